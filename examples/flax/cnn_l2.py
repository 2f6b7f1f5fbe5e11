"""A linen CNN (Conv, Dense) with an L2 penalty on tanh features.

The penalty depends on the parameters only, so it is added once per counted
row: `penalty * rows`. accum divides the summed loss by the summed weight (the
rows), so the step's loss holds the penalty exactly once, on every path.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from common import make_mesh, replicate, shard_batch, train


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Conv(4, (3, 3))(x))
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


def setup(mesh, rows=16):
    model = CNN()
    key_x, key_y = jax.random.split(jax.random.key(1))
    batch = {
        "x": jax.random.normal(key_x, (rows, 6, 6, 1)),
        "y": jax.random.randint(key_y, (rows,), 0, 3),
    }
    params = model.init(jax.random.key(0), batch["x"][:1])

    def loss_fn(params, mb):
        logits = model.apply(params, mb["x"])
        rows = jnp.float32(mb["y"].shape[0])
        l2 = sum(jnp.sum(p * p) for p in jax.tree.leaves(params))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, mb["y"])
        return jnp.sum(loss) + 1e-3 * l2 * rows, {"weight": rows}

    with jax.set_mesh(mesh):
        return loss_fn, replicate(mesh, params), shard_batch(mesh, batch)


def main():
    mesh = make_mesh()
    loss_fn, params, batch = setup(mesh)
    with jax.set_mesh(mesh):
        _, losses = train(loss_fn, params, batch, optax.sgd(0.1))
    print("cnn losses", losses)


if __name__ == "__main__":
    main()
