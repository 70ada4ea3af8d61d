"""Data: the embedded corpus, local files, deterministic non-overlapping splits (test held out), clear errors."""

import numpy as np
import pytest

from compress.corpus.splits import DataError, DataSplits, embedded_corpus, load_heldout, make_splits


def _rows(a):
    return {tuple(r) for r in a.tolist()}


def test_embedded_corpus_is_english_text():
    texts = embedded_corpus()
    assert len(texts) > 50 and sum(len(t) for t in texts) > 100_000
    assert any("for" in t and "statement" in t for t in texts)


def test_splits_are_deterministic_and_disjoint(tiny_tokenizer, tiny_splits):
    s = tiny_splits
    assert s.train.shape == (64, 32) and s.calib.shape == (8, 32) and s.selection.shape == (8, 32)
    assert s.test.shape == (8, 32) and s.heldout.shape == (8, 32) and s.heldout_source == "stdlib_code"
    parts = {"train": s.train, "calib": s.calib, "selection": s.selection, "test": s.test}
    for a in parts:
        assert len(_rows(parts[a])) == len(parts[a]), a  # no block twice, not even a block the text repeats
        for b in parts:
            if a < b:
                assert not (_rows(parts[a]) & _rows(parts[b])), (a, b)
    # The held-out source is another text: none of its blocks is a block of the corpus.
    corpus = make_splits(tiny_tokenizer, "embedded", 32, 10**6, 8, 8, test_blocks=8, seed=0, heldout_source="none")
    every = _rows(corpus.train) | _rows(corpus.calib) | _rows(corpus.selection) | _rows(corpus.test)
    assert not (_rows(s.heldout) & every) and corpus.heldout is None
    assert len(every) * 32 == corpus.total_tokens  # every (distinct) block of the corpus went to one split
    again = make_splits(tiny_tokenizer, "embedded", 32, 64, 8, 8, test_blocks=8, seed=0, heldout_blocks=8)
    for name in ("train", "calib", "selection", "test", "heldout"):
        assert np.array_equal(getattr(again, name), getattr(s, name)), name
    other = make_splits(tiny_tokenizer, "embedded", 32, 64, 8, 8, test_blocks=8, seed=1, heldout_blocks=8)
    assert not np.array_equal(other.selection, s.selection) and not np.array_equal(other.test, s.test)


def test_raising_one_split_moves_no_block_between_the_others(tiny_tokenizer, tiny_splits):
    """The splits used to be consecutive slices of one permutation: more eval blocks took calib's."""
    s = tiny_splits

    def cut(**kw):
        n = {"calib_blocks": 8, "selection_blocks": 8, "test_blocks": 8, **kw}
        return make_splits(tiny_tokenizer, "embedded", 32, 64, seed=0, heldout_source="none", **n)

    more_eval = cut(selection_blocks=40)
    assert np.array_equal(more_eval.calib, s.calib) and np.array_equal(more_eval.test, s.test)
    assert np.array_equal(more_eval.selection[:8], s.selection)  # the old eval blocks stay, new ones come from train
    assert not (_rows(more_eval.selection) & _rows(more_eval.train))
    more_test = cut(test_blocks=40)
    assert np.array_equal(more_test.calib, s.calib) and np.array_equal(more_test.selection, s.selection)
    more_calib = cut(calib_blocks=40)
    assert np.array_equal(more_calib.selection, s.selection) and np.array_equal(more_calib.test, s.test)


def test_test_split_and_heldout_source_are_saved_apart(tiny_splits, tmp_path):
    tiny_splits.save(tmp_path / "splits.npz")
    tiny_splits.save_heldout(tmp_path / "heldout.npz")
    with np.load(tmp_path / "splits.npz") as z:
        assert set(z.files) == {"train", "calib", "selection", "source", "total_tokens", "bos_token_id"}
    back = DataSplits.load(tmp_path / "splits.npz")
    assert back.test is None and back.heldout is None and np.array_equal(back.selection, tiny_splits.selection)
    held = load_heldout(tmp_path / "heldout.npz")
    assert np.array_equal(held.test, tiny_splits.test) and np.array_equal(held.heldout, tiny_splits.heldout)
    assert held.heldout_source == "stdlib_code"
    with pytest.raises(DataError, match="no test split"):
        back.save_heldout(tmp_path / "again.npz")


def test_heldout_source_is_another_genre_and_can_be_switched_off(tiny_tokenizer, tmp_path):
    from compress.corpus.splits import STDLIB_CODE_MODULES, load_texts

    code = load_texts("stdlib_code")
    assert len(code) == len(STDLIB_CODE_MODULES) and all("def " in t for t in code)
    (tmp_path / "dialog.txt").write_text("A: how are you?\nB: fine, thanks. and you?\n" * 40)
    s = make_splits(tiny_tokenizer, "embedded", 16, 8, 2, 2, test_blocks=2, heldout_source=str(tmp_path / "dialog.txt"),
                    heldout_blocks=4)
    assert s.heldout.shape == (4, 16) and s.heldout_source.endswith("dialog.txt")
    with pytest.raises(DataError, match=r"data\.heldout_blocks 10000.*data\.heldout_source"):
        make_splits(tiny_tokenizer, "embedded", 16, 8, 2, 2, test_blocks=2, heldout_source=str(tmp_path / "dialog.txt"),
                    heldout_blocks=10_000)


def test_local_jsonl_and_txt(tiny_tokenizer, tmp_path):
    import json

    lines = [json.dumps({"body": " ".join(f"document {i} line {j} says hello world" for j in range(20))}) for i in range(40)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    s = make_splits(tiny_tokenizer, str(tmp_path / "d.jsonl"), 16, 10, 4, 4, text_field="body")
    assert len(s.train) == 10 and len(s.selection) == 4 and len(s.test) == 32
    with pytest.raises(DataError, match="data.text_field 'text'.*body"):
        make_splits(tiny_tokenizer, str(tmp_path / "d.jsonl"), 16, 10, 4, 4)
    (tmp_path / "t.txt").write_text(" ".join(f"plain text file {i}" for i in range(400)))
    assert len(make_splits(tiny_tokenizer, str(tmp_path / "t.txt"), 16, 5, 2, 2).train) == 5


def test_missing_source_and_too_little_data(tiny_tokenizer, tmp_path):
    with pytest.raises(DataError, match="no such file"):
        make_splits(tiny_tokenizer, "./nowhere.jsonl")
    (tmp_path / "small.txt").write_text(" ".join(f"tiny {i}" for i in range(20)))
    with pytest.raises(DataError, match=r"data\.selection_blocks 8: .* at most every 4th .*lower data\.selection_blocks"):
        make_splits(tiny_tokenizer, str(tmp_path / "small.txt"), 8, 10, 1, 8, test_blocks=1, heldout_source="none")
    with pytest.raises(DataError, match=r"data\.test_blocks 32"):
        make_splits(tiny_tokenizer, str(tmp_path / "small.txt"), 8, 10, 1, 1, heldout_source="none")
