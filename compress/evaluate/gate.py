"""The acceptance gate: a candidate's metrics against the baseline's, under tolerances from config.

`accept` is a pure function of two metric dicts (from compress.evaluate.onnx_eval.evaluate_onnx).
The accuracy-aware loop that quantizes, gates and relaxes until this gate accepts is the quantize
stage's (compress/quantize/relax.py: ``quantize_with_acceptance``).

Two criteria (accept.criteria): ``fidelity`` for a model that should stay the one it replaces
(quantization: perplexity ratio, top-1 agreement, KL) and ``quality`` for a pruned or distilled
student, a different model judged as a language model on held-out text (perplexity ratio, the
held-out source's perplexity ratio, downstream multiple-choice accuracy). Each applied check is
listed in ``Verdict.checks`` with its value, limit and what it answers (``WHY``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from compress.config import AcceptConfig


# What each check answers, stated in the verdict beside its numbers (Verdict.checks).
WHY = {
    "perplexity_ratio": "how well it predicts held-out text of the corpus's kind, against the baseline (both criteria)",
    "perplexity_delta": "the same, as an absolute perplexity increase",
    "top1_agreement": "fidelity: how often it picks the baseline's next token; a quantized model should be the baseline",
    "kl": "fidelity: how far its next-token distribution is from the baseline's",
    "heldout_perplexity_ratio": "quality: prediction of another genre (data.heldout_source); training on the corpus "
                                "can teach the corpus instead of the teacher",
    "downstream_drop": "quality: multiple-choice continuation accuracy on held-out text (compress/evaluate/downstream.py); "
                       "a student is a different model, judged on what it does rather than on imitation",
    "chat_perplexity_ratio": "use: how well it predicts the teacher's answers to held-out chat prompts, rendered with "
                             "the model's chat template (compress/evaluate/chat.py), against the teacher",
    "chat_top1_agreement": "use: how often it picks the teacher's next token inside those answers",
    "chat_judged_ratio": "use: the teacher's perplexity of the candidate's own greedy answers over that of its own; "
                         "what users read is what the candidate writes, not what it would score",
    "chat_late_divergence_share": "use: the share of answers that follow the teacher's for at least "
                                  "accept.chat_divergence_tokens tokens",
    "throughput_ratio": "speed floor: batch-1 decode tokens/s against the baseline",
    "size_ratio": "size ceiling: artifact bytes against the baseline",
}


# Which text each check reads: the verdict lists the genres, each must pass (the worst decides, never an average).
GENRE = {"perplexity_ratio": "test", "perplexity_delta": "test", "top1_agreement": "test", "kl": "test",
         "heldout_perplexity_ratio": "heldout", "downstream_drop": "downstream", "chat_perplexity_ratio": "chat",
         "chat_top1_agreement": "chat", "chat_judged_ratio": "chat_judged", "chat_late_divergence_share": "chat_judged",
         "throughput_ratio": "speed", "size_ratio": "size"}

# accept.*chat* "auto" limits by criteria. A quantized model should be the teacher on its own answers (INT8 of
# SmolLM2: 1.0xx, agreement 0.9x, docs/evaluation.md); a pruned or distilled student is another model and may
# lose more, within a stated bound.
CHAT_LIMITS = {"fidelity": {"max_chat_perplexity_ratio": 1.05, "min_chat_top1_agreement": 0.85, "max_chat_judged_ratio": 1.10},
               "quality": {"max_chat_perplexity_ratio": 1.10, "min_chat_top1_agreement": None, "max_chat_judged_ratio": 1.25}}


def chat_limit(cfg: AcceptConfig, name: str, criteria: str) -> float | None:
    """An accept.*chat* limit with "auto" made concrete for the criteria."""
    v = getattr(cfg, name)
    return CHAT_LIMITS[criteria][name] if v == "auto" else v


@dataclass
class Verdict:
    accepted: bool
    reasons: list[str]  # one line per failed tolerance, with the numbers
    metrics: dict[str, float] = field(default_factory=dict)  # the gate's own figures (ratios, deltas)
    criteria: str = "fidelity"  # the resolved criteria: fidelity | quality
    checks: list[dict] = field(default_factory=list)  # name, value, limit, passed, why: every tolerance applied

    def __bool__(self) -> bool:
        return self.accepted

    def record(self, **extra) -> dict:
        """The verdict as stages hand it on and log it (verdict.json, a stage's DONE.json, the flow): accepted,
        reasons, criteria, checks and metrics, plus the stage's own fields (``extra`` wins on a clash)."""
        return {"accepted": self.accepted, "reasons": list(self.reasons), "criteria": self.criteria,
                "checks": list(self.checks), "metrics": dict(self.metrics), **extra}


def _num(d: dict, key: str, who: str) -> float:
    if key not in d or d[key] is None:
        raise KeyError(f"accept: the {who} metrics have no {key!r}; evaluate it with compress.evaluate.onnx_eval.evaluate_onnx")
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
        checks.append({"name": name, "genre": GENRE[name], "value": value, "limit": limit, "passed": bool(ok),
                       "why": WHY[name]})
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
    if cfg.max_heldout_perplexity_ratio is not None:  # another genre: both criteria, when a limit is set
        hc, hb = candidate.get("heldout_perplexity"), baseline.get("heldout_perplexity")
        hr = float(hc) / float(hb) if hc is not None and hb else float("nan")
        m["gate_heldout_perplexity_ratio"] = hr
        check("heldout_perplexity_ratio", hr, cfg.max_heldout_perplexity_ratio,
              hr <= cfg.max_heldout_perplexity_ratio,
              f"held-out source perplexity is {hr:.4f}x the baseline's > max_heldout_perplexity_ratio "
              f"{cfg.max_heldout_perplexity_ratio}" + (" (not measured: data.heldout_source is none; set one or "
                                                       "accept.max_heldout_perplexity_ratio=null)"
                                                       if math.isnan(hr) else ""))
    if criteria == "quality":
        if cfg.max_downstream_drop is not None:
            dc = float(candidate.get("downstream_accuracy", float("nan")))
            db = float(baseline.get("downstream_accuracy", float("nan")))
            m["gate_downstream_accuracy"] = dc
            m["gate_downstream_drop"] = db - dc
            check("downstream_drop", db - dc, cfg.max_downstream_drop, db - dc <= cfg.max_downstream_drop,
                  f"downstream accuracy {dc:.3f} is {db - dc:+.3f} below the baseline's {db:.3f} > max_downstream_drop "
                  f"{cfg.max_downstream_drop}" + (" (not measured)" if math.isnan(db - dc) else ""))
    if "chat_perplexity_ratio" in candidate:  # measured: the model has a chat template and accept.chat_sets is set
        _chat_checks(candidate, cfg, criteria, m, check)
    if cfg.min_decode_speed_ratio is not None:
        c_tps = _num(candidate, "decode_tokens_per_s", "candidate")
        b_tps = _num(baseline, "decode_tokens_per_s", "baseline")
        tr = c_tps / b_tps if b_tps > 0 else 0.0
        m["gate_decode_speed_ratio"] = tr
        check("throughput_ratio", tr, cfg.min_decode_speed_ratio, tr >= cfg.min_decode_speed_ratio,
              f"decode throughput {c_tps:.1f} tok/s is {tr:.3f}x the baseline {b_tps:.1f} < min_decode_speed_ratio "
              f"{cfg.min_decode_speed_ratio}")
    if cfg.max_size_ratio is not None:
        sr = _num(candidate, "size_bytes", "candidate") / _num(baseline, "size_bytes", "baseline")
        m["gate_size_ratio"] = sr
        check("size_ratio", sr, cfg.max_size_ratio, sr <= cfg.max_size_ratio,
              f"size {candidate['size_bytes'] / 2**20:.1f} MiB is {sr:.3f}x the baseline > max_size_ratio {cfg.max_size_ratio}")
    ratios = {g: m[f"gate_{k}"] for g, k in (("test", "perplexity_ratio"), ("heldout", "heldout_perplexity_ratio"),
                                              ("chat", "chat_perplexity_ratio")) if f"gate_{k}" in m}
    if ratios:  # the genre the candidate does worst on, as a figure (the verdict already needs every genre to pass)
        m["gate_worst_perplexity_ratio"] = max(v if math.isfinite(v) else math.inf for v in ratios.values())
    m["gate_quality_criteria"] = float(criteria == "quality")
    return Verdict(not reasons, reasons, m, criteria, checks)


def _chat_checks(c: dict, cfg: AcceptConfig, criteria: str, m: dict, check) -> None:
    """The chat set's tolerances (compress/evaluate/chat.py figures, each already a ratio to the teacher)."""
    n = int(c.get("chat_items", 0))
    r = float(c["chat_perplexity_ratio"])
    m["gate_chat_perplexity_ratio"] = r
    if (lim := chat_limit(cfg, "max_chat_perplexity_ratio", criteria)) is not None:
        check("chat_perplexity_ratio", r, lim, math.isfinite(r) and r <= lim,
              f"chat: perplexity of the teacher's answers to {n} held-out chat prompts is {r:.4f}x the teacher's "
              f"> max_chat_perplexity_ratio {lim}")
    agr = float(c.get("chat_top1_agreement", float("nan")))
    m["gate_chat_top1_agreement"] = agr
    if (lim := chat_limit(cfg, "min_chat_top1_agreement", criteria)) is not None:
        check("chat_top1_agreement", agr, lim, agr >= lim,
              f"chat: top-1 agreement with the teacher inside its answers {agr:.4f} < min_chat_top1_agreement {lim}")
    if "chat_judged_ratio" in c:
        j = float(c["chat_judged_ratio"])
        m["gate_chat_judged_ratio"] = j
        if (lim := chat_limit(cfg, "max_chat_judged_ratio", criteria)) is not None:
            check("chat_judged_ratio", j, lim, math.isfinite(j) and j <= lim,
                  f"chat: the teacher finds the candidate's own answers {j:.4f}x as perplexing as its own "
                  f"> max_chat_judged_ratio {lim}")
        share = float(c["chat_late_divergence_share"])
        m["gate_chat_late_divergence_share"] = share
        if cfg.min_chat_late_divergence_share is not None:
            lim = cfg.min_chat_late_divergence_share
            check("chat_late_divergence_share", share, lim, share >= lim,
                  f"chat: only {share:.3f} of the answers follow the teacher's for {cfg.chat_divergence_tokens}+ tokens "
                  f"< min_chat_late_divergence_share {lim}")


def genre_table(checks: list[dict]) -> list[dict]:
    """One row per genre: passed only when every check of it passed; its checks' values and limits."""
    rows: dict[str, dict] = {}
    for c in checks:
        r = rows.setdefault(c["genre"], {"genre": c["genre"], "passed": True, "checks": []})
        r["passed"] = r["passed"] and c["passed"]
        r["checks"].append(c)
    return list(rows.values())


# What is compared between an accepted candidate and the current champion (registered figures of both): key,
# whether lower is better, what it says. The first is the use set, which decides promotion (registry.promote_when_worse).
VERSUS_CHAMPION = (("chat_perplexity_ratio", True, "chat set perplexity ratio to the teacher"),
                   ("chat_judged_ratio", True, "teacher-judged chat answers"),
                   ("gate_perplexity_ratio", True, "test split perplexity ratio"),
                   ("heldout_perplexity_ratio", True, "held-out source perplexity ratio"),
                   ("size_bytes", True, "artifact bytes"),
                   ("decode_ms_per_token", True, "batch-1 decode ms/token"))


def versus_champion(candidate: dict, champion: dict, rel_tol: float = 1e-3) -> dict:
    """Which of the two is better on each figure both have (within rel_tol: "same"), and whether the candidate is
    worse on the use set (the chat set's perplexity ratio); ``use_measured`` is False when either lacks it."""
    rows = []
    for key, lower, what in VERSUS_CHAMPION:
        if key in candidate and key in champion:
            c, h = float(candidate[key]), float(champion[key])
            same = math.isclose(c, h, rel_tol=rel_tol)
            better = "same" if same else ("candidate" if (c < h) == lower else "champion")
            rows.append({"key": key, "what": what, "candidate": c, "champion": h, "better": better})
    use = next((r for r in rows if r["key"] == VERSUS_CHAMPION[0][0]), None)
    return {"rows": rows, "use_measured": use is not None, "worse_on_use": bool(use and use["better"] == "champion"),
            "use": use}
