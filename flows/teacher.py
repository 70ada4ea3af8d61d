"""The stages every run shares: load, every `auto` of the config resolved, export and golden (and, where
export.weights auto wrote 4 bits from the checkpoint, its gate on the selection split and the 8-bit graph where it
fails). Their keys are the candidate chain's roots (tasks/chain.py)."""

from __future__ import annotations

from dataclasses import replace

from prefect import get_run_logger

from compress.config import PipelineConfig
from compress.corpus.splits import DATA_FORMAT
from compress.export import EXPORT_FORMAT, fallback_weights, int4_keep_ladder
from compress.resolve import ResolvedConfig, resolve_config
from compress.sizing.memory import shape_of_folder
from flows.stages import run_context
from flows.summary import StageTimer
from tasks.chain import TeacherStages
from tasks.common import submit_stage
from tasks.export import export_task
from tasks.export_gate import export_gate_task, export_timing_task
from tasks.golden import golden_task
from tasks.load import load_task
from tasks.results import FormGated, Quantized
from tasks.tracking import log_json


def export_key_part(cfg: PipelineConfig, weights: str) -> str:
    """What of the quantize section shapes an export that writes quantized weights from the checkpoint."""
    q = cfg.quantize
    if weights == "int8":
        return f"int8b{q.weight_block_size}a{q.accuracy_level}"
    if weights == "int4":
        return (f"int4b{q.weight_block_size}a{q.accuracy_level}s{int(q.weight_symmetric)}k{q.int4_keep_int8}"
                f"c{int(q.w4_clip(False))}h{int(q.int4_lm_head)}" + (f"f{q.w4_block()}" if q.int4_block_size else ""))
    return ""


def teacher_stages(cfg: PipelineConfig, pid: str, timer: StageTimer) -> tuple[ResolvedConfig, TeacherStages]:
    """load, then every `auto` resolved (logged once: resolved_config.json), then export and golden under the
    resolved config, which the rest of the run uses (the ResolvedConfig returned beside the stages). When export.weights auto wrote
    4 bits from the checkpoint, the graph is gated on the selection split, and where it fails the export writes 8 bits
    instead (``written_forms``)."""
    at = run_context(cfg, pid).at("load", ["model", "data"], f"data{DATA_FORMAT}")
    loaded = timer.run("load", submit_stage, load_task, at, model=cfg.model, data=cfg.data)
    k_load = at.key
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
    return resolved, TeacherStages(k_load, loaded, k_exp, teacher, gold, forms)


def export_and_golden(cfg: PipelineConfig, pid: str, timer: StageTimer, loaded, k_load: str):
    """The export under cfg.export.weights and its golden check: (the export's key, Exported, Golden)."""
    weights = cfg.export.weights
    ctx = run_context(cfg, pid)
    at = ctx.at("export", ["export"], k_load, f"format{EXPORT_FORMAT}", export_key_part(cfg, weights))
    teacher = timer.run("export", submit_stage, export_task, at, export=cfg.export, quantize=cfg.quantize,
                        model=cfg.model, model_dir=loaded.model_dir, weights=weights, config_hash=cfg.section_hash())
    gold = timer.run("golden", submit_stage, golden_task, ctx.at("golden", ["golden"], at.key), golden=cfg.golden,
                     model=cfg.model, model_dir=loaded.model_dir, artifact=teacher.artifact)
    return at.key, teacher, gold


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
        at = run_context(cfg, pid).at("export_timing", ["quantize"], *(w[0] for _, w, _ in passed.values()))
        timed = timer.run("export_timing", submit_stage, export_timing_task, at, quantize=cfg.quantize,
                          artifacts={n: w[1].artifact for n, (_, w, _) in passed.items()},
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
    at = run_context(cfg, pid).at("export_gate", ["accept"], k_exp)  # k_exp chains the load stage's key
    return timer.run("export_gate", submit_stage, export_gate_task, at, accept=cfg.accept, model=cfg.model,
                     int4_keep_int8=cfg.quantize.int4_keep_int8, artifact=teacher.artifact, weights=teacher.weights,
                     splits=loaded.splits, model_dir=loaded.model_dir)
