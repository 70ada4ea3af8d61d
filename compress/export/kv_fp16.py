"""Half the KV cache's bytes: a gqa graph rewritten so GroupQueryAttention keeps its past/present in float16.

ONNX Runtime's CPU GroupQueryAttention takes float16 as well as float32 (one type T for query, key, value,
the caches and the rotary tables), so the rewrite is local to each attention node:

- its query/key/value inputs get a ``Cast`` to float16 (a packed QKV is one Cast), its output a ``Cast``
  back to float32: every MatMul, norm and the logits stay float32, as the quantize stage expects;
- the cos/sin tables it reads become float16 initializers;
- the graph's ``past_key_values.*`` inputs and ``present.*`` outputs are declared float16.

The runner and the evaluation driver read the manifest's ``kv_dtype`` (serve/kv/cache.py) and bind float16
buffers; the KV budget then holds twice the tokens. What it costs in accuracy (the K/V rounded to 11-bit
mantissas) and in time is measured in docs/gqa.md; the golden stage checks it like any export.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from serve.runners.onnx_external import tensor_array

_QKV_INPUTS = (0, 1, 2)
_ROTARY_INPUTS = (7, 8)  # cos_cache, sin_cache
KV_PREFIXES = ("past_key_values.", "present.")


class KvDtypeError(ValueError):
    """A graph the float16-KV rewrite does not apply to."""


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    out = onnx.NodeProto()
    out.CopyFrom(node)
    return out


def kv_to_fp16(model: onnx.ModelProto) -> int:
    """In place: float16 K/V for every GroupQueryAttention node. Returns the number of nodes rewritten."""
    g = model.graph
    # by position: protobuf wrappers are not stable identities to key on
    gqa_at = [i for i, n in enumerate(g.node) if n.op_type == "GroupQueryAttention"]
    gqa = [g.node[i] for i in gqa_at]
    if not gqa:
        raise KvDtypeError("export.kv_dtype float16: the graph has no GroupQueryAttention (use export.exporter gqa)")
    inits = {t.name: t for t in g.initializer}
    casts: dict[str, str] = {}  # float32 tensor -> its float16 copy (a packed QKV read twice is cast once)
    new_nodes: list[list[onnx.NodeProto]] = []
    done_tables: set[str] = set()
    for n in gqa:
        before: list[onnx.NodeProto] = []
        for i in _QKV_INPUTS:
            name = n.input[i] if i < len(n.input) else ""
            if not name:
                continue
            if name not in casts:
                casts[name] = f"{name}/fp16"
                before.append(helper.make_node("Cast", [name], [casts[name]], f"{name}/CastFp16",
                                               to=TensorProto.FLOAT16))
            n.input[i] = casts[name]
        for i in _ROTARY_INPUTS:
            name = n.input[i] if i < len(n.input) else ""
            if name and name not in done_tables:
                if name not in inits:
                    raise KvDtypeError(f"export.kv_dtype float16: {n.name}'s rotary table {name!r} is computed, not "
                                       f"stored; this graph cannot be rewritten (set export.kv_dtype to float32)")
                t = inits[name]
                if t.data_type != TensorProto.FLOAT16:
                    t.CopyFrom(numpy_helper.from_array(tensor_array(t).astype(np.float16), name))
                done_tables.add(name)
        out32 = n.output[0]
        n.output[0] = f"{out32}/fp16"
        after = helper.make_node("Cast", [n.output[0]], [out32], f"{n.name}/CastFp32", to=TensorProto.FLOAT)
        new_nodes.append(before + [n, after])
    at = dict(zip(gqa_at, new_nodes))
    order: list[onnx.NodeProto] = []
    for i, n in enumerate(g.node):
        order.extend(_copy(x) for x in at.get(i, [n]))  # copies: the originals go with the clear below
    del g.node[:]
    g.node.extend(order)
    for v in list(g.input) + list(g.output):
        if v.name.startswith(KV_PREFIXES):
            v.type.tensor_type.elem_type = TensorProto.FLOAT16
    return len(gqa)
