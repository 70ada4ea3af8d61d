"""Distillation checkpoints: the resumable training state and the best student, in the run's work folder.

Work folder layout (safetensors and JSON only, nothing pickled)::

    last/student.safetensors     student weights at the last checkpoint
    last/optimizer.safetensors   optimizer tensors (Adam moments, step) and the torch RNG state(s)
    last/state.json              step, seconds, history, best so far, optimizer param groups, ...
    best/                        the best student as a Hugging Face folder (save_pretrained) + best.json
    report.json                  the DistillReport of a finished run (a re-run returns it at once)

A checkpoint carries a fingerprint of everything that shapes the trajectory (config, student
shapes, data), so a work folder reused with another config starts afresh instead of resuming a
run that is not its own. Folders are filled beside their final place and renamed in, so a kill
at any moment leaves a complete checkpoint (last/ or last.old/) to resume from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from compress.corpus.splits import DataSplits
from compress.distill.report import DistillError

log = logging.getLogger(__name__)

LAST, BEST, REPORT = "last", "best", "report.json"
# Config keys that do not change the training trajectory: a checkpoint stays valid across them.
# The rank count is one of them: ranks split a fixed global batch, so the trajectory does not depend on it.
_RESUME_INDEPENDENT = ("enabled", "max_minutes", "checkpoint_every", "device", "amp", "early_stop_patience",
                       "nproc_per_node", "fused_loss", "compile")


@dataclass
class TrainState:
    """Everything besides weights and optimizer tensors that a resumed run needs to continue exactly."""

    fingerprint: str
    step: int = 0
    seconds: float = 0.0
    train_seconds: float = 0.0
    best_step: int = 0
    best_value: float = math.inf
    bad_evals: int = 0
    before: dict = field(default_factory=dict)
    best_eval: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    stop_reason: str = ""
    plan: dict = field(default_factory=dict)  # a token budget's plan (compress/distill/plan.py), made before step 1


def run_fingerprint(student, splits: DataSplits, cfg) -> str:
    """What a checkpoint must match to be resumed: the trajectory-shaping config, the student's shapes, the data."""
    h = hashlib.sha256()
    h.update(json.dumps(cfg.model_dump(mode="json", exclude=set(_RESUME_INDEPENDENT)), sort_keys=True).encode())
    h.update(json.dumps([(n, list(p.shape)) for n, p in student.named_parameters()]).encode())
    for arr in (splits.train, splits.selection):
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()[:16]


def _write_dir(final: Path, fill: Callable[[Path], None]) -> None:
    """Write a folder atomically: fill a temporary sibling, then swap it in."""
    tmp = final.with_name(final.name + ".tmp")
    old = final.with_name(final.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _optimizer_tensors(opt, scaler) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"state.{idx}.{k}"] = v.detach().contiguous().cpu()
            else:
                scalars[f"{idx}.{k}"] = v
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    meta = {"param_groups": sd["param_groups"], "scalars": scalars, "scaler": scaler.state_dict() if scaler else None}
    return tensors, meta


def _load_optimizer(opt, scaler, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for key, v in tensors.items():
        if key.startswith("state."):
            _, idx, k = key.split(".", 2)
            state.setdefault(int(idx), {})[k] = v
    for key, v in meta["scalars"].items():
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = v
    groups = meta["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    opt.load_state_dict({"state": state, "param_groups": groups})
    if scaler is not None and meta.get("scaler"):
        scaler.load_state_dict(meta["scaler"])
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])


def save_last(workdir: Path, student, opt, scaler, state: TrainState) -> None:
    """Student weights, optimizer tensors, RNG state(s) and `state` into last/."""
    tensors, meta = _optimizer_tensors(opt, scaler)

    def fill(d: Path) -> None:
        save_model(student, str(d / "student.safetensors"))
        save_file(tensors, str(d / "optimizer.safetensors"))
        (d / "state.json").write_text(json.dumps({"state": asdict(state), "optimizer": meta}))

    _write_dir(workdir / LAST, fill)


def load_last(workdir: Path, fingerprint: str, student, opt, scaler, may_delete: bool = True) -> TrainState | None:
    """Restore student, optimizer and RNG from last/ and return its state; None to start afresh.

    A checkpoint with another fingerprint is deleted with best/ and report.json (when may_delete).
    """
    d = workdir / LAST
    if not (d / "state.json").is_file():
        d = workdir / (LAST + ".old")  # a crash between the two renames of _write_dir
        if not (d / "state.json").is_file():
            return None
    saved = json.loads((d / "state.json").read_text())
    state = TrainState(**saved["state"])
    if state.fingerprint != fingerprint:
        if not may_delete:  # another rank (rank 0) clears the folder
            return None
        log.warning("distill: the checkpoint in %s is for another config, student or data; starting afresh", workdir)
        for name in (LAST, LAST + ".old", BEST, REPORT):
            p = workdir / name
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return None
    load_model(student, str(d / "student.safetensors"))
    _load_optimizer(opt, scaler, load_file(str(d / "optimizer.safetensors")), saved["optimizer"])
    return state


def save_best(workdir: Path, student, state: TrainState) -> None:
    """The student as a Hugging Face folder into best/, with the step and eval that made it best."""
    from transformers.utils import logging as hf_logging

    def fill(d: Path) -> None:
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # one "Writing model shards" bar per eval is noise
        try:
            student.save_pretrained(d)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        (d / "best.json").write_text(json.dumps({"step": state.best_step, "eval": state.best_eval}))

    _write_dir(workdir / BEST, fill)


def best_step_on_disk(workdir: Path) -> int | None:
    p = workdir / BEST / "best.json"
    return json.loads(p.read_text())["step"] if p.is_file() else None


def load_best(student, workdir: str | Path) -> None:
    """Load the best checkpoint's weights of ``workdir`` into ``student`` (same architecture)."""
    sd = load_file(str(Path(workdir) / BEST / "model.safetensors"))
    missing, unexpected = student.load_state_dict(sd, strict=False)
    tied = {"lm_head.weight"} if getattr(student.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        # Some families are saved under their original checkpoint names (GPT-NeoX: lm_head -> embed_out);
        # from_pretrained maps them back.
        saved = type(student).from_pretrained(str(Path(workdir) / BEST), dtype=next(student.parameters()).dtype)
        missing, unexpected = student.load_state_dict(saved.state_dict(), strict=False)
    if unexpected or set(missing) - tied:
        raise DistillError(f"best checkpoint in {workdir} does not fit the student: missing {missing}, unexpected {unexpected}")
