"""Supervised fine-tuning data (`use_sft=true`): conversations or labelled ids -> packed rows.

MaxText's keys: with `dataset_type=hf`, `hf_train_files` / `hf_eval_files` name
`.jsonl` or `.parquet` files (a glob, one file, or a directory searched recursively).
Each row (a jsonl line, a parquet row) is one example, either

- pretokenized: `input_ids` and `labels`, in transformers' convention: the same
  length, label i is what the model should predict having read ids up to i (the shift
  happens in the loss), -100 where nothing is counted; or
- a conversation: `messages`, a list of {role, content} (the column's name:
  `train_data_columns` / `eval_data_columns` when set to anything but the default
  `text`), rendered with the checkpoint's chat template (chat_template.py) and
  tokenized with its tokenizer.json without adding special tokens (the template writes
  them), as transformers' `apply_chat_template` does. The checkpoint is
  `tokenizer_path`'s directory, which `hf_model_path` fills in;
- or one of TRL's other forms (sft_rows.py): `prompt` + `completion`, `text`, or
  `input_ids` with `assistant_masks` / `completion_mask`.

With `sft_train_on_completion_only` (the default) only the assistant's tokens count:
every token overlapping an assistant message's text (the reply and whatever the
template closes it with, DeepSeek's end-of-sentence token included: it teaches the
model to stop), or the labels that are not -100. With it off, every token counts.

An example longer than `max_target_length` + 1 tokens is truncated (its end dropped,
counted on the startup line): cutting it into pieces would train replies without
their prompts. Examples are then packed as documents are (`text_data.pack`): each its
own segment, positions from 0, attention never crossing examples, the labels carried
with their tokens. The loss is the mean over the counted tokens of the whole optimizer
step: the summed token losses of every microbatch over the step's counted tokens
(accum divides once by the step's total weight), so a microbatch with more assistant
tokens weighs more; the eval loss is the same mean over the eval set.

Every problem with a row is a ConfigError naming the file and the row (jsonl: the
line number; parquet: the row index from 0), raised while the set is read, before
anything compiles.

The SFT format (input_pipeline.FORMATS, dataset_type=hf with use_sft=true):
`train_source` and `eval_source`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trainer.config import (
    Config,
    ConfigError,
    DataConfig,
    EvaluationConfig,
    ModelConfig,
)
from trainer.data import chat_template, eval_schedule, hf_data, sft_rows, text_data
from trainer.data.text_data import IGNORE

SUFFIXES = (".jsonl", ".parquet")
MESSAGES = "messages"  # the conversation column unless train_data_columns names another
OPTIONAL_COLUMNS = (
    "input_ids", "labels", "attention_mask", *sft_rows.MASKS, "prompt", "completion", "text"
)  # fmt: skip


# the data keys read here: hf's, and sft_train_on_completion_only (set without use_sft:
# refused, as a key another format reads)
READS = (*hf_data.READS, "sft_train_on_completion_only", "packing")
NEEDS = "use_sft=true reads hf_train_files (.jsonl or .parquet)"  # when dataset_type is not hf


def conversation_column(data: DataConfig, columns_key: str) -> str:
    """The column holding `messages`: the key's column unless it is the default `text`."""
    name = hf_data.column_name(getattr(data, columns_key), columns_key)
    return MESSAGES if name == "text" else name


def find_files(data: DataConfig, evaluation: EvaluationConfig, files_key: str) -> list[Path]:
    """The .jsonl / .parquet files `files_key` names (ConfigError naming the key)."""
    pattern = getattr(data, files_key)
    if not pattern:
        purpose = ""
        if files_key == "hf_eval_files":
            purpose = f" to evaluate (eval_interval={evaluation.eval_interval})"
        raise ConfigError(f"use_sft=true needs {files_key}=GLOB (.jsonl or .parquet){purpose}")
    files = hf_data.find_parquet_files(pattern, files_key, SUFFIXES)
    kept = [path for path in files if path.suffix in SUFFIXES]
    if not kept:
        raise ConfigError(f"{files_key}={pattern!r} names no .jsonl or .parquet files")
    return kept


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{number}", json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}:{number} is not valid JSON: {error}") from None


def _parquet_rows(path: Path, column: str, key: str) -> Iterator[tuple[str, Any]]:
    parquet = hf_data.open_parquet(path, key)
    names = parquet.schema_arrow.names
    if not {column, "input_ids", "prompt", "text"} & set(names):
        raise ConfigError(
            f"{path} has none of the columns {column!r} (conversations), 'prompt' + "
            f"'completion', 'text' or 'input_ids' (pretokenized); its columns: {', '.join(names)}"
        )
    wanted = [name for name in (column, *OPTIONAL_COLUMNS) if name in names]
    index = 0
    for batch in parquet.iter_batches(batch_size=hf_data.ROWS_PER_READ, columns=wanted):
        for row in batch.to_pylist():
            yield f"{path} row {index}", row
            index += 1


def read_rows(path: Path, column: str, key: str) -> Iterator[tuple[str, Any]]:
    """(where, row) in file order; `where` names the file and the row for messages."""
    return _parquet_rows(path, column, key) if path.suffix == ".parquet" else _jsonl_rows(path)


def _int_list(value: Any, name: str, where: str) -> np.ndarray:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: {name} is not a non-empty list of integers")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{where}: {name} holds something other than integers")
    return np.asarray(value, np.int64)


def checkpoint_key(model: ModelConfig, data: DataConfig) -> tuple[str, str]:
    """(the key naming the checkpoint whose tokenizer and chat template render
    conversations, its directory): tokenizer_path's directory when set by hand, else
    hf_model_path (which fills tokenizer_path with its tokenizer.json); ("", "") if none."""
    from_hf = os.path.join(model.hf_model_path, "tokenizer.json") if model.hf_model_path else ""
    if data.tokenizer_path and data.tokenizer_path != from_hf:
        return "tokenizer_path", os.path.dirname(data.tokenizer_path) or "."
    if model.hf_model_path:
        return "hf_model_path", model.hf_model_path
    return "", ""


class Encoder:
    """Turns rows into (ids, labels): the checkpoint's tokenizer and chat template are
    opened on the first conversation (pretokenized rows need neither)."""

    def __init__(self, model: ModelConfig, data: DataConfig, column: str):
        self.vocab_size, self.column = model.vocab_size, column
        self.completion_only = data.sft_train_on_completion_only
        self.key, self.directory = checkpoint_key(model, data)
        self.tokenizer_path = data.tokenizer_path or os.path.join(self.directory, "tokenizer.json")
        self.tokenizer: Any = None  # tokenizers.Tokenizer, once a row needs it
        self.special_tokens: dict[str, str] = {}  # tokenizer_config.json's
        self.template: chat_template.ChatTemplate | None = None
        self.conversations = self.pretokenized = self.other = 0

    def need_tokenizer(self, where: str):
        """The checkpoint's tokenizer (opened on the first row that needs it)."""
        if self.tokenizer is not None:
            return self.tokenizer
        if not self.key:
            raise ConfigError(
                f"{where} needs the checkpoint's tokenizer (and, for messages, its chat "
                "template) under use_sft; set hf_model_path=DIR (or "
                "tokenizer_path=DIR/tokenizer.json)"
            )
        if not os.path.isfile(self.tokenizer_path):
            raise ConfigError(
                f"{self.key}={self.directory!r} has no tokenizer.json, which conversations "
                f"({where}) need under use_sft"
            )
        import tokenizers  # here: pretokenized sets need no tokenizer

        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(self.tokenizer_path)
        except Exception as error:  # the Rust side raises its own exception types
            raise ConfigError(
                f"{self.key}: {self.tokenizer_path} is not a readable tokenizer.json: {error}"
            ) from None
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if size > self.vocab_size:
            raise ConfigError(
                f"vocab_size={self.vocab_size} is smaller than the {size} ids of "
                f"{self.tokenizer_path}; set vocab_size={size} or more"
            )
        self.special_tokens = chat_template.special_tokens(self.directory, self.key)
        return self.tokenizer

    def need_template(self, where: str) -> chat_template.ChatTemplate:
        """The checkpoint's chat template (and tokenizer), opened on first use."""
        self.need_tokenizer(where)
        if self.template is None:
            self.template = chat_template.load(self.directory, self.key)
        return self.template

    def rendered(self, render, where: str, *args):
        """`render(*args)`, a template's refusal (or a type it cannot render) one line."""
        import jinja2  # here: only conversations render a template

        try:
            return render(*args)
        except chat_template.TemplateBreaksPrefix as error:
            raise ConfigError(f"{where}: {error}") from None
        except (jinja2.TemplateError, TypeError) as error:
            raise ConfigError(
                f"{where}: the chat template ({self.template.source}) refused it: {error}"
            ) from None

    def encode(self, row: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, labels) of one row, int32, labels IGNORE where not counted."""
        if not isinstance(row, dict):
            raise ConfigError(f"{where} is a {type(row).__name__}, not an object")
        if row.get("input_ids") is not None:
            self.pretokenized += 1
            return self._pretokenized(row, where)
        if row.get("prompt") is not None and row.get("completion") is not None:
            self.other += 1
            return sft_rows.prompt_completion(self, row, where)
        if row.get(self.column) is not None:
            self.conversations += 1
            messages = sft_rows.check_messages(row[self.column], where, self.column)
            return self._conversation(messages, where)
        if row.get("text") is not None:
            self.other += 1
            return sft_rows.text(self, row, where)
        raise ConfigError(
            f"{where} has none of {self.column!r} (a conversation), 'prompt' + 'completion', "
            f"'text' or 'input_ids' (pretokenized); it has "
            f"{', '.join(sorted(map(str, row))) or 'nothing'}"
        )

    def _pretokenized(self, row: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
        ids = _int_list(row["input_ids"], "input_ids", where)
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise ConfigError(
                f"{where}: input_ids holds {bad}, outside [0, vocab_size={self.vocab_size})"
            )
        mask = row.get("attention_mask")
        if mask is not None and not all(mask):
            raise ConfigError(
                f"{where}: attention_mask holds zeros; drop the padding (rows are packed, "
                "padding is added where a row is not full)"
            )
        if row.get("labels") is None:
            mask = next((name for name in sft_rows.MASKS if row.get(name) is not None), None)
            if mask and self.completion_only:
                labels = sft_rows.mask_labels(ids, row[mask], mask, where)
                return ids.astype(np.int32), labels.astype(np.int32)
            if self.completion_only:
                raise ConfigError(
                    f"{where} has input_ids but no labels (-100 where not counted) nor "
                    "assistant_masks / completion_mask; add them, or set "
                    "sft_train_on_completion_only=false to count every token"
                )
            return ids.astype(np.int32), ids.astype(np.int32)
        labels = _int_list(row["labels"], "labels", where)
        if len(labels) != len(ids):
            raise ConfigError(
                f"{where}: labels has {len(labels)} entries but input_ids {len(ids)} "
                "(transformers' convention: the same length, shifted inside the loss)"
            )
        if not self.completion_only:
            labels = ids
        bad = labels[(labels != IGNORE) & ((labels < 0) | (labels >= self.vocab_size))]
        if bad.size:
            raise ConfigError(
                f"{where}: labels holds {bad[0]}, neither -100 nor in [0, vocab_size="
                f"{self.vocab_size})"
            )
        return ids.astype(np.int32), labels.astype(np.int32)

    def _conversation(self, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
        template = self.need_template(where)
        if self.completion_only:
            text, spans = self.rendered(template.assistant_spans, where, messages)
        else:
            text, spans = self.rendered(template.render, where, messages), []
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, np.int32)
        if not self.completion_only:
            return ids, ids.copy()
        offsets = np.asarray(encoding.offsets, np.int64).reshape(-1, 2)
        counted = np.zeros(len(ids), bool)
        for start, stop in spans:
            # A token counts when it covers any character of an assistant message.
            counted |= (offsets[:, 0] < stop) & (offsets[:, 1] > start)
        return ids, np.where(counted, ids, IGNORE).astype(np.int32)

    def as_tokenizer(self) -> text_data.Tokenizer | None:
        """The tokenizer rows were encoded with (None: every row was pretokenized),
        named for the startup line."""
        if self.tokenizer is None:
            return None
        tok = self.tokenizer
        name = f"tokenizer.json ({self.tokenizer_path})"
        if self.template is not None:
            name += f" + chat template ({self.template.source})"
        return text_data.Tokenizer(
            name, self.vocab_size, None, lambda text: tok.encode(text, add_special_tokens=False).ids
        )


def load_packed(
    model: ModelConfig, data: DataConfig, files: list[Path], files_key: str, columns_key: str
) -> text_data.PackedText:
    """Read every row of `files`, encode, truncate and pack into rows of max_target_length."""
    encoder = Encoder(model, data, conversation_column(data, columns_key))
    length = data.max_target_length
    ids, labels, truncated = [], [], 0
    for path in files:
        for where, row in read_rows(path, encoder.column, files_key):
            row_ids, row_labels = encoder.encode(row, where)
            if len(row_ids) > length + 1:  # length + 1 tokens fill a row's `length` pairs
                truncated += 1
                row_ids, row_labels = row_ids[: length + 1], row_labels[: length + 1]
            ids.append(row_ids)
            labels.append(row_labels)
    where = f"{files_key}={getattr(data, files_key)!r}"
    if not ids:
        raise ConfigError(f"{where}: {len(files)} files hold no rows")
    packed = text_data.pack(ids, length, labels, packing=data.packing)
    if not len(packed) or not packed.counted_targets():
        raise ConfigError(f"{where}: no token is counted in any row (nothing to learn from)")
    tokenizer = encoder.as_tokenizer()
    unit = "examples" if encoder.pretokenized or encoder.other else "conversations"
    return text_data.PackedText(packed, tokenizer, files, len(ids), unit, truncated)


def train_source(config: Config, global_batch: int) -> text_data.TextSource:
    """The training stream over hf_train_files' examples; the eval files are found
    first too (when evaluating), so a bad key stops the run before any row is read."""
    data, evaluation = config.data, config.evaluation
    hf_data.check_loader(data)
    files = find_files(data, evaluation, "hf_train_files")
    if eval_schedule.enabled(evaluation):
        find_files(data, evaluation, "hf_eval_files")
    text = load_packed(config.model, data, files, "hf_train_files", "train_data_columns")
    return text_data.shuffled_source(text, config.training, global_batch, "sft")


def eval_source(config: Config, global_batch: int) -> text_data.PackedEvalSource:
    """The eval set's examples, encoded and packed as the training ones (same masking)."""
    data = config.data
    files = find_files(data, config.evaluation, "hf_eval_files")
    columns_key = hf_data.eval_columns_key(data)
    text = load_packed(config.model, data, files, "hf_eval_files", columns_key)
    return text_data.PackedEvalSource(text, global_batch, "sft")


def loss_line(data: DataConfig) -> str:
    """The startup line saying what the loss averages over."""
    counted = (
        "assistant tokens and labels other than -100"
        if data.sft_train_on_completion_only
        else "every token (sft_train_on_completion_only=false)"
    )
    return (
        f"loss: mean over the step's counted tokens ({counted}): the summed token losses of "
        "all microbatches / the step's counted tokens, not a mean of microbatch means; "
        "eval: the same over the eval set"
    )
