"""The chat set's evaluation batched on the serving engine against the one-prompt-at-a-time loop it replaced.

    python -m benchmarks.eval_speed --teacher artifacts/export/<key>/artifact \
        --candidate artifacts/quantize/<key>/artifact [--prompts 48] [--json out.json]

Both paths in one process, one after the other, on the same prompts (the gate's builtin chat set):

* ``one_at_a_time``: what compress/evaluate/chat.py did before issue 41: per prompt, the driver's batch-1 greedy loop
  (``LanguageModelDriver.greedy``) and one prefill per scored answer (``score_answer``);
* ``batched``: what it does now: ``evaluate_chat`` with no teacher answers cached (the accept stage's first run):
  answers from the serving engine with every prompt in, the teacher loaded once for its answers and its judging,
  scoring in padded batches.

Printed: seconds of each and their ratio, whether the teacher's and the candidate's answers are the same token for
token, and the largest difference between the two paths' chat figures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from compress.drivers import load_lm
from compress.evaluate import chat as chat_eval

FIGURES = ("chat_perplexity_ratio", "chat_top1_agreement", "chat_judged_ratio", "chat_late_divergence_share")


def one_at_a_time(teacher: str, candidate: str, prompts, new_tokens: int) -> tuple[dict, list, list, float]:
    """The chat figures by the batch-1 loop, the teacher's and the candidate's answers, and the seconds."""
    t0 = time.perf_counter()
    lm = load_lm(teacher, verify=False)
    eos = [int(e) for e in lm.manifest.get("eos_token_ids") or []]
    t = chat_eval.TeacherTargets([], [], [], [], [], [p.kind for p in prompts])
    for p in prompts:
        ans = lm.greedy(p.prompt_ids, new_tokens, eos_ids=eos)
        nll, am = chat_eval.score_answer(lm, p.prompt_ids, ans)
        t.answers.append(ans)
        t.answer_nll.append(nll)
        t.targets.append(ans)
        t.target_nll.append(nll)
        t.target_argmax.append([int(x) for x in am])
    cand = load_lm(candidate, verify=False)
    rows, answers = [], []
    for i, p in enumerate(prompts):
        nll, am = chat_eval.score_answer(cand, p.prompt_ids, t.targets[i])
        ans = cand.greedy(p.prompt_ids, new_tokens, eos_ids=eos)
        jn, _ = chat_eval.score_answer(lm, p.prompt_ids, ans)
        answers.append(ans)
        rows.append({"kind": p.kind, "tokens": len(t.targets[i]), "nll": nll, "teacher_nll": t.target_nll[i],
                     "agree": int((am == np.asarray(t.target_argmax[i])).sum()), "answer_tokens": len(ans),
                     "judged_nll": jn, "own_tokens": len(t.answers[i]), "own_nll": t.answer_nll[i],
                     "divergence": min(chat_eval.first_divergence(ans, t.answers[i]), float(new_tokens))})
    return chat_eval._figures(rows, 16, True), t.answers, answers, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--candidate", required=True)
    ap.add_argument("--prompts", type=int, default=48, help="the first N prompts of the builtin set")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    prompts = chat_eval.render(a.teacher, chat_eval.load_sets(["builtin"]))[:a.prompts]

    with tempfile.TemporaryDirectory() as cache:  # the accept stage's call: no teacher answers cached yet
        t0 = time.perf_counter()
        new = chat_eval.evaluate_chat(a.candidate, a.teacher, prompts, None, 16, a.new_tokens, progress=False,
                                      cache_dir=cache)
        batched_s = time.perf_counter() - t0
        targets = chat_eval.cached_targets(a.teacher, prompts, a.new_tokens, cache)
    # the candidate's answers, for the token-for-token comparison (outside the timed part)
    from compress.evaluate.generate import greedy_answers

    cand_new = greedy_answers(a.candidate, [p.prompt_ids for p in prompts], a.new_tokens, progress=False).answers
    old, teacher_old, cand_old, old_s = one_at_a_time(a.teacher, a.candidate, prompts, a.new_tokens)

    same_teacher = sum(x == y for x, y in zip(targets.answers, teacher_old))
    same_cand = sum(x == y for x, y in zip(cand_new, cand_old))
    diff = {k: abs(new[k] - old[k]) for k in FIGURES}
    out = {"prompts": len(prompts), "new_tokens": a.new_tokens, "one_at_a_time_s": old_s, "batched_s": batched_s,
           "speedup": old_s / batched_s, "teacher_answers_same": same_teacher, "candidate_answers_same": same_cand,
           "figures_one_at_a_time": {k: old[k] for k in FIGURES}, "figures_batched": {k: new[k] for k in FIGURES},
           "largest_figure_difference": max(diff.values()), "batched_seconds": new["seconds"]}
    print(f"{len(prompts)} prompts x {a.new_tokens} tokens: one at a time {old_s:.1f} s, batched {batched_s:.1f} s "
          f"({out['speedup']:.2f}x)")
    print(f"same answers token for token: teacher {same_teacher}/{len(prompts)}, candidate {same_cand}/{len(prompts)}")
    for k in FIGURES:
        print(f"  {k:28s} one at a time {old[k]:.6f}  batched {new[k]:.6f}")
    print("batched parts (s): " + ", ".join(f"{k} {v:.1f}" for k, v in new["seconds"].items()))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0 if same_teacher == same_cand == len(prompts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
