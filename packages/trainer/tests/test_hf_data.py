"""Parquet data (dataset_type=hf): text and token-id columns packed, shuffled and resumed
exactly as the text pipeline does, the eval set, and every bad key (no JAX)."""

import json

import numpy as np
import pytest

from trainer.config import ConfigError, make_config, mesh_shape
from trainer.data import eval_data, hf_data, text_data
from trainer.data.input_pipeline import make_source

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

LENGTH = 16
BATCH = 4
# 14 documents: one long (cut into pieces), one tiny, one empty (no document), ...
TEXTS = ["hello world, " * 5, "tiny", ""] + [f"doc {i} " + "ab" * i for i in range(12)]


def _byte_ids(text):
    """What the byte tokenizer makes of `text`: its bytes, then end-of-document."""
    return list(text.encode()) + [text_data.EOS_BYTE] if text else []


def _write(path, **columns):
    pq.write_table(pa.table(columns), path, row_group_size=5)  # several row groups per file
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same documents as .jsonl (the text pipeline's input), as a text column split
    over two parquet files, and as a token-id column."""
    root = tmp_path_factory.mktemp("hf_corpus")
    lines = [json.dumps({"body": t}) for t in TEXTS]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    (root / "text").mkdir()
    ids = pa.array([_byte_ids(t) for t in TEXTS], pa.list_(pa.int32()))
    for part, rows in enumerate((slice(0, 6), slice(6, None))):
        _write(
            root / "text" / f"train-{part:05d}-of-00002.parquet",
            body=TEXTS[rows],
            id=list(range(len(TEXTS)))[rows],
            input_ids=ids[rows],
        )
    (root / "text" / "README.md").write_text("not read: the glob below names parquet only")
    return root


def _config(**overrides):
    return make_config(
        {
            "dataset_type": "hf",
            "vocab_size": "512",
            "max_target_length": str(LENGTH),
            **overrides,
        }
    )


def _hf(corpus, column="body", **overrides):
    return _config(
        hf_train_files=str(corpus / "text" / "*.parquet"), train_data_columns=column, **overrides
    )


def _text(corpus, **overrides):
    return _config(
        dataset_type="text",
        dataset_path=str(corpus / "docs.jsonl"),
        jsonl_field="body",
        **overrides,
    )


def _assert_same_rows(a, b, steps, batch=BATCH):
    for step in steps:
        want, got = a.rows(step, 0, batch), b.rows(step, 0, batch)
        for key in text_data.KEYS:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{key} of step {step}")


@pytest.mark.parametrize("column", ["body", "input_ids", "['body']"])
def test_columns_pack_and_shuffle_as_the_text_pipeline(corpus, column, monkeypatch):
    monkeypatch.setattr(hf_data, "ROWS_PER_READ", 4)  # batches cut across row groups and files
    text = make_source(_text(corpus), BATCH)
    hf = make_source(_hf(corpus, column), BATCH)
    assert [p.name for p in hf.files] == [f"train-0000{i}-of-00002.parquet" for i in (0, 1)]
    assert hf.documents == text.documents == 14  # the empty row is no document
    for field in ("tokens", "piece_start", "piece_len", "row_start"):
        np.testing.assert_array_equal(getattr(hf.packed, field), getattr(text.packed, field))
    # Same seed, same rows for every step, across epochs (reshuffled each).
    assert 2 * len(text.packed) < 12 * BATCH
    _assert_same_rows(text, hf, range(12))
    name, tokens = ("input_ids", "pre-tokenized") if "ids" in column else ("body", "bytes")
    assert hf.describe().startswith(f"data: hf, column {name!r}, 2 files, 14 documents, {tokens}")


def test_a_restarted_source_continues_the_stream_exactly(corpus):
    """What a resumed run does: a new process opens the files again and asks for the rows
    of step N onward; they are bitwise the rows an uninterrupted source gives."""
    config = _hf(corpus, "input_ids", seed="3")
    uninterrupted = make_source(config, BATCH)
    batches = [uninterrupted.rows(step, 0, BATCH) for step in range(9)]
    restarted = make_source(config, BATCH)
    for step in range(5, 9):
        got = restarted.rows(step, 0, BATCH)
        for key in text_data.KEYS:
            assert got[key].tobytes() == batches[step][key].tobytes()
    # A different seed is a different stream (the check above could fail).
    other = make_source(_hf(corpus, "input_ids", seed="4"), BATCH)
    assert other.rows(5, 0, BATCH)["inputs"].tobytes() != batches[5]["inputs"].tobytes()


def test_glob_file_and_directory(corpus):
    one = corpus / "text" / "train-00001-of-00002.parquet"
    assert make_source(_config(hf_train_files=str(one), train_data_columns="body"), 2).files == [
        one
    ]
    directory = make_source(
        _config(hf_train_files=str(corpus / "text"), train_data_columns="body"), 2
    )
    assert len(directory.files) == 2  # README.md is not a parquet file


def test_eval_set_reads_hf_eval_files_in_order(corpus):
    config = _hf(
        corpus,
        hf_eval_files=str(corpus / "text" / "*.parquet"),
        eval_data_columns="input_ids",
        eval_interval="5",
        per_device_batch_size="1",
    )
    eval_set = eval_data.make_eval_set(config, 2, mesh_shape(config, 2))
    text = _text(corpus)
    text_eval = text_data.PackedEvalSource(
        text_data.load_packed(text.model, text.data, str(corpus / "docs.jsonl")), 2
    )
    # The whole set once, in order, the last batch padded: as the text eval set.
    assert eval_set.steps == text_eval.num_batches == 11  # 21 packed rows, 2 per batch
    assert eval_set.note.startswith("hf, column 'input_ids', 2 files, 14 documents")
    _assert_same_rows(text_eval, eval_set.source, range(11), batch=2)


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """Parquet files with the wrong things in them."""
    root = tmp_path_factory.mktemp("hf_bad")
    _write(root / "floats.parquet", text=["a b"], score=[0.5], vecs=[[0.5]])
    _write(root / "big.parquet", ids=pa.array([[1, 2], [3, 600]], pa.list_(pa.int64())))
    _write(root / "negative.parquet", ids=pa.array([[1, -2]], pa.list_(pa.int16())))
    _write(root / "null.parquet", ids=pa.array([[1, None]], pa.list_(pa.int32())))
    _write(root / "mixed-a.parquet", text=["ab"])
    _write(root / "mixed-b.parquet", text=pa.array([[1, 2]], pa.list_(pa.int32())))
    (root / "empty").mkdir()
    (root / "broken.parquet").write_text("not parquet")
    return root


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({}, r"^dataset_type=hf needs hf_train_files=GLOB"),
        (
            {"hf_train_files": "gs://b/*.parquet"},
            r"^hf_train_files='gs://b/\*.parquet': only local",
        ),
        (
            {"hf_train_files": "BAD/*.nothing"},
            r"^hf_train_files='.*/\*\.nothing' matches no files$",
        ),
        (
            {"hf_train_files": "BAD/none.parquet"},
            r"^hf_train_files='.*/none.parquet' does not exist",
        ),
        (
            {"hf_train_files": "BAD/empty"},
            r"^directory hf_train_files='.*/empty' holds no .parquet",
        ),
        (
            {"hf_train_files": "BAD/broken.parquet"},
            r"broken.parquet is not a readable parquet file",
        ),
        (
            {"hf_train_files": "BAD/floats.parquet", "train_data_columns": "body"},
            r"floats.parquet has no column 'body' \(train_data_columns\); "
            r"its columns: text, score, vecs$",
        ),
        (
            {"hf_train_files": "BAD/floats.parquet", "train_data_columns": "score"},
            r"column 'score' \(train_data_columns\) is double, not text .* or token ids",
        ),
        (
            {"hf_train_files": "BAD/floats.parquet", "train_data_columns": "vecs"},
            r"column 'vecs' .* is list<element: double>, not text",
        ),
        (
            {"hf_train_files": "BAD/floats.parquet", "train_data_columns": "['text', 'score']"},
            r"train_data_columns=\"\['text', 'score'\]\" must name one column",
        ),
        (
            {"hf_train_files": "BAD/mixed-*.parquet"},
            r"column 'text' is text in .*mixed-a.parquet but token ids in .*mixed-b.parquet",
        ),
        (
            {"hf_train_files": "BAD/big.parquet", "train_data_columns": "ids"},
            r"big.parquet column 'ids' holds token id 600, outside \[0, vocab_size=512\)",
        ),
        (
            {"hf_train_files": "BAD/negative.parquet", "train_data_columns": "ids"},
            r"negative.parquet column 'ids' holds token id -2",
        ),
        (
            {"hf_train_files": "BAD/null.parquet", "train_data_columns": "ids"},
            r"null.parquet column 'ids' holds a null token id",
        ),
        (
            {"hf_train_files": "BAD/floats.parquet", "hf_path": "allenai/c4"},
            r"^hf_path='allenai/c4': only local parquet files are read",
        ),
        (
            {"hf_train_files": "BAD/mixed-a.parquet", "dataset_type": "text"},
            r"^hf_train_files='.*' is set but dataset_type=text; add dataset_type=hf to train on",
        ),
        (
            {"hf_train_files": "BAD/mixed-a.parquet", "eval_dataset_path": "BAD"},
            r"^eval_dataset_path='.*' is set but dataset_type=hf; add dataset_type=text",
        ),
        # The eval keys are checked with the training keys, before the training set is read.
        (
            {"hf_train_files": "BAD/mixed-a.parquet", "eval_interval": "2"},
            r"^dataset_type=hf needs hf_eval_files=GLOB .* to evaluate \(eval_interval=2\)",
        ),
        (
            {
                "hf_train_files": "BAD/mixed-a.parquet",
                "eval_interval": "2",
                "hf_eval_files": "BAD/floats.parquet",
                "eval_data_columns": "score",
            },
            r"floats.parquet column 'score' \(eval_data_columns\) is double",
        ),
    ],
)
def test_bad_input_is_one_config_error_before_any_row_is_read(bad, monkeypatch, overrides, message):
    overrides = {
        k: v.replace("BAD/", f"{bad}/").replace("B", str(bad)) for k, v in overrides.items()
    }
    if overrides.get("hf_train_files", "").endswith("mixed-a.parquet"):
        # Those cases are about other keys: reading the (good) training file is too late.
        def no_reading(*args):
            raise AssertionError("training rows read before every key was checked")

        monkeypatch.setattr(hf_data, "read_texts", no_reading)
    with pytest.raises(ConfigError, match=message) as error:
        make_source(_config(**overrides), BATCH)
    assert "\n" not in str(error.value)


def test_empty_documents_only_is_an_error(tmp_path):
    path = _write(tmp_path / "e.parquet", text=["", None, "a"])  # "a" + EOS: one target
    make_source(_config(hf_train_files=str(path)), 1)
    path = _write(tmp_path / "e.parquet", text=["", None])
    with pytest.raises(ConfigError, match=r"hf_train_files='.*e.parquet': 1 files hold no text"):
        make_source(_config(hf_train_files=str(path)), 1)
