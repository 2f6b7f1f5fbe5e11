"""SFT data (use_sft, issue 45): chat-template ids and assistant masks against transformers'
(fixtures/hf/v3_chat/chat_reference.json, written by make_hf_fixtures.py), pretokenized
labels, packing and truncation keeping the masks, the eval set, and every bad row
(no JAX)."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from trainer.config import ConfigError, make_config, mesh_shape
from trainer.data import chat_template, eval_data, sft_data, text_data
from trainer.data.input_pipeline import make_source

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

CHAT = Path(__file__).parent / "fixtures" / "hf" / "v3_chat"
EXAMPLES = Path(__file__).parents[3] / "examples" / "chat"
REFERENCE = json.loads((CHAT / "chat_reference.json").read_text(encoding="utf-8"))
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
LENGTH = 64


def _config(**overrides):
    values = {
        "hf_model_path": str(CHAT),
        "dataset_type": "hf",
        "use_sft": "true",
        "hf_train_files": str(EXAMPLES / "train.jsonl"),
        "max_target_length": str(LENGTH),
        **overrides,
    }
    return make_config({key: value for key, value in values.items() if value is not None})


def _encoder(**overrides):
    config = _config(**overrides)
    return sft_data.Encoder(config.model, config.data, sft_data.MESSAGES)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


def _decode(ids):
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(CHAT / "tokenizer.json"))
    return tokenizer.decode(list(ids), skip_special_tokens=False)


@pytest.mark.parametrize("index", range(len(REFERENCE["conversations"])))
def test_ids_and_assistant_masks_equal_transformers(index):
    """Ids as transformers' apply_chat_template; the counted tokens as the assistant mask
    transformers computes from {% generation %} tags the fixture's template lacks."""
    conversation = REFERENCE["conversations"][index]
    ids, labels = _encoder().encode({"messages": conversation["messages"]}, f"ref {index}")
    np.testing.assert_array_equal(ids, conversation["input_ids"])
    np.testing.assert_array_equal(labels != text_data.IGNORE, conversation["assistant_masks"])
    np.testing.assert_array_equal(labels[labels != text_data.IGNORE], ids[labels != -100])
    # The tagged template parses here too ({% generation %} accepted, rendered as its body)
    # and gives the same text and spans.
    plain = chat_template.load(str(CHAT), "hf_model_path")
    tagged = dataclasses.replace(
        plain, template=plain.template.environment.from_string(REFERENCE["generation_template"])
    )
    assert tagged.assistant_spans(conversation["messages"]) == plain.assistant_spans(
        conversation["messages"]
    )


def test_multi_turn_with_a_system_prompt_counts_the_replies_and_their_eos():
    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "The mill is red. What colour is the mill?"},
        {"role": "assistant", "content": "The mill is red."},
        {"role": "user", "content": "Spell the number 2."},
        {"role": "assistant", "content": "It is two."},
    ]
    encoder = _encoder()
    ids, labels = encoder.encode({"messages": messages}, "row")
    text = _decode(ids)
    assert text == (
        f"{BOS}You answer in one short sentence.<｜User｜>The mill is red. What colour is the "
        f"mill?<｜Assistant｜>The mill is red.{EOS}<｜User｜>Spell the number 2.<｜Assistant｜>"
        f"It is two.{EOS}"
    )
    counted = labels != text_data.IGNORE
    # Two runs of counted tokens: each reply and its end-of-sentence, nothing else.
    starts = np.flatnonzero(np.diff(np.concatenate([[0], counted.astype(int)])) == 1)
    assert len(starts) == 2
    replies = [_decode(ids[s : s + np.argmin(counted[s:])]) for s in starts[:1]]
    assert replies == [f"The mill is red.{EOS}"]
    assert _decode(ids[starts[1] :]) == f"It is two.{EOS}" and counted[starts[1] :].all()
    assert ids[0] == 0 and ids[-1] == 1  # the template's bos, once; the reply's eos, counted

    # sft_train_on_completion_only=false: every token counts.
    _, labels = _encoder(sft_train_on_completion_only="false").encode({"messages": messages}, "r")
    np.testing.assert_array_equal(labels, ids)


def test_pretokenized_rows_shift_labels_inside_the_loss(tmp_path):
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]},
        {"input_ids": [10, 11, 12], "labels": [10, 11, -100], "attention_mask": [1, 1, 1]},
    ]
    path = _jsonl(tmp_path / "ids.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "ids.parquet")
    for name in ("ids.jsonl", "ids.parquet"):
        source = make_source(_config(hf_train_files=str(tmp_path / name), seed="1"), 1)
        assert "2 examples, pre-tokenized tokens: 6 targets (4 counted)" in source.describe()
        packed = source.packed
        row = packed[0]  # both examples in one row, in order
        np.testing.assert_array_equal(row["inputs"][:6], [5, 6, 7, 8, 10, 11])
        np.testing.assert_array_equal(row["targets"][:6], [0, 7, 8, 9, 11, 0])
        np.testing.assert_array_equal(row["weights"][:6], [0, 1, 1, 1, 1, 0])
        np.testing.assert_array_equal(row["segments"][:7], [1, 1, 1, 1, 2, 2, 0])
        np.testing.assert_array_equal(row["positions"][:6], [0, 1, 2, 3, 0, 1])
        assert not row["weights"][6:].any()
    # Targets are the labels, not the next input: a label may differ from the next id.
    ids, labels = _encoder().encode({"input_ids": [1, 2, 3], "labels": [-100, 4, 5]}, "r")
    packed = text_data.pack([ids], 8, [labels])
    np.testing.assert_array_equal(packed[0]["targets"][:2], [4, 5])
    # Without completion-only every id counts (the labels' -100 ignored).
    _, labels = _encoder(sft_train_on_completion_only="false").encode(rows[0], "r")
    np.testing.assert_array_equal(labels, rows[0]["input_ids"])
    del path


def test_packing_keeps_every_examples_mask():
    encoder = _encoder()
    lines = (EXAMPLES / "train.jsonl").read_text().splitlines()
    examples = [encoder.encode(json.loads(line), f"line {n}") for n, line in enumerate(lines)]
    packed = text_data.pack([ids for ids, _ in examples], LENGTH, [lab for _, lab in examples])
    assert len(packed) < len(examples)  # several conversations share rows
    unpacked = []
    for r in range(len(packed)):
        row = packed[r]
        for segment in range(1, row["segments"].max() + 1):
            at = row["segments"] == segment
            np.testing.assert_array_equal(row["positions"][at], np.arange(at.sum()))
            unpacked.append({key: row[key][at] for key in ("inputs", "targets", "weights")})
    assert len(unpacked) == len(examples)
    for got, (ids, labels) in zip(unpacked, examples, strict=True):
        counted = labels[1:] != text_data.IGNORE
        np.testing.assert_array_equal(got["inputs"], ids[:-1])
        np.testing.assert_array_equal(got["weights"], counted)
        np.testing.assert_array_equal(got["targets"][counted], ids[1:][counted])
    assert packed.counted_targets() == sum(int((lab[1:] != -100).sum()) for _, lab in examples)


def test_long_conversations_are_truncated_not_cut(tmp_path):
    source = make_source(_config(max_target_length="24"), 4)
    assert source.text.truncated > 0 and f"{source.text.truncated} truncated" in source.describe()
    # Every conversation is one segment starting at position 0: nothing was cut into pieces.
    assert len(source.packed.piece_len) == 48 and source.packed.piece_len.max() == 24


def test_parquet_conversations_and_the_eval_set(tmp_path):
    rows = [json.loads(line) for line in (EXAMPLES / "held_out.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "held_out.parquet")
    config = _config(
        hf_eval_files=str(tmp_path / "held_out.parquet"),
        eval_interval="2",
        eval_per_device_batch_size="1",
    )
    eval_set = eval_data.make_eval_set(config, 8, mesh_shape(config, 8))
    jsonl = sft_data.load_packed(
        config.model,
        config.data,
        [EXAMPLES / "held_out.jsonl"],
        "hf_eval_files",
        "train_data_columns",
    )
    assert eval_set.note.startswith("sft, 1 files, 8 conversations, tokenizer.json")
    # Read in order, masked exactly as the jsonl training rows would be.
    for index in range(eval_set.steps):
        got = eval_set.source.rows(index, 0, eval_set.batch_size)
        for r in range(eval_set.batch_size):
            row = index * eval_set.batch_size + r
            if row >= len(jsonl.packed):  # the last batch's padding counts nothing
                assert not got["weights"][r].any()
                continue
            for key in text_data.KEYS:
                np.testing.assert_array_equal(got[key][r], jsonl.packed[row][key])


def test_a_messages_column_named_by_train_data_columns(tmp_path):
    rows = [{"chat": json.loads(line)["messages"]} for line in (EXAMPLES / "train.jsonl")
            .read_text().splitlines()[:4]]  # fmt: skip
    path = _jsonl(tmp_path / "chat.jsonl", rows)
    source = make_source(_config(hf_train_files=str(path), train_data_columns="['chat']"), 1)
    assert "4 conversations" in source.describe()


def _no_template_dir(tmp_path):
    directory = tmp_path / "no_template"
    directory.mkdir()
    shutil.copy(CHAT / "config.json", directory)
    shutil.copy(CHAT / "tokenizer.json", directory)
    return directory


def _breaking_template_dir(tmp_path):
    """A template that drops earlier replies' text (as reasoning templates drop thoughts)."""
    directory = tmp_path / "breaking"
    directory.mkdir()
    shutil.copy(CHAT / "config.json", directory)
    shutil.copy(CHAT / "tokenizer.json", directory)
    config = json.loads((CHAT / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
        "<｜Assistant｜>...{{ eos_token }}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


USER = {"role": "user", "content": "hi"}
REPLY = {"role": "assistant", "content": "hello"}


@pytest.mark.parametrize(
    "rows, overrides, message",
    [
        ([{"chat": "hello"}], {}, r"ROWS:1 has none of 'messages' \(a conversation\), 'prompt' "
         r"\+ 'completion', 'text' or 'input_ids' \(pretokenized\); it has chat$"),
        ([{"messages": [USER, {"role": "robot", "content": "x"}]}], {},
         r"ROWS:1: message 1 has role 'robot', not one of system, developer, user"),
        ([{"messages": [USER, {"role": "assistant"}]}], {},
         r"ROWS:1: message 1 has neither content nor tool_calls"),
        ([{"messages": [USER, {"role": "assistant", "content": 3}]}], {},
         r"ROWS:1: message 1's content is a int, not a string, null or parts"),
        ([{"messages": [USER, {"role": "assistant", "content": [{"type": "image"}]}]}], {},
         r"ROWS:1: message 1's content has a part of type 'image'; a text model takes text"),
        ([{"prompt": "a", "completion": [REPLY]}], {},
         r"ROWS:1: prompt and completion must both be strings or both lists of messages"),
        ([{"input_ids": [1, 2], "assistant_masks": [1]}], {},
         r"ROWS:1: assistant_masks is not a list of 0 and 1 as long as input_ids \(2\)"),
        ([{"messages": [USER, REPLY]}, {"messages": [USER]}], {},
         r"ROWS:2: no assistant message \(nothing to learn from\)$"),
        ([{"messages": []}], {}, r"ROWS:1: 'messages' is not a non-empty list of messages"),
        ([{"input_ids": [1, 2, 3], "labels": [1, 2]}], {},
         r"ROWS:1: labels has 2 entries but input_ids 3 \(transformers' convention"),
        ([{"input_ids": [1, 2, 3]}], {}, r"ROWS:1 has input_ids but no labels"),
        ([{"input_ids": [1, 2, 600], "labels": [1, 2, 3]}], {},
         r"ROWS:1: input_ids holds 600, outside \[0, vocab_size=512\)"),
        ([{"input_ids": [1, 2], "labels": [1, -5]}], {},
         r"ROWS:1: labels holds -5, neither -100 nor in \[0, vocab_size=512\)"),
        ([{"input_ids": [1, 2], "labels": [1, 2], "attention_mask": [1, 0]}], {},
         r"ROWS:1: attention_mask holds zeros"),
        ([{"input_ids": [1, "a"], "labels": [1, 2]}], {},
         r"ROWS:1: input_ids holds something other than integers"),
        ([{"input_ids": [1, 2], "labels": [-100, -100]}], {},
         r"hf_train_files='ROWS': no token is counted in any row"),
        (["{not json"], {}, r"ROWS:1 is not valid JSON"),
        ([[1, 2]], {}, r"ROWS:1 is a list, not an object"),
        ([{"messages": [USER, REPLY]}], {"hf_model_path": None},
         r"ROWS:1 needs the checkpoint's tokenizer \(and, for messages, its chat template\) "
         r"under use_sft; set hf_model_path=DIR"),
        ([{"messages": [USER, REPLY]}], {"hf_model_path": "NO_TEMPLATE"},
         r"^hf_model_path='.*no_template' has no chat template \(no chat_template.jinja, no "
         r"'chat_template' in tokenizer_config.json\)"),
        ([{"messages": [USER, REPLY, USER, REPLY]}], {"hf_model_path": "BREAKING"},
         r"ROWS:1: the chat template \(.*\) does not render message 1 .* as an extension"),
        ([{"messages": [USER, REPLY]}], {"dataset_type": "text", "hf_train_files": None,
                                         "dataset_path": "ROWS"},
         r"^use_sft=true reads hf_train_files \(.jsonl or .parquet\) but dataset_type=text; "
         r"add dataset_type=hf$"),
        ([{"messages": [USER, REPLY]}], {"use_sft": "false",
                                         "sft_train_on_completion_only": "false"},
         r"^sft_train_on_completion_only=false is set but use_sft=false; add use_sft=true$"),
        ([{"messages": [USER, REPLY]}], {"eval_interval": "2"},
         r"^use_sft=true needs hf_eval_files=GLOB \(.jsonl or .parquet\) to evaluate"),
        ([{"messages": [USER, REPLY]}], {"hf_train_files": "ROWS.txt"},
         r"^hf_train_files='.*ROWS.txt' does not exist"),
    ],
)  # fmt: skip
def test_bad_rows_are_one_line_errors_naming_the_file_and_row(tmp_path, rows, overrides, message):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    places = {
        "ROWS": str(path),
        "NO_TEMPLATE": str(_no_template_dir(tmp_path)),
        "BREAKING": str(_breaking_template_dir(tmp_path)),
    }

    def place(value):
        for name, where in places.items():
            value = value.replace(name, where) if isinstance(value, str) else value
        return value

    config = _config(**{"hf_train_files": str(path), **{k: place(v) for k, v in overrides.items()}})
    with pytest.raises(ConfigError, match=message.replace("ROWS", re.escape(str(path)))) as error:
        make_source(config, 1)
    assert "\n" not in str(error.value)
