"""`profiler=xplane`: a jax.profiler trace of steps profiler_start_step ..
profiler_start_step + profiler_steps - 1, written under run_dir/tensorboard
(plugins/profile/<timestamp>/<host>.xplane.pb), where TensorBoard's profile
plugin and xprof read it: `tensorboard --logdir <run_dir>/tensorboard`.
"""

from __future__ import annotations

import os

import jax

from trainer.config import ConfigError, OutputConfig, TrainingConfig
from trainer.io.metrics import TENSORBOARD_DIR


def check(training: TrainingConfig, output: OutputConfig) -> None:
    """ConfigError naming the key, before anything compiles."""
    if not output.profiler:
        return
    if output.profiler_start_step < 1:
        raise ConfigError(f"profiler_start_step={output.profiler_start_step} must be >= 1")
    if output.profiler_steps < 1:
        raise ConfigError(f"profiler_steps={output.profiler_steps} must be >= 1")
    if output.profiler_start_step > training.steps:
        raise ConfigError(
            f"profiler_start_step={output.profiler_start_step} is after the last step "
            f"(steps={training.steps}); nothing would be profiled"
        )


def trace_dir(run_dir: str) -> str:
    """Where the traces go: run_dir/tensorboard, beside the metrics' event files."""
    return os.path.join(run_dir, TENSORBOARD_DIR)


class Profiler:
    """Starts the trace before step `first` and stops it after step `last` (1-based).

    Call `before(step)` ahead of each step and `after(step)` once it has finished
    (its outputs fetched); a no-op unless `profiler=xplane`.
    """

    def __init__(self, training: TrainingConfig, output: OutputConfig, run_dir: str):
        self.enabled = output.profiler == "xplane"
        self.first = output.profiler_start_step
        self.last = min(output.profiler_start_step + output.profiler_steps - 1, training.steps)
        self.log_dir = trace_dir(run_dir)
        self.active = False

    def before(self, step: int) -> None:
        if self.enabled and not self.active and self.first <= step <= self.last:
            os.makedirs(self.log_dir, exist_ok=True)
            jax.profiler.start_trace(self.log_dir)
            self.active = True

    def after(self, step: int) -> None:
        if self.active and step >= self.last:
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
