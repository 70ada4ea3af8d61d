"""The verdict: on the held-out test split, which no stage before the accept stage reads.

The accept stage gates on the test split (the plain figures), scores the held-out source beside it
(heldout_*) and logs the selection (eval) split's figures beside (selection_*). The accuracy-aware loop in
the quantize stage already evaluated the final candidate and its fp32 source on the selection split; when
that source is the teacher (no prune/distill) those are exactly the selection figures, so the accept stage
must not measure the candidate (or the baseline) on that split a second time.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]


def test_accept_gates_on_the_test_split_and_reuses_the_selection_figures(prefect_harness, mlflow_store, tmp_path,
                                                                          monkeypatch):
    import compress.evaluate.verdict as accept_mod
    from compress.corpus.splits import DataSplits, load_heldout
    from compress.evaluate.onnx_eval import evaluate_onnx
    from flows.pipeline import compress_flow
    from tasks.results import Judged

    measured = []  # (artifact, blocks) of every candidate evaluation the accept stage runs
    references = []  # and of every reference pass (the baseline's figures and logits)
    real = accept_mod.evaluate_onnx

    def counting(artifact, blocks, *args, **kwargs):  # the real evaluation, recorded
        measured.append((str(artifact), np.asarray(blocks).copy()))
        return real(artifact, blocks, *args, **kwargs)

    class CountedPass(accept_mod.ReferencePass):
        def __init__(self, artifact, blocks, *args, **kwargs):
            references.append((str(artifact), np.asarray(blocks).copy()))
            super().__init__(artifact, blocks, *args, **kwargs)

    monkeypatch.setattr(accept_mod, "evaluate_onnx", counting)
    monkeypatch.setattr(accept_mod, "ReferencePass", CountedPass)
    heldout_readers = []  # the source file of the code that opened heldout.npz, every time
    real_load = np.load

    def watching(file, *args, **kwargs):
        if Path(str(file)).name == "heldout.npz":
            heldout_readers.append([f.filename for f in inspect.stack()[1:] if f.filename.startswith(str(ROOT))])
        return real_load(file, *args, **kwargs)

    monkeypatch.setattr(np, "load", watching)
    overrides = [f"workdir={tmp_path}", "prune.enabled=false", "distill.enabled=false", "benchmark.enabled=false",
                 "registry.promote=false", "registry.model_name=tiny-gate-once"]
    out = compress_flow(config="configs/tiny.yaml", overrides=overrides)
    monkeypatch.setattr(np, "load", real_load)

    # The test split was opened once, by the accept stage, and by nothing before it.
    assert len(heldout_readers) == 1 and str(ROOT / "tasks" / "accept.py") in heldout_readers[0], heldout_readers
    (splits_file,) = tmp_path.glob("load/*/splits.npz")
    (heldout_file,) = tmp_path.glob("load/*/heldout.npz")
    splits, held = DataSplits.load(str(splits_file)), load_heldout(heldout_file)
    assert splits.test is None  # the file every stage reads holds no test block

    # The verdict's evaluations: the baseline once on test and once on the held-out source (a reference pass whose
    # spooled logits the candidate's evaluation reads), the candidate on both; none on eval.
    def split(b):
        return ("test" if np.array_equal(b, held.test) else "heldout" if np.array_equal(b, held.heldout)
                else "eval" if np.array_equal(b, splits.selection) else "?")

    assert sorted(split(b) for _, b in measured) == ["heldout", "test"], measured
    assert sorted(split(b) for _, b in references) == ["heldout", "test"], references
    assert {a for a, _ in measured} == {out["candidate_artifact"]}
    assert {a for a, _ in references} == {out["teacher_artifact"]}
    # Where the stage's time went, per part and per part of the chat set, in the result and the summary.
    took = out["verdict"]["seconds"]
    assert {"test", "heldout", "chat", "chat_teacher_answers", "chat_candidate_answers", "chat_judging"} <= set(took)
    assert all(v > 0 for v in took.values()) and took["chat"] >= took["chat_candidate_answers"]

    client = MlflowClient(mlflow_store)
    exp = client.get_run(out["run_id"]).info.experiment_id
    children = client.search_runs([exp], f"tags.mlflow.parentRunId = '{out['run_id']}'")
    accept_run = next(r for r in children if r.data.tags["stage"] == "accept")
    assert accept_run.data.tags["evaluated_in"] == "quantize"
    assert out["verdict"]["evaluated_in"] == "quantize"
    assert accept_run.data.tags["heldout_source"] == "stdlib_code"

    # The selection figures are the quantize stage's evaluation, reused as they are.
    (quant_done,) = tmp_path.glob("quantize/*/DONE.json")
    evaluation = json.loads(quant_done.read_text())["evaluation"]
    assert evaluation["reference"] == out["teacher_artifact"]
    assert out["verdict"]["selection"] == {"candidate": evaluation["candidate"], "baseline": evaluation["baseline"]}
    m = out["verdict"]["metrics"]
    assert m["selection_perplexity"] == evaluation["candidate"]["perplexity"]
    assert m["selection_top1_agreement"] == evaluation["candidate"]["top1_agreement"]
    assert m["selection_perplexity_ratio"] == pytest.approx(
        evaluation["candidate"]["perplexity"] / evaluation["baseline"]["perplexity"])
    assert out["verdict"]["accepted"] and accept_run.data.metrics["accepted"] == 1.0

    # The verdict's figures are the test split's: what evaluate_onnx measures there, not the selection split's.
    cand = evaluate_onnx(out["candidate_artifact"], held.test, reference_artifact=out["teacher_artifact"], latency=False)
    base = evaluate_onnx(out["teacher_artifact"], held.test, latency=False)
    verdict_c, verdict_b = out["verdict"]["candidate"], out["verdict"]["baseline"]
    for k in ("perplexity", "top1_agreement", "kl_to_reference", "size_bytes"):
        assert verdict_c[k] == pytest.approx(cand[k], rel=1e-6, abs=1e-12), k
    assert verdict_b["perplexity"] == pytest.approx(base["perplexity"], rel=1e-6)
    assert verdict_c["perplexity"] != evaluation["candidate"]["perplexity"]
    assert m["gate_perplexity_ratio"] == pytest.approx(cand["perplexity"] / base["perplexity"], rel=1e-6)
    # No self-agreement on the test split; the chat set's figures of the teacher against itself (ratios 1) so the
    # registry's Compare lines them up with the candidate's.
    chat_b = {k for k in verdict_b if k.startswith("chat_")}
    assert set(verdict_b) - chat_b == set(base) | {"decode_ms_per_token", "decode_tokens_per_s"}
    assert verdict_b["chat_perplexity_ratio"] == 1.0 and verdict_c["chat_items"] == 48
    assert m["gate_chat_perplexity_ratio"] == verdict_c["chat_perplexity_ratio"]
    assert verdict_c["chat_perplexity"] == pytest.approx(verdict_c["chat_perplexity_ratio"] * verdict_b["chat_perplexity"])
    hc = evaluate_onnx(out["candidate_artifact"], held.heldout, reference_artifact=out["teacher_artifact"], latency=False)
    assert m["heldout_perplexity"] == pytest.approx(hc["perplexity"], rel=1e-6)
    assert m["heldout_top1_agreement"] == pytest.approx(hc["top1_agreement"], rel=1e-6)
    assert 0 < m["heldout_perplexity_ratio"] < 10

    # The registered version carries the test figures under plain names, the held-out and selection beside.
    figs = Judged.from_json(out["verdict"]).figures()
    assert figs["perplexity"] == verdict_c["perplexity"] and figs["gate_top1_agreement"] == m["gate_top1_agreement"]
    assert figs["heldout_perplexity_ratio"] == m["heldout_perplexity_ratio"]
    assert figs["selection_perplexity"] == m["selection_perplexity"]
    assert figs["chat_perplexity_ratio"] == verdict_c["chat_perplexity_ratio"]
    assert {g["genre"] for g in out["verdict"]["genres"]} >= {"test", "chat", "chat_judged"}


def test_only_the_accept_stage_opens_the_heldout_file():
    """Statically, for the stages the flow test above does not run (prune, distill): nothing else names it."""
    readers = sorted(str(p.relative_to(ROOT)) for d in ("compress", "tasks", "flows", "serve", "benchmarks", "scripts")
                     for p in (ROOT / d).rglob("*.py") if "load_heldout" in p.read_text() or "heldout.npz" in p.read_text())
    # benchmarks/large_models.py measures the accept stage's evaluation in a process of its own (peak RSS per stage),
    # benchmarks/int4_variants.py --accept-reference runs the stage's function against either reference.
    assert readers == ["benchmarks/int4_variants.py", "benchmarks/large_models.py", "compress/corpus/splits.py",
                       "tasks/accept.py", "tasks/load.py"], readers  # compress/evaluate/verdict.py is handed the splits
    assert "load_heldout" not in (ROOT / "tasks" / "load.py").read_text()  # the load stage writes it, only


def test_only_an_evaluation_against_the_same_baseline_and_split_is_reused(tmp_path):
    from tasks.accept import reusable

    teacher, student, splits = tmp_path / "teacher", tmp_path / "student", tmp_path / "splits.npz"
    evaluation = {"reference": str(teacher), "splits": str(splits), "candidate": {}, "baseline": {}}
    assert reusable(evaluation, str(teacher), str(splits))
    assert reusable(evaluation, str(tmp_path / "x" / ".." / "teacher"), str(splits))  # the same folder
    # A quantized student was gated against the fp32 student: the accept stage measures it against the teacher.
    assert not reusable({**evaluation, "reference": str(student)}, str(teacher), str(splits))
    assert not reusable(evaluation, str(teacher), str(tmp_path / "other.npz"))
    assert not reusable(None, str(teacher), str(splits))  # quantize off, or no loop ran
