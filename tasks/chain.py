"""A candidate's chain of stages: prune -> distill -> export + golden of the student -> quantize, each switched on
by its own section. The single-candidate path of flows/pipeline.py and every branch of the pruning search
(tasks/search.py) run it, so both compute the same stages under the same cache keys: a branch's ratio is its
`prune.mlp_ratio`, which every key downstream of prune hashes.

The chain gets its sections and the run's context (ChainSettings), never the whole config.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from compress.distill.settings import DistillConfig
from compress.evaluate.settings import AcceptConfig, GoldenConfig
from compress.export import EXPORT_FORMAT
from compress.export.settings import ExportConfig
from compress.loading.settings import ModelConfig
from compress.prune.settings import PruneConfig
from compress.quantize import QUANT_FORMAT
from compress.quantize.settings import QuantizeConfig
from tasks.common import RunContext, stage_logger, submit_stage
from tasks.distill import distill_task
from tasks.export import export_task
from tasks.golden import golden_task
from tasks.prune import prune_task
from tasks.quantize import quantize_task
from tasks.results import Exported, Golden, Loaded, Quantized


@dataclass(frozen=True)
class ChainSettings:
    """What the chain reads: its stages' sections, the model section (how checkpoints load), data.block_size, the
    run's config hash (written into each export's manifest) and the run's context (stage folders, keys, parent
    run)."""

    ctx: RunContext
    model: ModelConfig
    block_size: int
    prune: PruneConfig
    distill: DistillConfig
    export: ExportConfig
    golden: GoldenConfig
    quantize: QuantizeConfig
    accept: AcceptConfig
    config_hash: str


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
    The config they ran under is the flow's (its `auto`s resolved after load: compress/resolve/auto.py)."""

    k_load: str
    loaded: Loaded
    k_exp: str
    teacher: Exported
    gold: Golden
    # export.weights auto from the checkpoint: the forms the export weighed on the selection split (tasks/export_gate.py)
    forms: Quantized | None = None


def candidate_chain(c: ChainSettings, t: TeacherStages, run: Callable = _plain_run) -> Chain:
    """prune -> distill -> export + golden of the student -> quantize, each switched on by its section.

    run(name, fn, *args, **kwargs) calls each stage (the flow's StageTimer.run, or a branch's recorder).
    """
    loaded, teacher, ctx = t.loaded, t.teacher, c.ctx
    student_dir, masks, layers, key = loaded.model_dir, None, None, t.k_load
    if c.prune.enabled:
        at = ctx.at("prune", ["prune"], key)
        pruned = run("prune", submit_stage, prune_task, at, prune=c.prune, model=c.model, block_size=c.block_size,
                     model_dir=student_dir, splits=loaded.splits)
        student_dir, masks, layers, key = pruned.model_dir, pruned.masks, pruned.teacher_layers, at.key
    if c.distill.enabled:
        at = ctx.at("distill", ["distill"], key)
        distilled = run("distill", submit_stage, distill_task, at, distill=c.distill, model=c.model,
                        block_size=c.block_size, teacher_dir=loaded.model_dir, student_dir=student_dir,
                        splits=loaded.splits, masks=masks, teacher_layers=layers)
        student_dir, key = distilled.model_dir, at.key
    candidate, cand_key = teacher.artifact, t.k_exp
    if student_dir != loaded.model_dir:
        at = ctx.at("export_student", ["export"], key, f"format{EXPORT_FORMAT}")
        student = run("export_student", submit_stage, export_task, at, export=c.export, quantize=c.quantize,
                      model=c.model, model_dir=student_dir, config_hash=c.config_hash)
        cand_key = at.key
        run("golden_student", submit_stage, golden_task, ctx.at("golden_student", ["golden"], cand_key),
            golden=c.golden, model=c.model, model_dir=student_dir, artifact=student.artifact,
            reference_golden=t.gold.golden)
        candidate = student.artifact
    quant = None
    if teacher.from_checkpoint:
        quant = t.forms  # the forms export.weights auto weighed, when it did
        # the export wrote the weight-only INT8 (4-bit) graph from the checkpoint: it is the candidate, nothing is
        # left to quantize (W8A8 would calibrate the fp32 graph, which was never written)
        stage_logger().info("quantize: skipped, the export wrote the %s candidate from the checkpoint "
                            "(export.weights %s)", teacher.weights.upper(), teacher.weights)
    elif c.quantize.enabled:
        at = ctx.at("quantize", ["quantize", "accept"], cand_key, f"format{QUANT_FORMAT}")
        quant = run("quantize", submit_stage, quantize_task, at, quantize=c.quantize, accept=c.accept,
                    src_artifact=candidate, splits=loaded.splits)
        candidate, cand_key = quant.artifact, at.key
    return Chain(candidate=candidate, cand_key=cand_key, quant=quant, student_dir=student_dir)


