"""How much of a pruning cut KD gives back per token, on the chat set the gate judges: the recovery curve.

    .venv/bin/python -m benchmarks.kd_recovery --mlp-ratio 0.1 --tokens 1000000 --conversations 768

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

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from benchmarks.chat_check import SECOND_SET  # noqa: E402
from compress.config import DistillConfig, PruneConfig  # noqa: E402
from compress.sizing.cpu import cpu_flags  # noqa: E402
from compress.corpus.splits import make_splits  # noqa: E402
from compress.distill.data import training_splits  # noqa: E402
from compress.distill.train import distill  # noqa: E402
from compress.evaluate import chat as chat_eval  # noqa: E402
from compress.evaluate.torch_eval import perplexity  # noqa: E402
from compress.export.gqa import build_gqa_artifact  # noqa: E402
from compress.loading.models import load_teacher  # noqa: E402
from compress.prune import prune_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    raise SystemExit(main())
