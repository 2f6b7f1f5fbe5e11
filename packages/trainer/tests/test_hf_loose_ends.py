"""Issue 45's Hugging Face loose ends: a config.json key left out takes transformers'
default for the model type (or is refused naming it), keys transformers ignores are
ignored with a startup note, broken index/header files and NaN/Inf weights are one
line naming file and tensor, Moonlight's two epsilons and Kimi-K2 load, V2-Lite's
aux_loss_alpha maps onto load_balance_loss_weight, and an export keeps the source's
dtype, config.json keys and generation_config.json.

The committed fixtures (tests/fixtures/hf/) hold transformers' logits; a config that
equals a fixture's reuses its compiled forward (hf._forward_fn is cached by config).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from trainer import hf
from trainer.config import ConfigError, hf_map, make_config
from trainer.hf import notes, safetensors, stream
from trainer.hf.safetensors import SafetensorsError

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TOLERANCE = 1e-4
NULL = "<null>"  # a change that writes the key as JSON null (None removes the key)
ROPE_KEYS = (
    "rope_type",
    "rope_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "rope_truncate",
    "rope_attention_scaling",
    "rope_max_timescale",
)


def _hf_config(name: str, **changes) -> dict:
    """Fixture `name`'s config.json with `changes` (None: key removed; NULL: null)."""
    config = json.loads((FIXTURES / name / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = None if value == NULL else value
    return config


def _copy(name: str, tmp_path: Path, **changes) -> Path:
    """A copy of fixture `name` whose config.json has `changes` (as `_hf_config`)."""
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    (target / "config.json").write_text(json.dumps(_hf_config(name, **changes)))
    return target


def _exported(name: str, **changes) -> dict:
    """The config.json an export of fixture `name` should write: the source's with
    `changes`, no fp8 quantization, and no MTP layers (the export holds none)."""
    config = _hf_config(name, quantization_config=None, **changes)
    if "num_nextn_predict_layers" in config:
        config["num_nextn_predict_layers"] = 0
    return config


def _logits_error(directory: Path, name: str, **overrides) -> float:
    config, params = hf.load(str(directory), dtype="float32", progress=False, **overrides)
    reference = np.load(FIXTURES / name / "reference.npz")
    logits = np.asarray(hf.forward(config, params, reference["tokens"]))
    return float(np.abs(logits - reference["logits"]).max())


# --- missing keys: transformers' default for the model type -------------------


def test_v3_without_keys_at_their_defaults_loads_as_transformers(tmp_path):
    """v3_yarn's values of these keys are transformers' V3 defaults: left out, the
    model is the same (routed_scaling_factor used to fall back to the trainer's 1.0)."""
    dropped = ("routed_scaling_factor", "norm_topk_prob", "rms_norm_eps", "rope_interleave")
    directory = _copy("v3_yarn", tmp_path, **dict.fromkeys(dropped + ("n_shared_experts",)))
    assert (
        hf_map.from_hf(_hf_config("v3_yarn", routed_scaling_factor=None))["routed_scaling_factor"]
        == 2.5
    )
    assert hf.config_from_hf(str(directory)) == hf.config_from_hf(str(FIXTURES / "v3_yarn"))
    assert _logits_error(directory, "v3_yarn") <= TOLERANCE


def test_v2_without_keys_at_their_defaults_is_the_same_model():
    """V2's defaults differ from V3's (routed_scaling_factor 1.0, two shared experts,
    greedy, no groups); v2_lite's values are V2's defaults."""
    dropped = dict.fromkeys(
        ("routed_scaling_factor", "n_shared_experts", "topk_method", "n_group", "topk_group")
    )
    assert hf_map.from_hf(_hf_config("v2_lite", **dropped)) == hf_map.from_hf(_hf_config("v2_lite"))
    v2 = hf_map.from_hf(_hf_config("v2_lite", routed_scaling_factor=None))
    assert v2["routed_scaling_factor"] == 1.0 and v2["shared_experts"] == 2


@pytest.mark.parametrize(
    ("family", "key", "expected"),
    [
        ("deepseek_v3", "first_k_dense_replace", ("first_num_dense_layers", 3)),
        ("deepseek_v3", "n_group", ("n_routing_groups", 8)),
        ("deepseek_v3", "topk_group", ("topk_routing_group", 4)),
        ("deepseek_v3", "q_lora_rank", ("q_lora_rank", 1536)),
        ("deepseek_v3", "max_position_embeddings", ("max_position_embeddings", 4096)),
        ("deepseek_v2", "first_k_dense_replace", ("first_num_dense_layers", 0)),
        ("deepseek_v2", "q_lora_rank", ("q_lora_rank", 1536)),
        ("deepseek_v2", "max_position_embeddings", ("max_position_embeddings", 2048)),
    ],
)
def test_each_missing_key_takes_transformers_default(family, key, expected):
    name = "v3_chat" if family == "deepseek_v3" else "v2_grouped"
    out = hf_map.from_hf(_hf_config(name, **{key: None}))
    assert out[expected[0]] == expected[1]


def test_a_preset_never_fills_what_config_json_leaves_out():
    """deepseek3-671b's preset has YaRN (factor 40 from 4096) and 8 groups: a config.json
    gets its own RoPE and routing whichever preset it starts from."""
    routing = ("n_routing_groups", "topk_routing_group", "latent_norm_epsilon")
    plain_rope = ("rope_type", "rope_max_timescale")  # the YaRN keys then mean nothing
    for name, keys in (("v3_yarn", ROPE_KEYS + routing), ("v3_chat", plain_rope + routing)):
        path = str(FIXTURES / name)
        tiny = make_config({"hf_model_path": path})
        big = make_config({"hf_model_path": path, "model_name": "deepseek3-671b"})
        assert {k: getattr(big, k) for k in keys} == {k: getattr(tiny, k) for k in keys}, name
    assert big.rope_type == "default"


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("v3_chat", {"routed_scaling_factor": NULL}, "routed_scaling_factor is null"),
        ("v3_chat", {"num_key_value_heads": None}, "num_key_value_heads is missing"),
        ("v2_grouped", {"n_group": None}, "n_group is missing"),
        ("v2_grouped", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc' is not one of"),
        ("v3_chat", {"head_dim": 16}, "head_dim=16 must be 8"),
        (
            "v2_grouped",
            {"num_attention_heads": 3, "num_key_value_heads": 3},
            "not a multiple of num_attention_heads=3",
        ),
        ("v3_yarn", {"rope_parameters": {"rope_type": "yarn"}}, "yarn but no factor"),
    ],
)
def test_what_transformers_refuses_is_refused_naming_the_key(name, changes, message):
    with pytest.raises(ConfigError, match=message):
        hf_map.from_hf(_hf_config(name, **changes))


def test_yarn_without_original_context_takes_max_position_embeddings():
    """transformers fills original_max_position_embeddings from max_position_embeddings
    (it raises only for a missing factor); the trainer's preset 4096 is not used."""
    rope = dict(_hf_config("v3_yarn")["rope_parameters"])
    del rope["original_max_position_embeddings"]
    out = hf_map.from_hf(_hf_config("v3_yarn", rope_parameters=rope))
    assert out["original_max_position_embeddings"] == 64 and out["rope_factor"] == 4.0


# --- keys transformers ignores ------------------------------------------------


def test_keys_transformers_ignores_are_ignored_and_named(tmp_path, capsys):
    """V3 always routes sigmoid + noaux_tc in transformers, whatever scoring_func and
    topk_method say: the import does the same and says so at startup."""
    changes = {"scoring_func": "softmax", "topk_method": "greedy", "qk_head_dim": 99}
    directory = _copy("v3_yarn", tmp_path, **changes)
    assert hf.config_from_hf(str(directory)) == hf.config_from_hf(str(FIXTURES / "v3_yarn"))
    hf.load(str(directory), dtype="float32")
    err = capsys.readouterr().err
    assert "hf import: scoring_func='softmax' ignored: transformers' deepseek_v3 uses" in err
    assert "topk_method='greedy' ignored" in err and "qk_head_dim=99 ignored" in err
    v2 = _hf_config("v2_lite", norm_topk_prob=True, scoring_func="sigmoid")
    assert hf_map.from_hf(v2)["norm_topk_prob"] is False
    assert len(notes.lines(v2)) == 2


# --- broken files -------------------------------------------------------------


def _write_header(path: Path, header) -> None:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    new = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + length :])


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length])


def _one_line_error(directory: Path) -> str:
    with pytest.raises(SafetensorsError) as caught:
        hf.load(str(directory), progress=False)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_malformed_index_is_one_line_naming_it(tmp_path):
    directory = _copy("v3_sharded_mtp", tmp_path)
    index = directory / safetensors.INDEX
    index.write_text('{"weight_map": {"a": ')
    assert _one_line_error(directory).startswith(f"{index}: not JSON")
    index.write_text("[1, 2]")
    assert _one_line_error(directory) == f"{index}: no weight_map object"
    index.write_text('{"weight_map": {"model.norm.weight": 3}}')
    assert "tensor model.norm.weight maps to 3" in _one_line_error(directory)


def test_malformed_header_entries_name_file_and_tensor(tmp_path):
    directory = _copy("v3_yarn", tmp_path)
    path = directory / "model.safetensors"
    original = _header(path)
    header = dict(original)
    header["model.norm.weight"] = {k: v for k, v in header["model.norm.weight"].items()}
    del header["model.norm.weight"]["data_offsets"]
    _write_header(path, header)
    assert _one_line_error(directory) == (
        f"{path}: tensor model.norm.weight: header entry has no data_offsets"
    )
    _write_header(path, [original["model.norm.weight"]])
    assert _one_line_error(directory) == f"{path}: header is a JSON list, not an object"
    header["model.norm.weight"] = dict(original["model.norm.weight"], shape=["32"])
    _write_header(path, header)
    assert "tensor model.norm.weight: shape ['32'] is not a list of sizes" in _one_line_error(
        directory
    )


def _poison(directory: Path, name: str, value: float) -> None:
    """Set the first element of tensor `name` of model.safetensors to `value`."""
    ref = safetensors.read_header(str(directory / "model.safetensors"))[name]
    data = np.memmap(ref.path, ref.dtype, "r+", ref.offset, ref.shape)
    data.reshape(-1)[0] = value
    data.flush()


@pytest.mark.parametrize(("value", "weight_dtype"), [(np.nan, "float32"), (-np.inf, "bfloat16")])
def test_nan_or_inf_weights_name_file_and_tensor(tmp_path, value, weight_dtype):
    directory = _copy("v3_yarn", tmp_path)
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    _poison(directory, name, value)
    with pytest.raises(SafetensorsError) as caught:
        hf.load(str(directory), weight_dtype=weight_dtype, progress=False)
    message = str(caught.value)
    assert message == (
        f"{directory / 'model.safetensors'}: tensor {name} holds NaN or Inf "
        "(hf_check_finite=false loads it)"
    )
    _, params = hf.load(str(directory), hf_check_finite=False, progress=False)
    assert not np.isfinite(np.asarray(params["params"]["moe_layers"]["ffn"]["wo"])).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_the_finite_check_sees_every_chunk(dtype, value):
    array = np.ones((3, stream.FINITE_CHUNK), safetensors.DTYPES["F32"]).astype(dtype)
    assert stream._finite(array)
    array[2, 7] = value  # in the last chunk
    assert not stream._finite(array)


def test_nan_in_an_fp8_scale_is_named_by_its_weight(tmp_path):
    directory = _copy("v3_fp8", tmp_path)
    _poison(directory, "model.layers.0.self_attn.o_proj.weight_scale_inv", np.nan)
    assert "tensor model.layers.0.self_attn.o_proj.weight holds NaN" in _one_line_error(directory)


# --- Moonlight, Kimi-K2 -------------------------------------------------------


def test_moonlight_latent_norms_keep_transformers_epsilon():
    """Moonlight's fixture makes both epsilons matter (test_hf checks its logits):
    the latent norms at rms_norm_eps instead of 1e-6 move the logits far off."""
    config = hf.config_from_hf(str(FIXTURES / "moonlight"))
    assert config.normalization_layer_epsilon == 1e-5 and config.latent_norm_epsilon == 1e-6
    # latent_norm_epsilon < 0: MaxText's one epsilon for every norm, here 1e-5.
    assert _logits_error(FIXTURES / "moonlight", "moonlight", latent_norm_epsilon=-1) > 0.1
    assert hf_map.to_hf(config)["rms_norm_eps"] == 1e-5
    one_epsilon = make_config(
        {**hf_map.from_hf(_hf_config("moonlight")), "latent_norm_epsilon": -1}
    )
    with pytest.raises(ConfigError, match=r"latent_norm_epsilon=-1.0 .* cannot be exported"):
        hf_map.to_hf(one_epsilon)
    lines = notes.lines(_hf_config("moonlight"))
    assert any("latent norms" in line and "1e-06" in line for line in lines)


def test_kimi_k2_reads_as_v3_and_its_inv_freq_tensors_are_ignored(capsys):
    hf.load(str(FIXTURES / "kimi_k2"), dtype="float32")
    err = capsys.readouterr().err
    assert "model_type='kimi_k2' read as deepseek_v3" in err
    assert "ignoring 3 rotary_emb.inv_freq tensors" in err


# --- aux_loss_alpha / seq_aux -------------------------------------------------


def test_aux_loss_alpha_maps_to_the_balance_loss_weight(tmp_path, capsys):
    """DeepSeek adds alpha x each MoE layer's sequence-wise loss; the trainer adds the
    weight x their mean: weight = alpha x MoE layers (v2_lite: 2)."""
    v2 = _hf_config("v2_lite", aux_loss_alpha=0.001, seq_aux=True)
    assert hf_map.from_hf(v2)["load_balance_loss_weight"] == pytest.approx(0.002)
    batch_wise = _hf_config("v2_lite", aux_loss_alpha=0.001, seq_aux=False)
    assert "load_balance_loss_weight" not in hf_map.from_hf(batch_wise)
    assert "is not used" in notes.lines(batch_wise)[0]
    directory = _copy("v2_lite", tmp_path, aux_loss_alpha=0.001, seq_aux=True)
    config = make_config({"hf_model_path": str(directory), "load_balance_loss_weight": "0.5"})
    assert config.load_balance_loss_weight == 0.5
    assert "given explicitly wins" in notes.lines(v2, config)[0]


# --- export -------------------------------------------------------------------


def _dtypes(directory: Path) -> dict[str, str]:
    refs = safetensors.read_directory(str(directory))
    return {name: safetensors.NAMES[ref.dtype] for name, ref in refs.items()}


@pytest.mark.parametrize("name", ["moonlight", "kimi_k2", "v2_lite", "v3_yarn"])
def test_export_keeps_the_source_config_dtype_and_generation_config(tmp_path, name):
    """Nothing changed: config.json and generation_config.json come back as the
    source's, the tensors in the source's dtype, bit for bit."""
    source = FIXTURES / name
    config, params = hf.load(str(source), dtype="float32", progress=False)
    out = tmp_path / "export"
    hf.save(str(out), config, params, source=str(source), progress=False)
    assert json.loads((out / "config.json").read_text()) == _exported(name)
    for file in ("generation_config.json",):
        assert json.loads((out / file).read_text()) == json.loads((source / file).read_text())
    original = safetensors.read_directory(str(source))
    exported = safetensors.read_directory(str(out))
    ignored = {n for n in original if n.endswith("rotary_emb.inv_freq")}
    assert sorted(exported) == sorted(set(original) - ignored)
    for tensor, ref in exported.items():
        assert ref.dtype == original[tensor].dtype, tensor
        assert np.array_equal(np.asarray(ref.array()), np.asarray(original[tensor].array()))


def test_export_of_fp8_is_bf16_without_quantization_config(tmp_path):
    source = FIXTURES / "v3_fp8"
    config, params = hf.load(str(source), dtype="float32", progress=False)
    hf.save(str(tmp_path / "bf16"), config, params, source=str(source), progress=False)
    written = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert written == _exported("v3_fp8") and written["dtype"] == "bfloat16"
    dtypes = _dtypes(tmp_path / "bf16")
    assert {d for n, d in dtypes.items() if "e_score_correction_bias" not in n} == {"BF16"}
    assert {d for n, d in dtypes.items() if "e_score_correction_bias" in n} == {"F32"}
    # export_dtype=float32 writes f32, and the bf16 export is the f32 one rounded.
    hf.save(str(tmp_path / "f32"), config, params, dtype="float32", progress=False)
    assert set(_dtypes(tmp_path / "f32").values()) == {"F32"}
    f32 = safetensors.read_directory(str(tmp_path / "f32"))
    for tensor, ref in safetensors.read_directory(str(tmp_path / "bf16")).items():
        rounded = np.asarray(f32[tensor].array()).astype(ref.dtype)
        assert np.array_equal(np.asarray(ref.array()), rounded), tensor
    with pytest.raises(ConfigError, match="export_dtype='float16'"):
        hf.save(str(tmp_path / "x"), config, params, dtype="float16", progress=False)
    with pytest.raises(ConfigError, match="config.json: not found"):
        hf.save(str(tmp_path / "x"), config, params, source=str(tmp_path), progress=False)


def test_export_writes_the_changed_keys_and_token_ids(tmp_path):
    """A changed key is rewritten (routed_scaling_factor), the rest kept; without a
    generation_config.json in the source, one is written from its token ids."""
    source = _copy("moonlight", tmp_path)
    (source / "generation_config.json").unlink()
    _, params = hf.load(str(source), dtype="float32", progress=False)
    config = make_config(
        {**hf_map.from_hf(_hf_config("moonlight")), "routed_scaling_factor": 2.0,
         "load_balance_loss_weight": 0.0, "dtype": "float32"}
    )  # fmt: skip
    out = tmp_path / "export"
    hf.save(str(out), config, params, source=str(source), progress=False)
    written = json.loads((out / "config.json").read_text())
    assert written == _exported("moonlight", routed_scaling_factor=2.0, aux_loss_alpha=0.0)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (60, 61)
    assert hf_map.from_hf(written)["routed_scaling_factor"] == 2.0
