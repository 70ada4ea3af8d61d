"""The checkpoint as the accept stage's reference (compress/evaluate/checkpoint_ref.py).

In fp32 the checkpoint must be the exported graph's reference to float rounding: the same logits, the same greedy
answers token for token, the same figures. In bf16 it is another reference, close to it; and ``auto`` picks it
only for a large model stored in 16 bits whose gate needs no baseline decode speed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compress.drivers import load_lm
from compress.evaluate import chat as chat_eval
from compress.evaluate import checkpoint_ref
from compress.evaluate.checkpoint_ref import (CheckpointReference, ReferenceSettingError, resolve,
                                             stored_params_and_dtype)
from compress.evaluate.generate import greedy_answers
from compress.evaluate.onnx_eval import ReferencePass, evaluate_onnx
from compress.export.gqa import build_gqa_artifact
from compress.loading.tiny import build_tiny
from compress.evaluate.verdict import against_baseline

NEW = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(fp32 folder, bf16 folder, the fp32 gqa artifact, the gqa artifact of the bf16-rounded weights)."""
    root = tmp_path_factory.mktemp("ckpt")
    model, tok = build_tiny("llama", 0)
    model.save_pretrained(root / "fp32")
    tok.save_pretrained(root / "fp32")
    build_gqa_artifact(model, tok, root / "graph")
    half = model.to(torch.bfloat16)
    half.save_pretrained(root / "bf16")
    tok.save_pretrained(root / "bf16")
    build_gqa_artifact(half.float(), tok, root / "graph_of_bf16")
    return root / "fp32", root / "bf16", root / "graph", root / "graph_of_bf16"


@pytest.fixture(scope="module")
def prompts(checkpoints):
    return chat_eval.render(checkpoints[2], chat_eval.load_sets(["builtin"]))[:12]


def test_in_fp32_the_checkpoint_gives_the_graphs_logits_answers_and_scores(checkpoints, prompts, tiny_splits):
    fp32, _, graph, _ = checkpoints
    eos = chat_eval.read_manifest(graph, verify=False)["eos_token_ids"]
    ids = [p.prompt_ids for p in prompts]
    blocks = tiny_splits.test[:4]
    with CheckpointReference(str(fp32)).loaded(eos) as lm:
        assert lm.dtype == torch.float32
        ours = np.concatenate(list(lm.prefill_batches(blocks, 2)))
        gen = lm.generate(ids, NEW, progress=False, logprobs=True, rows=5)  # 12 prompts in rows of 5: 3 batches
        scored = dict(lm.continuation_logits(ids, gen.answers))
    drv = load_lm(graph, verify=False)
    theirs = np.concatenate(list(drv.prefill_batches(blocks, 2)))
    assert np.abs(ours - theirs).max() < 1e-4
    engine = greedy_answers(graph, ids, NEW, progress=False, logprobs=True)
    assert gen.answers == engine.answers  # left-padded batches of the checkpoint = the engine's batch-1-equal answers
    assert np.abs(np.array(gen.nll) - np.array(engine.nll)).max() < 1e-3
    for i, lg in drv.continuation_logits(ids, gen.answers):
        assert np.abs(scored[i] - lg).max() < 1e-4


def test_the_accept_figures_against_the_fp32_checkpoint_are_the_graphs(checkpoints, tiny_splits):
    fp32, _, graph, candidate = checkpoints
    blocks = tiny_splits.test
    base_g, cand_g = against_baseline(str(candidate), str(graph), blocks)
    base_c, cand_c = against_baseline(str(candidate), str(graph), blocks, reference=CheckpointReference(str(fp32)))
    assert base_c["perplexity"] == pytest.approx(base_g["perplexity"], rel=1e-5)
    assert cand_c["top1_agreement"] == cand_g["top1_agreement"]
    assert cand_c["kl_to_reference"] == pytest.approx(cand_g["kl_to_reference"], rel=1e-3, abs=1e-7)
    assert "decode_tokens_per_s" not in base_c and "decode_tokens_per_s" not in base_g  # no latency asked


def test_a_bf16_checkpoint_is_a_close_but_other_reference(checkpoints, tiny_splits, prompts):
    fp32, bf16, graph, graph_of_bf16 = checkpoints
    blocks = tiny_splits.test
    with CheckpointReference(str(bf16)).loaded() as lm:
        assert lm.dtype == torch.bfloat16
        ref = ReferencePass(graph, blocks, latency=False, lm=lm)
    with ref:
        # the graph of the same rounded weights, computed in fp32, against the bf16 computation of them
        same = evaluate_onnx(graph_of_bf16, blocks, reference=ref, latency=False)
    fp32_ppl = evaluate_onnx(graph, blocks, latency=False)["perplexity"]
    assert ref.figures["perplexity"] == pytest.approx(fp32_ppl, rel=0.02)
    assert same["top1_agreement"] > 0.95 and same["kl_to_reference"] < 1e-3
    # its chat targets are cached apart from the graph's
    assert chat_eval.targets_key(graph, prompts, NEW) != chat_eval.targets_key(
        graph, prompts, NEW, CheckpointReference(str(bf16)))


def test_a_16_bit_head_is_widened_a_chunk_at_a_time_to_the_same_fp32_logits(checkpoints, tiny_splits, monkeypatch):
    _, bf16, _, _ = checkpoints
    blocks = torch.as_tensor(tiny_splits.test[:2])
    with CheckpointReference(str(bf16)).loaded() as lm:
        assert lm.head.dtype == torch.bfloat16  # no fp32 copy held
        h, _ = lm._hidden(blocks)
        whole = (h.float() @ lm.head.float().T).numpy()
        monkeypatch.setattr(checkpoint_ref, "HEAD_CHUNK_BYTES", 37 * 4 * h.shape[-1])  # 37 rows, a ragged last chunk
        chunked = lm._logits(h)
    assert chunked.shape == whole.shape and np.abs(chunked - whole).max() <= 1e-5


def test_auto_picks_the_checkpoint_only_when_large_16_bit_and_no_speed_floor(checkpoints, monkeypatch):
    fp32, bf16, _, _ = checkpoints
    n, dtypes = stored_params_and_dtype(str(bf16))
    assert dtypes == "BF16" and n == sum(p.numel() for p in build_tiny("llama", 0)[0].parameters())
    assert stored_params_and_dtype(str(fp32))[1] == "F32"
    assert not resolve("auto", str(bf16), False)  # a tiny model: the graph is cheap
    monkeypatch.setattr(checkpoint_ref, "CHECKPOINT_FROM_PARAMS", 1000)
    assert resolve("auto", str(bf16), False)
    assert not resolve("auto", str(fp32), False)  # stored in fp32: the graph is the same numbers
    assert not resolve("auto", str(bf16), True)  # the speed floor needs the graph's decode speed
    assert not resolve("artifact", str(bf16), False) and not resolve("auto", None, False)
    assert resolve("checkpoint", str(fp32), False)
    with pytest.raises(ReferenceSettingError, match="min_decode_speed_ratio"):
        resolve("checkpoint", str(bf16), True)
    with pytest.raises(ReferenceSettingError, match="checkpoint's folder"):
        resolve("checkpoint", None, False)
