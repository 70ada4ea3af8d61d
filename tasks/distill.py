"""Task: distil the student from the teacher; resumable from the checkpoints in its stage folder."""

from __future__ import annotations

from prefect import task

from compress.distill.settings import DistillConfig
from compress.loading.settings import ModelConfig
from compress.sizing.memory import check_distill_memory, shape_of_folder
from tasks.common import StageRun, cache_key_fn, mark_done, open_stage
from tasks.results import Distilled
from tasks.load import load_model, load_splits
from tasks.tracking import child_run, log_figure, log_json, log_metrics, log_params


@task(name="distill", cache_key_fn=cache_key_fn, persist_result=True)
def distill_task(at: StageRun, *, distill: DistillConfig, model: ModelConfig, block_size: int, teacher_dir: str,
                 student_dir: str, splits: str, masks: str | None = None,
                 teacher_layers: list[int] | None = None) -> Distilled:
    """block_size: data.block_size (the train blocks' length, for the memory check)."""
    # No wipe: checkpoints under folder/ckpt let a killed run continue where it stopped.
    folder, done = open_stage(at, Distilled, wipe=False)
    if done is not None:
        return done
    from safetensors.torch import load_file

    from compress.distill import DistillJob, launch_distill, resolve_device, training_splits
    from compress.distill import distill as train

    with child_run(at.parent_run_id, at.stage) as run:
        log_params({"distill": distill.model_dump()})
        # before loading anything: CPU training too large for this machine is refused with the numbers
        device = resolve_device(distill.device).type if distill.device != "cuda" else "cuda"
        check_distill_memory(shape_of_folder(teacher_dir, model.trust_remote_code),
                             shape_of_folder(student_dir, model.trust_remote_code), device,
                             distill.batch_size, block_size)
        out = folder / "model"
        teacher = tok = None
        data = load_splits(splits)
        if distill.data != "corpus":
            # the teacher's generations replace or join the train blocks (compress/distill/data.py)
            cache = folder / f"train_{distill.data}.npz"
            if not cache.is_file():
                teacher, tok = load_model(teacher_dir, model)
            data = training_splits(data, teacher, tok, distill, cache)
            log_metrics({"distill_train_blocks": len(data.train)})
            splits = str(cache)
        on_log = lambda step, m: log_metrics(m, step=step)  # noqa: E731
        if distill.nproc_per_node > 1:
            # torchrun ranks (DDP); rank 0 reports the step metrics to this process and saves the student.
            job = DistillJob(teacher_dir=teacher_dir, student_dir=student_dir, splits=splits,
                             workdir=str(folder / "ckpt"), out_dir=str(out), config=distill.model_dump(mode="json"),
                             masks=masks, teacher_layers=teacher_layers, cache_dir=model.cache_dir,
                             revision=model.revision, trust_remote_code=model.trust_remote_code)
            report = launch_distill(job, distill.nproc_per_node, on_log=on_log)
        else:
            if teacher is None:
                teacher, tok = load_model(teacher_dir, model)
            student, _ = load_model(student_dir, model)
            keep = {k: v.bool() for k, v in load_file(masks).items()} if masks else None
            report = train(student, teacher, data, distill, folder / "ckpt", masks=keep,
                             on_log=on_log, teacher_layers=teacher_layers)
            student.save_pretrained(out)
            tok.save_pretrained(out)
        metrics = report.metrics()
        log_metrics(metrics)
        if run is not None:
            log_figure(report.figure(), "distill_curves.png")
            log_json({k: v for k, v in metrics.items()}, "distill_report.json")
    return mark_done(folder, Distilled(model_dir=str(out), metrics=metrics))
