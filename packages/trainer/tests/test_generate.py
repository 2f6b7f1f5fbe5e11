"""`generate` on the committed tiny checkpoints: greedy is the argmax of the full
forward step by step (V3, V2-Lite without q_lora, YaRN), and transformers' own greedy
`generate` (v3_chat/greedy.json, made by make_hf_fixtures.py); batched prompts of
different lengths give what each gives alone; draws are reproducible from the seed;
a run's checkpoint generates like the weights it holds. Each shape compiles once."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trainer import hf
from trainer.generate import Sampling, cli, generate

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
CHAT = FIXTURES / "v3_chat"
GREEDY = json.loads((CHAT / "greedy.json").read_text())
NEW = GREEDY["max_new_tokens"]
# Three prompts of different lengths (ids below every fixture's vocabulary of 64).
PROMPTS = [[0, 5, 9, 17, 3, 44, 2], [0, 7], [4, 4, 4, 4, 9]]
STEPS = 6


def _cases(eos: int | None = None, prompts=None) -> list[dict]:
    return [
        case
        for case in GREEDY["cases"]
        if (eos is None or case["eos_token_id"] == eos)
        and (prompts is None or case["prompt"] in prompts)
    ]


@pytest.fixture(scope="module")
def loaded():
    """The fixtures loaded once (float32 compute) on one device."""
    names = ("v3_chat", "v2_lite", "v3_yarn")
    return {name: hf.load(str(FIXTURES / name), dtype="float32", progress=False) for name in names}


def stepwise_argmax(config, params, prompts, steps: int) -> list[list[int]]:
    """The greedy continuation by the full forward (hf.forward), recomputed on the
    growing sequences at every step. Rows are right-padded to one length (one
    compile): causal attention keeps the padding out of the positions read."""
    length = max(map(len, prompts)) + steps
    rows = [list(p) for p in prompts]
    for _ in range(steps):
        tokens = np.zeros((len(rows), length), np.int32)
        for r, row in enumerate(rows):
            tokens[r, : len(row)] = row
        logits = np.asarray(hf.forward(config, params, tokens))
        for r, row in enumerate(rows):
            row.append(int(logits[r, len(row) - 1].argmax()))
    return [row[len(p) :] for row, p in zip(rows, prompts, strict=True)]


@pytest.mark.parametrize("name", ["v3_chat", "v2_lite", "v3_yarn"])
def test_greedy_is_the_argmax_of_the_full_forward(loaded, name):
    config, params = loaded[name]
    # v3_chat: the prompts of greedy.json (the shapes the other tests compile).
    prompts = [c["prompt_ids"] for c in _cases(eos=1)] if name == "v3_chat" else PROMPTS
    steps = NEW if name == "v3_chat" else STEPS
    got = generate(config, params, prompts, max_new_tokens=steps)
    assert got == stepwise_argmax(config, params, prompts, steps)
    assert all(len(row) == steps for row in got)  # no eos given: every row runs out


def _run(capsys, *words: str) -> tuple[list[list[int]], str]:
    """`generate` in this process: (the ids of each `ids:` line, the whole stdout)."""
    assert cli.main([f"hf_model_path={CHAT}", "dtype=float32", *words]) == 0
    out = capsys.readouterr().out
    ids = [line.removeprefix("ids: ") for line in out.splitlines() if line.startswith("ids: ")]
    return [[int(t) for t in line.split(",") if t] for line in ids], out


def test_text_prompts_batched_match_transformers_greedy_generate(capsys):
    """The three prompts in one batch, generation_config.json's eos: transformers' ids."""
    cases = _cases(eos=1)
    assert len(cases) == 3
    got, out = _run(capsys, *(f"prompt={c['prompt']}" for c in cases), f"max_new_tokens={NEW}")
    assert got == [c["new_ids"] for c in cases]
    assert "eos 1" in out and "left-padded" in out
    assert out.count("max_new_tokens reached") == 3


# The two whose eos-override reference ends early; alone, each an unpadded batch of one.
ALONE = ("The quick brown fox", "a")


@pytest.mark.parametrize("prompt", ALONE)
def test_one_prompt_alone_matches_batched_and_stops_at_eos(capsys, prompt):
    free, early = _cases(prompts=(prompt,))
    assert free["eos_token_id"] == 1 and early["eos_token_id"] != 1
    got, _ = _run(capsys, f"prompt={prompt}", f"max_new_tokens={NEW}")
    assert got == [free["new_ids"]]  # what the batch of three gave this row
    got, out = _run(
        capsys, f"prompt={prompt}", f"max_new_tokens={NEW}", f"eos_token_id={early['eos_token_id']}"
    )
    assert got == [early["new_ids"]] and got[0][-1] == early["eos_token_id"]
    assert "ended at eos" in out


def test_prompt_ids_are_the_tokenizers_encoding_with_bos(loaded, capsys):
    """The text path's ids are what transformers was given (BOS 0 prepended), and
    prompt_ids= of the same ids generates the same."""
    config, params = loaded["v3_chat"]
    cases = _cases(eos=1)
    rows = [c["prompt_ids"] for c in cases]
    assert all(row[0] == 0 for row in rows)
    assert generate(config, params, rows, max_new_tokens=NEW, eos_ids=(1,)) == [
        c["new_ids"] for c in cases
    ]
    got, out = _run(
        capsys, *(f"prompt_ids={','.join(map(str, r))}" for r in rows), f"max_new_tokens={NEW}"
    )
    assert got == [c["new_ids"] for c in cases]
    assert f"prompt 1: {','.join(map(str, rows[0]))}" in out


def test_top_k_one_is_greedy(loaded):
    config, params = loaded["v3_chat"]
    rows = [c["prompt_ids"] for c in _cases(eos=1)]
    top1 = Sampling("topk", temperature=0.7, top_k=1)
    for seed in (0, 1):
        got = generate(config, params, rows, max_new_tokens=NEW, sampling=top1, seed=seed)
        assert got == [c["new_ids"] for c in _cases(eos=1)]


def test_draws_are_reproducible_from_the_seed(loaded):
    config, params = loaded["v3_chat"]
    rows = [c["prompt_ids"] for c in _cases(eos=1)]
    nucleus = Sampling("nucleus", temperature=1.5, nucleus_p=0.95)

    def draw(seed):
        return generate(config, params, rows, max_new_tokens=NEW, sampling=nucleus, seed=seed)

    first = draw(3)
    assert draw(3) == first
    assert draw(4) != first
    assert first != [c["new_ids"] for c in _cases(eos=1)]  # not greedy at this temperature
