"""docs/config.md, the configuration reference, generated from `Config` and the source.

Per group (config.GROUPS): every key, its default, its one-line meaning (the field's
metadata) and the trainer modules that read it, found by scanning their syntax trees,
so the page cannot go stale (test_config_reference regenerates it and compares):

    uv run python -m trainer.config.reference          # rewrite docs/config.md
    uv run python -m trainer.config.reference --check  # exit 1 if it is out of date

A module reads a key when it has `<config>.<key>` (the config under one of the names
in CONFIG_NAMES, or a group view under its group's name with one of that group's
keys), calls a property or method of Config or of a group that reads it
(`config.run_dir`, `config.ici_parallelism()`, `model.emb_dim`), or names it in a
string where a key name is expected (`getattr(config, "hf_train_files")`, a tuple of
key names: `_key_mentions`) or an f-string pattern (`f"ici_{axis}_parallelism"`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import re
import sys
import types
from collections.abc import Iterable

from trainer.config import config as config_lib

# The trainer package (this file is trainer/config/reference.py).
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.abspath(os.path.join(PACKAGE, "..", "..", "..", ".."))
PAGE = os.path.join(REPO, "docs", "config.md")
COMMAND = "uv run python -m trainer.config.reference"
# Names a module holds the whole config under (`run.config` ends in config too).
MIN_PATTERN_TEXT = 5
# Names of a dict of raw overrides (`overrides.get("hf_model_path")`).
OVERRIDE_NAMES = frozenset({"overrides", "values"})
CONFIG_NAMES = frozenset({"config", "cfg", "c"})
# A group view, under its group's name, holds only that group's keys (`data.dtype` is
# an array's, not the model group's dtype).
GROUP_KEYS = {
    name: frozenset(f.name for f in dataclasses.fields(group))
    for name, group in config_lib.GROUPS.items()
}
# A group's own properties and methods (ModelConfig.emb_dim), by the group's name.
GROUP_DERIVED = {
    name: frozenset(
        attr
        for attr, value in vars(group).items()
        if not attr.startswith("_") and isinstance(value, property | types.FunctionType)
    )
    for name, group in config_lib.GROUPS.items()
}
# Names a key's holder goes by: the whole config's or a group view's.
HOLDER_NAMES = CONFIG_NAMES | frozenset(config_lib.GROUPS)


def _holder(node: ast.expr) -> str:
    """The last name of an attribute's object: `run.config` -> config, `config` -> config."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _pattern_keys(node: ast.JoinedStr, keys: Iterable[str]) -> set[str]:
    """The keys an f-string can spell: `f"ici_{axis}_parallelism"` -> every ici_ key.

    Only a key-shaped pattern counts: word characters around its fields, at least
    MIN_PATTERN_TEXT of them (`f"{a}{b}"` or a message spells no particular key).
    """
    text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
    if len(text) < MIN_PATTERN_TEXT or not re.fullmatch(r"\w+", text):
        return set()
    parts = [re.escape(v.value) if isinstance(v, ast.Constant) else r"\w+" for v in node.values]
    pattern = re.compile("".join(parts))
    return {key for key in keys if pattern.fullmatch(key)}


def _key_mentions(nodes: list[ast.AST]) -> list[ast.Constant]:
    """String constants that name a config key by its name: an argument of a call
    that also passes the config (getattr's attribute), an element of a tuple, list or
    set (`for key in ("vocab_size", ...)`), a dict value, a dict key mapping to a
    collection (a table of keys), either side of a comparison or `in` test, and the
    key of an overrides dict's get(). Not: prose, or a record's field that shares a
    key's name (`metrics["learning_rate"]`)."""
    out = []
    for node in nodes:
        if isinstance(node, ast.Call) and any(_holder(a) in HOLDER_NAMES for a in node.args):
            out += node.args  # getattr(config, "key"), open_column(data, ..., "key", ...)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "get" and _holder(node.func.value) in OVERRIDE_NAMES:
                out += node.args[:1]
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            out += node.elts
        elif isinstance(node, ast.Dict):
            out += [
                k
                for k, v in zip(node.keys, node.values, strict=True)
                if isinstance(v, ast.Tuple | ast.List | ast.Set)
            ]
            out += node.values  # a map onto keys: {"hidden_size": "base_emb_dim"}
        elif isinstance(node, ast.Compare):
            out += [node.left, *node.comparators]
    return [node for node in out if isinstance(node, ast.Constant)]


def keys_named(
    tree: ast.AST, keys: frozenset[str], derived: dict[str, set[str]], holders: frozenset[str]
) -> set[str]:
    """The keys `tree` reads (the rules in the module docstring), with the config held
    under the names in `holders`; `derived` maps a Config property or method name to
    the keys it reads."""
    nodes = list(ast.walk(tree))
    found = {node.value for node in _key_mentions(nodes) if node.value in keys}
    for node in nodes:
        if isinstance(node, ast.Attribute) and _holder(node.value) in holders:
            if node.attr in keys:
                found.add(node.attr)
            found |= derived.get(node.attr, set())
        elif isinstance(node, ast.Attribute) and node.attr in GROUP_KEYS.get(
            _holder(node.value), ()
        ):
            found.add(node.attr)  # a group view: config.data.dataset_path, data.dataset_path
        elif isinstance(node, ast.Attribute) and node.attr in GROUP_DERIVED.get(
            _holder(node.value), ()
        ):
            found |= derived.get(node.attr, set())  # a group's property: model.emb_dim
        elif isinstance(node, ast.JoinedStr):
            found |= _pattern_keys(node, keys)
    return found


def _derived_reads(tree: ast.Module, keys: frozenset[str]) -> dict[str, set[str]]:
    """Config's and its groups' own properties and methods -> the keys each reads
    (`emb_dim` is ModelConfig's, so `config.emb_dim` and `model.emb_dim` both read it)."""
    classes = {"Config", *(group.__name__ for group in config_lib.GROUPS.values())}
    out = {}
    for owner in tree.body:
        if isinstance(owner, ast.ClassDef) and owner.name in classes:
            for node in owner.body:
                if isinstance(node, ast.FunctionDef) and node.name not in config_lib.GROUPS:
                    out[node.name] = keys_named(node, keys, {}, frozenset({"self"}))
    return out


def _source_files() -> list[str]:
    """The trainer package's modules (paths relative to it), sorted."""
    out = []
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                out.append(os.path.relpath(os.path.join(root, name), PACKAGE))
    return sorted(out)


# The files declaring Config and its groups: `self.<key>` reads a key only there.
KEY_FILES = ("config/config.py", "config/model_keys.py", "config/run_keys.py")


def derived_reads(keys: frozenset[str]) -> dict[str, set[str]]:
    """`_derived_reads` over every file that declares Config or a group."""
    out: dict[str, set[str]] = {}
    for path in KEY_FILES:
        with open(os.path.join(PACKAGE, path)) as f:
            out.update(_derived_reads(ast.parse(f.read(), path), keys))
    return out


@functools.cache
def readers() -> dict[str, tuple[str, ...]]:
    """Key -> the trainer modules that read it (paths under trainer/, sorted); scanned
    once per process."""
    keys = frozenset(config_lib.FIELDS)
    trees = {}
    for path in _source_files():
        with open(os.path.join(PACKAGE, path)) as f:
            trees[path] = ast.parse(f.read(), path)
    derived = derived_reads(keys)
    out: dict[str, list[str]] = {key: [] for key in config_lib.FIELDS}
    for path, tree in trees.items():
        # `self.<key>` is a config read only in Config's own methods.
        holders = CONFIG_NAMES | {"self"} if path in KEY_FILES else CONFIG_NAMES
        for key in sorted(keys_named(tree, keys, derived, holders)):
            out[key].append(path)
    return {key: tuple(paths) for key, paths in out.items()}


def _default(field: dataclasses.Field) -> str:
    return f"`{field.default!r}`"


def render() -> str:
    """docs/config.md's text."""
    read_by = readers()
    lines = [
        "# Configuration reference",
        "",
        f"Generated from `trainer.config.Config` by `{COMMAND}`; do not edit by hand "
        "(test_config_reference fails when this page is out of date).",
        "",
        "Every key is set on the command line under its flat name (`key=value`, MaxText's "
        "names where the concept is the same) and read as `config.<key>`; a module that "
        "needs one group takes `config.<group>` (a frozen dataclass of that group's keys). "
        "Read by: the modules under packages/trainer/src/trainer that read the key, found "
        "by scanning their source (trainer/config/reference.py says how).",
        "",
    ]
    for name, group in config_lib.GROUPS.items():
        lines += [f"## {name}", "", f"`{group.__name__}`: {group.__doc__.strip()}", ""]
        lines += ["| key | default | meaning | read by |", "|---|---|---|---|"]
        for field in dataclasses.fields(group):
            modules = ", ".join(f"`{m}`" for m in read_by[field.name]) or "(none)"
            meaning = field.metadata["meaning"].replace("|", "\\|")
            lines.append(f"| `{field.name}` | {_default(field)} | {meaning} | {modules} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Write docs/config.md; with --check, compare instead (exit 1 when it differs)."""
    text = render()
    if "--check" in argv:
        with open(PAGE) as f:
            if f.read() == text:
                return 0
        print(f"{PAGE} is out of date: run `{COMMAND}`")
        return 1
    with open(PAGE, "w") as f:
        f.write(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
