"""Parameter counts and the training-FLOPs formula behind the MFU estimate.

FLOPs per token (training) = 6 x active matmul parameters
                           + 6 x layers x S x H x (qk_head_dim + v_head_dim)
The first term is forward (2 FLOPs per multiply-add) plus backward (twice the
forward) over every weight a token touches: attention projections, the dense
MLPs, the router, the shared experts, its top-k routed experts, the logits.
The second is attention's score and value products at sequence length S,
counted without a causal discount (the PaLM convention). Embedding lookups
and norms are not matmuls and are left out. Multi-token prediction adds, per
depth, its 2d -> d projection, one block, the shared output head again, and
one more layer of attention products.

With LoRA (lora_rank > 0) no base weight's gradient is formed: the first term is
4 x the active matmul parameters, plus 2 x those of the adapted expert kernels (the
MoE layer merges their adapters and forms the kernel's gradient), plus 6 x the
adapter parameters a token multiplies through. The per-microbatch merge of the
experts' adapters (independent of the token count) is left out.
"""

from __future__ import annotations

import math

import jax

from trainer.config import DataConfig, ModelConfig, OutputConfig
from trainer.model.lora import resolve_targets

# Peak dense bf16 TFLOP/s per chip, by `device_kind` prefix.
PEAK_TFLOPS = {
    "TPU v5 lite": 197.0,
    "TPU v5e": 197.0,
    "TPU v5p": 459.0,
    "TPU v5": 459.0,
    "TPU v6": 918.0,
    "TPU v4": 275.0,
    "NVIDIA H100": 989.0,
    "NVIDIA H200": 989.0,
    "NVIDIA A100": 312.0,
}


def count_params(params) -> int:
    """Total number of parameter elements."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def _query_params(model: ModelConfig) -> int:
    """Query projection weights: the low-rank pair, or the plain wq (q_lora_rank=0)."""
    h = model.base_num_query_heads
    if not model.q_lora_rank:
        return model.emb_dim * h * model.qk_head_dim
    return model.emb_dim * model.q_lora_rank + model.q_lora_rank * h * model.qk_head_dim


def mtp_param_count(params) -> int:
    """Elements of the MTP depths' own parameters (the shared embedding and head
    are the main model's, counted there)."""
    return count_params(params.get("mtp", {})) if isinstance(params, dict) else 0


def _attention_params(model: ModelConfig) -> int:
    h = model.base_num_query_heads
    return (
        _query_params(model)
        + model.emb_dim * (model.kv_lora_rank + model.qk_rope_head_dim)
        + model.kv_lora_rank * h * (model.qk_nope_head_dim + model.v_head_dim)
        + h * model.v_head_dim * model.emb_dim
    )


def _moe_ffn_params(model: ModelConfig) -> int:
    """One MoE feed-forward's weights a token multiplies through: router, top-k
    routed experts, shared experts."""
    d = model.emb_dim
    return d * model.num_experts + 3 * d * model.base_moe_mlp_dim * (
        model.num_experts_per_tok + model.shared_experts
    )


def active_matmul_params(model: ModelConfig) -> int:
    """Weights one token multiplies through (routed experts: only its top-k)."""
    d = model.emb_dim
    dense_ffn = 3 * d * model.base_mlp_dim
    moe_ffn = _moe_ffn_params(model)
    layers = model.base_num_decoder_layers * _attention_params(model)
    layers += model.first_num_dense_layers * dense_ffn + model.num_moe_layers * moe_ffn
    # Each MTP depth: eh_proj, a block like the later layers, the shared head.
    mtp_block = _attention_params(model) + (moe_ffn if model.num_moe_layers else dense_ffn)
    mtp = model.mtp_num_layers * (2 * d * d + mtp_block + d * model.vocab_size)
    return layers + d * model.vocab_size + mtp


def _lora_projections(model: ModelConfig) -> dict[str, tuple[int, int, int, bool]]:
    """Per LoRA target: (in dim, out dim, uses per token, an expert kernel?)."""
    d, h = model.emb_dim, model.base_num_query_heads
    blocks = model.base_num_decoder_layers + model.mtp_num_layers
    moe_blocks = model.num_moe_layers + (model.mtp_num_layers if model.num_moe_layers else 0)
    dense_blocks = blocks - moe_blocks
    f, fs = model.base_moe_mlp_dim, model.shared_experts * model.base_moe_mlp_dim
    k = model.num_experts_per_tok
    return {
        "wq": (d, h * model.qk_head_dim, blocks, False),
        "wq_a": (d, model.q_lora_rank, blocks, False),
        "wq_b": (model.q_lora_rank, h * model.qk_head_dim, blocks, False),
        "wkv_a": (d, model.kv_lora_rank + model.qk_rope_head_dim, blocks, False),
        "wkv_b": (
            model.kv_lora_rank,
            h * (model.qk_nope_head_dim + model.v_head_dim),
            blocks,
            False,
        ),
        "wo": (h * model.v_head_dim, d, blocks, False),
        "mlp_wi_0": (d, model.base_mlp_dim, dense_blocks, False),
        "mlp_wi_1": (d, model.base_mlp_dim, dense_blocks, False),
        "mlp_wo": (model.base_mlp_dim, d, dense_blocks, False),
        "expert_wi_0": (d, f, k * moe_blocks, True),
        "expert_wi_1": (d, f, k * moe_blocks, True),
        "expert_wo": (f, d, k * moe_blocks, True),
        "shared_wi_0": (d, fs, moe_blocks, True),
        "shared_wi_1": (d, fs, moe_blocks, True),
        "shared_wo": (fs, d, moe_blocks, True),
    }


def lora_matmul_flops_per_token(model: ModelConfig) -> float:
    """The matmul term of the training FLOPs with LoRA (module docstring)."""
    shapes = _lora_projections(model)
    adapters = merged = 0
    for name in resolve_targets(model):
        n_in, n_out, uses, expert = shapes[name]
        adapters += uses * model.lora_rank * (n_in + n_out)
        merged += uses * n_in * n_out if expert else 0
    return 4.0 * active_matmul_params(model) + 2.0 * merged + 6.0 * adapters


def _attention_products(model: ModelConfig, data: DataConfig, layers: int) -> int:
    """Multiply-adds of `layers` layers' score and value products per token."""
    products = layers * data.max_target_length * model.base_num_query_heads
    return products * (model.qk_head_dim + model.v_head_dim)


def training_flops_per_token(model: ModelConfig, data: DataConfig) -> float:
    """The formula in the module docstring."""
    attention = _attention_products(
        model, data, model.base_num_decoder_layers + model.mtp_num_layers
    )
    if model.lora_rank:
        return lora_matmul_flops_per_token(model) + 6.0 * attention
    return 6.0 * active_matmul_params(model) + 6.0 * attention


def pipelined_flops_per_token(model: ModelConfig, data: DataConfig) -> float:
    """The part of `training_flops_per_token` the pipeline's stages split: the MoE
    layers' (attention and MoE feed-forward; no LoRA, which stages refuse)."""
    params = model.num_moe_layers * (_attention_params(model) + _moe_ffn_params(model))
    return 6.0 * params + 6.0 * _attention_products(model, data, model.num_moe_layers)


def peak_tflops(output: OutputConfig, device_kind: str) -> float | None:
    """Per-chip peak: the config's `device_peak_tflops` if set, else the table."""
    if output.device_peak_tflops > 0:
        return output.device_peak_tflops
    for prefix, value in PEAK_TFLOPS.items():
        if device_kind.startswith(prefix):
            return value
    return None
