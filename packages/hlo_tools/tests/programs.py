"""The microbatch gradient-accumulation program of the JAX page "Autodiff and sharding".

A stack of LAYERS tanh layers (scan over layers) trained on MICROBATCHES
microbatches (scan over microbatches), data-parallel over an 8-device mesh.

- tagged: the weights are resharded to ``P(None, None, None, reduced={'data'})``
  before the loop, so each microbatch gradient comes out unreduced over
  ``data``; the partial sums accumulate in the carry and one reshard after the
  loop performs the single all-reduce.
- replicated: the weights stay plain replicated; every per-layer weight
  gradient is all-reduced inside both loops (LAYERS x MICROBATCHES times).
"""

from __future__ import annotations

LAYERS, WIDTH, MICROBATCHES, BATCH = 3, 4, 2, 16
# TPU tiles are 8x128: use a lane-sized width there so the layouts look real.
TPU_WIDTH, TPU_BATCH = 128, 64


def make_step(tagged: bool, scatter: bool = False):
    """The training step ``(weights[L,D,D], batches[M,B,D]) -> summed gradient``.

    ``scatter`` (tagged only) reshards the gradient to ``P(None, 'data', None)``
    instead of replicated, as ZeRO-1 does: a reduce-scatter instead of an all-reduce.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def loss(ws, x):
        def layer(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(layer, x, ws)
        return jnp.sum(h)

    def step(ws, xs):
        if tagged:
            ws = jax.reshard(ws, P(None, None, None, reduced={"data"}))
            acc = jax.reshard(
                jnp.zeros(ws.shape, ws.dtype), P(None, None, None, unreduced={"data"})
            )
        else:
            acc = jnp.zeros_like(ws)

        def microbatch(acc, x):
            return acc + jax.grad(loss)(ws, x), None

        grads, _ = jax.lax.scan(microbatch, acc, xs)
        # The reshard away from unreduced is the one all-reduce of the step.
        out = P(None, "data", None) if scatter else P(None, None, None)
        return jax.reshard(grads, out) if tagged else grads

    return jax.jit(step)


def cpu_args(mesh):
    """Concrete arguments on the 8-device CPU mesh: replicated weights, batch-sharded data."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    ws = jax.device_put(jnp.ones((LAYERS, WIDTH, WIDTH)), NamedSharding(mesh, P()))
    xs = jax.device_put(
        jnp.ones((MICROBATCHES, BATCH, WIDTH)), NamedSharding(mesh, P(None, "data", None))
    )
    return ws, xs


def cpu_mesh():
    """An all-Explicit ('data',) mesh over the 8 virtual CPU devices."""
    import jax
    from jax.sharding import AxisType

    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def compile_cpu(tagged: bool) -> str:
    """Compiled HLO text of the program on the CPU mesh."""
    import jax

    mesh = cpu_mesh()
    with jax.set_mesh(mesh):
        return make_step(tagged).lower(*cpu_args(mesh)).compile().as_text()


def compile_tpu(tagged: bool, topology: str = "v5e:2x4", scatter: bool = False) -> str:
    """Compiled HLO text for a TPU topology, ahead of time on this host (needs libtpu)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    topo = topologies.get_topology_desc(topology, "tpu")
    mesh = Mesh(np.array(topo.devices).reshape(-1), ("data",), axis_types=(AxisType.Explicit,))
    ws = jax.ShapeDtypeStruct(
        (LAYERS, TPU_WIDTH, TPU_WIDTH), jnp.float32, sharding=NamedSharding(mesh, P())
    )
    xs = jax.ShapeDtypeStruct(
        (MICROBATCHES, TPU_BATCH, TPU_WIDTH),
        jnp.float32,
        sharding=NamedSharding(mesh, P(None, "data", None)),
    )
    with jax.set_mesh(mesh):
        return make_step(tagged, scatter).lower(ws, xs).compile().as_text()
