"""Task: sensitivity scan + pruning of a copy of the teacher -> student checkpoint folder (+ masks)."""

from __future__ import annotations

from prefect import task

from compress.loading.settings import ModelConfig
from compress.prune.settings import PruneConfig
from compress.sizing.memory import check_prune_memory, shape_of_folder
from tasks.common import StageRun, cache_key_fn, mark_done, open_stage
from tasks.results import Pruned
from tasks.load import load_model, load_splits
from tasks.tracking import child_run, log_figure, log_json, log_metrics, log_params, log_rows


@task(name="prune", cache_key_fn=cache_key_fn, persist_result=True)
def prune_task(at: StageRun, *, prune: PruneConfig, model: ModelConfig, block_size: int, model_dir: str,
               splits: str) -> Pruned:
    """block_size: data.block_size (the calib blocks' length, for the memory check)."""
    folder, done = open_stage(at, Pruned)
    if done is not None:
        return done
    import torch
    from safetensors.torch import save_file

    from compress.evaluate import perplexity
    from compress.prune import prune_model, sensitivity_scan

    data = load_splits(splits)
    with child_run(at.parent_run_id, at.stage) as run:
        log_params({"prune": prune.model_dump()})
        # before loading anything: a model too large for this machine is refused with the numbers
        check_prune_memory(shape_of_folder(model_dir, model.trust_remote_code), prune.sensitivity_blocks, block_size)
        teacher, tok = load_model(model_dir, model)
        sens = sensitivity_scan(teacher, data.calib, prune) if prune.sensitivity else None
        student, report = prune_model(teacher, data.calib, prune, sens)
        metrics = {**report.metrics(), "prune_eval_ppl_before": perplexity(teacher, data.selection),
                   "prune_eval_ppl_after": perplexity(student, data.selection)}
        out = folder / "model"
        student.save_pretrained(out)
        tok.save_pretrained(out)
        masks_path = None
        if report.masks:
            masks_path = str(folder / "masks.safetensors")
            save_file({k: v.to("cpu", torch.uint8).contiguous() for k, v in report.masks.items()},
                      masks_path)
        log_metrics(metrics)
        if run is not None:
            log_json(report.to_dict(), "prune_report.json")
            if sens is not None:
                log_rows(sens.table(), "sensitivity.json")
                log_figure(sens.figure(), "sensitivity.png")
    return mark_done(folder, Pruned(model_dir=str(out), masks=masks_path, teacher_layers=report.teacher_layers,
                                    metrics=metrics))
