"""trainer.hf against transformers' own numbers, on the committed tiny checkpoints.

The fixtures (tests/fixtures/hf/, built by `nox -s hf_fixtures`) hold
transformers' float32 logits for fixed tokens; `hf.forward` after `hf.load` must
match them to 1e-4. Round trips are bitwise; bad files and keys fail in one line
naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
from pathlib import Path

import jax
import numpy as np
import pytest

from trainer import hf
from trainer.config import FIELDS, ConfigError, hf_map, make_config, mesh_shape
from trainer.hf import safetensors
from trainer.sharding import ShardCtx, logical_rules, make_mesh

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
NAMES = (
    "v3_yarn",
    "v2_lite",
    "v2_grouped",
    "v3_fp8",
    "v3_sharded_mtp",
    "v3_chat",
    "moonlight",
    "kimi_k2",
)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def loaded():
    """Each fixture loaded once (float32 compute) on one device."""
    return {name: hf.load(str(FIXTURES / name), dtype="float32", progress=False) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(loaded, name):
    config, params = loaded[name]
    reference = np.load(FIXTURES / name / "reference.npz")
    logits = np.asarray(hf.forward(config, params, reference["tokens"]))
    assert logits.shape == reference["logits"].shape
    assert np.abs(logits - reference["logits"]).max() <= TOLERANCE


def test_fixtures_record_a_transformers_with_v2s_yarn_softmax_scale():
    """transformers 4.57 and 5.0 leave mscale^2 out of V2's softmax scale, 5.18+ and
    DeepSeek's code keep it (as the trainer does): v2_lite's logits need the latter."""
    version = json.loads((FIXTURES / "manifest.json").read_text())["transformers"]
    major, minor = (int(x) for x in version.split(".")[:2])
    assert (major, minor) >= (5, 18), version


def test_v3_mtp_tensors_are_skipped_and_the_index_is_read(capsys):
    config, _ = hf.load(str(FIXTURES / "v3_sharded_mtp"), dtype="float32")
    assert "skipping" in capsys.readouterr().err
    refs = safetensors.read_directory(str(FIXTURES / "v3_sharded_mtp"))
    assert len({ref.path for ref in refs.values()}) > 2
    assert any(name.startswith(f"model.layers.{config.base_num_decoder_layers}.") for name in refs)


def _tensors(directory: str) -> dict[str, np.ndarray]:
    return {n: np.asarray(r.array()) for n, r in safetensors.read_directory(directory).items()}


def test_save_load_round_trip_is_bitwise(loaded, tmp_path):
    """f32 fixture -> trainer -> files: the same tensors, bit for bit, sharded with
    an index; loading the export gives the same parameters bit for bit."""
    config, params = loaded["v3_yarn"]
    hf.save(str(tmp_path), config, params, max_shard_bytes=60_000, progress=False)
    assert os.path.isfile(tmp_path / safetensors.INDEX)
    original, exported = _tensors(str(FIXTURES / "v3_yarn")), _tensors(str(tmp_path))
    assert sorted(original) == sorted(exported)
    for name, value in original.items():
        assert exported[name].dtype == value.dtype and np.array_equal(exported[name], value), name
    with pytest.raises(ConfigError, match="exists: export into a new directory"):
        hf.save(str(tmp_path), config, params, progress=False)  # nothing saved is overwritten
    _, again = hf.load(str(tmp_path), dtype="float32", progress=False)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, again
    )


def test_streamed_onto_8_devices_equals_one_device(loaded):
    """Every device's slice (experts over 'expert', embed over 'fsdp') read on its own
    from the memory maps equals the single-device import, fp8 dequantization included."""
    config, params = loaded["v3_fp8"]
    config = dataclasses.replace(
        config, ici_fsdp_parallelism=2, ici_expert_parallelism=4, ici_data_parallelism=1
    )
    mesh = make_mesh(mesh_shape(config, 8), config.shard_mode, jax.devices()[:8])
    ctx = ShardCtx(mesh, logical_rules(config.parallelism), config.shard_mode)
    sharded = hf.import_params(str(FIXTURES / "v3_fp8"), config, ctx, progress=False)
    wi = sharded["params"]["moe_layers"]["ffn"]["wi_0"]
    assert len({str(s.index) for s in wi.addressable_shards}) > 1  # really split
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, sharded
    )


def test_config_round_trips_through_config_json(loaded):
    for name in NAMES:
        config, _ = loaded[name]
        hf_config = hf_map.to_hf(config)
        again = make_config({**hf_map.from_hf(hf_config), "dtype": "float32"})
        assert again == config, name


def test_every_key_is_in_the_docs_table():
    docs = (Path(__file__).parents[3] / "docs" / "hf.md").read_text()
    missing = [key for key in hf_map.KEY_KINDS if f"`{key}`" not in docs]
    assert not missing


def _copy(name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    return target


def test_unknown_key_and_model_type_are_refused(tmp_path):
    directory = _copy("v3_yarn", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "sliding_window": 4096}))
    with pytest.raises(ConfigError, match="config.json: key sliding_window"):
        hf.load(str(directory))
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type='llama'"):
        hf.load(str(directory))


def test_truncated_file_is_named(tmp_path):
    directory = _copy("v3_yarn", tmp_path)
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(safetensors.SafetensorsError, match=r"model.safetensors: truncated: tensor"):
        hf.load(str(directory), progress=False)


def test_missing_shard_is_named(tmp_path):
    directory = _copy("v3_sharded_mtp", tmp_path)
    os.remove(directory / "model-00002-of-00004.safetensors")
    with pytest.raises(
        safetensors.SafetensorsError, match="model-00002-of-00004.safetensors: no such"
    ):
        hf.load(str(directory), progress=False)


def test_shape_mismatch_names_file_and_tensor():
    with pytest.raises(
        safetensors.SafetensorsError, match=r"model.safetensors: tensor .*mlp.* has shape"
    ):
        hf.load(str(FIXTURES / "v3_yarn"), base_mlp_dim=48, progress=False)


def test_fp8_weight_without_scale_is_named(tmp_path):
    directory = _copy("v3_fp8", tmp_path)
    refs = safetensors.read_directory(str(directory))
    dropped = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    entries = [
        (n, lambda r=r: np.asarray(r.array()), r.shape, r.dtype)
        for n, r in refs.items()
        if n != dropped
    ]
    safetensors.write_file(str(directory / "model.safetensors"), entries)
    with pytest.raises(
        safetensors.SafetensorsError, match="o_proj.weight is fp8 without .*_scale_inv"
    ):
        hf.load(str(directory), progress=False)


def test_unexpected_dtype_is_named(tmp_path):
    directory = _copy("v3_yarn", tmp_path)
    path = directory / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header["model.norm.weight"]["dtype"] = "I32"  # same size as F32
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (length - len(new))
    assert len(new) == length
    path.write_bytes(raw[:8] + new + raw[8 + length :])
    with pytest.raises(
        safetensors.SafetensorsError, match="model.norm.weight has unsupported dtype"
    ):
        hf.load(str(directory), progress=False)


@pytest.mark.skipif("mtp_num_layers" not in FIELDS, reason="needs MTP (issue 31's branch)")
def test_mtp_layer_round_trips_when_mtp_is_on(tmp_path):
    """With mtp_num_layers=1 the MTP layer's own tensors fill mtp/ and come back
    bitwise; its embedding/head copies are written from the shared ones."""
    directory = FIXTURES / "v3_sharded_mtp"
    config, params = hf.load(str(directory), dtype="float32", mtp_num_layers=1, progress=False)
    assert config.mtp_num_layers == 1 and "mtp" in params["params"]
    hf.save(str(tmp_path), config, params, max_shard_bytes=60_000, progress=False)
    original, exported = _tensors(str(directory)), _tensors(str(tmp_path))
    assert sorted(original) == sorted(exported)
    layer = f"model.layers.{config.base_num_decoder_layers}."
    copies = {layer + "embed_tokens.weight": "model.embed_tokens.weight"}
    copies[layer + "shared_head.head.weight"] = "lm_head.weight"
    for name, value in original.items():
        expected = original[copies[name]] if name in copies else value
        assert np.array_equal(exported[name], expected), name
