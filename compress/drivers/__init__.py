"""Offline language-model drivers: one interface over an exported decoder graph, one driver per attention layout.

Entry points: ``load_lm(artifact_dir)`` (the driver an artifact's manifest asks for), ``lm_for_model(model,
manifest)`` (the same over an in-memory graph), ``lm_for_session(session, manifest)`` (over a loaded session),
``LanguageModelDriver`` (base.py: the interface and ``greedy``, written once), ``OnnxLM`` (standard.py: layout
``standard``, past in / present out) and ``GqaLM`` (gqa.py: layout ``gqa``, KV in place). The drivers import
base.py and nothing here, so this loader is the only module that knows them all (no import circle;
tests/test_layout.py).
"""

from __future__ import annotations

from pathlib import Path

from compress.artifact import read_manifest
from compress.drivers.base import LanguageModelDriver, Past, greedy_token
from compress.drivers.gqa import GqaLM
from compress.drivers.standard import OnnxLM

__all__ = ["GqaLM", "LanguageModelDriver", "OnnxLM", "Past", "greedy_token", "lm_for_model", "lm_for_session",
           "load_lm"]

DRIVERS: dict[str, type[LanguageModelDriver]] = {OnnxLM.layout: OnnxLM, GqaLM.layout: GqaLM}


def _driver_class(manifest: dict, where) -> type[LanguageModelDriver]:
    layout = manifest.get("attention_layout", "standard")
    if layout not in DRIVERS:
        raise ValueError(f"{where}: attention_layout {layout!r} has no offline driver (have {', '.join(map(repr, DRIVERS))})")
    return DRIVERS[layout]


def load_lm(artifact_dir: str | Path, threads: int | None = None, verify: bool = True) -> LanguageModelDriver:
    """The driver matching the artifact's attention layout (OnnxLM for 'standard', GqaLM for 'gqa')."""
    return _driver_class(read_manifest(artifact_dir, verify=False), artifact_dir)(artifact_dir, threads, verify)


def lm_for_session(session, manifest: dict, folder: str | Path | None = None) -> LanguageModelDriver:
    """The driver for an already loaded session of an artifact laid out as ``manifest`` says."""
    return _driver_class(manifest, folder or "session").from_session(session, manifest, folder)


def lm_for_model(model, manifest: dict, threads: int | None = None) -> LanguageModelDriver:
    """The driver for an in-memory graph laid out as ``manifest`` says."""
    return _driver_class(manifest, "model").from_model(model, manifest, threads)
