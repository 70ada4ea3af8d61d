"""The compression DAG as a Prefect flow: one task per stage, one MLflow parent run per pipeline run.

load -> export -> golden -> register baseline -> [prune] -> [distill] -> [export + golden student]
-> [quantize] -> [accept] -> [benchmark] -> register candidate -> [deploy] -> [draft]. Bracketed stages switch on
in config; the draft stage builds an accepted version its drafter (flows/draft.py). With `search.mlp_ratios`,
prune -> ... -> quantize runs once per ratio as parallel branches of a `search` subflow (threads or Dask,
`search.task_runner`), each gated on the selection split; the fastest accepted candidate goes on to accept,
benchmark and register (docs/scaling.md).
Re-running with the same config resumes: finished stages come from cache.
"""

from __future__ import annotations

from datetime import datetime, timezone

import mlflow
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from compress.config import PipelineConfig, load_config
from compress.evaluate import chat as chat_eval
from compress.registry import store as registry
from flows.draft import draft_stage
from flows.outcome import pipeline_state
from flows.registration import register_baseline, register_candidate
from flows.search import check_search_runner, run_search, search_rejection
from flows.stages import chain_settings, resolve_config_path, run_context, trained
from flows.summary import StageTimer, summary_tail
from flows.teacher import teacher_stages
from tasks.accept import accept_task
from tasks.benchmark import benchmark_task
from tasks.chain import Chain, TeacherStages, candidate_chain
from tasks.common import submit_stage
from tasks.results import Benchmarked, Judged, Registered
from tasks.search import SearchSummary
from tasks.tracking import log_json, log_metrics, log_params


def quantize_rejection(choice: dict) -> Judged:
    """A rejected verdict for a quantize stage none of whose forms passed the gate on the selection split: the run
    stops there (the accept stage would judge, on the test split, a form already known to fail). Its reasons name
    every form's failed checks; the most accurate form is the registered, rejected candidate."""
    reasons = [f"no quantized form passed the gate on the selection split ({len(choice['attempts'])} tried); the most "
               f"accurate is registered as the rejected candidate"]
    reasons += [f"{a['form']} with {a['kv_label']}: {a['failed']}" for a in choice["attempts"]]
    best = min(choice["attempts"], key=lambda a: a["perplexity_ratio"])
    side = {"selection_perplexity_ratio": best["perplexity_ratio"], "selection_top1_agreement": best["top1_agreement"],
            "selection_perplexity": best["perplexity"]}
    return Judged(accepted=False, reasons=reasons, criteria="fidelity", checks=[], metrics=side, side=side,
                  split="selection")


def judge_candidate(cfg: PipelineConfig, pid: str, timer: StageTimer, t: TeacherStages, chain: Chain,
                    search: SearchSummary | None) -> tuple[Judged | None, bool]:
    """The verdict and whether the run was rejected before the accept stage: no quantized form passed on the
    selection split (compress/quantize/choice.py), or no search branch did. Then the accept stage and the
    benchmark do not spend their time on a candidate known to fail; the most accurate form or the best branch is
    registered, as a rejected candidate is, so it can be compared."""
    quant = chain.quant
    choice = quant.choice if quant is not None and search is None else None
    verdict, rejected_early = None, True
    if choice is not None and choice["chosen"] is None:
        verdict = quantize_rejection(choice)
    elif search is not None and search.picked is None:
        verdict = search_rejection(search)
    else:
        rejected_early = False
        if cfg.accept.enabled:
            at = run_context(cfg, pid).at("accept", ["accept"], chain.cand_key, t.k_exp,
                                          f"chat{chat_eval.sets_digest(cfg.accept.chat_sets)}")
            verdict = timer.run("accept", submit_stage, accept_task, at, accept=cfg.accept, model=cfg.model,
                                trained=trained(cfg), seed=cfg.data.seed,
                                candidate=chain.candidate, baseline=t.teacher.artifact,
                                splits=t.loaded.splits, heldout=t.loaded.heldout,
                                evaluated=quant.evaluation if quant else None, model_dir=t.loaded.model_dir)
    for reason in verdict.reasons if verdict else []:
        get_run_logger().warning("acceptance: %s", reason)
    return verdict, rejected_early


def benchmark_candidate(cfg: PipelineConfig, pid: str, timer: StageTimer, t: TeacherStages,
                        chain: Chain) -> Benchmarked | None:
    """The candidate against the fp32 teacher on the server, when there is an fp32 graph to serve beside it."""
    if t.teacher.from_checkpoint:
        w = t.teacher.weights
        get_run_logger().warning(
            "benchmark: skipped, the export wrote %s from the checkpoint (export.weights %s) and there is no fp32 "
            "graph to serve beside it (python -m benchmarks.large_models --serve measures the server at this size)",
            w.upper(), w)
        return None
    at = run_context(cfg, pid).at("benchmark", ["benchmark"], chain.cand_key, t.k_exp)
    return timer.run("benchmark", submit_stage, benchmark_task, at, benchmark=cfg.benchmark,
                     candidate=chain.candidate, baseline=t.teacher.artifact)


def run_pipeline(cfg: PipelineConfig) -> dict:
    log = get_run_logger()
    tracking_uri = registry.configure(cfg.mlflow.tracking_uri, cfg.mlflow.experiment)
    registry.check_reachable(tracking_uri)
    check_search_runner(cfg)
    timer = StageTimer()
    registered: list[Registered] = []
    with mlflow.start_run(run_name=f"{cfg.name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}") as parent:
        pid = parent.info.run_id
        log.info("MLflow parent run %s (%s)", pid, tracking_uri)
        if registry.sync_champion(cfg.registry.model_name, f"pipeline run {pid}"):
            log.info("%s: the champion alias was moved by hand; recorded in its champion history",
                     cfg.registry.model_name)
        mlflow.set_tags({"config_hash": cfg.section_hash(), "pipeline": cfg.name})
        log_params(cfg.model_dump(mode="json"))
        log_json(cfg.model_dump(mode="json"), "config.json")

        resolved, t = teacher_stages(cfg, pid, timer)
        cfg = resolved.cfg
        baseline_version = None
        if cfg.registry.register_baseline:
            registered.append(register_baseline(cfg, pid, timer, t))
            baseline_version = registered[-1].version
        search = None
        if cfg.search.mlp_ratios:
            cfg, search, chain = run_search(cfg, pid, tracking_uri, t=t, timer=timer)
        else:
            chain = candidate_chain(chain_settings(cfg, run_context(cfg, pid)), t, run=timer.run)
        candidate = chain.candidate
        verdict, rejected_early = judge_candidate(cfg, pid, timer, t, chain, search)
        compressed = candidate != t.teacher.artifact or t.teacher.from_checkpoint
        bench = benchmark_candidate(cfg, pid, timer, t, chain) if (
            cfg.benchmark.enabled and compressed and not rejected_early) else None
        out = None
        if compressed:
            out = register_candidate(cfg, parent, tracking_uri, timer, candidate=candidate, verdict=verdict,
                                     bench=bench, baseline_version=baseline_version)
            registered.append(out.registration)
        drafted = None
        if cfg.draft.enabled and out is not None and out.status == "accepted":
            drafted = timer.run("draft", draft_stage, cfg, out.registration.version, candidate)
            log.info("draft: %s", drafted.line)
        champion_vs = out.champion_vs if out else None
        if champion_vs:
            log_json(champion_vs, "versus_champion.json")
        for r in timer.rows:
            log_metrics({f"{r['stage']}_seconds": r["seconds"], **r["metrics"]})
        tail = "\n\n" + resolved.markdown() + summary_tail(search, chain) + (
            f"\n\n**Drafter:** {drafted.line}" if drafted else "")
        mlflow.log_text(timer.markdown(cfg.name, cfg.mlflow.experiment, parent, tracking_uri, registered, verdict,
                                       champion_vs) + tail, "summary.md")
    ui = registry.ui_url(tracking_uri, cfg.mlflow.ui_url)
    # read outside MLflow: the UI's address where known
    summary = timer.markdown(cfg.name, cfg.mlflow.experiment, parent, tracking_uri, registered, verdict, champion_vs,
                             ui=ui or "") + tail
    create_markdown_artifact(markdown=summary, key="compress-summary", description=f"compression run {cfg.name}")
    log.info("\n%s", summary)
    # The outcome as JSON: what `prefect` shows, what a direct call gets (flows/outcome.py)
    return {"run_id": pid, "tracking_uri": tracking_uri, "stages": timer.rows,
            "registered": [r.to_json() for r in registered], "teacher_artifact": t.teacher.artifact,
            "candidate_artifact": candidate, "golden": t.gold.metrics, "verdict": verdict and verdict.to_json(),
            "benchmark": bench and bench.to_json(), "deployed": out.deployed if out else None,
            "promotion_blocked": out.blocked if out else None, "versus_champion": champion_vs,
            "draft": drafted and drafted.to_json(),
            "search": search and {"rows": search.rows, "lines": search.lines, "metrics": search.metrics},
            "run_url": registry.run_link(ui, parent.info.experiment_id, pid),
            "model_url": registry.model_link(ui, cfg.registry.model_name)}


@flow(name="compress", log_prints=True)
def compress_flow(config: str = "configs/default.yaml", overrides: list[str] | None = None):
    """Run the compression DAG for a YAML config (path relative to the project root) with KEY=VALUE overrides.

    The final state says the outcome (docs/operations.md): Completed "Accepted" (or "Completed" when no
    gate ran) returns the run's summary dict; Failed "Rejected" / "Blocked" and Failed "<ErrorName>" for
    bad input carry the reasons, the versions and the MLflow link in their message, and a direct call
    raises `RunNotAccepted` (with `.outcome`) or the error itself.
    """
    return pipeline_state(lambda: run_pipeline(load_config(resolve_config_path(config), overrides or [])))
