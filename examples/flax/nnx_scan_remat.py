"""nnx layers stacked with `nnx.vmap`, run by `nnx.scan` over `nnx.remat`
(each layer's activations recomputed in the backward), unchanged."""

import jax
import jax.numpy as jnp
import optax
from common import make_mesh, replicate, shard_batch, train, weight
from flax import nnx


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.RMSNorm(8, rngs=rngs)
        self.lin = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return x + nnx.gelu(self.lin(self.norm(x)))


class Model(nnx.Module):
    def __init__(self, rngs, layers=3):
        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(rngs)

        self.inp = nnx.Linear(4, 8, rngs=rngs)
        self.blocks = create(rngs)  # each parameter stacked: a leading layer dimension
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def forward(x, block):
            return block(x)

        return self.out(forward(self.inp(x), self.blocks))


def setup(mesh, rows=16):
    """(loss_fn, params, batch) of this example on `mesh`."""
    graphdef, params = nnx.split(Model(nnx.Rngs(0)))
    batch = {"x": jax.random.normal(jax.random.key(1), (rows, 4)), "y": jnp.ones((rows, 1))}

    def loss_fn(params, mb):
        err = nnx.merge(graphdef, params)(mb["x"]) - mb["y"]
        return jnp.sum(err * err), weight(mb["y"])

    with jax.set_mesh(mesh):
        return loss_fn, replicate(mesh, params), shard_batch(mesh, batch)


def main():
    mesh = make_mesh()
    loss_fn, params, batch = setup(mesh)
    with jax.set_mesh(mesh):
        _, losses = train(loss_fn, params, batch, optax.adam(1e-2))
    print("nnx scan/remat losses", losses)


if __name__ == "__main__":
    main()
