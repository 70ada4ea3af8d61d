"""Evaluation in the form of use: held-out chat conversations rendered with the model's own chat template.

A chat model's users send conversations, and a gate that reads only documentation or code passes a student
that is much worse at answering them (a pruned + distilled SmolLM2 was 1.06x the teacher on documentation and
1.55x on English conversations). So, for an artifact with a chat template, the acceptance gate also scores:

* **answers the teacher would give**: each prompt (``compress/evaluate/chatsets/use.jsonl``, written for this and read by
  no training or calibration step, or a user's jsonl of conversations) is rendered with the template exactly as
  the server renders ``/v1/chat/completions`` (serve/api/chat_template.py, serve/engine/tokenizer.py), the teacher answers
  it greedily, and the candidate is scored on those answer tokens only: NLL (``chat_perplexity_ratio`` against
  the teacher's own NLL of them) and top-1 agreement with the teacher's argmax at the same positions. A
  conversation that ends with an assistant turn is scored on that turn instead (a reference answer);
* **its own answers, judged by the teacher**: the candidate answers each prompt greedily; the teacher's
  perplexity of those answers over its perplexity of its own (``chat_judged_ratio``), and the share of answers
  whose first token different from the teacher's comes at or after ``divergence_tokens``
  (``chat_late_divergence_share``; an identical answer counts as late).

The teacher's side (its greedy answers, its NLL and argmax on the targets) is data-free, offline and cached
per (teacher files, rendered prompts, max_new_tokens) in ``cache_dir``: a re-run or a second candidate reuses
it, and a changed teacher gets new answers.

How it runs (issue 41): every answer comes from the serving engine with all prompts in at once
(compress/evaluate/generate.py: the same tokens as the batch-1 greedy loop, by test), and every answer is scored in
padded batches (``score_answers``, only the answers' positions' logits kept). One model is in memory at a time.
``benchmarks/eval_speed.py`` runs this and the old one-prompt-at-a-time loop side by side.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from compress.artifact import read_manifest
from compress.drivers import LanguageModelDriver, load_lm
from compress.evaluate.checkpoint_ref import CheckpointReference
from compress.evaluate.generate import Generated, evaluation_engine, generate_on, greedy_answers, scoring_driver

# bump when the cached teacher targets change meaning (2: the teacher's NLL of its own answers from the logits it
# picked them from on the engine, and its argmax there the answer itself)
CHAT_FORMAT = 2
BUILTIN = "builtin"
BUILTIN_SET = Path(__file__).parent / "chatsets" / "use.jsonl"
# The pruning search scores its branches here, never on the gate's own prompts (search.chat_sets).
SELECTION = "selection"
NAMED_SETS = {BUILTIN: BUILTIN_SET, SELECTION: Path(__file__).parent / "chatsets" / "selection.jsonl"}


class ChatEvalError(ValueError):
    pass


# -- the conversations --------------------------------------------------------------------------------------------
def load_conversations(spec: str, field: str = "accept.chat_sets") -> list[dict]:
    """``builtin`` or a local .jsonl file, one conversation a line: {"messages": [{"role", "content"}, ...]} with an
    optional "kind" (a label for the per-kind table). The last message is a user turn (the teacher answers it) or
    an assistant turn (the reference answer scored as it is)."""
    path = NAMED_SETS.get(spec) or Path(spec)
    where = f"{field} entry {spec!r}"
    if not path.is_file():
        raise ChatEvalError(f"{where}: no such file; give a local .jsonl of {{\"messages\": [...]}} conversations, "
                            f"'{BUILTIN}', '{SELECTION}', or remove it")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            conv = json.loads(line)
        except json.JSONDecodeError as e:
            raise ChatEvalError(f"{where}: line {n} is not JSON ({e.msg}); each line is one {{\"messages\": [...]}}") from None
        msgs = conv.get("messages") if isinstance(conv, dict) else None
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
            raise ChatEvalError(f"{where}: line {n} needs \"messages\": a non-empty list of {{\"role\", \"content\"}} "
                                f"objects with string values")
        if msgs[-1]["role"] not in ("user", "assistant"):
            raise ChatEvalError(f"{where}: line {n} ends with a {msgs[-1]['role']!r} message; end it with the user "
                                f"turn to be answered, or with an assistant turn to score as the reference answer")
        out.append({"messages": msgs, "kind": str(conv.get("kind", "chat"))})
    if not out:
        raise ChatEvalError(f"{where}: the file holds no conversation")
    return out


def load_sets(specs: list[str], field: str = "accept.chat_sets") -> list[dict]:
    return [c for s in specs for c in load_conversations(s, field)]


def sets_digest(specs: list[str]) -> str:
    """A digest of the chat sets' contents, for the accept stage's cache key (an edited file is scored anew)."""
    h = hashlib.sha256()
    for s in specs:
        h.update(s.encode())
        p = NAMED_SETS.get(s) or Path(s)
        h.update(p.read_bytes() if p.is_file() else b"missing")
    return h.hexdigest()[:16]


@dataclass
class ChatPrompt:
    prompt_ids: list[int]
    reference_ids: list[int] | None  # the conversation's own last assistant turn, tokenized as the template writes it
    kind: str = "chat"


def has_chat_template(artifact_dir: str | Path) -> bool:
    return bool(read_manifest(artifact_dir, verify=False).get("chat_template"))


def render(artifact_dir: str | Path, conversations: list[dict]) -> list[ChatPrompt]:
    """Token ids of each conversation as the server builds them for /v1/chat/completions."""
    from jinja2 import TemplateError

    from serve.api.chat_template import render_template, template_specials
    from serve.engine.tokenizer import encode_chat, load_tokenizer

    manifest = read_manifest(artifact_dir, verify=False)
    source = manifest.get("chat_template")
    if not source:
        raise ChatEvalError(f"{artifact_dir}: the artifact has no chat template; set accept.chat_sets: [] for a "
                            f"model that is not used through chat")
    tok = load_tokenizer(artifact_dir)
    specials = template_specials(tok, manifest)
    out = []
    for conv in conversations:
        msgs = conv["messages"]
        ref = msgs[-1]["role"] == "assistant"
        try:
            prompt = encode_chat(tok, manifest, render_template(source, msgs[:-1] if ref else msgs, True, **specials))
            full = encode_chat(tok, manifest, render_template(source, msgs, False, **specials)) if ref else None
        except TemplateError as e:
            raise ChatEvalError(f"the chat template rejected a conversation ({e}): {msgs!r}") from None
        if full is not None and full[:len(prompt)] != prompt:
            raise ChatEvalError("the chat template renders the reference answer's conversation with another prefix "
                                f"than its prompt, so the answer tokens cannot be told apart: {msgs!r}")
        out.append(ChatPrompt(prompt, full[len(prompt):] if full is not None else None, conv["kind"]))
    return out


# -- scoring -----------------------------------------------------------------------------------------------------
def score_answer(lm: LanguageModelDriver, prompt: list[int], answer: list[int]) -> tuple[float, np.ndarray]:
    """Sum of the NLL of ``answer``'s tokens after ``prompt``, and the argmax at the positions that predict them."""
    if not answer:
        return 0.0, np.zeros(0, np.int64)
    logits, _ = lm.prefill(prompt + answer)
    return _nll_argmax(logits[len(prompt) - 1:len(prompt) - 1 + len(answer)], answer)


def _nll_argmax(lg: np.ndarray, answer: Sequence[int]) -> tuple[float, np.ndarray]:
    lg = np.asarray(lg, np.float64)
    m = lg.max(-1, keepdims=True)
    lse = np.log(np.exp(lg - m).sum(-1)) + m[:, 0]
    return float((lse - lg[np.arange(len(answer)), list(answer)]).sum()), lg.argmax(-1)


def score_answers(lm: LanguageModelDriver, prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]],
                  check: Callable[[str], None] | None = None, doing: str = "scoring") -> list[tuple[float, np.ndarray]]:
    """score_answer of every (prompt, answer) pair, computed in padded batches (the driver's continuation_logits:
    logits bounded per batch, only the answers' positions for the gqa layout). ``check(doing)`` runs after each
    answer (a budget's)."""
    out: list[tuple[float, np.ndarray]] = [(0.0, np.zeros(0, np.int64))] * len(prompts)
    for n, (i, lg) in enumerate(lm.continuation_logits(prompts, answers), 1):
        out[i] = _nll_argmax(lg, answers[i])
        if check is not None:
            check(f"{doing}: {n} of {sum(1 for a in answers if len(a))} answers")
    return out


def first_divergence(a: list[int], b: list[int]) -> float:
    """Index of the first token where two answers differ (inf when they are the same)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return float(i)
    return math.inf if len(a) == len(b) else float(min(len(a), len(b)))


@dataclass
class TeacherTargets:
    """The teacher's side of the chat evaluation, cached per teacher."""

    answers: list[list[int]]  # the teacher's greedy answers (EOS included when it stopped)
    answer_nll: list[float]  # its NLL of its own answers (the judge's baseline)
    targets: list[list[int]]  # what the candidate is scored on: the reference answer, else the teacher's answer
    target_nll: list[float]
    target_argmax: list[list[int]]
    kinds: list[str] = field(default_factory=list)
    cached: bool = False
    seconds: dict[str, float] = field(default_factory=dict)  # what generating and scoring took (empty when cached)


def targets_key(teacher_dir: str | Path, prompts: list[ChatPrompt], max_new_tokens: int,
                reference: CheckpointReference | None = None) -> str:
    files = read_manifest(teacher_dir, verify=False).get("files", {})
    teacher = {k: v.get("sha256") for k, v in sorted(files.items())} if reference is None else reference.key
    blob = json.dumps({"format": CHAT_FORMAT, "teacher": teacher,
                       "prompts": [[p.prompt_ids, p.reference_ids] for p in prompts], "max_new_tokens": max_new_tokens},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _cache_path(teacher_dir, prompts: list[ChatPrompt], max_new_tokens: int, cache_dir,
                reference: CheckpointReference | None = None) -> Path | None:
    return Path(cache_dir) / f"{targets_key(teacher_dir, prompts, max_new_tokens, reference)}.json" if cache_dir else None


def cached_targets(teacher_dir: str | Path, prompts: list[ChatPrompt], max_new_tokens: int,
                   cache_dir: str | Path | None, reference: CheckpointReference | None = None) -> TeacherTargets | None:
    """The teacher's side from ``cache_dir``, or None when it has not been computed for this teacher and these
    prompts."""
    path = _cache_path(teacher_dir, prompts, max_new_tokens, cache_dir, reference)
    if path is None or not path.is_file():
        return None
    return TeacherTargets(**{**json.loads(path.read_text()), "cached": True})


def teacher_targets(teacher_dir: str | Path, prompts: list[ChatPrompt], max_new_tokens: int,
                    cache_dir: str | Path | None = None, *, threads: int | None = None,
                    progress: bool = True, check: Callable[[str], None] | None = None,
                    reference: CheckpointReference | None = None) -> TeacherTargets:
    """The teacher's greedy answers (all prompts batched on the serving engine, their NLL from the logits they were
    picked from) and its NLL/argmax on the reference answers (scored in padded batches), from ``cache_dir`` when
    it has them."""
    return cached_targets(teacher_dir, prompts, max_new_tokens, cache_dir, reference) or _teacher_phase(
        teacher_dir, prompts, max_new_tokens, None, cache_dir=cache_dir, threads=threads, progress=progress,
        check=check, reference=reference)[0]


@contextmanager
def _teacher(teacher_dir, prompts: list[ChatPrompt], max_new_tokens: int, threads,
             reference: CheckpointReference | None) -> Iterator[tuple[Callable[..., Generated], object]]:
    """The teacher loaded once: ``(generate(ids, max_new_tokens, **kw), scorer)``, the scorer a driver with
    ``continuation_logits`` on the same weights. The artifact's graph on the serving engine, or the checkpoint
    (compress/evaluate/checkpoint_ref.py)."""
    if reference is None:
        with evaluation_engine(teacher_dir, [p.prompt_ids for p in prompts], max_new_tokens, threads) as engine:
            yield partial(generate_on, engine), scoring_driver(engine)
    else:
        with reference.loaded(read_manifest(teacher_dir, verify=False).get("eos_token_ids") or []) as lm:
            yield lm.generate, lm


def _targets_on(generate, scorer, prompts: list[ChatPrompt], max_new_tokens: int, progress: bool,
                check) -> TeacherTargets:
    ids = [p.prompt_ids for p in prompts]
    t0 = time.perf_counter()
    # its NLL of its own answers from the logits it picked them from, and its argmax there is the answer itself
    gen = generate(ids, max_new_tokens, progress=progress, desc="teacher chat answers", check=check, logprobs=True)
    seconds = {"teacher_answers": gen.seconds}
    refs = [p.reference_ids for p in prompts]
    with_ref = [i for i, r in enumerate(refs) if r is not None]
    by_ref = {}
    if with_ref:
        t1 = time.perf_counter()
        by_ref = dict(zip(with_ref, score_answers(scorer, [ids[i] for i in with_ref],
                                                  [refs[i] for i in with_ref], check,
                                                  "the teacher scoring the reference answers")))
        seconds["teacher_scoring"] = time.perf_counter() - t1
    t = TeacherTargets([], [], [], [], [], [p.kind for p in prompts])
    for i, ans in enumerate(gen.answers):
        t.answers.append(ans)
        t.answer_nll.append(gen.nll[i])
        target, tnll, am = (refs[i], *by_ref[i]) if i in by_ref else (ans, gen.nll[i], ans)
        t.targets.append(list(target))
        t.target_nll.append(tnll)
        t.target_argmax.append([int(x) for x in am])
    t.seconds = {**seconds, "teacher": time.perf_counter() - t0}
    return t


def _teacher_phase(teacher_dir, prompts: list[ChatPrompt], max_new_tokens: int, judged_answers: list | None, *,
                   cache_dir, threads, progress, check, targets: TeacherTargets | None = None,
                   reference: CheckpointReference | None = None) -> tuple[TeacherTargets, list | None, float]:
    """Everything the teacher does, on one load of it (an engine whose session also scores, or the checkpoint):
    its answers unless ``targets`` has them (then cached in ``cache_dir``), and its NLL of ``judged_answers`` (the
    candidate's). Returns the targets, the judged (nll, argmax) per answer or None, and the judging's seconds."""
    with _teacher(teacher_dir, prompts, max_new_tokens, threads, reference) as (generate, scorer):
        if targets is None:
            targets = _targets_on(generate, scorer, prompts, max_new_tokens, progress, check)
            path = _cache_path(teacher_dir, prompts, max_new_tokens, cache_dir, reference)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps({k: v for k, v in asdict(targets).items() if k not in ("cached", "seconds")}))
                tmp.replace(path)
        judged, t0 = None, time.perf_counter()
        if judged_answers is not None:
            judged = score_answers(scorer, [p.prompt_ids for p in prompts], judged_answers, check,
                                   "the teacher judging the candidate's answers")
        return targets, judged, time.perf_counter() - t0


def _ppl(nll: float, n: int) -> float:
    return math.exp(nll / max(n, 1))


def evaluate_chat(candidate_dir: str | Path, teacher_dir: str | Path, prompts: list[ChatPrompt],
                  targets: TeacherTargets | None = None, divergence_tokens: int = 16, max_new_tokens: int = 48,
                  *, judge: bool = True, threads: int | None = None, progress: bool = True,
                  check: Callable[[str], None] | None = None, cache_dir: str | Path | None = None,
                  reference: CheckpointReference | None = None) -> dict:
    """The chat figures of a candidate against the teacher (module docstring); ``by_kind`` holds the same per kind,
    ``seconds`` what each part took, ``teacher_cached`` whether the teacher's side came from the cache.

    One model in memory at a time, the teacher loaded once: the candidate's answers first (on the engine), then
    the teacher's answers (unless ``targets`` or ``cache_dir`` has them) and its judgement of the candidate's on
    one engine, then the candidate scoring the teacher's answers. ``reference``: the teacher is the checkpoint
    in torch (compress/evaluate/checkpoint_ref.py), not ``teacher_dir``'s graph, which then only renders."""
    ids = [p.prompt_ids for p in prompts]
    t0 = time.perf_counter()
    seconds: dict[str, float] = {}
    targets = targets or cached_targets(teacher_dir, prompts, max_new_tokens, cache_dir, reference)
    gen = None
    if judge:
        gen = greedy_answers(candidate_dir, ids, max_new_tokens, threads=threads, progress=progress,
                             desc="candidate chat answers", check=check)
        seconds["candidate_answers"] = gen.seconds
    judged = None
    if targets is None or judge:
        targets, judged, seconds["judging"] = _teacher_phase(
            teacher_dir, prompts, max_new_tokens, gen.answers if judge else None, cache_dir=cache_dir,
            threads=threads, progress=progress, check=check, targets=targets, reference=reference)
    t1 = time.perf_counter()
    cand = load_lm(candidate_dir, threads, verify=False)
    scored = score_answers(cand, ids, targets.targets, check, "the candidate scoring the targets")
    del cand
    seconds["candidate_scoring"] = time.perf_counter() - t1
    rows = []
    for i, p in enumerate(prompts):
        nll, am = scored[i]
        rows.append({"kind": p.kind, "tokens": len(targets.targets[i]), "nll": nll,
                     "teacher_nll": targets.target_nll[i],
                     "agree": int((am == np.asarray(targets.target_argmax[i], np.int64)).sum())})
        if judge:
            ans = gen.answers[i]
            rows[-1].update({"answer_tokens": len(ans), "judged_nll": judged[i][0],
                             "own_tokens": len(targets.answers[i]), "own_nll": targets.answer_nll[i],
                             # an answer that never departs from the teacher's counts as departing at the end
                             "divergence": min(first_divergence(ans, targets.answers[i]), float(max_new_tokens))})
    out = _figures(rows, divergence_tokens, judge)
    out["by_kind"] = {k: _figures([r for r in rows if r["kind"] == k], divergence_tokens, judge)
                      for k in sorted({r["kind"] for r in rows})}
    out["seconds"] = {**targets.seconds, **seconds, "total": time.perf_counter() - t0}
    out["teacher_cached"] = targets.cached
    return out


def _figures(rows: list[dict], divergence_tokens: int, judge: bool) -> dict:
    n = sum(r["tokens"] for r in rows)
    cand, base = _ppl(sum(r["nll"] for r in rows), n), _ppl(sum(r["teacher_nll"] for r in rows), n)
    out = {"chat_items": float(len(rows)), "chat_tokens": float(n), "chat_perplexity": cand,
           "chat_baseline_perplexity": base, "chat_perplexity_ratio": cand / base,
           "chat_top1_agreement": sum(r["agree"] for r in rows) / max(n, 1)}
    if judge:
        judged = _ppl(sum(r["judged_nll"] for r in rows), sum(r["answer_tokens"] for r in rows))
        own = _ppl(sum(r["own_nll"] for r in rows), sum(r["own_tokens"] for r in rows))
        div = [r["divergence"] for r in rows]
        out.update({"chat_judged_perplexity": judged, "chat_judged_baseline_perplexity": own,
                    "chat_judged_ratio": judged / own,
                    "chat_late_divergence_share": sum(d >= divergence_tokens for d in div) / max(len(div), 1),
                    "chat_median_divergence": float(np.median(div)) if div else math.nan})
    return out


def plot_by_kind(chat: dict, limit: float | None, judged_limit: float | None = None,
                 title: str = "chat set, by kind of prompt"):
    """Bars of the chat perplexity ratio and the teacher-judged ratio per kind of prompt, with the gate's limits."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    kinds = list(chat["by_kind"]) + ["all"]
    rows = [chat["by_kind"][k] for k in kinds[:-1]] + [chat]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    x = np.arange(len(kinds))
    shown = [r["chat_perplexity_ratio"] for r in rows]
    ax.bar(x - 0.2, shown, 0.4, color="tab:blue", label="perplexity ratio (teacher's answers)")
    if limit is not None:
        ax.axhline(limit, color="tab:blue", linestyle="--", linewidth=1, label=f"its limit {limit:g}")
    if "chat_judged_ratio" in chat:
        judged = [r["chat_judged_ratio"] for r in rows]
        shown += judged
        ax.bar(x + 0.2, judged, 0.4, color="tab:orange", label="teacher-judged ratio (own answers)")
        if judged_limit is not None:
            ax.axhline(judged_limit, color="tab:orange", linestyle="--", linewidth=1, label=f"its limit {judged_limit:g}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, kinds, rotation=20)
    ax.set_ylabel("candidate / teacher")
    ax.set_ylim(min(0.95, *shown) - 0.02, None)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
