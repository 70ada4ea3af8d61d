"""How much memory each stage needs for a model of a given shape, and the refusal when a stage cannot fit.

The formulas (docs/models.md#large-models states them and checks them against measured runs), for P parameters,
an embedding of V x h and a process overhead O (Python, torch, onnxruntime, Prefect, MLflow; about 1.5 GiB):

* load: the checkpoint as stored, bf16: 2P;
* export (gqa builder): the bf16 model plus one fp32 tensor and its transpose at a time: 2P + 8Vh;
* golden: the fp32 torch model (4P), then (not at the same time) the fp32 ONNX session, which ONNX Runtime holds
  in 1.13 x its weights: 4.5P;
* golden of an INT8 graph written from the checkpoint (export.weights int8): the checkpoint as stored (2P), then its
  INT8 session (about 1.1P): 2P;
* quantize: one fp32 ONNX session at a time (calibration, the reference's evaluation; the candidate is scored
  after the reference's logits went to disk, compress/evaluate/onnx_eval.py): 4.5P, plus a batch of logits;
* accept: the same below 1B parameters; from 1B (accept.reference: auto) the reference is the bf16 checkpoint,
  its head widened to fp32 a few rows at a time (compress/evaluate/checkpoint_ref.py: 2P), and apart from it the
  INT8 candidate, on the evaluation engine for the chat set (its weights 1.2P, a 1 GiB KV budget and its session's
  buffers: 1.2P + 2 GiB): the larger of the two, plus a batch of logits;
* pruning: teacher and student in fp32 side by side: 8P, plus calibration activations;
* distillation: the fp32 teacher (4P) and a trained fp32 student with its gradient and Adam's two moments
  (16P): 20P, plus activations.

Every stage adds the logits of a batch (batch x block x V x 4 bytes, a few of them alive at once) and O.
``check_fits`` turns an estimate above the memory this machine has into a ``MemoryBudgetError`` that gives the
numbers and the way out (a GPU for distillation, a smaller model or a larger machine).
"""

from __future__ import annotations

from dataclasses import dataclass

from serve.kv.budget import available_bytes

GIB = 2**30
# interpreter, torch, transformers, onnxruntime, Prefect and MLflow in the pipeline's process: about 1.5 GiB measured
OVERHEAD = 1.5 * GIB
# ONNX Runtime's CPU session of an fp32 graph holds 1.13 x its weights (13.5 GiB for the 3B's 12.0, measured alone)
SESSION = 1.13
LOGIT_COPIES = 3  # logits of one batch: the session's output, the reference's, one row's float64 temporaries
CHECKPOINT_FROM_PARAMS = 1_000_000_000  # compress/evaluate/checkpoint_ref.py's: the accept stage's bf16 reference
INT8_BYTES = 1.2  # weight-only INT8 graph per parameter, scales and the 8-bit embedding included (1B 1.19, 3B 1.17)
# The candidate's evaluation engine beside its weights: compress/evaluate/generate.py's KV_BUDGET_MB (1 GiB) and its
# session's buffers for the chat set's rows (measured over weights and KV: 1.8 GiB on the 1B, 1.5 on the 3B)
ENGINE_EXTRA = 2 * GIB


class MemoryBudgetError(RuntimeError):
    """A stage that would need more memory than the machine has, with the numbers and what to do instead."""


@dataclass(frozen=True)
class Shape:
    params: int
    vocab: int
    hidden: int
    tied: bool = True

    @classmethod
    def of_config(cls, config) -> "Shape":
        """From a transformers config (the parameter count is computed, not read)."""
        h, inter, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        d = getattr(config, "head_dim", None) or h // heads
        attn = h * heads * d * 2 + h * kv * d * 2
        mlp = 3 * h * inter
        if config.model_type == "qwen2":  # q/k/v biases
            attn += heads * d + 2 * kv * d
        tied = bool(getattr(config, "tie_word_embeddings", False))
        emb = config.vocab_size * h * (1 if tied else 2)
        return cls(L * (attn + mlp + 2 * h) + emb + h, config.vocab_size, h, tied)

    @classmethod
    def of_manifest(cls, manifest: dict) -> "Shape":
        """From an artifact's manifest.json (num_parameters, vocab_size, hidden_size)."""
        return cls(int(manifest["num_parameters"]), int(manifest["vocab_size"]), int(manifest["hidden_size"]))


def stage_bytes(shape: Shape, batch: int = 4, block: int = 128) -> dict[str, float]:
    """Estimated peak resident bytes of each stage's process (formulas in the module docstring)."""
    P, Vh = shape.params, shape.vocab * shape.hidden
    logits = LOGIT_COPIES * batch * block * shape.vocab * 4
    return {
        "build": 2 * P + 4 * Vh + OVERHEAD,
        "load": 2 * P + OVERHEAD,
        "export": 2 * P + 8 * Vh + OVERHEAD,
        "golden": SESSION * 4 * P + OVERHEAD,
        "golden_int8": 2 * P + 2 * Vh + OVERHEAD,
        "quantize": SESSION * 4 * P + logits + OVERHEAD,
        "accept": accept_bytes(shape, P >= CHECKPOINT_FROM_PARAMS, batch, block),
        "prune": 8 * P + logits + OVERHEAD,
        "distill": 20 * P + logits + OVERHEAD,
    }


def accept_bytes(shape: Shape, checkpoint: bool, batch: int = 4, block: int = 128) -> float:
    """The accept stage's peak: the reference (the bf16 checkpoint, or the fp32 graph's session) or, apart from it,
    the INT8 candidate on the evaluation engine, whichever is larger, plus a batch of logits."""
    P = shape.params
    logits = LOGIT_COPIES * batch * block * shape.vocab * 4
    return (max(2 * P, INT8_BYTES * P + ENGINE_EXTRA) if checkpoint else SESSION * 4 * P) + logits + OVERHEAD


def estimate_for_shape(name: str) -> dict:
    """Estimates (GiB) for one of compress/sizing/shapes.py's SHAPES, with the weights' sizes."""
    from compress.sizing.shapes import shape_config

    s = Shape.of_config(shape_config(name))
    est = stage_bytes(s)
    # configs/large.yaml's path: from CHECKPOINT_FROM_PARAMS the export writes INT8 (export.weights auto), so golden
    # is golden_int8's and there is no quantize stage; below it, the fp32 graph through golden and quantize
    fp32_path = ("load", "export", "golden", "quantize", "accept")
    path = ("load", "export", "golden_int8", "accept") if s.params >= CHECKPOINT_FROM_PARAMS else fp32_path
    return {"params": s.params, "fp32_gib": round(4 * s.params / GIB, 2), "bf16_gib": round(2 * s.params / GIB, 2),
            "stages": {k: round(v / GIB, 1) for k, v in est.items()},
            "pipeline_gib": round(max(est[k] for k in path) / GIB, 1),
            "pipeline_fp32_graph_gib": round(max(est[k] for k in fp32_path) / GIB, 1)}


def check_fits(stage: str, need: float, fix: str, available: int | None = None) -> None:
    """Raise MemoryBudgetError when ``need`` bytes are more than the machine has free now."""
    have = available_bytes() if available is None else available
    if need > have:
        raise MemoryBudgetError(
            f"{stage} on the CPU needs about {need / GIB:.1f} GiB of memory for this model and {have / GIB:.1f} GiB "
            f"are free ({fix})")


# What each evaluation stage holds, and the way out when it does not fit, for check_stage_memory.
STAGE_HOLDS = {
    "golden": ("the fp32 torch model, then the fp32 ONNX session (4.5 bytes a parameter)",
               "set export.weights=int8 to check the INT8 graph against the checkpoint as stored"),
    "golden_int8": ("the checkpoint as stored, then the INT8 graph's session (2 bytes a parameter)",
                    "run it on a larger machine: this is the smallest golden check there is"),
    "quantize": ("the fp32 ONNX session of the graph being calibrated and judged (4.5 bytes a parameter)",
                 "set quantize.enabled=false to register the fp32 export unquantized"),
    "accept": ("the reference (the fp32 graph's session, or from 1B parameters the bf16 checkpoint) and then the "
               "candidate's session", "set accept.reference=checkpoint to judge against the 16-bit checkpoint"),
}


def check_stage_memory(stage: str, shape: Shape, batch: int = 4, block: int = 128,
                       available: int | None = None, need: float | None = None) -> float:
    """Raise MemoryBudgetError, before the stage starts, when golden, quantize or accept cannot fit this machine's
    free memory (``need``: the caller's own estimate, else stage_bytes'); returns the estimate (bytes)."""
    need = stage_bytes(shape, batch, block)[stage] if need is None else need
    holds, way_out = STAGE_HOLDS[stage]
    check_fits(stage, need, f"it holds {holds} for {shape.params / 1e9:.2f}B parameters. Run it on a machine with "
                            f"{need / GIB:.0f} GiB free, or {way_out}", available)
    return need


def shape_of_folder(model_dir: str, trust_remote_code: bool = False) -> Shape:
    """The shape of a saved model from its config.json alone (no weights read)."""
    from transformers import AutoConfig

    return Shape.of_config(AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code))


def check_prune_memory(shape: Shape, calib_blocks: int = 8, block: int = 128, available: int | None = None) -> float:
    """Raise MemoryBudgetError when structured pruning of ``shape`` cannot fit here; returns the estimate (bytes)."""
    need = stage_bytes(shape, min(calib_blocks, 4), block)["prune"]
    check_fits("pruning", need,
               f"8 bytes per parameter: the fp32 teacher and the fp32 student side by side, {shape.params / 1e9:.2f}B "
               f"parameters. Run it on a machine with {need / GIB:.0f} GiB free, or set prune.enabled=false and "
               f"quantize only", available)
    return need


def check_distill_memory(teacher: Shape, student: Shape, device: str, batch: int = 4, block: int = 128,
                         available: int | None = None) -> float:
    """Raise MemoryBudgetError when CPU distillation cannot fit here (a GPU holds the training instead); returns
    the estimate (bytes) of host memory."""
    logits = LOGIT_COPIES * batch * block * teacher.vocab * 4
    need = 4 * teacher.params + 16 * student.params + logits + OVERHEAD
    if device == "cuda":
        return need  # the GPU's memory is CUDA's to refuse; the host holds the checkpoints
    check_fits("distillation", need,
               f"the fp32 teacher at 4 bytes per parameter ({teacher.params / 1e9:.2f}B) and the trained student at 16 "
               f"(weights, gradients, Adam's two moments; {student.params / 1e9:.2f}B). Set --set distill.device=cuda to "
               f"train on a GPU, or distill a smaller student", available)
    return need
