"""Build the champion's drafter, judge it on the serving engine, register it beside the champion when it pays.

On demand (`prefect deployment run 'draft/on-demand'`) or on a schedule (the `draft/weekly` deployment): the
version behind `champion` (or a named one) is fetched from the registry, its drafter is built (compress/draft/,
settings in the config's `draft:` section), judged one user at a time (compress/draft/judge.py) and, when the
target is at least `draft.min_speedup` faster with it, registered as a version of `<model_name>-drafter` and
linked from the target version (tag `drafter`). A server started with `serve.speculative: auto` follows the link:
the champion's drafter comes and goes with the champion (a rollback brings the old version's own drafter, or none).
The target version's verdict and aliases are never touched.

Outcomes: Completed "Registered" (drafter version and figures), Completed "NotRegistered" (the figures and why).
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import mlflow
from prefect import flow, get_run_logger

from compress.registry import store as registry
from compress.artifact import read_manifest
from compress.config import PipelineConfig, load_config
from compress.draft.judge import DraftingBound, drafting_bound
from flows.outcome import flow_state
from flows.stages import resolve_config_path, workdir

DRAFTER_TAG = "drafter"  # on the target version: "<drafter model>/<version>"


def drafter_model(model_name: str) -> str:
    return f"{model_name}-drafter"


def fetch_target(cfg: PipelineConfig, version: str | None) -> tuple[str, Path, str]:
    """(version, local folder, manifest sha256) of the target: ``version`` or the champion."""
    from serve.artifact import sha256_file

    name = cfg.registry.model_name
    if version is None:
        v = registry.version_for_alias(name, "champion")
        if v is None:
            raise ValueError(f"registry.model_name {name!r} has no champion to build a drafter for; run the "
                             f"pipeline first or pass -p version=N")
        version = v.version
    dst = workdir(cfg) / "draft" / f"target-{name}-v{version}"
    if not (dst / "manifest.json").is_file():
        shutil.rmtree(dst, ignore_errors=True)
        dst = Path(registry.download(f"models:/{name}/{version}", dst))  # the version's files, as the server gets them
        if not (dst / "manifest.json").is_file():
            raise ValueError(f"version {version} of {name} holds no artifact (manifest.json)")
    return str(version), dst, sha256_file(dst / "manifest.json")


def build_for_champion(cfg: PipelineConfig, version: str | None = None) -> dict:
    from compress.draft.judge import judge_drafter
    from compress.draft.stage import build_drafter
    from tasks.tracking import log_figure, log_metrics, log_params

    log = get_run_logger()
    registry.configure(cfg.mlflow.tracking_uri, cfg.mlflow.experiment)
    name = cfg.registry.model_name
    version, target, sha = fetch_target(cfg, version)
    key = hashlib.sha256(f"{sha}:{cfg.section_hash('draft')}".encode()).hexdigest()[:16]
    folder = workdir(cfg) / "draft" / key
    folder.mkdir(parents=True, exist_ok=True)
    with mlflow.start_run(run_name=f"draft-{name}-v{version}", tags={"stage": "draft", "target_version": version},
                          nested=mlflow.active_run() is not None):  # a child of the compress run's, in its draft stage
        log_params({"draft": cfg.draft.model_dump(mode="json"), "target_version": version})
        built = build_drafter(target, folder / "head", cfg.draft, cache=folder / "conversations.npz")
        log.info("drafter built in %.0f s: held-out acceptance %.2f drafts per check (by position %s)", built.seconds,
                 built.accepted_per_check, ", ".join(f"{r:.2f}" for r in built.rate_by_position))
        judged = judge_drafter(target, built.path, uniform_kernels=cfg.serve.uniform_kernels)
        figures = {**built.metrics(), **judged.metrics()}
        log_metrics(figures)
        for i, loss in enumerate(built.losses[::10]):
            mlflow.log_metric("draft_train_loss", loss, step=10 * i)
        log_figure(curves(built), "draft_head.png")
        pays = judged.speedup >= cfg.draft.min_speedup
        out = {"target": f"{name}/{version}", "figures": figures, "path": str(built.path), "registered": None}
        if not pays:
            out["why"] = (f"one user {judged.tokens_per_s_on} tokens/s with it against {judged.tokens_per_s_off} "
                          f"without: {judged.speedup}x < draft.min_speedup {cfg.draft.min_speedup}")
            return out
        run_id = mlflow.active_run().info.run_id
        dv = registry.register_folder(built.path, drafter_model(name), run_id,
                                      {"target_model": name, "target_version": version, "target_sha256": sha,
                                       "speedup": judged.speedup}, metrics=figures)
        registry.set_tags(name, version, {DRAFTER_TAG: f"{drafter_model(name)}/{dv.version}",
                                          "drafter_speedup": judged.speedup})
        out["registered"] = f"{drafter_model(name)}/{dv.version}"
        return out


@dataclass
class DraftStage:
    """The compress flow's draft stage: the draft flow's outcome for the accepted version, or why no drafter was built
    and what drafting could give it (``bound``)."""

    line: str
    built: dict | None = None
    bound: DraftingBound | None = None

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self.built["figures"]) if self.built else self.bound.metrics() if self.bound else {}

    def to_json(self) -> dict:
        return {"line": self.line, "built": self.built, "bound": self.bound and asdict(self.bound)}


def draft_stage(cfg: PipelineConfig, version: str, target: str | Path) -> DraftStage:
    """After the compress flow registered ``version`` as accepted: build, judge and register its drafter
    (build_for_champion), or, for a target below ``draft.min_params``, measure what drafting could give it. A
    failure here is reported, never raised: the drafter only changes speed and the version's verdict stands."""
    log = get_run_logger()
    try:
        params = int(read_manifest(Path(target), verify=False).get("num_parameters") or 0)
        if params and params < cfg.draft.min_params:
            bound = drafting_bound(target)
            line = (f"skipped: {params:,} parameters < draft.min_params {cfg.draft.min_params:,} (docs/drafter.md); "
                    f"{bound.line()}")
            return DraftStage(line, bound=bound)
        out = build_for_champion(cfg, version)
        return DraftStage(outcome_message(out), built=out)
    except Exception as e:  # noqa: BLE001 - the accepted version and its aliases stay as they are
        log.exception("draft stage failed")
        return DraftStage(f"failed ({type(e).__name__}: {e}); the version is registered as judged, without a drafter")


def curves(built):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot(built.losses, lw=0.8)
    a.set(title="draft head distillation", xlabel="step", ylabel="loss (KL x T^2 + features)")
    b.bar(range(1, len(built.rate_by_position) + 1), built.rate_by_position)
    b.set(title="held-out acceptance by draft position", xlabel="position", ylabel="accepted | earlier accepted",
          ylim=(0, 1))
    fig.tight_layout()
    return fig


def outcome_message(out: dict) -> str:
    f = out["figures"]
    head = (f"{out['target']}: one user x{f['draft_judge_speedup']:.2f} ({f['draft_judge_tokens_per_s_off']:.1f} -> "
            f"{f['draft_judge_tokens_per_s_on']:.1f} tokens/s), acceptance {f['draft_judge_acceptance']:.2f}, "
            f"built in {f['draft_seconds']:.0f} s")
    return f"{head}; registered {out['registered']}" if out["registered"] else f"{head}; not registered: {out['why']}"


@flow(name="draft", log_prints=True)
def draft_flow(config: str = "configs/default.yaml", overrides: list[str] | None = None,
               version: str | None = None):
    """Build, judge and (when it pays) register the drafter of the champion (or of ``version``)."""
    return flow_state(lambda: build_for_champion(load_config(resolve_config_path(config), overrides or []), version),
                      lambda out: "Registered" if out["registered"] else "NotRegistered", outcome_message)
