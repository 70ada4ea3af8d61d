"""4-bit weights: the arithmetic the 4-bit weight-only form needs that ONNX Runtime's quantizer lacks.

ORT has the 4-bit `MatMulNBits` kernel and a round-to-nearest block quantizer; the tensors are written in its layout by
compress/formats/nbits.py `pack_w4` (its grid, each block's range searched: quantize.weight_clip). What ORT does not do is decide *which* weights may lose that much
and *how to scale them first*. Both are measured here on the calibration sample (the calib split's token rows that
calibration already keeps per linear input, `ActStats.sample`), never on the selection split:

- ``awq_scales`` / ``choose_awq``: activation-aware scaling as in AWQ (Lin et al., 2023). A weight's input channel j
  that sees large activations is multiplied by s_j = mean|x_j|^alpha before rounding, and x_j divided by it (folded
  into the norm or up_proj that produces x, as SmoothQuant's fold does: compress/quantize/smoothquant.py), so the
  channels that matter most get a finer 4-bit grid. alpha is searched per activation on the grid, scored by the
  4-bit output error on the calibration rows; no scaling when none beats it.
- ``w4_output_error``: the relative output error of one group of linears with 4-bit weights (float activations, as
  the kernel sees them up to its int8 blocks), the measure by which the mixed-precision choice keeps the worst groups
  at 8 bits (compress/quantize/sensitivity.py `candidate_ranking`).

``fake_quant_w4`` (compress/formats/nbits.py) is the round trip of the written tensors, so the search scores the grid the
kernel will use; tests compare it with them.
"""

from __future__ import annotations

import numpy as np

from serve.runners.nbits import unpack_nbits

from compress.formats.nbits import fake_quant_w4
from compress.quantize.calibration import ActStats

AWQ_GRID = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def w4_output_error(x: np.ndarray, weights: list[np.ndarray], block: int, symmetric: bool = False,
                    s: np.ndarray | None = None, _y: list[np.ndarray] | None = None, clip: bool = True) -> float:
    """Relative squared error of y = x W with W rounded to 4 bits (after scaling its rows by ``s``, x divided by it)."""
    x = x.astype(np.float32)
    xs = x / s if s is not None else x
    num = den = 0.0
    for i, w in enumerate(weights):
        y = _y[i] if _y is not None else x @ w
        wq = fake_quant_w4(w * s[:, None] if s is not None else w, block, symmetric, clip)
        num += float(((xs @ wq - y) ** 2).sum())
        den += float((y**2).sum())
    return num / max(den, 1e-30)


def awq_scales(mean_abs: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = mean|x_j|^alpha, normalised so that the largest and smallest s multiply to 1 (AWQ's form)."""
    a = np.maximum(mean_abs.astype(np.float64), 1e-6) ** alpha
    s = a / np.sqrt(a.max() * a.min())
    return np.clip(s, 1e-4, 1e4).astype(np.float32)


def choose_awq(st: ActStats, weights: list[np.ndarray], block: int, symmetric: bool = False,
               grid: tuple[float, ...] = AWQ_GRID, clip: bool = True) -> tuple[np.ndarray, float, float] | None:
    """(s, alpha, its 4-bit output error) for one activation read by ``weights``, or None when no alpha of the grid
    beats plain rounding. Scored on the calibration rows the statistics kept (st.sample)."""
    if st.sample is None:
        raise ValueError("AWQ scaling needs calibration samples (collect_stats(sample_rows=...))")
    x = st.sample.astype(np.float32)
    mean_abs = np.abs(x).mean(axis=0)
    ys = [x @ w for w in weights]
    best_err = w4_output_error(x, weights, block, symmetric, None, ys, clip)
    best = None
    for a in grid:
        s = awq_scales(mean_abs, a)
        e = w4_output_error(x, weights, block, symmetric, s, ys, clip)
        if e < best_err:
            best_err, best = e, (s, a)
    return None if best is None else (best[0], best[1], best_err)


def dequantized_model(model):
    """A copy of ``model`` whose MatMulNBits nodes are float MatMuls on the weights they hold: the reference a
    quantized graph's logits are compared with (the kernel's own error, apart from the rounding of the weights)."""
    import copy

    from onnx import helper, numpy_helper

    m = copy.deepcopy(model)
    g = m.graph
    inits = {i.name: i for i in g.initializer}
    nodes = []
    for n in g.node:
        if n.op_type != "MatMulNBits":
            nodes.append(n)
            continue
        if len(n.input) > 5 and n.input[5]:  # bias
            raise ValueError(f"{n.name}: MatMulNBits with a bias is not handled")
        w_name = f"{n.name or n.output[0]}_dequantized"
        g.initializer.append(numpy_helper.from_array(unpack_nbits(n, inits), w_name))
        nodes.append(helper.make_node("MatMul", [n.input[0], w_name], list(n.output), name=n.name))
    g.ClearField("node")
    g.node.extend(nodes)
    used = {i for n in nodes for i in n.input}
    for i in reversed(range(len(g.initializer))):
        if g.initializer[i].name not in used:
            del g.initializer[i]
    return m
