"""Task: export a torch checkpoint folder to an ONNX artifact folder with KV-cache I/O."""

from __future__ import annotations

from prefect import task

from compress.export.settings import ExportConfig
from compress.loading.settings import ModelConfig
from compress.quantize.settings import QuantizeConfig
from compress.sizing.memory import check_fits, shape_of_folder, stage_bytes
from compress.artifact import write_checkpoint_record
from compress.export import FROM_CHECKPOINT_WEIGHTS
from compress.sizing.disk import check_room, export_bytes, int8_bytes
from tasks.common import StageRun, cache_key_fn, mark_done, open_stage, stage_logger
from tasks.results import Exported
from tasks.load import load_model
from tasks.tracking import child_run, log_metrics, log_params


def _int4_plan(model, q):
    """export.weights int4: which groups stay at 8 bits, by measured 4-bit weight error (logged)."""
    from compress.export.weights import int4_plan

    plan = int4_plan(model, q.weight_block_size, q.weight_symmetric, q.int4_keep_int8, q.w4_clip(False),
                     q.int4_lm_head, q.w4_block())
    stage_logger().info("export: 4-bit weights, %d of %d groups at 8 bits by measured 4-bit weight error "
                        "(largest %s %.4f)", len(plan.int8_groups), len(plan.errors),
                        *max(plan.errors.items(), key=lambda kv: kv[1]))
    return plan


@task(name="export", cache_key_fn=cache_key_fn, persist_result=True)
def export_task(at: StageRun, *, export: ExportConfig, quantize: QuantizeConfig, model: ModelConfig, model_dir: str,
                weights: str = "float32", config_hash: str = "") -> Exported:
    """weights (export.weights, resolved): float32, the fp32 graph; int8 (or int4), the weight-only INT8 (4-bit) graph
    written from the checkpoint (quantize: its block size, accuracy level and 4-bit plan), and beside it a record of
    the checkpoint by digest (the run's baseline version). config_hash: the run's, written into the manifest."""
    folder, done = open_stage(at, Exported)
    if done is not None:
        return done
    from compress.export import build_artifact, build_gqa_artifact, choose_exporter

    shape = shape_of_folder(model_dir, model.trust_remote_code)
    check_fits("export", stage_bytes(shape)["export"], "the checkpoint as stored plus one fp32 tensor at a time: "
               "run it on a machine with that much free")
    int8 = weights in FROM_CHECKPOINT_WEIGHTS
    check_room("export", folder, int8_bytes(shape) if int8 else export_bytes(shape),
               f"the {'INT8' if int8 else 'fp32'} graph: free the room, or set workdir to a larger disk")
    with child_run(at.parent_run_id, at.stage) as run:
        # As stored (bf16 for most checkpoints): the gqa builder reads one weight at a time in fp32
        lm, tok = load_model(model_dir, model, dtype="auto")
        art = folder / "artifact"
        extra = {"source_model": model_dir, "config_hash": config_hash}
        exporter, why = choose_exporter(lm, export.exporter)
        stage_logger().info("export: %s", why)
        if int8 and exporter != "gqa":
            raise ValueError(f"export.weights {weights}: this model is exported with {exporter} ({why}), and only the gqa "
                             f"builder writes INT8 from the checkpoint; set export.weights to float32")
        if exporter != "gqa" and export.kv_dtype != "float32":
            raise ValueError(f"export.kv_dtype {export.kv_dtype}: this model is exported with {exporter} ({why}), "
                             f"whose caches are float32; set export.kv_dtype to float32")
        if exporter != "gqa":
            lm = lm.float()  # the traced exporters write the graph in the model's dtype
        if exporter == "gqa":
            q = quantize
            result, manifest = build_gqa_artifact(lm, tok, art, extra=extra, kv_dtype=export.kv_dtype,
                                                  int8=(q.weight_block_size, q.accuracy_level) if int8 else None,
                                                  int4=_int4_plan(lm, q) if weights == "int4" else None,
                                                  external_data_threshold_mb=export.external_data_threshold_mb)
        else:
            result, manifest = build_artifact(lm, tok, art, exporter, export.opset,
                                              export.external_data_threshold_mb, extra=extra)
        del lm
        record = None
        if int8:  # the baseline: the checkpoint itself, by digest (its weights stay where they are)
            record = str(folder / "checkpoint")
            write_checkpoint_record(model_dir, record, {k: manifest[k] for k in (
                "num_parameters", "vocab_size", "hidden_size", "family", "num_layers") if k in manifest})
        log_params({"export": export.model_dump(), "export_used": exporter, "export_weights": weights})
        onnx_bytes = sum(p.stat().st_size for p in art.glob("model.onnx*"))
        metrics = {"export_seconds": result.seconds, "onnx_mb": onnx_bytes / 2**20}
        log_metrics(metrics)
        if run is not None:
            import mlflow

            mlflow.log_artifact(str(art / "manifest.json"))
    return mark_done(folder, Exported(artifact=str(art), weights=weights, record=record, metrics=metrics))
