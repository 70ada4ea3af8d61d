"""The pruning search's tasks: a branch of the fan-out (the candidate's chain, tasks/chain.py, then its gate on the
selection split), the teacher's figures every gate compares with, and the summary logged to the parent run
(compress/prune/search.py decides; docs/scaling.md).

A branch is gated on the selection split (the eval blocks, as the relax loop is), never on the test split: the
verdict of the picked candidate is still the accept stage's, on data no branch has seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
from prefect import task
from prefect.cache_policies import NONE

from compress.evaluate import accept, downstream_scores, evaluate_onnx, resolve_criteria
from compress.evaluate.gate import selection_limits
from compress.evaluate.settings import AcceptConfig
from compress.prune.search import (Candidate, best_rejected, describe, front_objectives, pareto_figure, pareto_front,
                                   pick_fastest_accepted, search_table)
from tasks.chain import Chain, ChainSettings, StageRecorder, TeacherStages, candidate_chain
from tasks.common import StageRun, cache_key_fn, mark_done, open_stage, submit_stage
from tasks.load import load_splits
from tasks.results import Judged, SearchBaseline, judged
from tasks.tracking import child_run, log_figure, log_json, log_metrics, log_params, log_rows


@dataclass(frozen=True)
class SearchGate:
    """What a branch's gate reads: the accept section (chat answer lengths, the downstream sample, the limits),
    search.selection_margin, whether the candidates are trained (pruned or distilled: the criteria's auto),
    search.chat_sets and data.seed."""

    accept: AcceptConfig
    margin: float
    trained: bool
    chat_sets: list[str]
    seed: int

    @property
    def limits(self) -> AcceptConfig:
        """accept's limits on the selection split: less the held-out source's check, each accuracy tolerance narrowed
        by the margin (compress.evaluate.gate.selection_limits)."""
        return selection_limits(self.accept, self.margin)

    @property
    def criteria(self) -> str:
        return resolve_criteria(self.accept, self.trained)


CHAT_FIGURES = ("chat_perplexity_ratio", "chat_top1_agreement", "chat_judged_ratio", "chat_late_divergence_share",
                "chat_items")


def search_chat_figures(gate: SearchGate, candidate: str, baseline: str, cache_dir: Path) -> dict[str, float]:
    """A branch's chat figures on search.chat_sets (never the gate's prompts; compress/config.py refuses that), in
    the model's chat template, against the teacher; {} when the sets are [] or the model has no chat template. The
    teacher's answers are cached beside the accept stage's (``cache_dir``), per teacher files and prompts."""
    from compress.evaluate.verdict import chat_figures

    chat, _ = chat_figures(gate.accept, candidate, baseline, cache_dir, sets=gate.chat_sets,
                           setting="search.chat_sets", progress=False)
    return {k: float(chat[k]) for k in CHAT_FIGURES if k in chat}


@task(name="search_baseline", cache_key_fn=cache_key_fn, persist_result=True)
def search_baseline_task(at: StageRun, *, gate: SearchGate, baseline: str, splits: str) -> SearchBaseline:
    """The teacher's figures on the selection split, measured once for every branch's gate."""
    folder, done = open_stage(at, SearchBaseline)
    if done is not None:
        return done
    with child_run(at.parent_run_id, at.stage):
        sel = load_splits(splits).selection
        figures = evaluate_onnx(baseline, sel)
        if gate.criteria == "quality" and gate.accept.max_downstream_drop is not None:
            figures.update(downstream_scores(baseline, sel, None, gate.accept.downstream_items, seed=gate.seed))
        log_metrics({f"search_baseline_{k}": v for k, v in figures.items()})
    return mark_done(folder, SearchBaseline(figures=figures))


@task(name="search_gate", cache_key_fn=cache_key_fn, persist_result=True)
def search_gate_task(at: StageRun, *, gate: SearchGate, ratio: float, candidate: str, baseline: str, splits: str,
                     baseline_figures: dict) -> Judged:
    """One branch's candidate (pruned by ``ratio``) against the teacher on the selection split, through the gate."""
    folder, done = open_stage(at, Judged)
    if done is not None:
        return done
    with child_run(at.parent_run_id, at.stage) as run:
        log_params({"search_mlp_ratio": ratio})
        sel = load_splits(splits).selection
        cand = evaluate_onnx(candidate, sel, reference_artifact=baseline)
        acfg = gate.limits
        if gate.criteria == "quality" and acfg.max_downstream_drop is not None:
            cand.update(downstream_scores(candidate, sel, None, acfg.downstream_items, seed=gate.seed))
        cand.update(search_chat_figures(gate, candidate, baseline, Path(at.workdir) / "chat_targets"))
        verdict = accept(cand, baseline_figures, acfg, gate.criteria)
        metrics = {"search_mlp_ratio": ratio, "search_accepted": float(verdict.accepted),
                   **{f"search_{k}": v for k, v in cand.items()},
                   **{f"search_{k}": v for k, v in verdict.metrics.items()}}
        log_metrics(metrics)
        if run is not None:
            mlflow.set_tag("search_mlp_ratio", str(ratio))
            log_json(verdict.record(candidate=cand, baseline=baseline_figures, split="selection"), "search_gate.json")
    return mark_done(folder, judged(verdict, candidate=cand, metrics=metrics, split="selection"))


@dataclass(frozen=True)
class Branch:
    """One branch of the search: its ratio, its chain and gate, and its stages' rows; or the error that ended it."""

    ratio: float
    chain: Chain | None = None
    gate: Judged | None = None
    rows: list[dict] = field(default_factory=list)
    error: str | None = None


@task(name="search_branch", cache_policy=NONE)
def search_branch_task(chain: ChainSettings, gate: SearchGate, tracking_uri: str, *, t: TeacherStages,
                       baseline_figures: dict) -> Branch:
    """One branch (``chain``: its sections, prune.mlp_ratio its ratio, and its keys): the candidate's chain, then its
    gate. No cache of its own: each stage inside caches under its key, so a re-run redoes only what is missing."""
    # On a Dask worker in another process (or machine) nothing has pointed MLflow at the store yet.
    mlflow.set_tracking_uri(tracking_uri)
    rec = StageRecorder()
    made = candidate_chain(chain, t, run=rec.run)
    from compress.evaluate.chat import sets_digest

    at = chain.ctx.at("search_gate", ["accept"], made.cand_key, t.k_exp, f"chat{sets_digest(gate.chat_sets)}")
    ratio = chain.prune.mlp_ratio
    judged_gate = rec.run("search_gate", submit_stage, search_gate_task, at, gate=gate, ratio=ratio,
                          candidate=made.candidate, baseline=t.teacher.artifact, splits=t.loaded.splits,
                          baseline_figures=baseline_figures)
    return Branch(ratio=ratio, chain=made, gate=judged_gate, rows=rec.rows)


def branch_candidate(branch: Branch, ms_per_token: float | None) -> Candidate:
    """A finished (or failed) branch as the search's Candidate; speed from the interleaved timing."""
    if branch.error:
        return Candidate(branch.ratio, math.nan, math.nan, math.nan, False, error=branch.error)
    cand = branch.gate.candidate
    ms = ms_per_token if ms_per_token is not None else cand.get("decode_ms_per_token", math.nan)
    return Candidate(ratio=branch.ratio, size_bytes=cand["size_bytes"], ms_per_token=ms,
                     perplexity_ratio=branch.gate.value("perplexity_ratio"),
                     accepted=branch.gate.accepted,
                     top1_agreement=cand.get("top1_agreement", math.nan), reasons=list(branch.gate.reasons),
                     chat_perplexity_ratio=cand.get("chat_perplexity_ratio", math.nan),
                     artifact=branch.chain.candidate)


def time_candidates(artifacts: dict[str, str], splits: str, rounds: int = 2, threads: int = 1) -> dict[str, float]:
    """Median batch-1 decode ms/token of each artifact, steps interleaved (compress.quantize.choice.decode_step_ms): the
    branches ran side by side on shared cores, so their own latencies do not compare; these do.

    One intra-op thread: the sessions' thread pools, each spinning between its steps, otherwise take the cores
    from each other (SmolLM2 on 2 loaded cores: 32 ms/token with the default threads against 8.7 with one, the
    accept stage's own timing 5.5) - as docs/pruning.md times decode steps.
    """
    import numpy as np

    from compress.quantize import decode_step_ms

    prompt = [int(t) for t in np.asarray(load_splits(splits).selection)[0][:32]]
    return decode_step_ms(artifacts, rounds=rounds, prompt=prompt, threads=threads)


@dataclass(frozen=True)
class SearchSummary:
    """The search's outcome: every candidate, the front, the pick (None when none passed) or else the best rejected
    one, the table's rows and the figures logged to the parent run; ``branch``, the chosen one (set by the flow)."""

    candidates: list[Candidate]
    front: list[Candidate]
    picked: Candidate | None
    best: Candidate | None
    rows: list[dict]
    teacher_ms_per_token: float
    metrics: dict[str, float]
    lines: list[str]
    branch: Branch | None = None


def summarize_search(branches: list[Branch], teacher_artifact: str, splits: str, title: str) -> SearchSummary:
    """Time the candidates side by side, compute the front and the pick, and log the table (search.json, an
    MLflow table search_table.json), search.csv and the plot (search_pareto.png) to the active (parent) run."""
    measured = {f"mlp{b.ratio:g}": b.chain.candidate for b in branches if not b.error}
    speed = time_candidates({"teacher": teacher_artifact, **measured}, splits) if measured else {}
    cands = [branch_candidate(b, speed.get(f"mlp{b.ratio:g}")) for b in branches]
    front = pareto_front(cands, front_objectives(cands))
    picked = pick_fastest_accepted(cands)
    best = picked or best_rejected(cands)
    rows = search_table(cands, front, picked)
    teacher_ms = speed.get("teacher", math.nan)
    for r in rows:
        r["speedup_vs_teacher"] = teacher_ms / r["ms_per_token"] if r["ms_per_token"] else math.nan
    log_json(rows, "search.json")
    log_rows(rows, "search_table.json")
    _log_csv(rows, "search.csv")
    log_figure(pareto_figure(cands, picked, title=title), "search_pareto.png")
    metrics = {"search_candidates": float(len(cands)), "search_accepted": float(sum(c.accepted for c in cands)),
               "search_front_size": float(len(front)), "search_teacher_ms_per_token": teacher_ms}
    if picked is not None:
        metrics.update({"search_picked_mlp_ratio": picked.ratio, "search_picked_ms_per_token": picked.ms_per_token,
                        "search_picked_size_bytes": picked.size_bytes,
                        "search_picked_perplexity_ratio": picked.perplexity_ratio})
    mlflow.set_tags({"search_picked": picked.name if picked else "none"})
    return SearchSummary(candidates=cands, front=front, picked=picked, best=best, rows=rows,
                         teacher_ms_per_token=teacher_ms, metrics=metrics, lines=[describe(c) for c in cands])


def _log_csv(rows: list[dict], name: str) -> None:
    import csv
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / name
        with p.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["candidate"])
            w.writeheader()
            w.writerows(rows)
        mlflow.log_artifact(str(p))
