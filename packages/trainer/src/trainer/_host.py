"""Sharing a host with other commands: which JAX platform a command may start, and what
JAX's import prints where no CUDA driver is.

- `cpu_only()`: a command that computes nothing on a device (`export-hf`) pins JAX to
  its CPU platform before any backend starts. JAX then loads no accelerator runtime:
  libtpu, whose lockfile lets one process at a time hold the chips, stays free for a
  run or compile beside it. (export-hf reads a run's checkpoint with no backend at all,
  io/checkpoint_host.py; the pin covers a LoRA run's merge, which computes.)
- `quiet_jax_import()`: with the `gpu` extra installed on a host without a CUDA driver,
  jaxlib's GPU kernel modules and the CUDA plugin each log "Could not find cuda
  drivers on your machine, GPU will not be used." at import (three or four lines,
  each after absl's "before InitializeLog" warning). They mean only that this host has
  no NVIDIA driver, which a GPU compile on a CPU host expects and a CPU run does not
  care about; absl writes them before its log level can be set, so they are dropped
  from stderr while JAX is imported and while it registers its plugins (JAX's private
  `xla_bridge._discover_and_register_pjrt_plugins`, wrapped where JAX calls it; left
  alone where a JAX release lacks it). Every other line passes through.

Imports nothing of the trainer: the console scripts (`_scripts.py`) call it first.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

# The CUDA plugin's line (cudart_stub.cc) and absl's warning printed before each one.
NO_DRIVER = "Could not find cuda drivers on your machine, GPU will not be used."
ABSL_PREAMBLE = "WARNING: All log messages before absl::InitializeLog() is called"


def cpu_only() -> None:
    """Pin JAX to the CPU platform (before any backend starts; a no-op after)."""
    import jax  # here: the pin must come before any backend starts, not at import

    jax.config.update("jax_platforms", "cpu")


def _kept(lines: list[str]) -> list[str]:
    """`lines` without the no-driver lines and the absl warning leading each."""
    kept = []
    for line in lines:
        if NO_DRIVER in line:
            if kept and kept[-1].startswith(ABSL_PREAMBLE):
                kept.pop()
            continue
        kept.append(line)
    return kept


@contextlib.contextmanager
def _stderr_without_no_driver_lines() -> Iterator[None]:
    """File descriptor 2 (C++ logging writes there, not to sys.stderr) goes to a
    temporary file for the block, then every line but the no-driver ones is written."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(_kept(lines)))
            sys.stderr.flush()


def quiet_jax_import() -> None:
    """Import JAX with the no-driver lines left out, and leave them out of its plugin
    registration too (what the first backend start or topology does, and logs); nothing
    when JAX is imported already. Starts no backend, decides no platform."""
    if "jax" in sys.modules:
        return
    with _stderr_without_no_driver_lines():
        import jax  # noqa: F401  (here: the one import of JAX whose stderr is filtered)
    from jax._src import xla_bridge

    # JAX registers its plugins (the CUDA plugin logs again) on first use, reading the
    # platform list then: the registration is wrapped where it is, not moved earlier.
    register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
    if register is not None and not getattr(register, "quiet", False):

        def quietly() -> None:
            with _stderr_without_no_driver_lines():
                register()

        quietly.quiet = True
        xla_bridge._discover_and_register_pjrt_plugins = quietly
