"""The code's layout: imports run one way, and source files stay small.

Every module under `packages/*/src` is parsed with `ast` (nothing is imported) and
the first-party import graph is built from every import statement: module level,
under `if TYPE_CHECKING:`, and inside functions (a deferred import still ties two
modules together). Checked:

- no import circle anywhere in packages/;
- no function-local first-party import in the four libraries (pspec_tags, hlo_tools,
  accum, moe_kernels); in the trainer only where a comment says why (a command line
  deferring JAX and the model code until its arguments are checked);
- a package imports only the packages below it (docs/design.md, "Packages"), and a
  trainer subpackage only the ones below it in `TRAINER_LAYERS`;
- no source file over `MAX_LINES` lines.

Reads text only: well under a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("pspec_tags", "hlo_tools", "accum", "moe_kernels")
# Which first-party packages each package may import (docs/design.md, "Packages").
MAY_IMPORT = {
    "pspec_tags": set(),
    "hlo_tools": set(),
    "accum": {"pspec_tags", "hlo_tools"},
    "moe_kernels": {"pspec_tags"},
    "trainer": {"pspec_tags", "hlo_tools", "accum", "moe_kernels"},
}
MAX_LINES = 500
# The trainer's subpackages, lowest first: each imports only those before it
# (docs/design.md, "The trainer's layout"). "_lazy" and "_host" are the top-level
# helpers below everything; "_scripts" (the console scripts) sits above everything.
TRAINER_LAYERS = (
    "_lazy",
    "_host",
    "config",
    "sharding",
    "model",
    "hf",
    "data",
    "step",
    "io",
    "run",
    "generate",
    "_scripts",
)


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module under packages/*/src."""
    found = {}
    for src in sorted(ROOT.glob("packages/*/src")):
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


class _Imports(ast.NodeVisitor):
    """The first-party modules one module imports: (target, line, inside a function)."""

    def __init__(self, name: str, is_package: bool):
        self.name, self.is_package = name, is_package
        self.depth = 0
        self.found: list[tuple[str, int, bool]] = []

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def _add(self, dotted: str, line: int) -> None:
        # The longest known module the name starts with: `from a.b import c` names
        # module a.b.c when there is one, else a.b (c is a name defined in it).
        while dotted and dotted not in MODULES:
            dotted = dotted.rpartition(".")[0]
        if dotted and dotted != self.name:
            self.found.append((dotted, line, self.depth > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.name.split(".")
            if not self.is_package:
                package.pop()
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([node.module] if node.module else []))
        for alias in node.names:
            self._add(f"{base}.{alias.name}", node.lineno)


def _imports() -> dict[str, list[tuple[str, int, bool]]]:
    out = {}
    for name, path in MODULES.items():
        visitor = _Imports(name, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), str(path)))
        out[name] = visitor.found
    return out


IMPORTS = _imports()


def _package(module: str) -> str:
    return module.split(".")[0]


def _circles(graph: dict[str, list[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one node of `graph` (node ->
    the nodes it imports): Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


CIRCLES = _circles({m: sorted({t for t, _, _ in IMPORTS[m]}) for m in MODULES})


def test_every_package_is_parsed():
    assert {_package(m) for m in MODULES} == set(MAY_IMPORT)
    assert sum(len(found) for found in IMPORTS.values()) > 100  # the walk sees imports


def test_the_circle_finder_finds_circles():
    graph = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": [], "e": ["f"], "f": ["e", "a"]}
    assert sorted(map(sorted, _circles(graph))) == [["a", "b", "c"], ["e", "f"]]
    assert _circles({"a": ["b"], "b": ["c"], "c": []}) == []


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_package_has_no_import_circle(package):
    circles = [sorted(c) for c in CIRCLES if any(_package(m) == package for m in c)]
    assert not circles, f"import circles in {package}: {circles}"


@pytest.mark.parametrize("library", LIBRARIES)
def test_library_has_no_function_local_first_party_import(library):
    # A deferred first-party import hides a circle (or a layering the reader cannot
    # see at the top of the file); libraries defer only third-party imports.
    local = [
        f"{MODULES[m].relative_to(ROOT)}:{line} imports {target}"
        for m, found in IMPORTS.items()
        if _package(m) == library
        for target, line, in_function in found
        if in_function
    ]
    assert not local, "\n".join(local)


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_packages_import_only_the_ones_below(package):
    upward = sorted(
        f"{MODULES[m].relative_to(ROOT)}:{line} imports {target}"
        for m, found in IMPORTS.items()
        if _package(m) == package
        for target, line, _ in found
        if _package(target) != package and _package(target) not in MAY_IMPORT[package]
    )
    assert not upward, "\n".join(upward)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_source_files_are_small(package):
    big = [
        f"{path.relative_to(ROOT)}: {_lines(path)} lines"
        for m, path in MODULES.items()
        if _package(m) == package and _lines(path) > MAX_LINES
    ]
    assert not big, f"over {MAX_LINES} lines: {big}"


def _layer(module: str) -> str:
    """The trainer subpackage (or top-level module) `module` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_trainer_module_has_a_layer():
    loose = [m for m in MODULES if _package(m) == "trainer" and m != "trainer"]
    assert all(_layer(m) in TRAINER_LAYERS for m in loose), sorted(
        m for m in loose if _layer(m) not in TRAINER_LAYERS
    )


def test_trainer_subpackages_import_only_the_ones_below():
    upward = sorted(
        f"{MODULES[m].relative_to(ROOT)}:{line} imports {target}"
        for m, found in IMPORTS.items()
        if _package(m) == "trainer" and m != "trainer"
        for target, line, _ in found
        if _package(target) == "trainer"
        and target != "trainer"
        and TRAINER_LAYERS.index(_layer(target)) > TRAINER_LAYERS.index(_layer(m))
    )
    assert not upward, "\n".join(upward)


def _has_reason(path: Path, line: int) -> bool:
    """A comment on the import's block of import lines, or on the line above it."""
    lines = path.read_text().splitlines()
    start = line - 1
    while start > 0 and lines[start - 1].strip().startswith(("from ", "import ")):
        start -= 1
    end = line - 1
    while end + 1 < len(lines) and lines[end + 1].strip().startswith(("from ", "import ")):
        end += 1
    return any("#" in text for text in lines[max(start - 1, 0) : end + 1])


def test_trainer_defers_first_party_imports_only_with_a_reason():
    unexplained = [
        f"{MODULES[m].relative_to(ROOT)}:{line} imports {target}"
        for m, found in IMPORTS.items()
        if _package(m) == "trainer"
        for target, line, in_function in found
        if in_function and not _has_reason(MODULES[m], line)
    ]
    assert not unexplained, "function-local imports without a comment saying why:\n" + "\n".join(
        unexplained
    )
