"""Parquet data (`dataset_type=hf`): local parquet files -> documents -> the text pipeline.

MaxText's keys: `hf_train_files` / `hf_eval_files` name the files (a glob, one
file, or a directory searched recursively for `*.parquet`), `train_data_columns`
/ `eval_data_columns` the one column read from every file (eval: the train
column unless set). Each row of that column is one document:

- a text column (string) is tokenized with the run's tokenizer exactly as
  `dataset_type=text` tokenizes a document: its ids, then end-of-document;
- a token-id column (a list of integers, e.g. a tokenized dataset's
  `input_ids`) is taken as it is: it carries its own end-of-document ids, and
  every id must be < vocab_size.

From there nothing is new: the documents are packed by `text_data.pack`,
shuffled and repeated by `text_data.shuffled_source` (the training stream) or
read in order by the eval source, so rows are a function of (seed, step) and a
resumed run continues the exact stream from its checkpoint's step.

pyarrow reads the files (grain's parquet dataset is an iterator; the packed
rows here are random access, which is what resuming by step and building only
a process's own rows rely on). Every file's schema is checked (the column
exists, its type is text or token ids) before any row is read, and the eval
files are checked with the training files, so a bad key stops the run before
the training set is tokenized.

The hf format (input_pipeline.FORMATS): `train_source` and `eval_source`.
"""

from __future__ import annotations

import dataclasses
import glob
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from trainer.config import (
    Config,
    ConfigError,
    DataConfig,
    EvaluationConfig,
    ModelConfig,
)
from trainer.data import eval_schedule, text_data

READS = ("tokenizer_path", "hf_path", "hf_train_files", "hf_eval_files")  # data keys read here
# MaxText's hf_path names a `datasets` loader or a Hub dataset; only local parquet is read here.
LOADERS = ("", "parquet")
SUFFIX = ".parquet"
ROWS_PER_READ = 4096  # rows tokenized per parquet batch (bounds the strings held at once)


@dataclasses.dataclass(frozen=True)
class ParquetColumn:
    """One column of a set of parquet files, its type checked in every file."""

    files: list[Path]
    column: str
    token_ids: bool  # a list-of-integers column (pre-tokenized), else text
    where: str  # the key=value that named the files, for messages


def check_loader(data: DataConfig) -> None:
    """hf_path (MaxText: a `datasets` loader or Hub dataset) must be empty or "parquet"."""
    if data.hf_path not in LOADERS:
        raise ConfigError(
            f"hf_path={data.hf_path!r}: only local parquet files are read (hf_path=parquet or "
            "unset); download the dataset's parquet files and set hf_train_files=GLOB"
        )


def find_parquet_files(pattern: str, key: str, suffixes: tuple[str, ...] = (SUFFIX,)) -> list[Path]:
    """The files `pattern` names: a glob, one file, or a directory (its files ending in
    one of `suffixes`, recursively)."""
    if "://" in pattern:  # MaxText reads gs:// through `datasets`; only local paths here
        raise ConfigError(
            f"{key}={pattern!r}: only local files are read; copy the files here "
            "(or mount the bucket, e.g. with gcsfuse) and name the local path"
        )
    path = Path(pattern)
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.suffix in suffixes and p.is_file())
        if not found:
            raise ConfigError(f"directory {key}={pattern!r} holds no {' or '.join(suffixes)} files")
        return found
    if glob.has_magic(pattern):
        found = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
        if not found:
            raise ConfigError(f"{key}={pattern!r} matches no files")
        return found
    if not path.is_file():
        raise ConfigError(f"{key}={pattern!r} does not exist")
    return [path]


def column_name(raw: str, key: str) -> str:
    """The one column named by `raw`: `text`, or MaxText's list form `['text']`."""
    names = [n.strip().strip("'\"").strip() for n in raw.strip().strip("[]").split(",")]
    names = [n for n in names if n]
    if len(names) != 1:
        raise ConfigError(f"{key}={raw!r} must name one column (the documents' text or token ids)")
    return names[0]


def _is_token_ids(path: Path, schema, column: str, key: str) -> bool:
    """True for a list-of-integers column, False for text; ConfigError for anything else."""
    import pyarrow as pa

    if column not in schema.names:
        raise ConfigError(
            f"{path} has no column {column!r} ({key}); its columns: {', '.join(schema.names)}"
        )
    kind = schema.field(column).type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return False
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    if any(is_list(kind) for is_list in lists) and pa.types.is_integer(kind.value_type):
        return True
    raise ConfigError(
        f"{path} column {column!r} ({key}) is {kind}, not text (string) or token ids "
        "(list of integers)"
    )


def open_parquet(path: Path, key: str):
    """The pyarrow ParquetFile of `path` (its footer read, no rows); ConfigError naming
    `key` when it is not parquet."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ...
        raise ConfigError(f"{key}: {path} is not a readable parquet file: {error}") from None


def open_column(
    data: DataConfig, evaluation: EvaluationConfig, files_key: str, columns_key: str
) -> ParquetColumn:
    """Find the files and check the column in every file's schema (no rows read)."""
    pattern = getattr(data, files_key)
    if not pattern:
        evaluating = files_key == "hf_eval_files"
        purpose = f" to evaluate (eval_interval={evaluation.eval_interval})" if evaluating else ""
        raise ConfigError(f"dataset_type=hf needs {files_key}=GLOB (local parquet files){purpose}")
    files = find_parquet_files(pattern, files_key)
    column = column_name(getattr(data, columns_key), columns_key)
    kinds = {
        path: _is_token_ids(path, open_parquet(path, files_key).schema_arrow, column, columns_key)
        for path in files
    }
    if len(set(kinds.values())) > 1:
        text = next(p for p, ids in kinds.items() if not ids)
        ids = next(p for p, ids in kinds.items() if ids)
        raise ConfigError(
            f"{files_key}={pattern!r}: column {column!r} is text in {text} but token ids in {ids}"
        )
    return ParquetColumn(files, column, kinds[files[0]], f"{files_key}={pattern!r}")


def _batches(source: ParquetColumn, path: Path) -> Iterator:
    """The column of `path`, ROWS_PER_READ rows at a time (pyarrow arrays)."""
    for batch in open_parquet(path, source.where).iter_batches(
        batch_size=ROWS_PER_READ, columns=[source.column]
    ):
        yield batch.column(0)


def read_texts(source: ParquetColumn) -> Iterator[str]:
    """The text column's rows in file order (a null row is an empty document)."""
    for path in source.files:
        for array in _batches(source, path):
            yield from (text or "" for text in array.to_pylist())


def read_token_ids(source: ParquetColumn, vocab_size: int) -> list[np.ndarray]:
    """The token-id column's non-empty rows in file order; ConfigError naming the file
    for a null id or an id outside [0, vocab_size)."""
    import pyarrow.compute as pc

    documents = []
    for path in source.files:
        for array in _batches(source, path):
            flat = array.flatten()  # the ids of every non-null row, in order
            if flat.null_count:
                raise ConfigError(f"{path} column {source.column!r} holds a null token id")
            ids = flat.to_numpy(zero_copy_only=False).astype(np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                bad = ids.min() if ids.min() < 0 else ids.max()
                raise ConfigError(
                    f"{path} column {source.column!r} holds token id {bad}, outside "
                    f"[0, vocab_size={vocab_size})"
                )
            lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy()
            pieces = np.split(ids.astype(np.int32), np.cumsum(lengths)[:-1])
            documents += [piece for piece in pieces if piece.size]
    return documents


def eval_columns_key(data: DataConfig) -> str:
    """The key naming the eval column: eval_data_columns, or train_data_columns when unset."""
    return "eval_data_columns" if data.eval_data_columns else "train_data_columns"


def load_packed(
    model: ModelConfig, data: DataConfig, source: ParquetColumn
) -> text_data.PackedText:
    """Read `source`'s rows, tokenize text with the run's tokenizer, pack into rows of
    `max_target_length` as dataset_type=text does."""
    if source.token_ids:
        documents, tokenizer = read_token_ids(source, model.vocab_size), None
    else:
        tokenizer = text_data.run_tokenizer(model, data)
        documents = text_data.tokenize(read_texts(source), tokenizer)
    return text_data.packed_text(documents, data, tokenizer, source.files, source.where)


def describe_kind(source: ParquetColumn) -> str:
    """The startup line's name for the data: `hf, column 'text'`."""
    return f"hf, column {source.column!r}"


def train_source(config: Config, global_batch: int) -> text_data.TextSource:
    """The training stream over hf_train_files; the eval files' keys are checked first
    too (when evaluating), so every bad key stops the run before anything is read."""
    data, evaluation = config.data, config.evaluation
    check_loader(data)
    train = open_column(data, evaluation, "hf_train_files", "train_data_columns")
    if eval_schedule.enabled(evaluation):
        open_column(data, evaluation, "hf_eval_files", eval_columns_key(data))
    text = load_packed(config.model, data, train)
    return text_data.shuffled_source(text, config.training, global_batch, describe_kind(train))


def eval_source(config: Config, global_batch: int) -> text_data.PackedEvalSource:
    """hf_eval_files' column (eval_data_columns, else train_data_columns), packed as the
    training files, in order."""
    data = config.data
    column = open_column(data, config.evaluation, "hf_eval_files", eval_columns_key(data))
    text = load_packed(config.model, data, column)
    return text_data.PackedEvalSource(text, global_batch, describe_kind(column))
