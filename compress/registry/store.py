"""MLflow model registry: register artifact folders as versions, move aliases, promote, roll back.

The one compress/ module that talks to MLflow, because the registry *is* MLflow;
it holds no pipeline logic.

A version's figures (perplexity, agreement, size, tokens/s, latencies, RSS) are the
metrics of its source run, so MLflow's own model-version Compare page lines them up;
its tags say only what it is (role, verdict, reasons, digest, config hash).

Aliases (docs/operations.md): ``baseline`` the exported fp32 teacher of the latest run,
``candidate`` the newest version that passed the gate and may be promoted, ``champion``
what the servers serve (moved only by deploy, rollback or a person in the UI).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# The lookups the server needs live with the server (serve/registry/client.py); this module adds the
# pipeline's side (register, promote, roll back) and re-exports them, so callers need one module.
from serve.registry import champion as _champion
from serve.registry.client import (RegistryError, Version, check_reachable, connect, default_tracking_uri, download,
                                   get_version, resolve_tracking_uri, store_lock, version_for_alias)
from serve.registry.client import client as _client

__all__ = ["RegistryError", "Version", "check_reachable", "configure", "default_tracking_uri", "download",
           "get_version", "resolve_tracking_uri", "store_lock", "version_for_alias"]

ARTIFACT_PATH = "artifact"


def configure(tracking_uri: str | None = None, experiment: str | None = None) -> str:
    """Point mlflow at the store (and experiment); artifacts of a sqlite store go to <project>/mlruns."""
    import mlflow

    uri = connect(tracking_uri)
    if experiment:
        exp = mlflow.get_experiment_by_name(experiment)
        if exp is None:
            location = None
            if uri.startswith("sqlite:///"):
                # Artifacts beside the database (absolute), not in whatever the cwd happens to be.
                db = Path(uri[len("sqlite:///"):])
                location = (db.parent / "artifacts" / experiment).as_uri()
            mlflow.create_experiment(experiment, artifact_location=location)
        mlflow.set_experiment(experiment)
    return uri


def ui_url(tracking_uri: str, configured: str | None = None) -> str | None:
    """The MLflow UI address people open, where it is known: configured (``mlflow.ui_url``, else $MLFLOW_UI_URL),
    else the tracking server itself; None for a local store, whose UI runs on whatever port ``make ui`` was given."""
    configured = configured or os.environ.get("MLFLOW_UI_URL")
    if configured:
        return configured.rstrip("/")
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return None


# MLflow 3's UI opens in its GenAI view unless the link asks for "Model training" (a per-browser setting
# otherwise; an experiment cannot choose), and that view hides the model registry.
ML_VIEW = "?workflowType=machine_learning"


def run_route(experiment_id: str, run_id: str) -> str:
    """The UI's route to a run, relative (``#/...``): in a description or a markdown artifact, which MLflow renders
    on its own pages, it opens the run on whatever address and port the UI is served."""
    return f"#/experiments/{experiment_id}/runs/{run_id}{ML_VIEW}"


def model_route(model_name: str, version: str | None = None) -> str:
    return f"#/models/{model_name}" + (f"/versions/{version}" if version else "") + ML_VIEW


def outside_link(ui: str | None, route: str) -> str:
    """A route as text read outside the MLflow UI (a Prefect state or artifact, a terminal): absolute where the UI's
    address is known, else the route with where to open it."""
    return f"{ui}/{route}" if ui else f"{route} in the MLflow UI (make ui)"


def run_link(ui: str | None, experiment_id: str, run_id: str) -> str:
    return outside_link(ui, run_route(experiment_id, run_id))


def model_link(ui: str | None, model_name: str, version: str | None = None) -> str:
    return outside_link(ui, model_route(model_name, version))


# registry.baseline_weights: auto records a baseline's weights by digest above this many bytes of graph weights.
DIGEST_ABOVE_BYTES = 2 * 2**30


def weight_files(folder: str | Path) -> list[str]:
    """The manifest's files that hold the graph and its weights (model.onnx and its external data)."""
    from compress.artifact import read_manifest
    from serve.artifact import graph_files

    return graph_files(read_manifest(folder, verify=False))


def weight_bytes(folder: str | Path) -> int:
    from compress.artifact import read_manifest
    from serve.artifact import graph_bytes

    return graph_bytes(read_manifest(folder, verify=False))


def keeps_weights(folder: str | Path, setting: str) -> bool:
    """Whether registry.baseline_weights ``setting`` uploads this folder's weights (copy) or records them (digest)."""
    if setting != "auto":
        return setting == "copy"
    return weight_bytes(folder) <= DIGEST_ABOVE_BYTES


def _by_digest(folder: Path, staging: Path, source: dict) -> Path:
    """``folder`` without its weights, plus WEIGHTS_BY_DIGEST recording them (name, bytes, sha256 from the
    manifest) and where they came from (``source``: the checkpoint's path and digest)."""
    import json
    import shutil

    from compress.artifact import read_manifest
    from serve.artifact import WEIGHTS_BY_DIGEST

    files = read_manifest(folder, verify=False)["files"]
    weights = set(weight_files(folder))
    for p in folder.rglob("*"):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel not in weights:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, staging / rel)
    (staging / WEIGHTS_BY_DIGEST).write_text(json.dumps(
        {"weights": {f: files[f] for f in sorted(weights)}, "source": source}, indent=1))
    return staging


def register_folder(folder: str | Path, model_name: str, run_id: str, tags: dict | None = None,
                    aliases: list[str] | None = None, *, metrics: dict | None = None,
                    params: dict | None = None, weights: str = "copy", source: dict | None = None) -> Version:
    """Log the artifact folder as an MLflow logged model of the run (with the version's figures and params on the
    run) and create a model version from it.

    The files go to a logged model whose source run is ``run_id`` (``_upload``), so the run's "Logged models"
    column and the model's page link the two; the version's source is ``models:/<model id>``. On a store without
    logged models (an MLflow 2 server) they go to the run's ``artifact/`` folder instead.
    weights="digest": the graph's weight files are recorded, not uploaded (``_by_digest``; ``source`` says where
    they came from), so a large baseline costs the store kilobytes instead of a second fp32 copy. The files are
    uploaded before the version is created, so a failure leaves no half-registered version behind.
    """
    import tempfile

    from compress.artifact import read_manifest
    from serve.api.mlflow_model import write_mlmodel
    from serve.artifact import CHECKPOINT_RECORD

    client = _client()
    _log_to_run(client, run_id, metrics or {}, params or {})
    with tempfile.TemporaryDirectory(prefix="version_") as tmp:
        files = Path(tmp) / "files"
        files.mkdir()
        if weights == "digest":
            _by_digest(Path(folder), files, source or {})
            uploads = [files]
        else:
            uploads = [Path(folder)]
            manifest = read_manifest(folder, verify=False)
            # a checkpoint record has no graph to load; a draft head drafts for another model (serve.speculative)
            if manifest.get("kind") not in (CHECKPOINT_RECORD, "draft_head"):
                # an MLflow Model over the folder's own files (serve/api/mlflow_model.py): MLmodel beside them
                write_mlmodel(files, manifest, run_id)
                uploads.append(files)
        version_source = _upload(client, run_id, model_name, uploads)
    try:
        client.get_registered_model(model_name)
    except Exception:
        try:
            client.create_registered_model(model_name)
        except Exception:  # another run created it between the two calls (a remote store takes no lock)
            client.get_registered_model(model_name)
    mv = client.create_model_version(model_name, version_source, run_id=run_id,
                                     tags={k: str(v) for k, v in (tags or {}).items()})
    for alias in aliases or []:
        set_alias(model_name, alias, mv.version)
    return get_version(model_name, mv.version)


def _upload(client, run_id: str, model_name: str, folders: list[Path]) -> str:
    """Upload ``folders`` (merged) as a logged model of the run; its ``models:/<id>`` URI. A store without logged
    models gets them under the run's ``artifact/`` folder; that folder's URI."""
    try:
        lm = client.create_logged_model(client.get_run(run_id).info.experiment_id, name=model_name,
                                        source_run_id=run_id, model_type="onnx-llm")
    except Exception:  # noqa: BLE001 - an MLflow 2 tracking server: the run's artifacts, as before
        for f in folders:
            client.log_artifacts(run_id, str(f), ARTIFACT_PATH)
        return f"{client.get_run(run_id).info.artifact_uri}/{ARTIFACT_PATH}"
    try:
        for f in folders:
            client.log_model_artifacts(lm.model_id, str(f))
    except BaseException:
        client.finalize_logged_model(lm.model_id, "FAILED")
        raise
    client.finalize_logged_model(lm.model_id, "READY")
    return f"models:/{lm.model_id}"


def list_versions(model_name: str) -> list[Version]:
    found = _client().search_model_versions(f"name='{model_name}'")
    # search_model_versions leaves aliases empty; get_model_version fills them.
    return sorted((get_version(model_name, v.version) for v in found), key=lambda v: int(v.version))


def numeric(figures: dict) -> dict[str, float]:
    """The finite numbers of a dict (bools as 0/1): what MLflow can store as metrics."""
    out = {}
    for k, v in figures.items():
        if isinstance(v, (int, float)) and v == v and abs(v) != float("inf"):
            out[k] = float(v)
    return out


def _log_to_run(client, run_id: str, metrics: dict, params: dict) -> None:
    from mlflow.entities import Metric, Param

    now = int(time.time() * 1000)
    logged = dict(client.get_run(run_id).data.params) if params else {}
    ms = [Metric(k, v, now, 0) for k, v in numeric(metrics).items()]
    # A param is write-once in MLflow: a reused version keeps the params it was registered with.
    ps = [Param(k, str(v)[:500]) for k, v in params.items() if k not in logged]
    for i in range(0, max(len(ms), len(ps)), 100):
        client.log_batch(run_id, metrics=ms[i:i + 100], params=ps[i:i + 100])


def log_figures(model_name: str, version: str | int, metrics: dict, params: dict | None = None) -> None:
    """Record (newer) figures of a version as metrics of its source run, where the UI compares them (and params it
    does not have yet: a param is write-once)."""
    v = get_version(model_name, version)
    if v.run_id:
        _log_to_run(_client(), v.run_id, metrics, params or {})


def figures(model_name: str, version: str | int) -> dict[str, float]:
    """A version's figures: the latest value of every metric of its source run."""
    v = get_version(model_name, version)
    return dict(_client().get_run(v.run_id).data.metrics) if v.run_id else {}


def find_by_digest(model_name: str, artifact_sha256: str, config_hash: str | None = None) -> Version | None:
    """The oldest version registered from these exact files (and, if given, under this config hash)."""
    try:
        versions = list_versions(model_name)
    except Exception:
        return None
    return next((v for v in versions if v.tags.get("artifact_sha256") == artifact_sha256
                 and (config_hash is None or v.tags.get("config_hash", "") == str(config_hash))), None)


def find_by_content(model_name: str, content_sha256: str) -> Version | None:
    """The oldest version holding these exact files (compress.artifact.content_digest), whatever manifest
    fields or config came with them: one teacher is one baseline version across configs."""
    try:
        versions = list_versions(model_name)
    except Exception:
        return None
    return next((v for v in versions if v.tags.get("content_sha256") == content_sha256), None)


CHAMPION = _champion.CHAMPION


def set_alias(model_name: str, alias: str, version: str | int, by: str = "compressor") -> None:
    """Point ``alias`` at ``version``. Moving ``champion`` records the move (``by``) in the champion history and
    rewrites every label that names the champion (serve/registry/champion.py)."""
    if alias == CHAMPION:
        _champion.move(model_name, str(version), by)
    else:
        _client().set_registered_model_alias(model_name, alias, str(version))


def sync_champion(model_name: str, noticed_by: str) -> bool:
    """Record a hand move of ``champion`` (made in the UI) and relabel; True when there was one. Never raises: the
    labels are a view of the alias, and failing to write them must not stop a run or a rollback."""
    import logging

    try:
        return _champion.sync(model_name, noticed_by)
    except Exception as e:  # noqa: BLE001
        if "RESOURCE_DOES_NOT_EXIST" not in str(e):
            logging.getLogger(__name__).warning("could not check the champion of %s: %s", model_name, e)
        return False


def describe(model_name: str, version: str | int) -> None:
    """The version's description: what it is now (champion since / was champion, from the history) and its ``note``
    tag (the verdict, its reasons and links to the runs), so its page tells its story. Written by the one relabel of
    every version (serve/registry/champion.py), which keeps them all consistent with the alias."""
    _champion.relabel(model_name, _champion.history(model_name))


def attach_from_run(model_name: str, version: str | int, run_id: str, paths: list[str],
                    under: str = "verdict") -> list[str]:
    """Copy ``paths`` (artifacts of ``run_id``, e.g. the accept run's verdict.json and chat_by_kind.png) into the
    version's source run under ``under``, where its page's "Source run" link leads; returns what was copied
    (a path the run lacks is skipped)."""
    import tempfile

    client = _client()
    target = get_version(model_name, version).run_id
    have = {f.path for f in client.list_artifacts(run_id)}
    done = []
    with tempfile.TemporaryDirectory(prefix="attach_") as tmp:
        for p in paths:
            if p in have:
                client.log_artifact(target, client.download_artifacts(run_id, p, tmp), under)
                done.append(p)
    return done


def set_tags(model_name: str, version: str | int, tags: dict) -> None:
    client = _client()
    for k, v in tags.items():
        client.set_model_version_tag(model_name, str(version), k, str(v))


def promote(model_name: str, version: str | int, alias: str = "champion", verify: bool = True,
            by: str = "promote") -> str | None:
    """Point alias at version; returns the version it pointed at before (for rollback).

    ``verify``: first download the version and check every file against its manifest sha256, so a
    copy damaged in the artifact store after registration is never promoted.
    """
    before = version_for_alias(model_name, alias)
    v = get_version(model_name, version)
    if v.tags.get("verdict") == "rejected":
        raise RegistryError(f"version {version} of {model_name} was rejected by the acceptance gate; it cannot become {alias}")
    if verify:
        verify_version(model_name, version)
    set_alias(model_name, alias, version, by=by)
    if before is not None:
        set_tags(model_name, version, {"previous_" + alias: before.version})
    return before.version if before else None


def verify_version(model_name: str, version: str | int) -> None:
    """Download a version and check its files against the manifest; RegistryError naming the file if not."""
    import shutil
    import tempfile

    from compress.artifact import ArtifactError, read_manifest

    tmp = tempfile.mkdtemp(prefix="compressor-verify-")
    try:
        read_manifest(download(f"models:/{model_name}/{version}", tmp), verify=True)
    except ArtifactError as e:
        raise RegistryError(f"version {version} of {model_name} is damaged in the artifact store; not promoted: "
                            f"{e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def rollback(model_name: str, to_version: str | int | None = None, alias: str = "champion") -> str:
    """Move alias to a named version, or to the previous champion (the champion history's term before the current
    one, so a move made by hand in the UI is rolled back too)."""
    if alias == CHAMPION:
        sync_champion(model_name, "rollback")
    current = version_for_alias(model_name, alias)
    if to_version is None:
        if current is None:
            raise RegistryError(f"{model_name} has no {alias!r} alias to roll back")
        to_version = (_champion.previous_champion(model_name) if alias == CHAMPION else None) \
            or current.tags.get("previous_" + alias) or ""
        if not to_version:
            older = [v for v in list_versions(model_name) if int(v.version) < int(current.version)
                     and v.tags.get("verdict") != "rejected"]
            if not older:
                raise RegistryError(f"{model_name}@{alias} is version {current.version}; there is no earlier version to roll back to")
            to_version = older[-1].version
    get_version(model_name, to_version)  # raises when it does not exist
    set_alias(model_name, alias, to_version, by="rollback")
    return str(to_version)


def delete_alias(model_name: str, alias: str, by: str = "compressor") -> None:
    if alias == CHAMPION:
        _champion.remove(model_name, by)
    else:
        _client().delete_registered_model_alias(model_name, alias)
def delete_alias(model_name: str, alias: str, by: str = "compressor") -> None:
    if alias == CHAMPION:
        _champion.remove(model_name, by)
    else:
        _client().delete_registered_model_alias(model_name, alias)
