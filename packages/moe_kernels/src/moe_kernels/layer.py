"""`sparse_moe` and `dense_moe`: one MoE layer in a shard_map that keeps sharding tags.

Both paths run per shard inside `jax.shard_map` over the whole mesh and share
the routing and the shared-expert MLP; they differ in how routed experts run:

- sparse: assignments gathered into a slot layout by expert (moe_kernels.permute),
  grouped matmuls for the SwiGLU pair and the output kernel (moe_kernels.grouped:
  ragged_dot, padded blocks or a Hopper grouped GEMM), gathered back and
  combined with their weights. With
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

Where the pieces are: this module the entry points and the shard_map around the
body; moe_kernels.params the parameters; moe_kernels.shard_plan the in_specs and
the expert-parallel layout; moe_kernels.shard_body one shard's computation;
moe_kernels.dispatch the routed rows' trip to their experts.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from moe_kernels.config import DEFAULT_RULES, MoEConfig
from moe_kernels.params import Params, check_params
from moe_kernels.shard_body import layer_body
from moe_kernels.shard_plan import ManualExperts, infer_mode, manual_plan, shard_plan
from pspec_tags import MODES, partitions, shard, spec_of, truncate, untagged


def _as_device_array(x):
    """`x` as a jax value; jax arrays and tracers (with their shardings and tags) pass as is."""
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


def _moe(
    x_BxSxD, params, *, config, mesh, rules, mode, keep_tags, sparse, recompute_casts,
    manual=None, device=None,
):  # fmt: skip
    # Host (numpy) inputs become device arrays first: the sparse path indexes the
    # activations with traced routing indices, which a numpy array cannot take.
    x_BxSxD = _as_device_array(x_BxSxD)
    if x_BxSxD.ndim != 3:
        raise ValueError(f"x must be (batch, seq, embed); got shape {x_BxSxD.shape}")
    params = {name: _as_device_array(w) for name, w in params.items()}
    if manual is not None and mesh is not None:
        raise ValueError("manual= runs inside the caller's shard_map: pass mesh=None")
    ep = manual.size if manual is not None else 1
    check_params(params, config, x_BxSxD.shape[-1], expert_shards=ep)
    if mesh is None:
        # Unsharded, or per device inside the caller's manual region: `device`, the
        # caller's mesh's (an AOT compile's target), else this process' first.
        device = jax.devices()[0] if device is None else device
        plan = None if ep == 1 else manual_plan(config, manual)
        y, shard_stats = layer_body(
            x_BxSxD, params, config=config, plan=plan, sparse=sparse, device=device
        )
        return y, _finish_stats(shard_stats)
    mode = mode or infer_mode(mesh)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    rules = DEFAULT_RULES if rules is None else rules
    plan = shard_plan(x_BxSxD, params, config, mesh, rules, mode, keep_tags, sparse)
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
    device = mesh.devices.flat[0]

    def body(x, p):
        return layer_body(x, p, config=config, plan=plan, sparse=sparse, device=device)

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
    manual: ManualExperts | None = None,
    device: Any = None,
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

    Inside a caller's fully manual `jax.shard_map` (every mesh axis manual, e.g. a
    pipeline stage's per-device layers) pass `mesh=None` and, where that map shards
    the experts over `config.expert_axis`, `manual=ManualExperts(size, tokens_split)`:
    the routed kernels (and their LoRA factors) then hold this device's E/size
    experts on dim 0, nothing is gathered, and the routed rows reach their experts
    by an all-to-all over the axis (`tokens_split`) or each shard runs its own
    experts on every token and the outputs are summed over it. `device`: one the
    program is built for (default: the mesh's, else `jax.devices()[0]`); its
    platform picks the grouped matmul, so an AOT compile from a CPU host passes it.

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
        manual=manual, device=device,
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
    manual: ManualExperts | None = None,
    device: Any = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Reference: every token through every expert, masked combine; same contract
    as `sparse_moe` (expert weights are gathered whole on every shard)."""
    return _moe(
        x_BxSxD, params, config=config, mesh=mesh, rules=rules, mode=mode,
        keep_tags=keep_tags, sparse=False, recompute_casts=recompute_casts,
        manual=manual, device=device,
    )  # fmt: skip
