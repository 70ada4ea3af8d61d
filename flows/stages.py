"""How the flow hands each stage its part of the config, built from the config the flow holds at that step (its
`auto`s resolved after load): the run's context (stage folders, the cache keys' section hashes, the MLflow parent
run), the candidate chain's sections, a search branch's and its gate's. Tasks get these typed parts, never the
PipelineConfig.
"""

from __future__ import annotations

from pathlib import Path

from compress.config import PipelineConfig, project_root
from tasks.chain import ChainSettings
from tasks.common import RunContext
from tasks.search import SearchGate

# The groups of sections stage keys hash (RunContext.at): a stage's key changes with exactly these settings.
KEY_SECTIONS = (("model", "data"), ("export",), ("golden",), ("prune",), ("distill",), ("quantize", "accept"),
                ("quantize",), ("accept",), ("benchmark",))


def workdir(cfg: PipelineConfig) -> Path:
    """Where stage folders live: `workdir`, relative to the project root unless absolute."""
    p = Path(cfg.workdir)
    return p if p.is_absolute() else project_root() / p


def run_context(cfg: PipelineConfig, parent_run_id: str | None) -> RunContext:
    return RunContext(workdir=str(workdir(cfg)), parent_run_id=parent_run_id,
                      section_hashes={"+".join(g): cfg.section_hash(*g) for g in KEY_SECTIONS})


def trained(cfg: PipelineConfig) -> bool:
    """Whether the candidate is pruned or distilled (the gate's criteria `auto` reads it)."""
    return cfg.prune.enabled or cfg.distill.enabled


def chain_settings(cfg: PipelineConfig, ctx: RunContext) -> ChainSettings:
    return ChainSettings(ctx=ctx, model=cfg.model, block_size=cfg.data.block_size, prune=cfg.prune,
                         distill=cfg.distill, export=cfg.export, golden=cfg.golden, quantize=cfg.quantize,
                         accept=cfg.accept, config_hash=cfg.section_hash())


def branch_config(cfg: PipelineConfig, ratio: float) -> PipelineConfig:
    """`cfg` with prune.mlp_ratio = ratio, validated: the config of that one branch (and of the pick, after)."""
    dump = cfg.model_dump(mode="json")
    dump["prune"]["mlp_ratio"] = ratio
    return PipelineConfig.model_validate(dump)


def search_gate(cfg: PipelineConfig) -> SearchGate:
    """A branch's gate: accept's tolerances on the selection split, less the held-out source's check, each accuracy
    tolerance narrowed by search.selection_margin (compress.evaluate.gate.selection_limits)."""
    return SearchGate(accept=cfg.accept, margin=cfg.search.selection_margin, trained=trained(cfg),
                      chat_sets=list(cfg.search.chat_sets), seed=cfg.data.seed)


def resolve_config_path(config: str) -> Path:
    """A config path as given, else relative to the project root (a deployment's working directory may differ)."""
    path = Path(config)
    if not path.is_absolute() and not path.exists():
        path = project_root() / path
    return path
