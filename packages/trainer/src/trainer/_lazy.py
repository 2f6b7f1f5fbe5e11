"""Names a package declares but loads on first use.

The command lines (`train`, `generate`, `export-hf`, ...) check every key before JAX
and the model code load, so a typo costs a fraction of a second. The packages on
that path declare their API through `exports`: the names are the package's, the
modules that define them load when a name is first read.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def exports(package: str, names: dict[str, str]) -> tuple[Callable, Callable]:
    """`__getattr__` and `__dir__` for `package`: `names` maps each exported name to
    the module defining it ("" for `package`'s subpackage of that name)."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = names[name]
        value = (
            importlib.import_module(f"{package}.{name}")
            if not module
            else getattr(importlib.import_module(module), name)
        )
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return __getattr__, __dir__
