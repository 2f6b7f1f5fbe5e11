"""Text data: files -> tokens -> packed rows with segments, positions and a loss mask (no JAX)."""

import json

import numpy as np
import pytest

from trainer.config import ConfigError, make_config
from trainer.data import text_data
from trainer.data.input_pipeline import make_source

LENGTH = 16


def _config(path, **overrides):
    values = {
        "dataset_type": "text",
        "dataset_path": str(path),
        "vocab_size": "512",
        "max_target_length": str(LENGTH),
        **overrides,
    }
    return make_config(values)


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, " * 5)  # 65 bytes: five pieces
    (tmp_path / "b.txt").write_text("tiny")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "notes.md").write_text("not read: wrong suffix")
    sub = tmp_path / "sub"
    sub.mkdir()
    lines = [json.dumps({"body": f"doc {i} " + "ab" * i, "id": i}) for i in range(12)]
    (sub / "c.jsonl").write_text("\n".join(lines) + "\n\n")
    return tmp_path


def _documents(corpus):
    docs = [(corpus / "a.txt").read_text(), "tiny"]
    docs += [f"doc {i} " + "ab" * i for i in range(12)]
    return [list(d.encode()) + [text_data.EOS_BYTE] for d in docs]


def test_rows_are_packed_documents_with_segments_positions_and_mask(corpus):
    source = make_source(_config(corpus, jsonl_field="body"), global_batch=4)
    assert [p.name for p in source.files] == ["a.txt", "b.txt", "empty.txt", "c.jsonl"]
    assert source.documents == 14  # the empty file is no document
    pieces = []
    for row in range(len(source.packed)):
        r = source.packed[row]
        seg, pos, w = r["segments"], r["positions"], r["weights"]
        assert seg[0] == 1 and np.all(np.diff(seg[seg > 0]) >= 0)
        assert np.array_equal(w, (seg > 0).astype(np.float32))  # padding carries no loss
        assert np.all(r["inputs"][seg == 0] == 0) and np.all(pos[seg == 0] == 0)
        for s in range(1, seg.max() + 1):
            at = seg == s
            assert np.array_equal(pos[at], np.arange(at.sum()))  # restarts per document
            # Within a piece the target is the next input: no cross-document target.
            assert np.array_equal(r["targets"][at][:-1], r["inputs"][at][1:])
            pieces.append(list(r["inputs"][at]) + [int(r["targets"][at][-1])])
    # Joining the pieces (each overlaps the next by one token) gives back every document.
    docs, current = [], []
    for piece in pieces:
        current = current + piece[1:] if current and current[-1] != text_data.EOS_BYTE else piece
        if current[-1] == text_data.EOS_BYTE:
            docs.append(current)
            current = []
    assert docs == _documents(corpus)


def test_long_documents_are_cut_and_rows_fill_in_order(corpus):
    packed = make_source(_config(corpus, jsonl_field="body"), global_batch=4).packed
    # a.txt: 65 bytes + EOS = 65 pairs -> pieces of 16, 16, 16, 16, 1.
    assert list(packed.piece_len[:5]) == [16, 16, 16, 16, 1]
    used = [int(packed[r]["weights"].sum()) for r in range(len(packed))]
    assert used[:4] == [16] * 4
    assert sum(used) == sum(len(d) - 1 for d in _documents(corpus))


def test_stream_is_deterministic_in_seed_and_step(corpus):
    config = _config(corpus, jsonl_field="body")
    a, b = make_source(config, 4), make_source(config, 4)
    for step in (0, 1, 7):
        for key in text_data.KEYS:
            np.testing.assert_array_equal(a.rows(step, 0, 4)[key], b.rows(step, 0, 4)[key])
    assert not np.array_equal(a.rows(0, 0, 4)["inputs"], a.rows(1, 0, 4)["inputs"])
    other = make_source(_config(corpus, jsonl_field="body", seed="1"), 4)
    assert not np.array_equal(a.rows(0, 0, 4)["inputs"], other.rows(0, 0, 4)["inputs"])


def test_epochs_cover_every_row_once_and_reshuffle(corpus):
    source = make_source(_config(corpus, jsonl_field="body"), global_batch=1)
    rows = len(source.packed)
    order = [source.dataset[i]["inputs"].tobytes() for i in range(2 * rows)]
    everything = sorted(source.packed[r]["inputs"].tobytes() for r in range(rows))
    assert sorted(order[:rows]) == everything and sorted(order[rows:]) == everything
    assert order[:rows] != order[rows:]


def test_each_process_builds_its_share_of_the_global_batch(corpus):
    source = make_source(_config(corpus, jsonl_field="body"), global_batch=8)
    whole = source.rows(3, 0, 8)
    shares = [source.process_rows(3, p, 4) for p in range(4)]
    for key in text_data.KEYS:
        assert all(s[key].shape == (2, LENGTH) for s in shares)
        np.testing.assert_array_equal(np.concatenate([s[key] for s in shares]), whole[key])
    with pytest.raises(ConfigError, match="global batch 8 does not split over 3 processes"):
        source.process_rows(0, 0, 3)


def test_glob_and_single_file(corpus):
    source = make_source(_config(corpus / "*.txt"), global_batch=2)
    assert [p.name for p in source.files] == ["a.txt", "b.txt", "empty.txt"]
    jsonl = make_source(_config(corpus / "sub" / "c.jsonl", jsonl_field="body"), global_batch=2)
    assert jsonl.documents == 12


def test_tokenizer_json(corpus, tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world,": 3, "tiny": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    config = _config(corpus / "*.txt", tokenizer_path=str(path), vocab_size="5")
    source = make_source(config, global_batch=2)
    assert source.tokenizer.eos_id == 1 and source.tokenizer.vocab_size == 5
    first = source.packed[0]
    assert list(first["inputs"][:3]) == [2, 3, 2]
    # "tiny" + </s>: one pair.
    assert [int(source.packed.piece_len[-1])] == [1]
    with pytest.raises(ConfigError, match=r"vocab_size=4 is smaller than the 5 ids"):
        make_source(_config(corpus / "*.txt", tokenizer_path=str(path), vocab_size="4"), 2)


@pytest.mark.parametrize(
    "setup, overrides, message",
    [
        (lambda d: None, {}, r"dataset_path='.*/nothere' does not exist"),
        (lambda d: d.mkdir(), {}, r"directory dataset_path=.* holds no \.txt or \.jsonl files"),
        (lambda d: (d.mkdir(), (d / "x.md").write_text("a")), {}, "holds no .txt or .jsonl"),
        (lambda d: (d.mkdir(), (d / "e.txt").write_text("")), {}, "hold no text"),
        (lambda d: (d.mkdir(), (d / "x.txt").write_bytes(b"\xff\xfe\x00")), {}, "cannot read"),
        (lambda d: (d.mkdir(), (d / "x.jsonl").write_text("{oops\n")), {}, r"x.jsonl:1 is not"),
        (
            lambda d: (d.mkdir(), (d / "x.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')),
            {},
            r"x.jsonl:2 has no field 'text' \(jsonl_field='text'\); it has \['body'\]",
        ),
        (lambda d: (d.mkdir(), (d / "x.txt").write_text("ab")), {"vocab_size": "256"}, "257"),
        (lambda d: (d.mkdir(), (d / "x.txt").write_text("ab")), {"tokenizer_path": "/no"}, "/no"),
    ],
    ids=[
        "missing",
        "empty-dir",
        "wrong-suffix",
        "empty-file",
        "not-utf8",
        "bad-json",
        "missing-field",
        "vocab-too-small",
        "missing-tokenizer",
    ],
)
def test_bad_inputs_raise_one_clear_config_error(tmp_path, setup, overrides, message):
    path = tmp_path / "nothere"
    setup(path)
    with pytest.raises(ConfigError, match=message):
        make_source(_config(path, **overrides), global_batch=2)


def test_text_keys_without_text_dataset_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="dataset_path='.*' is set but dataset_type=synthetic"):
        make_source(make_config({"dataset_path": str(tmp_path)}), global_batch=2)
    with pytest.raises(ConfigError, match="dataset_type=text needs dataset_path"):
        make_source(make_config({"dataset_type": "text"}), global_batch=2)


def test_put_rows_places_the_global_batch_on_the_mesh(corpus):
    import jax

    from trainer.data.input_pipeline import put_rows
    from trainer.sharding import ShardCtx, logical_rules, make_mesh

    config = _config(corpus, jsonl_field="body")
    source = make_source(config, global_batch=8)
    mesh = make_mesh(
        {"data": 4, "fsdp": 1, "tensor": 2, "tensor_transpose": 1, "context": 1, "expert": 1},
        "explicit",
        jax.devices()[:8],
    )
    ctx = ShardCtx(mesh, logical_rules(config.parallelism), "explicit")
    placed = put_rows(source, 5, ctx, LENGTH)
    want = source.rows(5, 0, 8)
    for key in text_data.KEYS:
        assert "data" in str(placed[key].sharding.spec)
        np.testing.assert_array_equal(np.asarray(placed[key]), want[key])
