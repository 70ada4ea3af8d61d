"""Task: the verdict. Candidate and baseline on the held-out test split, through the acceptance gate.

Three evaluations, each of the candidate against the baseline (the reference for agreement and KL):

- the verdict's, on the test split (heldout.npz, which no stage before this one opens): the gate decides
  on these figures; they keep the plain names (candidate_perplexity, gate_perplexity_ratio, ...);
- the held-out source's (text of another genre, data.heldout_source), beside it as ``heldout_*`` figures;
- the chat set's (compress/evaluate/chat.py: held-out chat prompts in the model's template, the teacher's answers as
  targets, the candidate's own answers judged by the teacher), as ``chat_*`` figures the gate reads too, when the
  model has a chat template and accept.chat_sets is set; the teacher's side is cached in <workdir>/chat_targets/;
- the selection split's (eval, which the relax loop and distillation chose on), as ``selection_*`` figures.
  When the quantize stage's accuracy-aware loop already measured this candidate against this baseline on
  that split, its figures are used as they are instead of being measured a second time (``evaluated_in``).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import mlflow
from prefect import task

from compress.artifact import read_manifest
from compress.config import PipelineConfig
from compress.data import load_heldout
from compress.evaluate import accept, chat_limit, downstream_scores, evaluate_onnx, genre_table, resolve_criteria
from compress.evaluate import chat as chat_eval
from compress.evaluate.budget import Budget
from compress.evaluate.checkpoint_ref import CheckpointReference, resolve
from compress.evaluate.onnx_eval import ReferencePass
from compress.export.weights import written_int8
from compress.memory import Shape, accept_bytes, check_stage_memory
from compress.room import check_room
from tasks.common import cache_key_fn, mark_done, open_stage, workdir
from tasks.load import load_splits
from tasks.tracking import child_run, log_figure, log_json, log_metrics, log_params

log = logging.getLogger(__name__)


def _same(a: str, b: str) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def reusable(evaluated: dict | None, baseline: str, splits: str) -> bool:
    """Whether an earlier stage's `evaluation` measured the candidate against `baseline` on `splits`' eval split.

    A quantized student was gated against the fp32 student, not the teacher: its agreement and
    perplexity ratio answer another question, so the accept stage measures it again.
    """
    return bool(evaluated) and _same(evaluated["reference"], baseline) and _same(evaluated["splits"], splits)


def side_figures(prefix: str, cand: dict, base: dict) -> dict[str, float]:
    """The figures logged beside the verdict's: candidate perplexity, its ratio to the baseline's, agreement, KL."""
    out = {f"{prefix}_perplexity": cand["perplexity"], f"{prefix}_baseline_perplexity": base["perplexity"],
           f"{prefix}_perplexity_ratio": cand["perplexity"] / base["perplexity"] if base["perplexity"] > 0 else float("inf"),
           f"{prefix}_eval_tokens": cand["eval_tokens"]}
    out.update({f"{prefix}_{k}": cand[k] for k in ("top1_agreement", "kl_to_reference") if k in cand})
    return out


def against_baseline(candidate: str, baseline: str, blocks, latency: bool = False,
                     reference: CheckpointReference | None = None) -> tuple[dict, dict]:
    """The baseline's figures and the candidate's against it on ``blocks``, the baseline run once (ReferencePass):
    its graph, or the checkpoint when ``reference`` is given (then only the candidate's latency is timed)."""
    if reference is None:
        with ReferencePass(baseline, blocks, latency=latency) as ref:
            return ref.figures, evaluate_onnx(candidate, blocks, reference=ref, latency=latency)
    with reference.loaded() as lm:
        ref = ReferencePass(baseline, blocks, latency=False, lm=lm)
    with ref:  # the spooled logits are all the candidate needs: the checkpoint is gone before its session comes
        return ({**ref.figures, "size_bytes": float(reference.stored_bytes())},
                evaluate_onnx(candidate, blocks, reference=ref, latency=latency))


def reference_of(cfg: PipelineConfig, model_dir: str | None, baseline: str | None = None) -> CheckpointReference | None:
    """The checkpoint as the reference when accept.reference resolves to it (checkpoint_ref.resolve), or always when
    the baseline artifact is the INT8 graph the export wrote from it (export.weights int8); else None: the baseline
    artifact's graph."""
    setting = cfg.accept.reference
    if baseline is not None and written_int8(read_manifest(baseline, verify=False)):
        setting = "checkpoint"
    if not resolve(setting, model_dir, cfg.accept.min_decode_speed_ratio is not None):
        return None
    m = cfg.model
    return CheckpointReference(str(model_dir), str(m.cache_dir), m.revision, m.trust_remote_code)


def chat_figures(cfg: PipelineConfig, candidate: str, baseline: str, check=None,
                 reference: CheckpointReference | None = None) -> tuple[dict, str]:
    """The chat set's figures of the candidate against the baseline (the teacher), and a note saying what was
    scored or why nothing was."""
    a = cfg.accept
    if not a.chat_sets:
        return {}, "not scored: accept.chat_sets is []"
    if not chat_eval.has_chat_template(baseline):
        return {}, "not scored: the model has no chat template (set accept.chat_sets: [] to say so)"
    prompts = chat_eval.render(baseline, chat_eval.load_sets(a.chat_sets))
    chat = chat_eval.evaluate_chat(candidate, baseline, prompts, None, a.chat_divergence_tokens,
                                   a.chat_max_new_tokens, check=check, cache_dir=workdir(cfg) / "chat_targets",
                                   reference=reference)
    return chat, (f"{len(prompts)} conversations of {', '.join(a.chat_sets)}; teacher answers "
                  f"{'reused from cache' if chat['teacher_cached'] else 'generated'}")


@task(name="accept", cache_key_fn=cache_key_fn, persist_result=True)
def accept_task(cfg: PipelineConfig, stage: str, key: str, parent_run_id: str | None, candidate: str,
                baseline: str, splits: str, heldout: str, evaluated: dict | None = None,
                model_dir: str | None = None) -> dict:
    """heldout: the load stage's heldout.npz. evaluated: the quantize stage's `evaluation` of this candidate on
    the selection split, or None (quantize off, or no loop ran). model_dir: the source checkpoint's folder, the
    reference when accept.reference resolves to it."""
    folder, done = open_stage(cfg, stage, key)
    if done is not None:
        return done
    with child_run(parent_run_id, stage) as run:
        log_params({"accept": cfg.accept.model_dump()})
        held = load_heldout(heldout)
        reference_name = "artifact"
        budget = Budget(cfg.accept.max_minutes, "accept.max_minutes")
        ref = reference_of(cfg, model_dir, baseline)
        shape = Shape.of_manifest(read_manifest(baseline, verify=False))
        check_stage_memory("accept", shape, block=held.test.shape[1],
                           need=accept_bytes(shape, ref is not None, block=held.test.shape[1]))
        # the reference's logits of the largest split, spooled while the candidate reads them (onnx_eval.ReferencePass)
        spool = max(len(b) * (b.shape[1] - 1) for b in (held.test, held.heldout) if b is not None) * shape.vocab * 4
        check_room("accept", tempfile.gettempdir(), spool, "the reference's logits, spooled: free the room or set "
                   "TMPDIR to a larger disk")
        if ref is not None:
            reference_name = "checkpoint"
            log.info("accept: judged against the checkpoint %s as stored (accept.reference: %s)", model_dir,
                     cfg.accept.reference)
        with budget.part("test"):
            base, cand = against_baseline(candidate, baseline, held.test, latency=True, reference=ref)
        criteria = resolve_criteria(cfg.accept, cfg.prune.enabled or cfg.distill.enabled)
        side: dict[str, float] = {}
        if held.heldout is not None:
            with budget.part("heldout"):
                held_base, held_cand = against_baseline(candidate, baseline, held.heldout, reference=ref)
                side.update(side_figures("heldout", held_cand, held_base))
        if criteria == "quality" and cfg.accept.max_downstream_drop is not None:
            n = cfg.accept.downstream_items
            with budget.part("downstream"):
                cand.update(downstream_scores(candidate, held.test, held.heldout, n, seed=cfg.data.seed))
                base.update(downstream_scores(baseline, held.test, held.heldout, n, seed=cfg.data.seed))
        with budget.part("chat"):
            chat, chat_note = chat_figures(cfg, candidate, baseline, budget.check, ref)
        cand.update({k: v for k, v in chat.items() if k not in ("by_kind", "seconds", "teacher_cached")})
        if chat:  # the teacher against itself, under the same names, so the registry's Compare lines them up
            base.update({"chat_perplexity": chat["chat_baseline_perplexity"], "chat_perplexity_ratio": 1.0,
                         "chat_top1_agreement": 1.0}
                        | ({"chat_judged_ratio": 1.0, "chat_late_divergence_share": 1.0}
                           if "chat_judged_ratio" in chat else {}))
        # The gate reads the held-out source's perplexity beside the test split's (quality criteria).
        held_ppl = ({"heldout_perplexity": side["heldout_perplexity"]},
                    {"heldout_perplexity": side["heldout_baseline_perplexity"]}) if side else ({}, {})
        verdict = accept({**cand, **held_ppl[0]}, {**base, **held_ppl[1]}, cfg.accept, criteria)
        if reusable(evaluated, baseline, splits):
            evaluated_in = "quantize"
            sel_base, sel_cand = evaluated["baseline"], evaluated["candidate"]
        else:
            evaluated_in = "accept"
            with budget.part("selection"):
                sel_base, sel_cand = against_baseline(candidate, baseline, load_splits(splits).eval, reference=ref)
        side.update(side_figures("selection", sel_cand, sel_base))
        if run is not None:
            mlflow.set_tags({"evaluated_in": evaluated_in, "heldout_source": held.heldout_source,
                             "accept_criteria": verdict.criteria, "accept_reference": reference_name,
                             "verdict": "accepted" if verdict.accepted else "rejected",
                             **({"reasons": "; ".join(verdict.reasons)[:4000]} if verdict.reasons else {})})
        seconds = {**budget.seconds, **{f"chat_{k}": v for k, v in chat.get("seconds", {}).items()}}
        metrics = {**{f"baseline_{k}": v for k, v in base.items()}, **{f"candidate_{k}": v for k, v in cand.items()},
                   **verdict.metrics, **side, "accepted": float(verdict.accepted),
                   **{f"accept_seconds_{k}": v for k, v in seconds.items()}}
        log_metrics(metrics)
        genres = genre_table(verdict.checks)
        if chat and run is not None:
            limits = [chat_limit(cfg.accept, k, verdict.criteria) for k in ("max_chat_perplexity_ratio",
                                                                            "max_chat_judged_ratio")]
            log_figure(chat_eval.plot_by_kind(chat, *limits), "chat_by_kind.png")
        log_json(verdict.record(genres=genres, chat=chat, chat_note=chat_note, candidate=cand, baseline=base,
                                split="test", heldout_source=held.heldout_source, side=side,
                                selection={"candidate": sel_cand, "baseline": sel_base}, evaluated_in=evaluated_in,
                                seconds=seconds, reference=reference_name),
                 "verdict.json")
    return mark_done(folder, verdict.record(
        metrics=metrics, genres=genres, chat_by_kind=chat.get("by_kind", {}), chat_note=chat_note, candidate=cand,
        baseline=base, heldout_source=held.heldout_source, selection={"candidate": sel_cand, "baseline": sel_base},
        evaluated_in=evaluated_in, seconds=seconds, reference=reference_name,
        run_id=run.info.run_id if run is not None else None))
