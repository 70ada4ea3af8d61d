"""Task: record golden outputs from the torch model and validate its ONNX export against them."""

from __future__ import annotations

import gc

from prefect import task

from compress.artifact import read_manifest
from compress.evaluate.settings import GoldenConfig
from compress.loading.settings import ModelConfig
from compress.export.weights import Int4Plan, written_int8
from compress.sizing.memory import check_stage_memory, shape_of_folder
from tasks.common import StageRun, cache_key_fn, mark_done, open_stage
from tasks.results import Golden
from tasks.load import load_model
from tasks.tracking import child_run, log_metrics, log_params


@task(name="golden", cache_key_fn=cache_key_fn, persist_result=True)
def golden_task(at: StageRun, *, golden: GoldenConfig, model: ModelConfig, model_dir: str, artifact: str,
                reference_golden: str | None = None) -> Golden:
    """Fails the run when the export does not reproduce its own torch model; drift vs a reference is reported only."""
    folder, done = open_stage(at, Golden)
    if done is not None:
        return done
    import mlflow

    from compress.evaluate import GoldenSet, compare_from_config, record_golden
    from compress.evaluate.golden_int8 import int8_thresholds

    manifest = read_manifest(artifact, verify=False)
    int8 = written_int8(manifest)
    check_stage_memory("golden_int8" if int8 else "golden", shape_of_folder(model_dir, model.trust_remote_code))
    with child_run(at.parent_run_id, at.stage) as run:
        # the INT8 graph written from the checkpoint is judged against it as stored (golden_int8.py)
        lm, tok = load_model(model_dir, model, dtype="auto" if int8 else "float32")
        g = golden
        recorded = record_golden(lm, tok, g.prompts, g.top_k, g.new_tokens)
        recorded.save(folder)
        pad_id = tok.pad_token_id or 0
        thresholds, expected = None, {}
        if int8:
            q = manifest["quantization"]
            thresholds, expected = int8_thresholds(lm, recorded, q["block_size"], q["accuracy_level"], g.int8_margin,
                                                   int4=Int4Plan.from_quantization(q))
        # The torch model and the ONNX session are each the size of the weights: never both at once
        del lm
        gc.collect()
        report = compare_from_config(artifact, recorded, g, pad_id=pad_id, thresholds=thresholds,
                                     decode_against="self" if int8 else "golden")
        metrics = {**report.metrics(), **expected}
        if reference_golden:
            drift = compare_from_config(artifact, GoldenSet.load(reference_golden), g, pad_id=pad_id)
            metrics.update(drift.metrics(prefix="drift_vs_teacher_"))
        log_params({"golden": {k: v for k, v in g.model_dump().items() if k != "prompts"},
                    **({"golden_thresholds": thresholds} if thresholds else {})})
        log_metrics(metrics)
        if run is not None:
            mlflow.log_table(report.table(), artifact_file="golden_report.json")
            mlflow.log_artifacts(str(folder), "golden")
        report.raise_if_failed()
    return mark_done(folder, Golden(golden=str(folder), failures=report.failures, metrics=metrics))
