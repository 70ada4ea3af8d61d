"""The draft head: its network, its training by distillation from the target, and its acceptance measured offline.

One step: from a hidden state ``h`` (the target's at first, then the head's own) and the token it chose, a small
MLP predicts the next hidden state ``z = h + fc2(silu(fc1([rms(h), rms(E[token])])))``, normalized, and the
target's own lm_head (frozen, trimmed to the drafter's vocabulary ``W`` [hidden, V]) turns it into logits. The token
table ``E`` is ``W``'s columns (the target's head rows, a zero row for tokens outside the vocabulary). Unrolled
``steps`` times it drafts that many tokens. Like EAGLE (Li et al., 2024) it drafts on features and is fed the
sampled token, with no attention: no draft KV cache, a few MB of weights.

Distillation on the target's conversations (compress/draft/conversations.py): step i is taught the target's
distribution for answer token j + i (its logits ``G[j+i] @ W``: KL at a temperature that follows the schedule,
start -> end) and the target's hidden state ``G[j+i]`` (smooth L1, weight ``feature_weight``); its input is the
head's own previous prediction and the true previous token, as when it serves (only accepted chains go on).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from compress.distill.schedules import schedule_value

EPS = 1e-6


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


class HeadNet(torch.nn.Module):
    def __init__(self, W: np.ndarray, width: int, out_scale: float):
        super().__init__()
        H, V = W.shape
        self.register_buffer("W", torch.from_numpy(W).float())
        self.register_buffer("E", torch.cat([torch.from_numpy(W.T.copy()).float(), torch.zeros(1, H)]))
        self.fc1 = torch.nn.Linear(2 * H, width)
        self.fc2 = torch.nn.Linear(width, H)
        torch.nn.init.zeros_(self.fc2.weight)  # starts as "the next state is this one"
        torch.nn.init.zeros_(self.fc2.bias)
        self.norm = torch.nn.Parameter(torch.full((H,), float(out_scale)))

    def step(self, h: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(next hidden state, its logits over the vocabulary) from ``h`` [B, H] and token indexes ``idx`` [B]."""
        u = torch.cat([rms(h), rms(self.E[idx])], -1)
        z = h + self.fc2(F.silu(self.fc1(u)))
        zn = rms(z) * self.norm
        return zn, zn @ self.W


@dataclass
class Corpus:
    """Conversations flattened: ``G`` [N, H] the hidden state that chose answer token n, ``idx`` [N] its index in the
    drafter's vocabulary (V = outside), ``ids`` [N] its id, ``left`` [N] how many answer tokens follow in its
    conversation."""

    G: np.ndarray
    idx: np.ndarray
    ids: np.ndarray
    left: np.ndarray

    @classmethod
    def of(cls, convs, to_index: np.ndarray) -> "Corpus":
        G = np.concatenate([c.hidden for c in convs])
        ids = np.concatenate([c.ids[c.start:] for c in convs]).astype(np.int64)
        left = np.concatenate([np.arange(len(c.hidden) - 1, -1, -1) for c in convs])
        return cls(G, to_index[ids], ids, left)


@dataclass
class TrainReport:
    steps: int
    tokens: int
    seconds: float
    losses: list[float]
    temperatures: list[float]


def train(net: HeadNet, data: Corpus, *, steps_unrolled: int, tokens: int, batch: int = 256, lr: float = 1e-3,
          t_start: float = 2.0, t_end: float = 1.0, feature_weight: float = 0.1, seed: int = 0,
          progress: bool = True) -> TrainReport:
    """Distil the head on ``tokens`` answer positions (a budget planned before step 1: ``tokens // batch`` steps)."""
    gen = torch.Generator().manual_seed(seed)
    K = steps_unrolled
    starts = np.flatnonzero(data.left >= 1)
    total = max(1, tokens // batch)
    G = torch.from_numpy(data.G)
    idx = torch.from_numpy(data.idx)
    left = torch.from_numpy(data.left)
    teacher_logits = target_logits(net, G)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses, temps, t0 = [], [], time.perf_counter()
    bar = tqdm(range(total), desc="draft head KD", disable=not progress)
    for step in bar:
        T = schedule_value("linear", t_start, t_end, step, total)
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total))
        pick = torch.from_numpy(starts)[torch.randint(len(starts), (batch,), generator=gen)]
        h = G[pick].float()
        tok = idx[pick]
        loss = torch.zeros(())
        for i in range(1, K + 1):
            mask = (left[pick] >= i).float()
            if mask.sum() == 0:
                break
            nxt = torch.clamp(pick + i, max=len(G) - 1)
            target_h = G[nxt].float()
            teacher = F.softmax(teacher_logits[nxt].float() / T, -1)
            h, logits = net.step(h, tok)
            kl = (teacher * (torch.log(teacher + 1e-9) - F.log_softmax(logits / T, -1))).sum(-1) * T * T
            feat = F.smooth_l1_loss(h, target_h, reduction="none").mean(-1)
            w = 0.8 ** (i - 1)
            loss = loss + w * ((kl + feature_weight * feat) * mask).sum() / mask.sum()
            tok = idx[nxt]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        temps.append(T)
        if step % 20 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}", T=f"{T:.2f}")
    return TrainReport(total, total * batch, time.perf_counter() - t0, losses, temps)


@torch.no_grad()
def target_logits(net: HeadNet, G: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """The target's logits over the drafter's vocabulary at every position, ``G @ W`` [N, V] in fp16: computed once,
    not once per step that reads them (the teacher's matmul was as large as the student's)."""
    out = torch.empty(len(G), net.W.shape[1], dtype=torch.float16)
    for lo in range(0, len(G), chunk):
        out[lo:lo + chunk] = (G[lo:lo + chunk].float() @ net.W).half()
    return out


@torch.no_grad()
def chain_acceptance(net: HeadNet, data: Corpus, vocab_ids: np.ndarray, k: int, limit: int = 4000) -> dict:
    """Greedy acceptance on held-out conversations, as the server checks it: from each answer position the head
    drafts ``k`` tokens on its own predictions; the drafts stand up to the first that is not the target's next
    token. Returns the mean accepted drafts per check and the per-position acceptance rates."""
    starts = np.flatnonzero(data.left >= 1)[:limit]
    G = torch.from_numpy(data.G)
    p = torch.from_numpy(starts)
    h, tok = G[p].float(), torch.from_numpy(data.idx)[p]
    alive = torch.ones(len(p), dtype=torch.bool)
    accepted = torch.zeros(len(p))
    per_pos = []
    for i in range(1, k + 1):
        h, logits = net.step(h, tok)
        draft = torch.from_numpy(vocab_ids)[logits.argmax(-1)]
        has = torch.from_numpy(data.left)[p] >= i
        nxt = torch.clamp(p + i, max=len(G) - 1)
        truth = torch.from_numpy(data.ids)[nxt]
        ok = alive & has & (draft == truth)
        per_pos.append(float(ok.sum() / max(1, int((alive & has).sum()))))
        accepted += ok.float()
        alive = ok
        tok = torch.from_numpy(data.idx)[nxt]
    return {"accepted_per_check": float(accepted.mean()), "rate_by_position": per_pos, "positions": len(p)}
