"""Task: resolve and load the teacher, cut the data into train/calib/eval/test blocks and the held-out source.

Two files: splits.npz (train / calib / eval, what every stage reads through `load_splits`) and heldout.npz
(the test split and the held-out source's blocks), which only the accept stage opens, for the verdict.
"""

from __future__ import annotations

from prefect import task

from compress.corpus.settings import DataConfig
from compress.loading.settings import ModelConfig
from compress.corpus.splits import DataSplits, splits_from_config
from tasks.common import StageRun, cache_key_fn, mark_done, open_stage
from tasks.results import Loaded
from tasks.tracking import child_run, log_metrics, log_params


def load_splits(path: str) -> DataSplits:
    return DataSplits.load(path)


def load_model(model_dir: str, m: ModelConfig, dtype="float32"):
    """The teacher in fp32 (what torch stages compute in), or dtype="auto": as stored (bf16 for most checkpoints)."""
    import torch

    from compress.loading.models import load_teacher

    return load_teacher(model_dir, None, m.cache_dir, m.revision, m.trust_remote_code,
                        dtype=torch.float32 if dtype == "float32" else dtype)


@task(name="load", cache_key_fn=cache_key_fn, persist_result=True, retries=1, retry_delay_seconds=5)
def load_task(at: StageRun, *, model: ModelConfig, data: DataConfig) -> Loaded:
    folder, done = open_stage(at, Loaded)
    if done is not None:
        return done
    from compress.export import choose_exporter
    from compress.loading.models import model_info, resolve_source

    with child_run(at.parent_run_id, at.stage):
        model_dir = resolve_source(model.source, model.gguf_file, model.cache_dir)
        lm, tok = load_model(model_dir, model, dtype="auto")  # only its shape is read here
        splits = splits_from_config(tok, data)
        path, heldout = folder / "splits.npz", folder / "heldout.npz"
        splits.save(path)
        splits.save_heldout(heldout)
        info = model_info(lm)
        exporter_auto = list(choose_exporter(lm, "auto"))
        log_params({"model": model.model_dump(), "data": data.model_dump()})
        metrics = {**{k: v for k, v in splits.summary().items() if isinstance(v, (int, float))},
                   "teacher_num_parameters": info["num_parameters"]}
        log_metrics(metrics)
    return mark_done(folder, Loaded(model_dir=model_dir, splits=str(path), heldout=str(heldout), info=info,
                                    exporter_auto=exporter_auto, metrics=metrics))
