"""The artifact folder's manifest.json, as the server reads it: the contract between pipeline and server.

The server owns the reading side (format constants, read, sha256 verify); compress/artifact.py
writes manifests against these same constants. Standard library only. Every file in the folder is
listed with its sha256 so a truncated or swapped file is caught before anything is promoted or served.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

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


def graph_files(manifest: dict) -> list[str]:
    """The manifest's files that hold the graph and its weights (model.onnx and its external data)."""
    onnx = manifest.get("onnx_file", "model.onnx")
    return sorted(f for f in manifest.get("files", {}) if f.startswith(onnx))


def graph_bytes(manifest: dict) -> int:
    """Bytes of graph_files, as the manifest lists them."""
    return sum(manifest["files"][f]["bytes"] for f in graph_files(manifest))


# manifest["kind"] of a registered checkpoint record (compress.artifact.write_checkpoint_record): the source model by
# digest, the baseline of a run whose export wrote INT8 (export.weights int8); no graph to serve.
CHECKPOINT_RECORD = "checkpoint_record"


def refuse_record(folder: str | Path, manifest: dict) -> None:
    """A clear refusal for a checkpoint record where a servable artifact is wanted."""
    if manifest.get("kind") == CHECKPOINT_RECORD:
        src = manifest.get("source_model", "the source checkpoint")
        raise ArtifactError(f"{folder}: this version records the source checkpoint {src} by digest (the baseline of a "
                            f"run whose export wrote INT8 straight from it); it has no graph to serve: serve a "
                            f"candidate version, or export the checkpoint with export.weights float32")


# A registered version whose weights are recorded, not copied (compress/registry/store.py register_folder weights="digest").
WEIGHTS_BY_DIGEST = "weights_by_digest.json"


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
            if (folder / WEIGHTS_BY_DIGEST).is_file():
                raise ArtifactError(f"{folder}: this version records its weights by digest only ({WEIGHTS_BY_DIGEST}: "
                                    f"the baseline of a large model, kept without its fp32 copy); serve a candidate "
                                    f"version, or export {manifest.get('source_model', 'the source checkpoint')} again")
            raise ArtifactError(f"{folder}: {rel} listed in the manifest is missing")
        size = p.stat().st_size
        if size != meta["bytes"]:
            raise ArtifactError(f"{folder}: {rel} has {size} bytes, the manifest says {meta['bytes']} (truncated or replaced)")
        if sha256_file(p) != meta["sha256"]:
            raise ArtifactError(f"{folder}: {rel} does not match its sha256 in the manifest (corrupt or replaced)")
