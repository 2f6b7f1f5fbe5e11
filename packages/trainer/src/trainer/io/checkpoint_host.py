"""A checkpoint step read on the host from orbax's files, with no JAX backend (export-hf).

orbax's restore asks JAX for the process index and places the arrays on devices:
it starts a backend (on a TPU host: libtpu, which takes the chips' lockfile, so a
run or compile beside it fails). Writing a Hugging Face directory needs neither:
the saved config and the parameters as numpy arrays. orbax writes them as files a
reader without devices can open: each JSON item as a file (`meta/metadata`), each
array as a zarr array (zarr3 or zarr v2; inside an OCDBT database by default) named
by its tree path, and the tree's paths listed in the item's `_METADATA`.
tensorstore (orbax's own array store) reads them.
"""

from __future__ import annotations

import json
import os

import numpy as np
import tensorstore as ts

from trainer.config import ConfigError

# orbax's JSON item handler writes its item into this file of the item's directory.
JSON_FILE = "metadata"
# The pytree item's list of its leaves' paths and how its arrays are stored.
TREE_FILE = "_METADATA"


def read_json_item(step_dir: str, item: str) -> dict:
    """The JSON item `item` (e.g. "meta") of checkpoint step directory `step_dir`."""
    path = os.path.join(step_dir, item, JSON_FILE)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: not a readable orbax JSON item ({error})") from None


def _leaf_paths(directory: str) -> list[tuple[str, ...]]:
    """The tree paths of the arrays saved in pytree item `directory`."""
    path = os.path.join(directory, TREE_FILE)
    try:
        with open(path) as f:
            tree = json.load(f)["tree_metadata"]
    except (OSError, ValueError, KeyError) as error:
        raise ConfigError(f"{path}: not an orbax pytree listing ({error!r})") from None
    paths = []
    for entry in tree.values():
        if entry["value_metadata"].get("skip_deserialize"):
            continue  # None leaves and the like: no array behind them
        paths.append(tuple(str(key["key"]) for key in entry["key_metadata"]))
    return paths


def _spec(directory: str, name: str, ocdbt: bool, zarr3: bool) -> dict:
    """tensorstore's spec of the array saved under `name` (its dot-joined tree path)."""
    base = os.path.abspath(directory)
    kvstore = (
        {"driver": "ocdbt", "base": f"file://{base}", "path": name}
        if ocdbt
        else {"driver": "file", "path": os.path.join(base, name)}
    )
    return {"driver": "zarr3" if zarr3 else "zarr", "kvstore": kvstore}


def read_arrays(step_dir: str, item: str, tops: tuple[str, ...]) -> dict[str, dict]:
    """{top: nested dict of numpy arrays} for each of the `tops` subtrees of pytree item
    `item` in checkpoint step directory `step_dir` (e.g. "state", ("params", "router")).

    Dict-keyed trees only (what the trainer saves); the arrays as saved (their dtype,
    their global shape). ConfigError naming the file for a layout this does not read.
    """
    directory = os.path.join(step_dir, item)
    with open(os.path.join(directory, TREE_FILE)) as f:
        layout = json.load(f)
    ocdbt, zarr3 = bool(layout.get("use_ocdbt", True)), bool(layout.get("use_zarr3", False))
    trees: dict[str, dict] = {top: {} for top in tops}
    for path in _leaf_paths(directory):
        if path[0] not in trees:
            continue
        spec = _spec(directory, ".".join(path), ocdbt, zarr3)
        array = ts.open(spec, read=True).result().read().result()
        node = trees[path[0]]
        for key in path[1:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = np.asarray(array)
    for top, tree in trees.items():
        if not tree:
            raise ConfigError(f"{directory}: holds no {top!r} arrays")
    return trees
