"""The knowledge-distillation objective: the loss, the teacher top-k cache that feeds it, and the eval.

Loss per token, averaged over the positions that count (``attention_mask``)::

    loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(student, labels)

Teacher top-k cache (``teacher_topk = k > 0``): the teacher's k largest logits per position and their
token ids are kept for every train block on its first visit and reused on later epochs, so the
teacher runs once per block instead of once per visit. Memory is ``blocks * (block_size - 1) * k * 8``
bytes (fp32 value + int32 id): 256 blocks of 128 tokens at k = 64 is 16.6 MB, where full fp32 logits
of a 49k vocabulary would be 6.4 GB. The price is accuracy: the KD term then compares the student
with the teacher renormalised over its top k, which drops the tail mass the teacher puts outside
them (more of it at a high T). With k = 0 the teacher runs on every batch and the KL is exact.
It pays only past the first epoch (steps * batch_size * grad_accum > train blocks).

Intermediate states (``hidden_weight = beta > 0``, as Minitron does beside the logit KD)::

    loss += beta * mean over student layers l of mean over tokens of ||h_s[l] - h_t[m(l)]||^2 / ||h_t[m(l)]||^2

h is the residual stream after a decoder layer and m(l) the teacher layer that student layer l was
cut from (the identity unless the prune stage dropped layers). Normalising per token keeps the few
tokens whose residual norm is hundreds of times the rest (the first position's attention sink)
from outweighing every other token, and makes beta mean the same on any model width.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from compress.distill import distributed
from compress.distill.distributed import Rank


class TopK(NamedTuple):
    """The teacher's k largest logits per position ([..., k]) and their token ids."""

    values: torch.Tensor
    indices: torch.Tensor


class TeacherOut(NamedTuple):
    """What the loss reads from the teacher for a batch: logits (or their cached top-k), hidden states or None."""

    logits: torch.Tensor | TopK
    hidden: Sequence[torch.Tensor] | None


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | TopK, labels: torch.Tensor,
            attention_mask: torch.Tensor | None, T: float, alpha: float) -> tuple[torch.Tensor, dict[str, float]]:
    """``alpha * T^2 * KL(p_t || p_s) + (1 - alpha) * CE``, each a mean over the positions that count.

    student_logits, teacher_logits: [batch, seq, vocab], already aligned with ``labels`` [batch, seq]
    (``logits[:, i]`` is scored against ``labels[:, i]``; for a causal LM pass ``logits[:, :-1]`` and
    ``input_ids[:, 1:]``). ``p_t = softmax(teacher / T)``, ``p_s = softmax(student / T)``; the CE uses
    the student at T = 1. attention_mask [batch, seq] (1 = real token, 0 = padding; None = all count)
    masks both terms; labels of -100 are also left out of the CE. ``teacher_logits`` may be a
    :class:`TopK`: ``p_t`` is then the softmax over the k kept logits and the KL sums over those k ids.

    Returns the loss (a scalar tensor with grad) and floats ``kl`` (at T), ``kd_loss`` (= T^2 * kl),
    ``ce_loss`` and ``loss``.
    """
    s = student_logits.float()
    mask = torch.ones(s.shape[:-1], dtype=torch.bool, device=s.device) if attention_mask is None else attention_mask.bool()
    log_ps = F.log_softmax(s / T, dim=-1)
    if isinstance(teacher_logits, TopK):
        log_pt = F.log_softmax(teacher_logits.values.float() / T, dim=-1)
        log_ps = log_ps.gather(-1, teacher_logits.indices.long())
    else:
        log_pt = F.log_softmax(teacher_logits.float() / T, dim=-1)
    kl_tok = F.kl_div(log_ps, log_pt, log_target=True, reduction="none").sum(-1)
    m = mask.float()
    kl = (kl_tok * m).sum() / m.sum().clamp(min=1.0)
    ce_labels = labels.masked_fill(~mask, -100)
    n_ce = (ce_labels != -100).sum().clamp(min=1)
    ce = F.cross_entropy(s.reshape(-1, s.shape[-1]), ce_labels.reshape(-1), ignore_index=-100, reduction="sum") / n_ce
    loss = alpha * T * T * kl + (1.0 - alpha) * ce
    kl_f, ce_f = kl.item(), ce.item()
    parts = {"kl": kl_f, "kd_loss": T * T * kl_f, "ce_loss": ce_f, "loss": alpha * T * T * kl_f + (1.0 - alpha) * ce_f}
    return loss, parts


def hidden_loss(student_hidden: Sequence[torch.Tensor], teacher_hidden: Sequence[torch.Tensor],
                teacher_layers: Sequence[int]) -> torch.Tensor:
    """Mean over the student's layers of the per-token normalised squared error to the teacher's layer.

    student_hidden, teacher_hidden: the models' ``hidden_states`` outputs ([batch, seq, hidden] each;
    entry 0 is the embedding output, entry l + 1 the output of decoder layer l). teacher_layers[l] is
    the teacher layer student layer l corresponds to. Every position counts (training blocks carry no
    padding).
    """
    if len(student_hidden) - 1 != len(teacher_layers):
        raise ValueError(f"{len(student_hidden) - 1} student layers but a layer map of {len(teacher_layers)}")
    total = student_hidden[0].new_zeros((), dtype=torch.float32)
    for layer, t_layer in enumerate(teacher_layers):
        hs, ht = student_hidden[layer + 1].float(), teacher_hidden[t_layer + 1].float()
        err = (hs - ht).pow(2).sum(-1) / ht.pow(2).sum(-1).clamp(min=1e-6)
        total = total + err.mean()
    return total / max(len(teacher_layers), 1)


@torch.no_grad()
def evaluate(student, teacher, blocks: np.ndarray, batch_size: int = 4, amp_dtype: torch.dtype | None = None,
             rank: Rank | None = None) -> dict[str, float]:
    """Student perplexity, KL(teacher || student) at T = 1 and top-1 agreement, plus the teacher's perplexity.

    Same definitions as compress.evaluate.torch_eval (perplexity over next-token predictions, KL and agreement
    over every position) in one pass: one student and one teacher forward per batch instead of three.
    With a distributed ``rank`` each rank scores every world-th block and the sums are added up.
    """
    student.eval()
    teacher.eval()
    dev = next(student.parameters()).device
    rank = rank or Rank()
    blocks = blocks[rank.rank :: rank.world]
    nll_s = nll_t = kl_sum = 0.0
    agree = n_tok = n_pred = 0
    for i in range(0, len(blocks), batch_size):
        x = torch.as_tensor(blocks[i : i + batch_size], dtype=torch.long, device=dev)
        with autocast(dev, amp_dtype):
            s = student(input_ids=x, use_cache=False).logits
            t = teacher(input_ids=x, use_cache=False).logits
        s, t = s.float(), t.float()
        y = x[:, 1:].reshape(-1)
        nll_s += float(F.cross_entropy(s[:, :-1].reshape(-1, s.shape[-1]), y, reduction="sum"))
        nll_t += float(F.cross_entropy(t[:, :-1].reshape(-1, t.shape[-1]), y, reduction="sum"))
        n_pred += y.numel()
        kl_sum += float(F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="sum"))
        agree += int((s.argmax(-1) == t.argmax(-1)).sum())
        n_tok += x.numel()
    if rank.distributed:
        nll_s, nll_t, kl_sum, agree, n_tok, n_pred = distributed.total(
            rank, [nll_s, nll_t, kl_sum, agree, n_tok, n_pred], dev)

    def ppl(nll: float) -> float:
        return math.exp(min(nll / max(n_pred, 1), 700.0))  # a diverged model reads 1e304, not an OverflowError

    return {
        "perplexity": ppl(nll_s),
        "kl": kl_sum / max(n_tok, 1),
        "top1_agreement": agree / max(n_tok, 1),
        "teacher_perplexity": ppl(nll_t),
    }


class TeacherCache:
    """Top-k teacher logits of each train block, computed on its first visit (see the module docstring)."""

    def __init__(self, n_blocks: int, positions: int, k: int):
        self.k = k
        self.values = torch.zeros(n_blocks, positions, k)
        self.indices = torch.zeros(n_blocks, positions, k, dtype=torch.int32)
        self.filled = torch.zeros(n_blocks, dtype=torch.bool)

    @property
    def nbytes(self) -> int:
        return self.values.numel() * 4 + self.indices.numel() * 4

    def get(self, ids: list[int], x: torch.Tensor, teacher_logits: Callable[[torch.Tensor], torch.Tensor]) -> TopK:
        idx = torch.as_tensor(ids)
        missing = [i for i, b in enumerate(ids) if not self.filled[b]]
        if missing:
            logits = teacher_logits(x[missing]).float()
            top = logits.topk(min(self.k, logits.shape[-1]), dim=-1)
            rows = idx[missing]
            self.values[rows] = top.values.cpu()
            self.indices[rows] = top.indices.to(torch.int32).cpu()
            self.filled[rows] = True
        return TopK(self.values[idx].to(x.device), self.indices[idx].to(x.device))


def autocast(device: torch.device, amp_dtype: torch.dtype | None):
    """Mixed precision on `device` in `amp_dtype`, or a no-op (CPU, amp off)."""
    return torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()

