"""Graph rewrites that make a decoder step cheaper at batch 1, the fusions onnxruntime-genai's builder writes.

ORT's own optimizer does none of these on our graphs (measured with ORT 1.31: the optimized gqa graph
keeps its 60 residual Adds, 61 RMSNorms and three q/k/v MatMuls per layer), so we write them:

- ``fuse_skip_rmsnorm``: ``Add(x, y) -> SimplifiedLayerNormalization`` becomes one
  ``com.microsoft.SkipSimplifiedLayerNormalization`` whose 4th output is the sum (the residual stream).
- ``pack_siblings``: linears reading the same activation (q/k/v, gate/up) become one MatMul (float
  weights concatenated along N) or one MatMulNBits (blocks and scales concatenated along N). A packed
  q/k/v feeding GroupQueryAttention goes straight into its query input (key/value left empty: GQA
  splits a packed QKV itself); other groups are split back with one Split.

Both keep the graph's meaning exactly (the same float operations; tests/test_graph_fusion.py checks
logits against the unfused graph). Packing at export time is limited to q/k/v (``qkv_only``): a
packed gate/up would hide ``up_proj`` from SmoothQuant's fold for ``down_proj``, so gate/up are packed
after quantization (compress/quantize/quantizer.py), where nothing needs them apart any more.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
from onnx import helper, numpy_helper

from serve.runners.onnx_external import tensor_array

MS_DOMAIN = "com.microsoft"
_LINEAR_OPS = ("MatMul", "MatMulNBits")


def consumers_of(g: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Each tensor's consumer nodes, by tensor name (empty optional inputs left out)."""
    out: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
    for n in g.node:
        for i in n.input:
            if i:
                out[i].append(n)
    return out


def _ensure_ms_opset(model: onnx.ModelProto) -> None:
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))


def fuse_skip_rmsnorm(model: onnx.ModelProto) -> int:
    """In place: residual Add + RMSNorm -> SkipSimplifiedLayerNormalization. Returns how many were fused.

    Only an Add of two activations (not a bias initializer) whose output an RMSNorm over the last axis reads.
    """
    g = model.graph
    inits = {t.name for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    fused: dict[str, onnx.NodeProto] = {}  # LN name -> new node
    drop: set[str] = set()  # Add names
    for n in g.node:
        if n.op_type != "SimplifiedLayerNormalization" or n.domain not in ("", "ai.onnx"):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if attrs.get("axis", -1) != -1 or len(n.input) < 2 or n.input[1] not in inits:
            continue
        add = producer.get(n.input[0])
        if add is None or add.op_type != "Add" or add.name in drop or any(i in inits for i in add.input):
            continue
        eps = float(attrs.get("epsilon", 1e-5))
        fused[n.name] = helper.make_node(
            "SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], n.input[1]],
            [n.output[0], "", "", add.output[0]], name=n.name.rsplit("/", 1)[0] + "/SkipSimplifiedLayerNormalization",
            domain=MS_DOMAIN, epsilon=eps)
        drop.add(add.name)
    if not fused:
        return 0
    nodes = []
    for n in g.node:
        if n.name in drop:
            continue
        nodes.append(fused.get(n.name, n))
    g.ClearField("node")
    g.node.extend(nodes)
    _ensure_ms_opset(model)
    return len(fused)


def _packed_name(names: list[str]) -> str:
    """'/model/layers/0/self_attn/q_proj/MatMul' + k + v -> '/model/layers/0/self_attn/qkv_proj/MatMul'."""
    roles = [n.rstrip("/").split("/")[-2] if n.count("/") >= 2 else n for n in names]
    short = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": "gate", "up_proj": "up"}
    if all(r in short for r in roles):
        joined = "".join(short[r] for r in roles) if roles[0] != "gate_proj" else "_".join(short[r] for r in roles)
        parts = names[0].split("/")
        parts[-2] = f"{joined}_proj"
        return "/".join(parts)
    return names[0] + "_packed"


def _nbits_key(n: onnx.NodeProto, inits) -> tuple | None:
    """Attributes that must match for MatMulNBits nodes to be concatenated along N (None: not packable)."""
    inputs = [i for i in n.input if i]
    if len(inputs) not in (3, 4) or len(inputs) != len(n.input) or any(i not in inits for i in inputs[1:]):
        return None  # g_idx or bias: not handled
    a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
    return (a.get("K"), a.get("bits"), a.get("block_size"), a.get("accuracy_level", 0), len(inputs))


def _nbits_suffix(name: str) -> str:
    """'_Q8' / '_Q4': the tag compress.quantize.graph.weight_only gives a MatMulNBits' name, or ''."""
    return next((t for t in ("_Q8", "_Q4") if name.endswith(t)), "")


def _sibling_groups(g: onnx.GraphProto, inits: dict) -> dict[tuple, list[onnx.NodeProto]]:
    """Linears by (input, op, NBits attributes): the candidates for one packed linear."""
    by_input: dict[tuple, list[onnx.NodeProto]] = collections.defaultdict(list)
    for n in g.node:
        if n.op_type == "MatMul" and n.domain in ("", "ai.onnx") and len(n.input) == 2 and n.input[1] in inits \
                and len(inits[n.input[1]].dims) == 2:
            by_input[(n.input[0], "MatMul", ())].append(n)
        elif n.op_type == "MatMulNBits" and n.domain == MS_DOMAIN:
            key = _nbits_key(n, inits)
            if key is not None:
                by_input[(n.input[0], "MatMulNBits", key)].append(n)
    return by_input


def _gqa_reader(outs: list[str], cons: dict) -> onnx.NodeProto | None:
    """The GroupQueryAttention whose slots 0-2 are these three outputs and their only reader, if one is."""
    readers = [cons.get(o, []) for o in outs]
    if len(outs) == 3 and all(len(r) == 1 for r in readers):
        cand = readers[0][0]
        if cand.op_type == "GroupQueryAttention" and list(cand.input[:3]) == outs:
            return cand
    return None


def _packed_matmul(group: list[onnx.NodeProto], inits: dict, x: str, out: str, new_name: str):
    """(node, new initializers, dropped initializers, output sizes) of plain MatMuls packed along N."""
    ws = [tensor_array(inits[n.input[1]]) for n in group]
    w_name = group[0].input[1].replace("q_proj", "qkv_proj").replace("gate_proj", "gate_up_proj")
    if w_name == group[0].input[1]:
        w_name += "_packed"
    packed = helper.make_node("MatMul", [x, w_name], [out], name=new_name)
    # keep the module path compress.quantize.calibration reads, with the packed role
    for p in group[0].metadata_props:
        e = packed.metadata_props.add()
        e.key = p.key
        e.value = p.value.replace("q_proj", "qkv_proj").replace("gate_proj", "gate_up_proj")
    return (packed, [numpy_helper.from_array(np.concatenate(ws, axis=1), w_name)], {n.input[1] for n in group},
            [w.shape[1] for w in ws])


def _packed_nbits(group: list[onnx.NodeProto], inits: dict, x: str, out: str, new_name: str):
    """(node, new initializers, dropped initializers, output sizes) of MatMulNBits packed along N: codes, scales and
    zero points are per-N rows, whether stored [N, k_blocks] or flat."""
    bs = [tensor_array(inits[n.input[1]]) for n in group]
    ss = [tensor_array(inits[n.input[2]]) for n in group]
    sizes = [b.shape[0] for b in bs]
    kb = bs[0].shape[1]
    b_name, s_name = new_name + "_B", new_name + "_scales"
    s_cat = np.concatenate([s.reshape(-1, kb) for s in ss], axis=0)
    new_inits = [numpy_helper.from_array(np.concatenate(bs, axis=0), b_name),
                 numpy_helper.from_array(s_cat.reshape((-1,) if ss[0].ndim == 1 else s_cat.shape), s_name)]
    inputs = [x, b_name, s_name]
    if len(group[0].input) == 4:
        zs = [tensor_array(inits[n.input[3]]) for n in group]
        z_cat = np.concatenate([z.reshape(b.shape[0], -1) for z, b in zip(zs, bs)], axis=0)
        inputs.append(new_name + "_zero_points")
        new_inits.append(numpy_helper.from_array(z_cat.reshape((-1,) if zs[0].ndim == 1 else z_cat.shape), inputs[3]))
    attrs = {a.name: helper.get_attribute_value(a) for a in group[0].attribute}
    attrs["N"] = int(sum(sizes))
    packed = helper.make_node("MatMulNBits", inputs, [out], name=new_name, domain=MS_DOMAIN, **attrs)
    return packed, new_inits, {i for n in group for i in n.input[1:]}, sizes


def _rewrite(g: onnx.GraphProto, replace: dict, drop_nodes: set, gqa_rewire: dict, drop_inits: set,
             new_inits: list) -> None:
    nodes = []
    for n in g.node:
        if n.name in drop_nodes:
            continue
        if n.name in replace:
            nodes.extend(replace[n.name])
            continue
        if n.name in gqa_rewire:
            n.input[0] = gqa_rewire[n.name]
            n.input[1] = ""
            n.input[2] = ""
        nodes.append(n)
    still = {i for n in nodes for i in n.input}
    # in place: rebuilding the list would copy every other tensor (and protobuf keeps the cleared ones' memory)
    for i in reversed(range(len(g.initializer))):
        if g.initializer[i].name in drop_inits and g.initializer[i].name not in still:
            del g.initializer[i]
    for t in new_inits:
        g.initializer.append(t)
    g.ClearField("node")
    g.node.extend(nodes)


def pack_siblings(model: onnx.ModelProto, qkv_only: bool = False) -> int:
    """In place: linears sharing an input packed into one (see the module docstring). Returns groups packed.

    qkv_only: pack only the q/k/v triples that feed a GroupQueryAttention (the export-time form).
    """
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    cons = consumers_of(g)
    replace: dict[str, list[onnx.NodeProto]] = {}  # first node's name -> new nodes
    drop_nodes: set[str] = set()
    drop_inits: set[str] = set()
    new_inits: list[onnx.TensorProto] = []
    gqa_rewire: dict[str, str] = {}  # GQA node name -> packed output
    for (x, op, _), group in _sibling_groups(g, inits).items():
        if len(group) < 2:
            continue
        outs = [n.output[0] for n in group]
        # A q/k/v triple read only by one GQA's slots 0-2 goes into its packed query input.
        gqa = _gqa_reader(outs, cons)
        if qkv_only and gqa is None:
            continue
        names = [n.name for n in group]
        tag = _nbits_suffix(names[0]) or ("_Q8" if op == "MatMulNBits" else "")
        new_name = _packed_name([nm.removesuffix(_nbits_suffix(nm)) for nm in names]) + tag
        out = new_name.removesuffix(tag).rsplit("/", 1)[0] + "/MatMul_output_0"
        pack = _packed_matmul if op == "MatMul" else _packed_nbits
        packed, inits_made, dropped, sizes = pack(group, inits, x, out, new_name)
        new_inits += inits_made
        drop_inits |= dropped
        new = [packed]
        if gqa is not None:
            gqa_rewire[gqa.name] = out
        else:
            split_name = new_name.removesuffix(tag).rsplit("/", 1)[0] + "/Split"
            sz = f"{split_name}_sizes"
            new_inits.append(numpy_helper.from_array(np.array(sizes, np.int64), sz))
            new.append(helper.make_node("Split", [out, sz], outs, name=split_name, axis=-1))
        replace[group[0].name] = new
        drop_nodes.update(names[1:])
    if replace:
        _rewrite(g, replace, drop_nodes, gqa_rewire, drop_inits, new_inits)
    return len(replace)


def fuse_decoder(model: onnx.ModelProto, qkv_only: bool = True) -> dict[str, int]:
    """Both rewrites in place; returns what was done, e.g. {"skip_rmsnorm": 60, "packed": 30}."""
    return {"skip_rmsnorm": fuse_skip_rmsnorm(model), "packed": pack_siblings(model, qkv_only=qkv_only)}
