"""`generate run_dir=...`: a run's newest checkpoint, with the run's own config and
tokenizer. Started from v3_chat and saved untrained, it generates what transformers
does from v3_chat; after a short training (slow tier), the argmax of the full forward
of the trained weights, not of those it started from."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from trainer import hf
from trainer.config import make_config
from trainer.generate import cli
from trainer.hf import safetensors
from trainer.io import export_hf
from trainer.run import run as run_lib

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
CHAT = FIXTURES / "v3_chat"
TEXT = Path(__file__).parents[3] / "examples" / "text" / "train.txt"
CASE = json.loads((CHAT / "greedy.json").read_text())["cases"][0]  # "The quick brown fox"


def _argmax_continuation(config, params, prompt: list[int], steps: int) -> list[int]:
    """Greedy by the full forward on the growing sequence, on one device."""
    mesh = hf.default_ctx(config).mesh
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = jax.device_put(jax.device_get(params), replicated)
    row = list(prompt)
    for _ in range(steps):
        row.append(int(np.asarray(hf.forward(config, params, [row]))[0, -1].argmax()))
    return row[len(prompt) :]


def _overrides(directory: Path, **extra: str) -> dict:
    return {
        "hf_model_path": str(CHAT),
        "dtype": "float32",
        "async_checkpointing": "false",
        "dataset_type": "text",  # so the run's tokenizer_path is v3_chat's tokenizer.json
        "dataset_path": str(TEXT),
        "base_output_directory": str(directory),
        **extra,
    }


def _generate(capsys, run_dir: str, steps: int) -> tuple[list[int], str]:
    argv = [f"run_dir={run_dir}", f"prompt={CASE['prompt']}", f"max_new_tokens={steps}"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    ids_line = next(line for line in out.splitlines() if line.startswith("ids: "))
    return [int(t) for t in ids_line.removeprefix("ids: ").split(",")], out


def test_a_saved_run_generates_with_its_config_and_tokenizer(capsys, tmp_path):
    """No training step (nothing compiled but generation): the checkpoint holds
    v3_chat's weights, so the text prompt continues as transformers continues it."""
    run = run_lib.setup(make_config(_overrides(tmp_path)))
    run.checkpoints.save(1, run.state)
    run.checkpoints.wait()
    got, out = _generate(capsys, run.config.run_dir, len(CASE["new_ids"]))
    assert got == CASE["new_ids"]
    assert f"checkpoint {Path(run.config.run_dir).resolve() / 'checkpoints' / '1'}" in out
    assert "float32 compute" in out and "eos 1" in out  # the run's dtype, v3_chat's eos


@pytest.mark.slow
def test_generates_from_the_newest_checkpoint_after_training(capsys, tmp_path):
    """Two steps at a high learning rate: the greedy tokens move, and generate follows
    the trained weights (the newest checkpoint, step 2)."""
    extra = {"steps": "2", "learning_rate": "0.05", "warmup_steps_fraction": "0"}
    run = run_lib.setup(make_config(_overrides(tmp_path, **extra)))
    run_lib.train(run)
    run.checkpoints.wait()
    got, out = _generate(capsys, run.config.run_dir, 4)
    assert f"checkpoint {Path(run.config.run_dir).resolve() / 'checkpoints' / '2'}" in out
    trained = {"params": run.state["params"], "router": run.state["router"]}
    assert got == _argmax_continuation(run.config, trained, CASE["prompt_ids"], 4)
    assert got != CASE["new_ids"][:4]  # the trained weights, not v3_chat's


def test_a_lora_run_generates_with_its_merged_weights(capsys, tmp_path):
    """A LoRA run's checkpoint holds adapters only (issue #55: generate ended in a
    traceback). Its base is loaded again as the run loaded it (hf_model_path) and the
    adapters merged: generate continues as the full forward of W + alpha / r A B."""
    lora = {"lora_rank": "2", "lora_targets": "attention"}
    run = run_lib.setup(make_config(_overrides(tmp_path, **lora)))
    # B starts at zero (the base exactly): give it values so the adapters matter.
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(
        lambda x: jax.device_put(0.5 * rng.standard_normal(x.shape).astype(x.dtype), x.sharding),
        run.state["params"],
    )
    run.checkpoints.save(1, {**run.state, "params": adapters})
    run.checkpoints.wait()
    got, out = _generate(capsys, run.config.run_dir, 3)
    from trainer import model as model_lib

    merged = model_lib.merged(run.model, run.state["frozen"], adapters)
    plain = make_config(_overrides(tmp_path / "plain"))
    expected = _argmax_continuation(
        plain, {"params": merged, "router": run.state["router"]}, CASE["prompt_ids"], 3
    )
    assert got == expected
    assert got != CASE["new_ids"][:3]  # the adapters moved the tokens

    # The same checkpoint as a PEFT adapter (export-hf adapter=true): lora_A.weight is
    # the trainer's A flattened to [in, r] and transposed (test_peft.py checks the
    # format against PEFT's own file); the base named is the run's hf_model_path.
    out = tmp_path / "adapter"
    assert export_hf.main([f"run_dir={run.config.run_dir}", f"output={out}", "adapter=true"]) == 0
    assert f"adapter: PEFT LoRA over {CHAT.resolve()}" in capsys.readouterr().out
    refs = safetensors.read_header(str(out / "adapter_model.safetensors"))
    a = np.asarray(adapters["dense_layers"]["attn"]["wq_a_DxQ_lora_a"])[0]
    name = "base_model.model.model.layers.0.self_attn.q_a_proj.lora_A.weight"
    np.testing.assert_array_equal(refs[name].array(), a.T)
    assert (out / "chat_template.jinja").exists() or (out / "tokenizer_config.json").exists()
