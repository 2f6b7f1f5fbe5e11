"""The model's keys (ModelConfig): architecture, MoE routing, MLA, rope, MTP, LoRA."""

from __future__ import annotations

import dataclasses
from typing import Literal

from trainer.config.keys import key


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture and how it is computed: shapes, routing, RoPE, MTP, dtypes, remat."""

    model_name: str = key("tagtrain-tiny", "preset the other keys start from (PRESETS)")
    # Start from a Hugging Face directory (trainer.hf, docs/hf.md): the architecture
    # from its config.json (explicit keys still win), the initial weights from its
    # safetensors, the tokenizer from its tokenizer.json unless tokenizer_path is set.
    # A restarted run resumes from its own checkpoints, never from these weights.
    hf_model_path: str = key(
        "", "Hugging Face directory: architecture, initial weights, tokenizer (docs/hf.md)"
    )
    # NaN/Inf in a tensor of hf_model_path is refused naming file and tensor (a
    # corrupt download would otherwise train silently on NaN); false skips the check.
    hf_check_finite: bool = key(True, "refuse NaN/Inf in hf_model_path's tensors (false: skip)")
    # MLA's q and kv latent norms: < 0 uses normalization_layer_epsilon (MaxText's one
    # epsilon); transformers and DeepSeek's code fix them at 1e-6 whatever
    # rms_norm_eps says, so a Hugging Face import sets 1e-6 (Moonlight: 1e-5 elsewhere).
    latent_norm_epsilon: float = key(
        -1.0, "RMSNorm epsilon of MLA's q/kv latent norms (< 0: normalization_layer_epsilon)"
    )
    vocab_size: int = key(256, "vocabulary size (embedding and output head rows)")
    base_emb_dim: int = key(64, "model width (embedding dimension)")
    base_num_decoder_layers: int = key(3, "decoder layers, dense ones included")
    first_num_dense_layers: int = key(1, "leading decoder layers with a dense MLP instead of MoE")
    base_mlp_dim: int = key(128, "hidden size of the dense layers' MLP")
    base_moe_mlp_dim: int = key(32, "hidden size of each expert's MLP")
    num_experts: int = key(8, "routed experts per MoE layer")
    num_experts_per_tok: int = key(2, "routed experts each token is sent to (top-k)")
    shared_experts: int = key(1, "always-on experts per MoE layer")
    n_routing_groups: int = key(2, "expert groups for group-limited routing")
    topk_routing_group: int = key(1, "groups a token may route into")
    routed_scaling_factor: float = key(1.0, "scale on the routed experts' combined output")
    routed_score_func: Literal["sigmoid", "softmax"] = key(
        "sigmoid", "router score function (HF scoring_func)"
    )
    # How experts are picked (HF topk_method): noaux_tc (DeepSeek-V3: a group scores
    # the sum of its two best biased scores), group_limited_greedy (DeepSeek-V2: a
    # group scores its best expert), greedy (plain top-k; n_routing_groups=1).
    # The routing bias steers the choice in every method; it stays 0 with
    # routed_bias_update_rate=0 (deepseek2-lite).
    routed_topk_method: Literal["noaux_tc", "group_limited_greedy", "greedy"] = key(
        "noaux_tc", "how experts are picked (HF topk_method)"
    )
    # Renormalize the chosen experts' combine weights to sum to one (before
    # routed_scaling_factor).
    norm_topk_prob: bool = key(True, "renormalize the chosen experts' combine weights")
    routed_bias_update_rate: float = key(
        0.001, "step of the aux-loss-free routing bias update per train step (0: bias stays 0)"
    )
    load_balance_loss_weight: float = key(0.0, "weight of the auxiliary load-balance loss")
    # ST-MoE's router z-loss under Megatron-Core's name (--moe-z-loss-coeff): each
    # MoE layer adds coeff x mean over tokens of logsumexp(router logits)^2 to the
    # loss; logged as learning/router_z_loss (the layers' mean, unscaled).
    moe_z_loss_coeff: float = key(
        0.0, "router z-loss coefficient (Megatron-Core's moe_z_loss_coeff; 0: off)"
    )
    sparse_matmul: bool = key(
        True,
        "experts as grouped (ragged) matmuls over sorted tokens; false: dense one-hot "
        "(compiled effect: benchmarks/results/perf_keys.md)",
    )
    # How the sparse path runs the experts' grouped matmuls (moe_kernels.grouped):
    # jax.lax.ragged_dot, which XLA:GPU rewrites into a dense matmul over every
    # expert; padded blocks of one expert each (batched matmuls, any backend); or
    # JAX's Mosaic-GPU grouped GEMM (Hopper, sm_90). auto: grouped_gemm on Hopper,
    # blocks on other GPUs, ragged_dot elsewhere; the startup line says which and why.
    grouped_matmul: Literal["auto", "ragged_dot", "padded_blocks", "grouped_gemm"] = key(
        "auto",
        "sparse experts' grouped matmul: ragged_dot, padded_blocks, grouped_gemm (Hopper), "
        "auto (grouped_gemm on Hopper, blocks on other GPUs)",
    )
    # 0 = never drop a token (all-to-all blocks sized for every assignment);
    # c > 0 caps each expert-parallel all-to-all block at c x its fair share, and
    # elsewhere (no expert parallelism, dense) each expert at c x its fair share of
    # a token shard's assignments; overflow is dropped and reported per layer
    # (moe/dropped_share). The startup line says what the cap is on the run's mesh.
    capacity_factor: float = key(
        0.0, "cap per expert (per all-to-all block with EP) in fair shares; overflow dropped"
    )
    base_num_query_heads: int = key(4, "attention heads")
    # The attention kernel (model/attention_kernel.py; MaxText's key, whose values
    # include dot_product and flash): dot_product materializes the (B, H, S, S)
    # scores in f32; cudnn_flash is cuDNN's fused attention (GPU, bf16, head dims
    # <= 128, sequence not sharded); splash is Pallas's TPU flash kernel (sequence a
    # multiple of 128, not sharded; on CPU devices by name, interpreted). auto: the
    # fused kernel where one applies.
    attention: Literal["auto", "dot_product", "cudnn_flash", "splash"] = key(
        "auto",
        "attention kernel: dot_product, cudnn_flash (GPU), splash (TPU), "
        "auto (a fused kernel where one applies)",
    )
    # > 0: queries through a low-rank bottleneck (wq_a, q_norm, wq_b; DeepSeek-V3);
    # 0: one plain query projection `wq` (DeepSeek-V2-Lite, HF q_lora_rank null).
    q_lora_rank: int = key(32, "query low-rank bottleneck (0: one plain query projection)")
    kv_lora_rank: int = key(32, "key/value latent (MLA compression) rank")
    qk_nope_head_dim: int = key(16, "per-head query/key dims without RoPE")
    qk_rope_head_dim: int = key(8, "per-head query/key dims with RoPE")
    v_head_dim: int = key(16, "per-head value dims")
    # RoPE (model/rope.py), MaxText's keys. rope_max_timescale is theta (HF rope_theta).
    rope_max_timescale: int = key(10_000, "RoPE theta (HF rope_theta)")
    # "default": plain RoPE; "yarn": YaRN (DeepSeek-V2/V3's rope_scaling), the keys below.
    rope_type: Literal["default", "yarn"] = key("default", "plain RoPE or YaRN")
    rope_factor: float = key(40.0, "YaRN context extension factor")
    original_max_position_embeddings: int = key(4096, "YaRN's pre-extension context")
    # The context YaRN extends to: with rope_type=yarn, max_target_length may not exceed it.
    max_position_embeddings: int = key(
        163_840, "YaRN's extended context: caps max_target_length under rope_type=yarn"
    )
    beta_fast: float = key(32.0, "YaRN ramp bound (fast)")
    beta_slow: float = key(1.0, "YaRN ramp bound (slow)")
    # m(s, k) = 0.1 k ln(s) + 1. Rotated q/k are scaled by m(rope_factor, mscale) /
    # m(rope_factor, mscale_all_dim); the softmax scale by m(rope_factor, mscale_all_dim)^2.
    # mscale_all_dim < 0: equal to mscale (MaxText's one-key meaning: q/k unscaled,
    # softmax times m(rope_factor, mscale)^2); HF's rope_scaling sets both.
    mscale: float = key(1.0, "YaRN attention scale exponent for rotated q/k")
    mscale_all_dim: float = key(-1.0, "YaRN softmax scale exponent (< 0: equal to mscale)")
    # Rotate interleaved pairs (2i, 2i+1), DeepSeek/HF's weight layout, instead of
    # half-split pairs (i, i+R/2): HF weights then load without a permutation.
    rope_interleave: bool = key(False, "rotate interleaved pairs (HF layout), not half-split")
    # Floor/ceil YaRN's ramp bounds (DeepSeek's and transformers' default).
    rope_truncate: bool = key(True, "floor/ceil YaRN's ramp bounds")
    # Also scale rotated q/k by m(rope_factor, 1) (MaxText's YaRN attention_scaling).
    rope_attention_scaling: bool = key(False, "also scale rotated q/k (MaxText's YaRN)")
    normalization_layer_epsilon: float = key(1e-6, "RMSNorm epsilon")
    dtype: Literal["float32", "bfloat16"] = key("bfloat16", "compute (activation) dtype")
    weight_dtype: Literal["float32", "bfloat16"] = key("float32", "parameter dtype")
    # Which activations each layer's backward recomputes (model/decoder.py REMAT):
    # none keeps them all, full saves nothing (jax.checkpoint nothing_saveable),
    # minimal saves the outputs of matmuls without batch dimensions; selective
    # saves what none saves but dot_product attention's (B, H, S, S) scores and
    # probabilities, which its backward recomputes (as cuDNN's fused kernel does).
    remat_policy: Literal["none", "full", "minimal", "selective"] = key(
        "none",
        "what each layer's backward recomputes: none, full (all), minimal (not matmuls), "
        "selective (dot_product attention's scores); "
        "memory, not collectives (benchmarks/results/perf_keys.md)",
    )
    # How the decoder layers run (model/decoder.py): one lax.scan (compile time
    # independent of depth; the fused and overlapped schedules work inside it) or an
    # unrolled loop over the same stacked parameters (checkpoints are alike). auto is
    # decided once, by run.resolve (config/layer_loop.py): unrolled on GPUs, where a
    # scanned layer launches about twice the kernels (docs/performance.md), scanned
    # elsewhere and wherever an overlapped schedule needs the scan.
    scan_layers: Literal["auto", True, False] = key(
        "auto",
        "decoder layers as one lax.scan (true) or unrolled (false); auto: unrolled on "
        "GPUs, scanned elsewhere (compiled effect: benchmarks/results/perf_keys.md; on one "
        "TPU v5e unrolled stepped faster and compiled slower: "
        "benchmarks/results/device_check_tpu_v5e.md)",
    )
    # Multi-token prediction (DeepSeek-V3 section 2.2), under MaxText's keys
    # (model/mtp.py): mtp_num_layers sequential depths after the main model, depth
    # k predicting the token k+1 ahead through its own block and the shared
    # embedding and output head; 0 = off. The loss adds mtp_loss_scaling_factor x
    # the mean over depths of each depth's cross-entropy (V3: 0.3, later 0.1).
    mtp_num_layers: int = key(0, "multi-token prediction depths (0: off)")
    mtp_loss_scaling_factor: float = key(0.1, "weight of the MTP loss")
    # LoRA (model/lora.py, docs/finetune.md#lora): lora_rank > 0 freezes every
    # parameter and trains low-rank adapters A, B on the lora_targets, each adapted
    # projection computing x W + lora_alpha / lora_rank x (x A) B; B starts at zero, so
    # step 0 is the base model. lora_targets: a comma list of parameter names (wq,
    # wq_a, wq_b, wkv_a, wkv_b, wo, mlp_wi_0, ..., expert_wi_0, ..., shared_wi_0, ...),
    # groups (attention, mlp, experts, shared_experts) and transformers' module names
    # as PEFT takes them (q_a_proj, kv_b_proj, gate_proj, ..., all-linear).
    # lora_alpha is PEFT's: default 8, scale lora_alpha / lora_rank. The routing
    # biases stay frozen under LoRA (every base tensor unchanged, so an adapter alone
    # reproduces the run) unless lora_update_routing_bias.
    lora_rank: int = key(0, "LoRA adapter rank (0: off, every parameter trained)")
    lora_alpha: float = key(
        8.0, "LoRA scale numerator (PEFT's lora_alpha): adapters add lora_alpha / lora_rank x A B"
    )
    lora_targets: str = key(
        "attention", "LoRA: adapted projections, names or groups (docs/finetune.md#lora)"
    )
    lora_update_routing_bias: bool = key(
        False, "LoRA: keep updating the routing biases (routed_bias_update_rate); off: frozen"
    )

    @property
    def emb_dim(self) -> int:
        """The model width (base_emb_dim)."""
        return self.base_emb_dim

    @property
    def num_moe_layers(self) -> int:
        """Decoder layers with an MoE MLP."""
        return self.base_num_decoder_layers - self.first_num_dense_layers

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key dims, RoPE and non-RoPE together."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim
