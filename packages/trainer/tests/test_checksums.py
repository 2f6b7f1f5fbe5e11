"""trainer.io.checksums: damage that still decodes changes the checksum; sharding does not."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from trainer.io import checksums


def _tree():
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.standard_normal((8, 6), np.float32)),
        "b": jnp.asarray(rng.standard_normal((6,)), jnp.bfloat16),
        "step": jnp.int32(7),
    }


def test_one_flipped_bit_or_two_swapped_elements_change_the_checksum():
    tree = _tree()
    before = checksums.of_tree(tree)
    w = np.asarray(tree["w"])
    flipped = w.copy()
    flipped.view(np.uint32)[3, 2] ^= 1 << 20
    swapped = w.copy()
    swapped[[0, 5]] = swapped[[5, 0]]
    for damaged in (flipped, swapped):
        after = checksums.of_tree({**tree, "w": jnp.asarray(damaged)})
        assert after["w"] != before["w"]
        assert after["b"] == before["b"] and after["step"] == before["step"]
    assert set(before) == {"w", "b", "step"}


def test_the_checksum_does_not_depend_on_the_sharding():
    tree = _tree()
    single = checksums.of_tree(jax.device_put(tree, jax.devices()[0]))
    mesh = jax.make_mesh((4, 2), ("a", "b"), devices=jax.devices()[:8])
    sharded = {
        "w": jax.device_put(tree["w"], NamedSharding(mesh, P("a", "b"))),
        "b": jax.device_put(tree["b"], NamedSharding(mesh, P("b"))),  # replicated over a
        "step": jax.device_put(tree["step"], NamedSharding(mesh, P())),
    }
    assert checksums.of_tree(sharded) == single
    # Equal values at other positions: the sum is positional.
    assert single["w"] != checksums.of_tree({"w": tree["w"].T.reshape(8, 6)})["w"]
