"""`sparse_moe` and `dense_moe`: one MoE layer in a shard_map that keeps sharding tags.

Both paths run per shard inside `jax.shard_map` over the whole mesh and share
the routing and the shared-expert MLP; they differ in how routed experts run:

- sparse: assignments sorted by expert, `jax.lax.ragged_dot` grouped matmuls for
  the SwiGLU pair and the output kernel, unsort and weighted combine. With
  expert parallelism (the `expert` mesh axis shards experts and tokens) the
  sorted rows travel to the shard that owns their expert with a padded
  `all_to_all` and come back the same way (XLA:CPU has no ragged-all-to-all).
  When the expert axis does not shard the tokens (e.g. the batch does not
  divide), each expert shard runs its own experts on all local tokens and the
  outputs are summed over the expert axis.
- dense (reference): every token through every expert (einsum), combined with
  a (tokens x experts) weight matrix that is zero off the chosen experts.

Tags: under explicit sharding a parameter resharded to `reduced={'data'}` by
gradient accumulation must enter the shard_map with that tag in its in_spec,
or shard_map (all mesh axes manual) psums its cotangent over `data` inside the
body: once per microbatch and per layer instead of once per step. The in_specs
here are rebuilt from logical rules (untagged by construction) and then pass
through `carry_reduced_axes`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from moe_kernels import dispatch, lora
from moe_kernels.config import DEFAULT_RULES, MoEConfig, fitting_expert_counts
from moe_kernels.grouped import resolve as resolve_grouped
from moe_kernels.routing import route
from pspec_tags import (
    MODES,
    carry_reduced_axes,
    entry_axes,
    entry_from_axes,
    fit_to_shape,
    logical_to_spec,
    mesh_axes_used,
    partitions,
    shard,
    spec_of,
    truncate,
    untagged,
)

EXPERT_PARAMS = ("wi_0", "wi_1", "wo")
SHARED_PARAMS = ("shared_wi_0", "shared_wi_1", "shared_wo")

Params = Mapping[str, jax.Array]


# ----------------------------------------------------------------------------
# Parameters


def param_shapes(config: MoEConfig, embed_dim: int) -> dict[str, tuple[int, ...]]:
    """Shapes of every parameter of one layer (shared experts only when configured)."""
    e, d, f = config.num_experts, embed_dim, config.mlp_dim
    shapes = {
        "gate": (d, e),
        "bias": (e,),
        "wi_0": (e, d, f),
        "wi_1": (e, d, f),
        "wo": (e, f, d),
    }
    if config.shared_dim:
        fs = config.shared_dim
        shapes.update(shared_wi_0=(d, fs), shared_wi_1=(d, fs), shared_wo=(fs, d))
    return shapes


def init_params(
    key: jax.Array, config: MoEConfig, embed_dim: int, dtype: Any = jnp.float32
) -> dict[str, jax.Array]:
    """Unsharded parameters: fan-in scaled normals, zero routing bias."""
    shapes = param_shapes(config, embed_dim)
    keys = dict(zip(shapes, jax.random.split(key, len(shapes)), strict=True))
    params = {}
    for name, shape in shapes.items():
        if name == "bias":
            params[name] = jnp.zeros(shape, dtype)
            continue
        fan_in = shape[-2]
        params[name] = (jax.random.normal(keys[name], shape) / math.sqrt(fan_in)).astype(dtype)
    return params


def param_specs(
    config: MoEConfig,
    rules: Any,
    mesh: Any,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, P]:
    """Untagged specs of every parameter from `config.param_axes` and logical `rules`.

    With `shapes`, each spec is fitted to its shape (axes that don't divide a
    dimension are dropped), except that an expert dim sharded over the expert
    axis must divide: `num_experts` not divisible by it raises ValueError.
    Use them to place parameters; `sparse_moe` derives the same specs.
    """
    names = shapes if shapes is not None else config.logical_axes
    specs = {}
    for name in names:
        spec = logical_to_spec(lora.logical_axes_of(config, name), rules, mesh)
        if shapes is not None:
            if lora.base_name(name) in EXPERT_PARAMS:
                _check_expert_dim(spec, shapes[name][0], config, mesh)
            spec = fit_to_shape(spec, shapes[name], mesh)
        specs[name] = spec
    return specs


def _check_expert_dim(spec: P, num_experts: int, config: MoEConfig, mesh: Any) -> None:
    entry = partitions(spec)[0] if partitions(spec) else None
    axes = entry_axes(entry)
    if not axes:
        return
    if axes != (config.expert_axis,):
        raise ValueError(
            f"the expert dim of the expert kernels is sharded over {axes}; only the expert "
            f"axis {config.expert_axis!r} may shard it (check the rule for "
            f"{config.logical_axes['wi_0'][0]!r})"
        )
    size = dict(mesh.shape)[config.expert_axis]
    if num_experts % size:
        fits = ", ".join(map(str, fitting_expert_counts(num_experts, size)))
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the size {size} of the mesh axis "
            f"{config.expert_axis!r} that shards the experts; nearest that fit: {fits}"
        )


def _check_params(params: Params, config: MoEConfig, embed_dim: int) -> None:
    want = param_shapes(config, embed_dim)
    want.update(lora.factor_shapes(params, want))
    optional = {"bias"}
    for name, shape in want.items():
        if name not in params:
            if name in optional:
                continue
            raise ValueError(f"params lack {name!r} (shape {shape}); have {sorted(params)}")
        if tuple(params[name].shape) != shape:
            raise ValueError(
                f"param {name!r} has shape {tuple(params[name].shape)}, expected {shape} for "
                f"num_experts={config.num_experts}, embed_dim={embed_dim}, "
                f"mlp_dim={config.mlp_dim}, shared_dim={config.shared_dim}"
            )
    extra = sorted(set(params) - set(want))
    if extra:
        raise ValueError(f"unexpected params {extra}; expected {sorted(want)}")


# ----------------------------------------------------------------------------
# Sharding plan


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything static the shard_map body needs."""

    token_spec: P  # (B, S, D) in_spec/out_spec of the activations
    token_axes: tuple[str, ...]  # mesh axes that shard tokens
    specs: dict[str, P]  # in_specs of the parameters (tagged in explicit mode)
    ep: int  # expert-parallel degree (1 = every shard holds all experts)
    a2a: bool  # tokens sharded over the expert axis: all-to-all dispatch
    expert_axis: str


def _infer_mode(mesh: Any) -> str:
    types = set(getattr(mesh, "axis_types", ()) or ())
    return "explicit" if AxisType.Explicit in types else "auto"


def _plan(
    x: jax.Array,
    params: Params,
    config: MoEConfig,
    mesh: Any,
    rules: Any,
    mode: str,
    keep_tags: bool,
    sparse: bool,
) -> _Plan:
    sizes = dict(mesh.shape)
    token_spec = logical_to_spec((config.batch_axis, config.length_axis, None), rules, mesh)
    token_spec = fit_to_shape(token_spec, x.shape, mesh)
    token_axes = mesh_axes_used(token_spec)
    shapes = {name: tuple(w.shape) for name, w in params.items()}
    rebuilt = param_specs(config, rules, mesh, shapes)
    specs = {}
    ep = 1
    for name, spec in rebuilt.items():
        # A routed kernel's LoRA factors share its expert dim (and its expert sharding).
        expert = lora.base_name(name) in EXPERT_PARAMS
        entries = []
        for dim, entry in enumerate(partitions(spec)):
            # Inside the body a weight may stay sharded over axes that shard the
            # tokens (it is all-gathered there; the transpose of that gather is
            # the reduce-scatter FSDP wants) and, for the sparse path, over the
            # expert axis on its expert dim. Other axes are gathered before the
            # shard_map by the in_spec itself.
            keep = [
                a
                for a in entry_axes(entry)
                if a in token_axes or (sparse and expert and dim == 0 and a == config.expert_axis)
            ]
            entries.append(entry_from_axes(keep))
        spec = P(*entries)
        if sparse and expert and partitions(spec) and partitions(spec)[0]:
            ep = sizes[config.expert_axis]
        if mode == "explicit" and keep_tags:
            # TAG: the spec was rebuilt from logical rules and carries no tag. A
            # parameter that gradient accumulation made `reduced` over the batch
            # axes must enter the shard_map with that tag, else shard_map psums
            # its cotangent over those axes inside the body (per microbatch, per
            # layer). carry_reduced_axes copies the value's own reduced axes;
            # it declines on overlap with the partitions and outside explicit mode.
            spec = carry_reduced_axes(spec, params[name])
        specs[name] = spec
    a2a = ep > 1 and config.expert_axis in token_axes
    return _Plan(token_spec, token_axes, specs, ep, a2a, config.expert_axis)


# ----------------------------------------------------------------------------
# Per-shard computation


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
    return jnp.dot(jax.nn.silu(h0) * h1, wo_FxD, precision=precision)


def _layer_body(
    x_BxSxD, params, *, config: MoEConfig, plan: _Plan | None, sparse: bool, platform: str
):
    """One shard's MoE: route, routed experts (sparse or dense), shared experts."""
    precision = _precision(config)
    # The grouped matmul's implementation for the platform the program is built for.
    grouped = {"impl": resolve_grouped(config.grouped_matmul, platform), "precision": precision}
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

    b, s, d = x_BxSxD.shape
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
            out_AxD, dropped = dispatch.routed_all_to_all(
                x_TxD, ids_A, k, kernels, ep, plan.expert_axis, e_local, cap, grouped
            )
        else:
            vary = None if ep == 1 else plan.expert_axis
            start = 0 if ep == 1 else lax.axis_index(plan.expert_axis) * e_local
            out_AxD, dropped = dispatch.routed_local(
                x_TxD, ids_A, k, kernels, start, e_local, grouped, vary, keep_A
            )
        routed_TxD = jnp.einsum(
            "tkd,tk->td", out_AxD.reshape(b * s, k, d).astype(jnp.float32), weights_TxZ
        )
        if ep > 1 and not a2a:
            # Tokens are replicated over the expert axis; each shard ran its own
            # experts, so the routed output is the sum over that axis.
            routed_TxD = lax.psum(routed_TxD, plan.expert_axis)
    else:
        wi0, wi1, wo = (kernel(n).astype(dtype) for n in EXPERT_PARAMS)
        h0 = jnp.einsum("td,edf->tef", x_TxD, wi0, precision=precision)
        h1 = jnp.einsum("td,edf->tef", x_TxD, wi1, precision=precision)
        out_TxExD = jnp.einsum("tef,efd->ted", jax.nn.silu(h0) * h1, wo, precision=precision)
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


# ----------------------------------------------------------------------------
# Public entry points


def _as_device_array(x):
    """`x` as a jax value; jax arrays and tracers (with their shardings and tags) pass as is."""
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


def _moe(x_BxSxD, params, *, config, mesh, rules, mode, keep_tags, sparse, recompute_casts):
    # Host (numpy) inputs become device arrays first: the sparse path indexes the
    # activations with traced routing indices, which a numpy array cannot take.
    x_BxSxD = _as_device_array(x_BxSxD)
    if x_BxSxD.ndim != 3:
        raise ValueError(f"x must be (batch, seq, embed); got shape {x_BxSxD.shape}")
    params = {name: _as_device_array(w) for name, w in params.items()}
    _check_params(params, config, x_BxSxD.shape[-1])
    if mesh is None:
        platform = jax.default_backend()
        y, shard_stats = _layer_body(
            x_BxSxD, params, config=config, plan=None, sparse=sparse, platform=platform
        )
        return y, _finish_stats(shard_stats)
    mode = mode or _infer_mode(mesh)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    rules = DEFAULT_RULES if rules is None else rules
    plan = _plan(x_BxSxD, params, config, mesh, rules, mode, keep_tags, sparse)
    param_in_specs = (
        plan.specs if mode == "explicit" else {n: untagged(s) for n, s in plan.specs.items()}
    )
    x_spec = spec_of(x_BxSxD)
    if mode == "explicit":
        # Explicit shard_map wants its inputs already on the in_specs. reshard
        # keeps a tag that is there (the carried one) and, with keep_tags=False,
        # drops it: that is the pre-fix behaviour the tests and bench measure.
        x_BxSxD = shard(x_BxSxD, plan.token_spec, mode)
        # TAG: onto the in_specs, reduced tags included (pt.shard keeps them): an
        # untagged weight here would have its cotangent psummed in the body.
        params = {n: shard(w, param_in_specs[n], mode) for n, w in params.items()}
    stat_spec = P(plan.token_axes or None)
    stats_specs = {
        "tokens_per_expert": P(plan.token_axes or None, None),
        "balance_loss": stat_spec,
        "dropped": stat_spec,
    }
    if config.router_z_loss:
        # Per token, laid out like the tokens' (batch, length) dims.
        stats_specs["router_z_BxS"] = P(*partitions(plan.token_spec)[:2])

    # The mesh's devices say what the program is compiled for (an AOT topology's
    # compile-only devices included), not the backend this process runs on.
    platform = mesh.devices.flat[0].platform

    def body(x, p):
        return _layer_body(x, p, config=config, plan=plan, sparse=sparse, platform=platform)

    layer = jax.shard_map(
        body,
        mesh=mesh,
        # TAG: explicit in_specs carry each weight's reduced tag (shard_map then leaves
        # its cotangent unreduced); in auto mode they are untagged (auto axes cannot).
        in_specs=(plan.token_spec, param_in_specs),
        out_specs=(plan.token_spec, stats_specs),
    )
    if recompute_casts:
        # Inside the body a weight meets the (varying) tokens through a cast to
        # varying. Autodiff would save that cast's output for the backward pass: a
        # per-device copy of every weight the layer reads, stacked over layers by
        # a layer scan. Recomputing the (free) casts instead saves the weights as
        # they came in, which a scan re-slices from its input: no copy.
        layer = jax.checkpoint(layer, policy=_save_all_but_casts)
    y, shard_stats = layer(x_BxSxD, params)
    if mode == "explicit" and x_spec is not None:
        # TAG: back in the caller's sharding (a no-op when equal); activations carry
        # no tag, so nothing deferred is reduced here.
        y = shard(y, x_spec, mode)
        if "router_z_BxS" in shard_stats:
            # TAG: an activation (no tag) laid out like the caller's tokens, so a loss
            # can weight it elementwise by token.
            shard_stats["router_z_BxS"] = shard(
                shard_stats["router_z_BxS"], truncate(x_spec, 2), mode
            )
    return y, _finish_stats(shard_stats)


def _save_all_but_casts(prim, *_, **__) -> bool:
    """Remat policy: every intermediate is saveable except varying/reduced casts."""
    return prim.name not in _CASTS


# Primitives that only retype a value across mesh axes (names as of JAX 0.10).
_CASTS = frozenset({"pvary", "pcast", "reduced_vary_cast_p", "reduced_vary_cast"})


def _finish_stats(shard_stats):
    """Global stats from the per-shard ones (one row per token shard).

    `tokens_per_expert_by_shard` stays sharded, so accumulating it over
    microbatches moves nothing; `tokens_per_expert` sums it (an all-reduce of
    E integers wherever it is used; unused, XLA drops it).
    """
    by_shard = shard_stats["tokens_per_expert"]
    return {
        "tokens_per_expert": by_shard.sum(0),
        "tokens_per_expert_by_shard": by_shard,
        "balance_loss": shard_stats["balance_loss"].mean(),
        # Sharded like the tokens: a caller that only averages it later (a
        # metric) accumulates it with no collective, unlike the scalar above.
        "balance_loss_by_shard": shard_stats["balance_loss"],
        "dropped": shard_stats["dropped"].sum(),
        # Sharded like the tokens, as balance_loss_by_shard: summed over
        # microbatches with no collective, over shards once per step.
        "dropped_by_shard": shard_stats["dropped"],
        **({"router_z_BxS": shard_stats["router_z_BxS"]} if "router_z_BxS" in shard_stats else {}),
    }


def sparse_moe(
    x_BxSxD: jax.Array,
    params: Params,
    *,
    config: MoEConfig,
    mesh: Any = None,
    rules: Any = None,
    mode: str | None = None,
    keep_tags: bool = True,
    recompute_casts: bool = True,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Routed (+ shared) experts with ragged grouped matmuls; returns `(y_BxSxD, stats)`.

    `params`: dict with `gate` (D,E), optional `bias` (E,), `wi_0`/`wi_1`
    (E,D,F), `wo` (E,F,D) and, when `config.num_shared_experts`, `shared_wi_0`/
    `shared_wi_1` (D,Fs), `shared_wo` (Fs,D). `mesh=None` runs unsharded.
    With a mesh, `rules` (default `DEFAULT_RULES`) map `config.param_axes` and
    the token axes to mesh axes; `mode` ('explicit' or 'auto') defaults to the
    mesh's axis types. Explicit: inputs are resharded onto the in_specs, whose
    parameter specs carry each value's `reduced` axes (`keep_tags=False`
    reproduces the untagged, psum-in-the-body behaviour for comparison). Auto:
    tags are stripped and shard_map reshards. `recompute_casts` (default) keeps
    autodiff from saving a per-device copy of every weight for the backward
    pass; turn it off when the caller rematerializes the layer anyway (then the
    extra checkpoint only costs a little memory).

    stats: `tokens_per_expert` (E,) int32 over all tokens (feed it to
    `update_routing_bias`), `tokens_per_expert_by_shard` (token shards, E),
    `balance_loss` (scalar, sequence-wise, unscaled; the mean of
    `balance_loss_by_shard`, one per token shard), `dropped` (assignments lost
    to a positive `capacity_factor`; `dropped_by_shard`, one per token shard),
    and with `config.router_z_loss` `router_z_BxS`, each token's logsumexp(router
    logits)^2 laid out like `x`'s first two dims (a z-loss is its mean times a
    coefficient).
    """
    return _moe(
        x_BxSxD, params, config=config, mesh=mesh, rules=rules, mode=mode,
        keep_tags=keep_tags, sparse=True, recompute_casts=recompute_casts,
    )  # fmt: skip


def dense_moe(
    x_BxSxD: jax.Array,
    params: Params,
    *,
    config: MoEConfig,
    mesh: Any = None,
    rules: Any = None,
    mode: str | None = None,
    keep_tags: bool = True,
    recompute_casts: bool = True,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Reference: every token through every expert, masked combine; same contract
    as `sparse_moe` (expert weights are gathered whole on every shard)."""
    return _moe(
        x_BxSxD, params, config=config, mesh=mesh, rules=rules, mode=mode,
        keep_tags=keep_tags, sparse=False, recompute_casts=recompute_casts,
    )  # fmt: skip
