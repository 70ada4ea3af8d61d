"""Task: the serving benchmark of the candidate and of the fp32 baseline, on the same seeded workload.

Every figure is also reported as a ratio to the baseline measured in the same run. With
``benchmark.genai_model`` the candidate is also timed at batch 1 against onnxruntime-genai on the same prompts
(``loadtest.batch1.compare_with_genai``), logged as ``bench_batch1_*`` / ``genai_batch1_*`` and their ratios.
"""

from __future__ import annotations

import math

from prefect import task

from compress.evaluate.settings import BenchmarkConfig
from loadtest.batch1 import compare_with_genai, genai_metrics
from loadtest.serve_bench import benchmark_artifact, ratios
from loadtest.workloads import fit_to_context, make_workload
from tasks.common import StageRun, cache_key_fn, mark_done, open_stage
from tasks.results import Benchmarked
from tasks.tracking import child_run, log_figure, log_json, log_metrics, log_params


def finite(figures: dict) -> dict[str, float]:
    """The numeric, non-NaN figures of a dict (what MLflow and the ratios take)."""
    return {k: v for k, v in figures.items() if isinstance(v, (int, float)) and not math.isnan(v)}


@task(name="benchmark", cache_key_fn=cache_key_fn, persist_result=True)
def benchmark_task(at: StageRun, *, benchmark: BenchmarkConfig, candidate: str, baseline: str) -> Benchmarked:
    folder, done = open_stage(at, Benchmarked)
    if done is not None:
        return done
    b = benchmark
    workload = make_workload(b.requests, seed=b.seed, prompt_words=tuple(b.prompt_words), max_tokens=tuple(b.max_tokens))
    with child_run(at.parent_run_id, at.stage) as run:
        log_params({"benchmark": b.model_dump()})
        results = {}
        for label, art in (("baseline", baseline), ("candidate", candidate)):
            res = benchmark_artifact(art, fit_to_context(workload, art), b.concurrency, b.serve_overrides,
                                     label=label, seed=b.seed)
            results[label] = res
            if run is not None:
                log_figure(res.figure(title=f"{label}: KV usage and RSS over time"), f"bench_{label}_memory.png")
        base, cand = finite(results["baseline"].metrics()), finite(results["candidate"].metrics())
        rat = finite(ratios(cand, base))
        metrics = {**{f"bench_{k}": v for k, v in cand.items()}, **{f"bench_{k}": v for k, v in rat.items()},
                   **{f"baseline_bench_{k}": v for k, v in base.items()}}
        genai = None
        if b.genai_model:
            genai = compare_with_genai(candidate, b.genai_model, requests=b.requests, max_tokens=max(b.max_tokens),
                                       seed=b.seed, prompt_words=tuple(b.prompt_words))
            metrics.update(genai_metrics(genai))
            if "skipped" in genai:
                log_params({"genai_skipped": genai["skipped"][:500]})
        log_metrics(metrics)
        log_json({"candidate": cand, "baseline": base, "ratios": rat, **({"genai": genai} if genai else {})},
                 "benchmark.json")
    floor = b.min_server_throughput_ratio
    tput = rat.get("output_tokens_per_s_ratio", float("nan"))
    blocked = None
    if floor is not None and not tput >= floor:
        blocked = f"server throughput {tput:.3f}x the baseline < benchmark.min_server_throughput_ratio {floor}"
    return mark_done(folder, Benchmarked(metrics=metrics, candidate=cand, baseline=base, ratios=rat,
                                         promotion_blocked=blocked, genai=genai))
