"""What a run reads and writes besides its data.

- checkpoint.py (orbax saves and restores, with checkpoint_keys.py, checkpoint_files.py,
  checkpoint_dtypes.py, checksums.py, stop_signals.py), initial_weights.py (weights
  from a checkpoint or a Hugging Face directory), export_hf.py (the `export-hf`
  command line), with checkpoint_host.py (a checkpoint read on the host, no JAX
  backend).
- metrics.py (JSONL and TensorBoard), plots.py / plots_moe.py (`plot-metrics`),
  profiling.py (profiler traces).
"""

from trainer._lazy import exports

_EXPORTS = {
    "Checkpointer": "trainer.io.checkpoint",
    "open_checkpointer": "trainer.io.checkpoint",
    "MetricsWriter": "trainer.io.metrics",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS)
