"""Why tags matter, in one short file: one gradient all-reduce per step, or one per microbatch.

uv run python examples/tag_demo.py
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a demo of 8 virtual CPU devices

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import hlo_tools  # noqa: E402
import pspec_tags as pt  # noqa: E402

MICROBATCHES = 4


def grad_step(w_DxD, x_MxBxD, tag: bool):
    # Reduced over 'data' = "already summed": its cotangent stays unreduced (partial sums).
    w = jax.reshard(w_DxD, pt.with_reduced(pt.spec_of(w_DxD), {"data"})) if tag else w_DxD

    def body(acc, x_BxD):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x_BxD @ w)))(w)
        return acc + g, None

    acc0 = jax.tree.map(jnp.zeros_like, jax.grad(lambda w: 0.0 * jnp.sum(w))(w))
    acc, _ = jax.lax.scan(body, acc0, x_MxBxD)
    return jax.reshard(acc, P(None, None))  # untagged target: the single reduction


def main():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.eye(64), NamedSharding(mesh, P(None, None)))
        x = jax.device_put(jnp.ones((MICROBATCHES, 32, 64)), NamedSharding(mesh, P(None, "data")))
        for tag in (True, False):
            text = jax.jit(grad_step, static_argnums=2).lower(w, x, tag).compile().as_text()
            inside, outside = hlo_tools.split_by_entry_loop(text)
            print(
                f"tagged={tag!s:5}  gradient all-reduce elements inside the microbatch loop: "
                f"{hlo_tools.cross_replica_all_reduce_sizes(inside)}, after it: "
                f"{hlo_tools.cross_replica_all_reduce_sizes(outside)}"
            )
        print("spec of a reduced parameter:", pt.with_reduced(P("fsdp", None), {"data"}))


if __name__ == "__main__":
    main()
