"""The pruning search as a subflow: one branch per MLP ratio (tasks/search.py), fanned out on threads or Dask
(search.task_runner), its table and plot logged to the parent run, and the pick's config for the rest of the run
(docs/scaling.md)."""

from __future__ import annotations

import time
from dataclasses import replace

from prefect import flow, get_run_logger

from compress.config import ConfigError, PipelineConfig
from compress.prune.search import describe
from flows.stages import branch_config, chain_settings, run_context, search_gate
from flows.summary import StageTimer
from tasks.chain import Chain, ChainSettings, TeacherStages
from tasks.common import submit_stage
from tasks.results import Judged
from tasks.search import Branch, SearchGate, SearchSummary, search_baseline_task, search_branch_task, summarize_search


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


def check_search_runner(cfg: PipelineConfig) -> None:
    """Before any stage: the dask extra's missing-package error, and a word when the scheduler has no workers."""
    s = cfg.search
    if s.mlp_ratios and s.task_runner == "dask" and s.dask_address:
        make_task_runner(s)
        if check_dask_scheduler(s.dask_address) == 0:
            get_run_logger().warning("search: the scheduler at %s has no workers yet; the branches wait until one "
                                     "joins", s.dask_address)


@flow(name="search", validate_parameters=False)
def search_flow(branches: list[ChainSettings], gate: SearchGate, tracking_uri: str, *, t: TeacherStages,
                baseline_figures: dict) -> list[Branch]:
    """The fan-out: one `search_branch` task per branch's chain, submitted to this subflow's task runner at once.

    A branch that raises is a failed candidate (its error in the table); when every branch fails the first
    error ends the run, as a failed stage does.
    """
    log = get_run_logger()
    futures = [search_branch_task.with_options(task_run_name=f"branch-mlp{b.prune.mlp_ratio:g}").submit(
        b, gate, tracking_uri, t=t, baseline_figures=baseline_figures) for b in branches]
    results, errors = [], []
    for b, fut in zip(branches, futures):
        try:
            results.append(fut.result())
        except Exception as e:  # one branch's failure is that candidate's, not the search's
            log.warning("search branch mlp%g failed: %s: %s", b.prune.mlp_ratio, type(e).__name__, e)
            errors.append(e)
            results.append(Branch(ratio=b.prune.mlp_ratio, error=f"{type(e).__name__}: {e}"))
    if len(errors) == len(branches):
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
    gate = search_gate(cfg)
    base = timer.run("search_baseline", submit_stage, search_baseline_task,
                     run_context(cfg, pid).at("search_baseline", ["accept"], t.k_exp), gate=gate,
                     baseline=t.teacher.artifact, splits=t.loaded.splits)
    branch_cfgs = [branch_config(cfg, r) for r in s.mlp_ratios]
    chains = [chain_settings(b, run_context(b, pid)) for b in branch_cfgs]
    where = s.dask_address or (f"a LocalCluster of {s.workers} workers" if s.task_runner == "dask"
                                else f"{s.workers} threads")
    log.info("search: %d branches (mlp ratios %s) on %s", len(branch_cfgs), s.mlp_ratios, where)
    t0 = time.perf_counter()
    runner = make_task_runner(s)
    branches = search_flow.with_options(task_runner=runner)(
        chains, gate, tracking_uri, t=t, baseline_figures=base.figures)
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
