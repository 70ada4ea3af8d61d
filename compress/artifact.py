"""The artifact folder and its manifest.json: the contract between pipeline and server.

Standard library only, because the server (which never imports torch) reads it too.
Every file in the folder is listed with its sha256 so a truncated or swapped
file is caught before anything is promoted or served.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


class ArtifactError(ValueError):
    """An artifact folder that is incomplete or corrupt."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def io_names(num_layers: int) -> dict[str, list[str]]:
    past = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return {
        "inputs": ["input_ids", "attention_mask", "position_ids", *past],
        "outputs": ["logits", *present],
    }


def write_manifest(folder: str | Path, fields: dict[str, Any]) -> dict:
    """Write manifest.json listing every other file of the folder with its size and sha256."""
    folder = Path(folder)
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel = p.relative_to(folder).as_posix()
            files[rel] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    manifest = {"manifest_version": MANIFEST_VERSION, **fields, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def read_manifest(folder: str | Path, verify: bool = True) -> dict:
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{folder}: no {MANIFEST}; this is not an artifact folder written by the pipeline")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: not valid JSON ({e})") from None
    if verify:
        verify_files(folder, manifest)
    return manifest


def verify_files(folder: Path, manifest: dict) -> None:
    for rel, meta in manifest.get("files", {}).items():
        p = folder / rel
        if not p.is_file():
            raise ArtifactError(f"{folder}: {rel} listed in the manifest is missing")
        size = p.stat().st_size
        if size != meta["bytes"]:
            raise ArtifactError(f"{folder}: {rel} has {size} bytes, the manifest says {meta['bytes']} (truncated or replaced)")
        if sha256_file(p) != meta["sha256"]:
            raise ArtifactError(f"{folder}: {rel} does not match its sha256 in the manifest (corrupt or replaced)")
