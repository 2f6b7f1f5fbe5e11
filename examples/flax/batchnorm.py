"""linen BatchNorm in training mode: its running averages come back through
`mutable=["batch_stats"]`, ride in the aux (weighted by rows, so accum's sum
over microbatches and devices divided by the weight is their mean), and are
written back after the step. On the local path the batch statistics are
those of each device's rows of a microbatch, as under DDP."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from common import make_mesh, replicate, shard_batch

import accum


class Model(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(1)(nn.relu(x))


def setup(mesh, rows=64):
    """(loss_fn, variables, batch) of this example on `mesh`. The running
    averages travel with the parameters (`variables`), not in loss_fn's closure:
    the local path's shard_map cannot close over a traced value on an explicit
    mesh. Their gradient is zeros (training mode reads the batch's statistics)."""
    model = Model()
    key_x, key_y = jax.random.split(jax.random.key(1))
    batch = {"x": jax.random.normal(key_x, (rows, 4)), "y": jax.random.normal(key_y, (rows, 1))}
    variables = model.init(jax.random.key(0), batch["x"][:1], train=False)

    def loss_fn(variables, mb):
        out, updates = model.apply(variables, mb["x"], train=True, mutable=["batch_stats"])
        err, rows = out - mb["y"], jnp.float32(out.shape[0])
        stats = jax.tree.map(lambda s: s * rows, updates["batch_stats"])
        return jnp.sum(err * err), {"weight": rows, "batch_stats": stats}

    with jax.set_mesh(mesh):
        return loss_fn, replicate(mesh, variables), shard_batch(mesh, batch)


def step(loss_fn, optimizer, variables, opt_state, batch):
    """One training step on variables["params"]; the new running averages are
    the rows-weighted mean of those each device and microbatch computed."""
    loss, aux, grads = accum.accumulate_gradients(loss_fn, variables, batch, num_microbatches=2)
    updates, opt_state = optimizer.update(grads["params"], opt_state, variables["params"])
    new = {
        "params": optax.apply_updates(variables["params"], updates),
        "batch_stats": jax.tree.map(lambda s: s / aux["weight"], aux["batch_stats"]),
    }
    return new, opt_state, loss, grads


def main():
    mesh = make_mesh()
    loss_fn, variables, batch = setup(mesh)
    optimizer = optax.sgd(0.1)
    opt_state = optimizer.init(variables["params"])
    with jax.set_mesh(mesh):
        compiled = accum.compile_checked(
            lambda v, o, b: step(loss_fn, optimizer, v, o, b), variables, opt_state, batch
        )
        for _ in range(3):
            variables, opt_state, loss, _ = compiled(variables, opt_state, batch)
            mean = variables["batch_stats"]["BatchNorm_0"]["mean"]
            print("batchnorm loss", float(loss), "running mean[0]", float(mean[0]))


if __name__ == "__main__":
    main()
