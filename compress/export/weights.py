"""export.weights: whether the export writes the fp32 graph, or the weight-only INT8 or 4-bit one straight from the checkpoint.

From 1B parameters (compress.sizing.memory.CHECKPOINT_FROM_PARAMS, where the accept stage's reference becomes the checkpoint
too) an fp32 graph is 4 bytes a parameter in memory, on disk and in the registry that nothing needs: the INT8 graph is
written tensor by tensor from the bf16 weights (gqa.build_gqa_model's int8), golden and acceptance judge it against
the checkpoint as stored, and the baseline version records the checkpoint by digest (docs/models.md#large-models).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from compress.sizing.memory import CHECKPOINT_FROM_PARAMS

# manifest["quantization"]["written_from"] of an INT8 graph the export wrote (not the quantize stage)
FROM_CHECKPOINT = "checkpoint"
# the export.weights values whose graph is written from the checkpoint (the candidate; no quantize stage after it)
FROM_CHECKPOINT_WEIGHTS = ("int8", "int4")


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
    if cfg.accept.min_decode_speed_ratio is not None and cfg.accept.reference != "checkpoint":
        return "accept.min_decode_speed_ratio times the fp32 graph's decode speed"
    if cfg.export.exporter in ("dynamo", "torchscript"):
        return f"export.exporter {cfg.export.exporter} writes fp32 only"
    return None


def int4_wanted_by(cfg) -> str | None:
    """Why a run whose export.weights is auto writes 4 bits first from the checkpoint (the quantize stage's choice
    includes weight_only_int4), or None (then 8 bits, as before)."""
    q = cfg.quantize
    if q.enabled and q.method == "auto" and "weight_only_int4" in q.auto_forms:
        return "quantize.method auto weighs weight_only_int4"
    if q.enabled and q.method == "weight_only" and q.weight_bits == 4:
        return "quantize.weight_bits 4"
    return None


def resolve_weights(setting: str, params: int, fp32_needed: str | None, int4_wanted: str | None = None
                    ) -> tuple[str, str]:
    """(float32 | int8 | int4, why) for export.weights ``setting``; ``fp32_needed``: fp32_needed_by's reason, if any;
    ``int4_wanted``: int4_wanted_by's. With auto from 1B parameters, 4 bits where the run weighs them (the flow gates
    the 4-bit graph on the selection split and writes 8 bits instead where it fails: ``fallback_weights``)."""
    if setting != "auto":
        return setting, f"export.weights: {setting}"
    if fp32_needed:
        return "float32", f"export.weights auto: float32, {fp32_needed}"
    if params >= CHECKPOINT_FROM_PARAMS:
        size = (f"{params / 1e9:.2f}B parameters, from {CHECKPOINT_FROM_PARAMS / 1e9:g}B no fp32 graph is written")
        if int4_wanted:
            return "int4", (f"export.weights auto: int4 written from the checkpoint ({size}; {int4_wanted}), gated on "
                            f"the selection split, int8 where it fails")
        return "int8", f"export.weights auto: int8 written from the checkpoint ({size})"
    return "float32", f"export.weights auto: float32 ({params / 1e6:.0f}M parameters, below {CHECKPOINT_FROM_PARAMS / 1e9:g}B)"


def fallback_weights(setting: str, resolved: str, cfg) -> str | None:
    """The weights written instead when the graph of ``resolved`` fails the selection split's gate: int8 after an
    int4 that export.weights auto chose for quantize.method auto; None otherwise (weights the user named, or
    quantize.weight_bits 4 asked for, are judged as they are)."""
    auto = setting == "auto" and cfg.quantize.enabled and cfg.quantize.method == "auto"
    return "int8" if auto and resolved == "int4" else None


def int4_keep_ladder(q) -> list[float]:
    """The shares of groups at 8 bits export.weights auto writes 4-bit graphs with, in turn, until one passes the
    selection split: quantize.int4_keep_int8_tries, then int4_keep_int8 (each once)."""
    return list(dict.fromkeys([*q.int4_keep_int8_tries, q.int4_keep_int8]))


def written_int8(manifest: dict) -> bool:
    """Whether an artifact is the INT8 (or 4-bit) graph the export wrote from the checkpoint (export.weights int8,
    int4)."""
    return (manifest.get("quantization") or {}).get("written_from") == FROM_CHECKPOINT


_GROUPS = (("self_attn.q_proj", "qkv"), ("self_attn.k_proj", "qkv"), ("self_attn.v_proj", "qkv"),
           ("self_attn.qkv_proj", "qkv"), ("self_attn.o_proj", "o"), ("mlp.gate_proj", "gate_up"),
           ("mlp.up_proj", "gate_up"), ("mlp.gate_up_proj", "gate_up"), ("mlp.down_proj", "down"),
           # GPT-NeoX's own names (its graph is written with the names above: compress/export/gqa_neox.py)
           ("attention.query_key_value", "qkv"), ("attention.dense", "o"), ("mlp.dense_h_to_4h", "gate_up"),
           ("mlp.dense_4h_to_h", "down"))


def group_of(module: str) -> str | None:
    """'model.layers.3.mlp.up_proj' -> 'layers.3.gate_up' (the unit the quantize stage keeps at 8 bits too); None
    for what is no decoder-layer linear (the lm_head)."""
    m = re.search(r"layers\.(\d+)\.(.+)$", module)
    if not m:
        return None
    return next((f"layers.{m.group(1)}.{g}" for suffix, g in _GROUPS if m.group(2) == suffix), None)


@dataclass(frozen=True)
class Int4Plan:
    """export.weights int4: every decoder-layer linear at 4 bits except ``int8_groups``; the lm_head (unless
    ``lm_head_bits`` 4, quantize.int4_lm_head) and a tied table stay 8-bit (a 4-bit lm_head has caused repetition
    loops); an untied embedding table is read one row per token, so ``embedding_bits`` 4 costs no speed and saves
    half its bytes (llama.cpp's Q4_K_M stores it at 4 bits too).
    ``clip``: each 4-bit block's range searched for the least squared error (quantize.weight_clip mse)."""

    int8_groups: frozenset[str] = frozenset()
    symmetric: bool = False
    clip: bool = True
    embedding_bits: int = 8
    lm_head_bits: int = 8  # 4: an untied lm_head at 4 bits too (quantize.int4_lm_head)
    block: int = 0  # the 4-bit parts' block (quantize.int4_block_size); 0: the graph's own (weight_block_size)
    errors: dict[str, float] = field(default_factory=dict, compare=False)  # group -> measured 4-bit weight error

    def at_4_bits(self, module: str | None) -> bool:
        if module == "lm_head":
            return self.lm_head_bits == 4
        g = group_of(module or "")
        return g is not None and g not in self.int8_groups

    def block4(self, block: int) -> int:
        """The 4-bit parts' block in a graph whose 8-bit parts have ``block``."""
        return self.block or block

    def manifest(self, block: int, accuracy_level: int) -> dict:
        return {"weight_bits": 4, "int4_block_size": self.block4(block), "weight_symmetric": self.symmetric,
                "weight_clip": "mse" if self.clip else "none",
                "embedding_bits": self.embedding_bits, "lm_head_bits": self.lm_head_bits,
                "int8_groups": sorted(self.int8_groups),
                "weights": (f"int4 block-wise ({'symmetric' if self.symmetric else 'asymmetric'}, "
                            f"{'mse-clipped' if self.clip else 'rtn'}, block {self.block4(block)}, MatMulNBits accuracy_level "
                            f"{accuracy_level}); {len(self.int8_groups)} groups at 8 bits, the lm_head at "
                            f"{self.lm_head_bits}, the embedding at {self.embedding_bits}")}

    @classmethod
    def from_quantization(cls, q: dict) -> Int4Plan | None:
        """The plan a manifest's "quantization" (written by ``manifest``) records; None for an 8-bit graph."""
        if q.get("weight_bits") != 4:
            return None
        # graphs written before quantize.weight_clip were ORT's round-to-nearest with an 8-bit table
        return cls(frozenset(q.get("int8_groups", [])), bool(q.get("weight_symmetric")),
                   q.get("weight_clip", "none") == "mse", int(q.get("embedding_bits", 8)),
                   int(q.get("lm_head_bits", 8)),
                   0 if q.get("int4_block_size", q.get("block_size")) == q.get("block_size") else int(q["int4_block_size"]))


def int4_plan(model, block: int, symmetric: bool, keep_int8: float, clip: bool = True,
              lm_head_4bit: bool = False, block4: int | None = None) -> Int4Plan:
    """Which decoder-layer groups stay at 8 bits in the 4-bit graph written from the checkpoint: the ``keep_int8``
    share with the largest measured 4-bit weight error (||W - Q4(W)|| / ||W||, the weights of a group together;
    read one tensor at a time in fp32). No activations are at hand at export time, so this is the weights' own
    measure; the quantize stage's 4-bit form (fp32 graph) ranks by the output error on the calib rows instead.
    ``block4``: the 4-bit parts' block where it is not ``block`` (quantize.int4_block_size)."""
    import torch

    from compress.formats.nbits import w4_weight_error  # torch: not at import (flows/pipeline.py imports this module)

    lost: dict[str, float] = {}
    energy: dict[str, float] = {}
    for name, mod in model.named_modules():
        g = group_of(name)
        if g is None or not isinstance(mod, torch.nn.Linear):
            continue
        w = mod.weight.detach().float().numpy().T  # [K, N], blocks along K as MatMulNBits stores them
        e = float((w**2).sum())
        lost[g] = lost.get(g, 0.0) + w4_weight_error(w, block4 or block, symmetric, clip) * e  # a group's tensors weighed together
        energy[g] = energy.get(g, 0.0) + e
        del w
    rel = {g: lost[g] / max(energy[g], 1e-30) for g in lost}
    ranked = sorted(rel, key=lambda g: -rel[g])
    keep = frozenset(ranked[: int(np.ceil(keep_int8 * len(ranked)))])
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    return Int4Plan(keep, symmetric, clip, 8 if tied else 4, 4 if lm_head_4bit and not tied else 8,
                    block4 if block4 and block4 != block else 0, rel)
