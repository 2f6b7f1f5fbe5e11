"""Decide, then build (run/spec.py): `resolve` makes every decision of a run, frozen;
`build` makes state and step from a spec and decides nothing."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from trainer.config import ConfigError, make_config
from trainer.config.layer_loop import decide_scan_layers
from trainer.run import run as run_lib
from trainer.run.spec import RunSpec, check_built, resolve, resolve_abstract

GA4 = {"gradient_accumulation_steps": "4", "per_device_batch_size": "1"}


@pytest.fixture(scope="module")
def auto_spec() -> RunSpec:
    return resolve(make_config(GA4), jax.devices())


def test_resolve_decides_auto_once_and_freezes_it(auto_spec):
    assert make_config(GA4).gradient_reduction_policy == "auto"
    chosen = auto_spec.config.gradient_reduction_policy
    assert chosen != "auto" and chosen == auto_spec.choice.policy
    assert auto_spec.plan.policy == chosen
    assert auto_spec.mesh_shape["data"] == 8 and auto_spec.batch_size == 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        auto_spec.config = make_config({})  # type: ignore[misc]


def test_resolve_allocates_no_parameter(auto_spec):
    leaves = jax.tree.leaves(auto_spec.trained)
    assert leaves and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)


def test_an_explicit_policy_is_taken_as_given():
    spec = resolve(
        make_config({**GA4, "gradient_reduction_policy": "per_microbatch"}), jax.devices()
    )
    assert spec.choice is None and spec.plan.policy == "per_microbatch"


def test_with_policy_changes_the_policy_and_the_plan_only(auto_spec):
    other = auto_spec.with_policy("per_microbatch")
    assert other.config.gradient_reduction_policy == "per_microbatch"
    assert other.plan.policy == "per_microbatch" and auto_spec.plan.policy != "per_microbatch"
    assert other.ctx is auto_spec.ctx and other.model is auto_spec.model
    assert other.trained is auto_spec.trained and other.devices == auto_spec.devices


def test_build_takes_the_spec_as_decided(auto_spec):
    spec = auto_spec.with_policy("per_microbatch")
    run = run_lib.build(spec, abstract=True)
    assert run.spec is spec and run.plan is spec.plan
    assert run.config.gradient_reduction_policy == "per_microbatch"


def test_resolve_refuses_a_bad_layout_before_building():
    with pytest.raises(ConfigError, match="ici_data_parallelism=-1 cannot fill 8 devices"):
        resolve(make_config({"ici_fsdp_parallelism": "3"}), jax.devices())


def test_check_built_names_a_parameter_unlike_the_spec(auto_spec):
    built = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding), auto_spec.trained
    )
    check_built(auto_spec, built)  # the same: no error
    path, first = jax.tree_util.tree_leaves_with_path(built)[0]
    wrong = jax.tree.map(
        lambda s: (
            jax.ShapeDtypeStruct(s.shape, jnp.bfloat16, sharding=s.sharding) if s is first else s
        ),
        built,
    )
    name = re.escape(f"built parameter {jax.tree_util.keystr(path)} is bfloat16")
    with pytest.raises(RuntimeError, match=name):
        check_built(auto_spec, wrong)


def test_resolve_abstract_decides_as_resolve_without_devices(auto_spec):
    abstract = resolve_abstract(make_config(GA4), num_devices=8)
    assert abstract.devices == () and abstract.mesh_shape == auto_spec.mesh_shape
    assert abstract.config == auto_spec.config and abstract.batch_size == auto_spec.batch_size
    assert abstract.plan.policy == auto_spec.plan.policy
    assert abstract.plan.deferred_axes == auto_spec.plan.deferred_axes
    shapes = lambda spec: jax.tree.map(lambda s: (s.shape, s.dtype), spec.trained)  # noqa: E731
    assert shapes(abstract) == shapes(auto_spec)
    # 16 devices: no machine has them here, the abstract mesh does.
    assert resolve_abstract(make_config(GA4), num_devices=16).mesh_shape["data"] == 16


class _Device:
    """A device of `platform` as layer_loop reads it (only `.platform`)."""

    def __init__(self, platform):
        self.platform = platform


@pytest.mark.parametrize(
    ("overrides", "platform", "scans"),
    [
        ({}, "gpu", False),  # auto: unrolled on GPUs (one launch per kernel)
        ({}, "cpu", True),
        ({}, "tpu", True),
        ({"gradient_accumulation_schedule": "overlapped"}, "gpu", True),  # needs the scan
        ({"scan_layers": "true"}, "gpu", True),  # given: kept
        ({"scan_layers": "false"}, "tpu", False),
    ],
)
def test_scan_layers_auto_is_decided_by_platform_and_schedule(overrides, platform, scans):
    config = make_config({"model_name": "tagtrain-tiny", **overrides})
    decided = decide_scan_layers(config, (_Device(platform),) * 2)
    assert decided.scan_layers is scans


def test_resolve_decides_scan_layers_for_its_devices(auto_spec):
    assert make_config({}).scan_layers == "auto"
    # CPU devices: scanned, a bool from here on (the model, the plan and the step read it).
    assert auto_spec.config.scan_layers is True
    assert resolve_abstract(make_config({"model_name": "tagtrain-tiny"})).config.scan_layers is True
