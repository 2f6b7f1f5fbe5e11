"""Text data: `.txt` / `.jsonl` files -> tokens -> packed rows -> a grain MapDataset.

Every document (a `.txt` file, or one `.jsonl` line's `jsonl_field`) is
tokenized — bytes by default (ids 0..255, `EOS_BYTE` = 256 ends a document), or
a local `tokenizer.json` through `tokenizers` — and turned into (input, target)
pairs. Pairs never cross a document, so packing needs no cross-document mask:
documents longer than `max_target_length` pairs are cut into pieces, and pieces
are packed in order into rows of `max_target_length`, each piece its own
segment (1..n per row, 0 for padding) with positions restarting at 0. Padding
has weight 0, every real target weight 1.

The packed rows are a grain `MapDataset`, shuffled with `seed` and repeated
(reshuffled every epoch). Global row `r` of step `s` is element
`s * global_batch + r`, so any process can build any rows of any step on its
own: a process builds only the rows its devices hold, and a resumed run
continues the exact stream from its step.

The text format (input_pipeline.FORMATS): `train_source` (the stream above) and
`eval_source` (`eval_dataset_path`'s files packed the same way, read in order by
`PackedEvalSource`, which hf_data.py and sft_data.py use too).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trainer.config import Config, ConfigError, DataConfig, ModelConfig, TrainingConfig

if TYPE_CHECKING:
    import grain

READS = ("dataset_path", "eval_dataset_path", "tokenizer_path")  # the data keys read here
SUFFIXES = (".txt", ".jsonl")
EOS_BYTE = 256
BYTE_VOCAB = 257  # 256 bytes + end-of-document
KEYS = ("inputs", "targets", "positions", "segments", "weights")
IGNORE = -100  # a label that is not counted (transformers' ignore_index)
# End-of-document tokens looked up in a tokenizer.json, first match wins.
EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "[SEP]", "<|im_end|>")


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    name: str
    vocab_size: int  # ids are < vocab_size
    eos_id: int | None
    encode: Callable[[str], Sequence[int]]


def byte_tokenizer() -> Tokenizer:
    return Tokenizer(
        "bytes", BYTE_VOCAB, EOS_BYTE, lambda text: np.frombuffer(text.encode("utf-8"), np.uint8)
    )


def load_tokenizer(path: str) -> Tokenizer:
    """A local tokenizer.json (Hugging Face `tokenizers` format)."""
    if not os.path.isfile(path):
        raise ConfigError(f"tokenizer_path={path!r} is not a file")
    import tokenizers

    try:
        tok = tokenizers.Tokenizer.from_file(path)
    except Exception as error:  # the Rust side raises its own exception types
        raise ConfigError(
            f"tokenizer_path={path!r} is not a readable tokenizer.json: {error}"
        ) from None
    eos = next((i for i in map(tok.token_to_id, EOS_NAMES) if i is not None), None)
    return Tokenizer(
        f"tokenizer.json ({path})",
        tok.get_vocab_size(with_added_tokens=True),
        eos,
        lambda text: tok.encode(text, add_special_tokens=False).ids,
    )


def find_files(dataset_path: str, key: str = "dataset_path") -> list[Path]:
    """A directory (searched recursively), a glob, or one file; only .txt / .jsonl.

    `key` is the config key that named the path (dataset_path, eval_dataset_path):
    every error names it.
    """
    if not dataset_path:
        raise ConfigError(f"dataset_type=text needs {key}=DIR_OR_GLOB (.txt / .jsonl files)")
    path = Path(dataset_path)
    if path.is_dir():
        found = [p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file()]
        where = f"directory {key}={dataset_path!r}"
    elif glob.has_magic(dataset_path):
        matches = [Path(p) for p in glob.glob(dataset_path, recursive=True)]
        found = [p for p in matches if p.suffix in SUFFIXES and p.is_file()]
        where = f"{key}={dataset_path!r} (matched {len(matches)} paths)"
    elif path.is_file():
        if path.suffix not in SUFFIXES:
            raise ConfigError(f"{key}={dataset_path!r} is not a .txt or .jsonl file")
        found = [path]
        where = ""
    else:
        raise ConfigError(f"{key}={dataset_path!r} does not exist")
    if not found:
        raise ConfigError(f"{where} holds no .txt or .jsonl files")
    return sorted(found)


def read_documents(files: Sequence[Path], field: str) -> Iterator[str]:
    """Documents in file order; unreadable or malformed input raises ConfigError."""
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"cannot read dataset file {str(path)!r}: {error}") from None
        if path.suffix == ".txt":
            yield text
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path}:{number} is not valid JSON: {error}") from None
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(
                    f"{path}:{number} has no field {field!r} (jsonl_field={field!r}); it has {keys}"
                )
            if not isinstance(record[field], str):
                raise ConfigError(
                    f"{path}:{number} field {field!r} is a {type(record[field]).__name__}, "
                    "not a string"
                )
            yield record[field]


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Rows of packed document pieces over one flat token array (random access).

    Piece `i` covers pairs (tokens[j], tokens[j + 1]) for j in
    [piece_start[i], piece_start[i] + piece_len[i]); row `r` holds pieces
    row_start[r] .. row_start[r + 1] - 1.
    """

    tokens: np.ndarray
    piece_start: np.ndarray
    piece_len: np.ndarray
    row_start: np.ndarray
    length: int
    # SFT (sft_data.py): per token, its label in transformers' convention (aligned with
    # `tokens`, the pair ending at token j+1 targets labels[j+1]; IGNORE: not counted).
    # None: every pair counts and targets the next token.
    labels: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.row_start) - 1

    def counted_targets(self) -> int:
        """Targets that count in the loss (weight 1) over all rows."""
        if self.labels is None:
            return int(self.piece_len.sum())
        return sum(
            int(np.count_nonzero(self.labels[s + 1 : s + n + 1] != IGNORE))
            for s, n in zip(self.piece_start, self.piece_len, strict=True)
        )

    def __getitem__(self, row: int) -> dict[str, np.ndarray]:
        length = self.length
        out = {
            "inputs": np.zeros(length, np.int32),
            "targets": np.zeros(length, np.int32),
            "positions": np.zeros(length, np.int32),
            "segments": np.zeros(length, np.int32),
            "weights": np.zeros(length, np.float32),
        }
        at = 0
        first, stop = self.row_start[row], self.row_start[row + 1]
        for segment, piece in enumerate(range(first, stop), 1):
            start, n = int(self.piece_start[piece]), int(self.piece_len[piece])
            out["inputs"][at : at + n] = self.tokens[start : start + n]
            out["positions"][at : at + n] = np.arange(n)
            out["segments"][at : at + n] = segment
            if self.labels is None:
                out["targets"][at : at + n] = self.tokens[start + 1 : start + n + 1]
                out["weights"][at : at + n] = 1.0
            else:
                labels = self.labels[start + 1 : start + n + 1]
                counted = labels != IGNORE
                out["targets"][at : at + n] = np.where(counted, labels, 0)
                out["weights"][at : at + n] = counted
            at += n
        return out


def pack(
    documents: Sequence[np.ndarray],
    length: int,
    labels: Sequence[np.ndarray] | None = None,
    packing: bool = True,
) -> PackedRows:
    """Cut each document into pieces of <= `length` pairs and pack them in order (next fit).

    `labels` (SFT): per document, its labels aligned with its tokens (IGNORE: not
    counted); they travel with the tokens, so every packed pair keeps its own label.
    `packing=False`: each document starts a row of its own (the rest is padding)."""
    keep = [i for i, d in enumerate(documents) if len(d) >= 2]
    docs = [np.asarray(documents[i], np.int32) for i in keep]
    offsets = np.cumsum([0] + [len(d) for d in docs])
    tokens = np.concatenate(docs) if docs else np.zeros(0, np.int32)
    flat_labels = None
    if labels is not None:
        kept = [np.asarray(labels[i], np.int32) for i in keep]
        flat_labels = np.concatenate(kept) if kept else np.zeros(0, np.int32)
    piece_start, piece_len, row_start = [], [], [0]
    used = 0
    for doc, offset in zip(docs, offsets[:-1], strict=True):
        pairs = len(doc) - 1
        for cut in range(0, pairs, length):
            n = min(length, pairs - cut)
            if used + n > length or (not packing and used and cut == 0):
                row_start.append(len(piece_start))
                used = 0
            piece_start.append(offset + cut)
            piece_len.append(n)
            used += n
    if piece_start:
        row_start.append(len(piece_start))
    return PackedRows(
        tokens,
        np.asarray(piece_start, np.int64),
        np.asarray(piece_len, np.int64),
        np.asarray(row_start, np.int64),
        length,
        flat_labels,
    )


@dataclasses.dataclass
class TextSource:
    """The packed stream: `rows(step, start, stop)` -> global rows [start, stop) of `step`.

    Built by `shuffled_source` for dataset_type=text and (hf_data.py) dataset_type=hf.
    """

    dataset: grain.MapDataset
    packed: PackedRows
    global_batch: int
    tokenizer: Tokenizer | None
    files: list[Path]
    documents: int
    kind: str = "text"  # the startup line's name for where the documents came from
    text: PackedText | None = None  # what the rows were packed from (the startup line)
    note: str = ""  # appended to the startup line (run.start: num_epochs' steps)

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        base = step * self.global_batch
        examples = [self.dataset[base + r] for r in range(start, stop)]
        return {key: np.stack([e[key] for e in examples]) for key in KEYS}

    def process_rows(
        self, step: int, process_index: int, process_count: int
    ) -> dict[str, np.ndarray]:
        """This process's contiguous share of the global batch of `step`."""
        start, stop = process_row_range(self.global_batch, process_index, process_count)
        return self.rows(step, start, stop)

    def describe(self) -> str:
        text = self.text or PackedText(self.packed, self.tokenizer, self.files, self.documents)
        line = f"data: {self.kind}, {text.describe()}{self.note}"
        if len(self.packed) < self.global_batch:
            # Said, not silent: the repeated rows weigh twice in the step's mean.
            line += (
                f"; only {len(self.packed)} rows for a global batch of {self.global_batch}: "
                "every step repeats rows"
            )
        return line


def process_row_range(global_batch: int, process_index: int, process_count: int) -> tuple[int, int]:
    """[start, stop) of the global batch rows that process `process_index` builds."""
    if global_batch % process_count:
        raise ConfigError(
            f"global batch {global_batch} does not split over {process_count} processes"
        )
    share = global_batch // process_count
    return process_index * share, (process_index + 1) * share


@dataclasses.dataclass(frozen=True)
class PackedText:
    """Files read, tokenized and packed (what a training or an eval source is built on).

    `tokenizer` is None when the files held token ids already (a parquet ids column).
    """

    packed: PackedRows
    tokenizer: Tokenizer | None
    files: list[Path]
    documents: int
    unit: str = "documents"  # what one row of the files is (SFT: conversations)
    truncated: int = 0  # documents cut to max_target_length, the rest dropped (SFT)

    def describe(self) -> str:
        tokens = int(self.packed.piece_len.sum())
        fill = tokens / max(1, len(self.packed) * self.packed.length)
        name = self.tokenizer.name if self.tokenizer else "pre-tokenized"
        counted = ""
        if self.packed.labels is not None:
            counted = f" ({self.packed.counted_targets():,} counted)"
        cut = f", {self.truncated} truncated" if self.truncated else ""
        return (
            f"{len(self.files)} files, {self.documents} {self.unit}{cut}, "
            f"{name} tokens: {tokens:,} targets{counted} in {len(self.packed):,} "
            f"packed rows of {self.packed.length} ({fill:.0%} filled)"
        )


def run_tokenizer(model: ModelConfig, data: DataConfig) -> Tokenizer:
    """The run's tokenizer (tokenizer_path's tokenizer.json, else bytes); ConfigError
    when vocab_size cannot hold its ids."""
    tokenizer = load_tokenizer(data.tokenizer_path) if data.tokenizer_path else byte_tokenizer()
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(
            f"vocab_size={model.vocab_size} is smaller than the {tokenizer.vocab_size} ids of the "
            f"{tokenizer.name} tokenizer"
            + (" (256 bytes + end-of-document)" if tokenizer.name == "bytes" else "")
            + f"; set vocab_size={tokenizer.vocab_size} or more"
        )
    return tokenizer


def tokenize(texts: Iterable[str], tokenizer: Tokenizer) -> list[np.ndarray]:
    """Each non-empty text's ids followed by end-of-document (when the tokenizer has one)."""
    eos = np.asarray([] if tokenizer.eos_id is None else [tokenizer.eos_id], np.int32)
    documents = []
    for text in texts:
        ids = np.asarray(tokenizer.encode(text), np.int32)
        if ids.size:
            documents.append(np.concatenate([ids, eos]))
    return documents


def packed_text(
    documents: Sequence[np.ndarray],
    data: DataConfig,
    tokenizer: Tokenizer | None,
    files: list[Path],
    where: str,
) -> PackedText:
    """`documents` packed into rows of `max_target_length`; ConfigError naming `where`
    (the key=value that named the files) when nothing is left to train on."""
    packed = pack(documents, data.max_target_length)
    if not len(packed):
        raise ConfigError(
            f"{where}: {len(files)} files hold no text (every document is empty or a single token)"
        )
    return PackedText(packed, tokenizer, files, len(documents))


def load_packed(
    model: ModelConfig, data: DataConfig, path: str, key: str = "dataset_path"
) -> PackedText:
    """Read, tokenize and pack the files under `path` (named by config key `key`) once,
    with the run's tokenizer and `max_target_length`; ConfigError on any bad input."""
    files = find_files(path, key)
    tokenizer = run_tokenizer(model, data)
    documents = tokenize(read_documents(files, data.jsonl_field), tokenizer)
    return packed_text(documents, data, tokenizer, files, f"{key}={path!r}")


def shuffled_source(
    text: PackedText, training: TrainingConfig, global_batch: int, kind: str = "text"
) -> TextSource:
    """The training stream over packed rows: shuffled with `seed`, repeated with a new
    order every epoch; element `step * global_batch + row` is a function of (seed, step)."""
    import grain  # here, not at import: synthetic runs (device_check.sh's host) need no grain

    dataset = (
        grain.MapDataset.source(text.packed)
        .shuffle(seed=training.seed % 2**32)
        .repeat(reseed_each_epoch=True)
    )
    return TextSource(
        dataset, text.packed, global_batch, text.tokenizer, text.files, text.documents, kind, text
    )


class PackedEvalSource:
    """Packed eval rows in order; row i of eval batch b is row b * batch + i of the set,
    rows past its end padding (weight 0), so no row is counted twice."""

    def __init__(self, text: PackedText, global_batch: int, kind: str = "text"):
        self.text, self.global_batch, self.kind = text, global_batch, kind
        self._padding = {
            key: np.zeros(text.packed.length, np.float32 if key == "weights" else np.int32)
            for key in KEYS
        }

    @property
    def num_batches(self) -> int:
        """Batches in one pass over the set (the last one padded)."""
        return math.ceil(len(self.text.packed) / self.global_batch)

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        base, packed = step * self.global_batch, self.text.packed
        examples = [
            packed[base + r] if base + r < len(packed) else self._padding
            for r in range(start, stop)
        ]
        return {key: np.stack([e[key] for e in examples]) for key in KEYS}

    def describe(self) -> str:
        return f"{self.kind}, {self.text.describe()}"


def train_source(config: Config, global_batch: int) -> TextSource:
    """The training stream over `dataset_path`; raise ConfigError on any bad input."""
    text = load_packed(config.model, config.data, config.dataset_path)
    return shuffled_source(text, config.training, global_batch)


def eval_source(config: Config, global_batch: int) -> PackedEvalSource:
    """The files under `eval_dataset_path`, packed as the training files, in order."""
    path = config.eval_dataset_path
    if not path:
        raise ConfigError(
            f"eval_interval={config.eval_interval} with dataset_type=text needs "
            "eval_dataset_path=DIR_OR_GLOB (.txt / .jsonl files held out from training)"
        )
    text = load_packed(config.model, config.data, path, key="eval_dataset_path")
    return PackedEvalSource(text, global_batch)
