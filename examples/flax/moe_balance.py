"""A top-2 mixture of experts (linen) with a Switch-style balance loss.

The balance loss is computed across rows (the fraction of rows routed to each
expert times its mean router probability), so it sees whichever rows `loss_fn`
is given: on the local path each device's rows of a microbatch (one group per
device and microbatch), on the tags path the microbatch. It is added times the
rows, so the step's division by the summed weight averages it over the groups
(docs/accum.md, "The loss contract, and what each layer sees")."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from common import replicate, run_example, shard_batch

EXPERTS, TOP, CLASSES, ALPHA = 4, 2, 3, 0.01


class MoE(nn.Module):
    @nn.compact
    def __call__(self, x):
        probs = jax.nn.softmax(nn.Dense(EXPERTS, name="router")(x))
        top_p, top_i = jax.lax.top_k(probs, TOP)
        gates = jnp.sum(jax.nn.one_hot(top_i, EXPERTS) * top_p[..., None], axis=1)
        experts = nn.Dense(EXPERTS * 16, name="experts")(x).reshape(x.shape[0], EXPERTS, 16)
        mixed = jnp.einsum("re,reh->rh", gates, nn.gelu(experts))
        routed = jnp.mean(jax.nn.one_hot(top_i[:, 0], EXPERTS), axis=0)
        balance = EXPERTS * jnp.sum(routed * jnp.mean(probs, axis=0))
        return nn.Dense(CLASSES, name="head")(mixed), balance


def setup(mesh, rows=64):
    """(loss_fn, params, batch) of this example on `mesh`."""
    model = MoE()
    key_x, key_y = jax.random.split(jax.random.key(1))
    batch = {
        "x": jax.random.normal(key_x, (rows, 8)),
        "y": jax.random.randint(key_y, (rows,), 0, CLASSES),
    }
    params = model.init(jax.random.key(0), batch["x"][:1])["params"]

    def loss_fn(params, mb):
        logits, balance = model.apply({"params": params}, mb["x"])
        rows = jnp.float32(mb["y"].shape[0])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, mb["y"])
        # The balance loss once per row: divided by the summed rows, its mean over groups.
        return jnp.sum(ce) + ALPHA * balance * rows, {"weight": rows}

    with jax.set_mesh(mesh):  # the weights replicated, the rows over "data"
        return loss_fn, replicate(mesh, params), shard_batch(mesh, batch)


if __name__ == "__main__":
    run_example(setup, optax.adam(1e-2), "moe balance losses")
