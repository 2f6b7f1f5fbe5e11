"""Tensor parallelism with stock nnx layers on an explicit data=4 x model=2 mesh.

A Megatron-style MLP: the first `nnx.Linear`'s kernel and bias sharded over
"model" on their output features (column parallel), the second's kernel over
"model" on its input features (row parallel). Explicit sharding asks the row
parallel matmul where its output goes (its contracted dimension is sharded):
`out_sharding=P(rows, None)`, the rows keeping the activation's own batch
sharding, read from its type, so the same line works outside a shard_map
(rows over "data") and inside accum's local path (rows local: None).

accum reads the batch axes from the batch (("data",): "model" shards no batch
leaf), runs each microbatch on the local path over "data" only, keeps every
weight and gradient sharded over "model", and reduces the gradients over
"data" once per step (compile_checked proves it)."""

import jax
import jax.numpy as jnp
import optax
from common import shard_batch
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Column parallel, then row parallel; the last bias replicated.
SPECS = {
    "l1": {"kernel": P(None, "model"), "bias": P("model")},
    "l2": {"kernel": P("model", None), "bias": P()},
}


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.l1(x))
        rows = jax.typeof(h).sharding.spec[0]  # TAG: the batch's own sharding, whatever it is
        return self.l2(h, out_sharding=P(rows, None))


def setup(mesh, rows=32):
    """(loss_fn, params, batch): params sharded as SPECS, rows over 'data'."""
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)))
    key_x, key_y = jax.random.split(jax.random.key(1))
    batch = {
        "x": jax.random.normal(key_x, (rows, 8)),
        "y": jax.random.randint(key_y, (rows,), 0, 3),
    }

    def loss_fn(params, mb):
        logits = nnx.merge(graphdef, params)(mb["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, mb["y"])
        return jnp.sum(loss), {"weight": jnp.float32(mb["y"].shape[0])}

    with jax.set_mesh(mesh):
        placed = jax.tree.map(
            lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), nnx.to_pure_dict(params), SPECS
        )
        nnx.replace_by_pure_dict(params, placed)
        return loss_fn, params, shard_batch(mesh, batch)


if __name__ == "__main__":
    from common import make_mesh, train

    mesh = make_mesh("explicit", model=2)
    loss_fn, params, batch = setup(mesh)
    with jax.set_mesh(mesh):
        params, losses = train(loss_fn, params, batch, optax.adamw(1e-2), steps=5)
    print("tensor parallel losses", losses)
