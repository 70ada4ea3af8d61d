"""The compression DAG as a Prefect flow: one task per stage, one MLflow parent run per pipeline run.

load -> export -> golden -> register baseline -> [prune] -> [distill] -> [export + golden student]
-> [quantize] -> [accept] -> [benchmark] -> register candidate -> [deploy]. Bracketed stages switch on
in config.
Re-running with the same config resumes: finished stages come from cache.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import mlflow
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from compress import registry
from compress.config import PipelineConfig, load_config, project_root
from compress.data import DATA_FORMAT
from compress.export import EXPORT_FORMAT
from flows.deploy import deploy_flow, served_model
from flows.outcome import pipeline_state
from tasks.accept import accept_task
from tasks.benchmark import benchmark_task
from tasks.common import stage_key, submit_stage
from tasks.distill import distill_task
from tasks.export import export_task
from tasks.golden import golden_task
from tasks.load import load_task
from tasks.prune import prune_task
from tasks.quantize import quantize_task
from tasks.register import register_task
from tasks.tracking import flatten, log_json, log_metrics, log_params


KEY_FIGURES = {
    "benchmark": ["bench_output_tokens_per_s", "bench_output_tokens_per_s_ratio", "bench_e2e_mean_s",
                  "bench_e2e_p99_s", "bench_ttft_p99_s", "bench_peak_rss_mb"],
    "accept": ["candidate_perplexity", "baseline_perplexity", "gate_perplexity_ratio", "gate_top1_agreement",
               "heldout_perplexity_ratio", "heldout_top1_agreement", "selection_perplexity_ratio",
               "gate_downstream_accuracy", "gate_downstream_drop", "candidate_size_bytes",
               "candidate_decode_ms_per_token"],
}


class StageTimer:
    """Wall time and key figures of each stage, for the run summary."""

    def __init__(self):
        self.rows: list[dict] = []

    def run(self, name: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.rows.append({"stage": name, "seconds": time.perf_counter() - t0, "metrics": (out or {}).get("metrics", {})})
        return out

    def markdown(self, cfg: PipelineConfig, run, tracking_uri: str, registered: list[dict],
                 verdict: dict | None = None) -> str:
        link = registry.run_link(registry.ui_url(tracking_uri, cfg.mlflow.ui_url), run.info.experiment_id,
                                 run.info.run_id)
        lines = [f"# Compression run `{cfg.name}`", "",
                 f"MLflow run `{run.info.run_id}` in experiment `{cfg.mlflow.experiment}` ({tracking_uri}): {link}",
                 "", "| stage | seconds | key figures |", "|---|---:|---|"]
        for r in self.rows:
            keys = KEY_FIGURES.get(r["stage"]) or list(r["metrics"])[:6]
            figs = ", ".join(f"{k}={r['metrics'][k]:.4g}" for k in keys
                             if isinstance(r["metrics"].get(k), (int, float)))
            lines.append(f"| {r['stage']} | {r['seconds']:.1f} | {figs} |")
        if verdict is not None:
            lines += ["", f"**Acceptance: {'accepted' if verdict['accepted'] else 'rejected'}** "
                      f"(criteria: {verdict.get('criteria', 'fidelity')})"]
            lines += [f"- {r}" for r in verdict["reasons"]]
        if registered:
            lines += ["", "| model | version | aliases |", "|---|---|---|"]
            lines += [f"| {r['name']} | {r['version']} | {', '.join(r['aliases'])} |" for r in registered]
        return "\n".join(lines)


SIDE_FIGURES = ("heldout_", "selection_")  # beside the verdict's: the held-out source's, the selection split's


def model_figures(verdict: dict) -> dict:
    """A candidate's figures: its evaluation on the test split (the verdict's) under plain names, the gate's
    own figures, and the held-out source's and the selection split's figures beside them (heldout_*, selection_*)."""
    figs = {k: v for k, v in verdict["candidate"].items() if isinstance(v, (int, float))}
    figs.update({k: v for k, v in verdict["metrics"].items() if k.startswith(("gate_",) + SIDE_FIGURES)})
    return figs


def baseline_figures(verdict: dict) -> dict:
    """The baseline's figures under the candidate's names (plain = test split; heldout_perplexity, ...)."""
    figs = {k: v for k, v in verdict["baseline"].items() if isinstance(v, (int, float))}
    figs.update({f"{p}perplexity": verdict["metrics"][f"{p}baseline_perplexity"] for p in SIDE_FIGURES
                 if f"{p}baseline_perplexity" in verdict["metrics"]})
    return figs


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
    else:
        params.update(flatten({"export": dump["export"]}))
    return {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in params.items()}


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


def run_pipeline(cfg: PipelineConfig) -> dict:
    log = get_run_logger()
    tracking_uri = registry.configure(cfg.mlflow.tracking_uri, cfg.mlflow.experiment)
    registry.check_reachable(tracking_uri)
    timer = StageTimer()
    registered: list[dict] = []
    run_name = f"{cfg.name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    with mlflow.start_run(run_name=run_name) as parent:
        pid = parent.info.run_id
        log.info("MLflow parent run %s (%s)", pid, tracking_uri)
        mlflow.set_tags({"config_hash": cfg.section_hash(), "pipeline": cfg.name})
        log_params(cfg.model_dump(mode="json"))
        log_json(cfg.model_dump(mode="json"), "config.json")

        k_load = stage_key(cfg, "load", ["model", "data"], f"data{DATA_FORMAT}")
        loaded = timer.run("load", submit_stage, load_task, cfg, "load", k_load, parent_run_id=pid)
        k_exp = stage_key(cfg, "export", ["export"], k_load, f"format{EXPORT_FORMAT}")
        teacher = timer.run("export", submit_stage, export_task, cfg, "export", k_exp, parent_run_id=pid,
                            model_dir=loaded["model_dir"])
        k_gold = stage_key(cfg, "golden", ["golden"], k_exp)
        gold = timer.run("golden", submit_stage, golden_task, cfg, "golden", k_gold, parent_run_id=pid,
                         model_dir=loaded["model_dir"], artifact=teacher["artifact"])

        baseline_version = None
        if cfg.registry.register_baseline:
            # Registered before the compression stages so a later failure still leaves the baseline.
            tags = {"role": "baseline", "config_hash": cfg.section_hash()}
            reg = timer.run("register_baseline", lambda: register_task(
                cfg, pid, teacher["artifact"], ["baseline"], tags, stage="register_baseline",
                metrics=gold["metrics"], params=version_params(cfg, "baseline"), same_config_only=False))
            registered.append(reg)
            baseline_version = reg["version"]

        student_dir, masks, key = loaded["model_dir"], None, k_load
        if cfg.prune.enabled:
            key = stage_key(cfg, "prune", ["prune"], key)
            pruned = timer.run("prune", submit_stage, prune_task, cfg, "prune", key, parent_run_id=pid,
                               model_dir=student_dir, splits=loaded["splits"])
            student_dir, masks = pruned["model_dir"], pruned["masks"]
        if cfg.distill.enabled:
            key = stage_key(cfg, "distill", ["distill"], key)
            distilled = timer.run("distill", submit_stage, distill_task, cfg, "distill", key, parent_run_id=pid,
                                  teacher_dir=loaded["model_dir"], student_dir=student_dir, splits=loaded["splits"],
                                  masks=masks)
            student_dir = distilled["model_dir"]
        candidate, cand_key = teacher["artifact"], k_exp
        if student_dir != loaded["model_dir"]:
            cand_key = stage_key(cfg, "export_student", ["export"], key, f"format{EXPORT_FORMAT}")
            student = timer.run("export_student", submit_stage, export_task, cfg, "export_student", cand_key,
                                parent_run_id=pid, model_dir=student_dir)
            k = stage_key(cfg, "golden_student", ["golden"], cand_key)
            timer.run("golden_student", submit_stage, golden_task, cfg, "golden_student", k, parent_run_id=pid,
                      model_dir=student_dir, artifact=student["artifact"], reference_golden=gold["golden"])
            candidate = student["artifact"]
        if cfg.quantize.enabled:
            cand_key = stage_key(cfg, "quantize", ["quantize", "accept"], cand_key)
            quant = timer.run("quantize", submit_stage, quantize_task, cfg, "quantize", cand_key, parent_run_id=pid,
                              src_artifact=candidate, splits=loaded["splits"])
            candidate = quant["artifact"]

        verdict, deployed = None, None
        if cfg.accept.enabled:
            k = stage_key(cfg, "accept", ["accept"], cand_key, k_exp)
            verdict = timer.run("accept", submit_stage, accept_task, cfg, "accept", k, parent_run_id=pid,
                                candidate=candidate, baseline=teacher["artifact"], splits=loaded["splits"],
                                heldout=loaded["heldout"], evaluated=quant.get("evaluation") if cfg.quantize.enabled else None)
            for reason in verdict["reasons"]:
                log.warning("acceptance: %s", reason)
        bench = None
        if cfg.benchmark.enabled and candidate != teacher["artifact"]:
            k = stage_key(cfg, "benchmark", ["benchmark"], cand_key, k_exp)
            bench = timer.run("benchmark", submit_stage, benchmark_task, cfg, "benchmark", k, parent_run_id=pid,
                              candidate=candidate, baseline=teacher["artifact"])
        if candidate != teacher["artifact"]:
            status = "unchecked" if verdict is None else ("accepted" if verdict["accepted"] else "rejected")
            blocked = bench["promotion_blocked"] if bench else None
            if blocked:
                log.warning("promotion blocked: %s", blocked)
            # `candidate` points only at versions that may be promoted: a rejected or blocked one is
            # registered (so it can be compared) but moves no alias.
            aliases = ["candidate"] if status != "rejected" and not blocked else []
            tags = {"role": "candidate", "verdict": status, "config_hash": cfg.section_hash()}
            # Only tags that say something: the UI shows an empty `promotion_blocked` as a badge.
            if verdict and verdict["reasons"]:
                tags["reasons"] = "; ".join(verdict["reasons"])
            if blocked:
                tags["promotion_blocked"] = blocked
            figures = {**(model_figures(verdict) if verdict else {}),
                       **({f"bench_{k}": v for k, v in {**bench["candidate"], **bench["ratios"]}.items()} if bench else {})}
            reg = timer.run("register", lambda: register_task(cfg, pid, candidate, aliases, tags, metrics=figures,
                                                              params=version_params(cfg, "candidate", status)))
            registered.append(reg)
            if baseline_version is not None and (verdict or bench):
                # The baseline's own figures under the same names, so the UI's Compare lines them up.
                base = baseline_figures(verdict) if verdict else {}
                base.update({f"bench_{k}": v for k, v in (bench["baseline"] if bench else {}).items()})
                registry.log_figures(cfg.registry.model_name, baseline_version, base)
            if status == "accepted" and cfg.registry.promote and not blocked:
                server_url = cfg.registry.server_url or local_server_url(cfg, reg["name"])
                deployed = deploy_flow(model_name=reg["name"], version=reg["version"], server_url=server_url,
                                       tracking_uri=tracking_uri)
                if server_url is None:
                    deployed["smoke"] = (f"skipped (no server at http://{cfg.serve.host}:{cfg.serve.port} serves "
                                         f"{reg['name']} from this registry; set registry.server_url to smoke-test "
                                         f"another)")
                reg["aliases"] = reg["aliases"] + ["champion"]
                log.info("deployed: %s", deployed)
            mlflow.set_tags({"verdict": status, **({"promotion_blocked": blocked} if blocked else {})})

        for r in timer.rows:
            log_metrics({f"{r['stage']}_seconds": r["seconds"], **r["metrics"]})
        summary = timer.markdown(cfg, parent, tracking_uri, registered, verdict)
        mlflow.log_text(summary, "summary.md")
    create_markdown_artifact(markdown=summary, key="compress-summary", description=f"compression run {cfg.name}")
    log.info("\n%s", summary)
    ui = registry.ui_url(tracking_uri, cfg.mlflow.ui_url)
    return {"run_id": pid, "tracking_uri": tracking_uri, "stages": timer.rows, "registered": registered,
            "teacher_artifact": teacher["artifact"], "candidate_artifact": candidate, "golden": gold["metrics"],
            "verdict": verdict, "benchmark": bench, "deployed": deployed,
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
