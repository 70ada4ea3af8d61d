"""The compression DAG as a Prefect flow: one task per stage, one MLflow parent run per pipeline run.

load -> export -> golden -> register baseline -> [prune] -> [distill] -> [export + golden student]
-> [quantize] -> [accept] -> [benchmark] -> register candidate -> [deploy]. Bracketed stages switch on
in config. With `search.mlp_ratios`, prune -> ... -> quantize runs once per ratio as parallel branches of a
`search` subflow (threads or Dask, `search.task_runner`), each gated on the selection split; the fastest
accepted candidate goes on to accept, benchmark and register (docs/scaling.md).
Re-running with the same config resumes: finished stages come from cache.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import mlflow
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from compress.registry import store as registry
from compress.artifact import read_manifest
from compress.config import ConfigError, PipelineConfig, load_config, project_root
from compress.corpus.splits import DATA_FORMAT
from compress.evaluate import chat as chat_eval
from compress.export import EXPORT_FORMAT, fallback_weights, int4_keep_ladder
from compress.sizing.memory import shape_of_folder
from compress.resolve import resolve_config
from compress.registry.scorecard import card_params, form_of, scorecard
from compress.prune.search import describe
from flows.deploy import deploy_flow, served_model
from flows.outcome import pipeline_state
from flows.promotion import decide_promotion, promote_if_still_best, verdict_status
from tasks.accept import accept_task
from tasks.benchmark import benchmark_task
from tasks.common import stage_key, submit_stage
from tasks.export import export_task
from tasks.export_gate import export_gate_task, export_timing_task
from tasks.golden import golden_task
from tasks.load import load_task
from tasks.register import register_task
from tasks.results import Benchmarked, FormGated, Judged, Quantized, Registered
from tasks.search import (Branch, Chain, SearchSummary, TeacherStages, branch_config, candidate_chain,
                          search_baseline_task, search_branch_task, StageRecorder, summarize_search)
from tasks.tracking import flatten, log_json, log_metrics, log_params


KEY_FIGURES = {
    "benchmark": ["bench_output_tokens_per_s", "bench_output_tokens_per_s_ratio", "bench_e2e_mean_s",
                  "bench_e2e_p99_s", "bench_ttft_p99_s", "bench_peak_rss_mb"],
    "accept": ["candidate_perplexity", "baseline_perplexity", "gate_perplexity_ratio", "gate_top1_agreement",
               "heldout_perplexity_ratio", "heldout_top1_agreement", "selection_perplexity_ratio",
               "gate_downstream_accuracy", "gate_downstream_drop", "gate_chat_perplexity_ratio",
               "gate_chat_top1_agreement", "gate_chat_judged_ratio", "candidate_size_bytes",
               "candidate_decode_ms_per_token"],
}


class StageTimer(StageRecorder):
    """Wall time and key figures of each stage (StageRecorder.run), and the run summary made of them."""

    def markdown(self, cfg: PipelineConfig, run, tracking_uri: str, registered: list[Registered],
                 verdict: Judged | None = None, champion_vs: dict | None = None, ui: str | None = None) -> str:
        """The run summary; ``ui`` None: for MLflow's own pages (relative links), else their address (Prefect)."""
        route = registry.run_route(run.info.experiment_id, run.info.run_id)
        link = f"[open the run]({route})" if ui is None else registry.outside_link(ui or None, route)
        lines = [f"# Compression run `{cfg.name}`", "",
                 f"MLflow run `{run.info.run_id}` in experiment `{cfg.mlflow.experiment}` ({tracking_uri}): {link}",
                 "", "| stage | seconds | key figures |", "|---|---:|---|"]
        for r in self.rows:
            keys = KEY_FIGURES.get(r["stage"]) or list(r["metrics"])[:6]
            figs = ", ".join(f"{k}={r['metrics'][k]:.4g}" for k in keys
                             if isinstance(r["metrics"].get(k), (int, float)))
            lines.append(f"| {r['stage']} | {r['seconds']:.1f} | {figs} |")
        if verdict is not None:
            lines += ["", f"**Acceptance: {verdict.status}** (criteria: {verdict.criteria})"]
            lines += [f"- {r}" for r in verdict.reasons]
            lines += genre_markdown(verdict)
        if champion_vs and champion_vs["rows"]:
            lines += ["", f"Against champion v{champion_vs['version']} (registered figures):", "",
                      "| figure | candidate | champion | better |", "|---|---:|---:|---|"]
            lines += [f"| {r['what']} | {r['candidate']:.4g} | {r['champion']:.4g} | {r['better']} |"
                      for r in champion_vs["rows"]]
            if not champion_vs["use_measured"]:
                lines.append("(the champion has no chat-set figures: registered before they were measured)")
        if registered:
            lines += ["", "| model | version | aliases |", "|---|---|---|"]
            lines += [f"| {r.name} | {r.version} | {', '.join(r.aliases)} |" for r in registered]
        return "\n".join(lines)


def genre_markdown(verdict: Judged) -> list[str]:
    """Every genre's checks with values and limits: the verdict needs each to pass (the worst decides)."""
    if not verdict.checks:
        return []
    lines = ["", "| genre | check | value | limit | passed |", "|---|---|---:|---:|---|"]
    lines += [f"| {c.get('genre', '')} | {c['name']} | {c['value']:.4g} | {c['limit']:.4g} | "
              f"{'yes' if c['passed'] else '**no**'} |" for c in verdict.checks]
    if verdict.chat_note:
        lines += ["", f"chat set: {verdict.chat_note}"]
    if verdict.reference == "checkpoint":
        lines += ["", "judged against the source checkpoint as stored (accept.reference), not the fp32 graph"]
    if verdict.seconds:
        lines += ["", "accept stage seconds: " + ", ".join(f"{k.replace('_', ' ')} {v:.1f}"
                                                        for k, v in verdict.seconds.items())]
    return lines


# What a version's note (its description in the UI) says of the verdict, beside the reasons and the links.
VERSION_FIGURES = (("gate_perplexity_ratio", "perplexity ratio"), ("gate_top1_agreement", "top-1 agreement"),
                   ("gate_chat_perplexity_ratio", "chat perplexity ratio"), ("gate_chat_judged_ratio", "judged ratio"),
                   ("gate_size_ratio", "size ratio"))
VERSION_PARAM_SECTIONS = ("export", "prune", "distill", "quantize", "accept")


def version_params(cfg: PipelineConfig, role: str, verdict: str | None = None) -> dict:
    """What a version is, as params of its source run: MLflow's Compare shows them beside the figures."""
    dump = cfg.model_dump(mode="json")
    params = {"role": role, "config": cfg.name, "config_hash": cfg.section_hash(), "model.source": dump["model"]["source"],
              "data.source": dump["data"]["source"]}
    if verdict is not None:
        params["verdict"] = verdict
    if role != "baseline":
        params.update(flatten({k: dump[k] for k in VERSION_PARAM_SECTIONS}))
        if cfg.search.mlp_ratios:  # prune.mlp_ratio is then the search's pick
            params["search.mlp_ratios"] = dump["search"]["mlp_ratios"]
    else:
        params.update(flatten({"export": dump["export"]}))
    return {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in params.items()}


def make_task_runner(scfg):
    """The search subflow's task runner: Prefect's thread pool, or prefect-dask on a LocalCluster / a scheduler."""
    if scfg.task_runner == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=scfg.workers)
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError:
        raise ConfigError("search.task_runner 'dask' needs prefect-dask and dask.distributed: install the project's "
                          "dask extra (pip install -e '.[dask]', which `make setup` does), or set "
                          "search.task_runner: threads") from None
    if scfg.dask_address:
        return DaskTaskRunner(address=scfg.dask_address)
    # One thread per worker: a branch's torch and ONNX Runtime already use every core they are given.
    return DaskTaskRunner(cluster_class="distributed.LocalCluster",
                          cluster_kwargs={"n_workers": scfg.workers, "threads_per_worker": 1,
                                          "processes": scfg.dask_processes})


def check_dask_scheduler(address: str, timeout_s: float = 10.0) -> int:
    """The number of workers of the Dask scheduler at ``address``; a clear error when none answers there.

    Checked before the first stage, so a wrong address costs seconds, not the stages before the search.
    """
    from distributed import Client

    try:
        with Client(address, timeout=timeout_s) as client:
            return len(client.scheduler_info().get("workers", {}))
    except (OSError, TimeoutError) as e:
        raise ConfigError(f"search.dask_address {address!r}: no Dask scheduler answers there within {timeout_s:g} s "
                          f"({type(e).__name__}); start one where the workers can reach it (dask scheduler --port "
                          f"8786, docs/scaling.md) or fix the address") from None


@flow(name="search", validate_parameters=False)
def search_flow(branch_cfgs: list[PipelineConfig], parent_run_id: str, tracking_uri: str, *, t: TeacherStages,
                baseline_figures: dict) -> list[Branch]:
    """The fan-out: one `search_branch` task per config, submitted to this subflow's task runner at once.

    A branch that raises is a failed candidate (its error in the table); when every branch fails the first
    error ends the run, as a failed stage does.
    """
    log = get_run_logger()
    futures = [search_branch_task.with_options(task_run_name=f"branch-mlp{b.prune.mlp_ratio:g}").submit(
        b, parent_run_id, tracking_uri, t=t, baseline_figures=baseline_figures) for b in branch_cfgs]
    results, errors = [], []
    for b, fut in zip(branch_cfgs, futures):
        try:
            results.append(fut.result())
        except Exception as e:  # one branch's failure is that candidate's, not the search's
            log.warning("search branch mlp%g failed: %s: %s", b.prune.mlp_ratio, type(e).__name__, e)
            errors.append(e)
            results.append(Branch(ratio=b.prune.mlp_ratio, error=f"{type(e).__name__}: {e}"))
    if len(errors) == len(branch_cfgs):
        raise errors[0]
    return results


def run_search(cfg: PipelineConfig, pid: str, tracking_uri: str, *, t: TeacherStages,
               timer: StageTimer) -> tuple[PipelineConfig, SearchSummary, Chain]:
    """Fan the ratios out, log the search to the parent run, and return (the pick's config, the search, its chain).

    The pick's config is `cfg` with prune.mlp_ratio = the picked ratio (the best rejected one's when none passed):
    the rest of the run (verdict, benchmark, registered params) is that candidate's, as in a single-ratio run.
    """
    log = get_run_logger()
    s = cfg.search
    k_base = stage_key(cfg, "search_baseline", ["accept"], t.k_exp)
    base = timer.run("search_baseline", submit_stage, search_baseline_task, cfg, "search_baseline", k_base,
                     parent_run_id=pid, baseline=t.teacher.artifact, splits=t.loaded.splits)
    branch_cfgs = [branch_config(cfg, r) for r in s.mlp_ratios]
    where = s.dask_address or (f"a LocalCluster of {s.workers} workers" if s.task_runner == "dask"
                                else f"{s.workers} threads")
    log.info("search: %d branches (mlp ratios %s) on %s", len(branch_cfgs), s.mlp_ratios, where)
    t0 = time.perf_counter()
    runner = make_task_runner(s)
    branches = search_flow.with_options(task_runner=runner)(
        branch_cfgs, pid, tracking_uri, t=t, baseline_figures=base.figures)
    fanout_s = time.perf_counter() - t0
    search = summarize_search(branches, t.teacher.artifact, t.loaded.splits, title=f"pruning search: {cfg.name}")
    for line in search.lines:
        log.info("search: %s", line)
    timer.rows.append({"stage": "search", "seconds": time.perf_counter() - t0,
                       "metrics": {**search.metrics, "search_fanout_seconds": fanout_s}})
    chosen = search.picked or search.best
    if chosen is None:
        raise RuntimeError("search: no branch produced a candidate")  # unreachable: search_flow raised already
    branch = next(b for b in branches if b.ratio == chosen.ratio)
    # The chosen branch's stages, under their own names: the parent run carries the same figures as a
    # single-candidate run (their seconds are the branch's, spent side by side with the others).
    timer.rows.extend(r for r in branch.rows if r["stage"] != "search_gate")
    log.info("search: %s %s", "picked" if search.picked else "none accepted; best", describe(chosen))
    return branch_config(cfg, chosen.ratio), replace(search, branch=branch), branch.chain


def search_markdown(search: SearchSummary) -> str:
    """The search's table for the run summary (the same rows as the search.json artifact)."""
    lines = ["## Search (selection split; speed timed side by side)", "",
             "| candidate | size MiB | ms/token | tokens/s | perplexity ratio | top-1 agreement | accepted | front | picked |",
             "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for r in search.rows:
        if r["error"]:
            lines.append(f"| {r['candidate']} | failed: {r['error']} |||||||| ")
            continue
        lines.append(f"| {r['candidate']} | {r['size_mb']:.2f} | {r['ms_per_token']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['perplexity_ratio']:.4f} | {r['top1_agreement']:.4f} | {'yes' if r['accepted'] else 'no'} | "
                     f"{'yes' if r['on_front'] else ''} | {'**yes**' if r['picked'] else ''} |")
    return "\n".join(lines)


def search_rejection(search: SearchSummary) -> Judged:
    """A rejected verdict for a search no branch passed: its reasons name the best candidate's figures."""
    best, gate = search.best, search.branch.gate
    reasons = [f"no search candidate passed the gate on the selection split ({len(search.candidates)} tried); "
               f"best {describe(best)}"]
    # Every figure under selection_*: the plain names of a registered version are the test split's, and no
    # verdict on the test split ran.
    side = {f"selection_{k}": v for k, v in gate.candidate.items() if isinstance(v, (int, float))}
    side.update({f"selection_{name}": v for name, v in gate.gate_figures().items()})
    side["selection_decode_ms_per_token"] = best.ms_per_token  # timed beside the other candidates
    return Judged(accepted=False, reasons=reasons, criteria=gate.criteria, checks=gate.checks, metrics=side,
                  side=side, split="selection")


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


def forms_markdown(choice: dict) -> str:
    """The quantize stage's forms: every attempt (weight form x K/V cache) with its selection-split figures."""
    lines = ["### Forms judged on the selection split", "",
             "| form | K/V cache | passed | size (x source) | perplexity ratio | top-1 agreement | decode tokens/s at users | failed |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for a in choice["attempts"]:
        levels = sorted((int(k[len("tokens_per_s_b"):]), v) for k, v in a.items() if k.startswith("tokens_per_s_b"))
        tps = (" / ".join(f"{v:.0f}" for _, v in levels) + " at " + " / ".join(str(b) for b, _ in levels)
               if levels else "")
        kept = a["form"] == choice["chosen"] and a["kv"] == choice["kv"] and a["accepted"]
        share = f" ({a['int8_groups']} groups at 8 bits)" if a.get("int8_share") is not None else ""
        lines.append(f"| {a['form']}{share}{' (kept)' if kept else ''} | {a['kv_label']} | "
                     f"{'yes' if a['accepted'] else '**no**'} | {a.get('size_ratio', float('nan')):.3f} | "
                     f"{a['perplexity_ratio']:.4f} | {a['top1_agreement']:.4f} | "
                     f"{tps} | {a['failed']} |")
    if choice.get("hints"):
        lines += ["", "What the cache cost:"] + [f"- {h}" for h in choice["hints"]]
    return "\n".join(lines)


def compare_with_champion(cfg: PipelineConfig, figures: dict) -> dict | None:
    """The candidate's figures against the current champion's registered ones (compress.evaluate.versus_champion),
    with the champion's version; None when the model has no champion yet."""
    from compress.evaluate import versus_champion

    name = cfg.registry.model_name
    champ = registry.version_for_alias(name, "champion")
    if champ is None:
        return None
    return {**versus_champion(figures, registry.figures(name, champ.version)), "version": champ.version}


def local_server_url(cfg: PipelineConfig, model_name: str) -> str | None:
    """The `serve` section's server when one answers there serving this model from this registry; None otherwise.

    "From this registry": the version it serves has the digest this store registered under that number
    (a server following another MLflow store may serve a "version 2" of its own).
    """
    url = f"http://{cfg.serve.host}:{cfg.serve.port}"
    try:
        version, digest = served_model(url, model_name, timeout=2)
        if version is None:
            return None
        ours = registry.get_version(model_name, version).tags.get("artifact_sha256")
    except Exception:
        return None
    return url if digest and digest == ours else None


@dataclass
class CandidateRegistration:
    """What registering a compressed candidate did: its version, the verdict tag, how it compares with the
    champion, why it was not promoted (None when it was, or was not to be), and the deploy flow's result."""

    registration: Registered
    status: str  # accepted | rejected | unchecked
    champion_vs: dict | None
    blocked: str | None
    deployed: dict | None


def candidate_tags(cfg: PipelineConfig, parent, *, status: str, verdict: Judged | None, figures: dict,
                   blocked: str | None) -> dict:
    """The candidate version's tags: role, verdict, reasons, and the note the registry's page shows."""
    pid, exp = parent.info.run_id, parent.info.experiment_id
    tags = {"role": "candidate", "verdict": status, "config_hash": cfg.section_hash()}
    # Only tags that say something: the UI shows an empty `promotion_blocked` as a badge.
    if verdict and verdict.reasons:
        tags["reasons"] = "; ".join(verdict.reasons)
    if blocked:
        tags["promotion_blocked"] = blocked
    shown = [f"{label} {figures[k]:.4g}" for k, label in VERSION_FIGURES if k in figures]
    # markdown links to relative routes: the description is read on the UI's own page, whatever its port
    tags["note"] = (f"{status}: " + ("; ".join(verdict.reasons) if verdict and verdict.reasons
                                     else "every check passed" if verdict else "not judged")
                    + (f" ({', '.join(shown)})" if shown else "")
                    + f". [Pipeline run]({registry.run_route(exp, pid)})"
                    + (f", [verdict, checks and plots]({registry.run_route(exp, verdict.run_id)})"
                       if verdict and verdict.run_id else "") + ".")
    if verdict and verdict.run_id:
        tags["accept_run_id"] = verdict.run_id
    return tags


def register_candidate(cfg: PipelineConfig, parent, tracking_uri: str, timer, *, candidate: str,
                       verdict: Judged | None, bench: Benchmarked | None, baseline_version) -> CandidateRegistration:
    """Register the candidate with its verdict, figures and note; promote it (compare-and-set under the model's
    promotion lock, flows/promotion.py) when decide_promotion says so."""
    log = get_run_logger()
    pid = parent.info.run_id
    champion_vs, deployed = None, None
    status = verdict_status(verdict)
    figures = {**(verdict.figures() if verdict else {}),
               **({f"bench_{k}": v for k, v in {**bench.candidate, **bench.ratios}.items()} if bench else {})}
    if verdict and verdict.candidate:  # which is better on what, shown for every judged candidate
        champion_vs = compare_with_champion(cfg, figures)
    decision = decide_promotion(status, cfg.registry.promote, bench.promotion_blocked if bench else None,
                                champion_vs, cfg.registry.promote_when_worse)
    blocked, aliases = decision.blocked, list(decision.aliases)
    if blocked:
        log.warning("promotion blocked: %s", blocked)
    tags = candidate_tags(cfg, parent, status=status, verdict=verdict, figures=figures, blocked=blocked)
    card = scorecard(figures, accepted=verdict.accepted if verdict else None, baseline=False,
                     size_ratio=verdict.size_ratio() if verdict else None)
    card_p = card_params(status, form_of(read_manifest(candidate, verify=False).get("quantization"),
                                         pruned=cfg.prune.enabled), cfg.benchmark.concurrency if bench else None)
    reg = timer.run("register", lambda: register_task(cfg, pid, candidate, aliases, tags, metrics={**figures, **card},
                                                      params={**version_params(cfg, "candidate", status), **card_p}))
    if not reg.reused:
        registry.describe(cfg.registry.model_name, reg.version)
        if verdict and verdict.run_id:  # the verdict and its plot where the version's run shows them
            registry.attach_from_run(cfg.registry.model_name, reg.version, verdict.run_id,
                                     ["verdict.json", "chat_by_kind.png"])
    if baseline_version is not None and (verdict or bench):
        # The baseline's own figures under the same names, so the UI's Compare lines them up.
        base = verdict.baseline_figures() if verdict else {}
        base.update({f"bench_{k}": v for k, v in (bench.baseline if bench else {}).items()})
        base.update(scorecard(base, accepted=None, baseline=True, size_ratio=1.0))
        registry.log_figures(cfg.registry.model_name, baseline_version, base,
                             card_params("baseline", form_of(None), cfg.benchmark.concurrency if bench else None))
    if decision.promote:
        server_url = cfg.registry.server_url or local_server_url(cfg, reg.name)
        # compare-and-set: judged again under the model's promotion lock if another run moved the champion
        deployed, blocked = promote_if_still_best(
            tracking_uri, reg.name, champion_vs, lambda: compare_with_champion(cfg, figures),
            cfg.registry.promote_when_worse,
            lambda: deploy_flow(model_name=reg.name, version=reg.version, server_url=server_url,
                                tracking_uri=tracking_uri))
        if blocked:
            log.warning("promotion blocked: %s", blocked)
            registry.set_tags(reg.name, reg.version, {"promotion_blocked": blocked})
        else:
            if server_url is None:
                deployed["smoke"] = (f"skipped (no server at http://{cfg.serve.host}:{cfg.serve.port} serves "
                                     f"{reg.name} from this registry; set registry.server_url to smoke-test "
                                     f"another)")
            reg = replace(reg, aliases=reg.aliases + ["champion"])
            log.info("deployed: %s", deployed)
    mlflow.set_tags({"verdict": status, **({"promotion_blocked": blocked} if blocked else {})})
    return CandidateRegistration(reg, status, champion_vs, blocked, deployed)


def check_search_runner(cfg: PipelineConfig) -> None:
    """Before any stage: the dask extra's missing-package error, and a word when the scheduler has no workers."""
    s = cfg.search
    if s.mlp_ratios and s.task_runner == "dask" and s.dask_address:
        make_task_runner(s)
        if check_dask_scheduler(s.dask_address) == 0:
            get_run_logger().warning("search: the scheduler at %s has no workers yet; the branches wait until one "
                                     "joins", s.dask_address)


def export_key_part(cfg: PipelineConfig, weights: str) -> str:
    """What of the quantize section shapes an export that writes quantized weights from the checkpoint."""
    q = cfg.quantize
    if weights == "int8":
        return f"int8b{q.weight_block_size}a{q.accuracy_level}"
    if weights == "int4":
        return (f"int4b{q.weight_block_size}a{q.accuracy_level}s{int(q.weight_symmetric)}k{q.int4_keep_int8}"
                f"c{int(q.w4_clip(False))}h{int(q.int4_lm_head)}" + (f"f{q.w4_block()}" if q.int4_block_size else ""))
    return ""


def teacher_stages(cfg: PipelineConfig, pid: str, timer: StageTimer) -> TeacherStages:
    """load, then every `auto` resolved (logged once: resolved_config.json), then export and golden under the
    resolved config, which the rest of the run uses (``TeacherStages.resolved.cfg``). When export.weights auto wrote
    4 bits from the checkpoint, the graph is gated on the selection split, and where it fails the export writes 8 bits
    instead (``written_forms``)."""
    k_load = stage_key(cfg, "load", ["model", "data"], f"data{DATA_FORMAT}")
    loaded = timer.run("load", submit_stage, load_task, cfg, "load", k_load, parent_run_id=pid)
    resolved = resolve_config(cfg, params=shape_of_folder(loaded.model_dir, cfg.model.trust_remote_code).params,
                              model_dir=loaded.model_dir, exporter_auto=tuple(loaded.exporter_auto))
    for s in resolved.settings:
        get_run_logger().info("resolved %s: %s (%s)", s.key, s.value, s.why)
    log_json(resolved.to_json(), "resolved_config.json")
    fallback = fallback_weights(cfg.export.weights, resolved.cfg.export.weights, resolved.cfg)
    cfg = resolved.cfg
    shares = int4_keep_ladder(cfg.quantize) if fallback else []
    if shares:
        cfg = with_int4_keep(cfg, shares[0])
    k_exp, teacher, gold = export_and_golden(cfg, pid, timer, loaded, k_load)
    forms = None
    if fallback:
        cfg, k_exp, teacher, gold, forms = written_forms(cfg, pid, timer, loaded, k_load, (k_exp, teacher, gold),
                                                         shares[1:] + [fallback])
        resolved = replace(resolved, cfg=cfg)
    return TeacherStages(resolved, k_load, loaded, k_exp, teacher, gold, forms)


def export_and_golden(cfg: PipelineConfig, pid: str, timer: StageTimer, loaded, k_load: str):
    """The export under cfg.export.weights and its golden check: (the export's key, Exported, Golden)."""
    weights = cfg.export.weights
    k_exp = stage_key(cfg, "export", ["export"], k_load, f"format{EXPORT_FORMAT}", export_key_part(cfg, weights))
    teacher = timer.run("export", submit_stage, export_task, cfg, "export", k_exp, parent_run_id=pid,
                        model_dir=loaded.model_dir, weights=weights)
    k_gold = stage_key(cfg, "golden", ["golden"], k_exp)
    gold = timer.run("golden", submit_stage, golden_task, cfg, "golden", k_gold, parent_run_id=pid,
                     model_dir=loaded.model_dir, artifact=teacher.artifact)
    return k_exp, teacher, gold


def with_int4_keep(cfg: PipelineConfig, share: float) -> PipelineConfig:
    """cfg with quantize.int4_keep_int8 = share (the 4-bit graph's groups at 8 bits)."""
    return cfg.model_copy(update={"quantize": cfg.quantize.model_copy(update={"int4_keep_int8": share})})


def written_forms(cfg: PipelineConfig, pid: str, timer: StageTimer, loaded, k_load: str, first: tuple,
                  then: list):
    """export.weights auto from the checkpoint: the first graph (4 bits) gated on the selection split; where it
    fails, each of ``then`` in turn (a share of groups at 8 bits for another 4-bit graph, then "int8") written,
    checked and gated too, until one passes. Where a 4-bit graph passed, quantize.auto_forms weighs weight_only and
    quantize.auto_objective is speed, the INT8 graph is written and gated as well, and the two that passed are timed
    at quantize.auto_concurrency users (``export_timing``): the faster is kept, as the quantize stage keeps its forms
    (with auto_objective size the first rung that passed is kept, untimed). Returns the run's config,
    the kept export's key, Exported and Golden, and the forms as a Quantized result (the attempts table, the kept
    form's figures for the accept stage; chosen None when none passed, so the run ends Rejected before the accept
    stage)."""
    attempts, passed = [], {}
    written = first
    for nxt in [*then, None]:
        gate = gate_written(cfg, pid, timer, loaded, written)
        attempts.append(gate.attempt)
        if gate.accepted:
            passed[gate.attempt["form"]] = (cfg, written, gate)
            break
        if nxt is None:
            break
        if isinstance(nxt, str):
            get_run_logger().warning("export: the %s graph failed the gate on the selection split (%s); writing %s "
                                     "from the checkpoint instead", written[1].weights, gate.attempt["failed"], nxt)
            cfg = cfg.model_copy(update={"export": cfg.export.model_copy(update={"weights": nxt})})
        else:
            get_run_logger().warning("export: the 4-bit graph with %.0f %% of its groups at 8 bits failed the gate on "
                                     "the selection split (%s); writing it with %.0f %%",
                                     100 * cfg.quantize.int4_keep_int8, gate.attempt["failed"], 100 * nxt)
            cfg = with_int4_keep(cfg, nxt)
        written = export_and_golden(cfg, pid, timer, loaded, k_load)
    if (any(w[1].weights == "int4" for _, w, _ in passed.values()) and "weight_only" in cfg.quantize.auto_forms
            and cfg.quantize.auto_objective == "speed"):
        cfg8 = cfg.model_copy(update={"export": cfg.export.model_copy(update={"weights": "int8"})})
        written8 = export_and_golden(cfg8, pid, timer, loaded, k_load)
        gate8 = gate_written(cfg8, pid, timer, loaded, written8)
        attempts.append(gate8.attempt)
        if gate8.accepted:
            passed[gate8.attempt["form"]] = (cfg8, written8, gate8)
    chosen = next(iter(passed), None)
    if len(passed) > 1:
        k = stage_key(cfg, "export_timing", ["quantize"], *(w[0] for _, w, _ in passed.values()))
        timed = timer.run("export_timing", submit_stage, export_timing_task, cfg, "export_timing", k,
                          parent_run_id=pid, artifacts={n: w[1].artifact for n, (_, w, _) in passed.items()},
                          perplexity={n: g.attempt["perplexity"] for n, (_, _, g) in passed.items()},
                          splits=loaded.splits)
        chosen = timed.chosen
        for a in attempts:
            if a["accepted"] and a["form"] in timed.records:
                a.update(timed.records[a["form"]])
    if chosen is None:
        cfg, (k_exp, teacher, gold), evaluation, kv = cfg, written, None, attempts[-1]["kv"]
    else:
        cfg, (k_exp, teacher, gold), gate = passed[chosen]
        evaluation, kv = gate.evaluation, gate.attempt["kv"]
    choice = {"attempts": attempts, "chosen": chosen, "kv": kv, "hints": []}
    forms = Quantized(artifact=teacher.artifact, evaluation=evaluation, choice=choice, metrics={})
    return cfg, k_exp, teacher, gold, forms


def gate_written(cfg: PipelineConfig, pid: str, timer: StageTimer, loaded, written: tuple) -> FormGated:
    """export_gate on one written graph (``written``: the export's key, Exported, Golden)."""
    k_exp, teacher, _ = written
    k = stage_key(cfg, "export_gate", ["accept"], k_exp)  # k_exp chains the load stage's (model, data) key
    return timer.run("export_gate", submit_stage, export_gate_task, cfg, "export_gate", k, parent_run_id=pid,
                     artifact=teacher.artifact, weights=teacher.weights, splits=loaded.splits,
                     model_dir=loaded.model_dir)


def register_baseline(cfg: PipelineConfig, pid: str, timer: StageTimer, t: TeacherStages) -> Registered:
    """Registered before the compression stages so a later failure still leaves the baseline. With an INT8 or
    4-bit export the baseline is the checkpoint itself, recorded by digest (its weights stay put)."""
    tags = {"role": "baseline", "config_hash": cfg.section_hash()}
    return timer.run("register_baseline", lambda: register_task(
        cfg, pid, t.teacher.record if t.teacher.from_checkpoint else t.teacher.artifact, ["baseline"], tags,
        stage="register_baseline", metrics=t.gold.metrics, params=version_params(cfg, "baseline"),
        same_config_only=False, weights=cfg.registry.baseline_weights))


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
            k = stage_key(cfg, "accept", ["accept"], chain.cand_key, t.k_exp,
                          f"chat{chat_eval.sets_digest(cfg.accept.chat_sets)}")
            verdict = timer.run("accept", submit_stage, accept_task, cfg, "accept", k, parent_run_id=pid,
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
    k = stage_key(cfg, "benchmark", ["benchmark"], chain.cand_key, t.k_exp)
    return timer.run("benchmark", submit_stage, benchmark_task, cfg, "benchmark", k, parent_run_id=pid,
                     candidate=chain.candidate, baseline=t.teacher.artifact)


def summary_tail(search: SearchSummary | None, chain: Chain) -> str:
    """The search's table, or the quantize stage's forms, under the stage table of summary.md."""
    if search is not None:
        return "\n\n" + search_markdown(search)
    choice = chain.quant.choice if chain.quant is not None else None
    return "\n\n" + forms_markdown(choice) if choice is not None else ""


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

        t = teacher_stages(cfg, pid, timer)
        cfg = t.resolved.cfg
        baseline_version = None
        if cfg.registry.register_baseline:
            registered.append(register_baseline(cfg, pid, timer, t))
            baseline_version = registered[-1].version
        search = None
        if cfg.search.mlp_ratios:
            cfg, search, chain = run_search(cfg, pid, tracking_uri, t=t, timer=timer)
        else:
            chain = candidate_chain(cfg, pid, t, run=timer.run)
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
        champion_vs = out.champion_vs if out else None
        if champion_vs:
            log_json(champion_vs, "versus_champion.json")
        for r in timer.rows:
            log_metrics({f"{r['stage']}_seconds": r["seconds"], **r["metrics"]})
        tail = "\n\n" + t.resolved.markdown() + summary_tail(search, chain)
        mlflow.log_text(timer.markdown(cfg, parent, tracking_uri, registered, verdict, champion_vs) + tail,
                        "summary.md")
    ui = registry.ui_url(tracking_uri, cfg.mlflow.ui_url)
    # read outside MLflow: the UI's address where known
    summary = timer.markdown(cfg, parent, tracking_uri, registered, verdict, champion_vs, ui=ui or "") + tail
    create_markdown_artifact(markdown=summary, key="compress-summary", description=f"compression run {cfg.name}")
    log.info("\n%s", summary)
    # The outcome as JSON: what `prefect` shows, what a direct call gets (flows/outcome.py)
    return {"run_id": pid, "tracking_uri": tracking_uri, "stages": timer.rows,
            "registered": [r.to_json() for r in registered], "teacher_artifact": t.teacher.artifact,
            "candidate_artifact": candidate, "golden": t.gold.metrics, "verdict": verdict and verdict.to_json(),
            "benchmark": bench and bench.to_json(), "deployed": out.deployed if out else None,
            "promotion_blocked": out.blocked if out else None, "versus_champion": champion_vs,
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


def resolve_config_path(config: str) -> Path:
    path = Path(config)
    if not path.is_absolute() and not path.exists():
        path = project_root() / path
    return path
