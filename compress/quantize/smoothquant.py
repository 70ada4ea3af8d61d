"""SmoothQuant on the ONNX graph: move activation outliers into the weights before W8A8.

For a linear group y = x W (all MatMuls that read the same activation x), pick
per input channel s_j = max|x_j|^alpha / max|W_j,:|^(1-alpha) and compute
y = (x / s) (diag(s) W). The division by s is folded into whatever produced x,
so the float model is unchanged and no op is added:

* x = gamma * rmsnorm(h)   (input_layernorm -> q/k/v, post_attention_layernorm -> gate/up):
  gamma <- gamma / s;
* x = silu(gate) * up      (-> down_proj, the |x| ~ 3100 outliers): up's weight columns <- / s.

Any other producer (the attention output feeding o_proj: folding into v_proj
would change the KV cache the server stores) is left alone. A fresh initializer
is written for every folded tensor because the exporter de-duplicates equal
initializers (e.g. all-ones norms of a fresh model share one tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from compress.export.graph_fusion import consumers_of
from compress.quantize.calibration import ActStats, Linear
from serve.runners.onnx_external import tensor_array


ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass
class SmoothedTensor:
    tensor: str
    folded_into: str  # "norm" or "up_proj"
    linears: list[str]
    max_before: float
    max_after: float
    alpha: float
    w8a8_error: float | None = None  # relative output error of the chosen alpha on the calibration sample (auto only)


def _fake_quant_act(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = max(hi - lo, 1e-8) / 255.0
    zp = np.round(-lo / scale)
    return (np.clip(np.round(x / scale) + zp, 0, 255) - zp) * scale


def _fake_quant_rows(x: np.ndarray) -> np.ndarray:
    """Symmetric int8 with one scale per row (per token), as insert_dynamic_per_token does at run time."""
    scale = np.maximum(np.abs(x).max(axis=1, keepdims=True), 1e-8) / 127.0
    return np.round(x / scale) * scale


def _fake_quant_weight(w: np.ndarray, reduce_range: bool) -> np.ndarray:
    qmax = 64.0 if reduce_range else 127.0
    scale = np.abs(w).max(axis=0) / qmax
    scale = np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(w / scale), -qmax, qmax) * scale


def w8a8_error(x: np.ndarray, cmin: np.ndarray, cmax: np.ndarray, weights: list[np.ndarray], s: np.ndarray | None,
               reduce_range: bool = False) -> float:
    """Relative squared error of the W8A8 (per-tensor uint8 x, per-channel int8 W) outputs of y = x W, smoothed by s.

    cmin/cmax: the per-channel range the activation scale is computed from (before smoothing).
    """
    inv = 1.0 / s if s is not None else np.ones_like(cmin)
    lo, hi = float((cmin * inv).min()), float((cmax * inv).max())
    xq = _fake_quant_act(x * inv, lo, hi).astype(np.float32)
    num = den = 0.0
    for w in weights:
        ws = w * s[:, None] if s is not None else w
        y = x @ w
        yq = xq @ _fake_quant_weight(ws, reduce_range).astype(np.float32)
        num += float(((yq - y) ** 2).sum())
        den += float((y**2).sum())
    return num / max(den, 1e-30)


def heldout_w8a8_error(x: np.ndarray, weights: list[np.ndarray], s: np.ndarray | None, reduce_range: bool = False,
                       _y: list[tuple[np.ndarray, np.ndarray]] | None = None, per_token: bool = False) -> float:
    """W8A8 output error with the activation range taken from one half of the sample rows and scored on the other (both ways).

    Scoring on the rows that set the range rewards smoothing that fits the calibration data exactly and then
    clips unseen tokens (it picked alpha 0.9+ on the tiny model and tripled its eval KL); held-out rows do not.
    _y: the float outputs (x[0::2] @ w, x[1::2] @ w) per weight, when the caller evaluates many s.
    per_token: activations quantized per row at run time (no calibrated range to fit).
    """
    halves = (x[0::2], x[1::2])
    inv = (1.0 / s).astype(np.float32) if s is not None else None
    wq = [_fake_quant_weight(w * s[:, None] if s is not None else w, reduce_range).astype(np.float32) for w in weights]
    ys = _y or [(halves[0] @ w, halves[1] @ w) for w in weights]
    total = 0.0
    for k in (0, 1):
        fit, score = halves[k], halves[1 - k]
        fit_s = fit * inv if inv is not None else fit
        xs = score * inv if inv is not None else score
        xq = (_fake_quant_rows(xs) if per_token else _fake_quant_act(xs, float(fit_s.min()), float(fit_s.max()))).astype(np.float32)
        num = den = 0.0
        for w_q, y in zip(wq, ys):
            yq = xq @ w_q
            num += float(((yq - y[1 - k]) ** 2).sum())
            den += float((y[1 - k] ** 2).sum())
        total += num / max(den, 1e-30)
    return 0.5 * total


def _init_map(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {i.name: i for i in model.graph.initializer}


def _replace_init(model: onnx.ModelProto, inits: dict, old: str, new_name: str, arr: np.ndarray, node: onnx.NodeProto, slot: int) -> None:
    """Point node.input[slot] at a new initializer; drop the old one when nothing else reads it."""
    t = numpy_helper.from_array(arr.astype(np.float32), new_name)
    model.graph.initializer.append(t)
    inits[new_name] = model.graph.initializer[-1]
    node.input[slot] = new_name
    still_used = any(old in n.input for n in model.graph.node)
    if not still_used and old in inits:
        model.graph.initializer.remove(inits.pop(old))


def smoothing_scales(act_absmax: np.ndarray, weights: list[np.ndarray], alpha: float) -> np.ndarray:
    """s_j = max|x_j|^alpha / max|W_j|^(1-alpha), over all weights [K, N] that read x; 1 where a channel is dead."""
    w_absmax = np.max(np.stack([np.abs(w).max(axis=1) for w in weights]), axis=0)
    a = np.maximum(act_absmax.astype(np.float64), 1e-5)
    w = np.maximum(w_absmax.astype(np.float64), 1e-5)
    s = a**alpha / w ** (1.0 - alpha)
    s = np.where((act_absmax > 0) & (w_absmax > 0), s, 1.0)
    return np.clip(s, 1e-4, 1e4).astype(np.float32)


def _graph_maps(model: onnx.ModelProto) -> tuple[dict, dict[str, onnx.NodeProto], dict[str, list[onnx.NodeProto]]]:
    """The graph's initializers by name, each tensor's producer node and each tensor's consumer nodes."""
    g = model.graph
    return _init_map(model), {o: n for n in g.node for o in n.output}, consumers_of(g)


def _fold_target(prod, inits: dict, channels: int, linear_by_output: dict, consumers: dict) -> tuple | None:
    """Where 1/s folds in upstream of a smoothed input: ("norm", slot, gamma initializer) when its producer has a
    per-channel initializer, ("up_proj", slot, Linear) when a Mul's other factor is an up projection read only
    there; None when neither."""
    for slot, name in enumerate(prod.input):
        t = inits.get(name)
        if t is not None and len(t.dims) == 1 and t.dims[0] == channels:
            return ("norm", slot, name)
    if prod.op_type == "Mul":
        for slot, name in enumerate(prod.input):
            up = linear_by_output.get(name)
            if up is not None and len(consumers.get(name, [])) == 1:
                return ("up_proj", slot, up)
    return None


def _fold(model: onnx.ModelProto, inits: dict, by_node: dict, *, fold: tuple, prod, tensor: str, s: np.ndarray,
          group: list[Linear], ws: list[np.ndarray]) -> None:
    """x / s folded upstream (into the norm's gamma or the up projection's columns) and s into the rows of every
    linear of ``group`` that reads x: the product is unchanged."""
    if fold[0] == "norm":
        gamma = tensor_array(inits[fold[2]])
        _replace_init(model, inits, fold[2], f"{tensor}_smooth_gamma", gamma / s, prod, fold[1])
    else:
        up_node = by_node[fold[2].node]
        w_up = tensor_array(inits[up_node.input[1]])
        _replace_init(model, inits, up_node.input[1], f"{up_node.input[1]}_smooth_cols", w_up / s[None, :], up_node, 1)
    for l, w in zip(group, ws):
        node = by_node[l.node]
        _replace_init(model, inits, node.input[1], f"{node.input[1]}_smooth_rows", w * s[:, None], node, 1)


def apply_smoothquant(model: onnx.ModelProto, linears: list[Linear], stats: dict[str, ActStats], alpha: float | str,
                      *, reduce_range: bool = False, grid: tuple[float, ...] = ALPHA_GRID, per_token: bool = False,
                      chooser: Callable[[ActStats, list[np.ndarray]], tuple[np.ndarray, float, float] | None] | None = None,
                      ) -> tuple[dict[str, np.ndarray], list[SmoothedTensor]]:
    """Smooth every linear input that has a foldable producer, in place.

    alpha "auto": per tensor, the alpha of `grid` (or no smoothing) whose W8A8 output error on the
    calibration sample (ActStats.sample) is smallest, the way INC's SmoothQuant auto-tunes alpha;
    per_token: score with per-token activation quantization (method dynamic, granularity token).
    chooser(stats, weights) -> (s, alpha, error) or None: another rule for s (AWQ's for 4-bit weights,
    compress/quantize/int4.py choose_awq), folded the same way.
    Returns {activation tensor: 1/s} (what calibration statistics must be multiplied by) and a report.
    """
    if alpha != "auto" and not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"quantize.smoothquant_alpha must be in [0, 1], 'auto' or null to disable, got {alpha!r}")
    g = model.graph
    inits, producer, consumers = _graph_maps(model)
    by_node = {n.name: n for n in g.node}
    linear_by_output = {by_node[l.node].output[0]: l for l in linears if l.node in by_node}
    groups: dict[str, list[Linear]] = {}
    for l in linears:
        groups.setdefault(l.input, []).append(l)

    inv: dict[str, np.ndarray] = {}
    report: list[SmoothedTensor] = []
    for tensor, group in groups.items():
        st = stats.get(tensor)
        prod = producer.get(tensor)
        # Mul: the standard graph's decomposed RMSNorm (x * rsqrt * gamma) or the MLP's act * up;
        # SimplifiedLayerNormalization: the gqa graph's fused RMSNorm, gamma on input 1; its
        # SkipSimplifiedLayerNormalization (residual add + RMSNorm, compress/export/graph_fusion.py), gamma on input 2.
        if st is None or prod is None or prod.op_type not in ("Mul", "SimplifiedLayerNormalization",
                                                              "SkipSimplifiedLayerNormalization"):
            continue
        group_nodes = {l.node for l in group}
        # every reader of x must be one of the smoothed linears, or it would see x / s
        if any(c.name not in group_nodes for c in consumers.get(tensor, [])):
            continue
        fold = _fold_target(prod, inits, st.cmax.shape[0], linear_by_output, consumers)
        if fold is None:
            continue
        ws = [tensor_array(inits[by_node[l.node].input[1]]) for l in group]
        if chooser is not None:
            picked = chooser(st, ws)
        else:
            chosen = _alpha_for(st, ws, alpha, reduce_range, per_token, grid)
            picked = None if chosen is None else (smoothing_scales(st.absmax, ws, chosen[0]), *chosen)
        if picked is None:
            continue  # scaling does not help this tensor
        s, a_used, err = picked
        kind = fold[0]
        _fold(model, inits, by_node, fold=fold, prod=prod, tensor=tensor, s=s, group=group, ws=ws)
        inv[tensor] = (1.0 / s).astype(np.float32)
        report.append(SmoothedTensor(tensor, kind, [l.module for l in group], float(st.absmax.max()), float((st.absmax / s).max()), a_used, err))
    return inv, report


def _alpha_for(st: ActStats, ws: list[np.ndarray], alpha: float | str, reduce_range: bool, per_token: bool,
               grid: tuple[float, ...] = ALPHA_GRID) -> tuple[float, float | None] | None:
    """(alpha, its held-out W8A8 error) for one activation read by `ws`: the fixed alpha (error None), or with
    "auto" the grid's best, None when no alpha beats leaving the tensor alone."""
    if alpha != "auto":
        return float(alpha), None
    if st.sample is None:
        raise ValueError("smoothquant_alpha 'auto' needs calibration samples (collect_stats(sample_rows=...))")
    x = st.sample.astype(np.float32)
    ys = [(x[0::2] @ w, x[1::2] @ w) for w in ws]
    best: tuple[float, float | None] = (heldout_w8a8_error(x, ws, None, reduce_range, ys, per_token), None)
    for a in grid:
        e = heldout_w8a8_error(x, ws, smoothing_scales(st.absmax, ws, a), reduce_range, ys, per_token)
        if e < best[0]:
            best = (e, a)
    return None if best[1] is None else (best[1], best[0])


# ---------------------------------------------------------------- the tied lm_head of the per-token form

_NORMS = ("Mul", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


@dataclass
class TiedLmHead:
    """A tied lm_head, MatMul(x, Transpose(E)), whose input x is a norm's output with a per-channel gamma."""

    tensor: str  # x
    embedding: str  # E's initializer
    norm: str  # the node making x
    gamma: str  # its gamma initializer (K,)


def tied_lm_head(model: onnx.ModelProto) -> TiedLmHead | None:
    """The tied lm_head whose input can be smoothed: every reader of x is such a MatMul, x comes from a norm with a
    1-D gamma of x's width (RMSNorm only: a LayerNormalization's bias would need dividing too). None otherwise."""
    g = model.graph
    inits, producer, consumers = _graph_maps(model)
    for t in g.node:
        if t.op_type != "Transpose" or t.input[0] not in inits or len(inits[t.input[0]].dims) != 2:
            continue
        heads = consumers.get(t.output[0], [])
        if len(heads) != 1 or heads[0].op_type != "MatMul" or heads[0].input[1] != t.output[0]:
            continue
        x = heads[0].input[0]
        norm = producer.get(x)
        K = inits[t.input[0]].dims[1]
        if norm is None or norm.op_type not in _NORMS or norm.output[0] != x or consumers.get(x) != heads:
            continue
        gamma = next((i for i in norm.input if i in inits and list(inits[i].dims) == [K]), None)
        if gamma is not None:
            return TiedLmHead(x, t.input[0], norm.name, gamma)
    return None


def smooth_tied_lm_head(model: onnx.ModelProto, stats: dict[str, ActStats], alpha: float | str,
                        reduce_range: bool = False) -> tuple[TiedLmHead, np.ndarray, SmoothedTensor] | None:
    """SmoothQuant's scales s for the tied lm_head of the per-token W8A8 form, scored the same way as every other
    linear input (per-token activations, held-out rows). The model is not changed: the lm_head's int8 copy is made
    when the graph is quantized, and then both halves of the fold go in together (fold_tied_lm_head and
    compress/quantize/graph.py quantize_tied_embedding). On SmolLM2 the final norm's output has channels up to 58
    against a median of 4, and its per-token int8 cost 0.027 of top-1 agreement (docs/quantization.md)."""
    head = tied_lm_head(model)
    st = stats.get(head.tensor) if head else None
    if head is None or st is None:
        return None
    w = tensor_array(_init_map(model)[head.embedding]).astype(np.float32).T
    chosen = _alpha_for(st, [w], alpha, reduce_range, per_token=True)
    if chosen is None:
        return None
    s = smoothing_scales(st.absmax, [w], chosen[0])
    return head, s, SmoothedTensor(head.tensor, "norm", ["lm_head"], float(st.absmax.max()),
                                   float((st.absmax / s).max()), chosen[0], chosen[1])


def fold_tied_lm_head(model: onnx.ModelProto, head: TiedLmHead, s: np.ndarray) -> None:
    """Divide the lm_head's input by s (the norm's gamma, as a fresh initializer); the caller multiplies the rows of
    the lm_head's own weight copy by s, or the float model changes."""
    inits = _init_map(model)
    norm = next(n for n in model.graph.node if n.name == head.norm)
    slot = list(norm.input).index(head.gamma)
    gamma = tensor_array(inits[head.gamma]).astype(np.float32)
    _replace_init(model, inits, head.gamma, f"{head.gamma}_lm_head_smooth", gamma / s, norm, slot)


def refresh_linears(model: onnx.ModelProto, linears: list[Linear]) -> list[Linear]:
    """The same linears with their (possibly renamed) weight initializers after smoothing."""
    by_node = {n.name: n for n in model.graph.node}
    return [Linear(l.node, l.module, l.role, l.layer, l.input, by_node[l.node].input[1]) for l in linears]
