"""Where and how a distillation run computes: its device, the autocast dtype, the attention form CPU training uses
and whether the bodies are torch.compiled (compress/distill/train.py sets the run up with them)."""

from __future__ import annotations

import contextlib
import shutil

import torch

from compress.distill.distributed import Rank
from compress.distill.fused import KDBody
from compress.distill.report import DistillError
from compress.sizing.cpu import has_bf16

EAGER_ATTENTION_MAX = 512  # tokens per block up to which CPU training uses the matmul form of attention
COMPILE_MIN_TOKENS = 200_000  # training tokens from which distill.compile 'auto' compiles on the CPU


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The training device; under torchrun CUDA rank i trains on GPU i of its node."""
    if name == "cuda" and not torch.cuda.is_available():
        raise DistillError("distill.device is 'cuda' but torch sees no CUDA device; set distill.device to 'auto' or 'cpu'")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def amp_dtype_for(cfg, device: torch.device) -> torch.dtype | None:
    """Autocast dtype, None for fp32. 'auto': bf16 where the device computes it natively (a GPU with bf16, a CPU with
    AVX-512 BF16 or AMX), fp16 on a GPU without bf16, fp32 on any other CPU."""
    if cfg.amp == "off":
        return None
    if device.type == "cuda":
        if cfg.amp == "auto":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.amp]
    if cfg.amp == "fp16":
        raise DistillError("distill.amp fp16 trains on CUDA only; on the CPU set distill.amp to bf16, auto or off")
    return torch.bfloat16 if cfg.amp == "bf16" or has_bf16() else None


@contextlib.contextmanager
def _training_attention(device: torch.device, block: int, *models):
    """On the CPU, blocks up to EAGER_ATTENTION_MAX tokens train with the matmul form of attention: its backward is
    4x faster there than the CPU flash-attention kernel's (0.22 of 0.85 s of a SmolLM2 step at 128 tokens), and its
    [seq x seq] scores are small at these lengths. The models' own setting comes back afterwards."""
    if device.type != "cpu" or block > EAGER_ATTENTION_MAX:
        yield
        return
    before = [m.config._attn_implementation for m in models]
    try:
        for m in models:
            m.set_attn_implementation("eager")
        yield
    finally:
        for m, impl in zip(models, before):
            m.set_attn_implementation(impl)


def _resolve_compile(cfg, device: torch.device, cut: KDBody | None, rank: Rank, positions: int) -> bool:
    """distill.compile: whether to torch.compile the bodies and the fused loss's chunk. 'auto' compiles where it pays
    back its one-off compile (~100 s on 2 cores, 0.35 s a step saved at 4 x 128 tokens, 1.5 s at 16 x 128): CPU runs
    of COMPILE_MIN_TOKENS or more in one process, with a C++ compiler for inductor."""
    if cut is None or cfg.compile == "off" or rank.distributed:
        return False
    if cfg.compile == "on":
        return True
    tokens = cfg.tokens or cfg.steps * cfg.batch_size * cfg.grad_accum * positions
    return device.type == "cpu" and tokens >= COMPILE_MIN_TOKENS and shutil.which("c++") is not None
