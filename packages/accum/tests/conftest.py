"""Fixtures for the accum tests: the toy model on each mesh, compiled once per session."""

import importlib.util
import sys
from pathlib import Path

import jax
import pytest

HERE = Path(__file__).parent
BATCH = 96  # divisible by num_microbatches 1..4 times the 8 batch-sharding devices


def _load(name):
    # Tests run with --import-mode=importlib, so sibling modules are loaded by path.
    spec = importlib.util.spec_from_file_location(f"accum_tests_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # Registered first: dataclasses resolve string annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


TOY = _load("toy_model")
if (
    importlib.util.find_spec("flax") is not None
):  # the closure tests' Flax layers; they skip without
    _load("closure_cases")


class Setup:
    """Mesh, placed params and batch, model and the full-batch reference for one mesh."""

    def __init__(self, name, mode):
        self.name, self.mode = name, mode
        self.mesh = TOY.make_mesh(name, mode)
        self.rules = TOY.rules_for(name)
        self.specs = TOY.param_specs(self.mesh, self.rules)
        with jax.set_mesh(self.mesh):
            self.params = TOY.place(TOY.init_params(0), self.specs, self.mesh)
            self.batch = TOY.place(
                TOY.make_batch(1, BATCH),
                TOY.batch_specs(self.mesh, self.rules),
                self.mesh,
            )
        self.model = TOY.Model(self.mesh, self.rules, mode)
        self._ref = None
        self._cache = {}

    def reference(self):
        """Full-batch (loss, aux), grads: one jax.grad over the whole batch, no accumulation."""
        if self._ref is None:
            fn = jax.jit(jax.value_and_grad(self.model.full_batch_loss, has_aux=True))
            with jax.set_mesh(self.mesh):
                self._ref = fn(self.params, self.batch)
        return self._ref

    def cached(self, key, build):
        """Memoize an expensive build (a compiled function) under `key`."""
        if key not in self._cache:
            with jax.set_mesh(self.mesh):
                self._cache[key] = build()
        return self._cache[key]


_SETUPS = {}


@pytest.fixture(scope="session")
def toy():
    """The toy model module."""
    return TOY


@pytest.fixture(scope="session")
def get_setup():
    """get_setup(mesh_name, mode='explicit') -> a session-cached Setup."""

    def get(name, mode="explicit"):
        if (name, mode) not in _SETUPS:
            _SETUPS[name, mode] = Setup(name, mode)
        return _SETUPS[name, mode]

    return get


HELPERS = _load("helpers")


@pytest.fixture(scope="session")
def close():
    """assert_trees_close(actual, expected, rtol=1e-5, atol=0.0)."""
    return HELPERS.assert_trees_close


@pytest.fixture(scope="session")
def generator():
    """tests/guard_generator.py: seeded random models and the HLO oracle."""
    return _load("guard_generator")
