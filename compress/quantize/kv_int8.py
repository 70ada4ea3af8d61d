"""An int8 K/V cache for the gqa graph: GroupQueryAttention stores its past/present as int8, one scale per channel.

ONNX Runtime's CPU GroupQueryAttention (1.31) reads an int8 cache with a float scale per KV head and channel
(``k_quant_type``/``v_quant_type`` ``PER_CHANNEL``, ``kv_cache_bit_width`` 8, the scales as inputs 12 and 13), or
one per tensor (``PER_TENSOR``: coarser, and the faster kernel on this CPU; ``quantize.kv_cache_scales``): it
quantizes each new K/V as it writes it (``q = clamp(round(x / scale), -128, 127)``) and dequantizes inside its
dot products. A position then costs a quarter of float32's bytes, and attention, which reads every row's K/V
each step and is half of a 64-row decode step on float32 (benchmarks/history.md run 10), runs 2-2.4x faster.

The scales are static, so they come from calibration: the largest |K| (after rotary) and |V| the artifact
itself writes on the calibration blocks, per layer, head and channel, times ``KV_MARGIN`` for what those
blocks did not show; a value beyond that is clipped. The accept stage then gates the artifact as it is served.

- ``kv_absmax``: run the artifact's own prefill on the blocks and read its caches.
- ``kv_to_int8``: the graph rewrite (inputs/outputs declared int8, attributes, scale initializers).
- ``int8_kv_artifact``: both, on an artifact folder (its manifest then says ``kv_dtype: int8``); per tensor, K's
  channels are evened out first (compress/quantize/kv_equalize.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from compress.quantize.graph import QuantizeError
from compress.quantize.kv_equalize import equalize_keys

CALIB_BLOCKS = 16  # calib blocks the scales are taken from (16 x 128 tokens for the demo)
KV_MARGIN = 1.25  # headroom over the calibration maximum: clipping an unseen outlier costs more than a coarser step
_MS_DOMAIN = "com.microsoft"
_SCALE_INPUTS = (12, 13)  # k_scale, v_scale (9-11: position_ids, attention_bias, head_sink, left empty)


def kv_absmax(artifact_dir: str | Path, blocks: np.ndarray, max_blocks: int = CALIB_BLOCKS) -> dict[str, np.ndarray]:
    """Per past input name (``past_key_values.<i>.key`` / ``.value``): the largest |value| the artifact writes into
    that cache on ``blocks`` (at most ``max_blocks`` of them), [kv_heads, head_dim]."""
    from compress.drivers import load_lm

    lm = load_lm(artifact_dir, verify=False)
    if lm.layout != "gqa":
        raise QuantizeError(f"quantize.kv_cache int8 needs the gqa layout (GroupQueryAttention); this artifact is "
                            f"{lm.layout!r}: export with export.exporter gqa or auto, or set quantize.kv_cache: float32")
    if lm.kv_dtype != np.float32:
        raise QuantizeError(f"quantize.kv_cache int8 needs a float32-KV artifact, not {np.dtype(lm.kv_dtype).name} "
                            f"(export.kv_dtype float32)")
    blocks = np.asarray(blocks)[:max_blocks]
    if len(blocks) == 0:
        raise QuantizeError("quantize.kv_cache int8 calibrates its scales on the calib split; it is empty")
    amax: list[np.ndarray] | None = None
    for ids in blocks:
        _, past = lm.prefill([int(t) for t in ids])
        cur = [np.abs(a[0, :, :past.length, :]).max(axis=1) for a in past.kv.arrays]
        amax = cur if amax is None else [np.maximum(x, y) for x, y in zip(amax, cur)]
    return dict(zip(lm.past_names, amax))


def kv_to_int8(model: onnx.ModelProto, absmax: dict[str, np.ndarray], margin: float = KV_MARGIN,
               scales: str = "channel") -> int:
    """In place: every GroupQueryAttention keeps an int8 cache with scales from ``absmax`` (by past input name),
    per KV head and channel (``scales`` "channel") or one per tensor ("tensor": the largest of them). Returns the
    number of nodes rewritten."""
    if scales not in ("channel", "tensor"):
        raise QuantizeError(f"quantize.kv_cache_scales {scales!r}: allowed are 'channel', 'tensor'")
    quant_type = "PER_CHANNEL" if scales == "channel" else "PER_TENSOR"
    g = model.graph
    n = 0
    int8_names: set[str] = set()
    for node in g.node:
        if node.op_type != "GroupQueryAttention" or node.domain != _MS_DOMAIN:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("k_quant_type", b"NONE") not in (b"NONE", "NONE"):
            raise QuantizeError(f"{node.name}: its cache is already quantized")
        past_k, past_v = node.input[3], node.input[4]
        if past_k not in absmax or past_v not in absmax:
            raise QuantizeError(f"{node.name}: no calibration range for {past_k!r}/{past_v!r}")
        inputs = list(node.input) + [""] * (14 - len(node.input))
        for slot, name in zip(_SCALE_INPUTS, (past_k, past_v)):
            a = np.maximum(absmax[name].astype(np.float32) * margin, 1e-6)
            if scales == "tensor":
                a = a.max(keepdims=True)
            scale_name = f"{name}_int8_scale"
            g.initializer.append(numpy_helper.from_array((a / 127.0).reshape(-1).astype(np.float32), scale_name))
            inputs[slot] = scale_name
        del node.input[:]
        node.input.extend(inputs)
        node.attribute.extend([helper.make_attribute("k_quant_type", quant_type),
                               helper.make_attribute("v_quant_type", quant_type),
                               helper.make_attribute("kv_cache_bit_width", 8)])
        int8_names.update({past_k, past_v, *node.output[1:3]})
        n += 1
    for vi in list(g.input) + list(g.output):
        if vi.name in int8_names:
            vi.type.tensor_type.elem_type = TensorProto.INT8
    return n


def int8_kv_artifact(artifact_dir: str | Path, blocks: np.ndarray, onnx_file: str = "model.onnx",
                     margin: float = KV_MARGIN, scales: str = "channel") -> dict:
    """Rewrite the artifact's graph (weights untouched) for an int8 cache calibrated on ``blocks``. The caller
    writes the manifest (``kv_dtype: int8``) afterwards. Returns a summary for the quantization settings."""
    artifact_dir = Path(artifact_dir)
    absmax = kv_absmax(artifact_dir, blocks)
    path = artifact_dir / onnx_file
    model = onnx.load(str(path), load_external_data=False)
    # one scale per tensor is set by K's largest channels: even them out first (exact; compress/quantize/kv_equalize.py)
    equalized, absmax = equalize_keys(model, absmax, artifact_dir) if scales == "tensor" else (0, absmax)
    n = kv_to_int8(model, absmax, margin, scales)
    if n == 0:
        raise QuantizeError("quantize.kv_cache int8: the graph has no GroupQueryAttention")
    onnx.save(model, str(path))  # the weights stay in their external file, which the graph still names
    k = np.concatenate([v.reshape(-1) for name, v in absmax.items() if name.endswith(".key")])
    v = np.concatenate([v.reshape(-1) for name, v in absmax.items() if name.endswith(".value")])
    return {"kv_cache": f"int8 per {scales} (calibrated max x {margin})", "kv_cache_layers": n,
            "kv_cache_equalized_layers": equalized,
            "kv_cache_calib_blocks": int(min(len(blocks), CALIB_BLOCKS)),
            "kv_key_absmax_p50_max": [float(np.median(k)), float(k.max())],
            "kv_value_absmax_p50_max": [float(np.median(v)), float(v.max())]}
