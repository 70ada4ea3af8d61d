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
from dataclasses import dataclass
from pathlib import Path

from tasks.results import RESULTS_FORMAT, R, ResultFormatError, StageResult

DONE = "DONE.json"


@dataclass(frozen=True)
class StageRun:
    """Where one stage's result lives and is logged: <workdir>/<stage>/<key>/ (the key hashes the stage's inputs and
    the settings it reads) and a child run of the MLflow parent run."""

    workdir: str
    stage: str
    key: str
    parent_run_id: str | None = None

    @property
    def folder(self) -> Path:
        return Path(self.workdir) / self.stage / self.key


@dataclass(frozen=True)
class RunContext:
    """What the stages of one pipeline run share: where their folders live, the MLflow parent run, and the hash of
    each group of config sections a stage's key depends on (hashed by the flow: no task sees the whole config)."""

    workdir: str
    parent_run_id: str | None
    section_hashes: dict[str, str]

    def at(self, stage: str, sections: list[str], *upstream: str) -> StageRun:
        """The stage's place: its key is the stage, the hash of the sections it reads and its upstream keys."""
        h = hashlib.sha256()
        h.update(stage.encode())
        h.update(self.section_hashes["+".join(sections)].encode())
        for u in upstream:
            h.update(str(u).encode())
        return StageRun(self.workdir, stage, h.hexdigest()[:16], self.parent_run_id)


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


def open_stage(at: StageRun, kind: type[R], *, wipe: bool = True) -> tuple[Path, R | None]:
    """The stage's folder and, when it finished before, its result (a ``kind``); else the folder made ready to
    compute (emptied, or kept with wipe=False for a stage that resumes from what it left there), with this process
    holding its lock until mark_done. Waits while another live process computes the same key, then reuses its
    result."""
    folder = at.folder
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
    at: StageRun = parameters["at"]
    where = hashlib.sha256(str(at.folder).encode()).hexdigest()[:8]
    return f"{at.stage}-{at.key}-{where}-r{RESULTS_FORMAT}"


def submit_stage(task, at: StageRun, **kwargs):
    """Run a stage task; bypass a Prefect cache hit whose outputs no longer exist on disk."""
    if not is_done(at.folder):
        task = task.with_options(refresh_cache=True)
    return task(at=at, **kwargs)


def stage_logger():
    """Prefect's run logger inside a flow or task run (it reaches the UI), a module logger outside one."""
    import logging

    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("tasks")
