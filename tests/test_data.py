"""Data: the embedded corpus, local files, deterministic non-overlapping splits, clear errors."""

import numpy as np
import pytest

from compress.data import DataError, embedded_corpus, make_splits


def _rows(a):
    return {tuple(r) for r in a.tolist()}


def test_embedded_corpus_is_english_text():
    texts = embedded_corpus()
    assert len(texts) > 50 and sum(len(t) for t in texts) > 100_000
    assert any("for" in t and "statement" in t for t in texts)


def test_splits_are_deterministic_and_disjoint(tiny_tokenizer, tiny_splits):
    s = tiny_splits
    assert s.train.shape == (64, 32) and s.calib.shape == (8, 32) and s.eval.shape == (8, 32)
    assert not (_rows(s.train) & _rows(s.eval)) and not (_rows(s.train) & _rows(s.calib)) and not (_rows(s.calib) & _rows(s.eval))
    again = make_splits(tiny_tokenizer, "embedded", 32, 64, 8, 8, seed=0)
    assert np.array_equal(again.eval, s.eval) and np.array_equal(again.train, s.train)
    other = make_splits(tiny_tokenizer, "embedded", 32, 64, 8, 8, seed=1)
    assert not np.array_equal(other.eval, s.eval)


def test_local_jsonl_and_txt(tiny_tokenizer, tmp_path):
    import json

    lines = [json.dumps({"body": f"document number {i} says hello world " * 20}) for i in range(40)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    s = make_splits(tiny_tokenizer, str(tmp_path / "d.jsonl"), 16, 10, 4, 4, text_field="body")
    assert len(s.train) == 10 and len(s.eval) == 4
    with pytest.raises(DataError, match="data.text_field 'text'.*body"):
        make_splits(tiny_tokenizer, str(tmp_path / "d.jsonl"), 16, 10, 4, 4)
    (tmp_path / "t.txt").write_text("plain text file " * 400)
    assert len(make_splits(tiny_tokenizer, str(tmp_path / "t.txt"), 16, 5, 2, 2).train) == 5


def test_missing_source_and_too_little_data(tiny_tokenizer, tmp_path):
    with pytest.raises(DataError, match="no such file"):
        make_splits(tiny_tokenizer, "./nowhere.jsonl")
    (tmp_path / "small.txt").write_text("tiny " * 30)
    with pytest.raises(DataError, match="eval_blocks"):
        make_splits(tiny_tokenizer, str(tmp_path / "small.txt"), 8, 10, 8, 8)
