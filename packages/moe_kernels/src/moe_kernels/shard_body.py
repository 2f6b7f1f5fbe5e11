"""One shard's MoE layer, the body of `sparse_moe`'s and `dense_moe`'s shard_map:
route, the routed experts (sparse: grouped matmuls, with expert parallelism; dense:
every token through every expert), the shared experts, per-shard statistics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from moe_kernels import dispatch, gemm_mgpu, lora
from moe_kernels.activation import gated_silu
from moe_kernels.config import MoEConfig
from moe_kernels.grouped import choose as choose_grouped
from moe_kernels.params import EXPERT_PARAMS, SHARED_PARAMS
from moe_kernels.routing import route
from moe_kernels.shard_plan import ShardPlan
from pspec_tags import entry_axes, entry_from_axes, partitions


def _precision(config: MoEConfig):
    return None if config.precision is None else lax.Precision[config.precision.upper()]


def _gather(w: jax.Array, spec: P, skip_dims: tuple[int, ...] = ()) -> jax.Array:
    """All-gather a per-shard weight along every sharded dim (except `skip_dims`).

    `partitions` reads the entries through the tag (a tagged spec refuses
    iteration). The gather's transpose reduce-scatters the cotangent over the
    gathered (token) axes, which is the FSDP gradient reduction; axes in the
    spec's `reduced` set are left alone, so their reduction stays deferred.
    """
    for dim, entry in enumerate(partitions(spec)):
        axes = entry_axes(entry)
        if dim in skip_dims or not axes:
            continue
        w = lax.all_gather(w, entry_from_axes(axes), axis=dim, tiled=True)
    return w


def _swiglu_dense(x_TxD, wi0_DxF, wi1_DxF, wo_FxD, precision):
    h0 = jnp.dot(x_TxD, wi0_DxF, precision=precision)
    h1 = jnp.dot(x_TxD, wi1_DxF, precision=precision)
    return jnp.dot(gated_silu(h0, h1), wo_FxD, precision=precision)


def layer_body(x_BxSxD, params, *, config: MoEConfig, plan: ShardPlan | None, sparse: bool, device):
    """One shard's MoE: route, routed experts (sparse or dense), shared experts.
    `device`: one the program is built for (its platform picks the grouped matmul)."""
    precision = _precision(config)
    b, s, d = x_BxSxD.shape
    # The grouped matmul's implementation for the device the program is built for.
    impl, _ = choose_grouped(config.grouped_matmul, device, x_BxSxD.dtype, (d, config.mlp_dim))
    sms = getattr(device, "core_count", None) or gemm_mgpu.H100_SMS
    grouped = {"impl": impl, "precision": precision, "sms": sms}
    specs = plan.specs if plan is not None else {}
    ep = plan.ep if plan is not None else 1

    def gathered(name, skip=()):
        w = params[name]
        if name in specs:
            w = _gather(w, specs[name], skip)
        return w

    def kernel(name, skip=()):
        """A kernel as the layer uses it: W, or merged with its LoRA factors (moe_kernels.lora)."""
        w = gathered(name, skip)
        if name + lora.SUFFIXES[0] not in params:
            return w
        a, b = (
            lora.as_varying(gathered(name + s, skip), specs.get(name + s)) for s in lora.SUFFIXES
        )
        return lora.merged(w, a, b, config.lora_scale, precision)

    k, e = config.num_experts_per_tok, config.num_experts
    x_TxD = x_BxSxD.reshape(b * s, d)
    # Router in f32 (as DeepSeek-V3 does): top-k choices are sensitive to rounding.
    logits_BxSxE = jnp.dot(
        x_TxD.astype(jnp.float32), gathered("gate").astype(jnp.float32), precision=precision
    ).reshape(b, s, e)
    bias = gathered("bias") if "bias" in params else None
    weights_BxSxZ, ids_BxSxZ, stats = route(logits_BxSxE, config=config, bias=bias)
    weights_TxZ = weights_BxSxZ.reshape(b * s, k)
    ids_A = ids_BxSxZ.reshape(-1)

    dtype = x_BxSxD.dtype
    # A positive capacity_factor off the all-to-all path: each expert keeps the
    # first ceil(T*Z/E * cf) of this shard's assignments (None: no cap, no code).
    a2a = sparse and plan is not None and plan.a2a
    cap = None if a2a else dispatch.local_capacity(config, ids_A.shape[0])
    keep_A = None if cap is None else dispatch.within_capacity(ids_A, e, cap)
    if sparse:
        # Expert kernels keep their expert dim sharded (dim 0 is not gathered).
        kernels = tuple(kernel(n, skip=(0,)).astype(dtype) for n in EXPERT_PARAMS)
        e_local = e // ep
        if a2a:
            cap = dispatch.block_capacity(config, ids_A.shape[0], ep)
            routed_TxD, dropped = dispatch.routed_all_to_all(
                x_TxD, ids_A, weights_TxZ, kernels, ep, plan.expert_axis, e_local, cap, grouped
            )
        else:
            vary = None if ep == 1 else plan.expert_axis
            start = 0 if ep == 1 else lax.axis_index(plan.expert_axis) * e_local
            routed_TxD, dropped = dispatch.routed_local(
                x_TxD, ids_A, weights_TxZ, kernels, start, e_local, grouped, vary, keep_A
            )
        if ep > 1 and not a2a:
            # Tokens are replicated over the expert axis; each shard ran its own
            # experts, so the routed output is the sum over that axis.
            routed_TxD = lax.psum(routed_TxD, plan.expert_axis)
    else:
        wi0, wi1, wo = (kernel(n).astype(dtype) for n in EXPERT_PARAMS)
        h0 = jnp.einsum("td,edf->tef", x_TxD, wi0, precision=precision)
        h1 = jnp.einsum("td,edf->tef", x_TxD, wi1, precision=precision)
        out_TxExD = jnp.einsum("tef,efd->ted", gated_silu(h0, h1), wo, precision=precision)
        dropped = jnp.zeros((), jnp.int32)
        if keep_A is not None:
            # The same cap as the sparse local path: a dropped assignment combines with 0.
            weights_TxZ = weights_TxZ * keep_A.reshape(b * s, k)
            dropped = jnp.sum(~keep_A).astype(jnp.int32)
        combine_TxE = jnp.einsum(
            "tke,tk->te", jax.nn.one_hot(ids_A.reshape(b * s, k), e), weights_TxZ
        )
        routed_TxD = jnp.einsum("ted,te->td", out_TxExD.astype(jnp.float32), combine_TxE)
    y_TxD = routed_TxD.astype(dtype)
    if config.shared_dim:
        shared = tuple(kernel(n).astype(dtype) for n in SHARED_PARAMS)
        y_TxD = y_TxD + _swiglu_dense(x_TxD, *shared, precision)
    shard_stats = {
        "tokens_per_expert": stats["tokens_per_expert"][None],
        "balance_loss": stats["balance_loss"][None],
        "dropped": dropped[None],
    }
    if config.router_z_loss:
        shard_stats["router_z_BxS"] = dispatch.router_z_BxS(logits_BxSxE)
    return y_TxD.reshape(b, s, d), shard_stats
