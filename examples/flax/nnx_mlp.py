"""An nnx MLP classifier with optax's integer-label cross entropy, unchanged."""

import jax
import jax.numpy as jnp
import optax
from common import make_mesh, replicate, shard_batch, train, weight
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 32, rngs=rngs)  # with bias
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.l2 = nnx.Linear(32, 5, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.norm(self.l1(x))))


def setup(mesh, rows=32):
    """(loss_fn, params, batch) of this example on `mesh`."""
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)))
    key_x, key_y = jax.random.split(jax.random.key(1))
    batch = {
        "x": jax.random.normal(key_x, (rows, 8)),
        "y": jax.random.randint(key_y, (rows,), 0, 5),
    }

    def loss_fn(params, mb):
        logits = nnx.merge(graphdef, params)(mb["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, mb["y"])
        return jnp.sum(loss), weight(mb["y"])

    with jax.set_mesh(mesh):
        return loss_fn, replicate(mesh, params), shard_batch(mesh, batch)


def main():
    mesh = make_mesh()
    loss_fn, params, batch = setup(mesh)
    with jax.set_mesh(mesh):
        _, losses = train(loss_fn, params, batch, optax.adam(1e-2))
    print("nnx mlp losses", losses)


if __name__ == "__main__":
    main()
