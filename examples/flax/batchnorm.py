"""linen BatchNorm in training mode, written the usual Flax way: a TrainState
holding `batch_stats`, and a `loss_fn` inside the step that closes over them
and returns the new running averages through `mutable=["batch_stats"]`. They
ride in the aux (weighted by rows, so accum's sum over microbatches and
devices divided by the weight is their mean) and are written back after the
step. On the local path the batch statistics are those of each device's rows
of a microbatch, as under DDP. On an explicit mesh JAX's shard_map refuses
the closed-over `state.batch_stats`; accum closure-converts `loss_fn` to pass
them into it (accum.closure), with the same numbers."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from common import make_mesh, replicate, shard_batch
from flax.training import train_state

import accum


class Model(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(1)(nn.relu(x))


class TrainState(train_state.TrainState):
    batch_stats: Any


def setup(mesh, rows=64, optimizer=None):
    """(state, batch) of this example on `mesh`: a TrainState with the running
    averages, replicated, and the batch sharded over 'data'."""
    model = Model()
    key_x, key_y = jax.random.split(jax.random.key(1))
    batch = {"x": jax.random.normal(key_x, (rows, 4)), "y": jax.random.normal(key_y, (rows, 1))}
    variables = model.init(jax.random.key(0), batch["x"][:1], train=False)
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optimizer or optax.sgd(0.1),
        batch_stats=variables["batch_stats"],
    )
    with jax.set_mesh(mesh):
        return replicate(mesh, state), shard_batch(mesh, batch)


def make_loss(apply_fn, batch_stats):
    """loss_fn(params, mb) closing over the running averages, as Flax users write it."""

    def loss_fn(params, mb):
        variables = {"params": params, "batch_stats": batch_stats}
        out, updates = apply_fn(variables, mb["x"], train=True, mutable=["batch_stats"])
        err, rows = out - mb["y"], jnp.float32(out.shape[0])
        stats = jax.tree.map(lambda s: s * rows, updates["batch_stats"])
        return jnp.sum(err * err), {"weight": rows, "batch_stats": stats}

    return loss_fn


def train_step(state, batch):
    """One step; the new running averages are the rows-weighted mean of those
    each device and microbatch computed. Returns (state, loss, grads)."""
    loss_fn = make_loss(state.apply_fn, state.batch_stats)
    loss, aux, grads = accum.accumulate_gradients(loss_fn, state.params, batch, num_microbatches=2)
    stats = jax.tree.map(lambda s: s / aux["weight"], aux["batch_stats"])
    return state.apply_gradients(grads=grads, batch_stats=stats), loss, grads


def main():
    mesh = make_mesh()
    state, batch = setup(mesh)
    with jax.set_mesh(mesh):
        compiled = accum.compile_checked(train_step, state, batch)
        for _ in range(3):
            state, loss, _ = compiled(state, batch)
            mean = state.batch_stats["BatchNorm_0"]["mean"]
            print("batchnorm loss", float(loss), "running mean[0]", float(mean[0]))


if __name__ == "__main__":
    main()
