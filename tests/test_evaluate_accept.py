"""ONNX evaluation numbers on the tiny artifact and the acceptance gate / accuracy-aware loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compress.evaluate.gate import Verdict, accept
from compress.quantize.relax import quantize_with_acceptance
from compress.config import AcceptConfig, QuantizeConfig
from compress.evaluate.onnx_eval import evaluate_onnx
from compress.quantize.quantizer import Quantizer
from compress.evaluate.torch_eval import perplexity

BASE = {"perplexity": 20.0, "top1_agreement": 1.0, "decode_tokens_per_s": 40.0, "size_bytes": 500e6}


@pytest.fixture(scope="module")
def fp32_eval(tiny_artifact, tiny_splits):
    return evaluate_onnx(tiny_artifact, tiny_splits.selection, reference_artifact=tiny_artifact, decode_steps=12)


def test_fp32_onnx_perplexity_equals_torch(fp32_eval, tiny_model, tiny_splits, tiny_artifact):
    ref = perplexity(tiny_model, tiny_splits.selection)
    assert fp32_eval["perplexity"] == pytest.approx(ref, rel=1e-3)
    assert fp32_eval["top1_agreement"] == 1.0 and fp32_eval["kl_to_reference"] < 1e-9
    assert fp32_eval["eval_tokens"] == tiny_splits.selection.shape[0] * (tiny_splits.selection.shape[1] - 1)
    assert fp32_eval["size_bytes"] == (tiny_artifact / "model.onnx").stat().st_size
    assert 0 < fp32_eval["decode_ms_per_token"] < 1000
    assert fp32_eval["decode_tokens_per_s"] == pytest.approx(1000 / fp32_eval["decode_ms_per_token"])


def test_golden_prefix_match(tiny_model, tiny_tokenizer, tiny_artifact, tiny_splits):
    golden = []
    for text in ["The capital of France is", "def fibonacci(n):"]:
        ids = tiny_tokenizer(text)["input_ids"]
        with torch.no_grad():
            out = tiny_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        golden.append((ids, out[0, len(ids):].tolist()))
    ok = evaluate_onnx(tiny_artifact, tiny_splits.selection[:2], golden=golden, latency=False)
    assert ok["golden_prefix_match"] == 1.0
    broken = [(p, g[:4] + [(g[4] + 1) % 512] + g[5:]) for p, g in golden]  # first mismatch at token 4 of 8
    bad = evaluate_onnx(tiny_artifact, tiny_splits.selection[:2], golden=[{"prompt_ids": p, "greedy_ids": g} for p, g in broken], latency=False)
    assert bad["golden_prefix_match"] == pytest.approx(0.5)


def test_accept_within_tolerance():
    cfg = AcceptConfig(max_perplexity_ratio=1.05, min_top1_agreement=0.9, min_decode_speed_ratio=1.2, max_size_ratio=0.5)
    v = accept({"perplexity": 20.5, "top1_agreement": 0.93, "decode_tokens_per_s": 60.0, "size_bytes": 200e6}, BASE, cfg)
    assert isinstance(v, Verdict) and v.accepted and v.reasons == []
    assert v.metrics["gate_perplexity_ratio"] == pytest.approx(1.025)
    assert v.metrics["gate_decode_speed_ratio"] == pytest.approx(1.5)


def test_accept_rejects_naming_each_failed_tolerance():
    cfg = AcceptConfig(max_perplexity_ratio=1.05, max_perplexity_delta=0.5, min_top1_agreement=0.9, min_decode_speed_ratio=1.2, max_size_ratio=0.3)
    v = accept({"perplexity": 22.0, "top1_agreement": 0.85, "decode_tokens_per_s": 44.0, "size_bytes": 200e6}, BASE, cfg)
    assert not v.accepted and len(v.reasons) == 5
    text = "\n".join(v.reasons)
    for needle in ["max_perplexity_ratio 1.05", "1.1000x", "max_perplexity_delta 0.5", "+2", "min_top1_agreement 0.9", "0.8500",
                   "min_decode_speed_ratio 1.2", "1.100x", "max_size_ratio 0.3", "0.400x"]:
        assert needle in text, needle
    # only the failing one is named
    v2 = accept({"perplexity": 20.1, "top1_agreement": 0.5}, BASE, AcceptConfig())
    assert not v2.accepted and len(v2.reasons) == 1 and "min_top1_agreement" in v2.reasons[0]
    # NaN perplexity (a broken model) can never pass
    assert not accept({"perplexity": float("nan"), "top1_agreement": 1.0}, BASE, AcceptConfig()).accepted


def test_broken_quantization_is_rejected(tiny_artifact, tiny_splits, fp32_eval, tmp_path):
    """An absurd calibration range (every activation collapses to a couple of levels) must not pass the gate."""
    q = Quantizer(tiny_artifact, tiny_splits.calib, QuantizeConfig(method="static", keep_float=[], quantize_embedding=False))
    q.prepare()
    q.ranges = {t: (-1e6, 1e6) for t in q.ranges}
    q.write(tmp_path / "broken")
    m = evaluate_onnx(tmp_path / "broken", tiny_splits.selection, reference_artifact=tiny_artifact, latency=False)
    v = accept(m, fp32_eval, AcceptConfig())
    assert not v.accepted
    assert any("max_perplexity_ratio" in r for r in v.reasons) and any("min_top1_agreement" in r for r in v.reasons)


def test_accuracy_aware_loop_relaxes_until_accepted(tiny_artifact, tiny_splits, fp32_eval, tmp_path):
    qcfg = QuantizeConfig(method="static", keep_float=[], keep_float_as="float", quantize_embedding=False)
    acfg = AcceptConfig(max_perplexity_ratio=1.05, min_top1_agreement=0.99, relax_trials=2, relax_groups_per_trial=4)
    seen = []
    res = quantize_with_acceptance(tiny_artifact, tmp_path / "cand", tiny_splits.calib, tiny_splits.selection, qcfg, acfg,
                                   baseline=fp32_eval, on_trial=lambda i, rec: seen.append(rec),
                                   eval_kwargs={"latency": False})
    assert [r["trial"] for r in seen] == list(range(len(seen))) and len(seen) >= 2
    assert not seen[0]["accepted"] and "min_top1_agreement" in seen[0]["reasons"][0]
    assert len(seen[1]["extra_float_groups"]) == 4  # relaxed by relax_groups_per_trial
    assert res.verdict.accepted and res.metrics["top1_agreement"] >= 0.99
    assert res.trials[-1]["accepted"] and res.artifact == tmp_path / "cand"


def test_accuracy_aware_loop_rejects_after_the_last_trial(tiny_artifact, tiny_splits, fp32_eval, tmp_path):
    qcfg = QuantizeConfig(method="static", keep_float=[], quantize_embedding=True)
    acfg = AcceptConfig(max_perplexity_ratio=1.0, min_top1_agreement=1.0, relax_trials=1, relax_groups_per_trial=1)
    res = quantize_with_acceptance(tiny_artifact, tmp_path / "cand", tiny_splits.calib, tiny_splits.selection, qcfg, acfg,
                                   baseline=fp32_eval, eval_kwargs={"latency": False})
    assert not res.verdict.accepted and len(res.trials) == 2
    assert "accept.relax_trials=1" in res.verdict.reasons[-1]


def test_agreement_from_cached_reference_top1(tiny_artifact, tiny_splits, fp32_eval):
    from compress.evaluate.onnx_eval import prefill_logits

    top1 = prefill_logits(tiny_artifact, tiny_splits.selection).argmax(-1)
    m = evaluate_onnx(tiny_artifact, tiny_splits.selection, reference_top1=top1, latency=False)
    assert m["top1_agreement"] == 1.0 and "kl_to_reference" not in m
    shifted = np.roll(top1, 1, axis=1)
    m2 = evaluate_onnx(tiny_artifact, tiny_splits.selection, reference_top1=shifted, latency=False)
    assert m2["top1_agreement"] == pytest.approx(float((shifted[:, :-1] == top1[:, :-1]).mean()))


def test_agreement_counts_exactly_the_positions_perplexity_scores(tiny_artifact, tiny_splits):
    """Position s-1's logits predict a token outside the block: perplexity never scores it, nor may agreement."""
    from compress.evaluate.onnx_eval import prefill_logits

    top1 = prefill_logits(tiny_artifact, tiny_splits.selection).argmax(-1)
    n, s = tiny_splits.selection.shape
    last_only = top1.copy()
    last_only[:, :-1] = (top1[:, :-1] + 1) % 7  # differs at every scored position, agrees at the last one
    m = evaluate_onnx(tiny_artifact, tiny_splits.selection, reference_top1=last_only, latency=False)
    assert m["eval_tokens"] == n * (s - 1) and m["top1_agreement"] == 0.0
    all_but_last = top1.copy()
    all_but_last[:, -1] = (top1[:, -1] + 1) % 7  # agrees at every scored position only
    m = evaluate_onnx(tiny_artifact, tiny_splits.selection, reference_top1=all_but_last, latency=False)
    assert m["top1_agreement"] == 1.0
    # The same positions, counted: one disagreement at a scored position costs exactly 1 / eval_tokens.
    one_off = top1.copy()
    one_off[0, 0] = (top1[0, 0] + 1) % 7
    m = evaluate_onnx(tiny_artifact, tiny_splits.selection, reference_top1=one_off, latency=False)
    assert m["top1_agreement"] == pytest.approx(1 - 1 / m["eval_tokens"])


def test_large_vocabularies_evaluate_in_smaller_batches_with_the_same_figures(tiny_artifact, tiny_splits, monkeypatch):
    """One batch's logits stay within LOGITS_BATCH_BYTES (a 128k vocabulary's accept-stage peak); the figures do
    not depend on the batch."""
    from compress.evaluate import onnx_eval

    assert onnx_eval.logits_batch(4, 128, 49_152) == 4  # SmolLM2: as asked
    assert onnx_eval.logits_batch(4, 128, 128_256) == 2  # Llama 3: 65.7 MB a block
    assert onnx_eval.logits_batch(4, 4096, 128_256) == 1
    ref = evaluate_onnx(tiny_artifact, tiny_splits.selection, reference_artifact=tiny_artifact, latency=False)
    monkeypatch.setattr(onnx_eval, "LOGITS_BATCH_BYTES", 1)  # one block per batch
    one = evaluate_onnx(tiny_artifact, tiny_splits.selection, reference_artifact=tiny_artifact, latency=False)
    assert one["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-6)
    assert one["top1_agreement"] == ref["top1_agreement"] == 1.0 and one["eval_tokens"] == ref["eval_tokens"]


def test_every_gate_row_has_one_name_from_limit_to_metric_and_the_docs_table_is_the_code():
    """A check's name is its metric (gate_<name>) and the tail of its accept.max_/min_ limit; every row with a
    limit set is measured, checked and reported; docs/architecture.md's gate table lists the same rows."""
    from pathlib import Path

    from compress.evaluate.gate import CHECKS

    for row in CHECKS:
        assert row.limit == ("max_" if row.upper else "min_") + row.name, row
        assert row.limit in AcceptConfig.model_fields, row
    cfg = AcceptConfig(max_perplexity_delta=1.0, max_kl=0.1, max_heldout_perplexity_ratio=1.2, max_chat_perplexity_ratio=1.1,
                       min_chat_top1_agreement=0.8, max_chat_judged_ratio=1.2, min_chat_late_divergence_share=0.5,
                       min_decode_speed_ratio=1.0, max_size_ratio=0.5, min_structured_agreement=0.6)
    cand = {**BASE, "perplexity": 21.0, "top1_agreement": 0.95, "kl_to_reference": 0.05, "heldout_perplexity": 33.0,
            "downstream_accuracy": 0.5, "chat_perplexity_ratio": 1.05, "chat_top1_agreement": 0.9, "chat_items": 9,
            "chat_judged_ratio": 1.1, "chat_late_divergence_share": 0.6, "decode_tokens_per_s": 50.0,
            "size_bytes": 200e6, "structured_valid_share": 0.5, "structured_valid_drop": 0.1,
            "structured_agreement": 0.7, "structured_tasks": 10}
    base = {**BASE, "heldout_perplexity": 30.0, "downstream_accuracy": 0.52, "structured_valid_share": 0.6}
    seen = set()
    for criteria in ("fidelity", "quality"):
        v = accept(cand, base, cfg, criteria)
        assert v.accepted, v.reasons
        names = [c["name"] for c in v.checks]
        assert names == [r.name for r in CHECKS if criteria in r.criteria]
        assert all(f"gate_{n}" in v.metrics for n in names)
        seen.update(names)
    assert seen == {r.name for r in CHECKS}
    assert v.metrics["gate_heldout_perplexity_ratio"] == pytest.approx(1.1)
    assert v.metrics["gate_downstream_drop"] == pytest.approx(0.02)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    table = [line for line in doc.split("## The gate, one table")[1].split("\n## ")[0].splitlines()
             if line.startswith("| `")]
    assert [line.split("`")[1] for line in table] == [r.name for r in CHECKS]
    assert [line.split("`")[3] for line in table] == [r.limit for r in CHECKS]


def test_the_selection_gate_narrows_each_accuracy_limit_by_the_margin():
    from compress.evaluate.gate import selection_limits

    cfg = AcceptConfig(max_perplexity_ratio=1.10, max_perplexity_delta=2.0, min_top1_agreement=0.90, max_kl=0.2,
                       max_heldout_perplexity_ratio=1.25, max_downstream_drop=0.05, max_size_ratio=0.5)
    sel = selection_limits(cfg, 0.5)
    assert sel.max_perplexity_ratio == pytest.approx(1.05) and sel.max_perplexity_delta == pytest.approx(1.0)
    assert sel.min_top1_agreement == pytest.approx(0.95) and sel.max_kl == pytest.approx(0.1)
    assert sel.max_downstream_drop == pytest.approx(0.025) and sel.max_heldout_perplexity_ratio is None
    assert sel.max_size_ratio == 0.5 and sel.max_chat_perplexity_ratio == "auto"  # not accuracy-on-the-split limits
