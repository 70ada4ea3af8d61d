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


# accept.*chat* "auto" limits by criteria. A quantized model should be the teacher on its own answers (INT8 of
# SmolLM2: 1.0xx, agreement 0.9x, docs/evaluation.md); a pruned or distilled student is another model and may
# lose more, within a stated bound.
# A quantized model should mostly give the baseline's constrained answers (fidelity); a student is judged by validity.
CHAT_LIMITS = {"fidelity": {"max_chat_perplexity_ratio": 1.05, "min_chat_top1_agreement": 0.85, "max_chat_judged_ratio": 1.10,
                            "min_structured_agreement": 0.5},
               "quality": {"max_chat_perplexity_ratio": 1.10, "min_chat_top1_agreement": None, "max_chat_judged_ratio": 1.25,
                           "min_structured_agreement": None}}

BOTH = ("fidelity", "quality")


@dataclass(frozen=True)
class Check:
    """One row of the gate: the check ``name`` is also its metric (``gate_<name>``) and the suffix of its limit,
    ``accept.<limit>``; ``upper``: the value must stay at or under the limit (else at or over it)."""

    name: str
    limit: str
    upper: bool
    genre: str  # which text it reads: the verdict lists the genres, each must pass (the worst decides)
    criteria: tuple[str, ...]  # the accept.criteria it applies under
    narrow: str | None  # how search.selection_margin narrows it on the selection split: ratio | scale | share
    why: str  # what it answers, stated in the verdict beside its numbers (Verdict.checks)
    message: str  # the reason when it fails: str.format over value, limit and the check's own figures


def gate_metric(name: str) -> str:
    """The metric a check logs its value under (its name in a verdict's ``metrics``)."""
    return f"gate_{name}"


# The gate, in the order its reasons are listed. compress/evaluate/gate.py::accept measures and checks every row;
# the search's selection gate (selection_limits) and the quantize stage's relax loop call the same accept.
CHECKS: tuple[Check, ...] = (
    Check("perplexity_ratio", "max_perplexity_ratio", True, "test", BOTH, "ratio",
          "how well it predicts held-out text of the corpus's kind, against the baseline (both criteria)",
          "perplexity {c:.4g} is {value:.4f}x the baseline {b:.4g} > max_perplexity_ratio {limit}"),
    Check("perplexity_delta", "max_perplexity_delta", True, "test", BOTH, "scale",
          "the same, as an absolute perplexity increase",
          "perplexity {c:.4g} is {value:+.4g} over the baseline {b:.4g} > max_perplexity_delta {limit}"),
    Check("top1_agreement", "min_top1_agreement", False, "test", ("fidelity",), "share",
          "fidelity: how often it picks the baseline's next token; a quantized model should be the baseline",
          "top-1 agreement {value:.4f} < min_top1_agreement {limit}{unmeasured}"),
    Check("kl", "max_kl", True, "test", ("fidelity",), "scale",
          "fidelity: how far its next-token distribution is from the baseline's",
          "KL to the baseline {value:.4f} nats/token > max_kl {limit}{unmeasured}"),
    Check("heldout_perplexity_ratio", "max_heldout_perplexity_ratio", True, "heldout", BOTH, None,
          "quality: prediction of another genre (data.heldout_source); training on the corpus can teach the corpus "
          "instead of the teacher",
          "held-out source perplexity is {value:.4f}x the baseline's > max_heldout_perplexity_ratio {limit}"
          "{unmeasured}"),
    Check("downstream_drop", "max_downstream_drop", True, "downstream", ("quality",), "scale",
          "quality: multiple-choice continuation accuracy on held-out text (compress/evaluate/downstream.py); "
          "a student is a different model, judged on what it does rather than on imitation",
          "downstream accuracy {c:.3f} is {value:+.3f} below the baseline's {b:.3f} > max_downstream_drop {limit}"
          "{unmeasured}"),
    Check("chat_perplexity_ratio", "max_chat_perplexity_ratio", True, "chat", BOTH, None,
          "use: how well it predicts the teacher's answers to held-out chat prompts, rendered with the model's chat "
          "template (compress/evaluate/chat.py), against the teacher",
          "chat: perplexity of the teacher's answers to {n} held-out chat prompts is {value:.4f}x the teacher's "
          "> max_chat_perplexity_ratio {limit}"),
    Check("chat_top1_agreement", "min_chat_top1_agreement", False, "chat", BOTH, None,
          "use: how often it picks the teacher's next token inside those answers",
          "chat: top-1 agreement with the teacher inside its answers {value:.4f} < min_chat_top1_agreement {limit}"),
    Check("chat_judged_ratio", "max_chat_judged_ratio", True, "chat_judged", BOTH, None,
          "use: the teacher's perplexity of the candidate's own greedy answers over that of its own; what users "
          "read is what the candidate writes, not what it would score",
          "chat: the teacher finds the candidate's own answers {value:.4f}x as perplexing as its own "
          "> max_chat_judged_ratio {limit}"),
    Check("chat_late_divergence_share", "min_chat_late_divergence_share", False, "chat_judged", BOTH, None,
          "use: the share of answers that follow the teacher's for at least accept.chat_divergence_tokens tokens",
          "chat: only {value:.3f} of the answers follow the teacher's for {tokens}+ tokens "
          "< min_chat_late_divergence_share {limit}"),
    Check("structured_valid_drop", "max_structured_valid_drop", True, "structured", BOTH, None,
          "use by programs: the share of free answers that are valid JSON of the task's schema or a valid call of an "
          "offered tool (compress/evaluate/structured.py), against the baseline's; compression can break JSON and "
          "tool calls while perplexity holds",
          "structured: {c:.3f} of {n} free answers are valid against the baseline's {b:.3f}, a drop of {value:.3f} "
          "> max_structured_valid_drop {limit}"),
    Check("structured_agreement", "min_structured_agreement", False, "structured", BOTH, None,
          "use by programs: how much of the constrained answers (JSON schema, a forced tool call) is the "
          "baseline's, field by field: the same tool with the same arguments, the same value under each key",
          "structured: {value:.3f} of the fields of {n} constrained answers equal the baseline's (another tool "
          "scores 0) < min_structured_agreement {limit}"),
    Check("decode_speed_ratio", "min_decode_speed_ratio", False, "speed", BOTH, None,
          "speed floor: batch-1 decode tokens/s against the baseline",
          "decode throughput {c:.1f} tok/s is {value:.3f}x the baseline {b:.1f} < min_decode_speed_ratio {limit}"),
    Check("size_ratio", "max_size_ratio", True, "size", BOTH, None,
          "size ceiling: artifact bytes against the baseline",
          "size {mib:.1f} MiB is {value:.3f}x the baseline > max_size_ratio {limit}"),
)
CHECK = {c.name: c for c in CHECKS}
WHY = {c.name: c.why for c in CHECKS}
GENRE = {c.name: c.genre for c in CHECKS}


def chat_limit(cfg: AcceptConfig, name: str, criteria: str) -> float | None:
    """An accept.*chat* limit with "auto" made concrete for the criteria."""
    v = getattr(cfg, name)
    return CHAT_LIMITS[criteria][name] if v == "auto" else v


def limit_of(cfg: AcceptConfig, check: Check, criteria: str) -> float | None:
    """The check's limit under the criteria ("auto" made concrete); None when it is not checked."""
    if criteria not in check.criteria:
        return None
    return chat_limit(cfg, check.limit, criteria)


def selection_limits(cfg: AcceptConfig, margin: float) -> AcceptConfig:
    """The gate's limits on the selection split (the pruning search's gate): each accuracy limit narrowed by
    ``margin`` (search.selection_margin) as its row says, the held-out source's check dropped (that text is read
    by the verdict only)."""
    keep, update = 1.0 - margin, {"max_heldout_perplexity_ratio": None}
    for c in CHECKS:
        v = getattr(cfg, c.limit)
        if c.narrow is None or v is None or v == "auto":
            continue
        update[c.limit] = {"ratio": 1.0 + (v - 1.0) * keep, "scale": v * keep, "share": 1.0 - (1.0 - v) * keep}[c.narrow]
    return cfg.model_copy(update=update)


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


def _ratio(c: dict, b: dict, key: str) -> tuple[float, dict]:
    cv, bv = c.get(key), b.get(key)
    return (float(cv) / float(bv) if cv is not None and bv else float("nan")), {}


def _measure(name: str, c: dict, b: dict, cfg: AcceptConfig) -> tuple[float, dict]:
    """A check's value and the figures its message names. Metrics a check cannot do without raise KeyError."""
    nan = float("nan")
    if name in ("perplexity_ratio", "perplexity_delta"):
        cp, bp = _num(c, "perplexity", "candidate"), _num(b, "perplexity", "baseline")
        if name == "perplexity_delta":
            return cp - bp, {"c": cp, "b": bp}
        return (cp / bp if bp > 0 else math.inf), {"c": cp, "b": bp}
    if name in ("top1_agreement", "kl"):
        return float(c.get("top1_agreement" if name == "top1_agreement" else "kl_to_reference", nan)), {}
    if name == "heldout_perplexity_ratio":
        return _ratio(c, b, "heldout_perplexity")
    if name == "downstream_drop":
        dc, db = float(c.get("downstream_accuracy", nan)), float(b.get("downstream_accuracy", nan))
        return db - dc, {"c": dc, "b": db}
    if name.startswith("chat_"):
        return float(c.get(name, nan)), {"n": int(c.get("chat_items", 0)), "tokens": cfg.chat_divergence_tokens}
    if name.startswith("structured_"):
        return float(c.get(name, nan)), {"n": int(c.get("structured_tasks", 0)),
                                         "c": float(c.get("structured_valid_share", nan)),
                                         "b": float(b.get("structured_valid_share", nan))}
    if name == "decode_speed_ratio":
        ct, bt = _num(c, "decode_tokens_per_s", "candidate"), _num(b, "decode_tokens_per_s", "baseline")
        return (ct / bt if bt > 0 else 0.0), {"c": ct, "b": bt}
    if name == "size_ratio":
        cs = _num(c, "size_bytes", "candidate")
        return cs / _num(b, "size_bytes", "baseline"), {"mib": cs / 2**20}
    raise ValueError(f"gate: no measure for check {name!r}")


# Why a value is missing, added to a failed check's reason.
UNMEASURED = {"top1_agreement": " (not measured: evaluate with reference_artifact)",
              "kl": " (not measured: evaluate with reference_artifact)",
              "heldout_perplexity_ratio": " (not measured: data.heldout_source is none; set one or "
                                          "accept.max_heldout_perplexity_ratio=null)",
              "downstream_drop": " (not measured)"}
# Figures the gate always reports, checked or not.
ALWAYS = ("perplexity_ratio", "perplexity_delta", "top1_agreement")


def _measured(name: str, c: dict) -> bool:
    """Whether the candidate's figures hold what the check reads: the chat rows only when the chat set ran (the
    model has a chat template and accept.chat_sets is set), the judged rows only when answers were judged."""
    if name in ("chat_perplexity_ratio", "chat_top1_agreement"):
        return "chat_perplexity_ratio" in c
    if name in ("chat_judged_ratio", "chat_late_divergence_share"):
        return "chat_perplexity_ratio" in c and "chat_judged_ratio" in c
    if name.startswith("structured_"):
        return "structured_agreement" in c
    return True


def accept(candidate: dict, baseline: dict, cfg: AcceptConfig, criteria: str | None = None) -> Verdict:
    """Accept when every check of the criteria (CHECKS) with a limit holds; a NaN or infinite value always fails.

    criteria: fidelity | quality (default: cfg.criteria, auto read as fidelity; the pipeline resolves auto
    with resolve_criteria). Every check that applies and is measured reports its figure as ``gate_<name>``.
    """
    criteria = criteria or (cfg.criteria if cfg.criteria != "auto" else "fidelity")
    if criteria not in ("fidelity", "quality"):
        raise ValueError(f"accept criteria {criteria!r}: allowed values are 'fidelity', 'quality'")
    reasons: list[str] = []
    checks: list[dict] = []
    m: dict[str, float] = {}
    for row in CHECKS:
        limit = limit_of(cfg, row, criteria)
        if not _measured(row.name, candidate) or (limit is None and row.name not in ALWAYS
                                                  and not row.name.startswith(("chat_", "structured_"))):
            continue
        value, figures = _measure(row.name, candidate, baseline, cfg)
        m[gate_metric(row.name)] = value
        if row.name == "downstream_drop":
            m["gate_downstream_accuracy"] = figures["c"]
        if limit is None:
            continue
        ok = math.isfinite(value) and (value <= limit if row.upper else value >= limit)
        checks.append({"name": row.name, "genre": row.genre, "value": value, "limit": limit, "passed": bool(ok),
                       "why": row.why})
        if not ok:
            unmeasured = UNMEASURED.get(row.name, "") if math.isnan(value) else ""
            reasons.append(row.message.format(value=value, limit=limit, unmeasured=unmeasured, **figures))
    ratios = {g: m[gate_metric(k)] for g, k in (("test", "perplexity_ratio"), ("heldout", "heldout_perplexity_ratio"),
                                                 ("chat", "chat_perplexity_ratio")) if gate_metric(k) in m}
    if ratios:  # the genre the candidate does worst on, as a figure (the verdict already needs every genre to pass)
        m["gate_worst_perplexity_ratio"] = max(v if math.isfinite(v) else math.inf for v in ratios.values())
    m["gate_quality_criteria"] = float(criteria == "quality")
    return Verdict(not reasons, reasons, m, criteria, checks)


def failed_checks(verdict: Verdict) -> str:
    """The failed checks of a verdict with their values and limits, e.g. 'top1_agreement 0.885 (limit 0.9)'."""
    return "; ".join(f"{c['name']} {c['value']:.4g} (limit {c['limit']:.4g})" for c in verdict.checks
                     if not c["passed"]) or "; ".join(verdict.reasons)


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
