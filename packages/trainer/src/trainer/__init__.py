"""tagtrain's trainer: DeepSeek-style MoE training in JAX under explicit sharding, each
gradient reduced once per optimizer step (accum), on CPU, GPU and TPU, and compiled for
TPU and GPU topologies on a CPU host.

The public API (`__all__`; every other module is internal and may move):

- Configuration: `Config`, the typed configuration `train key=value ...` builds;
  `make_config(overrides)` (a preset plus overrides, type-checked), `parse_overrides`
  (`key=value` words to a dict), `validate(config, num_devices)` (what depends on the
  machine: the mesh, batch sizes); `ConfigError`, what every bad key or value raises.
- A run, decided then built: `resolve(config, devices)` makes every decision (the
  validated config, mesh, model, auto's gradient_reduction_policy, the reduction plan)
  as a frozen `RunSpec`; `build(spec)` makes state and jitted step from it (`Run`);
  `setup(config)` does both, with the data, checkpoints and initial weights;
  `compile_step(run)`, `train(run)` (the per-step metrics), `startup_lines(run)` (what
  the binary prints before training).
- `compile_for_topology(config)`: the step compiled for a TPU or GPU topology on this
  host, with its memory (`compile_topology=`).
- `hf`: Hugging Face checkpoints, `hf.load`, `hf.forward`, `hf.save`.

The command lines: `train`, `plan-reduction`, `export-hf`, `plot-metrics`
(docs/training.md). Names load on first use, so `import trainer` starts no JAX backend.
"""

from __future__ import annotations

from trainer._lazy import exports

__version__ = "0.1.0"

# name -> the module that defines it ("" for a subpackage of that name).
_EXPORTS = {
    "Config": "trainer.config",
    "ConfigError": "trainer.config",
    "make_config": "trainer.config",
    "parse_overrides": "trainer.config",
    "validate": "trainer.config.validate",
    "RunSpec": "trainer.run.spec",
    "resolve": "trainer.run.spec",
    "build": "trainer.run.run",
    "Run": "trainer.run.run",
    "setup": "trainer.run.run",
    "compile_step": "trainer.run.run",
    "train": "trainer.run.run",
    "startup_lines": "trainer.run.run",
    "compile_for_topology": "trainer.run.aot",
    "hf": "",
}

__all__ = [*_EXPORTS, "__version__"]
__getattr__, __dir__ = exports(__name__, _EXPORTS)
