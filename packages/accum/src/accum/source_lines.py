"""The user's source lines of a traced equation: the frames outside jax, jaxlib
and accum, as the trace-time guard's messages name them (`where`) and the compiled
verdict matches them against an HLO instruction's stack (`user_lines`)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import jax

# Frames in these directories are library plumbing, not the model's lines.
# jaxlib (installed with jax, not imported by accum) is located, not imported.
_SKIP_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (jax.__file__, importlib.util.find_spec("jaxlib").origin, __file__)
)


def where(eqn: Any, depth: int = 2) -> str:
    """'file:line (function)' of the innermost `depth` frames outside jax, jaxlib and accum.

    Transposed equations carry the source info of the forward equation they
    came from, so for a backward equation this names the forward line; the
    caller's frame is added because that line is often in a helper (a `_dot`
    or `_gather` method). Reads the traceback's frames (public attributes of
    jaxlib's Traceback) rather than jax's private source_info_util; '?' when
    there are none.
    """
    frames = getattr(getattr(getattr(eqn, "source_info", None), "traceback", None), "frames", None)
    user = [
        f"{frame.file_name}:{frame.line_num} ({frame.function_name})"
        for frame in frames or ()
        if not os.path.abspath(frame.file_name).startswith(_SKIP_DIRS)
    ]
    return ", called from ".join(user[:depth]) or "?"


def user_lines(eqn: Any, depth: int = 2) -> tuple[tuple[str, int], ...]:
    """(file basename, line) of the innermost `depth` frames outside jax, jaxlib
    and accum: the key the compiled verdict matches an HLO instruction's stack by."""
    frames = getattr(getattr(getattr(eqn, "source_info", None), "traceback", None), "frames", None)
    user = [
        (os.path.basename(frame.file_name), frame.line_num)
        for frame in frames or ()
        if not os.path.abspath(frame.file_name).startswith(_SKIP_DIRS)
    ]
    return tuple(user[:depth])
