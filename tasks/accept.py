"""Task: evaluate candidate and baseline on the eval split and apply the acceptance gate.

When the quantize stage's accuracy-aware loop already evaluated this candidate against this baseline on
this split, its figures are used as they are instead of being measured a second time.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
from prefect import task

from compress.accept import accept
from compress.config import PipelineConfig
from compress.evaluate import evaluate_onnx
from tasks.common import cache_key_fn, mark_done, open_stage
from tasks.load import load_splits
from tasks.tracking import child_run, log_json, log_metrics, log_params


def _same(a: str, b: str) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def reusable(evaluated: dict | None, baseline: str, splits: str) -> bool:
    """Whether an earlier stage's `evaluation` measured the candidate against `baseline` on `splits`.

    A quantized student was gated against the fp32 student, not the teacher: its agreement and
    perplexity ratio answer another question, so the accept stage measures it again.
    """
    return bool(evaluated) and _same(evaluated["reference"], baseline) and _same(evaluated["splits"], splits)


@task(name="accept", cache_key_fn=cache_key_fn, persist_result=True)
def accept_task(cfg: PipelineConfig, stage: str, key: str, parent_run_id: str | None, candidate: str,
                baseline: str, splits: str, evaluated: dict | None = None) -> dict:
    """evaluated: the quantize stage's `evaluation` of this candidate, or None (quantize off, or no loop ran)."""
    folder, done = open_stage(cfg, stage, key)
    if done is not None:
        return done
    with child_run(parent_run_id, stage) as run:
        log_params({"accept": cfg.accept.model_dump()})
        if reusable(evaluated, baseline, splits):
            evaluated_in = "quantize"
            base, cand = evaluated["baseline"], evaluated["candidate"]
        else:
            evaluated_in = "accept"
            data = load_splits(splits)
            base = evaluate_onnx(baseline, data.eval)
            cand = evaluate_onnx(candidate, data.eval, reference_artifact=baseline)
        if run is not None:
            mlflow.set_tag("evaluated_in", evaluated_in)
        verdict = accept(cand, base, cfg.accept)
        metrics = {**{f"baseline_{k}": v for k, v in base.items()}, **{f"candidate_{k}": v for k, v in cand.items()},
                   **verdict.metrics, "accepted": float(verdict.accepted)}
        log_metrics(metrics)
        log_json({"accepted": verdict.accepted, "reasons": verdict.reasons, "candidate": cand, "baseline": base,
                  "evaluated_in": evaluated_in}, "verdict.json")
    return mark_done(folder, {"accepted": verdict.accepted, "reasons": verdict.reasons, "metrics": metrics,
                              "candidate": cand, "baseline": base, "evaluated_in": evaluated_in})
