"""Task: evaluate candidate and baseline on the eval split and apply the acceptance gate."""

from __future__ import annotations

from prefect import task

from compress.accept import accept
from compress.config import PipelineConfig
from compress.evaluate import evaluate_onnx
from tasks.common import cache_key_fn, mark_done, open_stage
from tasks.load import load_splits
from tasks.tracking import child_run, log_json, log_metrics, log_params


@task(name="accept", cache_key_fn=cache_key_fn, persist_result=True)
def accept_task(cfg: PipelineConfig, stage: str, key: str, parent_run_id: str | None, candidate: str,
                baseline: str, splits: str) -> dict:
    folder, done = open_stage(cfg, stage, key)
    if done is not None:
        return done
    data = load_splits(splits)
    with child_run(parent_run_id, stage):
        log_params({"accept": cfg.accept.model_dump()})
        base = evaluate_onnx(baseline, data.eval)
        cand = evaluate_onnx(candidate, data.eval, reference_artifact=baseline)
        verdict = accept(cand, base, cfg.accept)
        metrics = {**{f"baseline_{k}": v for k, v in base.items()}, **{f"candidate_{k}": v for k, v in cand.items()},
                   **verdict.metrics, "accepted": float(verdict.accepted)}
        log_metrics(metrics)
        log_json({"accepted": verdict.accepted, "reasons": verdict.reasons, "candidate": cand, "baseline": base},
                 "verdict.json")
    return mark_done(folder, {"accepted": verdict.accepted, "reasons": verdict.reasons, "metrics": metrics,
                              "candidate": cand, "baseline": base})
