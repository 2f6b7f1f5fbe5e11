"""Shared by the Flax examples: meshes, placing a batch, and a few optax steps."""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum


def make_mesh(kind: str = "explicit", model: int = 1):
    """8 devices: data=8, or data=8/model x model; explicit or auto axes."""
    axis = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    if model == 1:
        return jax.make_mesh((8,), ("data",), axis_types=(axis,))
    return jax.make_mesh((8 // model, model), ("data", "model"), axis_types=(axis, axis))


def shard_batch(mesh, batch):
    """Each leaf's rows over 'data' (0-d leaves replicated)."""
    return jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P("data") if jnp.ndim(x) else P())), batch
    )


def replicate(mesh, tree):
    """Every leaf replicated on `mesh`."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def train(loss_fn, params, batch, optimizer, *, steps=3, num_microbatches=2):
    """A few steps of `accum.train_step`, compiled and checked once; the losses."""
    state = optimizer.init(params)

    def step(params, state, batch):
        return accum.train_step(
            loss_fn, optimizer, params, state, batch, num_microbatches=num_microbatches
        )

    compiled = accum.compile_checked(step, params, state, batch)
    losses = []
    for _ in range(steps):
        params, state, loss, _ = compiled(params, state, batch)
        losses.append(float(loss))
    return params, losses


def run_example(setup, optimizer, label: str) -> None:
    """An example's `main`: its setup on the explicit data=8 mesh, a few steps, the losses."""
    mesh = make_mesh()
    loss_fn, params, batch = setup(mesh)
    with jax.set_mesh(mesh):
        _, losses = train(loss_fn, params, batch, optimizer)
    print(label, losses)


def weight(rows: jax.Array) -> dict:
    """The aux accum needs: the number of rows (targets) counted."""
    return {"weight": jnp.float32(rows.shape[0])}


__all__ = ["make_mesh", "optax", "replicate", "run_example", "shard_batch", "train", "weight"]
