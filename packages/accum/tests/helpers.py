"""Assertions shared by the accum tests."""

import jax
import numpy as np


def assert_trees_close(actual, expected, rtol=1e-5, atol=0.0):
    """Leafwise allclose, with the failing leaf's key path in the message.

    atol is relative to the leaf's largest magnitude (gradients of very
    different scales would otherwise need per-leaf tolerances).
    """
    flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_e = jax.tree.leaves(expected)
    assert len(flat_a) == len(flat_e), "tree structures differ"
    for (path, a), e in zip(flat_a, flat_e, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        scale = float(np.max(np.abs(e))) if e.size else 0.0
        np.testing.assert_allclose(
            a, e, rtol=rtol, atol=atol * scale, err_msg=jax.tree_util.keystr(path)
        )
