"""One optimizer step of distillation: the seeded data order, each rank's share of the step's global batch, the
micro-batches' losses and the masked, clipped update (compress/distill/train.py's loop calls :func:`train_step`)."""

from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np
import torch

from compress.distill import distributed
from compress.distill.distributed import Rank
from compress.distill.fused import TeacherRows, fused_kd_loss
from compress.distill.loss import TeacherOut, autocast, hidden_loss, kd_loss
from compress.distill.report import DistillError
from compress.distill.schedules import alpha_at, lr_at, temperature_at


def _prepare_masks(student, masks: dict | None) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """[(param, pruned positions)] on the param's device; names as in named_parameters (tied names too)."""
    if not masks:
        return []
    params = dict(student.named_parameters(remove_duplicate=False))
    out = []
    for name, keep in masks.items():
        if name not in params:
            raise DistillError(f"mask for {name!r}: the student has no such parameter")
        p = params[name]
        if tuple(keep.shape) != tuple(p.shape):
            raise DistillError(f"mask for {name!r} has shape {tuple(keep.shape)}, the parameter {tuple(p.shape)}")
        out.append((p, ~torch.as_tensor(keep).to(device=p.device, dtype=torch.bool)))
    return out


@torch.no_grad()
def _apply_masks(pairs) -> None:
    for p, pruned in pairs:
        p.masked_fill_(pruned, 0.0)


class _DataOrder:
    """Sample j of the run is train block perm_e[j % n] of epoch e = j // n, perm_e seeded by (seed, e).

    The order is a function of the step alone, so a resumed run sees the batches it would have seen.
    """

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self._perms = n, seed, {}

    def blocks(self, start: int, count: int) -> list[int]:
        out = []
        for j in range(start, start + count):
            e, r = divmod(j, self.n)
            if e not in self._perms:
                self._perms = {e: np.random.default_rng([self.seed, e]).permutation(self.n)}
            out.append(int(self._perms[e][r]))
        return out

def per_rank_blocks(cfg, world: int) -> int:
    """Blocks each of ``world`` ranks trains on per optimizer step: the global batch split evenly."""
    global_batch = cfg.batch_size * cfg.grad_accum
    if global_batch % world:
        raise DistillError(
            f"distill.batch_size x distill.grad_accum = {global_batch} blocks per step cannot be split evenly "
            f"over {world} processes; make it a multiple of {world} (distill.nproc_per_node)")
    return global_batch // world


def step_chunks(order: _DataOrder, step: int, cfg, rank: Rank) -> list[list[int]]:
    """The train blocks ``rank`` runs in 0-based optimizer step ``step``, as micro-batches of <= batch_size.

    The step's global batch is samples [step * G, (step + 1) * G) of the seeded order (G =
    batch_size * grad_accum); rank r takes the r-th of world equal slices of it.
    """
    mine = per_rank_blocks(cfg, rank.world)
    ids = order.blocks(step * cfg.batch_size * cfg.grad_accum + rank.rank * mine, mine)
    return [ids[c : c + cfg.batch_size] for c in range(0, mine, cfg.batch_size)]


def _micro_batch_loss(model, x: torch.Tensor, ids: list[int], *, teacher_for, cfg, T: float, alpha: float,
                      device: torch.device, amp_dtype, teacher_layers, head, compile_loss: bool):
    """One micro-batch's loss (to back-propagate) and its parts as floats: the student's forward, the teacher's
    rows for the same blocks, the KD loss (fused with the head when ``head`` is given) and the hidden-state term."""
    with_hidden = cfg.hidden_weight > 0
    with autocast(device, amp_dtype):
        if head is not None:
            last, hidden = model(x, with_hidden)
        else:
            out = model(input_ids=x, use_cache=False, output_hidden_states=with_hidden)
            hidden = out.hidden_states
    t_out = teacher_for(ids, x)
    if head is not None:
        loss, parts = fused_kd_loss(last[:, :-1].reshape(-1, last.shape[-1]), head, TeacherRows.of(t_out.logits),
                                    x[:, 1:].reshape(-1), T, alpha, seq=x.shape[1] - 1,
                                    compute_dtype=amp_dtype or torch.float32, compile_loss=compile_loss)
    else:
        loss, parts = kd_loss(out.logits[:, :-1], t_out.logits, x[:, 1:], None, T, alpha)
    parts["hidden_loss"] = 0.0
    if with_hidden:
        h = hidden_loss(hidden, t_out.hidden, teacher_layers)
        loss = loss + cfg.hidden_weight * h
        parts["hidden_loss"] = h.item()
        parts["loss"] += cfg.hidden_weight * parts["hidden_loss"]
    return loss, parts


def _update(opt: torch.optim.Optimizer, scaler, pairs, cfg, lr: float) -> None:
    """The optimizer step on the accumulated gradients: pruned gradients zeroed, unscaled, clipped, at ``lr``;
    pruned weights zeroed again after it."""
    for p, pruned in pairs:
        if p.grad is not None:
            p.grad.masked_fill_(pruned, 0.0)
    if scaler:
        scaler.unscale_(opt)
    if cfg.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], cfg.max_grad_norm)
    for g in opt.param_groups:
        g["lr"] = lr
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    _apply_masks(pairs)


def train_step(i: int, *, model, teacher_for: Callable[[list[int], torch.Tensor], TeacherOut],
               train: np.ndarray, order: _DataOrder, opt: torch.optim.Optimizer, scaler, pairs, cfg, rank: Rank,
               device: torch.device, amp_dtype: torch.dtype | None,
               teacher_layers: list[int] | None = None, head: torch.nn.Parameter | None = None,
               compile_loss: bool = False, lr_scale: float = 1.0) -> dict[str, float]:
    """Optimizer step ``i`` (0-based) on this rank's share of the step's global batch.

    ``model`` is the student, or with ``head`` (its LM head's weight) the student's body (a KDBody, maybe in DDP):
    the loss is then fused with the head (compress/distill/fused.py).
    Forward and KD loss per micro-batch, backward (DDP all-reduces on the last micro-batch only),
    pruned gradients zeroed, clipping, the step, pruned weights zeroed again. teacher_for(ids, x)
    gives the teacher's logits (or cached top-k) for train blocks ``ids`` = ``x``, and its hidden
    states when cfg.hidden_weight > 0 (compared layer by layer through ``teacher_layers``). Returns
    {T, alpha, kd_loss, ce_loss, hidden_loss, loss, lr}: the schedule values used and the losses
    averaged over the global batch.
    """
    T, alpha, lr = temperature_at(i, cfg.steps, cfg), alpha_at(i, cfg.steps, cfg), lr_at(i, cfg.steps, cfg) * lr_scale
    model.train()
    sums = {"kd_loss": 0.0, "ce_loss": 0.0, "hidden_loss": 0.0, "loss": 0.0}
    chunks = step_chunks(order, i, cfg, rank)
    mine = per_rank_blocks(cfg, rank.world)
    for c, ids in enumerate(chunks):
        share = mine / len(ids)  # = grad_accum alone: each micro-batch's mean weighs by its size
        x = torch.as_tensor(train[ids], dtype=torch.long, device=device)
        sync = c == len(chunks) - 1 or not rank.distributed
        with (contextlib.nullcontext() if sync else model.no_sync()):
            loss, parts = _micro_batch_loss(model, x, ids,
                                            teacher_for=teacher_for, cfg=cfg, T=T, alpha=alpha, device=device,
                                            amp_dtype=amp_dtype, teacher_layers=teacher_layers, head=head,
                                            compile_loss=compile_loss)
            (scaler.scale(loss / share) if scaler else loss / share).backward()
        for k in sums:
            sums[k] += parts[k] / share
    if rank.distributed:
        sums = dict(zip(sums, distributed.mean(rank, list(sums.values()), device)))
    _update(opt, scaler, pairs, cfg, lr)
    return {"T": T, "alpha": alpha, **sums, "lr": lr}
