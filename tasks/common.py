"""What every stage task shares: stage folders, done markers and the Prefect cache key.

A stage writes its outputs to <workdir>/<stage>/<key>/ and a DONE.json last. The
key is a hash of the stage's inputs and the config sections it reads; Prefect's
cache hits only while that folder is complete, so a re-run after a failure (or a
deleted folder) redoes exactly the stages whose outputs are missing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from compress.config import PipelineConfig, project_root

DONE = "DONE.json"


def workdir(cfg: PipelineConfig) -> Path:
    p = Path(cfg.workdir)
    return p if p.is_absolute() else project_root() / p


def stage_key(cfg: PipelineConfig, stage: str, sections: list[str], *upstream: str) -> str:
    h = hashlib.sha256()
    h.update(stage.encode())
    h.update(cfg.section_hash(*sections).encode())
    for u in upstream:
        h.update(str(u).encode())
    return h.hexdigest()[:16]


def stage_dir(cfg: PipelineConfig, stage: str, key: str) -> Path:
    return workdir(cfg) / stage / key


def is_done(folder: Path) -> bool:
    return (folder / DONE).is_file()


def read_done(folder: Path) -> dict:
    return json.loads((folder / DONE).read_text())


def fresh(folder: Path) -> Path:
    """An empty folder for a stage that is about to (re)compute."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def open_stage(cfg: PipelineConfig, stage: str, key: str, wipe: bool = True) -> tuple[Path, dict | None]:
    """The stage's folder and, when it finished before, its result; else the folder made ready to compute
    (emptied, or kept with wipe=False for a stage that resumes from what it left there)."""
    folder = stage_dir(cfg, stage, key)
    if is_done(folder):
        return folder, read_done(folder)
    if wipe:
        fresh(folder)
    else:
        folder.mkdir(parents=True, exist_ok=True)
    return folder, None


def mark_done(folder: Path, result: dict) -> dict:
    (folder / DONE).write_text(json.dumps(result, indent=2, default=str))
    return result


def cache_key_fn(context, parameters) -> str:
    """Prefect cache key: stage + key (inputs and config sections) + where the outputs live.

    The folder is part of it because a cached result holds paths: the same stage computed
    under another workdir must not answer for this one. The flow refreshes the cache when
    the folder is gone.
    """
    folder = stage_dir(parameters["cfg"], parameters["stage"], parameters["key"])
    where = hashlib.sha256(str(folder).encode()).hexdigest()[:8]
    return f"{parameters['stage']}-{parameters['key']}-{where}"


def submit_stage(task, cfg: PipelineConfig, stage: str, key: str, **kwargs):
    """Run a stage task; bypass a Prefect cache hit whose outputs no longer exist on disk."""
    if not is_done(stage_dir(cfg, stage, key)):
        task = task.with_options(refresh_cache=True)
    return task(cfg=cfg, stage=stage, key=key, **kwargs)


def stage_logger():
    """Prefect's run logger inside a flow or task run (it reaches the UI), a module logger outside one."""
    import logging

    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("tasks")
