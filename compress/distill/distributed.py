"""Process-group plumbing for distillation under torchrun: which rank this is, and collectives that are no-ops alone.

torchrun starts one process per GPU (or per CPU slot, for testing with gloo) and sets RANK,
WORLD_SIZE and LOCAL_RANK; :func:`init_from_env` joins the group those describe. A plain
single-process call never touches torch.distributed, so compress/distill/train.py runs the same code
either way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Rank:
    rank: int = 0
    world: int = 1
    local: int = 0  # index of this process on its node = its GPU

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def current() -> Rank:
    """This process's place in the initialised process group (rank 0 of 1 without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return Rank()
    return Rank(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())))


def init_from_env(use_cuda: bool) -> Rank:
    """Join the process group torchrun described in the environment: NCCL on GPUs, gloo on CPUs.

    Without WORLD_SIZE (or with 1) nothing is initialised and rank 0 of 1 comes back.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if use_cuda:
            torch.cuda.set_device(local)  # before init: NCCL binds each rank to its own GPU
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return current()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(rank: Rank) -> None:
    if rank.distributed:
        dist.barrier()


def total(rank: Rank, values: list[float], device: torch.device) -> list[float]:
    """The sum over ranks of each value (float64), bit-identical on every rank."""
    if not rank.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    dist.broadcast(t, 0)  # every rank then holds rank 0's bits, so decisions made on them agree
    return t.tolist()


def mean(rank: Rank, values: list[float], device: torch.device) -> list[float]:
    """The average over ranks of each value (float64), bit-identical on every rank."""
    return [v / rank.world for v in total(rank, values, device)] if rank.distributed else list(values)


def rank0_says(rank: Rank, flag: bool, device: torch.device) -> bool:
    """Rank 0's value of ``flag`` on every rank (wall-clock decisions must not differ between ranks)."""
    if not rank.distributed:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.broadcast(t, 0)
    return bool(t.item())
