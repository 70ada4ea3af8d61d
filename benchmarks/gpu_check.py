"""The torch side of the project on a GPU, in one short run: what a lent GPU machine can verify in minutes.

    python3 -m benchmarks.gpu_check --out "$OUT"          # on the GPU machine (needs torch, transformers, pydantic)
    .venv/bin/python -m benchmarks.gpu_check --cpu        # the same plumbing on a CPU, for a dry run

Checks, reported as one JSON (printed, and written to --out/gpu_check.json):

1. ``tiny_bf16``: compress.distill.train on the seeded tiny teacher / student, 12 steps on CUDA with bf16
   autocast against the same 12 steps on the CPU in fp32: losses finite, KL to the teacher falls, and
   how far bf16 drifts from fp32 (largest relative loss difference).
2. ``smollm2_shape``: a Llama with SmolLM2-135M's shape (random weights: the real checkpoint does not
   fit the 64 MiB a device call may carry) as teacher and a student with 25 % fewer MLP neurons:
   seconds per optimizer step at the GPU budget of docs/distillation.md (global batch 32 x 128
   tokens), tokens per second and peak GPU memory.
3. ``ddp``: with more than one GPU, the same tiny run on every GPU through compress.distill.launch
   (NCCL) against one GPU: largest relative loss difference. Skipped with one GPU (NCCL refuses two
   ranks on one device).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from compress.config import DistillConfig  # noqa: E402
from compress.corpus.splits import make_splits  # noqa: E402
from compress.distill.train import distill  # noqa: E402
from compress.loading.tiny import build_tiny_llama  # noqa: E402

# SmolLM2-135M's architecture (config of the embedded GGUF).
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=100000.0, tie_word_embeddings=True)


def _cfg(device: str, **kw) -> DistillConfig:
    base = dict(steps=12, lr=3e-3, batch_size=4, eval_every=6, checkpoint_every=1000, early_stop_patience=0,
                warmup_steps=1, device=device)
    base.update(kw)
    return DistillConfig(**base)


def tiny_bf16(work: Path, device: str) -> dict:
    teacher, tok = build_tiny_llama(seed=0)
    student = build_tiny_llama(seed=1)[0]
    splits = make_splits(tok, "embedded", block_size=32, train_blocks=64, calib_blocks=8, selection_blocks=8, seed=0)
    ref = distill(copy.deepcopy(student), teacher, splits, _cfg("cpu"), work / "cpu", progress=False)
    got = distill(copy.deepcopy(student), teacher, splits, _cfg(device), work / device, progress=False)
    losses = [h["loss"] for h in got.history]
    return {
        "device": got.device,
        "losses_finite": all(map(lambda v: v == v and abs(v) != float("inf"), losses)),
        "kl_before_after": [got.kl_before, got.kl_after],
        "kl_fell": got.kl_after < got.kl_before,
        "max_rel_loss_diff_vs_cpu_fp32": max(abs(a["loss"] - b["loss"]) / abs(b["loss"])
                                             for a, b in zip(got.history, ref.history)),
        "s_per_step": round(got.seconds_per_step, 4),
    }


def smollm2_shape(work: Path, device: str, steps: int, batch: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).eval()
    student = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2, "intermediate_size": 1152}))
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, SMOLLM2["vocab_size"], (batch * steps + 16, 128), generator=gen).numpy()
    from compress.corpus.splits import DataSplits

    splits = DataSplits(blocks[:-16], blocks[-16:-8], blocks[-8:], "random", int(blocks.size))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    rep = distill(student, teacher, splits, _cfg(device, steps=steps, batch_size=batch, eval_every=10**6), work / "smol",
                  progress=False)
    return {
        "device": rep.device, "steps": rep.steps, "global_batch": batch, "block_size": 128,
        "s_per_step": round(rep.seconds_per_step, 4),
        "train_tokens_per_s": round(batch * 128 / rep.seconds_per_step, 1),
        "wall_s_incl_evals": round(time.perf_counter() - t0, 1),
        "peak_gpu_mib": round(torch.cuda.max_memory_allocated() / 2**20) if device == "cuda" else None,
    }


def ddp(work: Path) -> dict:
    n = torch.cuda.device_count()
    if n < 2:
        return {"skipped": f"{n} GPU: NCCL needs one GPU per rank"}
    from compress.distill.launch import DistillJob, launch_distill
    from compress.loading.tiny import save_tiny_llama

    t_dir, s_dir = save_tiny_llama(work / "t", seed=0), save_tiny_llama(work / "s", seed=1)
    _, tok = build_tiny_llama(seed=0)
    splits = make_splits(tok, "embedded", block_size=32, train_blocks=64, calib_blocks=8, selection_blocks=8, seed=0)
    splits.save(work / "splits.npz")
    cfg = _cfg("cuda", batch_size=4 * n, amp="off")
    single = launch_distill(DistillJob(str(t_dir), str(s_dir), str(work / "splits.npz"), str(work / "one"),
                                       str(work / "one-out"), cfg.model_dump(mode="json")), 1)
    many = launch_distill(DistillJob(str(t_dir), str(s_dir), str(work / "splits.npz"), str(work / "many"),
                                     str(work / "many-out"), cfg.model_dump(mode="json")), n)
    return {"ranks": n, "max_rel_loss_diff": max(abs(a["loss"] - b["loss"]) / abs(b["loss"])
                                                 for a, b in zip(many.history, single.history))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU (small SmolLM2-shaped budget)")
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device; pass --cpu for a dry run")
    res: dict = {"torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        for name, fn in [("tiny_bf16", lambda: tiny_bf16(work, device)),
                         ("smollm2_shape", lambda: smollm2_shape(work, device, *((2, 2) if args.cpu else (20, 32)))),
                         ("ddp", lambda: ddp(work) if device == "cuda" else {"skipped": "no CUDA"})]:
            t0 = time.perf_counter()
            try:
                res[name] = fn()
            except Exception as e:  # one failing check must not hide the others' figures
                res[name] = {"error": f"{type(e).__name__}: {e}"}
            res[name]["check_s"] = round(time.perf_counter() - t0, 1)
            print(name, json.dumps(res[name]), flush=True)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(text)


if __name__ == "__main__":
    main()
