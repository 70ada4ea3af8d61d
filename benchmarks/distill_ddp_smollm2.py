"""SmolLM2-135M distillation on N torchrun ranks against one process, same config, same run: time per step and agreement.

    .venv/bin/python -m benchmarks.distill_ddp_smollm2                     # 2 ranks vs 1 process, 6 steps
    .venv/bin/python -m benchmarks.distill_ddp_smollm2 --nproc 4 --steps 20 --batch-size 16   # on a 4-GPU node

Student: 25 % of the MLP neurons pruned (activation importance, no sensitivity scan). Both runs
use compress.distill.train with the same DistillConfig; the ranks go through compress.distill.launch
(the path the flow takes for distill.nproc_per_node > 1). Prints seconds per optimizer step of
each and their ratio, the largest relative difference of the per-step losses, and the largest
absolute weight difference of the two trained students. On a CPU machine the ranks share the
cores (gloo): the ratio then shows the cost of the multi-process path, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
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
from compress.distill.launch import DistillJob, launch_distill  # noqa: E402
from compress.loading.models import load_teacher, resolve_source  # noqa: E402
from compress.prune import prune_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".cache" / "bench" / "distill_ddp"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=1)
    args = ap.parse_args()
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)

    teacher_dir = resolve_source("embedded", None, ROOT / ".cache" / "models")
    teacher, tok = load_teacher(teacher_dir)
    splits = make_splits(tok, "embedded", block_size=128, train_blocks=256, calib_blocks=16, selection_blocks=8, seed=0)
    splits.save(OUT / "splits.npz")
    student, _ = prune_model(teacher, splits.calib, PruneConfig(enabled=True, mlp_ratio=0.25, sensitivity=False))
    student.save_pretrained(OUT / "student")
    tok.save_pretrained(OUT / "student")
    cfg = DistillConfig(enabled=True, steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum,
                        eval_every=10**6, checkpoint_every=10**6, early_stop_patience=0, warmup_steps=1)

    t0 = time.perf_counter()
    single = distill(student, teacher, splits, cfg, OUT / "single")
    single_wall = time.perf_counter() - t0
    job = DistillJob(teacher_dir, str(OUT / "student"), str(OUT / "splits.npz"), str(OUT / "ddp"), str(OUT / "ddp-out"),
                     cfg.model_copy(update={"nproc_per_node": args.nproc}).model_dump(mode="json"))
    t0 = time.perf_counter()
    ranks = launch_distill(job, args.nproc)
    ranks_wall = time.perf_counter() - t0

    trained, _ = load_teacher(str(OUT / "ddp-out"))
    a, b = student.state_dict(), trained.state_dict()
    res = {
        "nproc": args.nproc, "device": ranks.device, "steps": args.steps, "global_batch": args.batch_size * args.grad_accum,
        "torch_threads_single": torch.get_num_threads(),
        "s_per_step_single": round(single.seconds_per_step, 3), "s_per_step_ranks": round(ranks.seconds_per_step, 3),
        "ratio_ranks_vs_single": round(ranks.seconds_per_step / single.seconds_per_step, 3),
        "wall_s_single": round(single_wall, 1), "wall_s_ranks_incl_start": round(ranks_wall, 1),
        "max_rel_loss_diff": max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(single.history, ranks.history)),
        "max_abs_weight_diff": max((a[k] - b[k]).abs().max().item() for k in a),
        "kl_after": [single.kl_after, ranks.kl_after],
        "loadavg": os.getloadavg(),
    }
    (OUT / "result.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
