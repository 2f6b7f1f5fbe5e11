"""Helpers that compile a jitted function and report on it. JAX is imported lazily."""

from __future__ import annotations

import glob
import os
import tempfile

from hlo_tools.assertions import assert_reduced_once_per_step
from hlo_tools.collectives import Collective
from hlo_tools.parser import parse
from hlo_tools.report import format_table


def compiled_text(fn, *args, **kwargs) -> str:
    """Compiled HLO text of ``fn(*args, **kwargs)``.

    ``fn`` may be jitted already or a plain function (it is wrapped in
    ``jax.jit``); args may be arrays or ``jax.ShapeDtypeStruct`` (AOT).
    """
    import jax  # deferred: hlo_tools imports only the standard library

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return jitted.lower(*args, **kwargs).compile().as_text()


def report_jitted(fn, *args, **kwargs) -> str:
    """Compile ``fn`` on ``args`` and return the ``hlo-report`` table for it."""
    return format_table(parse(compiled_text(fn, *args, **kwargs)))


def assert_jitted_reduced_once_per_step(
    fn, *args, max_in_loop_elements: int = 8, **kwargs
) -> list[Collective]:
    """Compile ``fn`` on ``args`` and :func:`assert_reduced_once_per_step` on the result."""
    return assert_reduced_once_per_step(
        compiled_text(fn, *args, **kwargs), max_in_loop_elements=max_in_loop_elements
    )


def compile_with_buffers(lowered) -> tuple[object, str]:
    """(compiled, buffer-assignment text) of a ``jax.stages.Lowered``.

    The buffer assignment (see :mod:`hlo_tools.buffers`) is not on the compiled
    object; XLA writes it when asked to dump, which this asks for this one
    compile only (``compiler_options``), into a temporary directory.
    """
    with tempfile.TemporaryDirectory(prefix="hlo_tools_") as directory:
        options = {"xla_dump_to": directory, "xla_dump_hlo_as_text": True}
        compiled = lowered.compile(compiler_options=options)
        pattern = os.path.join(directory, "*after_optimizations-buffer-assignment.txt")
        found = sorted(glob.glob(pattern))
        if len(found) != 1:
            names = sorted(os.listdir(directory))[:10]
            raise RuntimeError(f"expected one buffer-assignment dump, found {found} among {names}")
        with open(found[0]) as f:
            return compiled, f.read()
