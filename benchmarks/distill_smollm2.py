"""Distil a 25%-MLP-pruned SmolLM2-135M from the unpruned one on this CPU: the figures of docs/distillation.md.

    .venv/bin/python -m benchmarks.distill_smollm2 --compare-ce       # KD with the defaults, and CE alone (40 steps)
    .venv/bin/python -m benchmarks.distill_smollm2 --steps 60 --eval-every 20   # the demo budget
    .venv/bin/python -m benchmarks.distill_smollm2 --steps 60 --eval-every 20 --data corpus mix generated \
        --calib-blocks 64 --figure ''     # what the student trains on, scored on held-out text
    .venv/bin/python -m benchmarks.distill_smollm2 --steps 60 --eval-every 20 --hidden-weight 0 1 \
        --calib-blocks 64 --figure ''     # logits alone vs logits + intermediate states (Minitron)
    .venv/bin/python -m benchmarks.distill_smollm2 --steps 60 --eval-every 20 --hidden-weight 0 3 \
        --mlp-ratio 0 --layer-ratio 0.1 --calib-blocks 64 --figure ''   # the same on a student 3 layers shallower

Student: compress.prune.prune_model, structured, 25% of the MLP neurons of every layer by
activation importance on the calib split (no distillation, no fine-tuning). Data: the embedded
corpus, blocks of 128 tokens, 256 train / 16 calib / 32 eval. Prints a table and writes
results JSON and the loss / temperature / eval figure. --compare-ce trains the same student with the
same budget on the labels alone (alpha = 0), to show what the teacher adds. --data and --hidden-weight
train one KD run per `distill.data` mode (compress/distill/data.py) and intermediate-state loss weight,
and score every student, before and after, on the test split and the held-out source (Python stdlib
code, another genre than the corpus), with the perplexity gap each run recovered per 10k training tokens.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from compress.config import DistillConfig, PruneConfig  # noqa: E402
from compress.corpus.splits import make_splits  # noqa: E402
from compress.distill.train import distill  # noqa: E402
from compress.distill.data import training_splits  # noqa: E402
from compress.loading.models import load_teacher  # noqa: E402
from compress.prune import prune_model  # noqa: E402
from compress.evaluate.torch_eval import perplexity  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--lr-schedule", default="constant")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--t-start", type=float, default=4.0)
    ap.add_argument("--t-end", type=float, default=1.0)
    ap.add_argument("--t-schedule", default="cosine")
    ap.add_argument("--alpha-start", type=float, default=1.0)
    ap.add_argument("--alpha-end", type=float, default=1.0)
    ap.add_argument("--alpha-schedule", default="linear")
    ap.add_argument("--monitor", default="kl", choices=["kl", "perplexity"])
    ap.add_argument("--teacher-topk", type=int, default=0)
    ap.add_argument("--mlp-ratio", type=float, default=0.25)
    ap.add_argument("--layer-ratio", type=float, default=0.0, help="prune.layer_ratio: whole layers dropped too")
    ap.add_argument("--max-minutes", type=float, default=60.0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--data", nargs="+", default=["corpus"], choices=["corpus", "generated", "mix"],
                    help="distill.data of the KD runs (one run each)")
    ap.add_argument("--hidden-weight", type=float, nargs="+", default=[0.0],
                    help="distill.hidden_weight of the KD runs (one run per value and --data mode)")
    ap.add_argument("--calib-blocks", type=int, default=16)
    ap.add_argument("--compare-ce", action="store_true", help="also train on CE alone with the same budget")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".cache" / "bench" / "distill_smollm2")
    ap.add_argument("--resume", action="store_true", help="keep the workdir's checkpoints (default: start afresh)")
    ap.add_argument("--figure", type=Path, default=ROOT / "docs" / "img" / "distill_smollm2.png")
    ap.add_argument("--json", type=Path, default=ROOT / ".cache" / "bench" / "distill_smollm2.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    teacher, tok = load_teacher(cache_dir=ROOT / ".cache" / "models")
    splits = make_splits(tok, "embedded", block_size=128, train_blocks=256, calib_blocks=args.calib_blocks, selection_blocks=32)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    student, prep = prune_model(teacher, splits.calib, PruneConfig(enabled=True, method="structured",
                                                                    mlp_ratio=args.mlp_ratio, layer_ratio=args.layer_ratio,
                                                                    importance="activation"))
    layer_map = prep.teacher_layers
    t_prune = time.perf_counter() - t0

    cfg = DistillConfig(
        enabled=True, steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps,
        lr_schedule=args.lr_schedule, batch_size=args.batch_size, grad_accum=args.grad_accum,
        eval_every=args.eval_every, checkpoint_every=args.eval_every, t_start=args.t_start, t_end=args.t_end,
        t_schedule=args.t_schedule, alpha_start=args.alpha_start, alpha_end=args.alpha_end,
        alpha_schedule=args.alpha_schedule,
        teacher_topk=args.teacher_topk, max_minutes=args.max_minutes, early_stop_patience=0, device="cpu",
        monitor=args.monitor,
    )
    runs = {run_name(d, w): cfg.model_copy(update={"data": d, "hidden_weight": w})
            for d in args.data for w in args.hidden_weight}
    if args.compare_ce:
        runs["ce"] = cfg.model_copy(update={"alpha_start": 0.0, "alpha_end": 0.0})
    results = {
        "torch_threads": torch.get_num_threads(), "load_seconds": round(t_load, 1), "prune_seconds": round(t_prune, 1),
        "params_teacher": prep.params_before, "params_student": prep.params_after, "kept_layers": layer_map,
        "intermediate_size": [prep.shape_before["intermediate_size"], prep.shape_after["intermediate_size"]],
        "train_tokens_per_step": args.batch_size * args.grad_accum * 128, "config": cfg.model_dump(), "runs": {},
    }
    for name, c in runs.items():
        work = args.workdir / name
        if not args.resume:
            shutil.rmtree(work, ignore_errors=True)
        data = training_splits(splits, teacher, tok, c, args.workdir / f"train_{c.data}.npz")
        trained = copy.deepcopy(student)
        t0 = time.perf_counter()
        rep = distill(trained, teacher, data, c, work, teacher_layers=layer_map)
        results["runs"][name] = {**rep.metrics(), "stop_reason": rep.stop_reason, "evals": rep.evals,
                                 "data": c.data, "train_blocks": len(data.train),
                                 "seconds_with_generation": round(time.perf_counter() - t0, 1),
                                 "heldout": held_out(trained, splits)}
        if name == "kd" and str(args.figure) not in ("", "."):
            args.figure.parent.mkdir(parents=True, exist_ok=True)
            rep.figure().savefig(args.figure, dpi=110)
            results["figure"] = str(args.figure)
    results["heldout_teacher"], results["heldout_before"] = held_out(teacher, splits), held_out(student, splits)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    print_heldout(results)
    args.json.write_text(json.dumps(results, indent=1))

    kd = next(iter(results["runs"].values()))
    print(f"\nteacher perplexity          {kd['distill_teacher_perplexity']:.3f}")
    print(f"pruned student, before      {kd['distill_perplexity_before']:.3f}   KL {kd['distill_kl_before']:.4f}   "
          f"top-1 {kd['distill_top1_before']:.3f}")
    for name, r in results["runs"].items():
        print(f"after {name:<4} (best step {r['distill_best_step']:>3}) {r['distill_perplexity_after']:.3f}   "
              f"KL {r['distill_kl_after']:.4f}   top-1 {r['distill_top1_after']:.3f}   "
              f"{r['distill_steps']} steps, {r['distill_seconds_per_step']:.2f} s/step, {r['distill_seconds']:.0f} s in all")
    print(f"params {prep.params_before:,} -> {prep.params_after:,}; load {t_load:.0f} s, prune {t_prune:.0f} s; "
          f"results in {args.json}")


def run_name(data: str, hidden_weight: float) -> str:
    """kd (corpus, logits only), kd_mix, kd_hidden1, kd_mix_hidden0.5, ..."""
    parts = ["kd"] + ([data] if data != "corpus" else []) + ([f"hidden{hidden_weight:g}"] if hidden_weight else [])
    return "_".join(parts)


def held_out(model, splits) -> dict[str, float]:
    """Perplexity on the test split (the corpus's genre, never trained on) and the held-out source (code)."""
    return {"test": perplexity(model, splits.test), "stdlib_code": perplexity(model, splits.heldout)}


def print_heldout(results: dict) -> None:
    t, b = results["heldout_teacher"], results["heldout_before"]
    print("\n| student | train blocks | test ppl (x teacher) | stdlib code ppl (x teacher) | test gap recovered per 10k "
          "tokens | code gap recovered per 10k tokens |")
    print(f"| teacher | | {t['test']:.2f} | {t['stdlib_code']:.2f} | |")
    print(f"| pruned, before | | {b['test']:.2f} ({b['test'] / t['test']:.3f}) | "
          f"{b['stdlib_code']:.2f} ({b['stdlib_code'] / t['stdlib_code']:.3f}) | |")
    for name, r in results["runs"].items():
        h = r["heldout"]
        tokens = r["distill_steps"] * results["train_tokens_per_step"]
        rec = {k: (b[k] - h[k]) / (b[k] - t[k]) / (tokens / 1e4) for k in ("test", "stdlib_code")}
        r["gap_closed_per_10k_tokens"] = rec
        print(f"| {name} ({r['data']}) | {r['train_blocks']} | {h['test']:.2f} ({h['test'] / t['test']:.3f}) | "
              f"{h['stdlib_code']:.2f} ({h['stdlib_code'] / t['stdlib_code']:.3f}) | {rec['test']:.3f} | "
              f"{rec['stdlib_code']:.3f} |")


if __name__ == "__main__":
    main()
