"""Accuracy of torch models on token blocks: perplexity, KL to a teacher, top-1 agreement.

Shared by pruning (sensitivity, before/after) and distillation (eval curves); the
ONNX-side equivalents live in compress/evaluate/onnx_eval.py.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def _batches(blocks: np.ndarray, batch_size: int):
    for i in range(0, len(blocks), batch_size):
        yield torch.as_tensor(blocks[i : i + batch_size], dtype=torch.long)


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def perplexity(model, blocks: np.ndarray, batch_size: int = 4) -> float:
    """exp(mean next-token cross-entropy) over positions 1..s-1 of every block: the positions
    compress.evaluate.onnx_eval scores (position 0, which holds BOS for a model that takes one, is never a target)."""
    model.eval()
    dev = _device_of(model)
    total, count = 0.0, 0
    for x in _batches(blocks, batch_size):
        x = x.to(dev)
        logits = model(input_ids=x).logits[:, :-1].float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total += float(nll)
        count += x[:, 1:].numel()
    return math.exp(total / max(count, 1))


@torch.no_grad()
def kl_and_agreement(student, teacher, blocks: np.ndarray, batch_size: int = 4) -> dict[str, float]:
    """Mean per-token KL(teacher || student) at T=1 and the share of positions with the same argmax."""
    student.eval()
    teacher.eval()
    dev = _device_of(student)
    kl_sum, agree, count = 0.0, 0, 0
    for x in _batches(blocks, batch_size):
        s = student(input_ids=x.to(dev)).logits.float()
        t = teacher(input_ids=x.to(_device_of(teacher))).logits.float().to(dev)
        kl = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1)
        kl_sum += float(kl.sum())
        agree += int((s.argmax(-1) == t.argmax(-1)).sum())
        count += kl.numel()
    return {"kl": kl_sum / max(count, 1), "top1_agreement": agree / max(count, 1)}
