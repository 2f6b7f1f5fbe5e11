"""`train hf_model_path=DIR`, `load_parameters_path=` and `export-hf`, without compiling
a step: the state a run starts from, resumes from and exports is checked bitwise.
The fixture v3_yarn carries a character-level tokenizer.json."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from trainer import hf
from trainer.config import ConfigError, make_config
from trainer.hf import safetensors
from trainer.io import export_hf
from trainer.run import run as run_lib

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "v3_yarn"
TEXT = Path(__file__).parents[3] / "examples" / "text" / "train.txt"
BASE = {"dtype": "float32", "steps": "2", "async_checkpointing": "false"}


def _equal(a, b) -> None:
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_config_comes_from_the_directory_and_explicit_keys_win():
    hf_dir = FIXTURE
    text = {"dataset_type": "text"}
    config = make_config({"hf_model_path": str(hf_dir), "rope_factor": "2.0", **text})
    assert config.base_emb_dim == 32 and config.rope_type == "yarn" and config.rope_interleave
    assert config.rope_factor == 2.0  # explicit
    assert config.tokenizer_path == str(hf_dir / "tokenizer.json")
    explicit = make_config({"hf_model_path": str(hf_dir), "tokenizer_path": "t.json", **text})
    assert explicit.tokenizer_path == "t.json"
    assert make_config({"hf_model_path": str(hf_dir)}).tokenizer_path == ""  # synthetic data


# transformers 5.24's `tokenizer.save_pretrained` writes the chat template to its own
# file, chat_template.jinja, and leaves it out of tokenizer_config.json; from there
# `apply_chat_template` reads it back. An export must carry that file.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def _transformers5_directory(tmp_path: Path) -> Path:
    """FIXTURE copied with the tokenizer files transformers 5 saves beside it."""
    out = tmp_path / "source"
    shutil.copytree(FIXTURE, out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    return out


def test_start_resume_export_and_load_parameters(tmp_path, capsys):
    hf_dir = _transformers5_directory(tmp_path)
    overrides = {**BASE, "hf_model_path": str(hf_dir), "base_output_directory": str(tmp_path / "a")}
    overrides |= {"dataset_type": "text", "dataset_path": str(TEXT)}  # DIR's tokenizer.json
    run = run_lib.setup(make_config(overrides))
    assert run.initialized_from and not run.restored_from
    _, expected = hf.load(str(hf_dir), dtype="float32", progress=False)
    _equal(expected, {"params": run.state["params"], "router": run.state["router"]})
    run.checkpoints.save(1, run.state)
    run.checkpoints.wait()

    # A restart resumes from the run's own checkpoint, not the HF weights.
    again = run_lib.setup(make_config(overrides))
    assert again.restored_from and not again.initialized_from and again.start_step == 1

    # export-hf: the checkpoint's tensors are the fixture's, bit for bit, tokenizer copied.
    out = tmp_path / "export"
    assert export_hf.main([f"run_dir={run.config.run_dir}", f"output={out}", "step=1"]) == 0
    # The source's config.json says one MTP layer; the run trained none: said aloud.
    printed = capsys.readouterr().out
    assert "config.json: num_nextn_predict_layers 1 -> 0 (no multi-token" in printed
    original = safetensors.read_directory(str(FIXTURE))
    exported = safetensors.read_directory(str(out))
    assert sorted(original) == sorted(exported)
    for name, ref in original.items():
        assert np.array_equal(np.asarray(ref.array()), np.asarray(exported[name].array())), name
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (hf_dir / name).read_bytes(), name
    # ... over the source's config.json (token ids kept) and generation_config.json;
    # export_dtype=bfloat16 rounds every tensor but the routing biases.
    source_config = json.loads((hf_dir / "config.json").read_text())
    exported_config = json.loads((out / "config.json").read_text())
    assert exported_config == dict(source_config, num_nextn_predict_layers=0)
    generation = "generation_config.json"
    assert (out / generation).read_bytes() == (hf_dir / generation).read_bytes()
    bf16 = tmp_path / "export_bf16"
    args = [f"run_dir={run.config.run_dir}", f"output={bf16}"]
    assert export_hf.main([*args, "export_dtype=bfloat16"]) == 0
    dtypes = {n: r.dtype for n, r in safetensors.read_directory(str(bf16)).items()}
    assert {str(d) for n, d in dtypes.items() if "e_score" not in n} == {"bfloat16"}
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert export_hf.main([*args, "export_dtype=float16"]) == 2

    # load_parameters_path: another run (same model keys) starts from those parameters.
    checkpoints = os.path.join(run.config.run_dir, "checkpoints")
    other = {**BASE, **_model_keys(run.config), "base_output_directory": str(tmp_path / "b")}
    second = run_lib.setup(make_config({**other, "load_parameters_path": checkpoints}))
    assert second.initialized_from.endswith(checkpoints)
    _equal(expected["params"], second.state["params"])


def _model_keys(config) -> dict:
    from trainer.config import hf_map

    return hf_map.from_hf(hf_map.to_hf(config))


def test_bad_paths_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="config.json: not found"):
        make_config({"hf_model_path": str(tmp_path)})
    assert export_hf.main([f"run_dir={tmp_path}", f"output={tmp_path / 'x'}"]) == 2
