"""Sync BatchNorm, linen and nnx, as their docs write it: `axis_name="data"`.

accum runs each microbatch on the local path (a shard_map over the batch axes,
which binds "data"), so the layer's `pmean` averages its statistics over every
device's rows of the microbatch: the statistics of the whole microbatch, as
one device running it alone would compute them. Gradients and new running
averages are those of the microbatches one after the other, each normalized by
its own statistics (`reference`). Without `axis_name` each device normalizes
by its own rows' statistics (examples/flax/batchnorm.py, as under DDP).

The running averages come back through the aux, weighted by rows: accum sums
the aux over microbatches and devices, and dividing by the weight gives their
mean. nnx: merge with `copy=True` so the module's BatchStat updates do not
write into the Variables of the step's trace (plain `jax.grad` needs it too).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from common import make_mesh, replicate, shard_batch
from flax import nnx

import accum

ROWS, N = 64, 2


class Linen(nn.Module):
    axis_name: str | None = "data"

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=self.axis_name)(x)
        return nn.Dense(1)(nn.relu(x))


class Nnx(nnx.Module):
    def __init__(self, axis_name="data"):
        rngs = nnx.Rngs(0)
        self.l1 = nnx.Linear(4, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, momentum=0.9, axis_name=axis_name, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.bn(self.l1(x))))


def _squared(out, mb, stats):
    """(loss_sum, aux): squared error, rows, statistics weighted by rows."""
    err, rows = out - mb["y"], jnp.float32(out.shape[0])
    return jnp.sum(err * err), {"weight": rows, "stats": jax.tree.map(lambda s: s * rows, stats)}


def make_model(kind, axis_name="data"):
    """(loss_fn factory, params, stats): `make_loss(stats)` closes over the stats."""
    if kind == "linen":
        model = Linen(axis_name)
        variables = model.init(jax.random.key(0), jnp.ones((1, 4)))

        def make_loss(stats):
            def loss_fn(params, mb):
                variables = {"params": params, "batch_stats": stats}
                out, new = model.apply(variables, mb["x"], mutable=["batch_stats"])
                return _squared(out, mb, new["batch_stats"])

            return loss_fn

        return make_loss, variables["params"], variables["batch_stats"]
    graphdef, params, stats = nnx.split(Nnx(axis_name), nnx.Param, nnx.BatchStat)

    def make_loss(stats):
        def loss_fn(params, mb):
            model = nnx.merge(graphdef, params, stats, copy=True)
            return _squared(model(mb["x"]), mb, nnx.state(model, nnx.BatchStat))

        return loss_fn

    return make_loss, params, stats


def batch_of(rows=ROWS):
    key_x, key_y = jax.random.split(jax.random.key(1))
    return {"x": jax.random.normal(key_x, (rows, 4)), "y": jax.random.normal(key_y, (rows, 1))}


def step(make_loss):
    """The jitted step: gradients and the new running averages."""

    def run(params, stats, batch):
        _, aux, grads = accum.accumulate_gradients(
            make_loss(stats), params, batch, num_microbatches=N
        )
        return grads, jax.tree.map(lambda s: s / aux["weight"], aux["stats"])

    return run


def reference(kind, batch):
    """The documented semantics on one device: microbatch i (rows i, i+N, ...: accum's
    split) normalized by its own statistics; gradients and averages over rows."""
    make_loss, params, stats = make_model(kind, axis_name=None)
    loss_fn = make_loss(stats)
    parts = [jax.tree.map(lambda x, i=i: x[i::N], batch) for i in range(N)]
    grads = [jax.grad(lambda p, mb=mb: loss_fn(p, mb)[0])(params) for mb in parts]
    stats = [loss_fn(params, mb)[1]["stats"] for mb in parts]
    mean = lambda *xs: sum(xs) / ROWS  # noqa: E731 - the rows-weighted mean of the parts
    return jax.tree.map(mean, *grads), jax.tree.map(mean, *stats)


def run_on(mesh, kind):
    """(grads, new running averages) of one accum step on `mesh`, compiled checked."""
    make_loss, params, stats = make_model(kind)
    with jax.set_mesh(mesh):
        params, stats = replicate(mesh, params), replicate(mesh, stats)
        batch = shard_batch(mesh, batch_of())
        compiled = accum.compile_checked(step(make_loss), params, stats, batch)
        return compiled(params, stats, batch), compiled


def main():
    mesh = make_mesh()
    for kind in ("linen", "nnx"):
        (grads, stats), _ = run_on(mesh, kind)
        want_grads, want_stats = reference(kind, batch_of())
        diff = max(
            float(jnp.max(jnp.abs(jnp.asarray(a) - b)))
            for a, b in zip(
                jax.tree.leaves((grads, stats)),
                jax.tree.leaves((want_grads, want_stats)),
                strict=True,
            )
        )
        print(
            f"sync batchnorm ({kind}): max difference from the full-microbatch reference {diff:.2e}"
        )


if __name__ == "__main__":
    main()
