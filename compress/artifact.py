"""Writing an artifact folder's manifest.json (the reading side is serve/artifact.py, the server's).

Every file in the folder is listed with its size and sha256 so a truncated or swapped file is
caught before anything is promoted or served.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

# Re-exported: the pipeline reads and verifies manifests through this module too.
from serve.artifact import MANIFEST, MANIFEST_VERSION, ArtifactError, read_manifest, sha256_file, verify_files

__all__ = ["MANIFEST", "MANIFEST_VERSION", "ArtifactError", "checkpoint_digest", "checkpoint_files", "content_digest",
           "write_checkpoint_record",
           "io_names", "read_manifest", "sha256_file", "verify_files", "write_manifest"]


def io_names(num_layers: int) -> dict[str, list[str]]:
    past = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return {
        "inputs": ["input_ids", "attention_mask", "position_ids", *past],
        "outputs": ["logits", *present],
    }


def content_digest(folder: str | Path) -> str:
    """sha256 of what the folder holds: every file's name and sha256 as its manifest lists them, not the
    manifest's other fields (config hash, export seconds). The same weights and tokenizer exported under two
    configs have one content digest and two manifest digests (the registry's baseline identity)."""
    manifest = read_manifest(folder)
    listing = {name: f["sha256"] for name, f in sorted(manifest.get("files", {}).items())}
    if "checkpoint" in manifest:  # a checkpoint record: what it stands for is the checkpoint's files
        listing["checkpoint"] = manifest["checkpoint"]["sha256"]
    listing = json.dumps(listing, sort_keys=True)
    return hashlib.sha256(listing.encode()).hexdigest()


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """A source checkpoint's weight and config files (a folder's), or the one file it is (a .gguf)."""
    path = Path(model_dir)
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin", ".gguf", ".json")) \
        if path.is_dir() else []


def checkpoint_digest(model_dir: str | Path) -> dict:
    """Where a source checkpoint is and what it holds: its weight and config files' sha256, and one sha256 over them
    (what a baseline registered by digest records instead of a copy of its weights)."""
    path = Path(model_dir)
    files = {p.name: sha256_file(p) for p in checkpoint_files(path)}
    listing = json.dumps(files, sort_keys=True)
    return {"path": str(path.resolve()), "files": files, "sha256": hashlib.sha256(listing.encode()).hexdigest()}


# A checkpoint's files a record copies: what says what the model is, never its weights.
RECORD_MAX_BYTES = 64 * 2**20


def write_checkpoint_record(model_dir: str | Path, out_dir: str | Path, fields: dict[str, Any]) -> dict:
    """A folder that stands for a source checkpoint without its weights: its config, generation config and tokenizer
    files, and a manifest (kind CHECKPOINT_RECORD) with ``fields`` and the checkpoint's digest (checkpoint_digest).
    The baseline version of a run whose export wrote INT8 from the checkpoint (export.weights int8)."""
    import shutil

    from serve.artifact import CHECKPOINT_RECORD

    src, out = Path(model_dir), Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for p in sorted(src.iterdir()) if src.is_dir() else []:
        if p.is_file() and p.stat().st_size <= RECORD_MAX_BYTES \
                and not p.name.endswith((".safetensors", ".bin", ".gguf", ".pt", ".pth")):
            shutil.copy2(p, out / p.name)
    return write_manifest(out, {"kind": CHECKPOINT_RECORD, "source_model": str(src),
                                "checkpoint": checkpoint_digest(src), **fields})


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
