"""The accuracy-aware loop: quantize, evaluate, gate, and on a rejection keep the next most sensitive linear groups in
float and retry, up to ``accept.relax_trials`` times, before rejecting for good.

The quantize stage's (tasks/quantize.py, and every form of ``quantize.method: auto`` in choice.py) on the selection
split; the gate it asks is compress/evaluate/gate.py's ``accept`` (criteria ``fidelity``: quantization should stay
the model it replaces). Calibration runs once (``Quantizer``); each trial only writes another variant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compress.config import AcceptConfig, QuantizeConfig
from compress.evaluate.gate import Verdict, accept
from compress.evaluate.onnx_eval import ReferencePass, evaluate_onnx
from compress.quantize.quantizer import Quantizer
from compress.quantize.sensitivity import float_groups_by_sensitivity


@dataclass
class AcceptanceResult:
    verdict: Verdict
    artifact: Path  # the last trial's artifact (the accepted one when verdict.accepted)
    report: object  # compress.quantize.quantizer.QuantReport of that trial
    metrics: dict[str, float]  # evaluate_onnx of that trial
    baseline: dict[str, float]
    trials: list[dict]  # per trial: trial, float_groups, metrics, accepted, reasons


def quantize_with_acceptance(
    src_artifact: str | Path,
    out_dir: str | Path,
    calib_blocks: np.ndarray,
    selection_blocks: np.ndarray,
    qcfg: QuantizeConfig,
    acfg: AcceptConfig,
    *, baseline: dict | None = None,
    threads: int | None = None,
    on_trial: Callable[[int, dict], None] | None = None,
    eval_kwargs: dict | None = None,
    reference: ReferencePass | None = None,
    quantizer: Quantizer | None = None,
) -> AcceptanceResult:
    """Quantize `src_artifact` (the fp32 baseline, also the agreement reference) into out_dir until the gate accepts.

    Trial 0 uses qcfg as is; each later trial keeps `relax_groups_per_trial` more groups in float, most
    sensitive first (sensitivity scan results when qcfg.sensitivity_trials > 0, else the activation-range
    proxy). Calibration runs once, on calib_blocks only; selection_blocks (the selection split) are used only for the
    loop's gate. The pipeline's verdict is the accept stage's, on the test split no trial has seen (tasks/accept.py).
    on_trial(i, record) is called after every trial (for MLflow child runs). reference: the source's
    ReferencePass over selection_blocks (its figures are the baseline; choose_quant_form shares one between forms),
    made here when not given (and no reference_top1 is in eval_kwargs). quantizer: one already calibrated on
    this source (choose_quant_form writes several K/V forms from one), else one is made from qcfg.
    """
    src = Path(src_artifact)
    out_dir = Path(out_dir)
    ekw = dict(eval_kwargs or {})
    if threads:
        ekw.setdefault("threads", threads)
    own_ref = reference is None and "reference_top1" not in ekw
    if own_ref:
        # One pass of the source, spooled: its figures are the baseline, its logits every trial's reference.
        reference = ReferencePass(src, selection_blocks, threads=ekw.get("threads"), latency=ekw.get("latency", True))
    try:
        q = quantizer or Quantizer(src, calib_blocks, qcfg, threads=threads)
        return _loop(q, out_dir, selection_blocks, acfg, baseline=baseline, on_trial=on_trial, ekw=ekw, reference=reference)
    finally:
        if own_ref:
            reference.close()


def _loop(q: Quantizer, out_dir: Path, selection_blocks, acfg: AcceptConfig, *, baseline: dict | None, on_trial, ekw: dict,
          reference: ReferencePass | None) -> AcceptanceResult:
    # eval_kwargs may carry reference_top1 (the baseline's argmax on selection_blocks) to skip re-running the baseline
    ref = {"reference": reference} if reference is not None else {}
    if baseline is None:
        baseline = reference.figures if reference is not None else evaluate_onnx(
            q.src, selection_blocks, **{k: v for k, v in ekw.items() if k != "reference_top1"})
    # The loop gates on the selection split alone: the other genres are the verdict's (tasks/accept.py).
    loop_cfg = acfg.model_copy(update={"max_heldout_perplexity_ratio": None})
    extra: list[str] = []
    trials: list[dict] = []
    for i in range(acfg.relax_trials + 1):
        report = q.write(out_dir, extra)
        metrics = evaluate_onnx(out_dir, selection_blocks, **ref, **ekw)
        verdict = accept(metrics, baseline, loop_cfg, criteria="fidelity")  # quantization: stay the source
        rec = {"trial": i, "float_groups": list(report.float_linears), "extra_float_groups": list(extra),
               "metrics": {**metrics, **report.metrics(), **verdict.metrics}, "accepted": verdict.accepted, "reasons": list(verdict.reasons)}
        trials.append(rec)
        if on_trial:
            on_trial(i, rec)
        if verdict.accepted or i == acfg.relax_trials:
            break
        already = set(extra)
        quantized = {g for g in q.groups() if not any(l.group == g for l in q.selected(extra)[1])}
        nxt = [g for g in float_groups_by_sensitivity(q) if g not in already and g in quantized][: acfg.relax_groups_per_trial]
        if not nxt:
            break  # nothing left to relax
        extra += nxt
    if not verdict.accepted:
        verdict.reasons.append(f"rejected after {len(trials)} trial(s) of the accuracy-aware loop (accept.relax_trials={acfg.relax_trials})")
    return AcceptanceResult(verdict, out_dir, report, metrics, baseline, trials)
