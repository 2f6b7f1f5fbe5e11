"""MaxText's own DeepSeek command lines parse unchanged; MaxText-only keys are honoured
or refused by name, never dropped."""

from __future__ import annotations

import shlex
import subprocess
import sys
import typing

import pytest

from trainer.config import Config, ConfigError, make_config, maxtext_compat
from trainer.config.make import parse_value
from trainer.run import main
from trainer.sharding import distributed

BUCKET = "gs://example-bucket"

# The `MaxText.train` commands of MaxText's DeepSeek docs (end_to_end/tpu/deepseek:
# Run_DeepSeek.md, v2-16b/test_deepseek.sh, v3-671b/test_deepseek_mtp.sh), with their
# shell variables filled in, and MaxText's CPU recipe for the same models.
MAXTEXT_COMMANDS = {
    "v3 pre-training": f"""src/MaxText/configs/base.yml base_output_directory={BUCKET}
        run_name=matmul_pre_training per_device_batch_size=4 enable_checkpointing=false
        model_name=deepseek3-671b ici_fsdp_parallelism=128 steps=5 max_target_length=1024
        async_checkpointing=false tokenizer_type=huggingface
        tokenizer_path=deepseek-ai/DeepSeek-V3 attention=flash dtype=bfloat16
        weight_dtype=bfloat16 megablox=False sparse_matmul=False dataset_type=synthetic""",
    "v3 fine-tuning": f"""src/MaxText/configs/base.yml base_output_directory={BUCKET}
        dataset_path={BUCKET}/data load_parameters_path={BUCKET}/ckpt/0/items
        run_name=matmul_fine_tuning per_device_batch_size=4 model_name=deepseek3-671b steps=5
        max_target_length=1024 async_checkpointing=false tokenizer_type=huggingface
        tokenizer_path=deepseek-ai/DeepSeek-V3 attention=flash dtype=bfloat16
        weight_dtype=bfloat16 megablox=False sparse_matmul=False enable_checkpointing=true
        ici_expert_parallelism=128 ici_fsdp_parallelism=1""",
    "v3 MTP fine-tuning": f"""MaxText/configs/base.yml base_output_directory={BUCKET}
        dataset_path={BUCKET}/data load_parameters_path={BUCKET}/ckpt/0/items
        run_name=mtp_fine_tuning per_device_batch_size=4 model_name=deepseek3-671b
        ici_fsdp_parallelism=128 steps=10000 max_target_length=2048
        tokenizer_type=huggingface tokenizer_path=deepseek-ai/DeepSeek-V3 attention=flash
        dtype=bfloat16 weight_dtype=bfloat16 enable_checkpointing=true mtp_num_layers=1
        mtp_loss_scaling_factor=0.1""",
    "v2-lite pre-training": f"""src/MaxText/configs/base.yml
        base_output_directory={BUCKET} run_name=matmul_pre_training per_device_batch_size=4
        enable_checkpointing=false model_name=deepseek2-16b ici_fsdp_parallelism=4 steps=5
        max_target_length=1024 async_checkpointing=false tokenizer_type=huggingface
        tokenizer_path=deepseek-ai/DeepSeek-V2-Lite attention=flash dtype=bfloat16
        weight_dtype=bfloat16 megablox=False sparse_matmul=False dataset_type=synthetic""",
    "v2-lite fine-tuning": f"""src/MaxText/configs/base.yml
        base_output_directory={BUCKET} dataset_path={BUCKET}/data
        load_parameters_path={BUCKET}/ckpt/0/items run_name=matmul_fine_tuning
        per_device_batch_size=4 enable_checkpointing=false model_name=deepseek2-16b
        ici_fsdp_parallelism=4 steps=5 max_target_length=1024 async_checkpointing=false
        tokenizer_type=huggingface tokenizer_path=deepseek-ai/DeepSeek-V2-Lite attention=flash
        dtype=bfloat16 weight_dtype=bfloat16 megablox=False sparse_matmul=False
        enable_checkpointing=true""",
    "cpu smoke run": """src/MaxText/configs/base.yml run_name=cpu_test
        base_output_directory=/tmp/maxtext_cpu model_name=deepseek3-tiny
        per_device_batch_size=1 steps=2 dataset_type=synthetic hardware=cpu
        attention=dot_product skip_jax_distributed_system=true megablox=false
        sparse_matmul=false enable_checkpointing=false""",
}


def _parse(command: str):
    overrides, notes = maxtext_compat.read_command_line(shlex.split(command))
    return overrides, notes, make_config(overrides)


@pytest.mark.parametrize("name", sorted(MAXTEXT_COMMANDS))
def test_maxtext_command_parses_and_sets_its_keys(name):
    overrides, notes, config = _parse(MAXTEXT_COMMANDS[name])
    # Every key the command sets reaches the config with the command's value.
    for key, raw in overrides.items():
        assert getattr(config, key) == parse_value(key, raw), key
    # The kernel choices that tagtrain honours another way are said, not dropped.
    if "attention=flash" in MAXTEXT_COMMANDS[name]:
        assert any(note.startswith("attention=flash") for note in notes)
    assert any("base" in note for note in notes)


def test_keys_tagtrain_cannot_honour_are_refused_by_name():
    for arg, key in [
        ("attention=paged", "attention"),
        ("tokenizer_type=sentencepiece", "tokenizer_type"),
        ("megablox=maybe", "megablox"),
    ]:
        with pytest.raises(ConfigError, match=key):
            maxtext_compat.read_command_line([arg])
    with pytest.raises(ConfigError, match="my.yml"):
        maxtext_compat.read_command_line(["configs/my.yml", "steps=2"])


def test_exact_values_need_no_note():
    _, notes = maxtext_compat.read_command_line(["attention=dot_product", "megablox=false"])
    assert notes == []


@pytest.mark.parametrize(
    "given, ours",
    [
        ("dot_product", "dot_product"),
        ("cudnn_flash", "cudnn_flash"),
        ("splash", "splash"),
        ("auto", "auto"),
        ("flash", "auto"),
        ("autoselected", "auto"),
        ("cudnn_flash_te", "cudnn_flash"),
    ],
)
def test_attention_on_the_command_line_reaches_the_attention_key(given, ours):
    # The `attention` key is tagtrain's own too: a command line's value is translated
    # onto it, never absorbed (attention=dot_product must not leave auto in place).
    overrides, _ = maxtext_compat.read_command_line([f"attention={given}"])
    assert overrides == {"attention": ours}
    assert make_config(overrides).model.attention == ours


def test_every_hardware_value_names_a_jax_platform():
    choices = typing.get_args(typing.get_type_hints(Config)["hardware"])
    assert {c for c in choices if c} == set(main.PLATFORMS)


def test_skip_jax_distributed_system_keeps_one_process(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1234")
    assert distributed.choose_launch().multi_process
    assert not distributed.choose_launch(skip=True).multi_process
    with pytest.raises(ValueError, match="--coordinator_address"):
        distributed.choose_launch("127.0.0.1:1234", 2, 0, skip=True)


def test_hardware_cpu_selects_the_cpu_backend():
    # A fresh process: the platform is fixed when JAX's backend first starts.
    code = (
        "from absl import flags; from trainer.run import main; flags.FLAGS(['x']); "
        "main._configure_jax('cpu'); import jax; print(jax.devices()[0].platform, "
        "jax.device_count())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["cpu", "8"]
