"""One name per decision (issue 56): `trainer.resolve` is the trainer's only `resolve`,
`RunSpec.with_policy` its only `with_policy`, and docs/design.md's list of decisions
names the functions that make them, every one of them.

Reads text only (`ast`, nothing imported): well under a second.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "packages" / "trainer" / "src" / "trainer"
# A bullet of design.md's list: `- `trainer.module.path.function`: what it decides.`
LISTED = re.compile(r"^- `(trainer\.[\w.]+)`", re.MULTILINE)
# The names a deciding function carries.
DECIDES = re.compile(r"^(resolve|choose|choose_\w+|decide_\w+)$")


def _functions() -> dict[str, str]:
    """Every function and method of the trainer: dotted name -> its defining name."""
    found = {}
    for path in sorted(TRAINER.rglob("*.py")):
        module = ".".join(path.relative_to(TRAINER.parent).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                found[f"{module}.{node.name}"] = node.name
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        found[f"{module}.{node.name}.{item.name}"] = item.name
    return found


def _listed() -> list[str]:
    return LISTED.findall((ROOT / "docs" / "design.md").read_text())


def test_one_resolve_and_one_with_policy():
    functions = _functions()
    resolves = sorted(name for name, short in functions.items() if short == "resolve")
    assert resolves == ["trainer.run.spec.resolve"]
    policies = sorted(name for name, short in functions.items() if short == "with_policy")
    assert policies == ["trainer.run.spec.RunSpec.with_policy"]


def test_design_lists_every_decision_under_its_code_name():
    functions, listed = _functions(), _listed()
    assert len(listed) >= 5
    missing = [name for name in listed if name not in functions]
    assert not missing, f"docs/design.md names functions the code does not have: {missing}"
    deciders = {name for name, short in functions.items() if DECIDES.match(short)}
    unlisted = sorted(deciders - set(listed))
    assert not unlisted, f"deciding functions missing from docs/design.md's list: {unlisted}"
