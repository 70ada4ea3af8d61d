"""The pruning stage: sensitivity scan, structured and unstructured pruning of Llama-family models.

Entry points (lazy: importing this package imports no torch):

* ``sensitivity_scan(model, calib_blocks, cfg) -> SensitivityReport`` (sensitivity.py);
* ``prune_model(model, calib_blocks, cfg, sensitivity=None) -> (student, PruneReport)`` (stage.py); the teacher is
  never modified;
* ``unstructured_masks(model)`` / ``apply_masks(model, masks)`` (unstructured.py) for the distillation stage;
* ``SUPPORTED_MODEL_TYPES``, ``UnsupportedArchitectureError``, ``StructuredPlan``, ``mask_plan`` (structured.py).

Beside them: structured.py (MLP neurons, KV-head groups, layers), unstructured.py (magnitude / Wanda, 2:4) and
reconstruct.py (least-squares re-fit of o_proj / down_proj after a structured cut). docs/pruning.md.
"""

from compress._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "stage": ["PruneReport", "prune_model"],
    "sensitivity": ["SensitivityReport", "sensitivity_scan"],
    "structured": ["SUPPORTED_MODEL_TYPES", "StructuredPlan", "UnsupportedArchitectureError", "mask_plan"],
    "unstructured": ["apply_masks", "unstructured_masks"],
})
