"""README.md's "Fine-tune a published checkpoint" block: `train` from a Hugging Face
directory with `use_sft`, `generate` from that run, `export-hf` of it.

The commands are read by test_doc_commands.py's parser: its cpu tier puts their keys
through each program's own parser (a removed or misspelt key fails there), and its slow
tier leaves this block to the test here, which checks what the block prints.

- cpu tier: the block is train, generate, export-hf on one run (generate and export-hf
  read the run directory train writes); the fixture and the data file it names exist.
- slow tier: the block runs as written in an empty directory (its 60 steps take a few
  seconds; the compiles dominate): the loss falls, the step losses the README shows are
  the printed ones (within 2%: XLA:CPU on another CPU may sum in another order, and
  60 steps carry the difference along), generate prints an `ids:` line per prompt, and
  export-hf writes config.json and the safetensors.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _doc_commands():
    """test_doc_commands.py as a module (tests run with --import-mode=importlib, so a
    test file is not importable by name)."""
    spec = importlib.util.spec_from_file_location(
        "readme_finetune_doc_commands", Path(__file__).parent / "test_doc_commands.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


doc = _doc_commands()
COMMANDS = [c for c in doc.section_commands(README, doc.README_FINETUNE) if c.fenced]
STEP_LINE = re.compile(r"^step\s+(\d+)\s+loss (\d+\.\d+)\s", re.M)


def keys(command) -> dict[str, str]:
    """The command's `key=value` words (the last one wins for a repeated key)."""
    (words,) = doc._invocations(command.text)
    return dict(w.split("=", 1) for w in words[1:] if "=" in w)


def shown_output() -> str:
    """The section's ```text block: what the README says the commands print."""
    text = README.read_text()
    section = text[text.index(f"## {doc.README_FINETUNE}") :]
    section = section[: section.index("\n## ")]
    blocks = [m.group(3) for m in doc.FENCE.finditer(section) if m.group(2) == "text"]
    assert len(blocks) == 1, "the fine-tune section shows its output in one ```text block"
    return blocks[0]


def test_the_block_trains_samples_and_exports_one_run():
    assert [doc.program(c) for c in COMMANDS] == ["train", "generate", "export-hf"]
    train, generate, export = (keys(c) for c in COMMANDS)
    assert train["use_sft"] == "true" and train["dataset_type"] == "hf"
    assert (ROOT / train["hf_model_path"] / "config.json").is_file()
    assert (ROOT / train["hf_train_files"]).is_file()
    # An absolute output directory, as a new user's clone has it; the others read it.
    assert train["base_output_directory"].startswith("$PWD/")
    run_dir = os.path.join(train["base_output_directory"][len("$PWD/") :], train["run_name"])
    assert generate["run_dir"] == export["run_dir"] == run_dir
    assert generate.get("decode_sampling_strategy", "greedy") == "greedy"


def test_test_doc_commands_parses_the_block_and_leaves_its_run_here():
    parsed = {c.where for c in doc.COMMANDS if not doc._is_placeholder(c)}
    assert {c.where for c in COMMANDS} <= parsed
    assert not {c.where for c in COMMANDS} & {s.where for s in doc.STEPS}


def test_the_shown_losses_fall():
    losses = [float(x) for _, x in STEP_LINE.findall(shown_output())]
    assert len(losses) >= 2 and losses == sorted(losses, reverse=True)


def _run(command, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env.pop("XLA_FLAGS", None)  # the README's run uses XLA's defaults
    done = subprocess.run(
        ["bash", "-c", doc.local(command.text)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"{command.where}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow
def test_the_block_runs_and_prints_what_the_readme_shows(tmp_path):
    for name in ("examples", "packages"):  # the inputs, at the paths the block names
        (tmp_path / name).symlink_to(ROOT / name)
    train, generate, export = COMMANDS

    printed = {int(s): float(x) for s, x in STEP_LINE.findall(_run(train, tmp_path).stdout)}
    steps = int(keys(train)["steps"])
    assert max(printed) == steps
    assert printed[steps] < printed[min(printed)] / 3, printed
    shown = {int(s): float(x) for s, x in STEP_LINE.findall(shown_output())}
    for step, loss in shown.items():
        assert printed[step] == pytest.approx(loss, rel=0.02), (step, printed)
    # The step-1 loss the prose gives, from metrics.jsonl (step lines start at 10).
    said = re.search(r"step-1 loss, in\s+`(\S+)`, is (\d+\.\d+)", README.read_text())
    record = json.loads((tmp_path / said.group(1)).read_text().splitlines()[0])
    assert record["step"] == 1
    assert record["learning/loss"] == pytest.approx(float(said.group(2)), abs=0.01)

    ids = [line for line in _run(generate, tmp_path).stdout.splitlines() if line.startswith("ids:")]
    assert len(ids) == generate.text.count(" prompt=")
    assert all(re.fullmatch(r"ids: \d+(,\d+)*", line) for line in ids), ids

    _run(export, tmp_path)
    exported = tmp_path / keys(export)["output"]
    assert (exported / "config.json").is_file()
    assert list(exported.glob("*.safetensors")), sorted(p.name for p in exported.iterdir())
