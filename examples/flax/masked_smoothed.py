"""A masked, label-smoothed classification loss (linen), written as accum asks:
`loss_sum` the sum of the counted targets' losses, `aux["weight"]` how many were
counted (the mask's sum). accum divides once per step, so the result is the
full batch's mean over its unmasked targets however the rows fall into
microbatches and devices. A mean with `{"weight": 1}` would not be (accum warns)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from common import replicate, run_example, shard_batch

CLASSES = 5


class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(CLASSES)(nn.gelu(nn.Dense(32)(x)))


def setup(mesh, rows=32):
    """(loss_fn, params, batch) of this example on `mesh`; about a third of the
    targets masked out."""
    model = Classifier()
    key_x, key_y, key_m = jax.random.split(jax.random.key(1), 3)
    batch = {
        "x": jax.random.normal(key_x, (rows, 8)),
        "y": jax.random.randint(key_y, (rows,), 0, CLASSES),
        "mask": jax.random.bernoulli(key_m, 0.7, (rows,)),
    }
    params = model.init(jax.random.key(0), batch["x"][:1])["params"]

    def loss_fn(params, mb):
        logits = model.apply({"params": params}, mb["x"])
        labels = optax.smooth_labels(jax.nn.one_hot(mb["y"], CLASSES), 0.1)
        per_target = optax.softmax_cross_entropy(logits, labels)
        mask = mb["mask"].astype(jnp.float32)
        # The SUM over counted targets and their number: accum makes the mean.
        return jnp.sum(per_target * mask), {"weight": jnp.sum(mask)}

    with jax.set_mesh(mesh):  # the weights replicated, the rows over "data"
        return loss_fn, replicate(mesh, params), shard_batch(mesh, batch)


if __name__ == "__main__":
    run_example(setup, optax.adamw(1e-2), "masked label-smoothed losses")
