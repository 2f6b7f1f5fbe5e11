"""Cases shared by the closure tests (test_local_closures.py,
test_local_nested_closures.py): the meshes, stock Flax layers with a loss_fn
closing over a traced scale, which local mechanism a step traced to, and the
full-batch check. Registered by conftest as `accum_tests_closure_cases`."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import hlo_tools

N, ROWS = 2, 64  # microbatches, batch rows
FIX = "pass it through the params or the batch"  # the one-line error's advice
MESHES = {  # name: (axis type, model axis size)
    "auto_data8": (AxisType.Auto, 1),
    "explicit_data8": (AxisType.Explicit, 1),
    "explicit_data4_model2": (AxisType.Explicit, 2),
}


def mesh_named(name):
    """The 8 virtual devices as MESHES[name]."""
    axis, model = MESHES[name]
    if model == 1:
        return jax.make_mesh((8,), ("data",), axis_types=(axis,))
    return jax.make_mesh((8 // model, model), ("data", "model"), axis_types=(axis, axis))


class ScannedBlocks(nn.Module):
    """Two tanh(Dense) blocks through nn.scan over nn.remat."""

    @nn.compact
    def __call__(self, x):
        class Block(nn.Module):
            @nn.compact
            def __call__(self, carry, _):
                return nn.tanh(nn.Dense(4)(carry)), None

        scan = nn.scan(
            nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=2
        )
        return scan()(x, None)[0]


# name: (module, input rows (ROWS, ...)), each called the usual way inside loss_fn.
LAYERS = {
    "Dense": (lambda: nn.Dense(4), (4,)),
    "LayerNorm": (lambda: nn.LayerNorm(), (16,)),  # 16 features: a gradient-sized scale
    "RMSNorm": (lambda: nn.RMSNorm(), (16,)),
    "MultiHeadDotProductAttention": (
        lambda: nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4),
        (3, 4),
    ),
    "scan_remat": (ScannedBlocks, (4,)),
    "Embed": (lambda: nn.Embed(16, 4), ()),  # a gather
    "Conv": (lambda: nn.Conv(4, (2,)), (3, 4)),  # a convolution
}


def layer_case(name, mesh, squash=jnp.tanh):
    """(step, loss_of, args): `step` accumulates loss_fn closing over a traced
    scale, `squash(module(x) * scale)` squared. On a data x model mesh the scale
    is a vector over the 4 features (JAX takes a scalar into the shard_map there
    itself) and the embedding table is sharded over "model" (a Conv kernel
    cannot be: JAX asks for an out_sharding, closure or not)."""
    make, shape = LAYERS[name]
    module = make()
    if name == "Embed":
        x = jnp.arange(ROWS, dtype=jnp.int32) % 16
    else:
        x = jax.random.normal(jax.random.key(1), (ROWS, *shape))
    params = module.init(jax.random.key(0), x[:1])["params"]
    scale = jnp.full((4,), 2.0) if "model" in mesh.axis_names else jnp.float32(2.0)
    params, scale = jax.device_put((params, scale), NamedSharding(mesh, P()))
    batch = jax.device_put({"x": x}, NamedSharding(mesh, P("data")))

    def loss_of(p, mb, s):
        out = squash(module.apply({"params": p}, mb["x"]) * s)
        return jnp.sum(out * out), {"weight": jnp.float32(mb["x"].shape[0])}

    def step(params, batch, scale):
        loss_fn = lambda p, mb: loss_of(p, mb, scale)  # noqa: E731 - the closure under test
        return accum.accumulate_gradients(loss_fn, params, batch, num_microbatches=N)

    return step, loss_of, (params, batch, scale)


def mechanism(step, args):
    """Which local mechanism `step` traced to: "converted" (the shard_map of the
    closure-converted loss_fn, no varying types), "shard_map" or "vmap"."""
    text = str(jax.make_jaxpr(step)(*args))
    if "shard_map[" not in text:
        return "vmap"
    return "converted" if "check_vma=False" in text else "shard_map"


def check_layer_case(step, loss_of, args, mesh):
    """Full-batch gradients, no in-loop reduction."""
    with jax.set_mesh(mesh):
        compiled = accum.compile_checked(step, *args)
        _, _, grads = compiled(*args)
    params, batch, scale = jax.device_get(args)
    ref = jax.grad(lambda p: loss_of(p, batch, scale)[0] / ROWS)(params)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
    hlo_tools.assert_reduced_once_per_step(compiled.as_text())


def device_groups(batch, devices):
    """Each device's rows of each microbatch, as batches: accum.local's strided
    split of the device's block of ROWS // devices rows."""
    block = ROWS // devices
    rows = [np.arange(d * block + i, (d + 1) * block, N) for d in range(devices) for i in range(N)]
    return [jax.tree.map(lambda x, g=g: x[g], batch) for g in rows]


def ddp_grads(loss_fn, params, groups):
    """The DDP reference: loss_fn's gradients over each group, summed, / ROWS (one
    jit for the groups, which share their shapes: op by op each took seconds)."""
    grad_fn = jax.jit(jax.grad(lambda p, b: loss_fn(p, b)[0]))
    grads = [grad_fn(params, b) for b in groups]
    return jax.tree.map(lambda *g: sum(g) / ROWS, *grads)
