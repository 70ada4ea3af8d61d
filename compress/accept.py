"""The acceptance gate: a candidate's metrics against the baseline's, under tolerances from config.

`accept` is a pure function of two metric dicts (from compress.evaluate.evaluate_onnx);
`quantize_with_acceptance` is the accuracy-aware loop: quantize, evaluate, gate, and on a
rejection move the next most sensitive linear groups back to float and retry, up to
AcceptConfig.relax_trials times, before rejecting for good.

Two criteria (accept.criteria): ``fidelity`` for a model that should stay the one it replaces
(quantization: perplexity ratio, top-1 agreement, KL) and ``quality`` for a pruned or distilled
student, a different model judged as a language model on held-out text (perplexity ratio, the
held-out source's perplexity ratio, downstream multiple-choice accuracy). Each applied check is
listed in ``Verdict.checks`` with its value, limit and what it answers (``WHY``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from compress.config import AcceptConfig, QuantizeConfig


# What each check answers, stated in the verdict beside its numbers (Verdict.checks).
WHY = {
    "perplexity_ratio": "how well it predicts held-out text of the corpus's kind, against the baseline (both criteria)",
    "perplexity_delta": "the same, as an absolute perplexity increase",
    "top1_agreement": "fidelity: how often it picks the baseline's next token; a quantized model should be the baseline",
    "kl": "fidelity: how far its next-token distribution is from the baseline's",
    "heldout_perplexity_ratio": "quality: prediction of another genre (data.heldout_source); training on the corpus "
                                "can teach the corpus instead of the teacher",
    "downstream_drop": "quality: multiple-choice continuation accuracy on held-out text (compress/downstream.py); "
                       "a student is a different model, judged on what it does rather than on imitation",
    "throughput_ratio": "speed floor: batch-1 decode tokens/s against the baseline",
    "size_ratio": "size ceiling: artifact bytes against the baseline",
}


@dataclass
class Verdict:
    accepted: bool
    reasons: list[str]  # one line per failed tolerance, with the numbers
    metrics: dict[str, float] = field(default_factory=dict)  # the gate's own figures (ratios, deltas)
    criteria: str = "fidelity"  # the resolved criteria: fidelity | quality
    checks: list[dict] = field(default_factory=list)  # name, value, limit, passed, why: every tolerance applied

    def __bool__(self) -> bool:
        return self.accepted


def _num(d: dict, key: str, who: str) -> float:
    if key not in d or d[key] is None:
        raise KeyError(f"accept: the {who} metrics have no {key!r}; evaluate it with compress.evaluate.evaluate_onnx")
    v = float(d[key])
    return v


def resolve_criteria(cfg: AcceptConfig, changed_model: bool) -> str:
    """accept.criteria with auto made concrete: quality when pruning or distillation made another model."""
    if cfg.criteria != "auto":
        return cfg.criteria
    return "quality" if changed_model else "fidelity"


def accept(candidate: dict, baseline: dict, cfg: AcceptConfig, criteria: str | None = None) -> Verdict:
    """Accept when every tolerance of the criteria holds; a NaN or infinite metric always fails.

    criteria: fidelity | quality (default: cfg.criteria, auto read as fidelity; the pipeline resolves auto
    with resolve_criteria). quality reads candidate/baseline "heldout_perplexity" and "downstream_accuracy"
    when their tolerances are set.
    """
    criteria = criteria or (cfg.criteria if cfg.criteria != "auto" else "fidelity")
    if criteria not in ("fidelity", "quality"):
        raise ValueError(f"accept criteria {criteria!r}: allowed values are 'fidelity', 'quality'")
    reasons: list[str] = []
    checks: list[dict] = []
    m: dict[str, float] = {}

    def check(name: str, value: float, limit: float, ok: bool, reason: str) -> None:
        checks.append({"name": name, "value": value, "limit": limit, "passed": bool(ok), "why": WHY[name]})
        if not ok:
            reasons.append(reason)

    c_ppl, b_ppl = _num(candidate, "perplexity", "candidate"), _num(baseline, "perplexity", "baseline")
    ratio = c_ppl / b_ppl if b_ppl > 0 else math.inf
    m["gate_perplexity_ratio"] = ratio
    m["gate_perplexity_delta"] = c_ppl - b_ppl
    check("perplexity_ratio", ratio, cfg.max_perplexity_ratio,
          math.isfinite(c_ppl) and ratio <= cfg.max_perplexity_ratio,
          f"perplexity {c_ppl:.4g} is {ratio:.4f}x the baseline {b_ppl:.4g} > max_perplexity_ratio {cfg.max_perplexity_ratio}")
    if cfg.max_perplexity_delta is not None:
        check("perplexity_delta", c_ppl - b_ppl, cfg.max_perplexity_delta, (c_ppl - b_ppl) <= cfg.max_perplexity_delta,
              f"perplexity {c_ppl:.4g} is {c_ppl - b_ppl:+.4g} over the baseline {b_ppl:.4g} > max_perplexity_delta {cfg.max_perplexity_delta}")
    agr = float(candidate.get("top1_agreement", float("nan")))
    m["gate_top1_agreement"] = agr
    if criteria == "fidelity":
        check("top1_agreement", agr, cfg.min_top1_agreement, agr >= cfg.min_top1_agreement,
              f"top-1 agreement {agr:.4f} < min_top1_agreement {cfg.min_top1_agreement}"
              + (" (not measured: evaluate with reference_artifact)" if math.isnan(agr) else ""))
        if cfg.max_kl is not None:
            kl = float(candidate.get("kl_to_reference", float("nan")))
            m["gate_kl"] = kl
            check("kl", kl, cfg.max_kl, kl <= cfg.max_kl,
                  f"KL to the baseline {kl:.4f} nats/token > max_kl {cfg.max_kl}"
                  + (" (not measured: evaluate with reference_artifact)" if math.isnan(kl) else ""))
    else:
        if cfg.max_heldout_perplexity_ratio is not None:
            hc, hb = candidate.get("heldout_perplexity"), baseline.get("heldout_perplexity")
            hr = float(hc) / float(hb) if hc is not None and hb else float("nan")
            m["gate_heldout_perplexity_ratio"] = hr
            check("heldout_perplexity_ratio", hr, cfg.max_heldout_perplexity_ratio,
                  hr <= cfg.max_heldout_perplexity_ratio,
                  f"held-out source perplexity is {hr:.4f}x the baseline's > max_heldout_perplexity_ratio "
                  f"{cfg.max_heldout_perplexity_ratio}" + (" (not measured: data.heldout_source is none; set one or "
                                                           "accept.max_heldout_perplexity_ratio=null)"
                                                           if math.isnan(hr) else ""))
        if cfg.max_downstream_drop is not None:
            dc = float(candidate.get("downstream_accuracy", float("nan")))
            db = float(baseline.get("downstream_accuracy", float("nan")))
            m["gate_downstream_accuracy"] = dc
            m["gate_downstream_drop"] = db - dc
            check("downstream_drop", db - dc, cfg.max_downstream_drop, db - dc <= cfg.max_downstream_drop,
                  f"downstream accuracy {dc:.3f} is {db - dc:+.3f} below the baseline's {db:.3f} > max_downstream_drop "
                  f"{cfg.max_downstream_drop}" + (" (not measured)" if math.isnan(db - dc) else ""))
    if cfg.min_throughput_ratio is not None:
        c_tps = _num(candidate, "decode_tokens_per_s", "candidate")
        b_tps = _num(baseline, "decode_tokens_per_s", "baseline")
        tr = c_tps / b_tps if b_tps > 0 else 0.0
        m["gate_throughput_ratio"] = tr
        check("throughput_ratio", tr, cfg.min_throughput_ratio, tr >= cfg.min_throughput_ratio,
              f"decode throughput {c_tps:.1f} tok/s is {tr:.3f}x the baseline {b_tps:.1f} < min_throughput_ratio {cfg.min_throughput_ratio}")
    if cfg.max_size_ratio is not None:
        sr = _num(candidate, "size_bytes", "candidate") / _num(baseline, "size_bytes", "baseline")
        m["gate_size_ratio"] = sr
        check("size_ratio", sr, cfg.max_size_ratio, sr <= cfg.max_size_ratio,
              f"size {candidate['size_bytes'] / 2**20:.1f} MiB is {sr:.3f}x the baseline > max_size_ratio {cfg.max_size_ratio}")
    m["gate_quality_criteria"] = float(criteria == "quality")
    return Verdict(not reasons, reasons, m, criteria, checks)


@dataclass
class AcceptanceResult:
    verdict: Verdict
    artifact: Path  # the last trial's artifact (the accepted one when verdict.accepted)
    report: object  # compress.quantize.QuantReport of that trial
    metrics: dict[str, float]  # evaluate_onnx of that trial
    baseline: dict[str, float]
    trials: list[dict]  # per trial: trial, float_groups, metrics, accepted, reasons


def quantize_with_acceptance(
    src_artifact: str | Path,
    out_dir: str | Path,
    calib_blocks: np.ndarray,
    eval_blocks: np.ndarray,
    qcfg: QuantizeConfig,
    acfg: AcceptConfig,
    baseline: dict | None = None,
    threads: int | None = None,
    on_trial: Callable[[int, dict], None] | None = None,
    eval_kwargs: dict | None = None,
) -> AcceptanceResult:
    """Quantize `src_artifact` (the fp32 baseline, also the agreement reference) into out_dir until the gate accepts.

    Trial 0 uses qcfg as is; each later trial keeps `relax_groups_per_trial` more groups in float, most
    sensitive first (sensitivity scan results when qcfg.sensitivity_trials > 0, else the activation-range
    proxy). Calibration runs once, on calib_blocks only; eval_blocks (the selection split) are used only for the
    loop's gate. The pipeline's verdict is the accept stage's, on the test split no trial has seen (tasks/accept.py).
    on_trial(i, record) is called after every trial (for MLflow child runs).
    """
    from compress.evaluate import evaluate_onnx
    from compress.quant_sensitivity import float_groups_by_sensitivity
    from compress.quantize import Quantizer

    src = Path(src_artifact)
    out_dir = Path(out_dir)
    ekw = dict(eval_kwargs or {})
    if threads:
        ekw.setdefault("threads", threads)
    # eval_kwargs may carry reference_top1 (the baseline's argmax on eval_blocks) to skip re-running the baseline
    ref = {} if "reference_top1" in ekw else {"reference_artifact": src}
    if baseline is None:
        # Without a reference, as the accept stage measures a baseline, so the quantize stage can hand its
        # figures on (agreement of the baseline with itself would only cost a second pass over eval_blocks).
        baseline = evaluate_onnx(src, eval_blocks, **{k: v for k, v in ekw.items() if k != "reference_top1"})
    q = Quantizer(src, calib_blocks, qcfg, threads=threads)
    extra: list[str] = []
    trials: list[dict] = []
    for i in range(acfg.relax_trials + 1):
        report = q.write(out_dir, extra)
        metrics = evaluate_onnx(out_dir, eval_blocks, **ref, **ekw)
        verdict = accept(metrics, baseline, acfg, criteria="fidelity")  # quantization: stay the source
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
