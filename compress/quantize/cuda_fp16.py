"""``quantize.target: cuda``: the CUDA form of a gqa graph, fp16 weights and activations with the K/V cache in fp16.

ONNX Runtime's CUDA ``GroupQueryAttention`` takes fp16/bf16 only, and its MatMuls and norms run on the tensor
cores in fp16: what onnxruntime-genai's model builder writes for CUDA. Every float initializer becomes fp16, the
graph's ``past_key_values.*`` / ``present.*`` are declared fp16, and the logits get one Cast back to fp32, so the
engine samples float32 logits on either device. The CPU EP runs the same graph (its GroupQueryAttention takes fp16;
ORT casts around the kernels that have no fp16 version), which is how the accept stage gates it on a machine without
a GPU; docs/serving.md#cuda says what differs between the two.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from compress.artifact import write_manifest
from compress.export.kv_fp16 import KV_PREFIXES

FP16_MAX = float(np.finfo(np.float16).max)


class CudaFormError(ValueError):
    """A graph the fp16 CUDA form does not apply to."""


def _half(t: onnx.TensorProto) -> onnx.TensorProto:
    arr = numpy_helper.to_array(t)
    # A weight past fp16's range would become inf; none of the supported families has one, so refuse, never clip.
    if np.abs(arr).max(initial=0.0) > FP16_MAX:
        raise CudaFormError(f"initializer {t.name} holds values beyond float16's range ({FP16_MAX:g})")
    return numpy_helper.from_array(arr.astype(np.float16), t.name)


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """In place: the fp16 CUDA form of a gqa decoder graph with its weights loaded (see the module docstring)."""
    g = model.graph
    if not any(n.op_type == "GroupQueryAttention" for n in g.node):
        raise CudaFormError("the fp16 CUDA form is built from a gqa graph (export.attention: gqa)")
    for i, t in enumerate(g.initializer):
        if t.data_type == TensorProto.FLOAT:
            g.initializer[i].CopyFrom(_half(t))
    for n in g.node:
        if n.op_type == "Cast":
            for a in n.attribute:
                if a.name == "to" and a.i == TensorProto.FLOAT:
                    a.i = TensorProto.FLOAT16  # a float16-KV graph's casts back to fp32 become no-ops
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                a.t.CopyFrom(_half(a.t))
    for v in [*g.input, *g.output]:
        if v.name.startswith(KV_PREFIXES):
            v.type.tensor_type.elem_type = TensorProto.FLOAT16
    del g.value_info[:]
    (producer,) = [n for n in g.node if "logits" in n.output]
    producer.output[list(producer.output).index("logits")] = "logits_fp16"
    g.node.append(helper.make_node("Cast", ["logits_fp16"], ["logits"], name="/logits/Cast", to=TensorProto.FLOAT))
    return model


def write_fp16_artifact(src: str | Path, out_dir: str | Path) -> dict:
    """The fp16 CUDA form of the gqa artifact ``src`` as a complete artifact folder; returns its manifest."""
    import json

    from compress.export.gqa import save_model

    src, out_dir = Path(src), Path(out_dir)
    manifest = json.loads((src / "manifest.json").read_text())
    if manifest.get("attention_layout") != "gqa":
        raise CudaFormError(f"attention layout {manifest.get('attention_layout')!r}: the fp16 CUDA form is built "
                            "from a gqa graph; set export.attention: gqa")
    if manifest.get("quantization"):
        raise CudaFormError("the source is already quantized; the fp16 CUDA form is built from the float graph")
    model = to_fp16(onnx.load(str(src / manifest.get("onnx_file", "model.onnx"))))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model.onnx") and f.name != "manifest.json":
            shutil.copy2(f, out_dir / f.name)
    save_model(model, out_dir / "model.onnx")
    fields = {k: v for k, v in manifest.items() if k not in ("files", "manifest_version")}
    fields.update(kv_dtype="float16", onnx_file="model.onnx",
                  quantization={"method": "fp16", "target": "cuda", "weights": "float16", "activations": "float16",
                                "kv_cache": "float16"})
    return write_manifest(out_dir, fields)
