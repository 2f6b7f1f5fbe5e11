"""A run: from a config to a trained model, and the command lines around it.

- spec.py: `resolve(config, devices)`, every decision of a run (validation, mesh,
  model, the auto gradient_reduction_policy, the reduction plan) as a frozen `RunSpec`.
- run.py: `build(spec)` (state and jitted step: a `Run`; decides nothing), `setup(config)`
  (resolve, open the inputs, build, restore), `compile_step`, `train`, `startup_lines`;
  report.py (what the binary prints).
- main.py: the `train` console script; aot.py: `compile_for_topology` (TPU and GPU
  topologies on this host, gpu_topology.py); plan_reduction.py: `plan-reduction`;
  evaluate.py: evaluation during training; floor.py: the untagged reference step.
- xla_options.py: the XLA flags a run sets.
"""

from trainer._lazy import exports

_EXPORTS = {
    "RunSpec": "trainer.run.spec",
    "resolve": "trainer.run.spec",
    "build": "trainer.run.run",
    "start": "trainer.run.run",
    "Run": "trainer.run.run",
    "setup": "trainer.run.run",
    "compile_step": "trainer.run.run",
    "train": "trainer.run.run",
    "startup_lines": "trainer.run.run",
    "compile_for_topology": "trainer.run.aot",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS)
