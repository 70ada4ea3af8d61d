"""What every stage task shares: stage folders, done markers and the Prefect cache key.

A stage writes its outputs to <workdir>/<stage>/<key>/ and a DONE.json last. The
key is a hash of the stage's inputs and the config sections it reads; Prefect's
cache hits only while that folder is complete, so a re-run after a failure (or a
deleted folder) redoes exactly the stages whose outputs are missing.

A DONE.json holds the stage's typed result (tasks/results.py); one written in another format is not reused:
the stage computes again.

Two runs that reach the same key at once (a cron run and one on demand) take turns: the first to
create <key>.lock beside the folder computes, the other waits for it and reuses its DONE.json. A lock
whose process is gone on this host is broken; one of this process is its own (a retry after a failure).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

from compress.config import PipelineConfig, project_root
from tasks.results import RESULTS_FORMAT, R, ResultFormatError, StageResult

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


def read_done(folder: Path, kind: type[R]) -> R | None:
    """The stage's result as ``kind``; None (with a word in the log) when its DONE.json is of another format."""
    try:
        return kind.from_json(json.loads((folder / DONE).read_text()))
    except (ResultFormatError, ValueError) as e:
        stage_logger().warning("%s: the finished result is not reused (%s); computing the stage again", folder, e)
        return None


def fresh(folder: Path) -> Path:
    """An empty folder for a stage that is about to (re)compute."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def open_stage(cfg: PipelineConfig, stage: str, key: str, kind: type[R], *,
               wipe: bool = True) -> tuple[Path, R | None]:
    """The stage's folder and, when it finished before, its result (a ``kind``); else the folder made ready to
    compute (emptied, or kept with wipe=False for a stage that resumes from what it left there), with this process
    holding its lock until mark_done. Waits while another live process computes the same key, then reuses its
    result."""
    folder = stage_dir(cfg, stage, key)
    if is_done(folder) and (done := read_done(folder, kind)) is not None:
        return folder, done
    take_lock(folder)
    if is_done(folder) and (done := read_done(folder, kind)) is not None:  # the run we waited for finished it
        release_lock(folder)
        return folder, done
    (folder / DONE).unlink(missing_ok=True)  # of another format: computed again
    if wipe:
        fresh(folder)
    else:
        folder.mkdir(parents=True, exist_ok=True)
    return folder, None


def mark_done(folder: Path, result: StageResult) -> StageResult:
    # written beside, then renamed: a reader sees no DONE.json or a whole one
    tmp = folder / f".{DONE}.{os.getpid()}"
    tmp.write_text(json.dumps(result.to_json(), indent=2, default=str))
    tmp.replace(folder / DONE)
    release_lock(folder)
    return result


def lock_path(folder: Path) -> Path:
    return folder.with_name(folder.name + ".lock")


def _owner() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname()}


def _mine(owner: dict) -> bool:
    return owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()


def _alive(owner: dict) -> bool:
    """Whether the lock's process still runs; a process on another host is taken to."""
    if owner.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def take_lock(folder: Path, poll_s: float = 1.0) -> None:
    """Create ``<folder>.lock`` (exclusively), waiting while a live process of another run holds it."""
    path = lock_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    said = False
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = json.loads(path.read_text() or "{}")
            except (OSError, ValueError):
                owner = {}  # being written this instant: look again
            if _mine(owner):
                return  # ours: a retry in the process that took it
            if (owner and not _alive(owner)) or (not owner and _age_s(path) > 60):
                path.unlink(missing_ok=True)  # its process is gone (or died writing it): the folder it left is redone
                continue
            if is_done(folder):
                return
            if owner and not said:
                stage_logger().info("%s: run in process %s on %s is computing it; waiting to reuse its result",
                                    folder, owner.get("pid"), owner.get("host"))
                said = True
            time.sleep(poll_s)
            continue
        with os.fdopen(fd, "w") as fh:
            json.dump({**_owner(), "since": time.time()}, fh)
        return


def release_lock(folder: Path) -> None:
    path = lock_path(folder)
    try:
        if _mine(json.loads(path.read_text())):
            path.unlink(missing_ok=True)
    except (OSError, ValueError):
        pass  # no lock, or another run's


def cache_key_fn(context, parameters) -> str:
    """Prefect cache key: stage + key (inputs and config sections) + where the outputs live.

    The folder is part of it because a cached result holds paths: the same stage computed
    under another workdir must not answer for this one. The flow refreshes the cache when
    the folder is gone.
    """
    folder = stage_dir(parameters["cfg"], parameters["stage"], parameters["key"])
    where = hashlib.sha256(str(folder).encode()).hexdigest()[:8]
    return f"{parameters['stage']}-{parameters['key']}-{where}-r{RESULTS_FORMAT}"


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
