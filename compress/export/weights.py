"""export.weights: whether the export writes the fp32 graph or the weight-only INT8 one straight from the checkpoint.

From 1B parameters (compress.memory.CHECKPOINT_FROM_PARAMS, where the accept stage's reference becomes the checkpoint
too) an fp32 graph is 4 bytes a parameter in memory, on disk and in the registry that nothing needs: the INT8 graph is
written tensor by tensor from the bf16 weights (gqa.build_gqa_model's int8), golden and acceptance judge it against
the checkpoint as stored, and the baseline version records the checkpoint by digest (docs/models.md#large-models).
"""

from __future__ import annotations

from compress.memory import CHECKPOINT_FROM_PARAMS

# manifest["quantization"]["written_from"] of an INT8 graph the export wrote (not the quantize stage)
FROM_CHECKPOINT = "checkpoint"


def fp32_needed_by(cfg) -> str | None:
    """What in the PipelineConfig ``cfg`` starts from the fp32 graph (so auto keeps float32), or None."""
    if cfg.prune.enabled or cfg.distill.enabled:
        return "pruning or distillation starts from the fp32 model"
    if cfg.quantize.enabled and cfg.quantize.target == "cuda":
        return "quantize.target cuda builds the fp16 CUDA form from the fp32 graph"
    if cfg.quantize.enabled and cfg.quantize.method in ("static", "dynamic"):
        return f"quantize.method {cfg.quantize.method} calibrates the fp32 graph"
    if cfg.accept.reference == "artifact":
        return "accept.reference artifact judges against the fp32 graph"
    if cfg.export.exporter in ("dynamo", "torchscript"):
        return f"export.exporter {cfg.export.exporter} writes fp32 only"
    return None


def resolve_weights(setting: str, params: int, fp32_needed: str | None) -> tuple[str, str]:
    """(float32 | int8, why) for export.weights ``setting``; ``fp32_needed``: fp32_needed_by's reason, if any."""
    if setting != "auto":
        return setting, f"export.weights: {setting}"
    if fp32_needed:
        return "float32", f"export.weights auto: float32, {fp32_needed}"
    if params >= CHECKPOINT_FROM_PARAMS:
        return "int8", (f"export.weights auto: int8 written from the checkpoint ({params / 1e9:.2f}B parameters, from "
                        f"{CHECKPOINT_FROM_PARAMS / 1e9:g}B no fp32 graph is written)")
    return "float32", f"export.weights auto: float32 ({params / 1e6:.0f}M parameters, below {CHECKPOINT_FROM_PARAMS / 1e9:g}B)"


def written_int8(manifest: dict) -> bool:
    """Whether an artifact is the INT8 graph the export wrote from the checkpoint (export.weights int8)."""
    return (manifest.get("quantization") or {}).get("written_from") == FROM_CHECKPOINT
