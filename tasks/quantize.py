"""Task: INT8-quantize a candidate artifact on the calib split (with the accuracy-aware loop when the gate is on)."""

from __future__ import annotations

from pathlib import Path

import mlflow
from prefect import task

from compress.artifact import read_manifest
from compress.evaluate.settings import AcceptConfig
from compress.quantize.settings import QuantizeConfig
from compress.sizing.memory import Shape, check_stage_memory
from compress.sizing.disk import check_room, int8_bytes
from tasks.common import StageRun, cache_key_fn, mark_done, open_stage
from tasks.results import Quantized
from tasks.load import load_splits
from tasks.tracking import child_run, log_figure, log_json, log_metrics, log_params


@task(name="quantize", cache_key_fn=cache_key_fn, persist_result=True)
def quantize_task(at: StageRun, *, quantize: QuantizeConfig, accept: AcceptConfig, src_artifact: str,
                  splits: str) -> Quantized:
    """The result's `evaluation`, when the accuracy-aware loop ran, holds the final candidate's and the source's
    figures on the selection split, with `src_artifact` as the reference: the accept stage reuses them when it
    gates against that same artifact instead of evaluating both again."""
    folder, done = open_stage(at, Quantized)
    if done is not None:
        return done
    from compress.quantize import choose_quant_form, quantize_artifact, quantize_with_acceptance
    from compress.quantize.choice import profile_figure

    data = load_splits(splits)
    out = folder / "artifact"
    shape = Shape.of_manifest(read_manifest(src_artifact, verify=False))
    check_stage_memory("quantize", shape, block=data.selection.shape[1])
    cuda = quantize.target == "cuda"  # the fp16 CUDA form, nothing to choose among
    forms = 2 if quantize.method == "auto" and not cuda else 1  # auto writes each weight form before it keeps one
    size = 2 * shape.params if cuda else forms * int8_bytes(shape)
    check_room("quantize", folder, size, "the forms it writes: free the room, or set workdir to a larger disk")
    evaluation = None
    with child_run(at.parent_run_id, at.stage) as run:
        log_params({"quantize": quantize.model_dump()})
        trials: list[dict] = []
        choice = None
        if cuda:
            report = quantize_artifact(src_artifact, out, data.calib, quantize)
            artifact = out
        elif "auto" in (quantize.method, quantize.kv_cache):
            # the forms (weights x K/V cache) the stage chooses from, gated on the selection split, fastest kept
            choice = choose_quant_form(src_artifact, out, data.calib, data.selection, quantize, accept,
                                       on_trial=lambda form, i, m: trials.append({"form": form, **m}))
            res = choice.result
            report, artifact = res.report, Path(res.artifact)
            evaluation = {"reference": str(src_artifact), "splits": str(splits), "candidate": res.metrics,
                          "baseline": res.baseline}
        elif accept.enabled and accept.relax_trials > 0:
            res = quantize_with_acceptance(src_artifact, out, data.calib, data.selection, quantize, accept,
                                           on_trial=lambda i, m: (log_metrics(m.get("metrics", {}), step=i), trials.append(m)))
            report, artifact = res.report, Path(res.artifact)
            evaluation = {"reference": str(src_artifact), "splits": str(splits), "candidate": res.metrics,
                          "baseline": res.baseline}
        else:
            report = quantize_artifact(src_artifact, out, data.calib, quantize)
            artifact = out
        metrics = {**report.metrics(), **(choice.metrics() if choice else {})}
        log_metrics(metrics)
        if choice is not None:
            log_params({"quantize_auto_chosen": choice.chosen or "none",
                        **({"quantize_auto_kv": choice.kv_chosen or "none"} if choice.kv_auto else {})})
            fig = profile_figure(choice.forms, choice.chosen) if run is not None else None
            if fig is not None:
                log_figure(fig, "auto_forms_tokens_per_s.png")
        if run is not None:
            log_json({"float_linears": report.float_linears, "sensitivity": report.sensitivity, "trials": trials,
                      "auto_forms": choice.forms if choice else None},
                     "quantize_report.json")
            mlflow.log_artifact(str(artifact / "manifest.json"))
    return mark_done(folder, Quantized(artifact=str(artifact), evaluation=evaluation,
                                       choice=choice_summary(choice) if choice else None, metrics=metrics))


def choice_summary(choice) -> dict:
    """What the run summary and a rejection say about the forms: each attempt's figures, the pick, the hints."""
    return {"chosen": choice.chosen, "kv": choice.kv_chosen, "kv_auto": choice.kv_auto, "hints": choice.hints(),
            "attempts": [{"form": name, **a, **({k: v for k, v in f.items() if k.startswith("tokens_per_s_b")}
                                                 if a["kv"] == f["kv"] else {})}
                         for name, f in choice.forms.items() for a in f["kv_attempts"]]}
