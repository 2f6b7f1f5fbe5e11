"""bf16 parameters for compute, an f32 master copy for the optimizer: the step
casts the master to bf16, accumulates the bf16 gradients in f32
(`accum_dtype=jnp.float32`) and updates the master."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from common import make_mesh, replicate, shard_batch, weight

import accum

# What tests/test_flax_examples.py passes for this example: bf16 compute agrees
# with the full batch to bf16's precision, and the sums are kept in f32.
ACCUM_DTYPE = jnp.float32
RTOL, ATOL = 3e-2, 1e-2


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x)
        x = nn.LayerNorm(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(nn.gelu(x))
        return nn.Dense(1, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x)


def to_bf16(master):
    """The compute copy of the f32 master parameters."""
    return jax.tree.map(lambda p: p.astype(jnp.bfloat16), master)


def setup(mesh, rows=16):
    """(loss_fn, bf16 params, batch) of this example on `mesh`."""
    model = Model()
    batch = {"x": jax.random.normal(jax.random.key(1), (rows, 4)), "y": jnp.ones((rows, 1))}
    params = model.init(jax.random.key(0), batch["x"][:1])

    def loss_fn(params, mb):
        err = (model.apply(params, mb["x"]) - mb["y"]).astype(jnp.float32)
        return jnp.sum(err * err), weight(mb["y"])

    with jax.set_mesh(mesh):
        return loss_fn, replicate(mesh, params), shard_batch(mesh, batch)


def train_master(loss_fn, master, batch, optimizer, steps=3):
    """A few steps on the f32 `master`; the losses."""

    def step(master, state, batch):
        loss, _, grads = accum.accumulate_gradients(
            loss_fn, to_bf16(master), batch, num_microbatches=2, accum_dtype=ACCUM_DTYPE
        )
        updates, state = optimizer.update(grads, state, master)  # f32 grads, f32 master
        return optax.apply_updates(master, updates), state, loss

    state = optimizer.init(master)
    compiled = accum.compile_checked(step, master, state, batch)
    losses = []
    for _ in range(steps):
        master, state, loss = compiled(master, state, batch)
        losses.append(float(loss))
    return master, losses


def main():
    mesh = make_mesh()
    loss_fn, params, batch = setup(mesh)
    master = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    with jax.set_mesh(mesh):
        master, losses = train_master(loss_fn, replicate(mesh, master), batch, optax.adam(1e-2))
    print("bf16 compute, f32 master", jax.tree.leaves(master)[0].dtype, "losses", losses)


if __name__ == "__main__":
    main()
