"""What XLA:TPU sends across slices for one reduction, compiled for two v5e slices of
4, 8 and 16 chips on this CPU host: accum.cost's rule (`cost.crosses_whole`: a
vector of at most VECTOR_TILE elements per in-slice device, or a row of at most
ROW_TILE, crosses whole; longer ones and arrays of two or more rows cross as their
in-slice shard) against hlo_tools' count of the megascale sends, array by array, so
a libtpu that draws the line elsewhere fails here before it skews a model's
prediction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import accum
from accum import cost
from trainer.sharding.slices import slice_major
from trainer.step import reduction_bytes

pytestmark = pytest.mark.aot
pytest.importorskip("libtpu", reason="needs the tpu extra (libtpu): uv run --extra tpu")

AXES = ("dcn_data", "data")
GA = 4


def _mesh(chips_per_slice: int) -> Mesh:
    from jax.experimental import topologies

    name = {4: "v5e:2x2", 8: "v5e:2x4", 16: "v5e:4x4"}[chips_per_slice]
    devices = topologies.get_topology_desc(name, "tpu", num_slices=2).devices
    return Mesh(np.array(slice_major(devices)).reshape(2, chips_per_slice), AXES)


def _compiled_sum_over_microbatches(mesh, shape, dtype):
    """A GA-microbatch loop that all-reduces a replicated array's per-microbatch
    value over both axes and sums it (XLA moves the reduction after the loop)."""

    def body(x):
        def microbatch(i, acc):
            # psum in the shard_map: the reduction per microbatch, as autodiff's.
            return acc + jax.lax.psum(jnp.sin(x * (i + 1).astype(x.dtype)), AXES)

        return jax.lax.fori_loop(0, GA, microbatch, jnp.zeros_like(x))

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))
    arg = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
    return fn.lower(arg).compile().as_text()


def _predicted_crossing(mesh, shape, dtype):
    """accum.cost's after-loop dcn_data bytes for the same reduction: a per-microbatch
    leaf the loop only sums."""
    sizes = dict(mesh.shape)
    arg = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
    plan = accum.make_plan(
        {"x": arg}, batch_axes=AXES, mesh_shape=sizes, policy="per_microbatch", slice_axes=AXES[:1]
    )
    events = cost.plan_events(
        plan,
        {"x": arg},
        num_microbatches=GA,
        compute_dtype=dtype,
        accum_dtype="float32",
        summed_by_the_loop={"x": True},
    )
    inside, outside = cost.bytes_per_axis(events, AXES, sizes, AXES[:1])
    return inside["dcn_data"], outside["dcn_data"]


# (chips per slice, local shape, dtype, crosses whole), at each line (a vector's 1,024
# elements per chip, a row's 128, whatever the dtype) and at twice it, where each
# chip's shard is whole tiles (an array just past the line crosses as uneven shards
# padded to a tile, which the count does not read back).
CASES = [
    (8, (8192,), "float32", True),
    (8, (16384,), "float32", False),
    (8, (8192,), "bfloat16", True),
    (8, (16384,), "bfloat16", False),
    (8, (1, 1024), "float32", True),
    (8, (1, 2048), "float32", False),
    (8, (1, 1024), "bfloat16", True),
    (8, (2, 128), "float32", False),
    (4, (4096,), "float32", True),
    (4, (8192,), "float32", False),
    (4, (1, 512), "float32", True),
    (4, (1, 1024), "float32", False),
    (16, (16384,), "float32", True),
    (16, (1, 2048), "float32", True),
    (16, (1, 4096), "float32", False),
]


@pytest.mark.parametrize(
    "chips,shape,dtype,whole",
    CASES,
    ids=[f"{c}chips-{'x'.join(map(str, s))}-{d}" for c, s, d, _ in CASES],
)
def test_small_vectors_and_rows_cross_slices_whole(chips, shape, dtype, whole):
    mesh = _mesh(chips)
    text = _compiled_sum_over_microbatches(mesh, shape, dtype)
    counted = reduction_bytes.counted_cross_slice(text)
    nbytes = int(np.prod(shape)) * jnp.dtype(dtype).itemsize
    assert counted == (0, nbytes if whole else nbytes // chips)
    assert _predicted_crossing(mesh, shape, dtype) == counted
