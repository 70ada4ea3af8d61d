"""The pruning search's tasks: one candidate's chain of stages, a branch of the fan-out, its gate on the
selection split, and the summary logged to the parent run (compress/prune/search.py decides; docs/scaling.md).

`candidate_chain` is the single-candidate path of flows/pipeline.py too (prune -> distill -> student export +
golden -> quantize), so a branch and a plain run compute the same stages under the same cache keys: a branch's
ratio is its config's `prune.mlp_ratio`, which every key downstream of prune hashes.

A branch is gated on the selection split (the eval blocks, as the relax loop is), never on the test split: the
verdict of the picked candidate is still the accept stage's, on data no branch has seen.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import mlflow
from prefect import task
from prefect.cache_policies import NONE

from compress.config import PipelineConfig
from compress.evaluate import accept, downstream_scores, evaluate_onnx, resolve_criteria
from compress.evaluate.gate import selection_limits
from compress.export import EXPORT_FORMAT
from compress.quantize import QUANT_FORMAT
from compress.resolve import ResolvedConfig
from compress.prune.search import (Candidate, best_rejected, describe, front_objectives, pareto_figure, pareto_front,
                             pick_fastest_accepted, search_table)
from tasks.common import cache_key_fn, mark_done, open_stage, stage_key, stage_logger, submit_stage, workdir
from tasks.distill import distill_task
from tasks.export import export_task
from tasks.golden import golden_task
from tasks.load import load_splits
from tasks.prune import prune_task
from tasks.quantize import quantize_task
from tasks.results import Exported, Golden, Judged, Loaded, Quantized, SearchBaseline, judged
from tasks.tracking import child_run, log_figure, log_json, log_metrics, log_params, log_rows


def _plain_run(name: str, fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


class StageRecorder:
    """Each stage's row (name, wall seconds, the figures its result logged) as ``run`` calls it: the flow's
    summary table, or a search branch's rows."""

    def __init__(self):
        self.rows: list[dict] = []

    def run(self, name: str, fn: Callable, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.rows.append({"stage": name, "seconds": time.perf_counter() - t0,
                          "metrics": dict(getattr(out, "metrics", None) or {})})
        return out


@dataclass(frozen=True)
class Chain:
    """What a candidate's chain made: the candidate artifact, its cache key (what the accept and benchmark keys chain
    from), the quantize stage's result (None when off; for a graph export.weights auto wrote from the checkpoint,
    the forms the export weighed) and the student's checkpoint folder."""

    candidate: str
    cand_key: str
    quant: Quantized | None
    student_dir: str


@dataclass(frozen=True)
class TeacherStages:
    """load -> export -> golden, the stages every run shares; their keys are the candidate chain's roots.
    ``resolved``: the run's config with every `auto` made concrete after load (compress/resolve/settings.py)."""

    resolved: ResolvedConfig
    k_load: str
    loaded: Loaded
    k_exp: str
    teacher: Exported
    gold: Golden
    # export.weights auto from the checkpoint: the forms the export weighed on the selection split (tasks/export_gate.py)
    forms: Quantized | None = None


def candidate_chain(cfg: PipelineConfig, pid: str | None, t: TeacherStages, run: Callable = _plain_run) -> Chain:
    """prune -> distill -> export + golden of the student -> quantize, each switched on by `cfg`.

    run(name, fn, *args, **kwargs) calls each stage (the flow's StageTimer.run, or a branch's recorder).
    """
    loaded, teacher = t.loaded, t.teacher
    student_dir, masks, layers, key = loaded.model_dir, None, None, t.k_load
    if cfg.prune.enabled:
        key = stage_key(cfg, "prune", ["prune"], key)
        pruned = run("prune", submit_stage, prune_task, cfg, "prune", key, parent_run_id=pid,
                     model_dir=student_dir, splits=loaded.splits)
        student_dir, masks, layers = pruned.model_dir, pruned.masks, pruned.teacher_layers
    if cfg.distill.enabled:
        key = stage_key(cfg, "distill", ["distill"], key)
        distilled = run("distill", submit_stage, distill_task, cfg, "distill", key, parent_run_id=pid,
                        teacher_dir=loaded.model_dir, student_dir=student_dir, splits=loaded.splits, masks=masks,
                        teacher_layers=layers)
        student_dir = distilled.model_dir
    candidate, cand_key = teacher.artifact, t.k_exp
    if student_dir != loaded.model_dir:
        cand_key = stage_key(cfg, "export_student", ["export"], key, f"format{EXPORT_FORMAT}")
        student = run("export_student", submit_stage, export_task, cfg, "export_student", cand_key,
                      parent_run_id=pid, model_dir=student_dir)
        k = stage_key(cfg, "golden_student", ["golden"], cand_key)
        run("golden_student", submit_stage, golden_task, cfg, "golden_student", k, parent_run_id=pid,
            model_dir=student_dir, artifact=student.artifact, reference_golden=t.gold.golden)
        candidate = student.artifact
    quant = None
    if teacher.from_checkpoint:
        quant = t.forms  # the forms export.weights auto weighed, when it did
        # the export wrote the weight-only INT8 (4-bit) graph from the checkpoint: it is the candidate, nothing is
        # left to quantize (W8A8 would calibrate the fp32 graph, which was never written)
        stage_logger().info("quantize: skipped, the export wrote the %s candidate from the checkpoint "
                            "(export.weights %s)", teacher.weights.upper(), teacher.weights)
    elif cfg.quantize.enabled:
        cand_key = stage_key(cfg, "quantize", ["quantize", "accept"], cand_key, f"format{QUANT_FORMAT}")
        quant = run("quantize", submit_stage, quantize_task, cfg, "quantize", cand_key, parent_run_id=pid,
                    src_artifact=candidate, splits=loaded.splits)
        candidate = quant.artifact
    return Chain(candidate=candidate, cand_key=cand_key, quant=quant, student_dir=student_dir)


def branch_config(cfg: PipelineConfig, ratio: float) -> PipelineConfig:
    """`cfg` with prune.mlp_ratio = ratio, validated: the config of that one branch (and of the pick, after)."""
    dump = cfg.model_dump(mode="json")
    dump["prune"]["mlp_ratio"] = ratio
    return PipelineConfig.model_validate(dump)


def gate_config(cfg: PipelineConfig):
    """The gate's tolerances on the selection split (compress.evaluate.gate.selection_limits): as accept's, less
    the held-out source's check, each accuracy tolerance narrowed by ``search.selection_margin``."""
    return selection_limits(cfg.accept, cfg.search.selection_margin)


CHAT_FIGURES = ("chat_perplexity_ratio", "chat_top1_agreement", "chat_judged_ratio", "chat_late_divergence_share",
                "chat_items")


def search_chat_figures(cfg: PipelineConfig, candidate: str, baseline: str) -> dict[str, float]:
    """A branch's chat figures on search.chat_sets (never the gate's prompts; compress/config.py refuses that), in
    the model's chat template, against the teacher; {} when the sets are [] or the model has no chat template. The
    teacher's answers are cached beside the accept stage's, per teacher files and prompts."""
    from compress.evaluate.verdict import chat_figures

    chat, _ = chat_figures(cfg, candidate, baseline, workdir(cfg) / "chat_targets", setting="search.chat_sets",
                           progress=False)
    return {k: float(chat[k]) for k in CHAT_FIGURES if k in chat}


def _criteria(cfg: PipelineConfig) -> str:
    return resolve_criteria(cfg.accept, cfg.prune.enabled or cfg.distill.enabled)


@task(name="search_baseline", cache_key_fn=cache_key_fn, persist_result=True)
def search_baseline_task(cfg: PipelineConfig, stage: str, key: str, parent_run_id: str | None, baseline: str,
                         splits: str) -> SearchBaseline:
    """The teacher's figures on the selection split, measured once for every branch's gate."""
    folder, done = open_stage(cfg, stage, key, SearchBaseline)
    if done is not None:
        return done
    with child_run(parent_run_id, stage):
        sel = load_splits(splits).selection
        figures = evaluate_onnx(baseline, sel)
        if _criteria(cfg) == "quality" and cfg.accept.max_downstream_drop is not None:
            figures.update(downstream_scores(baseline, sel, None, cfg.accept.downstream_items, seed=cfg.data.seed))
        log_metrics({f"search_baseline_{k}": v for k, v in figures.items()})
    return mark_done(folder, SearchBaseline(figures=figures))


@task(name="search_gate", cache_key_fn=cache_key_fn, persist_result=True)
def search_gate_task(cfg: PipelineConfig, stage: str, key: str, *, parent_run_id: str | None, candidate: str,
                     baseline: str, splits: str, baseline_figures: dict) -> Judged:
    """One branch's candidate against the teacher on the selection split, through the gate (`gate_config`)."""
    folder, done = open_stage(cfg, stage, key, Judged)
    if done is not None:
        return done
    with child_run(parent_run_id, stage) as run:
        log_params({"search_mlp_ratio": cfg.prune.mlp_ratio})
        sel = load_splits(splits).selection
        cand = evaluate_onnx(candidate, sel, reference_artifact=baseline)
        criteria = _criteria(cfg)
        acfg = gate_config(cfg)
        if criteria == "quality" and acfg.max_downstream_drop is not None:
            cand.update(downstream_scores(candidate, sel, None, acfg.downstream_items, seed=cfg.data.seed))
        cand.update(search_chat_figures(cfg, candidate, baseline))
        verdict = accept(cand, baseline_figures, acfg, criteria)
        metrics = {"search_mlp_ratio": cfg.prune.mlp_ratio, "search_accepted": float(verdict.accepted),
                   **{f"search_{k}": v for k, v in cand.items()},
                   **{f"search_{k}": v for k, v in verdict.metrics.items()}}
        log_metrics(metrics)
        if run is not None:
            mlflow.set_tag("search_mlp_ratio", str(cfg.prune.mlp_ratio))
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
def search_branch_task(cfg: PipelineConfig, parent_run_id: str | None, tracking_uri: str, *, t: TeacherStages,
                       baseline_figures: dict) -> Branch:
    """One branch (cfg = `branch_config` of its ratio): the candidate's chain, then its gate. No cache of its own:
    each stage inside caches under its key, so a re-run redoes only what is missing."""
    # On a Dask worker in another process (or machine) nothing has pointed MLflow at the store yet.
    mlflow.set_tracking_uri(tracking_uri)
    rec = StageRecorder()
    chain = candidate_chain(cfg, parent_run_id, t, run=rec.run)
    from compress.evaluate.chat import sets_digest

    k = stage_key(cfg, "search_gate", ["accept"], chain.cand_key, t.k_exp, f"chat{sets_digest(cfg.search.chat_sets)}")
    gate = rec.run("search_gate", submit_stage, search_gate_task, cfg, "search_gate", k, parent_run_id=parent_run_id,
               candidate=chain.candidate, baseline=t.teacher.artifact, splits=t.loaded.splits,
               baseline_figures=baseline_figures)
    return Branch(ratio=cfg.prune.mlp_ratio, chain=chain, gate=gate, rows=rec.rows)


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
