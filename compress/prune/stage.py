"""The pruning stage: sensitivity scan, structured and unstructured pruning of Llama-family models.

Public API (plain functions; the task layer adds Prefect and MLflow):

* ``sensitivity_scan(model, calib_blocks, cfg) -> SensitivityReport``
* ``prune_model(model, calib_blocks, cfg, sensitivity=None) -> (student, PruneReport)``
  The teacher is never modified: the student is a deep copy.
* ``unstructured_masks(model)`` / ``apply_masks(model, masks)`` for the distillation stage,
  which must re-apply the masks after each optimizer step so pruned weights stay at zero.

Method ``structured`` really shrinks the matrices and the config (see
compress/prune/structured.py for the importance scores and why); ``unstructured``
zeroes weights (compress/prune/unstructured.py); ``both`` cuts first, then zeroes.
Design notes and measurements on SmolLM2-135M: docs/pruning.md.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from compress.prune.structured import (
    SUPPORTED_MODEL_TYPES,
    StructuredPlan,
    UnsupportedArchitectureError,
    apply_plan,
    check_supported,
    collect_importance,
    count_params,
    decoder_layers,
    make_plan,
    mask_plan,
    normalize_layers,
)
from compress.prune.reconstruct import ReconstructionReport, reconstruct
from compress.prune.unstructured import (
    Masks,
    apply_masks,
    compute_masks,
    input_norms,
    sparsity_by_layer,
    unstructured_masks,
)
from compress.prune.sensitivity import SensitivityReport, sensitivity_scan

log = logging.getLogger(__name__)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "PruneReport",
    "SensitivityReport",
    "StructuredPlan",
    "UnsupportedArchitectureError",
    "apply_masks",
    "mask_plan",
    "prune_model",
    "sensitivity_scan",
    "unstructured_masks",
]


def _shape(model) -> dict[str, int]:
    c = model.config
    return {
        "num_hidden_layers": int(c.num_hidden_layers),
        "num_attention_heads": int(c.num_attention_heads),
        "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads),
        "intermediate_size": int(c.intermediate_size),
    }


@dataclass
class PruneReport:
    method: str
    params_before: int
    params_after: int
    nonembedding_params_before: int
    nonembedding_params_after: int
    shape_before: dict[str, int]
    shape_after: dict[str, int]
    seconds: float
    importance: str | None = None
    plan: StructuredPlan | None = None
    reconstruction: ReconstructionReport | None = None  # prune.reconstruct: the re-fit's per-layer errors
    # unstructured
    target_sparsity: float = 0.0
    pattern: str = "none"
    allocation: str | None = None
    score: str | None = None  # magnitude | wanda
    sparsity: float = 0.0  # zeros / weights over the pruned matrices
    layer_sparsity: dict[int, float] = field(default_factory=dict)  # all decoder linears, protected included
    matrix_sparsity: dict[str, float] = field(default_factory=dict)
    masks: Masks | None = None  # keep-masks (True = kept), keyed by the student's parameter names

    @property
    def removed(self) -> dict:
        """What went: layers (original indices), KV groups and neurons per original layer."""
        return self.plan.to_dict() if self.plan is not None else {}

    @property
    def teacher_layers(self) -> list[int] | None:
        """The teacher layer each student layer came from (distill.hidden_weight's map); None = every layer kept."""
        return self.plan.kept_layers if self.plan is not None and self.plan.drop_layers else None

    @property
    def nonembedding_removed_fraction(self) -> float:
        return 1 - self.nonembedding_params_after / max(self.nonembedding_params_before, 1)

    def metrics(self) -> dict[str, float]:
        m = {
            "prune_params_before": float(self.params_before),
            "prune_params_after": float(self.params_after),
            "prune_params_ratio": self.params_after / max(self.params_before, 1),
            "prune_nonemb_params_before": float(self.nonembedding_params_before),
            "prune_nonemb_params_after": float(self.nonembedding_params_after),
            "prune_nonemb_removed_frac": float(self.nonembedding_removed_fraction),
            "prune_seconds": float(self.seconds),
        }
        for k, v in self.shape_before.items():
            m[f"prune_{k}_before"] = float(v)
        for k, v in self.shape_after.items():
            m[f"prune_{k}_after"] = float(v)
        if self.reconstruction is not None:
            m.update(self.reconstruction.metrics())
        if self.method in ("unstructured", "both"):
            m["prune_target_sparsity"] = float(self.target_sparsity)
            m["prune_sparsity"] = float(self.sparsity)
            for i, s in self.layer_sparsity.items():
                m[f"prune_sparsity_layer_{i:02d}"] = float(s)
        return m

    def to_dict(self) -> dict:
        """JSON-serialisable summary (masks left out)."""
        return {
            "method": self.method,
            "importance": self.importance,
            "params": [self.params_before, self.params_after],
            "nonembedding_params": [self.nonembedding_params_before, self.nonembedding_params_after],
            "shape_before": self.shape_before,
            "shape_after": self.shape_after,
            "removed": self.removed,
            "target_sparsity": self.target_sparsity,
            "pattern": self.pattern,
            "allocation": self.allocation,
            "score": self.score,
            "sparsity": self.sparsity,
            "layer_sparsity": {str(k): v for k, v in self.layer_sparsity.items()},
            "matrix_sparsity": self.matrix_sparsity,
            "seconds": self.seconds,
            "reconstruction": self.reconstruction.to_dict() if self.reconstruction is not None else None,
        }


def _check_cfg(cfg) -> None:
    if cfg.method in ("unstructured", "both") and cfg.pattern == "2:4" and abs(cfg.sparsity - 0.5) > 1e-9:
        raise ValueError(
            f"prune.pattern '2:4' makes every matrix exactly 50% sparse, but prune.sparsity is {cfg.sparsity}; "
            f"set prune.sparsity=0.5 or prune.pattern=none"
        )


def _layer_scores_from(sens: SensitivityReport | None, num_layers: int) -> dict[int, float] | None:
    if sens is None or "layer" not in sens.groups() or sens.num_layers != num_layers:
        return None
    return sens.deltas("layer")


def _unit_deltas(sens: SensitivityReport, plan: StructuredPlan | None) -> dict[tuple[int, str], float]:
    """(new layer index, attn|mlp) -> calib loss increase, remapped past dropped layers.

    Uses the attn_weights / mlp_weights rows; a report with only whole-layer rows gives each
    layer's delta to both of its units.
    """
    old_to_new = {old: new for new, old in enumerate(plan.kept_layers)} if plan else None
    groups = set(sens.groups())
    if groups & {"attn_weights", "mlp_weights"}:
        kinds = {"attn_weights": ("attn",), "mlp_weights": ("mlp",)}
    elif "layer" in groups:
        kinds = {"layer": ("attn", "mlp")}
    else:
        raise ValueError("prune.allocation 'sensitivity': the sensitivity report has no attn/mlp/layer rows "
                         "to allocate from")
    out = {}
    for r in sens.rows:
        i = r["layer"] if old_to_new is None else old_to_new.get(r["layer"])
        if i is None or r["group"] not in kinds:
            continue
        for k in kinds[r["group"]]:
            out[(i, k)] = r["delta"]
    return out


def prune_model(model, calib_blocks: np.ndarray, cfg, sensitivity: SensitivityReport | None = None,
                batch_size: int = 4) -> tuple[torch.nn.Module, PruneReport]:
    """Return (a pruned deep copy of model, what was done). cfg is a PruneConfig."""
    check_supported(model)
    _check_cfg(cfg)
    t0 = time.perf_counter()
    before = count_params(model)
    shape_before = _shape(model)
    student = copy.deepcopy(model).eval()
    L = len(decoder_layers(student))
    protected = normalize_layers(cfg.protected_layers, L)
    report = PruneReport(cfg.method, before["total"], before["total"], before["non_embedding"], before["non_embedding"],
                         shape_before, shape_before, 0.0)

    if cfg.method in ("structured", "both") and max(cfg.mlp_ratio, cfg.head_ratio, cfg.layer_ratio) > 0:
        layer_scores = _layer_scores_from(sensitivity, L)
        imp = collect_importance(student, np.asarray(calib_blocks), cfg.importance, batch_size,
                                 layer_scores=cfg.layer_ratio > 0 and layer_scores is None)
        plan = make_plan(student, imp, cfg.mlp_ratio, cfg.head_ratio, cfg.layer_ratio, protected, layer_scores)
        if cfg.head_ratio > 0 and not plan.keep_groups:
            log.warning("prune.head_ratio %s removes no KV group of %d (rounds to 0); no heads pruned",
                        cfg.head_ratio, plan.num_kv_heads)
        apply_plan(student, plan)
        if cfg.reconstruct:
            report.reconstruction = reconstruct(model, student, plan, calib_blocks, cfg.reconstruct_ridge,
                                                cfg.reconstruct_inputs, batch_size)
        report.plan = plan
        report.importance = cfg.importance
        # Protected indices refer to the original layers; carry them to the new numbering.
        new_idx = {old: new for new, old in enumerate(plan.kept_layers)}
        protected = {new_idx[i] for i in protected if i in new_idx}

    if cfg.method in ("unstructured", "both") and (cfg.sparsity > 0 or cfg.pattern == "2:4"):
        deltas = None
        if cfg.allocation == "sensitivity" and cfg.pattern == "none":
            if sensitivity is None:
                if not cfg.sensitivity:
                    raise ValueError("prune.allocation 'sensitivity' needs prune.sensitivity=true "
                                     "or a sensitivity report passed in")
                sensitivity = sensitivity_scan(model, calib_blocks, cfg, groups=["attn_weights", "mlp_weights"])
            deltas = _unit_deltas(sensitivity, report.plan)
        norms = None
        if cfg.unstructured_score == "wanda":
            norms = input_norms(student, np.asarray(calib_blocks), batch_size)
        masks = compute_masks(student, cfg.sparsity, cfg.pattern, cfg.allocation, protected, deltas, norms)
        apply_masks(student, masks)
        report.masks = masks
        report.target_sparsity = 0.5 if cfg.pattern == "2:4" else cfg.sparsity
        report.pattern = cfg.pattern
        report.allocation = cfg.allocation
        report.score = cfg.unstructured_score
        report.layer_sparsity, report.matrix_sparsity = sparsity_by_layer(student)
        zeros = sum(int((student.get_parameter(n) == 0).sum()) for n in masks)
        report.sparsity = zeros / max(sum(m.numel() for m in masks.values()), 1)

    after = count_params(student)
    report.params_after, report.nonembedding_params_after = after["total"], after["non_embedding"]
    report.shape_after = _shape(student)
    report.seconds = time.perf_counter() - t0
    return student, report
