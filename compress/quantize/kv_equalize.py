"""Even out K's channels before a per-tensor int8 cache: query channels times c, key channels divided by c.

A per-tensor int8 cache (``quantize.kv_cache_scales: tensor``) gives each layer's K one scale, set by its
largest channel. After rotary, a few K channels are many times larger than the rest (SmolLM2: the largest
channel 4-7x the median), so most channels get a few of the 255 steps. Attention only needs q . k =
sum_j q_j k_j, which does not change when channel j of every query head is multiplied by c_j and channel j of
their KV head divided by c_j. Rotary embedding rotates channel pairs, (j, j + r/2) or (2j, 2j + 1) when
interleaved, so both channels of a pair share one c and the rotation commutes with it. The factors are powers of
two, so the products are exact in floating point: the graph computes the same logits bit for bit with a float
cache, and only the int8 cache's rounding changes (run 12 in benchmarks/history.md).

The factors fold into the per-output-column scales of the product that feeds GroupQueryAttention's packed
Q|K|V input (or its Q and K inputs): ``MatMulIntegerToFloat``'s ``b_scale`` (W8A8), ``MatMulNBits``'
``scales`` (weight-only), or the columns of a float ``MatMul`` weight, through a per-row ``Mul`` (per-token
W8A8) or a constant bias ``Add``. A layer whose Q or K comes another way (q/k norms, rotary outside the node) is
left as it is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

_MS_DOMAIN = "com.microsoft"


def pair_factors(absmax: np.ndarray, rotary_dim: int, interleaved: bool) -> np.ndarray:
    """Powers of two c [kv_heads, head_dim] that bring every rotary pair's largest |K| within sqrt(2) of the
    layer's median pair; channels past ``rotary_dim`` are their own pair."""
    a = np.asarray(absmax, np.float64)
    hd = a.shape[1]
    idx = np.arange(hd)
    if rotary_dim and interleaved:
        mate = np.where(idx < rotary_dim, idx ^ 1, idx)
    elif rotary_dim:
        half = rotary_dim // 2
        mate = np.where(idx < half, idx + half, np.where(idx < rotary_dim, idx - half, idx))
    else:
        mate = idx
    pair = np.maximum(a, a[:, mate])
    level = float(np.median(pair))
    if level <= 0:
        return np.ones_like(a, np.float32)
    pair = np.maximum(pair, level * 1e-3)  # a channel that never fired: no factor past 2^10
    return np.exp2(np.round(np.log2(pair / level))).astype(np.float32)


def _const(name: str, inits: dict, base_dir: Path) -> np.ndarray | None:
    t = inits.get(name)
    return None if t is None else numpy_helper.to_array(t, base_dir=str(base_dir))


def _column_edits(tensor: str, f: np.ndarray, graph: tuple[dict, dict, dict], base_dir: Path) -> list | None:
    """The constants that multiply output column n of the product behind ``tensor`` by f[n], as [(name, new
    value)] in the constants' own dtypes; None when the chain is not one this knows or a constant on it is shared. ``graph``: (producer by
    output, uses per tensor, initializer by name)."""
    prod, uses, inits = graph
    edits: list[tuple[str, np.ndarray]] = []
    cur = tensor
    while True:
        node = prod.get(cur)
        if node is None or uses.get(cur, 0) != 1:
            return None
        if node.op_type == "Add" and node.domain in ("", "ai.onnx"):
            consts = [i for i in node.input if i in inits]
            if len(consts) != 1 or uses[consts[0]] != 1:
                return None
            b = _const(consts[0], inits, base_dir)
            if b.shape[-1:] != f.shape:
                return None
            edits.append((consts[0], (b * f).astype(b.dtype)))
            cur = next(i for i in node.input if i not in inits)
        elif node.op_type == "Mul" and node.domain in ("", "ai.onnx") and len(node.input) == 2 \
                and getattr(prod.get(node.input[1]), "op_type", None) in ("Max", "ReduceMax"):
            cur = node.input[0]  # the per-row scale of per-token W8A8 (a row maximum, [..., 1]) commutes with a column scale
        elif node.op_type == "MatMulIntegerToFloat" and node.domain == _MS_DOMAIN:
            s = _const(node.input[3], inits, base_dir)
            if s is None or uses[node.input[3]] != 1:
                return None
            edits.append((node.input[3], (np.broadcast_to(s, f.shape) * f).astype(s.dtype)))
            break
        elif node.op_type == "MatMulNBits" and node.domain == _MS_DOMAIN:
            s = _const(node.input[2], inits, base_dir)
            if s is None or uses[node.input[2]] != 1:
                return None
            edits.append((node.input[2], (s.reshape(len(f), -1) * f[:, None]).reshape(s.shape).astype(s.dtype)))
            break
        elif node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and node.input[1] in inits:
            w = _const(node.input[1], inits, base_dir)
            if w.ndim != 2 or w.shape[1] != len(f) or uses[node.input[1]] != 1:
                return None
            edits.append((node.input[1], (w * f).astype(w.dtype)))
            break
        else:
            return None
    return edits


def _apply(edits: list, inits: dict) -> None:
    for name, arr in edits:  # each new value already in its constant's dtype (_column_edits)
        inits[name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(arr), name))


def equalize_keys(model: onnx.ModelProto, absmax: dict[str, np.ndarray], base_dir: str | Path) -> tuple[int, dict]:
    """In place: every GroupQueryAttention whose Q and K come from known products (packed Q|K|V, or Q and K apart)
    gets K's channels evened out (module docstring). ``absmax``: the calibrated largest |value| per past input name,
    [kv_heads, head_dim]. Returns (layers changed, ``absmax`` with those layers' K divided by their factors: what
    the cache then holds)."""
    base_dir = Path(base_dir)
    g = model.graph
    prod = {o: n for n in g.node for o in n.output}
    uses: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    inits = {i.name: i for i in g.initializer}
    graph = (prod, uses, inits)
    out = dict(absmax)
    n = 0
    for node in g.node:
        if node.op_type != "GroupQueryAttention" or node.domain != _MS_DOMAIN:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        nh, nkv = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
        key = node.input[3]
        a = np.asarray(absmax[key])
        hd = a.shape[1]
        rotary = 0
        if int(attrs.get("do_rotary", 0)):
            cos = inits.get(node.input[7]) if len(node.input) > 7 else None
            if cos is None or len(cos.dims) != 2:
                continue
            rotary = 2 * int(cos.dims[1])
        c = pair_factors(a, rotary, bool(int(attrs.get("rotary_interleaved", 0))))
        if np.all(c == 1):
            continue
        fq, fk = np.repeat(c, nh // nkv, axis=0).reshape(-1), (1.0 / c).reshape(-1)
        if node.input[1]:  # Q and K apart
            eq, ek = _column_edits(node.input[0], fq, graph, base_dir), _column_edits(node.input[1], fk, graph, base_dir)
            edits = eq + ek if eq is not None and ek is not None else None
        else:
            f = np.concatenate([fq, fk, np.ones(nkv * hd, np.float32)]).astype(np.float32)
            edits = _column_edits(node.input[0], f, graph, base_dir)
        if edits is not None:
            _apply(edits, inits)
            out[key] = a / c
            n += 1
    return n, out
