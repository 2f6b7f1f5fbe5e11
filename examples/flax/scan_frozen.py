"""Scanned, rematerialized linen layers (`nn.scan` over `nn.remat`) with a frozen
embedding subtree through `optax.multi_transform`."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from common import make_mesh, replicate, shard_batch, train


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(8)(nn.LayerNorm()(x)), None


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="frozen_in")(x)
        stack = nn.scan(
            nn.remat(Layer), variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(1)(x)


def setup(mesh, rows=16):
    model = Model()
    batch = {"x": jax.random.normal(jax.random.key(1), (rows, 4)), "y": jnp.ones((rows, 1))}
    params = model.init(jax.random.key(0), batch["x"][:1])

    def loss_fn(params, mb):
        err = model.apply(params, mb["x"]) - mb["y"]
        return jnp.sum(err * err), {"weight": jnp.float32(err.shape[0])}

    with jax.set_mesh(mesh):
        return loss_fn, replicate(mesh, params), shard_batch(mesh, batch)


def optimizer(params):
    labels = jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if "frozen_in" in jax.tree_util.keystr(path) else "train", params
    )
    return optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)


def main():
    mesh = make_mesh()
    loss_fn, params, batch = setup(mesh)
    with jax.set_mesh(mesh):
        new, losses = train(loss_fn, params, batch, optimizer(params))
    frozen_same = jax.tree.map(
        lambda a, b: bool((a == b).all()), new["params"]["frozen_in"], params["params"]["frozen_in"]
    )
    print("scan losses", losses, "frozen unchanged", frozen_same)


if __name__ == "__main__":
    main()
