"""Task: register an artifact folder as an MLflow model version, with its figures, and set its aliases.

Idempotent. The baseline (the exported teacher) is one version per set of files (their content digest,
whatever config or manifest fields came with them): a run that exports the same files reuses it and records
its newer figures. A candidate is one version per (manifest, config): the same files judged under another
gate carry another verdict.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
from prefect import task

from compress.registry import store as registry
from compress.artifact import MANIFEST, checkpoint_digest, content_digest, read_manifest, sha256_file
from compress.sizing.disk import check_room, folder_bytes, local_artifact_dir
from serve.artifact import CHECKPOINT_RECORD
from tasks.results import Registered
from tasks.tracking import child_run


@task(name="register", retries=2, retry_delay_seconds=3)
def register_task(name: str, parent_run_id: str | None, artifact: str, aliases: list[str],
                  tags: dict, *, stage: str = "register", metrics: dict | None = None,
                  params: dict | None = None, same_config_only: bool = True, weights: str = "copy") -> Registered:
    """Register ``artifact`` as a version of the model ``name`` (registry.model_name). metrics become the version's
    figures (its source run's metrics); tags say what it is. weights: "copy" uploads
    the graph's weights, "digest" records them, "auto" decides by their size (registry.baseline_weights)."""
    folder = Path(artifact)
    read_manifest(folder, verify=True)  # a truncated or swapped file stops here, before the registry changes
    sha = sha256_file(folder / MANIFEST)
    record = read_manifest(folder, verify=False).get("kind") == CHECKPOINT_RECORD  # the checkpoint, by digest
    content = content_digest(folder)
    # looked up and created under one lock: two runs registering the same baseline at once make one version
    with registry.store_lock(f"register-{name}", mlflow.get_tracking_uri()):
        return _register(parent_run_id, folder, name=name, sha=sha, content=content, record=record,
                         aliases=aliases, tags=tags, stage=stage, metrics=metrics, params=params,
                         same_config_only=same_config_only, weights=weights)


def _register(parent_run_id, folder: Path, *, name: str, sha: str, content: str, record: bool, aliases, tags,
              stage, metrics, params, same_config_only: bool, weights: str) -> Registered:
    if same_config_only:
        found = registry.find_by_digest(name, sha, tags.get("config_hash", ""))
    else:
        found = registry.find_by_content(name, content) or registry.find_by_digest(name, sha)
    if found is None:
        keep = registry.keeps_weights(folder, weights)
        with child_run(parent_run_id, stage) as run:
            store = local_artifact_dir(mlflow.get_artifact_uri()) if mlflow.active_run() else None
            upload = folder_bytes(folder) - (0 if keep else registry.weight_bytes(folder))
            if store is not None:  # a remote store's room is its own to refuse
                check_room(f"registering {folder.name} as a version of {name}", store, upload,
                           "the registry copies the artifact's files: free the room, or point MLflow's artifact "
                           "store at a larger disk")
            run_id = run.info.run_id if run is not None else parent_run_id
            source = None
            if not keep:
                src = read_manifest(folder, verify=False).get("source_model")
                source = {"source_model": src, "checkpoint": checkpoint_digest(src) if src and Path(src).exists()
                          else None}
            found = registry.register_folder(folder, name, run_id, {**tags, "artifact_sha256": sha,
                                                                    "content_sha256": content,
                                                                    "weights": "checkpoint_record" if record
                                                                    else "copy" if keep else "digest",
                                                                    "parent_run_id": parent_run_id or ""},
                                             aliases, metrics=metrics, params=params,
                                             weights="copy" if keep else "digest", source=source)
        reused = False
    else:
        if metrics:
            registry.log_figures(name, found.version, metrics)
        for alias in aliases:
            registry.set_alias(name, alias, found.version)
        reused = True
    return Registered(name=name, version=found.version, aliases=list(aliases), source=found.source, reused=reused)
