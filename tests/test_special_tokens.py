"""Special tokens as the model expects them (issue 17): BOS where the tokenizer adds it, the same scored
positions for every model, and generation that stops on any of several EOS ids.

The BOS model is the seed-0 tiny Llama with a tokenizer that adds BOS (``add_bos_token=True``, which is
what a GGUF's ``tokenizer.ggml.add_bos_token`` becomes in transformers); the default tiny takes none.
Its BOS is ``<|im_start|>`` (id 1), not the pad id 0: a freshly initialised HF model keeps the pad row of
the embedding at zero, so logits after a pad-id BOS are all equal and top-1 is a coin toss.
"""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest

from compress.config import GoldenConfig
from compress.corpus.splits import DataSplits, embedded_corpus, make_splits
from compress.loading.special_tokens import SpecialTokens, eos_ids_of, from_manifest, special_tokens

PROMPTS = GoldenConfig().prompts
BLOCK, TRAIN, CALIB, EVAL, TEST = 32, 64, 8, 8, 8


def _bos_tokenizer(tok):
    t = copy.deepcopy(tok)
    t.bos_token = "<|im_start|>"
    t.add_bos_token = True  # rewrites the post-processor: tokenizer("x") now starts with BOS
    return t


@pytest.fixture(scope="module")
def bos_tok(tiny_tokenizer):
    return _bos_tokenizer(tiny_tokenizer)


@pytest.fixture(scope="module")
def stream(tiny_tokenizer):
    """The embedded corpus as one token stream, documents separated by EOS: computed here, not by compress.corpus.splits."""
    ids: list[int] = []
    for text in embedded_corpus():
        ids += tiny_tokenizer.encode(text, add_special_tokens=False) + [tiny_tokenizer.eos_token_id]
    return np.asarray(ids, np.int64)


def _expected_splits(blocks: np.ndarray, seed: int = 0) -> dict[str, np.ndarray]:
    """DATA_FORMAT 3: repeated blocks kept once (first occurrence), then a seeded permutation dealt into four
    lanes: test / selection / calib take the head of lanes 0 / 1 / 2, train the head of what is left."""
    blocks = blocks[np.sort(np.unique(blocks, axis=0, return_index=True)[1])]
    order = np.random.default_rng(seed).permutation(len(blocks))
    test, ev, calib = order[0::4][:TEST], order[1::4][:EVAL], order[2::4][:CALIB]
    used = set(test) | set(ev) | set(calib)
    train = np.array([i for i in order if i not in used][:TRAIN])
    return {"test": blocks[test], "selection": blocks[ev], "calib": blocks[calib], "train": blocks[train]}


def test_the_rule_per_tokenizer(tiny_tokenizer, bos_tok, tmp_path):
    from transformers import AutoTokenizer

    assert special_tokens(tiny_tokenizer) == SpecialTokens(None, [2], False)  # has a BOS token, does not add it
    assert special_tokens(bos_tok).bos_id == 1 and bos_tok("x")["input_ids"][0] == 1
    # Saved and reloaded, the add_bos_token attribute is gone (transformers does not save it) but the
    # post-processor in tokenizer.json still adds BOS: the rule reads what encoding does, not the flag.
    bos_tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert special_tokens(again).bos_id == 1
    assert special_tokens(again).encode(again, "hello") == again("hello")["input_ids"]
    no_bos = copy.deepcopy(bos_tok)
    no_bos.bos_token = None
    assert special_tokens(no_bos).bos_id is None


def test_default_tiny_blocks_are_unchanged(tiny_splits, stream):
    """No BOS: blocks of 32 consecutive stream tokens (as before BOS support), dealt into the four splits."""
    n = len(stream) // BLOCK
    want = _expected_splits(stream[: n * BLOCK].reshape(n, BLOCK))
    for name, arr in want.items():
        assert np.array_equal(getattr(tiny_splits, name), arr), name
    assert tiny_splits.bos_token_id is None


def test_bos_model_blocks_start_with_bos(bos_tok, stream, tmp_path):
    s = make_splits(bos_tok, "embedded", BLOCK, TRAIN, CALIB, EVAL, TEST, seed=0, heldout_source="none")
    assert s.bos_token_id == 1
    for part in (s.train, s.calib, s.selection, s.test):
        assert part.shape[1] == BLOCK and (part[:, 0] == 1).all()
    step = BLOCK - 1  # BOS + 31 stream tokens
    n = len(stream) // step
    body = stream[: n * step].reshape(n, step)
    want = _expected_splits(np.concatenate([np.ones((n, 1), np.int64), body], axis=1))
    for name, arr in want.items():
        assert np.array_equal(getattr(s, name), arr), name
    s.save(tmp_path / "s.npz")
    assert DataSplits.load(tmp_path / "s.npz").bos_token_id == 1
    # The held-out source follows the same rule.
    held = make_splits(bos_tok, "embedded", BLOCK, TRAIN, CALIB, EVAL, TEST, seed=0, heldout_blocks=4).heldout
    assert held.shape == (4, BLOCK) and (held[:, 0] == 1).all() and not (held[:, 1:] == 1).all()
    # A splits file written before the field existed reads as no BOS.
    np.savez(tmp_path / "old.npz", train=s.train, calib=s.calib, eval=s.selection, source="x", total_tokens=1)
    assert DataSplits.load(tmp_path / "old.npz").bos_token_id is None


@pytest.fixture(scope="module")
def bos_artifact(tiny_model, bos_tok, tmp_path_factory):
    """The tiny model exported with the BOS tokenizer and a generation config that lists two EOS ids."""
    from compress.export.standard import build_artifact

    model = copy.deepcopy(tiny_model)
    model.generation_config.eos_token_id = [2, 100]
    out = tmp_path_factory.mktemp("bos_artifact") / "fp32"
    build_artifact(model, bos_tok, out, exporter="dynamo")
    return out


def test_manifest_records_the_decision(bos_artifact, tiny_artifact):
    from compress.artifact import read_manifest

    m = read_manifest(bos_artifact)
    assert m["add_bos_token"] is True and m["bos_token_id"] == 1 and m["eos_token_ids"] == [2, 100]
    # The tiny chat template starts every message with <|im_start|>, this tokenizer's BOS: the template writes it.
    assert m["chat_template_adds_bos"] is True and from_manifest(m) == SpecialTokens(1, [2, 100], True)
    default = read_manifest(tiny_artifact)
    assert default["add_bos_token"] is False and default["eos_token_ids"] == [2]
    # A manifest from before these fields: today's behaviour (no BOS added).
    old = {k: v for k, v in default.items() if k not in ("add_bos_token", "chat_template_adds_bos")}
    assert from_manifest({**old, "bos_token_id": 0}) == SpecialTokens(None, [2], False)


def test_golden_passes_with_bos(tiny_model, bos_tok, bos_artifact):
    from compress.evaluate.golden import compare_onnx, record_golden

    g = record_golden(tiny_model, bos_tok, PROMPTS, top_k=8, new_tokens=8)
    for p, ids in zip(PROMPTS, g.prompt_ids):
        assert ids == [1] + bos_tok(p, add_special_tokens=False)["input_ids"]
    report = compare_onnx(bos_artifact, g)  # the ONNX side replays the same ids, BOS included
    assert report.passed, report.failures
    assert report.metrics()["golden_top1_agreement"] == 1.0


def test_perplexity_scores_the_same_positions(tiny_artifact, tiny_splits, bos_tok):
    from compress.evaluate.onnx_eval import evaluate_onnx

    bos_eval = make_splits(bos_tok, "embedded", BLOCK, TRAIN, CALIB, EVAL, TEST, seed=0, heldout_source="none").selection
    plain = evaluate_onnx(tiny_artifact, tiny_splits.selection, latency=False)
    with_bos = evaluate_onnx(tiny_artifact, bos_eval, latency=False)
    assert plain["eval_tokens"] == with_bos["eval_tokens"] == EVAL * (BLOCK - 1)
    assert np.isfinite(with_bos["perplexity"])


def test_generation_stops_on_any_eos(tiny_model, tiny_tokenizer, bos_artifact):
    from compress.evaluate.golden import record_golden
    from compress.drivers.standard import OnnxLM

    lm = OnnxLM(bos_artifact)
    prompt = special_tokens(tiny_tokenizer).encode(tiny_tokenizer, PROMPTS[0])
    free = lm.greedy(prompt, 8)
    # The first greedy token after the first that is new and not the primary EOS becomes the 2nd EOS.
    k = next(i for i in range(1, 8) if free[i] not in free[:i] and 2 not in free[:i + 1])
    model = copy.deepcopy(tiny_model)
    model.generation_config.eos_token_id = [2, free[k]]
    eos = eos_ids_of(model, tiny_tokenizer)
    assert set(eos) == {2, free[k]}
    assert lm.greedy(prompt, 8, eos_ids=eos) == free[:k + 1]  # stops on the second EOS, which it emits
    # The golden reference holds every EOS off (min_new_tokens), and so does its ONNX replay.
    g = record_golden(model, tiny_tokenizer, PROMPTS[:1], top_k=8, new_tokens=8)
    assert set(g.suppressed_ids) == {2, free[k]} and free[k] not in g.continuations[0]


def test_chat_end_of_turn_tokens_are_eos(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|eot_id|>"]})
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}"
    assert eos_ids_of(None, tok) == [2, eot]  # appended: the first id stays the primary EOS
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert eos_ids_of(None, tok) == [2]
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}<|eot_id|>{% endfor %}"
    btok = _bos_tokenizer(tok)
    st = special_tokens(btok)
    assert st.bos_id == 1 and st.chat_template_adds_bos
    rendered = btok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    ids = st.encode_rendered_chat(btok, rendered)
    assert ids[0] == 1 and ids[1] != 1  # one BOS, not two
    assert not special_tokens(tok).chat_template_adds_bos or special_tokens(tok).bos_id is None


def test_workload_fit_counts_the_bos(tiny_artifact, tmp_path):
    from loadtest.workloads import fit_to_context, make_workload

    art = tmp_path / "a"
    shutil.copytree(tiny_artifact, art)
    man = json.loads((art / "manifest.json").read_text())
    (art / "manifest.json").write_text(json.dumps({**man, "add_bos_token": True, "bos_token_id": 1}))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(art / "tokenizer.json"))
    wl = fit_to_context(make_workload(8, seed=0, prompt_words=(150, 200)), art, max_len=96)
    for r in wl:
        assert 1 + len(tok.encode(r["prompt"], add_special_tokens=False).ids) + r["max_tokens"] < 96
