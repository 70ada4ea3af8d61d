"""The verdict as a plain function: a candidate and its baseline on the held-out test split, the held-out source,
the downstream task and the chat set, through the acceptance gate (gate.py). tasks/accept.py logs it to MLflow and
marks the stage done; benchmarks/gpu_distill.py calls it without Prefect.

Four evaluations, each of the candidate against the baseline (the reference for agreement and KL):

- the verdict's, on the test split (which no stage before this one opens): the gate decides on these figures; they
  keep the plain names (candidate_perplexity, gate_perplexity_ratio, ...);
- the held-out source's (text of another genre), beside it as ``heldout_*`` figures;
- the chat set's (chat.py: held-out chat prompts in the model's template, the teacher's answers as targets, the
  candidate's own answers judged by the teacher), as ``chat_*`` figures the gate reads too, when the model has a chat
  template and accept.chat_sets is set;
- the selection split's (eval, which the relax loop and distillation chose on), as ``selection_*`` figures, unless
  the quantize stage's loop already measured them (``evaluated``).
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from compress.artifact import read_manifest
from compress.corpus.splits import DataSplits
from compress.evaluate import chat as chat_eval
from compress.evaluate.budget import Budget
from compress.evaluate.checkpoint_ref import CheckpointReference, resolve
from compress.evaluate.downstream import downstream_scores
from compress.evaluate.gate import Verdict, accept, genre_table, resolve_criteria
from compress.evaluate.onnx_eval import ReferencePass, evaluate_onnx
from compress.evaluate.settings import AcceptConfig
from compress.export.weights import written_int8
from compress.loading.settings import ModelConfig
from compress.sizing.memory import Shape, accept_bytes, check_stage_memory
from compress.sizing.disk import check_room

log = logging.getLogger(__name__)


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


def reference_of(a: AcceptConfig, m: ModelConfig, model_dir: str | None,
                 baseline: str | None = None) -> CheckpointReference | None:
    """The checkpoint as the reference when accept.reference resolves to it (checkpoint_ref.resolve), or always when
    the baseline artifact is the INT8 graph the export wrote from it (export.weights int8); else None: the baseline
    artifact's graph."""
    setting = a.reference
    if baseline is not None and written_int8(read_manifest(baseline, verify=False)):
        setting = "checkpoint"
    if not resolve(setting, model_dir, a.min_decode_speed_ratio is not None):
        return None
    return CheckpointReference(str(model_dir), str(m.cache_dir), m.revision, m.trust_remote_code)


def structured_figures(a: AcceptConfig, candidate: str, baseline: str) -> dict:
    """The structured genre's figures (compress/evaluate/structured.py) on accept.structured_sets; {} when off or when
    the model has no chat template."""
    sets = a.structured_sets
    if not sets or not chat_eval.has_chat_template(baseline):
        return {}
    from compress.evaluate.structured import evaluate_structured, load_tasks

    return evaluate_structured(candidate, baseline, load_tasks(sets), a.structured_max_new_tokens)


def chat_figures(a: AcceptConfig, candidate: str, baseline: str, cache_dir: str | Path | None, check=None,
                 reference: CheckpointReference | None = None, *, sets: list[str] | None = None,
                 setting: str = "accept.chat_sets", progress: bool = True) -> tuple[dict, str]:
    """The chat figures of the candidate against the baseline (the teacher) on ``sets`` (accept.chat_sets when None;
    search.chat_sets for a search branch, ``setting`` naming the key in messages), and a note saying what was scored
    or why nothing was. The teacher's side is cached in ``cache_dir``."""
    sets = a.chat_sets if sets is None else sets
    if not sets:
        return {}, f"not scored: {setting} is []"
    if not chat_eval.has_chat_template(baseline):
        return {}, f"not scored: the model has no chat template (set {setting}: [] to say so)"
    prompts = chat_eval.render(baseline, chat_eval.load_sets(sets, setting))
    chat = chat_eval.evaluate_chat(candidate, baseline, prompts, None, a.chat_divergence_tokens,
                                   a.chat_max_new_tokens, check=check, cache_dir=cache_dir, reference=reference,
                                   progress=progress)
    return chat, (f"{len(prompts)} conversations of {', '.join(sets)}; teacher answers "
                  f"{'reused from cache' if chat['teacher_cached'] else 'generated'}")


@dataclass
class Judgement:
    """What the verdict found: the gate's Verdict and every figure beside it."""

    verdict: Verdict
    candidate: dict
    baseline: dict
    side: dict  # heldout_* and selection_* figures
    chat: dict
    chat_note: str
    selection: dict  # {"candidate": ..., "baseline": ...} on the selection split
    evaluated_in: str  # quantize (the loop's figures reused) | accept
    heldout_source: str
    reference: str  # artifact | checkpoint
    seconds: dict = field(default_factory=dict)

    @property
    def metrics(self) -> dict[str, float]:
        return {**{f"baseline_{k}": v for k, v in self.baseline.items()},
                **{f"candidate_{k}": v for k, v in self.candidate.items()},
                **self.verdict.metrics, **self.side, "accepted": float(self.verdict.accepted),
                **{f"accept_seconds_{k}": v for k, v in self.seconds.items()}}

    @property
    def genres(self) -> list:
        return genre_table(self.verdict.checks)

    def record(self, **extra) -> dict:
        """verdict.json's content (the stage's DONE.json adds the metrics and the run id through ``extra``)."""
        return self.verdict.record(genres=self.genres, candidate=self.candidate, baseline=self.baseline,
                                   heldout_source=self.heldout_source, side=self.side, selection=self.selection,
                                   evaluated_in=self.evaluated_in, seconds=self.seconds, reference=self.reference,
                                   chat_note=self.chat_note, **extra)


def judge(a: AcceptConfig, candidate: str, baseline: str, held: DataSplits, *, model: ModelConfig, trained: bool,
          seed: int, selection: Callable[[], np.ndarray], evaluated: dict | None = None, model_dir: str | None = None,
          chat_cache: str | Path | None = None) -> Judgement:
    """The verdict on ``candidate`` against ``baseline`` (artifact folders). held: the held-out splits (test, held-out
    source). selection: gives the selection split's blocks, read only when ``evaluated`` (the quantize stage's
    figures of this candidate against this baseline on that split) is None. model_dir: the source checkpoint's
    folder, the reference when accept.reference resolves to it. trained: the candidate was pruned or distilled (the
    criteria's auto); seed: data.seed, the downstream task's sample."""
    reference_name = "artifact"
    budget = Budget(a.max_minutes, "accept.max_minutes")
    ref = reference_of(a, model, model_dir, baseline)
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
                 a.reference)
    with budget.part("test"):
        base, cand = against_baseline(candidate, baseline, held.test, latency=True, reference=ref)
    criteria = resolve_criteria(a, trained)
    side: dict[str, float] = {}
    if held.heldout is not None:
        with budget.part("heldout"):
            held_base, held_cand = against_baseline(candidate, baseline, held.heldout, reference=ref)
            side.update(side_figures("heldout", held_cand, held_base))
    if criteria == "quality" and a.max_downstream_drop is not None:
        n = a.downstream_items
        with budget.part("downstream"):
            cand.update(downstream_scores(candidate, held.test, held.heldout, n, seed=seed))
            base.update(downstream_scores(baseline, held.test, held.heldout, n, seed=seed))
    with budget.part("chat"):
        chat, chat_note = chat_figures(a, candidate, baseline, chat_cache, budget.check, ref)
    cand.update({k: v for k, v in chat.items() if k not in ("by_kind", "seconds", "teacher_cached")})
    with budget.part("structured"):
        structured = structured_figures(a, candidate, baseline)
    if structured:  # the baseline against itself, under the same names (as the chat rows)
        cand.update({k: v for k, v in structured.items() if k != "by_kind"})
        base.update({"structured_valid_share": structured["structured_baseline_valid_share"],
                     "structured_valid_drop": 0.0, "structured_agreement": 1.0})
    if chat:  # the teacher against itself, under the same names, so the registry's Compare lines them up
        base.update({"chat_perplexity": chat["chat_baseline_perplexity"], "chat_perplexity_ratio": 1.0,
                     "chat_top1_agreement": 1.0}
                    | ({"chat_judged_ratio": 1.0, "chat_late_divergence_share": 1.0}
                       if "chat_judged_ratio" in chat else {}))
    # The gate reads the held-out source's perplexity beside the test split's (quality criteria).
    held_ppl = ({"heldout_perplexity": side["heldout_perplexity"]},
                {"heldout_perplexity": side["heldout_baseline_perplexity"]}) if side else ({}, {})
    verdict = accept({**cand, **held_ppl[0]}, {**base, **held_ppl[1]}, a, criteria)
    if evaluated:
        evaluated_in = "quantize"
        sel_base, sel_cand = evaluated["baseline"], evaluated["candidate"]
    else:
        evaluated_in = "accept"
        with budget.part("selection"):
            sel_base, sel_cand = against_baseline(candidate, baseline, selection(), reference=ref)
    side.update(side_figures("selection", sel_cand, sel_base))
    seconds = {**budget.seconds, **{f"chat_{k}": v for k, v in chat.get("seconds", {}).items()}}
    return Judgement(verdict=verdict, candidate=cand, baseline=base, side=side, chat=chat, chat_note=chat_note,
                     selection={"candidate": sel_cand, "baseline": sel_base}, evaluated_in=evaluated_in,
                     heldout_source=held.heldout_source, reference=reference_name, seconds=seconds)
