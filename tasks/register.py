"""Task: register an artifact folder as an MLflow model version and set its aliases.

Idempotent: a folder whose manifest was registered before (same sha256) under the
same config gets its aliases moved instead of a duplicate version; the same files
judged under another config (another verdict) become a version of their own.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task

from compress import registry
from compress.artifact import MANIFEST, read_manifest, sha256_file
from compress.config import PipelineConfig
from tasks.tracking import child_run


def _existing(model_name: str, manifest_sha: str, config_hash: str) -> registry.Version | None:
    """The version registered before from these exact files under this exact config, if any."""
    try:
        versions = registry.list_versions(model_name)
    except Exception:
        return None
    return next((v for v in versions if v.tags.get("artifact_sha256") == manifest_sha
                 and v.tags.get("config_hash", "") == str(config_hash)), None)


@task(name="register", retries=2, retry_delay_seconds=3)
def register_task(cfg: PipelineConfig, parent_run_id: str | None, artifact: str, aliases: list[str],
                  tags: dict, stage: str = "register") -> dict:
    folder = Path(artifact)
    read_manifest(folder, verify=True)  # a truncated or swapped file stops here, before the registry changes
    sha = sha256_file(folder / MANIFEST)
    name = cfg.registry.model_name
    found = _existing(name, sha, tags.get("config_hash", ""))
    if found is None:
        with child_run(parent_run_id, stage) as run:
            run_id = run.info.run_id if run is not None else parent_run_id
            found = registry.register_folder(folder, name, run_id, {**tags, "artifact_sha256": sha,
                                                                    "parent_run_id": parent_run_id or ""}, aliases)
    else:
        for alias in aliases:
            registry.set_alias(name, alias, found.version)
    return {"name": name, "version": found.version, "aliases": aliases, "source": found.source}
