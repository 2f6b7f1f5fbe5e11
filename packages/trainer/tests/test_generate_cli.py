"""`generate`'s command line without compiling a model: every bad key or value is one
line naming it (exit 2) before any weight is read; MaxText's sampling strategies
draw from the tokens they should; a run's checkpoint generates like its weights."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.config import ConfigError
from trainer.generate import args as args_lib
from trainer.generate import cli, draw
from trainer.generate.sampling import Sampling, check, choose_sampling
from trainer.generate.source import choose_source

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
CHAT = FIXTURES / "v3_chat"
GENERATE = Path(sys.executable).parent / "generate"
DOCS = Path(__file__).parents[3] / "docs" / "finetune.md"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["hf_model_path=X", "promt=hi"], "unknown key 'promt'; did you mean 'prompt'?"),
        (["prompt=hi"], "give one of hf_model_path= or run_dir="),
        ([f"hf_model_path={CHAT}"], "no prompt"),
        ([f"hf_model_path={CHAT}", "prompt=a", "prompt_ids=1"], "text prompts"),
        ([f"hf_model_path={CHAT}", "prompt_ids=1,x"], "prompt_ids='1,x' is not a comma"),
        ([f"hf_model_path={CHAT}", "prompt=a", "max_new_tokens=0"], "max_new_tokens=0 must"),
        ([f"hf_model_path={CHAT}", "prompt=a", "seed=1.5"], "seed='1.5' is not an integer"),
        ([f"hf_model_path={CHAT}", "prompt=a", "seed=1", "seed=2"], "seed= given twice"),
        ([f"hf_model_path={CHAT}", "prompt=a", "step=3"], "step= goes with run_dir="),
        ([f"hf_model_path={CHAT}", "prompt=a", "dtype=fp16"], "dtype='fp16' is not one of"),
        ([f"hf_model_path={CHAT}", "prompts_file=/nonexistent"], "prompts_file='/nonexistent'"),
        (["hf_model_path=/nonexistent", "prompt=a"], "hf_model_path='/nonexistent' is not a"),
        (["hf_model_path", "prompt=a"], "'hf_model_path' is not of the form key=value"),
    ],
)
def test_bad_arguments_name_the_key(argv, message):
    with pytest.raises(ConfigError) as error:
        args_lib.parse(argv)
    assert message in str(error.value)


def test_the_docs_table_lists_every_key_in_order():
    text = DOCS.read_text()
    section = text[text.index("## Generate") :]
    section = section[: section.index("\n## ")] if "\n## " in section else section
    assert re.findall(r"^\| `(\w+)` \|", section, re.M) == list(args_lib.KEYS)


def _error(capsys, *words: str) -> str:
    """`generate` in this process, expected to stop with a config error: its line."""
    assert cli.main(list(words)) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    return captured.err


@pytest.mark.parametrize(
    "words, message",
    [
        (("prompt_ids=0,600",), "id 600 is not below the model's vocab_size=512"),
        (("prompt=a", "eos_token_id=512"), "eos_token_id=512 is not below"),
        (("prompt=a", "decode_sampling_strategy=beam"), "decode_sampling_strategy='beam'"),
        (
            ("prompt=a", "decode_sampling_strategy=topk", "decode_sampling_top_k=0"),
            "decode_sampling_top_k=0 must be in",
        ),
        (
            ("prompt=a", "decode_sampling_strategy=nucleus", "decode_sampling_nucleus_p=1.5"),
            "decode_sampling_nucleus_p=1.5 must be in (0, 1]",
        ),
        (
            ("prompt=a", "decode_sampling_strategy=weighted", "decode_sampling_temperature=0"),
            "decode_sampling_temperature=0.0 must be > 0",
        ),
        (("prompt=a", "tokenizer_path=/nonexistent.json"), "tokenizer_path='/nonexistent.json'"),
    ],
)
def test_checkpoint_dependent_errors_come_before_loading(capsys, words, message):
    assert message in _error(capsys, f"hf_model_path={CHAT}", *words)


def test_yarn_context_and_missing_tokenizer_are_refused(capsys):
    yarn = FIXTURES / "v3_yarn"  # max_position_embeddings 64, YaRN
    err = _error(capsys, f"hf_model_path={yarn}", "prompt_ids=1,2,3", "max_new_tokens=62")
    assert "max_new_tokens=62 after a 3-token prompt exceeds max_position_embeddings=64" in err
    no_tokenizer = FIXTURES / "v2_lite"
    err = _error(capsys, f"hf_model_path={no_tokenizer}", "prompt=hello")
    assert "prompt= needs a tokenizer" in err


def test_run_dir_without_checkpoints_is_refused(capsys, tmp_path):
    err = _error(capsys, f"run_dir={tmp_path}", "prompt_ids=1")
    assert f"run_dir={str(tmp_path)!r} has no checkpoints/" in err


def test_the_console_script_reports_a_bad_key_in_one_line(tmp_path):
    done = subprocess.run(
        [str(GENERATE), f"hf_model_path={CHAT}", "prompt=hi", "max_new_token=3"],
        capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if line.startswith("config error")]
    assert lines == [
        "config error: generate: unknown key 'max_new_token'; did you mean 'max_new_tokens'?"
    ]


SAMPLING_REFERENCE = json.loads((FIXTURES / "sampling_reference.json").read_text())


def test_filters_run_in_transformers_order():
    """sampling_reference.json (make_peft_fixtures.py): transformers 5.24's scores after
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, the order generate
    builds them for do_sample; -inf where a token is filtered out. top-p after the
    temperature: the same p keeps fewer tokens at T 0.5 than at T 2 (MaxText's order,
    top-p on the untempered softmax, kept the same set for both)."""
    logits = jnp.asarray(SAMPLING_REFERENCE["logits"], jnp.float32)
    kept_by_temperature = {}
    for case in SAMPLING_REFERENCE["cases"]:
        k, p = case["top_k"], case["top_p"]
        strategy = "composite" if k and p < 1 else "topk" if k else "nucleus"
        sampling = Sampling(strategy, case["temperature"], k or 50, p)
        ours = np.asarray(draw.warp(logits, sampling))
        theirs = np.asarray(case["scores"], np.float32)
        assert (np.isfinite(ours) == np.isfinite(theirs)).all(), case
        finite = np.isfinite(theirs)
        np.testing.assert_allclose(ours[finite], theirs[finite], rtol=1e-6)
        if not k:
            kept_by_temperature[case["temperature"]] = np.isfinite(theirs).sum()
    assert kept_by_temperature[0.5] < kept_by_temperature[2.0]


def test_defaults_are_the_checkpoint_s_then_transformers():
    # transformers' GenerationConfig leaves do_sample, temperature, top_k, top_p unset;
    # generate then samples greedily, or with 1.0, 50 and 1.0 when do_sample is true.
    assert SAMPLING_REFERENCE["defaults"] == dict.fromkeys(
        ("do_sample", "temperature", "top_k", "top_p")
    )
    assert choose_sampling({}, {}) == Sampling("greedy", 1.0, 50, 1.0)
    # DeepSeek-V3's published generation_config.json: do_sample, temperature 0.6, top_p 0.95.
    published = {"do_sample": True, "temperature": 0.6, "top_p": 0.95}
    assert choose_sampling({}, published) == Sampling("composite", 0.6, 50, 0.95)
    assert choose_sampling({"strategy": "greedy"}, published).strategy == "greedy"
    assert choose_sampling({"nucleus_p": 0.5}, published) == Sampling("composite", 0.6, 50, 0.5)


def test_an_hf_checkpoint_computes_in_its_own_dtype():
    """transformers loads v3_chat's float32 files in float32 (dtype "auto"); so does
    generate, unless dtype= says otherwise (issue #55: it computed in bfloat16)."""
    source = choose_source(args_lib.parse([f"hf_model_path={CHAT}", "prompt=a"]))
    assert (source.config.dtype, source.config.weight_dtype) == ("float32", "float32")
    told = args_lib.parse([f"hf_model_path={CHAT}", "prompt=a", "dtype=bfloat16"])
    assert choose_source(told).config.dtype == "bfloat16"


def test_sampling_notes_keys_the_strategy_ignores():
    notes = check(Sampling("greedy", top_k=5), vocab_size=10)
    assert notes == ["decode_sampling_top_k=5 has no effect with decode_sampling_strategy=greedy"]
    assert check(Sampling("composite", 0.5, 3, 0.9), vocab_size=10) == []


# Logits of one row: token 3 has probability ~0.64, token 1 ~0.24, token 0 ~0.09, ...
LOGITS = jnp.log(jnp.asarray([[0.09, 0.24, 0.02, 0.64, 0.01]], jnp.float32))


def _counts(sampling: Sampling, draws: int = 2000) -> np.ndarray:
    """How often each token is drawn, over `draws` keys (one jitted vmap)."""
    keys = jax.random.split(jax.random.key(0), draws)
    ids = jax.jit(jax.vmap(lambda k: draw.sample(LOGITS, k, sampling)[0]))(keys)
    return np.bincount(np.asarray(ids), minlength=LOGITS.shape[1])


def test_strategies_draw_from_the_tokens_they_keep():
    assert (_counts(Sampling("greedy"), 4) == [0, 0, 0, 4, 0]).all()
    assert (_counts(Sampling("topk", top_k=1)) == [0, 0, 0, 2000, 0]).all()
    top2 = _counts(Sampling("topk", top_k=2))
    assert set(np.flatnonzero(top2)) == {1, 3} and 0.68 < top2[3] / 2000 < 0.78  # 0.64/0.88
    # Nucleus p=0.8: 0.64 < 0.8 so the token crossing it (1) is kept too, nothing else.
    assert set(np.flatnonzero(_counts(Sampling("nucleus", nucleus_p=0.8)))) == {1, 3}
    assert set(np.flatnonzero(_counts(Sampling("nucleus", nucleus_p=0.5)))) == {3}
    # Composite: top-3 (3, 1, 0), then the nucleus of their own softmax (0.66, 0.25).
    kept = np.flatnonzero(_counts(Sampling("composite", top_k=3, nucleus_p=0.8)))
    assert set(kept) == {1, 3}
    weighted = _counts(Sampling("weighted"))
    assert weighted.sum() == 2000 and 0.59 < weighted[3] / 2000 < 0.69
    # Temperature sharpens before the draw: at 0.25 token 3 has ~98% (p^4 renormalized).
    assert _counts(Sampling("weighted", temperature=0.25))[3] > 1920
