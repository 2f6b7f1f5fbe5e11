"""Closure conversion: the arrays a `loss_fn` closes over, made its arguments.

On an explicit mesh JAX's shard_map refuses a value the function inside it
closes over (a jitted step's traced argument read inside `loss_fn`: a
TrainState's `batch_stats`, a temperature, a dropout key): "Closing over
inputs to shard_map where the input is sharded on `Explicit` axes is not
implemented" (or, on a data x model mesh, a context-mesh mismatch), raised by
the first op inside the shard_map that reads it, whatever traces it. The
user's Python holds the value, so no wrapper can hand it in; a jaxpr can.
`lift_closure` traces `loss_fn` once, outside the shard_map, where reading
the value is legal (`jax.make_jaxpr`): the arrays it closes over become the
jaxpr's consts, and the function returned evaluates the jaxpr with them as
arguments, which the shard_map takes as replicated inputs (`P()`).

What it takes to evaluate that jaxpr inside the shard_map (accum.local):

- It is traced on mesh-free inputs of one device's shapes (its rows of a
  microbatch), under an empty abstract mesh. Every equation records the mesh
  it was traced under and is bound under it again when evaluated (JAX's
  `eqn.ctx`): traced under the step's explicit mesh it would refuse the
  shard_map's manual-typed values ("context mesh ... should match the aval
  mesh"); under an empty mesh JAX checks no mesh and types each op from its
  operands, here the shard_map's own values. A model axis that is not a batch
  axis keeps its explicit sharding: it comes in on the operands.
- A jaxpr traced outside a shard_map has no varying-over-manual-axes types (JAX
  inserts `pvary` when it traces inside one), so the shard_map evaluating it
  runs with `check_vma=False`. The semantics the local path relies on do not
  change: the gradient of a device's loss with respect to its copy of the
  weights is its local partial sum (no cross-device sum is added inside), and
  the one `psum` after the loop sums the devices.

Nested jaxprs: a closed-over array that reaches one (`jax.nn.relu` or
`softmax` of it: a custom_jvp and a jit; a `jit`, `scan`, `cond`, `while`,
`checkpoint`; a closed-over dropout key reaching `jax.random`'s jitted
samplers) keeps, inside that jaxpr, the explicit mesh's type it had when
traced, and JAX re-uses a nested jaxpr's types when it evaluates or
differentiates it: inside the shard_map a mesh mismatch ("Mesh for all inputs
should be equal", "Expected cotangent type"). So the jaxpr is evaluated by
accum.retype, which traces those nested jaxprs again on the values it is
given (a custom_jvp keeps its rule).

What it cannot do, and why (accum.local then falls back to accum.local_mapped):
a closed-over array reaching what accum.retype does not rebuild (a
`custom_vjp`, a `jit` with shardings of its own) fails as above. Nor can the
trace, made without a mesh, record the out_sharding a library computes from
its operands' types on a non-batch explicit axis (the backward scatter of an
`Embed` table sharded over "model"). Both fail loudly at trace time, never
with other numbers.

Only JAX arrays (tracers and committed arrays: their types name a mesh) are
lifted; numpy constants stay in the jaxpr. PRNG keys and integers pass as any
array. The gradient is still taken with respect to the parameters only: the
caller differentiates the returned function in its `params` argument, and the
lifted consts are not differentiated, as a closure's values are not.

JAX API used: `jax.make_jaxpr(..., return_shape=True)`, the same on JAX 0.10.2
and 0.12 (0.12 merged `ClosedJaxpr` into `Jaxpr`, whose legacy `.jaxpr` returns
itself; the consts are bound as given on either), and accum.retype's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from accum.retype import eval_retyped, open_jaxpr

# No mesh: what `lift_closure` traces under (module docstring).
_NO_MESH = jax.sharding.AbstractMesh((), ())


def _mesh_free(x: Any) -> jax.ShapeDtypeStruct:
    """`x`'s shape and dtype without a sharding (an array or a ShapeDtypeStruct)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def lift_closure(
    fn: Callable, *args: Any, axis_env: tuple[tuple[str, int], ...] = ()
) -> tuple[Callable, list[Any]]:
    """(converted, consts): `converted(consts, *args)` computes `fn(*args)`,
    the JAX arrays `fn` closes over passed in `consts` instead.

    `args` give shapes and dtypes only (arrays or ShapeDtypeStructs), those of
    the values `converted` will be called with; `fn` is traced once, here.
    Call it where `fn`'s closed-over values may be read (outside the
    shard_map); call `converted` inside it (module docstring). `axis_env`:
    (name, size) of the shard_map's manual axes, so a collective over one (a
    sync BatchNorm's `pmean` over "data") traces; `converted.jaxpr` and
    `converted.out_shape` are the trace, for checks (accum.batch_collectives).

    Example (in a jitted step, `temperature` a traced argument):

    >>> def step(x, temperature):
    ...     converted, consts = accum.closure.lift_closure(lambda v: v / temperature, x)
    ...     return converted(consts, x)
    >>> float(jax.jit(step)(jnp.float32(3.0), jnp.float32(2.0)))
    1.5
    """
    shapes = jax.tree.map(_mesh_free, args)
    with jax.sharding.use_abstract_mesh(_NO_MESH):
        closed, out_shape = jax.make_jaxpr(fn, axis_env=list(axis_env), return_shape=True)(*shapes)
    in_tree, out_tree = jax.tree.structure(shapes), jax.tree.structure(out_shape)
    # 0.10: the open Jaxpr of a ClosedJaxpr; 0.12: the Jaxpr itself.
    jaxpr, _ = open_jaxpr(closed)
    lifted = [isinstance(c, jax.Array) for c in closed.consts]

    def converted(consts: list[Any], *call_args: Any) -> Any:
        leaves, tree = jax.tree.flatten(call_args)
        if tree != in_tree:
            raise TypeError(f"lift_closure: called with {tree}, traced with {in_tree}")
        given = iter(consts)
        values = [next(given) if lift else c for c, lift in zip(closed.consts, lifted, strict=True)]
        return jax.tree.unflatten(out_tree, eval_retyped(jaxpr, values, *leaves))

    converted.jaxpr, converted.out_shape = closed, out_shape
    return converted, [c for c, lift in zip(closed.consts, lifted, strict=True) if lift]
