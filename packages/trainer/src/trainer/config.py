"""One typed config for model, parallelism and training, with presets and validation.

Key names follow MaxText where the concept is the same, so a MaxText user can
carry their overrides over (`per_device_batch_size`, `ici_fsdp_parallelism`, ...).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from typing import Any, Literal

from pspec_tags import MODES as SHARD_MODES

# The in-slice (ICI) axes, sized by ici_<axis>_parallelism.
ICI_AXES = ("data", "fsdp", "tensor", "tensor_transpose", "context", "expert")
# The cross-slice (DCN) axes, sized by dcn_<axis>_parallelism: each is its own mesh
# axis ("dcn_data" beside "data"), outermost, so one slice is a contiguous block of
# the mesh and a gradient can be unreduced over the slices while sharded inside one.
DCN_AXES = ("dcn_data", "dcn_fsdp")
MESH_AXES = DCN_AXES + ICI_AXES
# MaxText's other cross-slice keys (configs/base.yml), accepted so a MaxText command
# line parses, and held to 1: only the batch (dcn_data, dcn_fsdp) is split across
# slices here; tensor, expert or context parallelism across slices would put
# per-layer collectives on the slow DCN links.
OTHER_DCN_KEYS = tuple(
    f"dcn_{axis}_parallelism"
    for axis in (
        "fsdp_transpose",
        "sequence",
        "context",
        "context_autoregressive",
        "tensor",
        "tensor_transpose",
        "tensor_sequence",
        "pipeline",
        "expert",
        "autoregressive",
        "diloco",
    )
)
DTYPES = ("float32", "bfloat16")
ROPE_TYPES = ("default", "yarn")


class ConfigError(ValueError):
    """A bad configuration: the message names the offending key and value."""


def _key(default: Any, meaning: str) -> Any:
    """A config key's field: its default and its one-line meaning (docs/config.md)."""
    return dataclasses.field(default=default, metadata={"meaning": meaning})


# The keys come in groups, one dataclass each; Config inherits them all, so every key
# stays a flat attribute (and a flat MaxText name on the command line) while a module
# can take just the group it reads (`config.data` is a DataConfig). Each key is
# declared once, in its group, with its default and meaning.


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture and how it is computed: shapes, routing, RoPE, MTP, dtypes, remat."""

    model_name: str = _key("tagtrain-tiny", "preset the other keys start from (PRESETS)")
    # Start from a Hugging Face directory (trainer.hf, docs/hf.md): the architecture
    # from its config.json (explicit keys still win), the initial weights from its
    # safetensors, the tokenizer from its tokenizer.json unless tokenizer_path is set.
    # A restarted run resumes from its own checkpoints, never from these weights.
    hf_model_path: str = _key(
        "", "Hugging Face directory: architecture, initial weights, tokenizer (docs/hf.md)"
    )
    # NaN/Inf in a tensor of hf_model_path is refused naming file and tensor (a
    # corrupt download would otherwise train silently on NaN); false skips the check.
    hf_check_finite: bool = _key(True, "refuse NaN/Inf in hf_model_path's tensors (false: skip)")
    # MLA's q and kv latent norms: < 0 uses normalization_layer_epsilon (MaxText's one
    # epsilon); transformers and DeepSeek's code fix them at 1e-6 whatever
    # rms_norm_eps says, so a Hugging Face import sets 1e-6 (Moonlight: 1e-5 elsewhere).
    latent_norm_epsilon: float = _key(
        -1.0, "RMSNorm epsilon of MLA's q/kv latent norms (< 0: normalization_layer_epsilon)"
    )
    vocab_size: int = _key(256, "vocabulary size (embedding and output head rows)")
    base_emb_dim: int = _key(64, "model width (embedding dimension)")
    base_num_decoder_layers: int = _key(3, "decoder layers, dense ones included")
    first_num_dense_layers: int = _key(1, "leading decoder layers with a dense MLP instead of MoE")
    base_mlp_dim: int = _key(128, "hidden size of the dense layers' MLP")
    base_moe_mlp_dim: int = _key(32, "hidden size of each expert's MLP")
    num_experts: int = _key(8, "routed experts per MoE layer")
    num_experts_per_tok: int = _key(2, "routed experts each token is sent to (top-k)")
    shared_experts: int = _key(1, "always-on experts per MoE layer")
    n_routing_groups: int = _key(2, "expert groups for group-limited routing")
    topk_routing_group: int = _key(1, "groups a token may route into")
    routed_scaling_factor: float = _key(1.0, "scale on the routed experts' combined output")
    routed_score_func: Literal["sigmoid", "softmax"] = _key(
        "sigmoid", "router score function (HF scoring_func)"
    )
    # How experts are picked (HF topk_method): noaux_tc (DeepSeek-V3: a group scores
    # the sum of its two best biased scores), group_limited_greedy (DeepSeek-V2: a
    # group scores its best expert), greedy (plain top-k; n_routing_groups=1).
    # The routing bias steers the choice in every method; it stays 0 with
    # routed_bias_update_rate=0 (deepseek2-lite).
    routed_topk_method: Literal["noaux_tc", "group_limited_greedy", "greedy"] = _key(
        "noaux_tc", "how experts are picked (HF topk_method)"
    )
    # Renormalize the chosen experts' combine weights to sum to one (before
    # routed_scaling_factor).
    norm_topk_prob: bool = _key(True, "renormalize the chosen experts' combine weights")
    routed_bias_update_rate: float = _key(
        0.001, "step of the aux-loss-free routing bias update per train step (0: bias stays 0)"
    )
    load_balance_loss_weight: float = _key(0.0, "weight of the auxiliary load-balance loss")
    # ST-MoE's router z-loss under Megatron-Core's name (--moe-z-loss-coeff): each
    # MoE layer adds coeff x mean over tokens of logsumexp(router logits)^2 to the
    # loss; logged as learning/router_z_loss (the layers' mean, unscaled).
    moe_z_loss_coeff: float = _key(
        0.0, "router z-loss coefficient (Megatron-Core's moe_z_loss_coeff; 0: off)"
    )
    sparse_matmul: bool = _key(
        True,
        "experts as grouped (ragged) matmuls over sorted tokens; false: dense one-hot "
        "(compiled effect: benchmarks/results/perf_keys.md)",
    )
    # How the sparse path runs the experts' grouped matmuls (moe_kernels.grouped):
    # jax.lax.ragged_dot, which XLA:GPU rewrites into a dense matmul over every
    # expert, or padded blocks of one expert each (batched matmuls). auto: blocks
    # on GPU, ragged_dot elsewhere (benchmarks/results/device_check.md).
    grouped_matmul: Literal["auto", "ragged_dot", "padded_blocks"] = _key(
        "auto", "sparse experts' grouped matmul: ragged_dot, padded_blocks, auto (blocks on GPU)"
    )
    # 0 = never drop a token (all-to-all blocks sized for every assignment);
    # c > 0 caps each expert-parallel all-to-all block at c x its fair share, and
    # elsewhere (no expert parallelism, dense) each expert at c x its fair share of
    # a token shard's assignments; overflow is dropped and reported per layer
    # (moe/dropped_share). The startup line says what the cap is on the run's mesh.
    capacity_factor: float = _key(
        0.0, "cap per expert (per all-to-all block with EP) in fair shares; overflow dropped"
    )
    base_num_query_heads: int = _key(4, "attention heads")
    # The attention kernel (model/attention_kernel.py; MaxText's key, whose values
    # include dot_product and cudnn_flash_te): dot_product materializes the
    # (B, H, S, S) scores in f32; cudnn_flash is cuDNN's fused attention (GPU, bf16,
    # head dims <= 128, sequence not sharded). auto: cudnn_flash where it applies.
    attention: Literal["auto", "dot_product", "cudnn_flash"] = _key(
        "auto",
        "attention kernel: dot_product, cudnn_flash (GPU), auto (cudnn_flash where it applies)",
    )
    # > 0: queries through a low-rank bottleneck (wq_a, q_norm, wq_b; DeepSeek-V3);
    # 0: one plain query projection `wq` (DeepSeek-V2-Lite, HF q_lora_rank null).
    q_lora_rank: int = _key(32, "query low-rank bottleneck (0: one plain query projection)")
    kv_lora_rank: int = _key(32, "key/value latent (MLA compression) rank")
    qk_nope_head_dim: int = _key(16, "per-head query/key dims without RoPE")
    qk_rope_head_dim: int = _key(8, "per-head query/key dims with RoPE")
    v_head_dim: int = _key(16, "per-head value dims")
    # RoPE (model/rope.py), MaxText's keys. rope_max_timescale is theta (HF rope_theta).
    rope_max_timescale: int = _key(10_000, "RoPE theta (HF rope_theta)")
    # "default": plain RoPE; "yarn": YaRN (DeepSeek-V2/V3's rope_scaling), the keys below.
    rope_type: Literal["default", "yarn"] = _key("default", "plain RoPE or YaRN")
    rope_factor: float = _key(40.0, "YaRN context extension factor")
    original_max_position_embeddings: int = _key(4096, "YaRN's pre-extension context")
    # The context YaRN extends to: with rope_type=yarn, max_target_length may not exceed it.
    max_position_embeddings: int = _key(
        163_840, "YaRN's extended context: caps max_target_length under rope_type=yarn"
    )
    beta_fast: float = _key(32.0, "YaRN ramp bound (fast)")
    beta_slow: float = _key(1.0, "YaRN ramp bound (slow)")
    # m(s, k) = 0.1 k ln(s) + 1. Rotated q/k are scaled by m(rope_factor, mscale) /
    # m(rope_factor, mscale_all_dim); the softmax scale by m(rope_factor, mscale_all_dim)^2.
    # mscale_all_dim < 0: equal to mscale (MaxText's one-key meaning: q/k unscaled,
    # softmax times m(rope_factor, mscale)^2); HF's rope_scaling sets both.
    mscale: float = _key(1.0, "YaRN attention scale exponent for rotated q/k")
    mscale_all_dim: float = _key(-1.0, "YaRN softmax scale exponent (< 0: equal to mscale)")
    # Rotate interleaved pairs (2i, 2i+1), DeepSeek/HF's weight layout, instead of
    # half-split pairs (i, i+R/2): HF weights then load without a permutation.
    rope_interleave: bool = _key(False, "rotate interleaved pairs (HF layout), not half-split")
    # Floor/ceil YaRN's ramp bounds (DeepSeek's and transformers' default).
    rope_truncate: bool = _key(True, "floor/ceil YaRN's ramp bounds")
    # Also scale rotated q/k by m(rope_factor, 1) (MaxText's YaRN attention_scaling).
    rope_attention_scaling: bool = _key(False, "also scale rotated q/k (MaxText's YaRN)")
    normalization_layer_epsilon: float = _key(1e-6, "RMSNorm epsilon")
    dtype: Literal["float32", "bfloat16"] = _key("bfloat16", "compute (activation) dtype")
    weight_dtype: Literal["float32", "bfloat16"] = _key("float32", "parameter dtype")
    # Which activations each layer's backward recomputes (model/decoder.py REMAT):
    # none keeps them all, full saves nothing (jax.checkpoint nothing_saveable),
    # minimal saves the outputs of matmuls without batch dimensions.
    remat_policy: Literal["none", "full", "minimal"] = _key(
        "none",
        "what each layer's backward recomputes: none, full (all), minimal (not matmuls); "
        "memory, not collectives (benchmarks/results/perf_keys.md)",
    )
    scan_layers: bool = _key(
        True,
        "decoder layers as one lax.scan (fused accumulation needs it); false: unrolled "
        "(compiled effect: benchmarks/results/perf_keys.md)",
    )
    # Multi-token prediction (DeepSeek-V3 section 2.2), under MaxText's keys
    # (model/mtp.py): mtp_num_layers sequential depths after the main model, depth
    # k predicting the token k+1 ahead through its own block and the shared
    # embedding and output head; 0 = off. The loss adds mtp_loss_scaling_factor x
    # the mean over depths of each depth's cross-entropy (V3: 0.3, later 0.1).
    mtp_num_layers: int = _key(0, "multi-token prediction depths (0: off)")
    mtp_loss_scaling_factor: float = _key(0.1, "weight of the MTP loss")

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


@dataclasses.dataclass(frozen=True)
class ParallelismConfig:
    """Devices, the mesh, sharding, and how the program is compiled for them."""

    # Parallelism: -1 fills the devices left over (ici_: within a slice; dcn_: across
    # slices, filling num_slices). num_slices=-1: detected (1 on one slice or CPU; set
    # it to emulate slices on CPU devices, e.g. num_slices=2 on 8 devices = 2 x 4).
    num_slices: int = _key(-1, "slices (-1: detected; set it to emulate slices on CPU)")
    dcn_data_parallelism: int = _key(-1, "cross-slice data parallelism (-1: fills the slices)")
    dcn_fsdp_parallelism: int = _key(1, "cross-slice FSDP")
    # OTHER_DCN_KEYS: MaxText's names, accepted; anything but 1 stops before compiling.
    dcn_fsdp_transpose_parallelism: int = _key(1, "MaxText's; must be 1")
    dcn_sequence_parallelism: int = _key(1, "MaxText's; must be 1")
    dcn_context_parallelism: int = _key(1, "MaxText's; must be 1")
    dcn_context_autoregressive_parallelism: int = _key(1, "MaxText's; must be 1")
    dcn_tensor_parallelism: int = _key(1, "MaxText's; must be 1")
    dcn_tensor_transpose_parallelism: int = _key(1, "MaxText's; must be 1")
    dcn_tensor_sequence_parallelism: int = _key(1, "MaxText's; must be 1")
    dcn_pipeline_parallelism: int = _key(1, "MaxText's; must be 1")
    dcn_expert_parallelism: int = _key(1, "MaxText's; must be 1")
    dcn_autoregressive_parallelism: int = _key(1, "MaxText's; must be 1")
    dcn_diloco_parallelism: int = _key(1, "MaxText's; must be 1")
    ici_data_parallelism: int = _key(-1, "in-slice data parallelism (-1: fills the devices)")
    ici_fsdp_parallelism: int = _key(1, "in-slice FSDP (parameters sharded over 'fsdp')")
    ici_tensor_parallelism: int = _key(1, "in-slice tensor parallelism")
    ici_tensor_transpose_parallelism: int = _key(1, "in-slice transposed tensor parallelism")
    ici_context_parallelism: int = _key(1, "in-slice context (sequence) parallelism")
    ici_expert_parallelism: int = _key(1, "in-slice expert parallelism")
    expert_shard_attention_option: Literal["fsdp", "context"] = _key(
        "fsdp", "what the expert axis shards in attention layers"
    )
    shard_mode: Literal[SHARD_MODES] = _key(
        "explicit", "explicit sharding (tags, deferred reductions) or auto (GSPMD)"
    )
    shard_optimizer_over_data: bool = _key(
        False, "ZeRO-1: optimizer state and update sharded over the data axes"
    )
    # On TPU, compile with XLA's asynchronous all-reduce collective fusions and no
    # all-reduce combining (trainer/xla_options.py), so an all-reduce can be an async
    # start/done pair with compute scheduled between. Only all-reduces are touched:
    # reduce-scatters (ZeRO-1's) and overlapped_ring's collective-permutes compile
    # the same with it on and off. What it changes per topology and schedule (memory,
    # the async share of the gradient reductions), measured:
    # benchmarks/results/perf_keys.md and aot_async.md. Off by default. No effect on
    # CPU and GPU.
    tpu_async_collectives: bool = _key(
        False,
        "TPU: XLA options for uncombined, async all-reduces (what they change, measured: "
        "benchmarks/results/perf_keys.md)",
    )
    # The platform to run on, under MaxText's key: "" = JAX's default (an accelerator
    # where there is one), cpu (the CPU backend with --num_cpu_devices virtual
    # devices, even beside an accelerator), tpu, gpu (gpu_multiprocess: the same).
    hardware: Literal["", "cpu", "tpu", "gpu", "gpu_multiprocess"] = _key(
        "", "platform to run on ('': JAX's default)"
    )
    # Never join a process group (MaxText's key): one process even on a detected
    # cluster or with JAX_COORDINATOR_ADDRESS set (distributed.py).
    skip_jax_distributed_system: bool = _key(False, "never join a multi-process group")
    # AOT (aot.py): compile the step for a TPU or GPU topology on this host, do not train.
    compile_topology: str = _key(
        "", "AOT: compile for this TPU or GPU topology (e.g. v5e-8, h100-8), no training"
    )
    compile_topology_num_slices: int = _key(
        1, "AOT: slices (TPU) or hosts (GPU) of compile_topology"
    )

    def ici_parallelism(self) -> dict[str, int]:
        """Requested size per in-slice mesh axis (before -1 is filled)."""
        return {axis: getattr(self, f"ici_{axis}_parallelism") for axis in ICI_AXES}

    def dcn_parallelism(self) -> dict[str, int]:
        """Requested size per cross-slice mesh axis (before -1 is filled)."""
        return {
            axis: getattr(self, f"dcn_{axis.removeprefix('dcn_')}_parallelism") for axis in DCN_AXES
        }


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """The optimizer, its schedule, the step count and the seed."""

    steps: int = _key(10, "optimizer steps")
    learning_rate: float = _key(3e-3, "peak learning rate")
    warmup_steps_fraction: float = _key(0.1, "share of steps in linear warmup")
    cosine_final_lr_fraction: float = _key(0.1, "final learning rate / peak (cosine decay)")
    adam_b1: float = _key(0.9, "AdamW beta1")
    adam_b2: float = _key(0.95, "AdamW beta2")
    adam_eps: float = _key(1e-8, "AdamW epsilon")
    adam_weight_decay: float = _key(0.1, "AdamW weight decay")
    gradient_clipping_threshold: float = _key(1.0, "global gradient norm clip (<= 0: off)")
    seed: int = _key(0, "seed of the initial weights and the data order")


@dataclasses.dataclass(frozen=True)
class AccumulationConfig:
    """Microbatches and when, where and how each gradient is reduced."""

    gradient_accumulation_steps: int = _key(1, "microbatches per optimizer step")
    # When each gradient is reduced (accum.plan): deferred (once per step over every
    # batch axis), per_microbatch, or hierarchical (cross-slice axes once per step,
    # in-slice ones reduce-scattered per microbatch into sharded accumulators).
    # auto (the default): the policy accum.cost predicts fastest that fits in HBM
    # (trainer/reduction_choice.py).
    gradient_reduction_policy: Literal["auto", "deferred", "per_microbatch", "hierarchical"] = _key(
        "auto", "when each gradient is reduced (auto: the fastest that fits)"
    )
    # The chip whose figures (accum.hardware) auto's cost model uses: v4, v5e, v5p,
    # v6e, h100, h200. Empty: compile_topology's chip, else the devices' kind.
    reduction_hardware: str = _key("", "chip whose figures auto's cost model uses")
    # The gradient accumulator's dtype (the scan carry summing microbatches):
    # bfloat16 halves its memory and the bytes of the deferred reductions, which
    # reduce the accumulator; sums then differ from float32's by bf16 rounding.
    accum_dtype: Literal["float32", "bfloat16"] = _key(
        "float32",
        "gradient accumulator dtype: bfloat16 halves it and the bytes of its deferred "
        "reduction (benchmarks/results/perf_keys.md)",
    )
    # Print the reduction plan (parameter group x mesh axis -> when) at startup.
    print_reduction_plan: bool = _key(False, "print the reduction plan at startup")
    # Where each step adds up and reduces the gradients (accum/schedule.py; same numbers):
    # plain (add each microbatch's gradient after its backward), fused (the default: add
    # each layer's inside the backward layer scan, no full-size per-microbatch gradient;
    # no effect without scan_layers or with per_microbatch: accum.ReductionPlan.fused_applies;
    # benchmarks/results/aot_fused.md, fused_cpu.md), overlapped (fused, and the last
    # microbatch reduces each layer inside its backward, under the remaining layers'
    # compute where XLA runs those reductions asynchronously, which v5e does not for
    # ZeRO-1's reduce-scatters: perf_keys.md; needs scan_layers), overlapped_ring
    # (overlapped, reductions onto ZeRO-1 shards as rings of collective-permutes, which
    # XLA:TPU runs asynchronously with or without tpu_async_collectives where it keeps
    # reduce-scatters synchronous on v5e: perf_keys.md, aot_async.md; explicit mode,
    # not with per_microbatch).
    gradient_accumulation_schedule: Literal["plain", "fused", "overlapped", "overlapped_ring"] = (
        _key(
            "fused",
            "how microbatch gradients are added and reduced: plain, fused (no full-size "
            "per-microbatch gradient), overlapped (per-layer reductions in the last backward), "
            "overlapped_ring (those as async permute rings) (benchmarks/results/perf_keys.md)",
        )
    )


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The training data: what is read, how it is tokenized, batch and sequence size."""

    per_device_batch_size: float = _key(1.0, "sequences per device per microbatch")
    max_target_length: int = _key(32, "sequence length in tokens")
    # Data (input_pipeline.py, text_data.py, hf_data.py): synthetic; text: .txt/.jsonl
    # files (a directory or glob); hf: local parquet files. Byte tokens unless
    # tokenizer_path names a tokenizer.json.
    dataset_type: Literal["synthetic", "text", "hf"] = _key(
        "synthetic", "synthetic tokens, text (.txt/.jsonl) files, or hf (local parquet)"
    )
    dataset_path: str = _key("", "text: a directory or glob of .txt/.jsonl files")
    jsonl_field: str = _key("text", "text: the .jsonl field holding the document")
    tokenizer_path: str = _key("", "a tokenizer.json ('': byte tokens)")
    # dataset_type=hf, under MaxText's names: hf_train_files / hf_eval_files are parquet
    # files (a glob, a file, or a directory of *.parquet); train_data_columns /
    # eval_data_columns (empty: the train column) the one column read, `text` or
    # MaxText's `['text']`: text (tokenized with the run's tokenizer, end-of-document
    # appended) or token ids (a list of integers, taken as they are). hf_path: MaxText's
    # loader name, "parquet" or empty (no Hub streaming here).
    hf_path: str = _key("", "hf: MaxText's loader name, 'parquet' or empty (no Hub streaming)")
    hf_train_files: str = _key("", "hf: training parquet files (glob, file or directory)")
    hf_eval_files: str = _key("", "hf: evaluation parquet files (glob, file or directory)")
    train_data_columns: str = _key("text", "hf: the column read (text or token ids)")
    eval_data_columns: str = _key("", "hf: the eval column ('': train_data_columns)")


@dataclasses.dataclass(frozen=True)
class EvaluationConfig:
    """The held-out loss: how often, over what."""

    # Evaluation (eval_data.py, evaluate.py), under MaxText's names: a held-out loss
    # every eval_interval steps and at the end (<= 0: never), over the first eval_steps
    # batches of the eval set (<= 0: all of it, text and hf only) of
    # eval_per_device_batch_size sequences per device (0: per_device_batch_size). Text
    # runs read eval_dataset_path (MaxText names it per data type: grain_eval_files,
    # hf_eval_files), hf runs hf_eval_files; synthetic runs get a held-out stream drawn
    # from the same seed.
    eval_interval: int = _key(
        -1, "held-out loss every this many steps and at the end (<= 0: never)"
    )
    eval_steps: int = _key(-1, "eval batches per evaluation (<= 0: the whole eval set)")
    eval_per_device_batch_size: float = _key(0.0, "eval sequences per device (0: training's)")
    eval_dataset_path: str = _key("", "text: the eval files (directory or glob)")
    # mtp_eval_target_module=k > 0: evaluation reports depth k's top-1 acceptance.
    mtp_eval_target_module: int = _key(0, "report MTP depth k's top-1 acceptance (0: off)")


@dataclasses.dataclass(frozen=True)
class CheckpointingConfig:
    """Saving and restoring the training state, and starting from other weights."""

    # Checkpoints (checkpoint.py): on when base_output_directory is set; they go to
    # run_dir/checkpoints, every checkpoint_period steps (0: only at the end) and at
    # the end, async; a restart resumes from the newest complete one.
    enable_checkpointing: bool = _key(True, "save checkpoints (when base_output_directory is set)")
    async_checkpointing: bool = _key(True, "save in the background while training goes on")
    checkpoint_period: int = _key(100, "save every this many steps (0: only at the end)")
    max_checkpoints_to_keep: int = _key(3, "newest checkpoints kept")
    # Initial parameters (and routing biases) only, from another run's checkpoint:
    # its checkpoints directory (the newest step) or one step's directory (MaxText's key).
    load_parameters_path: str = _key("", "initial parameters from another run's checkpoint")


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    """Where a run writes, and what it logs, measures and profiles."""

    run_name: str = _key("", "run directory name ('': model_name)")
    base_output_directory: str = _key("", "parent of the run directory ('': outputs)")
    log_period: int = _key(
        1,
        "print a step line every this many steps (and the last); metrics.jsonl and "
        "TensorBoard still get every step",
    )
    device_peak_tflops: float = _key(0.0, "peak TFLOP/s per device for MFU (0: from the device)")
    # Metrics (metrics.py): JSONL and TensorBoard event files under run_dir.
    enable_tensorboard: bool = _key(True, "also write TensorBoard event files")
    # Profiling (profiling.py): jax.profiler traces under run_dir/tensorboard.
    profiler: Literal["", "xplane"] = _key("", "xplane: jax.profiler traces ('': off)")
    profiler_start_step: int = _key(2, "first profiled step")
    profiler_steps: int = _key(3, "profiled steps")


# Group name -> its dataclass, in the order docs/config.md lists them.
GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "parallelism": ParallelismConfig,
    "training": TrainingConfig,
    "accumulation": AccumulationConfig,
    "data": DataConfig,
    "evaluation": EvaluationConfig,
    "checkpointing": CheckpointingConfig,
    "output": OutputConfig,
}


Group = typing.TypeVar("Group")


class _GroupView(typing.Generic[Group]):
    """`config.<group>`: the config's keys of one group, as that group's dataclass.
    (A class attribute without an annotation: no dataclass field.)"""

    def __init__(self, group: type[Group]):
        self.group = group

    def __get__(self, config: Any, owner: type | None = None) -> Group:
        return self.group(
            **{f.name: getattr(config, f.name) for f in dataclasses.fields(self.group)}
        )


# Bases last to first: dataclass fields follow the reversed MRO, so keys keep the
# group order of GROUPS.
@dataclasses.dataclass(frozen=True)
class Config(
    OutputConfig,
    CheckpointingConfig,
    EvaluationConfig,
    DataConfig,
    AccumulationConfig,
    TrainingConfig,
    ParallelismConfig,
    ModelConfig,
):
    """Everything a run needs. Build with `make_config(overrides)`, never by hand.

    Every key is a flat attribute (`config.steps`); `config.<group>` (model,
    parallelism, training, accumulation, data, evaluation, checkpointing, output)
    is one group's keys as its own frozen dataclass, for a module that reads only those.
    """

    model = _GroupView(ModelConfig)
    parallelism = _GroupView(ParallelismConfig)
    training = _GroupView(TrainingConfig)
    accumulation = _GroupView(AccumulationConfig)
    data = _GroupView(DataConfig)
    evaluation = _GroupView(EvaluationConfig)
    checkpointing = _GroupView(CheckpointingConfig)
    output = _GroupView(OutputConfig)

    @property
    def run_dir(self) -> str:
        """base_output_directory/run_name: metrics, traces, checkpoints and HLO go here.

        Defaults: base_output_directory "outputs", run_name the model_name (the
        same on every process of a multi-host run, and again on a restart).
        """
        return os.path.join(
            self.base_output_directory or "outputs", self.run_name or self.model_name
        )


# MaxText's DeepSeek-V3 test shapes, under MaxText's names (configs/models/*.yml), so a
# command copied from MaxText trains the shape it names, with V3's YaRN as there.
# MaxText leaves routing groups off (-1) for both: one group here is the same routing.
# remat_policy is MaxText's default (base.yml: full), which these presets run with there.
_MAXTEXT_DEEPSEEK3 = dict(
    remat_policy="full",
    vocab_size=129_280,
    num_experts_per_tok=8,
    shared_experts=1,
    n_routing_groups=1,
    topk_routing_group=1,
    routed_scaling_factor=2.5,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_target_length=1024,
)

# DeepSeek-V2/V3's published rope_scaling (config.json): YaRN from 4k to 160k
# positions, theta 10000, rope dims stored as interleaved pairs.
_DEEPSEEK_YARN = dict(
    rope_type="yarn",
    rope_max_timescale=10_000,
    rope_factor=40.0,
    original_max_position_embeddings=4096,
    max_position_embeddings=163_840,
    beta_fast=32.0,
    beta_slow=1.0,
    rope_interleave=True,
    rope_truncate=True,
    rope_attention_scaling=False,
    normalization_layer_epsilon=1e-6,
)

PRESETS: dict[str, dict[str, Any]] = {
    # Seconds per step on 8 CPU devices: every shape tiny, every feature on.
    # The small presets carry tagtrain's own names: MaxText's deepseek3-tiny is another shape.
    "tagtrain-tiny": {},
    # A few times the tiny shape: AOT compiles and CPU benchmarks.
    "tagtrain-test": dict(
        vocab_size=1024,
        base_emb_dim=256,
        base_num_decoder_layers=4,
        base_mlp_dim=512,
        base_moe_mlp_dim=128,
        num_experts=16,
        num_experts_per_tok=4,
        n_routing_groups=4,
        topk_routing_group=2,
        base_num_query_heads=8,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        max_target_length=128,
    ),
    # 763.5M parameters (flops.count_params): fits one accelerator with 24+ GiB.
    "deepseek3-small": dict(
        vocab_size=32_768,
        base_emb_dim=1024,
        base_num_decoder_layers=24,
        first_num_dense_layers=1,
        base_mlp_dim=4096,
        base_moe_mlp_dim=512,
        num_experts=16,
        num_experts_per_tok=2,
        n_routing_groups=4,
        topk_routing_group=2,
        base_num_query_heads=16,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        max_target_length=1024,
        routed_scaling_factor=2.5,
    ),
    # Sized to fill one H200 (141 GB): about 5.0B parameters, 1.2B active per token.
    # f32 weights, Adam's two moments and the f32 gradient accumulator take 16 bytes a
    # parameter (~86 GB), leaving the rest for activations at per_device_batch_size 2
    # (`train compile_topology=h200-1 model_name=deepseek3-h200 per_device_batch_size=2
    # gradient_accumulation_steps=16` compiles it for one H200 from a CPU host).
    # Most parameters sit in 32 experts (top-4 plus 2 shared), so the routed
    # matmuls are large enough to keep the GPU's matrix units busy; head dims of at
    # most 128 (96 + 32 for queries and keys, 128 for values) keep cuDNN's fused
    # attention available.
    "deepseek3-h200": dict(
        vocab_size=32_768,
        base_emb_dim=2048,
        base_num_decoder_layers=24,
        first_num_dense_layers=1,
        base_mlp_dim=8192,
        base_moe_mlp_dim=1024,
        num_experts=32,
        num_experts_per_tok=4,
        shared_experts=2,
        n_routing_groups=4,
        topk_routing_group=2,
        base_num_query_heads=16,
        q_lora_rank=768,
        kv_lora_rank=512,
        qk_nope_head_dim=96,
        qk_rope_head_dim=32,
        v_head_dim=128,
        max_target_length=1024,
        routed_scaling_factor=2.5,
    ),
    # MaxText's deepseek3-tiny: 61 layers (3 dense) of emb 64, 16 experts top-8.
    "deepseek3-tiny": dict(
        _MAXTEXT_DEEPSEEK3,
        **_DEEPSEEK_YARN,
        base_emb_dim=64,
        base_num_decoder_layers=61,
        first_num_dense_layers=3,
        base_mlp_dim=64,
        base_moe_mlp_dim=64,
        num_experts=16,
        base_num_query_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
    ),
    # MaxText's deepseek3-test: one MoE layer of the full DeepSeek-V3 width.
    "deepseek3-test": dict(
        _MAXTEXT_DEEPSEEK3,
        **_DEEPSEEK_YARN,
        base_emb_dim=7168,
        base_num_decoder_layers=1,
        first_num_dense_layers=0,
        base_mlp_dim=2048,
        base_moe_mlp_dim=2048,
        num_experts=256,
        base_num_query_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
    ),
    # DeepSeek-V3 (671B total, 37B active) with its published config.json values
    # (YaRN rope_scaling, interleaved rope weights, noaux_tc sigmoid routing): AOT compiles.
    "deepseek3-671b": dict(
        _DEEPSEEK_YARN,
        mscale=1.0,
        mscale_all_dim=1.0,
        routed_score_func="sigmoid",
        routed_topk_method="noaux_tc",
        norm_topk_prob=True,
        vocab_size=129_280,
        base_emb_dim=7168,
        base_num_decoder_layers=61,
        first_num_dense_layers=3,
        base_mlp_dim=18_432,
        base_moe_mlp_dim=2048,
        num_experts=256,
        num_experts_per_tok=8,
        shared_experts=1,
        n_routing_groups=8,
        topk_routing_group=4,
        routed_scaling_factor=2.5,
        base_num_query_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_target_length=4096,
        remat_policy="full",
    ),
    # DeepSeek-V2-Lite (15.7B total, 2.4B active) with its published config.json
    # values: no q LoRA, softmax greedy routing without renormalization, no routing
    # bias (V2 has none: the bias is kept at 0), untied embeddings.
    "deepseek2-lite": dict(
        _DEEPSEEK_YARN,
        mscale=0.707,
        mscale_all_dim=0.707,
        vocab_size=102_400,
        base_emb_dim=2048,
        base_num_decoder_layers=27,
        first_num_dense_layers=1,
        base_mlp_dim=10_944,
        base_moe_mlp_dim=1408,
        num_experts=64,
        num_experts_per_tok=6,
        shared_experts=2,
        n_routing_groups=1,
        topk_routing_group=1,
        routed_scaling_factor=1.0,
        routed_score_func="softmax",
        routed_topk_method="greedy",
        norm_topk_prob=False,
        routed_bias_update_rate=0.0,
        base_num_query_heads=16,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_target_length=4096,
        remat_policy="full",
    ),
}
# MaxText's name for DeepSeek-V2-Lite (configs/models/deepseek2-16b.yml), so its commands run.
PRESETS["deepseek2-16b"] = PRESETS["deepseek2-lite"]

FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _field_type(name: str) -> Any:
    return typing.get_type_hints(Config)[name]


def _parse_value(key: str, raw: Any) -> Any:
    """Convert `raw` (a string from the command line, or a value) to the key's type."""
    hint = _field_type(key)
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if raw not in choices:
            raise ConfigError(f"{key}={raw!r} is not one of {choices}")
        return raw
    if isinstance(hint, types.UnionType):
        hint = str
    if hint is bool:
        return _parse_bool(key, raw)
    if hint is int:
        if isinstance(raw, bool):
            raise ConfigError(f"{key}={raw!r} is not an integer")
        try:
            value = float(raw) if isinstance(raw, str) else raw
        except ValueError:
            raise ConfigError(f"{key}={raw!r} is not an integer") from None
        if not isinstance(value, int | float) or value != int(value):
            raise ConfigError(f"{key}={raw!r} is not an integer")
        return int(value)
    if hint is float:
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={raw!r} is not a number") from None
    return str(raw)


def _parse_bool(key: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    lowered = str(raw).lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ConfigError(f"{key}={raw!r} is not a boolean (true/false)")


def parse_overrides(args: list[str]) -> dict[str, str]:
    """`['key=value', ...]` -> dict, rejecting anything not of that form."""
    out: dict[str, str] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {arg!r} is not of the form key=value")
        out[key.strip()] = value.strip()
    return out


def _check_known(keys: list[str]) -> None:
    for key in keys:
        if key not in FIELDS:
            close = difflib.get_close_matches(key, FIELDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}")


# Removed boolean keys: their combination is now one value of
# gradient_accumulation_schedule, defer_gradient_reduction one of gradient_reduction_policy.
SCHEDULE_FLAGS = (
    "fused_gradient_accumulation",
    "overlap_gradient_reduction",
    "ring_reduce_scatter",
)
REPLACED_KEYS = (*SCHEDULE_FLAGS, "defer_gradient_reduction")


def _replacement(overrides: dict[str, Any]) -> str:
    """The `key=value` words that say what the removed keys in `overrides` said."""
    flag = lambda key, default: _parse_bool(key, overrides.get(key, default))  # noqa: E731
    words = []
    if set(SCHEDULE_FLAGS) & set(overrides):
        if flag("ring_reduce_scatter", False):
            schedule = "overlapped_ring"
        elif flag("overlap_gradient_reduction", False):
            schedule = "overlapped"
        else:
            schedule = "fused" if flag("fused_gradient_accumulation", True) else "plain"
        words.append(f"gradient_accumulation_schedule={schedule}")
    if "defer_gradient_reduction" in overrides:
        policy = "deferred" if flag("defer_gradient_reduction", True) else "per_microbatch"
        words.append(f"gradient_reduction_policy={policy}")
    return " ".join(words)


def _check_replaced(overrides: dict[str, Any]) -> None:
    """ConfigError naming the removed keys given and what to write instead.

    >>> make_config({"overlap_gradient_reduction": "true", "ring_reduce_scatter": "true"})
    Traceback (most recent call last):
    ...
    trainer.config.ConfigError: ... write gradient_accumulation_schedule=overlapped_ring instead
    """
    old = [k for k in overrides if k in REPLACED_KEYS]
    if old:
        raise ConfigError(f"{', '.join(old)} removed: write {_replacement(overrides)} instead")


def make_config(overrides: dict[str, Any] | None = None) -> Config:
    """Preset for `model_name` (default tagtrain-tiny) + `overrides`, type-checked.

    Only structural checks happen here; `validate(config, num_devices)` checks
    what depends on the machine (mesh, batch sizes).

    >>> from trainer.config import make_config, parse_overrides
    >>> overrides = parse_overrides(["ici_fsdp_parallelism=4", "gradient_accumulation_steps=4"])
    >>> config = make_config(overrides)
    >>> config.model_name, config.ici_fsdp_parallelism, config.gradient_accumulation_steps
    ('tagtrain-tiny', 4, 4)
    >>> make_config({"gradient_accumulaton_steps": "4"})
    Traceback (most recent call last):
    ...
    trainer.config.ConfigError: unknown config key ...; did you mean 'gradient_accumulation_steps'?
    """
    overrides = dict(overrides or {})
    _check_replaced(overrides)
    _check_known(list(overrides))
    model_name = overrides.get("model_name", Config.model_name)
    if model_name not in PRESETS:
        raise ConfigError(f"model_name={model_name!r} is not one of {sorted(PRESETS)}")
    values = dict(PRESETS[model_name])
    if overrides.get("hf_model_path"):
        # Imported here: trainer.hf imports this module.
        from trainer.hf.config_map import trainer_keys_of_directory

        text = overrides.get("dataset_type", values.get("dataset_type")) not in (None, "synthetic")
        values.update(trainer_keys_of_directory(str(overrides["hf_model_path"]), text))
    values.update(overrides)
    return Config(**{key: _parse_value(key, raw) for key, raw in values.items()})


def _fill(sizes: dict[str, int], total: int, prefix: str, what: str) -> dict[str, int]:
    """`sizes` with the (single) -1 entry filling `total`; ConfigError naming the keys."""
    key = lambda axis: f"{prefix}{axis.removeprefix('dcn_')}_parallelism"  # noqa: E731
    fill = [axis for axis, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ConfigError(
            f"only one {prefix}*_parallelism may be -1; got -1 for "
            + ", ".join(key(a) for a in fill)
        )
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"{key(axis)}={size} must be a positive size or -1")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if total % fixed:
            raise ConfigError(
                f"{key(fill[0])}=-1 cannot fill {total} {what}: the other "
                f"axes multiply to {fixed}, which does not divide {total}"
            )
        sizes[fill[0]] = total // fixed
    product = math.prod(sizes.values())
    if product != total:
        listing = ", ".join(f"{key(a)}={s}" for a, s in sizes.items() if s != 1)
        raise ConfigError(
            f"the {prefix}*_parallelism keys multiply to {product} ({listing or 'all 1'}) but "
            f"there are {total} {what}: change them so their product is {total}, or set "
            "one of them to -1 to fill the " + what
        )
    return sizes


def _check_other_dcn_keys(parallelism: ParallelismConfig) -> None:
    """ConfigError naming the first of OTHER_DCN_KEYS not left at 1."""
    for key in OTHER_DCN_KEYS:
        value = getattr(parallelism, key)
        if value != 1:
            raise ConfigError(
                f"{key}={value} is not supported: only dcn_data_parallelism and "
                "dcn_fsdp_parallelism cross slices here (cross-slice tensor, expert or "
                "context parallelism would put per-layer collectives on DCN); set it to 1"
            )


def mesh_shape(
    parallelism: ParallelismConfig, num_devices: int, num_slices: int = 1
) -> dict[str, int]:
    """Mesh axis sizes (MESH_AXES order): the dcn_ axes fill `num_slices`, the ici_
    axes the devices of one slice; a -1 fills what the others leave. MaxText's other
    dcn_ keys (OTHER_DCN_KEYS) must be 1. (A whole Config is a ParallelismConfig too.)"""
    _check_other_dcn_keys(parallelism)
    if num_slices < 1 or num_devices % num_slices:
        raise ConfigError(
            f"num_slices={num_slices} does not divide the {num_devices} devices into equal slices"
        )
    dcn = _fill(parallelism.dcn_parallelism(), num_slices, "dcn_", "slices")
    per_slice = "devices" if num_slices == 1 else "devices per slice"
    ici = _fill(parallelism.ici_parallelism(), num_devices // num_slices, "ici_", per_slice)
    return {**dcn, **ici}
