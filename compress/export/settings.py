"""The export section (``export:``): which exporter, which weights, which K/V element type."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from serve.config import Section


class ExportConfig(Section):
    # dynamo / torchscript: torch.onnx exports, attention layout `standard` (any architecture).
    # gqa: a graph built from the weights around com.microsoft.GroupQueryAttention (Llama family;
    # in-place KV, seconds instead of minutes to build, faster batched decode; see docs/gqa.md).
    # auto: gqa where the model allows it, dynamo otherwise (the choice is logged).
    exporter: Literal["auto", "dynamo", "torchscript", "gqa"] = "auto"
    # ONNX opset of the torch.onnx exporters (dynamo, torchscript); the gqa builder writes its own and ignores it
    # (with exporter: gqa it is not part of the export stage's cache key either).
    opset: int = Field(18, ge=14, le=23)
    # Weights go to an external data file above this size (protobuf's 2 GB limit), whichever the exporter.
    external_data_threshold_mb: int = Field(1800, ge=1)
    # The KV cache's element type (gqa layout only): float16 halves the bytes per cached token, so the same
    # serve.kv_memory_mb holds twice the tokens; the K/V are rounded to fp16 (docs/gqa.md has the figures).
    kv_dtype: Literal["float32", "float16"] = "float32"
    # The graph's weights. float32: the fp32 graph every later stage starts from (pruning, distillation, the INT8
    # forms of the quantize stage). int8: the weight-only INT8 graph written straight from the checkpoint, tensor by
    # tensor (quantize.weight_block_size and accuracy_level), with no fp32 copy in memory, on disk or in the registry: it is
    # the candidate (the quantize stage has nothing left to do), golden and acceptance judge it against the checkpoint
    # as stored, and the baseline version records the checkpoint by digest. gqa layout only; not with pruning or
    # distillation. auto: from 1B parameters when neither is on, int4 where the quantize section weighs 4 bits
    # (quantize.method auto with weight_only_int4 in auto_forms, or weight_bits 4), gated on the selection split, with
    # int8 written instead where it fails (method auto) and the forms table saying why; int8 otherwise; float32 below
    # 1B (docs/models.md#large-models). int4: as int8, with the decoder's linears at 4 bits (round-to-nearest with the
    # range search, quantize.weight_symmetric) but for the
    # quantize.int4_keep_int8 share of groups with the largest measured 4-bit weight error, which stay at 8 bits, as do
    # the lm_head and the embedding (docs/quantization.md#4-bit-weights).
    weights: Literal["auto", "float32", "int8", "int4"] = "auto"

    @model_validator(mode="after")
    def _fp16_kv_needs_gqa(self) -> "ExportConfig":
        if self.weights in ("int8", "int4") and self.exporter in ("dynamo", "torchscript"):
            raise ValueError(f"export.weights {self.weights} is written by the gqa builder; set export.exporter to gqa or "
                             f"auto, or export.weights to float32")
        if self.kv_dtype == "float16" and self.exporter in ("dynamo", "torchscript"):
            raise ValueError(f"export.kv_dtype float16 needs the gqa layout (GroupQueryAttention takes fp16 caches); "
                             f"set export.exporter to gqa or auto, or export.kv_dtype to float32")
        return self
