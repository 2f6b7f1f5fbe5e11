"""PRESETS: model_name -> the keys it sets (the rest keep their defaults)."""

from __future__ import annotations

from typing import Any

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
    # f32 weights take 4 bytes a parameter and Adam's two moments (bf16, below) 4 more;
    # activations decide the rest. The 16 sequences a step trains run as ONE microbatch
    # (per_device_batch_size=16, gradient_accumulation_steps=1) rather than 8 x GA 2:
    # no f32 gradient accumulator (4 bytes a parameter) and no bf16 weight copy held
    # through a microbatch loop, which leaves room for twice the activations, and no
    # accumulation adds, the costliest non-matmul kernels of the GA=2 step (each reads
    # and writes the f32 accumulator of every parameter per microbatch). Both programs
    # and their predicted step times: benchmarks/results/gpu_estimate.md (h200 rows);
    # `train compile_topology=h200-1 model_name=deepseek3-h200` prints the memory and,
    # where it passes the 75% of HBM JAX's allocator takes by default, which
    # XLA_PYTHON_CLIENT_MEM_FRACTION holds it (the page's compiled GiB column: it passed
    # 75% until SwiGLU's gate saved only its inputs, moe_kernels.gated_silu).
    # remat_policy=selective recomputes dot_product attention's (B, H, S, S) scores in
    # the backward (a compile on a CPU host builds dot_product, having no cuDNN; on the
    # device cuDNN's fused kernel recomputes them itself, and selective then changes
    # nothing). Most parameters sit in 32 experts (top-4 plus 2 shared), so the routed
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
        remat_policy="selective",
        # AdamW's moments in bf16, as DeepSeek-V3 trains (its report, 3.3.2, "without
        # observable performance degradation"): half the optimizer state's bytes, read
        # and written every step. nu too: with adam_b2=0.95 (V3's), 1 - b2 = 0.05 is far
        # above the 2^-8 under which b2 x nu would round back to nu in bf16 and never
        # decay (trainer.config.validate refuses that); each update is computed in f32.
        mu_dtype="bfloat16",
        nu_dtype="bfloat16",
        per_device_batch_size=16,
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
