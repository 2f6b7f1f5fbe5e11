"""Every rule in the library that owns it: the trainer's ConfigError for a value
moe_kernels or accum refuses carries that library's own reason, word for word, and
names the trainer's key. The library's reason is got here from the library itself,
called with the same values under its own names, so the two cannot drift apart (a
restated rule in the trainer would word it its own way and fail here)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum
import moe_kernels
from trainer.config import ConfigError, make_config
from trainer.config.moe_map import KEY_OF_FIELD
from trainer.config.validate import validate
from trainer.run import plan_reduction
from trainer.run import run as run_lib
from trainer.run.spec import resolve

# Trainer overrides -> the same values as MoEConfig fields (the default model's
# num_experts=8, n_routing_groups=2, topk_routing_group=1 where a rule reads them).
ROUTING = [
    ({"num_experts_per_tok": "9"}, {"num_experts": 8, "num_experts_per_tok": 9}),
    ({"num_experts": "0"}, {"num_experts": 0}),
    ({"n_routing_groups": "3"}, {"num_experts": 8, "n_groups": 3}),
    ({"n_routing_groups": "0"}, {"num_experts": 8, "n_groups": 0}),
    ({"topk_routing_group": "3"}, {"num_experts": 8, "n_groups": 2, "topk_groups": 3}),
    (
        {"num_experts_per_tok": "5"},
        {"num_experts": 8, "num_experts_per_tok": 5, "n_groups": 2, "topk_groups": 1},
    ),
    ({"routed_topk_method": "greedy"}, {"num_experts": 8, "n_groups": 2, "topk_method": "greedy"}),
    ({"capacity_factor": "-1"}, {"capacity_factor": -1.0}),
    ({"base_moe_mlp_dim": "0"}, {"mlp_dim": 0}),
]


def _reason(call) -> str:
    """The library's ValueError message for `call()`."""
    with pytest.raises(ValueError) as error:
        call()
    return str(error.value)


@pytest.mark.parametrize("overrides,fields", ROUTING, ids=[",".join(o) for o, _ in ROUTING])
def test_a_routing_error_is_moe_kernels_reason_named_by_the_trainer_key(overrides, fields):
    reason = _reason(lambda: moe_kernels.MoEConfig(**fields))
    config = make_config(overrides)
    with pytest.raises(ConfigError) as error:
        validate(config, 8)
    message = str(error.value)
    assert reason in message
    for key in overrides:  # the key the user wrote, with its value as parsed
        value = getattr(config, key)
        assert key in message and (repr(value) if isinstance(value, str) else str(value)) in message
    # Every field moe_kernels names is named as the trainer's key too.
    for field, key in KEY_OF_FIELD.items():
        if re.search(rf"\b{field}\b", reason):
            assert re.search(rf"\b{key}\b", message), (key, message)


def test_every_field_maps_to_a_trainer_key():
    config = make_config({})
    assert set(KEY_OF_FIELD) <= {f.name for f in dataclasses.fields(moe_kernels.MoEConfig)}
    for key in KEY_OF_FIELD.values():
        assert hasattr(config.model, key), key


def _tiny_plan(sizes, **kwargs) -> accum.ReductionPlan:
    """accum.make_plan on a one-leaf tree over a mesh of `sizes`, batch over every axis."""
    mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes), devices=jax.devices()[:8])
    w = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P()))
    return accum.make_plan({"w": w}, batch_axes=tuple(sizes), mesh_shape=sizes, **kwargs)


ONE_SLICE = {"data": 8}
TWO_SLICES = {"dcn_data": 2, "data": 4}
# Trainer overrides -> the same refusal from accum, called directly.
PLANS = [
    (
        {"gradient_reduction_policy": "hierarchical"},
        "gradient_reduction_policy=hierarchical",
        lambda: _tiny_plan(ONE_SLICE, policy="hierarchical", slice_axes=()),
    ),
    (
        {"num_slices": "2", "gradient_reduction_policy": "hierarchical", "shard_mode": "auto"},
        "gradient_reduction_policy=hierarchical",
        lambda: _tiny_plan(
            TWO_SLICES, policy="hierarchical", mode="auto", slice_axes=("dcn_data",)
        ),
    ),
    (
        {"gradient_accumulation_schedule": "overlapped_ring", "shard_mode": "auto"},
        "gradient_accumulation_schedule=overlapped_ring",
        lambda: accum.check_schedule("overlapped_ring", _tiny_plan(ONE_SLICE, mode="auto")),
    ),
    (
        {
            "gradient_accumulation_schedule": "overlapped_ring",
            "gradient_reduction_policy": "per_microbatch",
        },
        "gradient_accumulation_schedule=overlapped_ring",
        lambda: accum.check_schedule(
            "overlapped_ring", _tiny_plan(ONE_SLICE, policy="per_microbatch")
        ),
    ),
]
PLAN_IDS = [",".join(o.values()) for o, _, _ in PLANS]


@pytest.mark.parametrize("overrides,named,library", PLANS, ids=PLAN_IDS)
def test_a_plan_error_is_accums_reason_named_by_the_trainer_key(overrides, named, library):
    reason = _reason(library)
    with pytest.raises(ConfigError) as error:
        resolve(make_config(overrides), jax.devices())
    assert str(error.value).startswith(named) and reason in str(error.value)
    # The AOT compile takes the same path (abstract_setup = build of a resolved spec).
    with pytest.raises(ConfigError, match=f"^{named}"):
        run_lib.abstract_setup(make_config(overrides), jax.devices())


@pytest.mark.parametrize("overrides,named,library", PLANS, ids=PLAN_IDS)
def test_plan_reduction_refuses_what_train_refuses(overrides, named, library, capsys):
    args = ["compile_topology=v5e-8", *(f"{k}={v}" for k, v in overrides.items())]
    args = [a.replace("num_slices=", "compile_topology_num_slices=") for a in args]
    assert plan_reduction.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: {named}") and _reason(library) in err
