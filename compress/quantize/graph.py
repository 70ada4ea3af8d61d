"""Graph surgery for INT8: rewrite chosen linear MatMuls of an ONNX decoder into quantized ops.

Each function takes the linears to quantize (compress.quantize.calibration.Linear) and edits the graph;
which linears, and with which activation ranges, is the caller's choice (compress/quantize/quantizer.py).

- `insert_qdq`: static W8A8, our own Q/DQ pairs (uint8 asymmetric per-tensor activations, int8
  symmetric per-output-channel weights) from our own calibration (compress/quantize/calibration.py says why
  not ORT's calibrators). It is the graph ORT's quantizer emits with nodes_to_quantize +
  OpTypesToExcludeOutputQuantization=['MatMul']; ORT fuses DQ->MatMul into integer kernels.
- `insert_dynamic_per_token`: W8A8 with per-token activation ranges computed at run time.
- `dynamic_per_tensor`: ORT's dynamic quantization (one activation range per call).
- `weight_only`: 8- or 4-bit block-wise weights in MatMulNBits, float activations.
- `quantize_tied_embedding`: one 8-bit table shared by the token Gather and a tied lm_head.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from compress.formats.blocks import table_block
from compress.formats.nbits import pack_w4
from compress.quantize.calibration import Linear
from serve.runners.onnx_external import save_external, tensor_array

_MS_DOMAIN = "com.microsoft"


class QuantizeError(ValueError):
    """A quantization request that cannot be carried out, phrased for the user."""


def drop_initializers(g, names: set[str]) -> None:
    """Remove the initializers named in `names`, in place. Rebuilding the list instead (ClearField + extend) copies
    every other tensor, and protobuf keeps the memory of the cleared ones until the model is freed: on a 3B model's
    INT8 graph that was 3 GB a rewrite."""
    for i in reversed(range(len(g.initializer))):
        if g.initializer[i].name in names:
            del g.initializer[i]


def _replace_nodes(g, new_nodes: list, dropped: set[str]) -> None:
    """Swap the graph's nodes for `new_nodes`; drop the initializers in `dropped` that no new node reads."""
    still = {i for n in new_nodes for i in n.input}
    drop_initializers(g, {t for t in dropped if t not in still})
    g.ClearField("node")
    g.node.extend(new_nodes)


def _weight_qdq(w: np.ndarray, per_channel: bool, reduce_range: bool) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 weights [K, N], one scale per output channel N (or one for the tensor)."""
    qmax = 64.0 if reduce_range else 127.0  # ORT's reduced int8 range is [-64, 64]
    amax = np.abs(w).max(axis=0) if per_channel else np.array(np.abs(w).max())
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    q = np.clip(np.round(w / scale), -qmax, qmax).astype(np.int8)
    return q, scale


def _act_params(lo: float, hi: float) -> tuple[np.float32, np.uint8]:
    """uint8 asymmetric: [lo, hi] (containing 0) onto [0, 255]."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi - lo < 1e-8:
        hi = lo + 1e-8
    scale = (hi - lo) / 255.0
    zp = int(np.clip(round(-lo / scale), 0, 255))
    return np.float32(scale), np.uint8(zp)


def insert_qdq(model: onnx.ModelProto, linears: list[Linear], ranges: dict[str, tuple[float, float]],
               per_channel: bool, reduce_range: bool) -> None:
    """In place: Q/DQ on each linear's activation (shared by the linears that read it) and DQ on its int8 weight."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    todo = {l.node: l for l in linears}
    act_done: dict[str, str] = {}
    new_nodes = []
    drop_inits: set[str] = set()
    for n in g.node:
        l = todo.get(n.name)
        if l is not None:
            a = n.input[0]
            if a not in act_done:
                if a not in ranges:
                    raise QuantizeError(f"no calibration range for {a!r} (input of {l.module}); calibrate with the same model")
                scale, zp = _act_params(*ranges[a])
                s_name, z_name = f"{a}_scale", f"{a}_zero_point"
                g.initializer.extend([numpy_helper.from_array(np.array(scale), s_name), numpy_helper.from_array(np.array(zp), z_name)])
                new_nodes.append(helper.make_node("QuantizeLinear", [a, s_name, z_name], [f"{a}_quantized"], name=f"{a}_QuantizeLinear"))
                new_nodes.append(helper.make_node("DequantizeLinear", [f"{a}_quantized", s_name, z_name], [f"{a}_dequantized"], name=f"{a}_DequantizeLinear"))
                act_done[a] = f"{a}_dequantized"
            w_name = n.input[1]
            w = tensor_array(inits[w_name])
            q, scale = _weight_qdq(w, per_channel, reduce_range)
            q_name, s_name, z_name = f"{w_name}_quantized", f"{w_name}_scale", f"{w_name}_zero_point"
            g.initializer.extend([
                numpy_helper.from_array(q, q_name),
                numpy_helper.from_array(scale, s_name),
                numpy_helper.from_array(np.zeros(scale.shape, np.int8), z_name),
            ])
            attrs = {"axis": 1} if per_channel else {}
            new_nodes.append(helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [f"{w_name}_dequantized"], name=f"{w_name}_DequantizeLinear", **attrs))
            n.input[0] = act_done[a]
            n.input[1] = f"{w_name}_dequantized"
            drop_inits.add(w_name)
        new_nodes.append(n)
    _replace_nodes(g, new_nodes, drop_inits)


def insert_dynamic_per_token(model: onnx.ModelProto, linears: list[Linear], per_channel: bool, reduce_range: bool) -> None:
    """In place: W8A8 with int8 activations quantized per token (row) at run time, symmetric.

    ORT's dynamic quantization (DynamicQuantizeLinear) uses one range per call, i.e. per tensor over the
    whole batch x sequence; per-token ranges keep a token with outliers from crushing its neighbours
    (measured with torch fake-quant: perplexity 17.2 per-token vs 26.3 per-tensor). Per group sharing an input:
      m = max(max|x|_last axis, eps) ([..., 1]); xq = QuantizeLinear(x / m, 1/127, zero point 128) (uint8)
    and each linear reading it as
      y = MatMulIntegerToFloat(xq, Wq, 1/127, w_scale, 128) * m
    5 nodes per group and 2 per linear, on the activation's own rank (MatMulInteger broadcasts like MatMul: no
    Shape/Reshape around it). Each node is a pass with a thread hand-off, and at 32-64 rows these elementwise passes
    cost more than the integer GEMMs (benchmarks/history.md, run 10): the first form's Div/Round/Add/Cast chain and
    MatMulInteger/Cast/Mul/Mul were 8 + 4 per linear. Format 3 packed linears sharing an input (gate/up) into one
    product and split it after; the Split was a copy of the whole product, and two products reading the same
    quantized input are 8 % faster on 32 batched prompts, 2 % on a 32-row decode step (format 4, benchmarks/history.md
    run 11).
    uint8 with a fixed zero point 128: ORT's s8 x s8 MatMulInteger is a slow path (5 ms vs 0.02 ms for u8 x s8
    at 1x576x1536 on this CPU).
    """
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    todo = {l.node: l for l in linears}
    by_input: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        if n.name in todo:
            by_input.setdefault(n.input[0], []).append(n)
    consts = _Consts(model)
    new_nodes = []
    drop: set[str] = set()
    for n in g.node:
        if n.name not in todo:
            new_nodes.append(n)
            continue
        a = n.input[0]
        group = by_input.pop(a, None)
        if group is None:
            continue  # packed into its group's first linear
        p = f"{a}_ptq"
        new_nodes += _row_quantize(a, p, consts)
        for m in group:  # one integer product each, all reading the shared quantized input
            q, scale = _weight_qdq(tensor_array(inits[m.input[1]]), per_channel, reduce_range)
            qn, sn = f"{m.input[1]}_quantized", f"{m.input[1]}_scale"
            g.initializer.extend([numpy_helper.from_array(q, qn), numpy_helper.from_array(
                np.broadcast_to(scale.reshape(-1), (q.shape[1],)).astype(np.float32), sn)])
            drop.add(m.input[1])
            o = m.output[0]
            new_nodes += [
                helper.make_node("MatMulIntegerToFloat", [f"{p}_q", qn, consts.inv127, sn, consts.zp128],
                                 [f"{o}_unit"], name=f"{m.name}_MatMulIntegerToFloat", domain=_MS_DOMAIN),
                helper.make_node("Mul", [f"{o}_unit", f"{p}_m"], [o], name=f"{m.name}_MulRow"),
            ]
    _replace_nodes(g, new_nodes, drop)
    _ensure_ms_opset(model)


class _Consts:
    """The per-token quantization's shared constants, added to the graph once (a second call, the tied lm_head,
    reuses the first call's)."""

    def __init__(self, model: onnx.ModelProto):
        self.graph = model.graph
        self.have = {i.name for i in model.graph.initializer}
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)

    @property
    def inv127(self) -> str:
        return self.get("ptq_inv127", np.array(1.0 / 127.0, np.float32))

    @property
    def zp128(self) -> str:
        return self.get("ptq_zp128", np.array(128, np.uint8))

    def get(self, name: str, arr: np.ndarray) -> str:
        if name not in self.have:
            self.graph.initializer.append(numpy_helper.from_array(arr, name))
            self.have.add(name)
        return name


def _row_quantize(a: str, p: str, consts: _Consts) -> list[onnx.NodeProto]:
    """x -> m = max(max|x| over the last axis, eps) as {p}_m and QuantizeLinear(x / m, 1/127, 128) as {p}_q."""
    if consts.opset >= 18:  # ReduceMax takes its axes as an input from opset 18 on (the gqa graph is opset 17)
        row_max = helper.make_node("ReduceMax", [f"{p}_abs", consts.get("ptq_axis_last", np.array([-1], np.int64))],
                                   [f"{p}_amax"], keepdims=1, name=f"{p}_ReduceMax")
    else:
        row_max = helper.make_node("ReduceMax", [f"{p}_abs"], [f"{p}_amax"], axes=[-1], keepdims=1,
                                   name=f"{p}_ReduceMax")
    return [
        helper.make_node("Abs", [a], [f"{p}_abs"], name=f"{p}_Abs"),
        row_max,
        helper.make_node("Max", [f"{p}_amax", consts.get("ptq_eps", np.array(1e-8, np.float32))], [f"{p}_m"],
                         name=f"{p}_Max"),
        helper.make_node("Div", [a, f"{p}_m"], [f"{p}_unit"], name=f"{p}_Div"),
        helper.make_node("QuantizeLinear", [f"{p}_unit", consts.inv127, consts.zp128], [f"{p}_q"],
                         name=f"{p}_Quantize"),
    ]


def quantize_tied_embedding(model: onnx.ModelProto, block_size: int = 32, accuracy_level: int = 4,
                            lm_head_per_token: bool = False, per_channel: bool = True,
                            reduce_range: bool = False, lm_head_scales: np.ndarray | None = None) -> bool:
    """Store the embedding table once as 8-bit blocks, shared by the token Gather and a tied lm_head.

    Gather(E, ids)            -> GatherBlockQuantized(Eq[V, K/b, b]) -> Reshape [.., K]
    MatMul(x, Transpose(E))   -> MatMulNBits(x, Eq) (weight-only, bits=8)
    lm_head_per_token (the W8A8 per-token form): the lm_head instead gets its own int8 copy [K, V], per channel,
    behind per-token activations (insert_dynamic_per_token): MatMulNBits at M = 32 rows ran ~5x slower than
    MatMulInteger on this CPU (benchmarks/history.md), and the lm_head is a fifth of SmolLM2's weights. Costs V x K
    bytes more (28 MiB for SmolLM2). lm_head_scales: SmoothQuant's s for that copy's input channels (its rows are
    multiplied by s); the caller has divided the lm_head's input by s (compress/quantize/smoothquant.py
    fold_tied_lm_head).
    Returns False (model untouched) when the graph has no such pattern.
    """
    g = model.graph
    found = _tied_table(g, block_size)
    if found is None:
        return False
    gather, transposes, lm_heads, block_size = found
    e_name = gather.input[0]
    E = tensor_array(next(i for i in g.initializer if i.name == e_name)).astype(np.float32)
    V, K = E.shape
    qn = _table_blocks(g, E, e_name, block_size)
    new_nodes = []
    for n in g.node:
        if n is gather:
            out = n.output[0]
            new_nodes.append(helper.make_node("GatherBlockQuantized", [qn, n.input[1], f"{qn}_gather_scales", f"{qn}_gather_zero_points"],
                                              [f"{out}_blocks"], name=f"{n.name}_q8", domain=_MS_DOMAIN,
                                              gather_axis=0, quantize_axis=2, block_size=block_size, bits=8))
            new_nodes.append(helper.make_node("Reshape", [f"{out}_blocks", f"{qn}_shape"], [out], name=f"{n.name}_q8_reshape"))
        elif n in transposes:
            continue
        elif n in lm_heads and lm_head_per_token:
            new_nodes.append(helper.make_node("MatMul", [n.input[0], f"{e_name}_lm_head_T"], list(n.output), name=n.name))
        elif n in lm_heads:
            new_nodes.append(helper.make_node("MatMulNBits", [n.input[0], qn, f"{qn}_matmul_scales"], list(n.output), name=f"{n.name}_q8",
                                              domain=_MS_DOMAIN, K=K, N=V, bits=8, block_size=block_size, accuracy_level=accuracy_level))
        else:
            new_nodes.append(n)
    if lm_head_per_token and lm_heads:
        w = E.T if lm_head_scales is None else E.T * np.asarray(lm_head_scales, np.float32)[:, None]
        g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w), f"{e_name}_lm_head_T"))
    g.ClearField("node")
    g.node.extend(new_nodes)
    drop_initializers(g, {e_name})
    if lm_head_per_token and lm_heads:
        insert_dynamic_per_token(model, [Linear(n.name, "lm_head", "lm_head", None, n.input[0], f"{e_name}_lm_head_T")
                                         for n in lm_heads], per_channel, reduce_range)
    _ensure_ms_opset(model)
    return True


def _tied_table(g: onnx.GraphProto, block_size: int):
    """(the token Gather, the Transposes of its table, the MatMuls reading them, the block its rows are rounded in:
    compress/formats/blocks.py table_block of its width) when the table is read only so and its rows split into whole blocks
    of some power of two up to ``block_size``; else None."""
    inits = {i.name: i for i in g.initializer}
    gather = next((n for n in g.node if n.op_type == "Gather" and n.input[0] in inits and len(inits[n.input[0]].dims) == 2), None)
    if gather is None:
        return None
    e_name = gather.input[0]
    block = table_block(int(inits[e_name].dims[1]), block_size)
    if not block:
        return None
    consumers = [n for n in g.node if e_name in n.input]
    transposes = [n for n in consumers if n.op_type == "Transpose"]
    if len(consumers) != 1 + len(transposes):
        return None
    lm_heads = []
    for t in transposes:
        users = [n for n in g.node if t.output[0] in n.input]
        if not all(u.op_type == "MatMul" and u.input[1] == t.output[0] for u in users):
            return None
        lm_heads += users
    return gather, transposes, lm_heads, block


def _table_blocks(g: onnx.GraphProto, E: np.ndarray, e_name: str, block_size: int) -> str:
    """The table as symmetric 8-bit blocks (stored +128), with the scales and zero points both readers take; returns
    the codes' name."""
    V, K = E.shape
    kb = K // block_size
    Eb = E.reshape(V, kb, block_size)
    scale = (np.abs(Eb).max(-1) / 127.0).astype(np.float32)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = (np.clip(np.round(Eb / scale[..., None]), -127, 127) + 128).astype(np.uint8)
    qn = f"{e_name}_q8"
    g.initializer.extend([
        numpy_helper.from_array(q, qn),
        numpy_helper.from_array(scale.reshape(V, kb, 1), f"{qn}_gather_scales"),
        numpy_helper.from_array(np.full((V, kb, 1), 128, np.uint8), f"{qn}_gather_zero_points"),
        numpy_helper.from_array(scale.reshape(-1), f"{qn}_matmul_scales"),
        numpy_helper.from_array(np.array([0, 0, K], np.int64), f"{qn}_shape"),
    ])
    return qn


def _ensure_ms_opset(model: onnx.ModelProto) -> None:
    if not any(o.domain == _MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_MS_DOMAIN, 1))


def weight_only(model: onnx.ModelProto, linears: list[Linear], block_size: int, accuracy_level: int, bits: int = 8,
                symmetric: bool = True, clip: bool = True) -> onnx.ModelProto:
    """In place (and returned): `linears` as `bits`-bit (8 or 4) block-wise MatMulNBits, float activations.

    The same tensors and node ORT's MatMulNBitsQuantizer writes (8 bits: its C++ block quantizer does the arithmetic;
    4 bits: compress/formats/nbits.py pack_w4, ORT's layout and grid, ``clip`` searching each block's range), but one weight
    at a time: each float weight is read (from the proto or, for a lazily loaded graph, from its file), quantized and
    dropped before the next, so a model never has an fp32 copy and an int8 copy of all its linears at once. ORT's
    quantizer holds the whole model in memory; on a 1B model that was most of the quantize stage's memory.
    symmetric False: a zero point per block (the 4-bit form's default, compress/quantize/int4.py).
    """
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                 DefaultWeightOnlyQuantizer)

    if block_size & (block_size - 1) or block_size < 16:
        raise QuantizeError(f"quantize.weight_block_size must be a power of two >= 16 for weight_only, got {block_size}")
    if bits not in (4, 8):
        raise QuantizeError(f"quantize.weight_bits must be 4 or 8, got {bits}")
    # bits= given to the config itself: ORT 1.31 wrote 8-bit nodes when only an algo_config asked for 4 (FACTS.md)
    quantizer = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level, bits=bits)) if bits == 8 else None
    tag = f"Q{bits}"
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    todo = {l.node for l in linears}
    new_nodes, drop = [], set()
    for n in g.node:
        w = inits.get(n.input[1]) if n.name in todo and n.op_type == "MatMul" and len(n.input) == 2 else None
        if w is None or len(w.dims) != 2:
            new_nodes.append(n)
            continue
        arr = tensor_array(w).astype(np.float32, copy=False)
        K, N = arr.shape
        packed, scales, zero_points = (pack_w4(arr, block_size, symmetric, clip) if bits == 4 else
                                       quantizer.qbits_block_quant(np.ascontiguousarray(arr)))
        del arr
        inputs = [n.input[0], f"{w.name}_{tag}", f"{w.name}_scales"]
        g.initializer.append(numpy_helper.from_array(packed, inputs[1]))
        g.initializer.append(numpy_helper.from_array(scales, inputs[2]))
        if not symmetric:
            inputs.append(f"{w.name}_zero_points")
            g.initializer.append(numpy_helper.from_array(zero_points, inputs[3]))
        del packed, scales, zero_points
        kw = {"accuracy_level": accuracy_level} if accuracy_level else {}
        new_nodes.append(helper.make_node("MatMulNBits", inputs, list(n.output), name=f"{n.name}_{tag}" if n.name else "",
                                          domain=_MS_DOMAIN, K=K, N=N, bits=bits, block_size=block_size, **kw))
        drop.add(w.name)
    _replace_nodes(g, new_nodes, drop)
    _ensure_ms_opset(model)
    return model


def dynamic_per_tensor(model: onnx.ModelProto, linears: list[Linear], per_channel: bool, reduce_range: bool) -> onnx.ModelProto:
    """A copy with `linears` quantized by ORT's quantize_dynamic (one activation range per call)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="quant_dyn_") as tmp:
        src, dst = Path(tmp) / "in.onnx", Path(tmp) / "out.onnx"
        save_model(model, src)
        quantize_dynamic(src, dst, op_types_to_quantize=["MatMul"], per_channel=per_channel, reduce_range=reduce_range,
                         weight_type=QuantType.QInt8, nodes_to_quantize=[l.node for l in linears],
                         # the gqa graph's contrib ops (GroupQueryAttention, SkipSimplifiedLayerNormalization) give
                         # ORT's shape inference no output types: every tensor there is float
                         extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT})
        return onnx.load(str(dst))


def save_model(model: onnx.ModelProto, path: Path) -> None:
    """protobuf cannot serialize 2 GB: bigger models, and lazily loaded ones, keep their weights in
    model.onnx.data, written tensor by tensor (serve/runners/onnx_external.py)."""
    save_external(model, path)


def pow2_block(n: int) -> int:
    """MatMulNBits takes power-of-two blocks of at least 16; anything else falls back to 32."""
    return n if n >= 16 and n & (n - 1) == 0 else 32
