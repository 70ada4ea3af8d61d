"""Tasks: the selection split's gate for a graph export.weights auto wrote from the checkpoint
(compress/evaluate/written_form.py), and the timing of the graphs that passed against each other at the deployment's
concurrency (compress/quantize/choice.py fastest_form): their figures logged as the quantize stage logs each form's
(auto_<form>_*, the plot auto_forms_tokens_per_s.png), so the MLflow compare page lines runs of both paths up.
"""

from __future__ import annotations

from prefect import task

from compress.evaluate.settings import AcceptConfig
from compress.loading.settings import ModelConfig
from compress.quantize.settings import QuantizeConfig
from tasks.common import StageRun, cache_key_fn, mark_done, open_stage, stage_logger
from tasks.load import load_splits
from tasks.results import FormGated, FormsTimed
from tasks.tracking import child_run, log_figure, log_metrics, log_params


@task(name="export_gate", cache_key_fn=cache_key_fn, persist_result=True)
def export_gate_task(at: StageRun, *, accept: AcceptConfig, model: ModelConfig, int4_keep_int8: float,
                     artifact: str, weights: str, splits: str, model_dir: str) -> FormGated:
    """artifact: the export's graph, written with ``weights`` (int4 | int8, ``int4_keep_int8`` of its groups at 8 bits)
    from the checkpoint in ``model_dir``; splits: the load stage's splits file (its selection split is read)."""
    folder, done = open_stage(at, FormGated)
    if done is not None:
        return done
    from compress.evaluate.written_form import gate_written_form

    with child_run(at.parent_run_id, at.stage) as run:
        g = gate_written_form(accept, model, artifact, weights, load_splits(splits).selection, model_dir=model_dir,
                              splits=splits, int4_keep_int8=int4_keep_int8)
        a, name = g.attempt, f"auto_{g.attempt['form']}"
        metrics = {f"{name}_accepted": float(g.accepted), f"{name}_perplexity_ratio": a["perplexity_ratio"],
                   f"{name}_top1_agreement": a["top1_agreement"], f"{name}_size_ratio": a["size_ratio"]}
        log_params({"export_gate_weights": weights})
        log_metrics(metrics)
        if run is not None:
            import mlflow

            mlflow.set_tags({"export_form": weights, "verdict": "accepted" if g.accepted else "rejected",
                             **({"failed": a["failed"][:4000]} if a["failed"] else {})})
        stage_logger().info("export_gate: the %s graph %s on the selection split (perplexity ratio %.4f, top-1 "
                            "agreement %.4f%s)", weights, "passed" if g.accepted else "failed", a["perplexity_ratio"],
                            a["top1_agreement"], f"; {a['failed']}" if a["failed"] else "")
    return mark_done(folder, FormGated(accepted=g.accepted, attempt=a, evaluation=g.evaluation, metrics=metrics))


@task(name="export_timing", cache_key_fn=cache_key_fn, persist_result=True)
def export_timing_task(at: StageRun, *, quantize: QuantizeConfig, artifacts: dict[str, str],
                       perplexity: dict[str, float], splits: str) -> FormsTimed:
    """artifacts: form -> a graph that passed export_gate; perplexity: its selection-split perplexity (the tie-break
    within quantize.auto_speed_tolerance)."""
    folder, done = open_stage(at, FormsTimed)
    if done is not None:
        return done
    from pathlib import Path

    from compress.quantize.choice import fastest_form, profile_figure

    prompt = [int(t) for t in load_splits(splits).selection[0][:32]]
    records: dict[str, dict] = {n: {} for n in artifacts}
    with child_run(at.parent_run_id, at.stage):
        chosen = fastest_form({n: Path(p) for n, p in artifacts.items()}, perplexity, records, quantize, prompt)
        metrics = {f"auto_{n}_{k}": float(v) for n, r in records.items() for k, v in r.items()}
        log_params({"auto_concurrency": quantize.auto_concurrency, "export_timing_chosen": chosen})
        log_metrics(metrics)
        fig = profile_figure(records, chosen)
        if fig is not None:
            log_figure(fig, "auto_forms_tokens_per_s.png")
        users = quantize.auto_concurrency
        stage_logger().info("export_timing: %s kept (%s)", chosen, ", ".join(
            f"{n} {r.get(f'tokens_per_s_b{users}', 0):.1f} tokens/s at {users} users" if users > 1 else
            f"{n} {r['decode_ms_per_step']:.1f} ms a step" for n, r in records.items()))
    return mark_done(folder, FormsTimed(chosen=chosen, records=records, metrics=metrics))
