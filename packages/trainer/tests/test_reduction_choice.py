"""gradient_reduction_policy=auto and `plan-reduction`: the config value, the ranking
rules, the refusals, and the planner's table on abstract meshes (nothing compiles;
the compiled-memory fallback runs in the aot tier's compiles)."""

import dataclasses

import jax
import pytest

from accum import cost as cost_lib
from accum.hardware import HARDWARE
from trainer.config import ConfigError, make_config
from trainer.run import plan_reduction
from trainer.step import reduction_choice


def test_auto_is_the_default_and_explicit_values_keep_their_meaning():
    assert make_config({}).gradient_reduction_policy == "auto"
    explicit = make_config({"gradient_reduction_policy": "hierarchical"})
    assert explicit.gradient_reduction_policy == "hierarchical"
    # A config's own fields passed back in is fine.
    assert make_config(dict(make_config({}).__dict__)).gradient_reduction_policy == "auto"


def _choice(**overrides):
    config = plan_reduction.config_of([f"{k}={v}" for k, v in overrides.items()])
    return plan_reduction.choice_for(config)[0]


def test_one_slice_picks_deferred_and_two_slices_never_per_microbatch_first():
    one = _choice(
        model_name="tagtrain-test", compile_topology="v5e-8", gradient_accumulation_steps=4
    )
    assert one.order == ("deferred", "per_microbatch")
    two = _choice(
        model_name="tagtrain-test",
        compile_topology="v5e-8",
        num_slices=2,
        dcn_data_parallelism=2,
        gradient_accumulation_steps=4,
    )
    assert set(two.order) == {"deferred", "hierarchical", "per_microbatch"}
    assert two.order.index("hierarchical") < two.order.index("per_microbatch")
    dcn = {p: c.link_bytes[cost_lib.DCN] for p, c in two.costs.items()}
    assert dcn["per_microbatch"] > dcn["hierarchical"]


def test_at_ga2_per_microbatch_moves_bytes_but_deferred_stays_within_the_margin():
    # accum.cost places what XLA moves: tagtrain-test's leaves outside the looping
    # layer scan are reduced once after the loop, in bf16, under per_microbatch. At
    # GA=2 that is fewer bytes than deferred's one f32 reduction of everything, and a
    # slightly shorter predicted step; within DEFERRED_MARGIN (the model has no
    # per-collective term) deferred stays first.
    bf16 = _choice(
        model_name="tagtrain-test", compile_topology="v5e-8", gradient_accumulation_steps=2
    )
    per_mb, deferred = bf16.costs["per_microbatch"], bf16.costs["deferred"]
    assert 0 < per_mb.bytes_outside["data"] < deferred.bytes_outside["data"]
    per_mb_total = per_mb.bytes_in_loop["data"] + per_mb.bytes_outside["data"]
    assert per_mb_total < deferred.bytes_outside["data"]
    margin = 1 - reduction_choice.DEFERRED_MARGIN
    assert margin * deferred.step_seconds < per_mb.step_seconds < deferred.step_seconds
    assert bf16.order == ("deferred", "per_microbatch")
    # Outside the margin the faster policy leads.
    faster = dataclasses.replace(per_mb, step_seconds=0.8 * deferred.step_seconds)
    costs = {"deferred": deferred, "per_microbatch": faster}
    assert reduction_choice.rank(costs, across_slices=False) == ("per_microbatch", "deferred")


def test_overlapped_ring_leaves_per_microbatch_out_of_the_candidates():
    # The ring has nothing to ring under per_microbatch (accum.check_schedule), so
    # auto never falls back onto a combination an explicit config is refused.
    ring = _choice(
        model_name="tagtrain-test",
        compile_topology="v5e-8",
        gradient_accumulation_steps=4,
        gradient_accumulation_schedule="overlapped_ring",
    )
    assert ring.order == ("deferred",)


def test_rank_puts_hierarchical_before_per_microbatch_across_slices():
    # Even where the figures would favour per_microbatch (forced here), it follows hierarchical.
    fake = {
        p: cost_lib.Cost(p, {}, {}, {}, {}, 0.0, 0.0, 0.0, float(t), 0.0, 0)
        for p, t in (("per_microbatch", 1), ("hierarchical", 3), ("deferred", 2))
    }
    assert reduction_choice.rank(fake, across_slices=True) == (
        "deferred",
        "hierarchical",
        "per_microbatch",
    )
    assert reduction_choice.rank(fake, across_slices=False)[0] == "per_microbatch"


def test_no_policy_fits_is_one_line_naming_what_to_change():
    choice = reduction_choice.Choice(("deferred", "per_microbatch"), {}, None, "")
    choice = reduction_choice.next_choice(choice, "compiled 20.00 GiB > 16 GiB HBM")
    assert choice.policy == "per_microbatch"
    with pytest.raises(ConfigError) as error:
        reduction_choice.next_choice(choice, "compiled 19.00 GiB > 16 GiB HBM")
    message = str(error.value)
    assert "\n" not in message
    assert "found no policy that fits in HBM (deferred: compiled 20.00 GiB" in message
    assert "lower per_device_batch_size" in message


def _unlink_v4(monkeypatch):
    """The table with v4's link figures missing (an entry no source completes)."""
    v4 = dataclasses.replace(HARDWARE["v4"], ici_bytes_per_s=None, dcn_bytes_per_s=None)
    monkeypatch.setitem(HARDWARE, "v4", v4)


def test_hardware_for_names_the_assumption_and_refuses_incomplete_entries(monkeypatch):
    _unlink_v4(monkeypatch)
    config = make_config({})
    hw, note = reduction_choice.hardware_for(config.parallelism, config.accumulation, jax.devices())
    assert hw.name == "v5e" and "no hardware table entry for 'cpu': assumed v5e" in note
    config = make_config({"reduction_hardware": "v4"})
    with pytest.raises(ConfigError, match=r"'v4' lacks ici_bytes_per_s.*reduction_hardware="):
        reduction_choice.hardware_for(config.parallelism, config.accumulation, [])
    config = make_config({"compile_topology": "v6e-8"})
    hw, note = reduction_choice.hardware_for(config.parallelism, config.accumulation, [])
    assert hw.name == "v6e" and "compile_topology=v6e-8" in note


def test_planner_prints_the_table_and_refuses_bad_input(capsys, monkeypatch):
    _unlink_v4(monkeypatch)
    args = ["model_name=tagtrain-test", "compile_topology=v5p-16", "num_slices=2"]
    assert plan_reduction.main([*args, "gradient_accumulation_steps=8"]) == 0
    out = capsys.readouterr().out
    assert "tagtrain-test on v5p-16 x 2 slices, mesh dcn_data=2, data=8, GA=8" in out
    rows = [line.split()[0] for line in out.splitlines() if "MiB" not in line and " ms" not in line]
    assert {"deferred", "hierarchical", "per_microbatch"} <= set(rows)
    assert "<- chosen" in out and "predicted only, nothing compiled" in out
    assert plan_reduction.main(["compile_topology=v9x-8"]) == 2
    assert "compile_topology='v9x-8' is not a known TPU or GPU topology" in capsys.readouterr().err
    assert plan_reduction.main(["model_name=tagtrain-test"]) == 2
    assert "plan-reduction needs compile_topology=" in capsys.readouterr().err
    assert plan_reduction.main([*args, "reduction_hardware=v4"]) == 2
    assert "'v4' lacks ici_bytes_per_s" in capsys.readouterr().err


class _Run:
    def __init__(self, policy, choice):
        self.policy, self.reduction_choice = policy, choice


def test_compile_first_fitting_skips_what_does_not_fit_and_names_it():
    gib = reduction_choice.GIB
    sizes = {
        "deferred": 20 * gib,
        "hierarchical": "RESOURCE_EXHAUSTED: out of HBM",
        "per_microbatch": 9 * gib,
    }

    def compile_run(run):
        if isinstance(sizes[run.policy], str):
            raise RuntimeError(sizes[run.policy])
        return sizes[run.policy]

    choice = reduction_choice.Choice(("deferred", "hierarchical", "per_microbatch"), {}, None, "")
    run, compiled = reduction_choice.compile_first_fitting(
        _Run("deferred", choice), compile_run, lambda c: _Run(c.policy, c), 16 * gib, lambda c: c
    )
    assert run.policy == "per_microbatch" and compiled == 9 * gib
    assert run.reduction_choice.skipped == (
        "deferred: compiled 20.00 GiB > 16 GiB HBM",
        "hierarchical: XLA: RESOURCE_EXHAUSTED: out of HBM",
    )
    assert (
        "skipped deferred: compiled 20.00 GiB"
        in reduction_choice.startup_lines(run.reduction_choice)[1]
    )
    # An explicit policy compiles once, whatever its size; another error is not a misfit.
    run, compiled = reduction_choice.compile_first_fitting(
        _Run("deferred", None), compile_run, None, 16 * gib, lambda c: c
    )
    assert compiled == 20 * gib
    with pytest.raises(RuntimeError, match="boom"):
        reduction_choice.compile_first_fitting(
            _Run("deferred", choice),
            lambda r: (_ for _ in ()).throw(RuntimeError("boom")),
            None,
            0,
            int,
        )
    with pytest.raises(ConfigError, match="found no policy that fits in HBM"):
        reduction_choice.compile_first_fitting(
            _Run("deferred", choice),
            lambda r: 99 * gib,
            lambda c: _Run(c.policy, c),
            16 * gib,
            lambda c: c,
        )
