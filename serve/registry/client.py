"""The server's view of the MLflow model registry: which version an alias names, and its files.

Only what serving a ``models:/`` URI needs: resolve the tracking store, check it is reachable,
look up a version or alias, download a version's artifact folder, and the file lock that serialises writes to a
local store (``store_lock``). MLflow is imported lazily, inside the functions, so serving a local folder needs no
MLflow at all. The one write a server makes is the champion's labels (serve/registry/champion.py). The pipeline's
registry (compress/registry/store.py: register, promote, roll back) builds on these same functions.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from serve.config import project_root


class RegistryError(RuntimeError):
    pass


def default_tracking_uri() -> str:
    db = project_root() / "mlruns" / "mlflow.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    # Absolute: a worker started elsewhere must find the same store.
    return f"sqlite:///{db}"


def resolve_tracking_uri(configured: str | None = None) -> str:
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def check_reachable(tracking_uri: str) -> None:
    """Fail early, with the URI, when the tracking server cannot be reached."""
    if not tracking_uri.startswith(("http://", "https://")):
        return
    import urllib.request

    try:
        urllib.request.urlopen(tracking_uri.rstrip("/") + "/health", timeout=5).read()
    except Exception as e:
        raise RegistryError(
            f"MLflow tracking server {tracking_uri} is unreachable ({type(e).__name__}: {e}); start it "
            f"(make ui) or unset MLFLOW_TRACKING_URI to use the local store under mlruns/"
        ) from None


def connect(tracking_uri: str | None = None) -> str:
    """Point mlflow at the store (configured, else $MLFLOW_TRACKING_URI, else <project>/mlruns); returns the URI."""
    import mlflow

    uri = resolve_tracking_uri(tracking_uri)
    # Before any MLflow call: MLflow's own HTTP client retries a dead server for minutes.
    check_reachable(uri)
    use_wal(uri)
    mlflow.set_tracking_uri(uri)
    return uri


def sqlite_path(uri: str) -> Path:
    """The database file of a ``sqlite:///`` tracking URI."""
    return Path(uri[len("sqlite:///"):].split("?", 1)[0])


def use_wal(uri: str) -> None:
    """Make a local sqlite store safe for several processes at once, under a file lock beside it: its tables are
    created by one process only (three runs starting on a new store raced to create them: "table ... already
    exists"), and it is put in write-ahead-log mode (the file keeps it), so writers wait for each other
    (MLflow's 20 s busy timeout per session) instead of failing with "database is locked" while another reads."""
    if not uri.startswith("sqlite:///"):
        return
    import fcntl
    import sqlite3
    from contextlib import closing

    path = sqlite_path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with closing(sqlite3.connect(path, timeout=30)) as db:
            if db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                db.execute("PRAGMA journal_mode=WAL")
            ready = db.execute("SELECT 1 FROM sqlite_master WHERE name = 'alembic_version'").fetchone()
        if not ready:
            from mlflow.tracking import MlflowClient

            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)  # creates and migrates the tables


@dataclass
class Version:
    name: str
    version: str
    run_id: str | None
    source: str
    tags: dict
    aliases: list[str]


def client():
    from mlflow import MlflowClient

    return MlflowClient()


def get_version(model_name: str, version: str | int) -> Version:
    mv = client().get_model_version(model_name, str(version))
    return Version(mv.name, str(mv.version), mv.run_id, mv.source, dict(mv.tags), list(mv.aliases))


def version_for_alias(model_name: str, alias: str) -> Version | None:
    try:
        mv = client().get_model_version_by_alias(model_name, alias)
    except Exception:
        return None
    return get_version(model_name, mv.version)


def download(model_uri: str, dst: str | Path | None = None) -> Path:
    """models:/NAME@alias or models:/NAME/3 -> a local artifact folder."""
    import mlflow

    return Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dst) if dst else None))


@contextmanager
def store_lock(name: str, tracking_uri: str | None = None) -> Iterator[bool]:
    """Hold an exclusive file lock beside a local sqlite store (``<store>.<name>.lock``) for the block, which every
    process on this machine honours; yields True, or False (no lock taken) for a remote tracking server."""
    uri = tracking_uri or resolve_tracking_uri(None)
    if not uri.startswith("sqlite:///"):
        yield False
        return
    import fcntl

    db = sqlite_path(uri)
    path = db.with_name(f"{db.name}.{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.lock")
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes, also if the process dies
        yield True
