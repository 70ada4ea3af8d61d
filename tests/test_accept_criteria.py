"""Criteria that fit each compression: fidelity for a quantized model, quality for a pruned/distilled student.

The downstream score (compress/evaluate/downstream.py) is checked against the same log-likelihoods computed with
torch; the accept stage is run as a task function on the tiny artifacts (baseline = the tiny model,
candidate = a pruned copy built with the gqa builder).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compress.evaluate.gate import WHY, accept, resolve_criteria
from compress.config import AcceptConfig, PipelineConfig
from compress.evaluate.downstream import CHOICES, choice_loglik, continuation_items, downstream_scores, mc_accuracy

BASE = {"perplexity": 20.0, "heldout_perplexity": 15.0, "downstream_accuracy": 0.60}
# A pruned + distilled student: as good a language model, but its argmax often differs from the teacher's.
STUDENT = {"perplexity": 21.0, "top1_agreement": 0.75, "kl_to_reference": 0.30, "heldout_perplexity": 16.0,
           "downstream_accuracy": 0.58}


def test_auto_criteria_follow_the_compression():
    cfg = AcceptConfig()
    assert (resolve_criteria(cfg, changed_model=True), resolve_criteria(cfg, changed_model=False)) == ("quality", "fidelity")
    assert resolve_criteria(AcceptConfig(criteria="fidelity"), changed_model=True) == "fidelity"
    with pytest.raises(ValueError, match="criteria"):
        AcceptConfig(criteria="vibes")


def test_quality_judges_a_student_on_quality_not_imitation():
    cfg = AcceptConfig(max_perplexity_ratio=1.10, min_top1_agreement=0.90, max_kl=0.1, max_heldout_perplexity_ratio=1.10,
                       max_downstream_drop=0.05)
    fid = accept(STUDENT, BASE, cfg, "fidelity")
    assert not fid.accepted and fid.criteria == "fidelity"
    # The other genre is checked under both criteria (every genre must pass).
    assert [c["name"] for c in fid.checks] == ["perplexity_ratio", "top1_agreement", "kl", "heldout_perplexity_ratio"]
    assert any("min_top1_agreement 0.9" in r for r in fid.reasons) and any("max_kl 0.1" in r for r in fid.reasons)
    q = accept(STUDENT, BASE, cfg, "quality")
    assert q.accepted and q.criteria == "quality", q.reasons
    assert [c["name"] for c in q.checks] == ["perplexity_ratio", "heldout_perplexity_ratio", "downstream_drop"]
    assert all(c["why"] == WHY[c["name"]] and c["passed"] for c in q.checks)
    assert q.metrics["gate_downstream_drop"] == pytest.approx(0.02)
    assert q.metrics["gate_heldout_perplexity_ratio"] == pytest.approx(16 / 15)
    assert q.metrics["gate_top1_agreement"] == 0.75  # logged, not checked

    worse = {**STUDENT, "heldout_perplexity": 24.0, "downstream_accuracy": 0.50}
    v = accept(worse, BASE, cfg, "quality")
    assert not v.accepted and len(v.reasons) == 2
    assert "max_heldout_perplexity_ratio 1.1" in v.reasons[0] and "1.6000x" in v.reasons[0]
    assert "max_downstream_drop 0.05" in v.reasons[1] and "+0.100" in v.reasons[1]
    # Not measured is a failure that says how to fix it, never a silent pass.
    blind = accept({"perplexity": 21.0}, {"perplexity": 20.0}, cfg, "quality")
    assert not blind.accepted and any("heldout_source is none" in r for r in blind.reasons)
    assert any("not measured" in r for r in blind.reasons if "downstream" in r)
    # cfg.criteria auto without a pipeline to resolve it: fidelity, as the gate always was.
    assert accept(STUDENT, BASE, cfg).criteria == "fidelity"


def test_continuation_items_put_the_true_span_among_its_neighbours():
    blocks = np.arange(3 * 32).reshape(3, 32)
    items = continuation_items(blocks, seed=1)
    assert items.sequences.shape == (3, CHOICES, 16 + 4) and items.context == 16
    for i in range(3):
        seqs = items.sequences[i]
        assert (seqs[:, :16] == blocks[i, :16]).all()
        assert (seqs[items.labels[i], 16:] == blocks[i, 16:20]).all()  # the true continuation
        assert sorted(s[16] for s in seqs) == [blocks[i, 16 + 4 * k] for k in range(CHOICES)]
    assert len(set(items.labels.tolist())) > 1 or len(items) < 2  # the answer is not always in one place
    with pytest.raises(ValueError, match="block_size"):
        continuation_items(np.zeros((2, 6), dtype=np.int64))


def test_mc_accuracy_equals_torch_log_likelihoods(tiny_model, tiny_artifact, tiny_splits):
    items = continuation_items(tiny_splits.test, seed=0)
    acc = mc_accuracy(tiny_artifact, items)
    flat = torch.as_tensor(items.sequences.reshape(-1, items.sequences.shape[-1]))
    with torch.no_grad():
        ll = choice_loglik(tiny_model(input_ids=flat).logits.numpy(), flat.numpy(), items.context)
    ll = ll.reshape(len(items), CHOICES)
    assert acc == pytest.approx(float((ll.argmax(-1) == items.labels).mean()))
    scores = downstream_scores(tiny_artifact, tiny_splits.test, tiny_splits.heldout, n=8)
    assert scores["downstream_items"] == 16 and scores["downstream_test_accuracy"] == acc
    assert scores["downstream_accuracy"] == pytest.approx((acc + scores["downstream_heldout_accuracy"]) / 2)


def test_accept_stage_judges_a_pruned_student_on_quality(tiny, tiny_artifact, tiny_splits, tmp_path, mlflow_store):
    import mlflow

    from compress.config import PruneConfig
    from compress.export.gqa import build_gqa_artifact
    from compress.prune import prune_model
    from tasks.accept import accept_task
    from tasks.common import StageRun

    model, tok = tiny
    student, _ = prune_model(model, tiny_splits.calib, PruneConfig(enabled=True, mlp_ratio=0.5, sensitivity=False,
                                                                   protected_layers=[]))
    build_gqa_artifact(student, tok, tmp_path / "student")
    tiny_splits.save(tmp_path / "splits.npz")
    tiny_splits.save_heldout(tmp_path / "heldout.npz")
    overrides = {"workdir": str(tmp_path / "work"), "prune": {"enabled": True},
                 "accept": {"enabled": True, "max_perplexity_ratio": 5.0, "min_top1_agreement": 1.0,
                            "max_heldout_perplexity_ratio": 1.0, "max_downstream_drop": 1.0, "downstream_items": 8,
                            "chat_max_new_tokens": 8, "max_chat_perplexity_ratio": 100.0, "max_chat_judged_ratio": 100.0}}
    cfg = PipelineConfig.model_validate(overrides)
    mlflow.set_experiment("accept-criteria")
    with mlflow.start_run() as parent:  # the stage logs to a child run, as under the flow
        at = StageRun(str(tmp_path / "work"), "accept", "k-quality", parent.info.run_id)
        out = accept_task.fn(at, accept=cfg.accept, model=cfg.model, trained=True, seed=cfg.data.seed,
                             candidate=str(tmp_path / "student"), baseline=str(tiny_artifact),
                             splits=str(tmp_path / "splits.npz"), heldout=str(tmp_path / "heldout.npz"))
    assert mlflow.active_run() is None
    (child,) = mlflow.search_runs(filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
                                  output_format="list")
    assert child.data.tags["accept_criteria"] == "quality" and child.data.metrics["accepted"] == 0.0
    assert out.criteria == "quality"
    assert [c["name"] for c in out.checks] == ["perplexity_ratio", "heldout_perplexity_ratio", "downstream_drop",
                                                  "chat_perplexity_ratio", "chat_judged_ratio"]
    # Agreement 1.0 was asked, and not checked (nor the chat set's): a pruned student is judged on quality. The held-out source's
    # perplexity ratio is checked (a pruned random model is worse there than the model it came from).
    ratio = out.metrics["heldout_perplexity_ratio"]
    assert ratio > 1.0 and not out.accepted and len(out.reasons) == 1 and "heldout" in out.reasons[0]
    assert out.metrics["gate_heldout_perplexity_ratio"] == pytest.approx(ratio)
    want = downstream_scores(tmp_path / "student", tiny_splits.test, tiny_splits.heldout, n=8)
    assert {k: out.candidate[k] for k in want} == want
    assert out.metrics["gate_downstream_drop"] == pytest.approx(
        out.baseline["downstream_accuracy"] - out.candidate["downstream_accuracy"])
