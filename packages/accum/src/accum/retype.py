"""Evaluating a lifted jaxpr with its nested jaxprs re-traced at today's types.

accum.closure traces a `loss_fn` once outside the local path's shard_map and
evaluates the jaxpr inside it. A nested jaxpr (the body of a `jit`, `scan`,
`while`, `cond`, `checkpoint`, or a `custom_jvp` such as `jax.nn.relu`'s) keeps
the types its operands had at that trace: a closed-over array's type names the
step's explicit mesh. `jax.core.eval_jaxpr` binds the stored nested jaxpr
again, and JAX re-uses its types when it evaluates or differentiates it: inside
the shard_map that is a mesh mismatch ("Mesh for all inputs should be equal",
"Expected cotangent type"). A closed-over dropout key reaches `jax.random`'s
jitted samplers, BatchNorm's statistics `relu`: the usual Flax step hits it.

`eval_retyped` evaluates equation by equation as `eval_jaxpr` does (each under
the context it was traced in, accum.closure), but builds the higher-order ones
again with JAX's own API, whose bodies evaluate the nested jaxpr recursively:
JAX traces them afresh on the operands it is given now, the shard_map's values.

- `jit` / `pjit` / `closed_call` / `core_call` without shardings of their own:
  the inner jaxpr inline (XLA inlines a jit anyway);
- `checkpoint` (`remat2`): `jax.checkpoint` with the same policy and prevent_cse;
- `scan`: `lax.scan` with the same length, reverse and unroll;
- `while`: `lax.while_loop`; `cond`: `lax.switch` on the same index;
- `custom_jvp_call`: `jax.custom_jvp` whose rule evaluates the original rule's
  jaxpr (the equation's own `jvp_jaxpr_fun`, traced in the equation's context),
  so the custom derivative stays: `relu`'s gradient at exactly 0 is JAX's.

The same trace copies a closed-over value's type into the params of ops built
from it (`jnp.zeros_like`, `relu`'s rule: a `broadcast_in_dim` with the
explicit mesh's replicated sharding); bound inside the shard_map that sharding
mismatches the manual operands. A sharding that shards nothing over a mesh is
dropped (`_retyped_params`): JAX types the result from its operands, same
values; one that names an axis, or that a constraint op exists to apply, stays.

Everything else is bound as stored, as `eval_jaxpr` does: a `custom_vjp_call`,
a jit with its own shardings, a differentiated checkpoint. Where a closed-over
value reaches one of those, it fails at trace time as before and accum.local
falls back to its next mechanism; nothing is evaluated differently.

The parameters read are the same on JAX 0.10.2 and 0.12, except `scan`'s
layout: 0.10 has `num_consts`/`num_carry`, 0.12 a flat tree `ft_in` of
(consts, carry, xs) (`_scan_counts`); and 0.12 merged `ClosedJaxpr` into
`Jaxpr` (`open_jaxpr`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal


def eval_retyped(jaxpr: Any, consts: Sequence[Any], *args: Any) -> list[Any]:
    """`jax.core.eval_jaxpr(jaxpr, consts, *args)`, nested jaxprs re-traced
    on the operands' current types (module docstring).

    >>> closed = jax.make_jaxpr(lambda x: jax.nn.relu(jnp.sin(x)))(1.0)
    >>> relu_sin = lambda x: accum.retype.eval_retyped(closed.jaxpr, closed.consts, x)[0]
    >>> float(relu_sin(0.5))
    0.479425...
    >>> float(jax.grad(relu_sin)(0.0))  # relu's own rule at 0, not max's 0.5
    0.0
    """
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        rule = _RULES.get(eqn.primitive.name)
        # Bound under the context it was traced in, as eval_jaxpr does (accum.closure).
        with eqn.ctx.manager:
            out = None if rule is None else rule(eqn, invals)
            if out is None:  # not handled: bound as stored
                params = eqn.params
                if eqn.primitive.name not in _CONSTRAINTS:
                    params = _retyped_params(params)
                out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        outs = out if eqn.primitive.multiple_results else [out]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


# What the user asked to be placed so: bound with the sharding as written.
_CONSTRAINTS = frozenset({"sharding_constraint", "reshard", "mesh_cast", "device_put"})


def _replicated_on_a_mesh(value: Any) -> bool:
    """Whether `value` is a NamedSharding over a mesh that shards nothing."""
    if not isinstance(value, jax.sharding.NamedSharding) or not value.mesh.axis_names:
        return False
    spec = value.spec
    named = getattr(spec, "unreduced", None) or getattr(spec, "reduced", None)
    return not named and all(entry is None for entry in spec)


def _retyped_params(params: dict) -> dict:
    """`params` without the replicated shardings the trace copied from a
    closed-over value's type (`broadcast_in_dim`'s `sharding` in
    `jnp.zeros_like(x)`, `relu`'s rule): None, JAX types the result from its
    operands, as it does every other op here. Same values either way; a
    sharding that names an axis is kept (and fails, as before, if it must), and
    so is every sharding of an op that exists to place a value (`_CONSTRAINTS`)."""
    if not any(_replicated_on_a_mesh(v) for v in params.values()):
        return params
    return {k: None if _replicated_on_a_mesh(v) else v for k, v in params.items()}


def open_jaxpr(closed: Any) -> tuple[Any, Sequence[Any]]:
    """(jaxpr, consts) of a nested jaxpr param: a ClosedJaxpr on 0.10, an open
    Jaxpr (checkpoint's on 0.10) or 0.12's Jaxpr, whose `.jaxpr` is itself."""
    return getattr(closed, "jaxpr", closed), getattr(closed, "consts", ())


def _evaluator(closed: Any) -> Callable[..., list[Any]]:
    """`closed` as a function of its inputs, evaluated by `eval_retyped`."""
    return functools.partial(eval_retyped, *open_jaxpr(closed))


def _unsharded(shardings: Sequence[Any]) -> bool:
    """Whether a jit's in/out shardings are all left to JAX (none given)."""
    return all(type(s).__name__ == "UnspecifiedValue" for s in shardings)


def _inline(eqn: Any, invals: list[Any]) -> list[Any] | None:
    """A jit or closed call, its jaxpr evaluated inline; a jit that fixes
    shardings of its own (typed on the outer mesh) is left as stored."""
    params = eqn.params
    if not _unsharded((*params.get("in_shardings", ()), *params.get("out_shardings", ()))):
        return None
    return _evaluator(params.get("jaxpr", params.get("call_jaxpr")))(*invals)


def _checkpoint(eqn: Any, invals: list[Any]) -> list[Any] | None:
    """`jax.checkpoint` again, same policy; one already differentiated (not in
    a loss_fn's forward trace) is left as stored."""
    params = eqn.params
    if params.get("differentiated"):
        return None
    fn = jax.checkpoint(
        _evaluator(params["jaxpr"]), prevent_cse=params["prevent_cse"], policy=params["policy"]
    )
    return fn(*invals)


def _scan_counts(params: dict, n_in: int) -> tuple[int, int]:
    """(consts, carry) counts of a scan's flat operands (consts, carry, xs)."""
    if "num_consts" in params:  # JAX 0.10
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].update(list(range(n_in))).unpack()  # JAX 0.12
    return len(list(consts)), len(list(carry))


def _scan(eqn: Any, invals: list[Any]) -> list[Any]:
    """`lax.scan` again: same length, direction, unroll; the body re-traced."""
    params = eqn.params
    n_consts, n_carry = _scan_counts(params, len(invals))
    consts, carry, xs = (
        invals[:n_consts],
        invals[n_consts : n_consts + n_carry],
        invals[n_consts + n_carry :],
    )
    body = _evaluator(params["jaxpr"])

    def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        out = body(*consts, *carry, *x)
        return out[:n_carry], out[n_carry:]

    carry, ys = lax.scan(
        step,
        carry,
        xs,
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return [*carry, *ys]


def _while(eqn: Any, invals: list[Any]) -> list[Any]:
    """`lax.while_loop` again, condition and body re-traced."""
    params = eqn.params
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts = invals[:n_cond], invals[n_cond : n_cond + n_body]
    cond, body = _evaluator(params["cond_jaxpr"]), _evaluator(params["body_jaxpr"])
    return lax.while_loop(
        lambda carry: cond(*cond_consts, *carry)[0],
        lambda carry: body(*body_consts, *carry),
        invals[n_cond + n_body :],
    )


def _cond(eqn: Any, invals: list[Any]) -> list[Any]:
    """`lax.switch` on the cond's (already clamped) index, branches re-traced."""
    branches = [_evaluator(branch) for branch in eqn.params["branches"]]
    return lax.switch(invals[0], branches, *invals[1:])


def _zero_tangent(primal: Any) -> Any:
    """An instantiated zero tangent for `primal` (float0 for integers and keys)."""
    if jnp.issubdtype(primal.dtype, jnp.inexact):
        return jnp.zeros_like(primal)
    return np.zeros(np.shape(primal), jax.dtypes.float0)


def _custom_jvp(eqn: Any, invals: list[Any]) -> list[Any] | None:
    """`jax.custom_jvp` again: the function re-traced, and a rule evaluating
    the original rule's jaxpr (every tangent instantiated: `jax.custom_jvp`
    hands in no symbolic zeros). The equation's leading `num_consts` operands
    are the function's closed-over values, which its rule does not see (as in
    JAX's own `custom_jvp_call`)."""
    params = eqn.params
    n_consts, rule_of = params["num_consts"], params.get("jvp_jaxpr_fun")
    if rule_of is None:  # a JAX that names it otherwise: bound as stored
        return None
    fn = jax.custom_jvp(_evaluator(params["call_jaxpr"]))

    def rule(primals: tuple, tangents: tuple) -> tuple[list[Any], list[Any]]:
        primals, tangents = primals[n_consts:], tangents[n_consts:]
        with eqn.ctx.manager:  # the rule is traced where the function was
            jaxpr, consts, out_zeros = rule_of.call_wrapped(*[False] * len(primals))
        out = eval_retyped(open_jaxpr(jaxpr)[0], consts, *primals, *tangents)
        outs, nonzero = out[: len(out_zeros)], iter(out[len(out_zeros) :])
        pairs = zip(outs, out_zeros, strict=True)
        return outs, [_zero_tangent(p) if zero else next(nonzero) for p, zero in pairs]

    fn.defjvp(rule)
    return fn(*invals)


# Primitive name -> how to build it again (None from a rule: bind it as stored).
_RULES: dict[str, Callable[[Any, list[Any]], list[Any] | None]] = {
    "jit": _inline,  # JAX 0.10 and 0.12
    "pjit": _inline,  # older JAX
    "closed_call": _inline,
    "core_call": _inline,
    "remat2": _checkpoint,
    "checkpoint": _checkpoint,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "custom_jvp_call": _custom_jvp,
}
