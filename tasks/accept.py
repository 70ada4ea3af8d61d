"""Task: the verdict (compress/evaluate/verdict.py::judge: the test split, the held-out source, the downstream task,
the chat set and the selection split, through the gate), logged to MLflow and marked done. The teacher's chat
answers are cached in <workdir>/chat_targets/. When the quantize stage's accuracy-aware loop already measured this
candidate against this baseline on the selection split, its figures are used as they are (``evaluated_in``).
"""

from __future__ import annotations

from pathlib import Path

import mlflow
from prefect import task

from compress.corpus.splits import load_heldout
from compress.evaluate import chat as chat_eval
from compress.evaluate import chat_limit
from compress.evaluate.settings import AcceptConfig
from compress.evaluate.verdict import judge
from compress.loading.settings import ModelConfig
from tasks.common import StageRun, cache_key_fn, mark_done, open_stage
from tasks.load import load_splits
from tasks.results import Judged
from tasks.tracking import child_run, log_figure, log_json, log_metrics, log_params

def _same(a: str, b: str) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def reusable(evaluated: dict | None, baseline: str, splits: str) -> bool:
    """Whether an earlier stage's `evaluation` measured the candidate against `baseline` on `splits`' selection split.

    A quantized student was gated against the fp32 student, not the teacher: its agreement and
    perplexity ratio answer another question, so the accept stage measures it again.
    """
    return bool(evaluated) and _same(evaluated["reference"], baseline) and _same(evaluated["splits"], splits)


@task(name="accept", cache_key_fn=cache_key_fn, persist_result=True)
def accept_task(at: StageRun, *, accept: AcceptConfig, model: ModelConfig, trained: bool, seed: int,
                candidate: str, baseline: str, splits: str, heldout: str, evaluated: dict | None = None,
                model_dir: str | None = None) -> Judged:
    """trained: the candidate was pruned or distilled (compress.evaluate.gate.resolve_criteria); seed: data.seed (the
    downstream task's sample). heldout: the load stage's heldout.npz. evaluated: the quantize stage's `evaluation` of this candidate on
    the selection split, or None (quantize off, or no loop ran). model_dir: the source checkpoint's folder, the
    reference when accept.reference resolves to it."""
    folder, done = open_stage(at, Judged)
    if done is not None:
        return done
    with child_run(at.parent_run_id, at.stage) as run:
        log_params({"accept": accept.model_dump()})
        j = judge(accept, candidate, baseline, load_heldout(heldout), model=model, trained=trained, seed=seed,
                  selection=lambda: load_splits(splits).selection,
                  evaluated=evaluated if reusable(evaluated, baseline, splits) else None, model_dir=model_dir,
                  chat_cache=Path(at.workdir) / "chat_targets")
        verdict, chat = j.verdict, j.chat
        if run is not None:
            mlflow.set_tags({"evaluated_in": j.evaluated_in, "heldout_source": j.heldout_source,
                             "accept_criteria": verdict.criteria, "accept_reference": j.reference,
                             "verdict": "accepted" if verdict.accepted else "rejected",
                             **({"reasons": "; ".join(verdict.reasons)[:4000]} if verdict.reasons else {})})
        log_metrics(j.metrics)
        if chat and run is not None:
            limits = [chat_limit(accept, k, verdict.criteria) for k in ("max_chat_perplexity_ratio",
                                                                            "max_chat_judged_ratio")]
            log_figure(chat_eval.plot_by_kind(chat, *limits), "chat_by_kind.png")
        log_json(j.record(chat=chat, split="test"), "verdict.json")
    return mark_done(folder, Judged.from_json(j.record(
        metrics=j.metrics, gate=dict(verdict.metrics), chat_by_kind=chat.get("by_kind", {}),
        run_id=run.info.run_id if run is not None else None)))
