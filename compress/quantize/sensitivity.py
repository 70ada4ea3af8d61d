"""Which linear groups to keep in float: a cheap ranking and a KL sensitivity scan, on calib data only.

The accuracy-aware loop (compress/quantize/relax.py) and `quantize.sensitivity_trials` both need an order of
the quantizable groups (one decoder layer's q/k/v, o, gate/up or down linears), most harmful to
quantize first. `candidate_ranking` scores every group from the calibration statistics alone, with no
model run; `sensitivity_scan` runs the model with one group quantized at a time for the top
`sensitivity_trials` of that ranking, because a local error does not always predict the logits' error.
The selection split is never used here, so the gate's figures stay an honest held-out measurement.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import onnx

from compress.config import QuantizeConfig
from compress.quantize.calibration import ActStats, Linear
from serve.runners.onnx_external import tensor_array


class QuantizerView(Protocol):
    """What the scans need of compress.quantize.quantizer.Quantizer (which calls them from ``write``): named here so
    that this module does not import the quantizer, which imports it (tests/test_layout.py: no import cycles)."""

    cfg: QuantizeConfig
    model: onnx.ModelProto
    manifest: dict
    threads: int | None
    calib: np.ndarray | None
    stats: dict[str, ActStats]
    inv_scales: dict[str, np.ndarray]
    reduce_range: bool
    sensitivity: list[tuple[str, float]]
    on_event: Callable[[str, dict], None]

    def prepare(self) -> None: ...

    def selected(self, extra_float_groups: list[str] | tuple[str, ...] = ()) -> tuple[list[Linear], list[Linear]]: ...

    def build(self, linears: list[Linear], embedding: bool | None = None, fallback: bool = True) -> onnx.ModelProto: ...


def _by_group(linears: list[Linear]) -> dict[str, list[Linear]]:
    out: dict[str, list[Linear]] = {}
    for l in linears:
        out.setdefault(l.group, []).append(l)
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def candidate_ranking(q: QuantizerView) -> list[str]:
    """Quantizable groups, worst first, by a cheap local measure computed on calib data only.

    4-bit weights: the group's 4-bit output error on the calib rows (compress/quantize/int4.py, after AWQ's scaling).
    With calibration samples: the W8A8 output error of the group's linears (smoothed weights,
    per-tensor or per-token activations as configured, activation range fitted on half the rows and
    scored on the other half). Without: how badly one 8-bit range fits the input, max/median channel range.
    """
    from compress.quantize.int4 import w4_output_error
    from compress.quantize.smoothquant import heldout_w8a8_error

    q.prepare()
    cfg = q.cfg
    inits = {i.name: i for i in q.model.graph.initializer}
    per_token = cfg.method == "dynamic" and cfg.activation_granularity == "token"
    score: dict[str, float] = {}
    for g, ls in _by_group(q.selected()[0]).items():
        st = q.stats.get(ls[0].input)
        inv = q.inv_scales.get(ls[0].input)
        if st is None:
            score[g] = 0.0
        elif st.sample is not None and cfg.method == "weight_only" and cfg.weight_bits == 4:
            x = st.sample * inv if inv is not None else st.sample
            score[g] = w4_output_error(x, [tensor_array(inits[l.weight]) for l in ls], cfg.w4_block(),
                                       cfg.weight_symmetric, clip=cfg.w4_clip(cfg.weight_algorithm == "awq"))
        elif st.sample is not None and cfg.method != "weight_only":
            x = st.sample * inv if inv is not None else st.sample
            ws = [tensor_array(inits[l.weight]) for l in ls]
            score[g] = heldout_w8a8_error(x.astype(np.float32), ws, None, q.reduce_range, per_token=per_token)
        else:
            am = st.absmax * (inv if inv is not None else 1.0)
            score[g] = float(am.max() / max(np.median(am), 1e-12))
    return sorted(score, key=lambda k: -score[k])


def sensitivity_scan(q: QuantizerView, trials: int | None = None, blocks: int | None = None) -> list[tuple[str, float]]:
    """Quantize one group at a time; score = mean KL(float || group-quantized) on calib blocks. Most sensitive first."""
    from compress.drivers import lm_for_model

    q.prepare()
    trials = q.cfg.sensitivity_trials if trials is None else trials
    if trials <= 0 or q.calib is None:
        return []
    data = q.calib[: blocks or q.cfg.sensitivity_blocks]
    ref_lm = lm_for_model(q.model, q.manifest, q.threads)
    ref = [_log_softmax(x) for x in ref_lm.prefill_batches(data)]
    del ref_lm
    by_group = _by_group(q.selected()[0])
    results = []
    for g in candidate_ranking(q)[:trials]:
        t0 = time.perf_counter()
        lm = lm_for_model(q.build(by_group[g], embedding=False, fallback=False), q.manifest, q.threads)
        kl, n = 0.0, 0
        for r, x in zip(ref, lm.prefill_batches(data)):
            lp = _log_softmax(x)
            kl += float((np.exp(r) * (r - lp)).sum())
            n += r.shape[0] * r.shape[1]
        del lm
        results.append((g, kl / max(n, 1)))
        q.on_event("sensitivity", {"group": g, "kl": kl / max(n, 1), "seconds": time.perf_counter() - t0})
    results.sort(key=lambda x: -x[1])
    return results


def float_groups_by_sensitivity(q: QuantizerView) -> list[str]:
    """Every quantizable group, most sensitive first: scanned ones by KL, then the rest by the range proxy."""
    scanned = [g for g, _ in q.sensitivity]
    return scanned + [g for g in candidate_ranking(q) if g not in scanned]


def sensitivity_figure(sensitivity: list[tuple[str, float]], kept: int = 0):
    """Bar chart of a sensitivity scan (KL per group, most sensitive first; the first `kept` bars are the float ones)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(4.0, 0.35 * len(sensitivity) + 1.5), 3.2))
    ax = fig.add_subplot(1, 1, 1)
    names = [g for g, _ in sensitivity]
    vals = [v for _, v in sensitivity]
    ax.bar(range(len(vals)), vals, color=["tab:red" if i < kept else "tab:blue" for i in range(len(vals))])
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels(names, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("KL(float || group int8)")
    ax.set_title("sensitivity scan (red: kept in float)")
    fig.tight_layout()
    return fig
