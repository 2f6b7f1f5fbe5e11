"""Issue 7's matrix, auto mode: each parallelism layout equals one device.

The same layouts and check as test_parallelism.py (conftest.LAYOUTS); a file of
its own so the two halves compile on different test workers.
"""

MATRIX_MODE = "auto"  # conftest.SLOW_LAYOUTS: the layouts left to the slow tier


def test_auto_layout_matches_single_device(matrix_layout, check_layout):
    check_layout(matrix_layout, "auto")


def test_auto_mode_lays_optimizer_state_out_like_the_parameters():
    """Under FSDP, XLA left to itself replicated Adam's moments in auto mode."""
    import jax

    from trainer.config import make_config
    from trainer.run import run as run_lib
    from trainer_tests_layouts import EIGHT_DEVICE_LAYOUTS

    config = make_config({**EIGHT_DEVICE_LAYOUTS["fsdp"], "shard_mode": "auto"})
    run = run_lib.setup(config)
    params = run.state["params"]
    moments = [
        node
        for node in jax.tree.leaves(
            run.state["opt_state"],
            is_leaf=lambda n: jax.tree.structure(n) == jax.tree.structure(params),
        )
        if jax.tree.structure(node) == jax.tree.structure(params)
    ]
    assert len(moments) == 2  # Adam's mu and nu
    sharded = 0
    for moment in moments:
        for m, p in zip(jax.tree.leaves(moment), jax.tree.leaves(params), strict=True):
            assert m.sharding.spec == p.sharding.spec
            sharded += "fsdp" in str(p.sharding.spec)
    assert sharded > 0
