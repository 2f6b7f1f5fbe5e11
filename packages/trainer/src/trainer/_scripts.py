"""The console scripts (pyproject's `[project.scripts]`): each readies the host
(`_host.py`) before its command imports JAX, then runs the command.

Each imports JAX with the CUDA plugin's no-driver lines left out; `export-hf`, which
reads and writes files only, then pins JAX to the CPU platform itself (its `main`).
"""

from __future__ import annotations

import sys

from trainer import _host


def train() -> None:
    """`train`."""
    _host.quiet_jax_import()
    # deferred: the host is readied before the command's modules import JAX
    from trainer.run import main

    main.run()


def export_hf() -> None:
    """`export-hf`."""
    _host.quiet_jax_import()
    # deferred: the host is readied before the command's modules import JAX
    from trainer.io import export_hf as command

    sys.exit(command.main())


def generate() -> None:
    """`generate`."""
    _host.quiet_jax_import()
    # deferred: the host is readied before the command's modules import JAX
    from trainer.generate import cli

    cli.run()


def plan_reduction() -> None:
    """`plan-reduction`."""
    _host.quiet_jax_import()
    # deferred: the host is readied before the command's modules import JAX
    from trainer.run import plan_reduction as command

    command.run()
