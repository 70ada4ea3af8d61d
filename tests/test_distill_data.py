"""distill.data: the teacher's own generations as distillation data (compress/distill/data.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compress.config import DistillConfig
from compress.corpus.splits import DataSplits
from compress.distill.data import distill_blocks, teacher_generations, training_splits


@pytest.fixture(scope="module")
def generated(trained_tiny4, tiny_splits, tiny_tokenizer, one_torch_thread):
    return teacher_generations(trained_tiny4, 16, tiny_splits.train.shape[1], seed=3, bos_id=tiny_splits.bos_token_id,
                               exclude_ids=tiny_tokenizer.all_special_ids, batch_size=8, progress=False)


def _nll(model, blocks: np.ndarray) -> float:
    with torch.no_grad():
        x = torch.as_tensor(blocks)
        return float(model(input_ids=x, labels=x).loss)


def test_blocks_are_seeded_shaped_and_free_of_specials(trained_tiny4, tiny_splits, tiny_tokenizer, generated):
    block = tiny_splits.train.shape[1]
    assert generated.shape == (16, block) and generated.dtype == np.int64
    again = teacher_generations(trained_tiny4, 16, block, seed=3, bos_id=tiny_splits.bos_token_id,
                                exclude_ids=tiny_tokenizer.all_special_ids, batch_size=8, progress=False)
    assert np.array_equal(again, generated)
    other = teacher_generations(trained_tiny4, 16, block, seed=4, bos_id=tiny_splits.bos_token_id,
                                exclude_ids=tiny_tokenizer.all_special_ids, batch_size=8, progress=False)
    assert not np.array_equal(other, generated)
    body = generated[:, 0 if tiny_splits.bos_token_id is None else 1:]
    if tiny_splits.bos_token_id is not None:
        assert (generated[:, 0] == tiny_splits.bos_token_id).all()
    eos = trained_tiny4.generation_config.eos_token_id
    assert not np.isin(body, np.atleast_1d(eos)).any()  # EOS suppressed: full blocks like the corpus's
    assert not np.isin(body[:, 0], tiny_tokenizer.all_special_ids).any()
    assert len(np.unique(body[:, 0])) > 8  # first tokens drawn across the vocabulary


def test_samples_follow_the_teacher(trained_tiny4, tiny_splits, generated):
    """The teacher finds its own samples far likelier than tokens drawn uniformly (sampling at T = 1)."""
    rng = np.random.default_rng(0)
    uniform = generated.copy()
    start = 0 if tiny_splits.bos_token_id is None else 1
    vocab = trained_tiny4.config.vocab_size
    uniform[:, start + 1:] = rng.integers(3, vocab, size=uniform[:, start + 1:].shape)
    own, rand = _nll(trained_tiny4, generated), _nll(trained_tiny4, uniform)
    print(f"teacher NLL: own samples {own:.3f}, uniform tokens {rand:.3f}, log(vocab) {np.log(vocab):.3f}")
    assert own < rand - 0.5


def test_training_splits_modes_and_cache(trained_tiny4, tiny_splits, tiny_tokenizer, tmp_path, one_torch_thread):
    cfg = DistillConfig(enabled=True, data="mix", generated_blocks=8)
    cache = tmp_path / "train_mix.npz"
    mixed = training_splits(tiny_splits, trained_tiny4, tiny_tokenizer, cfg, cache, progress=False)
    assert len(mixed.train) == len(tiny_splits.train) + 8
    assert np.array_equal(mixed.train[:len(tiny_splits.train)], tiny_splits.train)
    assert np.array_equal(mixed.calib, tiny_splits.calib)
    # the selection split: the corpus's blocks, then as many of the teacher's samples, none of them trained on
    n = len(tiny_splits.selection)
    assert len(mixed.selection) == 2 * n and np.array_equal(mixed.selection[:n], tiny_splits.selection)
    trained_on = {tuple(b) for b in mixed.train}
    assert not any(tuple(b) in trained_on for b in mixed.selection[n:])
    # a re-run reads the cache: no teacher needed, the same blocks
    again = training_splits(tiny_splits, None, None, cfg, cache, progress=False)
    assert np.array_equal(again.train, mixed.train)
    assert training_splits(tiny_splits, None, None, DistillConfig(), cache) is tiny_splits  # corpus: as given
    gen_only = distill_blocks(tiny_splits.train, mixed.train[len(tiny_splits.train):], "generated")
    assert len(gen_only) == 8
    with pytest.raises(ValueError, match="generated_blocks"):
        distill_blocks(tiny_splits.train, None, "mix")


def test_chat_data_is_the_teachers_own_conversations_in_its_template(trained_tiny4, tiny_splits, tiny_tokenizer,
                                                                    tmp_path, one_torch_thread):
    from compress.distill.data import chat_opening, template_special_ids

    tok = tiny_tokenizer
    opening = chat_opening(tok, tiny_splits.bos_token_id)
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
    assert tok.decode(opening) == text[:text.index("x")]  # "<|im_start|>user\n": the opening of a user turn
    unused = template_special_ids(tok)
    used = [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    assert unused and not set(unused) & set(used)
    cfg = DistillConfig(enabled=True, data="chat", generated_blocks=8)
    out = training_splits(tiny_splits, trained_tiny4, tok, cfg, tmp_path / "train_chat.npz", progress=False)
    block = tiny_splits.train.shape[1]
    assert out.train.shape == (8, block)  # only the teacher's conversations
    assert len(out.selection) == 2 * len(tiny_splits.selection)  # as many held-out conversations join the selection split
    assert (out.train[:, :len(opening)] == opening).all() and (out.selection[-1, :len(opening)] == opening).all()
    body = out.train[:, len(opening):]
    assert not np.isin(body, unused).any()  # never a special token the template does not write
    assert len({tuple(r) for r in body}) == 8  # sampled, not one conversation repeated
    assert np.array_equal(DataSplits.load(tmp_path / "train_chat.npz").train, out.train)  # cached for a resume


def test_chat_mix_is_the_corpus_and_the_teachers_conversations_and_never_reads_the_gate_prompts(
        trained_tiny4, tiny_splits, tiny_tokenizer, tmp_path, one_torch_thread, monkeypatch):
    from compress.evaluate import chat as chat_eval

    def refuse(*a, **k):
        raise AssertionError("the distillation data read the gate's chat set")

    monkeypatch.setattr(chat_eval, "load_conversations", refuse)
    monkeypatch.setattr(chat_eval, "load_sets", refuse)
    cfg = DistillConfig(enabled=True, data="chat_mix", generated_blocks=8)
    out = training_splits(tiny_splits, trained_tiny4, tiny_tokenizer, cfg, tmp_path / "train_chat_mix.npz",
                          progress=False)
    n = len(tiny_splits.train)
    assert out.train.shape == (n + 8, tiny_splits.train.shape[1])
    assert np.array_equal(out.train[:n], tiny_splits.train)  # the corpus's train blocks, then the conversations
    # no 6-token run of any gate prompt appears in what the student trains on
    monkeypatch.undo()
    gate = [tiny_tokenizer(m["content"], add_special_tokens=False)["input_ids"]
            for conv in chat_eval.load_sets(["builtin"]) for m in conv["messages"] if m["role"] == "user"]
    grams = {tuple(ids[i:i + 6]) for ids in gate for i in range(len(ids) - 5)}
    seen = {tuple(r[i:i + 6]) for r in out.train[n:] for i in range(len(r) - 5)}
    assert grams and not grams & seen
