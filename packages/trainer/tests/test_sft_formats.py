"""SFT rows in the forms TRL's SFTTrainer takes (data/sft_rows.py), packing, num_epochs,
the warmup and the named schedulers, a data set smaller than a batch (issue #55).

TRL's behaviour these tests hold the trainer to (trl/trainer/sft_trainer.py, SFTConfig;
transformers' optimization.py), written down here since neither is a dependency:
- prompt/completion, plain: `prompt_ids = tok(prompt)`, `ids = tok(prompt + completion)`
  with the eos token appended to the completion when it lacks one (add_eos), special
  tokens as the tokenizer adds them; completion_mask 0 over len(prompt_ids), 1 after;
  completion_only_loss (the default for this form) counts the completion alone.
- prompt/completion, conversational: the same with apply_chat_template(prompt) (the
  generation prompt added) and apply_chat_template(prompt + completion).
- text: tok(text + eos), every token counted.
- pretokenized input_ids + assistant_masks / completion_mask: 1 counted, 0 not.
- packing: SFTConfig.packing (false: one example per sequence).
- get_linear_schedule_with_warmup: step/warmup during the warmup, then
  (total - step) / (total - warmup); get_constant_schedule_with_warmup: step/warmup,
  then 1; get_cosine_schedule_with_warmup: 0.5 (1 + cos(pi progress)) after it.
"""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from trainer.config import ConfigError, make_config
from trainer.config.validate import validate
from trainer.data import sft_data
from trainer.data.input_pipeline import make_source
from trainer.data.text_data import IGNORE
from trainer.step.optimizer import learning_rate_schedule

CHAT = Path(__file__).parent / "fixtures" / "hf" / "v3_chat"
EXAMPLES = Path(__file__).parents[3] / "examples" / "chat"
EOS = "<｜end▁of▁sentence｜>"
USER = {"role": "user", "content": "What is a cache?"}
REPLY = {"role": "assistant", "content": "A fast store."}


def _config(directory=CHAT, **overrides):
    values = {
        "hf_model_path": str(directory),
        "dataset_type": "hf",
        "use_sft": "true",
        "hf_train_files": str(EXAMPLES / "train.jsonl"),
        "max_target_length": "64",
        **overrides,
    }
    return make_config(values)


def _encode(row, directory=CHAT, **overrides):
    config = _config(directory, **overrides)
    return sft_data.Encoder(config.model, config.data, sft_data.MESSAGES).encode(row, "row")


def _tokenizer():
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(CHAT / "tokenizer.json"))


def test_plain_prompt_completion_counts_the_completion_as_trl():
    tok = _tokenizer()
    ids, labels = _encode({"prompt": "The capital of France is", "completion": " Paris."})
    prompt_ids = tok.encode("The capital of France is").ids
    assert ids.tolist() == tok.encode("The capital of France is Paris." + EOS).ids
    assert ids[-1] == tok.token_to_id(EOS)  # add_eos
    assert (labels[: len(prompt_ids)] == IGNORE).all()
    assert labels[len(prompt_ids) :].tolist() == ids[len(prompt_ids) :].tolist()
    _, every = _encode({"prompt": "a", "completion": "b"}, sft_train_on_completion_only="false")
    assert (every != IGNORE).all()


def test_conversational_prompt_completion_counts_what_messages_count():
    """DeepSeek's template: past the generation prompt is the reply and its eos, the
    same tokens a `messages` row counts for that turn."""
    pc_ids, pc_labels = _encode({"prompt": [USER], "completion": [REPLY]})
    ids, labels = _encode({"messages": [USER, REPLY]})
    assert pc_ids.tolist() == ids.tolist() and pc_labels.tolist() == labels.tolist()
    assert (labels != IGNORE).sum() > 0 and labels[-1] == _tokenizer().token_to_id(EOS)


def test_text_rows_count_every_token_and_end_with_eos():
    tok = _tokenizer()
    ids, labels = _encode({"text": "Once upon a time"})
    assert ids.tolist() == tok.encode("Once upon a time" + EOS).ids
    assert labels.tolist() == ids.tolist()


@pytest.mark.parametrize("mask", ["assistant_masks", "completion_mask"])
def test_pretokenized_masks_choose_the_counted_tokens(mask):
    ids, labels = _encode({"input_ids": [5, 6, 7, 8], mask: [0, 0, 1, 1]})
    assert labels.tolist() == [IGNORE, IGNORE, 7, 8]


# DeepSeek-V3's way with tools, cut down: an assistant turn with tool_calls and null
# content, a tool message answering it.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'tool' %}<｜tool▁output▁begin｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>"
    "{% if m['content'] is none %}{% for call in m['tool_calls'] %}"
    "call {{ call['function']['name'] }}({{ call['function']['arguments'] | tojson }})"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def _tool_checkpoint(tmp_path) -> Path:
    out = tmp_path / "tools"
    shutil.copytree(CHAT, out)
    (out / "chat_template.jinja").write_text(TOOL_TEMPLATE, encoding="utf-8")
    return out


def test_tool_calls_null_content_and_parts_reach_the_template(tmp_path):
    directory = _tool_checkpoint(tmp_path)
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"q": "cache"}}}
    messages = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "a store"},
        REPLY,
    ]
    ids, labels = _encode({"messages": messages}, directory)
    counted = _tokenizer().decode(ids[labels != IGNORE].tolist(), skip_special_tokens=False)
    assert 'call lookup({"q": "cache"})' in counted and "A fast store." in counted
    assert "a store" not in counted.replace("A fast store.", "")  # the tool's output is not
    # Content as a list of text parts is the joined text.
    parts = [{"type": "text", "text": "A fast "}, {"type": "text", "text": "store."}]
    as_parts = [USER, {"role": "assistant", "content": parts}]
    assert [x.tolist() for x in _encode({"messages": as_parts}, directory)] == [
        x.tolist() for x in _encode({"messages": [USER, REPLY]}, directory)
    ]


def test_packing_off_puts_one_example_a_row(tmp_path):
    rows = [json.loads(line) for line in (EXAMPLES / "train.jsonl").read_text().splitlines()]
    packed = make_source(_config(), 4).packed
    unpacked = make_source(_config(packing="false"), 4).packed
    assert len(unpacked) == len(rows) > len(packed)
    assert unpacked.counted_targets() == packed.counted_targets()
    assert {int(unpacked[r]["segments"].max()) for r in range(len(unpacked))} == {1}


def test_a_data_set_smaller_than_the_batch_says_so():
    source = make_source(_config(), 64)
    assert len(source.packed) < 64
    assert f"only {len(source.packed)} rows for a global batch of 64: every step repeats rows" in (
        source.describe()
    )
    assert "repeats rows" not in make_source(_config(), 4).describe()


def _schedule(**keys):
    config = make_config({"steps": "10", "learning_rate": "1.0", **keys})
    schedule = learning_rate_schedule(config.training)
    return [float(schedule(step)) for step in range(11)]


def test_schedulers_are_transformers():
    def linear(step):
        return step / 2 if step < 2 else max(0.0, (10 - step) / 8)

    def cosine(step):
        return step / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * (step - 2) / 8))

    np.testing.assert_allclose(
        _schedule(warmup_steps="2", lr_scheduler_type="linear"), [linear(s) for s in range(11)],
        atol=1e-6,
    )  # fmt: skip
    constant = [0.0, 0.5] + [1.0] * 9
    np.testing.assert_allclose(
        _schedule(warmup_steps="2", lr_scheduler_type="constant"), constant, atol=1e-6
    )
    np.testing.assert_allclose(
        _schedule(warmup_steps="2", cosine_final_lr_fraction="0"), [cosine(s) for s in range(11)],
        atol=1e-6,
    )  # fmt: skip
    # warmup_steps wins over warmup_steps_fraction (0.1 x 10 = 1 step by default).
    assert _schedule(warmup_steps="4", lr_scheduler_type="constant")[3] == pytest.approx(0.75)
    with pytest.raises(ConfigError, match="lr_scheduler_type='cosine_with_restarts' is not one"):
        validate(make_config({"lr_scheduler_type": "cosine_with_restarts"}), 8)
    with pytest.raises(ConfigError, match="warmup_steps=20 must be <= steps=10"):
        validate(make_config({"steps": "10", "warmup_steps": "20"}), 8)
    with pytest.raises(ConfigError, match="num_epochs=2 must be >= 0 and needs data"):
        validate(make_config({"num_epochs": "2"}), 8)  # synthetic batches: no size


def test_num_epochs_sets_the_steps_from_the_rows(tmp_path):
    """transformers' num_train_epochs: steps = ceil(epochs x rows / global batch)."""
    from trainer.run import run as run_lib

    config = _config(num_epochs="3", base_output_directory=str(tmp_path), steps="1")
    run = run_lib.setup(config)
    rows, batch = len(run.source.packed), run.spec.batch_size
    assert run.config.steps == math.ceil(3 * rows / batch) > 1
    assert f"num_epochs=3: {rows} rows / {batch} a step -> steps={run.config.steps}" in (
        run.source.describe()
    )
