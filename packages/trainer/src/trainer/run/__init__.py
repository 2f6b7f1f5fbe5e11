"""A run: from a config to a trained model, and the command lines around it.

- run.py: `setup(config)` (mesh, model, state, jitted step: a `Run`), `compile_step`,
  `train`, `startup_lines`; report.py (what the binary prints).
- main.py: the `train` console script; aot.py: `compile_for_topology` (TPU and GPU
  topologies on this host, gpu_topology.py); plan_reduction.py: `plan-reduction`;
  evaluate.py: evaluation during training; floor.py: the untagged reference step.
- xla_options.py: the XLA flags a run sets.
"""

from trainer._lazy import exports

_EXPORTS = {
    "Run": "trainer.run.run",
    "setup": "trainer.run.run",
    "compile_step": "trainer.run.run",
    "train": "trainer.run.run",
    "startup_lines": "trainer.run.run",
    "compile_for_topology": "trainer.run.aot",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS)
