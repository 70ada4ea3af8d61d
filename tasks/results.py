"""What each stage hands on: one frozen dataclass per stage result, written as the stage's DONE.json and read back.

The field names are the contract between the tasks, the flow and the run summary. `from_json` takes exactly the
fields of the class: a DONE.json written under other names (an older format, or a renamed field) is refused with a
`ResultFormatError` naming the fields, and `open_stage` then computes the stage again instead of handing on a
result with a figure missing. A renamed field breaks the code that reads it (and its test), never a summary line.
"""

from __future__ import annotations

import hashlib
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from compress.evaluate.gate import CHECKS, gate_metric
from compress.export import FROM_CHECKPOINT_WEIGHTS

R = TypeVar("R", bound="StageResult")


class ResultFormatError(ValueError):
    """A DONE.json that is not a result of the expected class (written by another version of the code)."""


@dataclass(frozen=True)
class StageResult:
    """A stage's outputs (paths, figures). ``metrics``: what the stage logged, shown in the run's stage table."""

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls: type[R], data: dict[str, Any]) -> R:
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        unknown, missing = sorted(set(data) - names), sorted(required - set(data))
        if unknown or missing:
            raise ResultFormatError(f"not the fields of {cls.__name__}: " + "; ".join(
                part for part in (f"unknown fields {unknown}" if unknown else "",
                                  f"missing fields {missing}" if missing else "") if part))
        return cls(**data)


@dataclass(frozen=True)
class Loaded(StageResult):
    """load: the resolved checkpoint folder, the splits file (train / calib / eval) and the held-out one (test, the
    held-out source; only the accept stage opens it)."""

    model_dir: str
    splits: str
    heldout: str
    info: dict
    exporter_auto: list[str]  # what export.exporter auto gives for this model, and why (compress.export.choose_exporter)
    metrics: dict[str, float]


@dataclass(frozen=True)
class Exported(StageResult):
    """export: the artifact folder; ``weights`` as resolved (float32 | int8 | int4); ``record``, for a graph written
    from the checkpoint, the checkpoint's record by digest (the baseline version)."""

    artifact: str
    weights: str
    record: str | None
    metrics: dict[str, float]

    @property
    def from_checkpoint(self) -> bool:
        """Quantized weights written from the checkpoint: there is no fp32 graph."""
        return self.weights in FROM_CHECKPOINT_WEIGHTS


@dataclass(frozen=True)
class Golden(StageResult):
    """golden: the folder of the recorded golden outputs and the comparison's failures (none when it passed)."""

    golden: str
    failures: list
    metrics: dict[str, float]


@dataclass(frozen=True)
class FormGated(StageResult):
    """export_gate: a graph written from the checkpoint (export.weights auto) judged on the selection split against
    the checkpoint: passed or not, its forms-table row, and the figures the accept stage may reuse (``evaluation``:
    reference, splits, candidate, baseline)."""

    accepted: bool
    attempt: dict
    evaluation: dict
    metrics: dict[str, float]


@dataclass(frozen=True)
class FormsTimed(StageResult):
    """export_timing: the graphs written from the checkpoint that passed the selection split, timed against each
    other on the serving engine: the kept form and each form's speeds (``records``: decode_ms_per_step,
    tokens_per_s_b<N>)."""

    chosen: str
    records: dict[str, dict]
    metrics: dict[str, float]


@dataclass(frozen=True)
class Pruned(StageResult):
    """prune: the student checkpoint, its masks (unstructured pruning) and which teacher layers it kept."""

    model_dir: str
    masks: str | None
    teacher_layers: list[int] | None
    metrics: dict[str, float]


@dataclass(frozen=True)
class Distilled(StageResult):
    model_dir: str
    metrics: dict[str, float]


@dataclass(frozen=True)
class Quantized(StageResult):
    """quantize: the kept artifact; ``evaluation`` its figures and the source's on the selection split when a gate
    measured them (reference, splits, candidate, baseline); ``choice`` the forms `auto` weighed (tasks.quantize)."""

    artifact: str
    evaluation: dict | None
    choice: dict | None
    metrics: dict[str, float]


@dataclass(frozen=True)
class Judged(StageResult):
    """A verdict as the flow hands it on: the accept stage's (test split), a search branch's (selection split), or
    a rejection before the accept stage. ``gate``: the gate's own figures (gate_<check>); ``side``: the held-out
    source's and the selection split's (heldout_*, selection_*); ``metrics``: all the stage logged."""

    accepted: bool
    reasons: list[str]
    criteria: str
    checks: list[dict]
    metrics: dict[str, float]
    gate: dict[str, float] = field(default_factory=dict)
    candidate: dict = field(default_factory=dict)
    baseline: dict = field(default_factory=dict)
    side: dict[str, float] = field(default_factory=dict)
    split: str = "test"
    genres: list = field(default_factory=list)
    heldout_source: str | None = None
    selection: dict = field(default_factory=dict)
    evaluated_in: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    reference: str | None = None
    chat_note: str = ""
    chat_by_kind: dict = field(default_factory=dict)
    run_id: str | None = None

    @property
    def status(self) -> str:
        return "accepted" if self.accepted else "rejected"

    def figures(self) -> dict[str, float]:
        """The candidate's figures: its own (plain names: the split judged), the gate's and the side ones."""
        own = {k: v for k, v in self.candidate.items() if isinstance(v, (int, float))}
        return {**own, **self.gate, **self.side}

    def baseline_figures(self) -> dict[str, float]:
        """The baseline's figures under the candidate's names (plain = test split; heldout_perplexity, ...)."""
        figs = {k: v for k, v in self.baseline.items() if isinstance(v, (int, float))}
        figs.update({f"{p}_perplexity": self.side[f"{p}_baseline_perplexity"] for p in ("heldout", "selection")
                     if f"{p}_baseline_perplexity" in self.side})
        return figs

    def value(self, check: str) -> float:
        """A check's measured value (compress/evaluate/gate.py::CHECKS names it), applied or only reported."""
        return self.gate[gate_metric(check)]

    def gate_figures(self) -> dict[str, float]:
        """The gate's measured values by check name."""
        return {c.name: self.gate[gate_metric(c.name)] for c in CHECKS if gate_metric(c.name) in self.gate}

    def size_ratio(self) -> float | None:
        """The candidate's graph bytes over the baseline's."""
        c, b = self.candidate.get("size_bytes"), self.baseline.get("size_bytes")
        return c / b if c and b else None


def judged(verdict, **fields) -> Judged:
    """A compress.evaluate.gate.Verdict with the stage's own fields, as a Judged."""
    return Judged(accepted=verdict.accepted, reasons=list(verdict.reasons), criteria=verdict.criteria,
                  checks=list(verdict.checks), gate=dict(verdict.metrics), **fields)


@dataclass(frozen=True)
class Benchmarked(StageResult):
    """benchmark: the candidate's and the baseline's serving figures, their ratios, and the speed floor's word."""

    metrics: dict[str, float]
    candidate: dict[str, float]
    baseline: dict[str, float]
    ratios: dict[str, float]
    promotion_blocked: str | None
    genai: dict | None


@dataclass(frozen=True)
class SearchBaseline(StageResult):
    """search_baseline: the teacher's figures on the selection split, shared by every branch's gate."""

    figures: dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Registered:
    """What registering an artifact did: the version, its aliases, where it points, whether it existed already."""

    name: str
    version: str
    aliases: list[str]
    source: str
    reused: bool

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _layout() -> str:
    """A digest of every result class's name and fields, in order."""
    h = hashlib.sha256()
    for cls in sorted((c for c in globals().values() if isinstance(c, type) and c.__module__ == __name__
                       and hasattr(c, "__dataclass_fields__")), key=lambda c: c.__name__):
        h.update(f"{cls.__name__}({','.join(f.name for f in fields(cls))})".encode())
    return h.hexdigest()[:8]


# Part of every stage's Prefect cache key: a result Prefect pickled under another layout of these classes (a field
# renamed, added or dropped) is never handed on; the stage's DONE.json is then refused by from_json and recomputed.
RESULTS_FORMAT = _layout()
