"""Registering the run's versions: the baseline before the compression stages, the candidate after its verdict,
with its figures, scorecard, tags and note, compared with the champion and promoted (compare-and-set under the
model's promotion lock, flows/promotion.py) when decide_promotion says so."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import mlflow
from prefect import get_run_logger

from compress.artifact import read_manifest
from compress.config import PipelineConfig
from compress.registry import store as registry
from compress.registry.scorecard import card_params, form_of, scorecard
from flows.deploy import deploy_flow, served_model
from flows.promotion import decide_promotion, promote_if_still_best, verdict_status
from flows.summary import StageTimer
from tasks.chain import TeacherStages
from tasks.register import register_task
from tasks.results import Benchmarked, Judged, Registered
from tasks.tracking import flatten


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
    reg = timer.run("register", lambda: register_task(
        cfg.registry.model_name, pid, candidate, aliases, tags, metrics={**figures, **card},
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


def register_baseline(cfg: PipelineConfig, pid: str, timer: StageTimer, t: TeacherStages) -> Registered:
    """Registered before the compression stages so a later failure still leaves the baseline. With an INT8 or
    4-bit export the baseline is the checkpoint itself, recorded by digest (its weights stay put)."""
    tags = {"role": "baseline", "config_hash": cfg.section_hash()}
    return timer.run("register_baseline", lambda: register_task(
        cfg.registry.model_name, pid, t.teacher.record if t.teacher.from_checkpoint else t.teacher.artifact, ["baseline"], tags,
        stage="register_baseline", metrics=t.gold.metrics, params=version_params(cfg, "baseline"),
        same_config_only=False, weights=cfg.registry.baseline_weights))
