"""The accept stage gates on the quantize stage's evaluation when that one answers the same question.

The accuracy-aware loop in the quantize stage evaluates the final candidate and its fp32 source on the
eval split. When that source is the teacher (no prune/distill), those are exactly the figures the accept
stage needs, so it must not measure the candidate (or the baseline) a second time.
"""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

pytestmark = pytest.mark.timeout(600)


def test_accept_gates_on_the_quantize_stage_evaluation(prefect_harness, mlflow_store, tmp_path, monkeypatch):
    import tasks.accept as accept_mod
    from compress.data import DataSplits
    from compress.evaluate import evaluate_onnx
    from flows.pipeline import compress_flow

    measured = []
    real = accept_mod.evaluate_onnx

    def counting(artifact, *args, **kwargs):  # the real evaluation, counted
        measured.append(str(artifact))
        return real(artifact, *args, **kwargs)

    monkeypatch.setattr(accept_mod, "evaluate_onnx", counting)
    overrides = [f"workdir={tmp_path}", "prune.enabled=false", "distill.enabled=false", "benchmark.enabled=false",
                 "registry.promote=false", "registry.model_name=tiny-gate-once"]
    out = compress_flow(config="configs/tiny.yaml", overrides=overrides)

    assert measured == [], f"the accept stage evaluated {measured} again"
    client = MlflowClient(mlflow_store)
    exp = client.get_run(out["run_id"]).info.experiment_id
    children = client.search_runs([exp], f"tags.mlflow.parentRunId = '{out['run_id']}'")
    accept_run = next(r for r in children if r.data.tags["stage"] == "accept")
    assert accept_run.data.tags["evaluated_in"] == "quantize"
    assert out["verdict"]["evaluated_in"] == "quantize"

    (quant_done,) = tmp_path.glob("quantize/*/DONE.json")
    evaluation = json.loads(quant_done.read_text())["evaluation"]
    assert evaluation["reference"] == out["teacher_artifact"]
    assert out["verdict"]["candidate"] == evaluation["candidate"]
    assert out["verdict"]["baseline"] == evaluation["baseline"]
    assert out["verdict"]["accepted"] and accept_run.data.metrics["accepted"] == 1.0

    # What the accept stage would have measured itself: the same accuracy figures.
    (splits_file,) = tmp_path.glob("load/*/splits.npz")
    eval_blocks = DataSplits.load(str(splits_file)).eval
    cand = evaluate_onnx(out["candidate_artifact"], eval_blocks, reference_artifact=out["teacher_artifact"],
                         latency=False)
    base = evaluate_onnx(out["teacher_artifact"], eval_blocks, latency=False)
    reused_c, reused_b = out["verdict"]["candidate"], out["verdict"]["baseline"]
    for k in ("perplexity", "top1_agreement", "kl_to_reference", "size_bytes"):
        assert reused_c[k] == pytest.approx(cand[k], rel=1e-6, abs=1e-12), k
    assert reused_b["perplexity"] == pytest.approx(base["perplexity"], rel=1e-6)
    assert set(reused_b) == set(base) | {"decode_ms_per_token", "decode_tokens_per_s"}  # no self-agreement


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
