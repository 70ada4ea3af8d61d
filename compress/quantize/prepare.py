"""Calibration and smoothing, run once per source model before any quantized variant is built.

`calibrate_and_smooth` feeds the calib split through the model's linear inputs
(compress/quantize/calibration.py), folds SmoothQuant's per-channel scales into the weights in place
(compress/quantize/smoothquant.py) and turns the statistics into the activation range of every quantized
input. The sensitivity scan and every trial of the accuracy-aware loop then reuse the result, so
the model runs over the calibration data once however many variants are written.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from compress.quantize.calibration import (ActStats, Linear, collect_stats, entropy_range, load_first_pass, percentile_range,
                                  save_first_pass)
from compress.config import QuantizeConfig
from compress.quantize.int4 import choose_awq
from compress.quantize.smoothquant import SmoothedTensor, apply_smoothquant, refresh_linears


@dataclass
class Calibrated:
    stats: dict[str, ActStats]  # raw (unsmoothed) per-channel statistics per linear input
    inv_scales: dict[str, np.ndarray]  # SmoothQuant's 1/s per smoothed input
    ranges: dict[str, tuple[float, float]]  # activation range per input, after smoothing
    smooth_report: list[SmoothedTensor]
    linears: list[Linear]  # the linears again: smoothing renames the weights it scales
    seconds: float
    sha256: str  # of the calibration blocks fed
    blocks: int


def calibrate_and_smooth(model: onnx.ModelProto, linears: list[Linear], calib: np.ndarray, cfg: QuantizeConfig,
                         alpha: float | str | None, *, reduce_range: bool, num_kv_heads: int, head_dim: int,
                         threads: int | None = None, calibration_cache: Path | None = None,
                         on_event: Callable[[str, dict], None] = lambda name, data: None,
                         extra_tensors: tuple[str, ...] = (), awq: tuple[int, bool, bool] | None = None) -> Calibrated:
    """Calibrate `linears` of `model` on `calib` and smooth `model` in place with `alpha` (None = no smoothing).

    calibration_cache: an .npz of the first pass, keyed by the calib blocks' sha256; reused when it
    matches, written when it does not.
    extra_tensors: more activations to take statistics of (the tied lm_head's input, which is not a linear here).
    awq: (block size, symmetric, clip) of 4-bit weights: AWQ's activation-aware scales instead of SmoothQuant's
    (compress/quantize/int4.py), folded the same way.
    """
    tensors = list(dict.fromkeys([*(l.input for l in linears), *extra_tensors]))
    hist = cfg.method == "static" and cfg.calibration in ("entropy", "percentile")
    smooth_report: list[SmoothedTensor] = []

    def smooth(stats: dict[str, ActStats]) -> dict[str, np.ndarray]:
        if alpha is None and awq is None:
            return {}
        chooser = (lambda st, ws: choose_awq(st, ws, awq[0], awq[1], clip=awq[2])) if awq else None
        inv, rep = apply_smoothquant(model, linears, stats, "auto" if awq else alpha, reduce_range=reduce_range,
                                     per_token=cfg.method == "dynamic" and cfg.activation_granularity == "token",
                                     chooser=chooser)
        smooth_report[:] = rep
        on_event("smoothquant", {"tensors": len(rep), "max_before": max((r.max_before for r in rep), default=0.0),
                                 "max_after": max((r.max_after for r in rep), default=0.0)})
        return inv

    first = None
    if calibration_cache is not None:
        sha = hashlib.sha256(np.ascontiguousarray(calib.astype(np.int64)).tobytes()).hexdigest()
        first = load_first_pass(calibration_cache, sha)
        if first is not None and (not set(tensors) <= set(first) or any(first[t].sample is None for t in tensors)):
            first = None
    # Histograms are taken of the smoothed activations, so smoothing has to happen between the two
    # passes (collect_stats calls `smooth` there); min/max calibration smooths afterwards.
    res = collect_stats(model, tensors, calib, num_kv_heads, head_dim, histogram=hist, inv_scales=smooth,
                        batch_size=cfg.calib_batch_size, threads=threads, first_pass=first,
                        sample_rows=cfg.smoothquant_samples)
    if calibration_cache is not None and first is None:
        save_first_pass(calibration_cache, res.stats, res.sha256)
    if not hist:
        inv_scales = smooth(res.stats)
    else:
        inv_scales = {t: st.inv_scale for t, st in res.stats.items() if st.inv_scale is not None}
    ranges: dict[str, tuple[float, float]] = {}
    for t, st in res.stats.items():
        if cfg.calibration == "percentile" and st.hist is not None:
            ranges[t] = percentile_range(st, cfg.percentile)
        elif cfg.calibration == "entropy" and st.hist is not None:
            ranges[t] = entropy_range(st)
        else:
            ranges[t] = st.range_after(inv_scales.get(t))
    on_event("calibration", {"blocks": res.blocks, "seconds": res.seconds, "tensors": len(tensors)})
    return Calibrated(stats=res.stats, inv_scales=inv_scales, ranges=ranges, smooth_report=smooth_report,
                      linears=refresh_linears(model, linears), seconds=res.seconds, sha256=res.sha256,
                      blocks=res.blocks)
