"""Chat-set figures of artifacts against their teacher, on the gate's set and on a second set no stage reads.

    python -m benchmarks.chat_check --teacher artifacts/export/<key>/artifact \
        --candidate int8=artifacts/quantize/<key>/artifact --candidate chain=... [--json out.json]

A candidate may also be a Hugging Face model folder (a pruned or distilled student before export, e.g.
artifacts/prune/<key>/model or artifacts/distill/<key>/model): it is built into a gqa artifact first, so the
pruning damage and what distillation recovered are measured on the same chat sets.

The gate's set is compress/evaluate/chatsets/use.jsonl (single-turn prompts). The second set,
benchmarks/data/chat_second.jsonl, is another style (system personas, multi-turn conversations, opinions, creative
and how-to requests), written apart from the first and read by no stage of the pipeline, no config and no test
threshold: it checks that a verdict on the first set holds on chat it was not tuned on (issue 26: within 0.03 of
the perplexity ratio).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import run_modes  # noqa: E402
from compress.config import DistillConfig, PruneConfig  # noqa: E402
from compress.corpus.splits import make_splits  # noqa: E402
from compress.distill.data import training_splits  # noqa: E402
from compress.distill.train import distill  # noqa: E402
from compress.drivers import load_lm  # noqa: E402
from compress.evaluate import chat as chat_eval  # noqa: E402
from compress.evaluate.torch_eval import perplexity  # noqa: E402
from compress.export.gqa import build_gqa_artifact  # noqa: E402
from compress.loading.models import load_teacher  # noqa: E402
from compress.prune import prune_model  # noqa: E402
from compress.sizing.cpu import cpu_flags  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODES_HELP = ("modes (each with its own --help): --speed: the chat set's batched evaluation against the one-prompt loop "
              "it replaced (formerly benchmarks/eval_speed.py); --kd-recovery: what KD gives back of a pruning cut per "
              "token, on the chat set (formerly benchmarks/kd_recovery.py)")
SECOND_SET = Path(__file__).parent / "data" / "chat_second.jsonl"
SHOWN = ("chat_perplexity_ratio", "chat_top1_agreement", "chat_judged_ratio", "chat_late_divergence_share",
         "chat_median_divergence", "chat_tokens")


def as_artifact(item: str) -> str:
    """NAME=FOLDER with FOLDER an artifact (manifest.json) as it is, or an HF model folder built into one."""
    name, _, path = item.partition("=")
    if (Path(path) / "manifest.json").is_file():
        return item
    model, tok = load_teacher(path)[:2]
    out = Path(tempfile.mkdtemp(prefix=f"chat_{name}_")) / "artifact"
    build_gqa_artifact(model, tok, out)
    return f"{name}={out}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(epilog=MODES_HELP, description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--candidate", action="append", required=True, help="NAME=ARTIFACT_DIR (repeatable)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--divergence-tokens", type=int, default=16)
    ap.add_argument("--cache", default=None, help="teacher-answer cache folder (default: a temporary one)")
    ap.add_argument("--sets", nargs="+", choices=("gate", "second"), default=["gate", "second"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cache = a.cache or tempfile.mkdtemp(prefix="chat_targets_")
    a.candidate = [as_artifact(c) for c in a.candidate]
    sets = {name: spec for key, name, spec in (("gate", "use (gate)", "builtin"),
                                               ("second", "second (never tuned on)", str(SECOND_SET)))
            if key in a.sets}
    out: dict = {}
    for set_name, spec in sets.items():
        prompts = chat_eval.render(a.teacher, chat_eval.load_sets([spec]))
        t0 = time.perf_counter()
        targets = chat_eval.teacher_targets(a.teacher, prompts, a.max_new_tokens, cache)
        out[set_name] = {"teacher_seconds": time.perf_counter() - t0}
        for item in a.candidate:
            name, _, path = item.partition("=")
            t0 = time.perf_counter()
            r = chat_eval.evaluate_chat(path, a.teacher, prompts, targets, a.divergence_tokens, a.max_new_tokens)
            r["seconds"] = time.perf_counter() - t0
            out[set_name][name] = r
    print(f"\n| set | candidate | {' | '.join(SHOWN)} | seconds |\n|---|---|{'---:|' * (len(SHOWN) + 1)}")
    for set_name, res in out.items():
        for name, r in res.items():
            if isinstance(r, dict):
                print(f"| {set_name} | {name} | " + " | ".join(f"{r[k]:.4g}" for k in SHOWN) + f" | {r['seconds']:.0f} |")
    if len(sets) == 2:
        for name in (c.partition("=")[0] for c in a.candidate):
            a_, b_ = (out[s][name]["chat_perplexity_ratio"] for s in sets)
            print(f"{name}: second-set ratio - gate-set ratio = {b_ - a_:+.4f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


# --- `--speed`: formerly benchmarks/eval_speed.py -----------------------------------

EVAL_SPEED_DOC = """The chat set's evaluation batched on the serving engine against the one-prompt-at-a-time loop it replaced.

    python -m benchmarks.chat_check --speed --teacher artifacts/export/<key>/artifact \\
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


def eval_speed_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chat_check --speed", description=EVAL_SPEED_DOC.split("\n\n")[0])
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


# --- `--kd-recovery`: formerly benchmarks/kd_recovery.py ----------------------------

KD_RECOVERY_DOC = """How much of a pruning cut KD gives back per token, on the chat set the gate judges: the recovery curve.

    .venv/bin/python -m benchmarks.chat_check --kd-recovery --mlp-ratio 0.1 --tokens 1000000 --conversations 768

SmolLM2-135M-Instruct, ``--mlp-ratio`` of every MLP's neurons pruned by activation importance and re-fitted on 64 calib
blocks (the prune stage's defaults), then distilled (compress/distill/train.py::distill, today's fast loop) on a token
budget, on the teacher's own conversations in its chat template mixed with the corpus (``distill.data: chat_mix``;
no gate prompt is read). At each ``--points`` token count the student is saved; afterwards each saved student is
built into an fp32 gqa artifact and scored as the gate scores a chat model: the perplexity ratio of the teacher's
answers to the gate's chat prompts, the teacher-judged ratio of the student's own answers, and the held-out corpus
genres (documentation test split, stdlib code) in torch. The second chat set (benchmarks/data/chat_second.jsonl,
never tuned on) is scored at the last point. Writes benchmarks/results/kd_recovery_<ratio>.json and the curve,
docs/img/kd_recovery.png.
"""

LIMITS = {"chat_perplexity_ratio": 1.10, "chat_judged_ratio": 1.25, "test_ratio": 1.10, "code_ratio": 1.25}


def corpus_ratios(model, teacher_ppl: dict, splits) -> dict:
    return {"test_ratio": perplexity(model, splits.test) / teacher_ppl["test"],
            "code_ratio": perplexity(model, splits.heldout) / teacher_ppl["code"]}


def chat_figures(artifact: Path, teacher_art: Path, sets: dict, cache: Path) -> dict:
    out = {}
    for name, (prompts, targets) in sets.items():
        r = chat_eval.evaluate_chat(str(artifact), str(teacher_art), prompts, targets, progress=False)
        out[name] = {k: r[k] for k in ("chat_perplexity_ratio", "chat_top1_agreement", "chat_judged_ratio",
                                        "chat_late_divergence_share")}
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    toks = [r["tokens"] for r in rows]
    for key, label, style in (("chat_perplexity_ratio", "chat: teacher's answers", "o-"),
                              ("chat_judged_ratio", "chat: own answers, teacher-judged", "s-"),
                              ("test_ratio", "documentation (test split)", "^--"),
                              ("code_ratio", "stdlib code (held out)", "v--")):
        ax.plot(toks, [r[key] for r in rows], style, label=f"{label} (limit {LIMITS[key]})")
    for lim in sorted(set(LIMITS.values())):
        ax.axhline(lim, color="grey", lw=0.6, ls=":")
    ax.set_xscale("symlog", linthresh=50_000)
    ax.set_xlabel("KD tokens")
    ax.set_ylabel("× the teacher")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def kd_recovery_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chat_check --kd-recovery", description=KD_RECOVERY_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mlp-ratio", type=float, default=0.1)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--points", type=int, nargs="+", default=[0, 62_500, 125_000, 250_000, 500_000, 1_000_000])
    ap.add_argument("--conversations", type=int, default=768, help="distill.generated_blocks")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--max-minutes", type=float, default=180)
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench" / "kd_recovery")
    ap.add_argument("--teacher-artifact", type=Path, help="the teacher's fp32 gqa artifact (built when not given)")
    ap.add_argument("--figure", type=Path, default=ROOT / "docs" / "img" / "kd_recovery.png")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    a.json = a.json or ROOT / "benchmarks" / "results" / f"kd_recovery_{a.mlp_ratio:g}.json"
    a.work.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()

    teacher, tok = load_teacher(cache_dir=ROOT / ".cache" / "models")
    splits = make_splits(tok, "embedded", block_size=128, train_blocks=256, calib_blocks=64, selection_blocks=32)
    student, prep = prune_model(teacher, splits.calib, PruneConfig(enabled=True, method="structured",
                                                                    mlp_ratio=a.mlp_ratio, importance="activation"))
    positions = splits.train.shape[1] - 1
    step_tokens = a.batch_size * positions
    cfg = DistillConfig(enabled=True, tokens=a.tokens, batch_size=a.batch_size, lr=a.lr, lr_schedule="cosine",
                        warmup_steps=20, eval_every=max(1, round(min(p for p in a.points if p) / step_tokens)),
                        checkpoint_every=50, early_stop_patience=0, max_minutes=a.max_minutes, device="cpu",
                        data="chat_mix", generated_blocks=a.conversations)
    t0 = time.perf_counter()
    data = training_splits(splits, teacher, tok, cfg, a.work / f"train_chat_mix_{a.conversations}.npz")
    t_data = time.perf_counter() - t0

    points_dir = a.work / f"points_{a.mlp_ratio:g}"
    shutil.rmtree(points_dir, ignore_errors=True)
    saved: dict[int, Path] = {}
    marks = sorted(a.points)

    def on_log(step: int, metrics: dict) -> None:
        if "eval_kl" not in metrics:
            return
        tokens = step * step_tokens
        due = [p for p in marks if p <= tokens and p not in [k for k in saved]]
        if due:
            folder = points_dir / str(tokens)
            student.save_pretrained(folder)
            tok.save_pretrained(folder)
            for p in due:
                saved[p] = folder
            log.info("kd_recovery: saved the student at %d tokens (step %d)", tokens, step)

    work = a.work / f"distill_{a.mlp_ratio:g}"
    shutil.rmtree(work, ignore_errors=True)
    rep = distill(student, teacher, data, cfg, work, on_log=on_log)
    print(f"distill: {rep.steps} steps in {rep.seconds:.0f} s; planned {rep.plan.get('estimate_seconds')} s; "
          f"{rep.steps * step_tokens / rep.train_seconds:.0f} tokens/s in the steps", flush=True)

    teacher_art = a.teacher_artifact
    if teacher_art is None:
        teacher_art = a.work / "teacher_artifact"
        if not (teacher_art / "manifest.json").is_file():
            build_gqa_artifact(teacher, tok, teacher_art)
    cache = a.work / "chat_targets"
    sets = {}
    for name, spec in (("gate", "builtin"), ("second", str(SECOND_SET))):
        prompts = chat_eval.render(str(teacher_art), chat_eval.load_sets([spec]))
        sets[name] = (prompts, chat_eval.teacher_targets(str(teacher_art), prompts, 48, str(cache)))
    teacher_ppl = {"test": perplexity(teacher, splits.test), "code": perplexity(teacher, splits.heldout)}
    rows = []
    for tokens in marks:
        folder = saved.get(tokens)
        if folder is None:
            continue
        t0 = time.perf_counter()
        model = load_teacher(str(folder))[0]
        art = a.work / "artifacts" / folder.name
        if not (art / "manifest.json").is_file():
            build_gqa_artifact(model, tok, art)
        use = {"gate": sets["gate"]} if tokens != marks[-1] else sets
        chat = chat_figures(art, teacher_art, use, cache)
        row = {"tokens": tokens, "saved_at_tokens": int(folder.name), **corpus_ratios(model, teacher_ppl, splits),
               **chat["gate"], "second": chat.get("second"), "seconds": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(f"{tokens:>9,} tokens: chat {row['chat_perplexity_ratio']:.3f} judged {row['chat_judged_ratio']:.3f} "
              f"test {row['test_ratio']:.3f} code {row['code_ratio']:.3f}", flush=True)
    res = {"cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx"))),
           "threads": torch.get_num_threads(), "mlp_ratio": a.mlp_ratio, "params": [prep.params_before, prep.params_after],
           "config": cfg.model_dump(mode="json"), "train_blocks": len(data.train), "data_seconds": round(t_data, 1),
           "distill": {**rep.metrics(), "plan": rep.plan, "evals": rep.evals}, "limits": LIMITS, "rows": rows,
           "seconds": round(time.perf_counter() - t_all, 1)}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(res, indent=1))
    if str(a.figure) not in ("", "."):
        plot(rows, a.figure, f"SmolLM2-135M, {a.mlp_ratio:.0%} of the MLP pruned, KD on chat_mix "
                             f"(batch {a.batch_size} x 128)")
    print(f"results in {a.json}")
    return 0


log = logging.getLogger("kd_recovery")


if __name__ == "__main__":
    raise SystemExit(run_modes(main, {"--speed": eval_speed_main, "--kd-recovery": kd_recovery_main}))
