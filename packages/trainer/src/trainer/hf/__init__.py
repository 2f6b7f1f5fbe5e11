"""Hugging Face checkpoints in and out: `load`, `save`, `forward`.

A HF directory (config.json, one safetensors file or several with
model.safetensors.index.json, tokenizer.json) of model_type deepseek_v3,
deepseek_v2 or kimi_k2 (V3's layout) maps onto the trainer's Config and parameter
tree and back. Nothing outside this package knows the HF names. `params` here is
the pair of trees the trainer's state holds: {"params": ..., "router": ...} (the
router tree holds the routing biases, HF's e_score_correction_bias), stacked for
the scanned layers.
docs/hf.md has the key table.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trainer import model as model_lib
from trainer.config import Config, ConfigError, hf_map, make_config, mesh_shape
from trainer.hf import export_config, keys, notes, safetensors, stream
from trainer.hf import peft as peft  # the PEFT adapter format (hf.peft.save_adapter)
from trainer.model import pipeline_slots
from trainer.sharding import ShardCtx, logical_rules, make_mesh

# Shards above this size get split (transformers' default max_shard_size is 5 GB).
MAX_SHARD_BYTES = 5 * 1024**3
# transformers 5 writes the chat template to chat_template.jinja (not into
# tokenizer_config.json): copied in whichever file the source holds it.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
FILE_DTYPE = {"float32": "F32", "bfloat16": "BF16"}  # export dtype -> safetensors name


def config_from_hf(path: str, **overrides: Any) -> Config:
    """The trainer Config of HF directory `path`; `overrides` (trainer keys) win."""
    hf = hf_map.read_config_json(path)
    return make_config({**hf_map.from_hf(hf, os.path.join(path, "config.json")), **overrides})


def default_ctx(config: Config) -> ShardCtx:
    """One device: what `load` places on when no ShardCtx is given."""
    devices = jax.devices()[:1]
    mesh = make_mesh(mesh_shape(config, 1), config.shard_mode, devices)
    return ShardCtx(mesh, logical_rules(config.parallelism), config.shard_mode)


def plan_import(path: str, config: Config, targets: dict[str, dict]) -> stream.Plan:
    """Check the files of `path` against `targets` ({"params", "router"} trees of
    ShapeDtypeStructs): SafetensorsError naming file and key before any data is read."""
    hf = hf_map.read_config_json(path)
    leaves = keys.leaves(targets, config, hf_map.family_of(hf))
    refs = safetensors.read_directory(path)
    return stream.check(leaves, refs, config.base_num_decoder_layers, path)


def import_params(
    path: str, config: Config, ctx: ShardCtx, progress: bool = True, model=None
) -> dict[str, dict]:
    """{"params", "router"} of HF directory `path`, streamed onto `ctx`'s mesh in the
    shardings the trainer gives them (`model`: its ModelDef, when already built).
    With `progress`, one stderr line per config.json key read otherwise than it says
    or not used (hf.notes)."""
    model = model or model_lib.define(config.model, ctx)
    params_abs, router_abs = model_lib.abstract_state(model, ctx)
    padded = {"params": params_abs, "router": router_abs}
    # Uneven pipeline stages: the L real MoE layers read, then put in their slots.
    targets = pipeline_slots.stored_abstract(padded, model.moe_layout)
    plan = plan_import(path, config, targets)
    if progress:
        for note in notes.lines(hf_map.read_config_json(path), config):
            print(f"hf import: {note}", file=sys.stderr, flush=True)
    trees = stream.import_leaves(plan, targets, progress, config.hf_check_finite)
    return pipeline_slots.to_slots(trees, padded, model.moe_layout)


def load(
    path: str, *, ctx: ShardCtx | None = None, progress: bool = True, **overrides: Any
) -> tuple[Config, dict[str, dict]]:
    """(Config, {"params", "router"}) of HF directory `path`.

    `overrides` are trainer config keys (e.g. dtype="float32"); a shape key that
    disagrees with the weights is a one-line error naming the tensor. Placed on
    `ctx`'s mesh (default: one device).
    """
    config = config_from_hf(path, **overrides)
    return config, import_params(path, config, ctx or default_ctx(config), progress)


def _check_empty(path: str) -> None:
    """ConfigError when `path` already holds a checkpoint: stale shards beside new
    ones would mix two models, and nothing already saved may be overwritten."""
    if not os.path.isdir(path):
        return
    held = [n for n in os.listdir(path) if n.endswith(".safetensors") or n == safetensors.INDEX]
    if held:
        raise ConfigError(f"{os.path.join(path, held[0])} exists: export into a new directory")


def _check_exportable(config: Config, params: dict[str, dict], model_type: str) -> None:
    if model_type != "deepseek_v2" or not config.num_moe_layers:
        return
    # numpy, not jnp: the arrays may be host arrays read with no backend (export-hf)
    bias = np.asarray(params["router"]["moe_layers"]["ffn"]["bias"])
    if bool(np.any(bias != 0)):
        raise ConfigError(
            "the routing biases are nonzero, and deepseek_v2 (softmax routing) has no "
            "e_score_correction_bias to hold them: set routed_bias_update_rate=0 for V2"
        )


def save(
    path: str,
    config: Config,
    params: dict[str, dict],
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: bool = True,
    dtype: str | None = None,
    source: str | None = None,
) -> list[str]:
    """Write `params` ({"params", "router"}) as a HF directory transformers loads:
    config.json, generation_config.json when token ids are known, and safetensors,
    sharded with an index above `max_shard_bytes`.

    `source`: the HF directory the model was imported from; its config.json keys
    the trainer did not change, its generation_config.json and its dtype are kept
    (hf.export_config). `dtype` (float32 or bfloat16) is every tensor's but the
    routing biases' (float32); default: the source's, else each parameter's own
    (weight_dtype), so an f32 round trip is bitwise. Returns the config.json keys
    written otherwise than the source's, one phrase each (export_config.changes)."""
    source_hf = export_config.read_source(source)
    if source and source_hf is None:
        raise ConfigError(f"{source}/config.json: not found (source= is the imported directory)")
    if dtype is None and source_hf is not None:
        dtype = export_config.source_dtype(source_hf, source)
    if dtype is not None and dtype not in export_config.EXPORT_DTYPES:
        raise ConfigError(f"export_dtype={dtype!r} is not one of {export_config.EXPORT_DTYPES}")
    computed = hf_map.to_hf(config)
    _check_exportable(config, params, computed["model_type"])
    _check_empty(path)
    hf = export_config.merge(computed, source_hf, config)
    hf = export_config.set_dtype(hf, dtype or config.weight_dtype)
    leaves = keys.leaves(params, config, computed["model_type"])
    leaves = [leaf for leaf in leaves if not leaf.optional]
    leaves += keys.mtp_copies(leaves, config.base_num_decoder_layers)

    def dtype_of(leaf: keys.Leaf) -> np.dtype:
        if dtype is None:
            return np.dtype(_leaf_array(params, leaf).dtype)
        # Routing biases stay float32, as in DeepSeek's files.
        return safetensors.DTYPES["F32" if leaf.tree == "router" else FILE_DTYPE[dtype]]

    entries = list(stream.export_tensors(leaves, params, dtype_of))
    sizes = {name: int(np.prod(shape)) * kind.itemsize for name, _, shape, kind in entries}
    groups = safetensors.plan_shards(sizes, max_shard_bytes)
    files = safetensors.shard_names(len(groups))
    os.makedirs(path, exist_ok=True)
    by_name = {entry[0]: entry for entry in entries}
    bar = stream.Progress("hf export", len(entries), sum(sizes.values()), progress)
    for file, group in zip(files, groups, strict=True):
        chunk = [by_name[name] for name in group]
        written = safetensors.write_file(os.path.join(path, file), chunk)
        bar.add(len(chunk), written)
    if len(files) > 1:
        weight_map = {
            name: file for file, group in zip(files, groups, strict=True) for name in group
        }
        safetensors.write_index(path, weight_map, sum(sizes.values()))
    generation = export_config.generation_config(hf, source)
    if generation is not None:
        export_config.write_json(os.path.join(path, export_config.GENERATION_CONFIG), generation)
    export_config.write_json(os.path.join(path, "config.json"), hf)
    return export_config.changes(source_hf, hf)


def _leaf_array(trees: dict, leaf: keys.Leaf):
    node = trees[leaf.tree]
    for key in leaf.path:
        node = node[key]
    return node


def copy_tokenizer(source: str, destination: str) -> list[str]:
    """Copy the tokenizer files `source` has into `destination`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(destination, name))
            copied.append(name)
    return copied


def _mesh_of(params: dict[str, dict]):
    leaf = jax.tree.leaves(params)[0]
    return leaf.sharding.mesh


@functools.cache
def _forward_fn(config: Config, mesh):
    """The jitted forward of `config` on `mesh` (built once per pair)."""
    ctx = ShardCtx(mesh, logical_rules(config.parallelism), config.shard_mode)
    model = model_lib.define(config.model, ctx)

    def run(params, router, tokens_BxS):
        positions_BxS = jnp.broadcast_to(jnp.arange(tokens_BxS.shape[1]), tokens_BxS.shape)
        segments_BxS = jnp.ones_like(tokens_BxS)
        logits, _ = model_lib.apply(model, params, router, tokens_BxS, positions_BxS, segments_BxS)
        return logits

    return jax.jit(run)


def forward(config: Config, params: dict[str, dict], tokens) -> jax.Array:
    """Logits [batch, seq, vocab] (float32) for int tokens [batch, seq]: positions
    from 0, one segment, causal. Runs on the mesh the parameters live on."""
    mesh = _mesh_of(params)
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens of shape {tokens.shape} must be [batch, seq]")
    with jax.set_mesh(mesh):
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        tokens = jax.device_put(tokens, replicated)
        return _forward_fn(config, mesh)(params["params"], params["router"], tokens)
