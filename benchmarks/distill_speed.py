"""KD tokens/s on this machine: the loop as it was (fp32, full logits, the CPU flash-attention kernel, per-tensor
AdamW) against today's, lever by lever, in one run, on the same student, batch and sequence length.

    .venv/bin/python -m benchmarks.distill_speed                      # SmolLM2-135M, 25 % of the MLP pruned, 4 x 128
    .venv/bin/python -m benchmarks.distill_speed --batch-size 16 --steps 3
    .venv/bin/python -m benchmarks.distill_speed --only none --plan-tokens 100000 --batch-size 16   # the planner

Every variant trains a fresh copy of the same pruned student from the same weights for ``--warmup`` + ``--steps``
optimizer steps of the real training step (compress/distill/train.py::train_step); the timed steps are the last
``--steps``. Printed as tokens/s and as a ratio to the first row; written to
benchmarks/results/distill_speed_b<batch>x<block>.json with the CPU's flags, torch's version and threads.
``--plan-tokens N`` then runs the stage itself (compress/distill/train.py::distill, today's defaults) on a budget of
N tokens and sets the planner's estimate, made before step 1, beside the measured wall time.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from compress.config import DistillConfig, PruneConfig  # noqa: E402
from compress.sizing.cpu import cpu_flags  # noqa: E402
from compress.corpus.splits import make_splits  # noqa: E402
from compress.distill.distributed import Rank  # noqa: E402
from compress.distill.fused import KDBody, TeacherRows, split_head  # noqa: E402
from compress.distill.loss import TeacherOut  # noqa: E402
from compress.distill.train import _DataOrder, distill, train_step  # noqa: E402
from compress.loading.models import load_teacher  # noqa: E402
from compress.prune import prune_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ("avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")

# name: (bf16, fused loss, matmul attention, fused AdamW, compiled loss and bodies)
VARIANTS = {
    "before (fp32, full logits, flash attention, per-tensor AdamW)": (False, False, False, False, False),
    "+ bf16 autocast, bf16 teacher copy": (True, False, False, False, False),
    "+ fused chunked KD loss": (True, True, False, False, False),
    "+ matmul attention": (True, True, True, False, False),
    "+ fused AdamW (today's loop)": (True, True, True, True, False),
    "+ torch.compile, loss chunk and bodies (distill.compile: on)": (True, True, True, True, True),
}


def run_variant(student, teacher, train, cfg: DistillConfig, flags: tuple, warmup: int, steps: int) -> dict:
    bf16, fused, eager, fused_adam, compiled = flags
    dev = torch.device("cpu")
    amp = torch.bfloat16 if bf16 else None
    s = copy.deepcopy(student)
    t = copy.deepcopy(teacher).to(torch.bfloat16) if bf16 else teacher
    for m in (s, t):
        m.set_attn_implementation("eager" if eager else "sdpa")
    probe = torch.as_tensor(train[:1, :16], dtype=torch.long)
    s_cut = split_head(s, probe) if fused else None
    t_cut = KDBody(t) if fused and split_head(teacher, probe) is not None else None
    if compiled:
        s_cut, t_cut = torch.compile(s_cut), torch.compile(t_cut)
    opt = torch.optim.AdamW(s.parameters(), lr=cfg.lr, fused=fused_adam, foreach=None if fused_adam else True)
    t.eval()

    def teacher_for(ids, x):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if t_cut is not None:
                last, _ = t_cut(x)
                return TeacherOut(TeacherRows(hidden=last[:, :-1].reshape(-1, last.shape[-1]), weight=t_cut.weight), None)
            return TeacherOut(t(input_ids=x, use_cache=False).logits[:, :-1], None)

    order = _DataOrder(len(train), cfg.seed)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        train_step(i, model=s if s_cut is None else s_cut, teacher_for=teacher_for, train=train, order=order, opt=opt, scaler=None,
                   pairs=[], cfg=cfg, rank=Rank(), device=dev, amp_dtype=amp, head=s.get_output_embeddings().weight if s_cut is not None else None,
                   compile_loss=compiled)
        times.append(time.perf_counter() - t0)
    per_step = sum(times[warmup:]) / steps
    return {"seconds_per_step": round(per_step, 3), "first_step_seconds": round(times[0], 2),
            "tokens_per_second": round(cfg.batch_size * cfg.grad_accum * (train.shape[1] - 1) / per_step, 1)}


def plan_check(student, teacher, splits, a) -> dict:
    """distill() on a budget of a.plan_tokens with today's defaults: the plan made before step 1 against the clock."""
    work = ROOT / ".cache" / "bench" / "distill_speed_plan"
    shutil.rmtree(work, ignore_errors=True)
    cfg = DistillConfig(enabled=True, tokens=a.plan_tokens, batch_size=a.batch_size, device="cpu", max_minutes=600,
                        early_stop_patience=0, eval_every=10**6, checkpoint_every=10**6)
    t0 = time.perf_counter()
    rep = distill(copy.deepcopy(student), teacher, splits, cfg, work, progress=False)
    wall = time.perf_counter() - t0
    out = {"tokens": a.plan_tokens, "steps": rep.steps, "planned_seconds": rep.plan["estimate_seconds"],
           "measured_seconds": round(rep.seconds, 1), "wall_seconds": round(wall, 1),
           "error": round(rep.plan["estimate_seconds"] / rep.seconds - 1, 3), "plan": rep.plan,
           "tokens_per_second": round(rep.steps * rep.plan["tokens_per_step"] / rep.train_seconds, 1)}
    print(f"planner: {a.plan_tokens:,} tokens, {rep.steps} steps: planned {out['planned_seconds']:.0f} s before step 1, "
          f"measured {out['measured_seconds']:.0f} s ({out['error']:+.1%}); {out['tokens_per_second']:.0f} tokens/s "
          f"in the steps")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="timed optimizer steps per variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (the compiled loss compiles here)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--mlp-ratio", type=float, default=0.25)
    ap.add_argument("--only", nargs="*", help="variant name prefixes to run (default: all)")
    ap.add_argument("--plan-tokens", type=int, default=0, help="also run distill() on this token budget: planned "
                    "against measured seconds")
    ap.add_argument("--json", type=Path, help="default: benchmarks/results/distill_speed_b<batch>x<block>.json")
    a = ap.parse_args(argv)
    a.json = a.json or ROOT / "benchmarks" / "results" / f"distill_speed_b{a.batch_size}x{a.block_size}.json"

    teacher, tok = load_teacher(cache_dir=ROOT / ".cache" / "models")
    splits = make_splits(tok, "embedded", block_size=a.block_size, train_blocks=64, calib_blocks=8, selection_blocks=4)
    student, prep = prune_model(teacher, splits.calib, PruneConfig(enabled=True, method="structured",
                                                                    mlp_ratio=a.mlp_ratio, importance="activation"))
    cfg = DistillConfig(enabled=True, steps=1000, batch_size=a.batch_size, device="cpu")
    flags = [f for f in FLAGS if f in cpu_flags()]
    print(f"CPU flags: {' '.join(flags) or 'none of ' + ' '.join(FLAGS)}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; student {prep.params_after:,} parameters; "
          f"{a.batch_size} x {a.block_size} tokens per step")
    rows = {}
    for name, v in VARIANTS.items():
        if a.only and not any(name.startswith(p) or p in name for p in a.only):
            continue
        rows[name] = r = run_variant(student, teacher, splits.train, cfg, v, a.warmup, a.steps)
        base = next(iter(rows.values()))["tokens_per_second"]
        r["ratio"] = round(r["tokens_per_second"] / base, 2)
        print(f"{name:<58} {r['seconds_per_step']:6.2f} s/step  {r['tokens_per_second']:7.1f} tok/s  "
              f"{r['ratio']:5.2f}x  (first step {r['first_step_seconds']:.1f} s)", flush=True)
    planner = plan_check(student, teacher, splits, a) if a.plan_tokens else None
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"planner": planner, "cpu_flags": flags, "machine": platform.machine(), "torch": torch.__version__,
                                  "threads": torch.get_num_threads(), "batch_size": a.batch_size,
                                  "block_size": a.block_size, "params_student": prep.params_after,
                                  "steps": a.steps, "warmup": a.warmup, "rows": rows}, indent=1))
    print(f"results in {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
