"""Knowledge distillation: the (pruned) student learns from the teacher under a temperature schedule.

Loss per token, averaged over the positions that count (``attention_mask``)::

    loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(student, labels)

T and alpha follow the schedules of compress/schedules.py, one value per optimizer step. The
training loop (:func:`distill`) runs on CPU or CUDA (autocast bf16/fp16 there), accumulates
gradients, stops at ``steps`` or ``max_minutes``, evaluates perplexity and KL-to-teacher every
``eval_every`` steps, keeps the best checkpoint, stops early, re-applies pruning masks after every
optimizer step and resumes from the last checkpoint in its work folder. Plain functions: the
caller (the Prefect task) does the MLflow logging through ``on_log``.

Several GPUs: started by torchrun (compress/distill_launch.py), each process calls :func:`distill`
inside an initialised process group; the student is wrapped in DistributedDataParallel, the teacher
is replicated, and every optimizer step's global batch (``batch_size * grad_accum`` blocks, in the
seeded order) is split evenly across the ranks. The gradient DDP averages is then the gradient of
the whole global batch, so N ranks follow the single-process trajectory (up to float summation
order) and a checkpoint resumes on any number of ranks. Evals are sharded and summed; rank 0 alone
writes checkpoints, the report and the ``on_log`` stream.

Work folder layout (safetensors and JSON only, nothing pickled)::

    last/student.safetensors     student weights at the last checkpoint
    last/optimizer.safetensors   optimizer tensors (Adam moments, step) and the torch RNG state(s)
    last/state.json              step, seconds, history, best so far, optimizer param groups, ...
    best/                        the best student as a Hugging Face folder (save_pretrained) + best.json
    report.json                  the DistillReport of a finished run (a re-run returns it at once)

Teacher top-k cache (``teacher_topk = k > 0``): the teacher's k largest logits per position and their
token ids are kept for every train block on its first visit and reused on later epochs, so the
teacher runs once per block instead of once per visit. Memory is ``blocks * (block_size - 1) * k * 8``
bytes (fp32 value + int32 id): 256 blocks of 128 tokens at k = 64 is 16.6 MB, where full fp32 logits
of a 49k vocabulary would be 6.4 GB. The price is accuracy: the KD term then compares the student
with the teacher renormalised over its top k, which drops the tail mass the teacher puts outside
them (more of it at a high T). With k = 0 the teacher runs on every batch and the KL is exact.
It pays only past the first epoch (steps * batch_size * grad_accum > train blocks).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, load_model, save_file, save_model

from compress import distributed
from compress.data import DataSplits
from compress.distributed import Rank
from compress.schedules import alpha_at, lr_at, temperature_at

log = logging.getLogger(__name__)

LAST, BEST, REPORT = "last", "best", "report.json"
# Config keys that do not change the training trajectory: a checkpoint stays valid across them.
# The rank count is one of them: ranks split a fixed global batch, so the trajectory does not depend on it.
_RESUME_INDEPENDENT = ("enabled", "max_minutes", "checkpoint_every", "device", "amp", "early_stop_patience",
                       "nproc_per_node")


class DistillError(ValueError):
    """A distillation set-up that cannot run, phrased for the user."""


class TopK(NamedTuple):
    """The teacher's k largest logits per position ([..., k]) and their token ids."""

    values: torch.Tensor
    indices: torch.Tensor


# ---------------------------------------------------------------------------------------------- loss


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


# ---------------------------------------------------------------------------------------------- eval


@torch.no_grad()
def evaluate(student, teacher, blocks: np.ndarray, batch_size: int = 4, amp_dtype: torch.dtype | None = None,
             rank: Rank | None = None) -> dict[str, float]:
    """Student perplexity, KL(teacher || student) at T = 1 and top-1 agreement, plus the teacher's perplexity.

    Same definitions as compress.torch_eval (perplexity over next-token predictions, KL and agreement
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
        with _autocast(dev, amp_dtype):
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


# ---------------------------------------------------------------------------------------------- report


@dataclass
class DistillReport:
    steps: int  # optimizer steps done (all attempts together)
    seconds: float  # wall time of the stage over all attempts, evals and checkpoints included
    train_seconds: float  # time in optimizer steps alone
    best_step: int  # 0 = the untrained student stayed best
    teacher_perplexity: float
    perplexity_before: float
    perplexity_after: float  # of the best checkpoint, which the student holds on return
    kl_before: float
    kl_after: float
    top1_before: float
    top1_after: float
    stop_reason: str  # steps | time | early_stop
    resumed_from: int  # step the last call started from (0 = fresh)
    device: str
    world_size: int = 1  # processes (torchrun ranks) that trained together in the last call
    history: list[dict] = field(default_factory=list)  # per step: step, T, alpha, kd_loss, ce_loss, loss, lr
    evals: list[dict] = field(default_factory=list)  # per eval: step, perplexity, kl, top1_agreement

    @property
    def seconds_per_step(self) -> float:
        return self.train_seconds / max(self.steps, 1)

    def metrics(self) -> dict[str, float]:
        """Flat numeric summary, for MLflow."""
        return {
            "distill_steps": self.steps,
            "distill_seconds": round(self.seconds, 3),
            "distill_seconds_per_step": round(self.seconds_per_step, 4),
            "distill_best_step": self.best_step,
            "distill_teacher_perplexity": self.teacher_perplexity,
            "distill_perplexity_before": self.perplexity_before,
            "distill_perplexity_after": self.perplexity_after,
            "distill_kl_before": self.kl_before,
            "distill_kl_after": self.kl_after,
            "distill_top1_before": self.top1_before,
            "distill_top1_after": self.top1_after,
            "distill_early_stopped": float(self.stop_reason == "early_stop"),
            "distill_resumed_from": self.resumed_from,
            "distill_world_size": self.world_size,
        }

    def figure(self):
        """Loss curves, the T and alpha schedules and the eval curves, as a matplotlib Figure."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(13, 3.8), layout="constrained")
        ax_loss, ax_sched, ax_eval = fig.subplots(1, 3)
        steps = [h["step"] for h in self.history]
        ax_loss.plot(steps, [h["kd_loss"] for h in self.history], label="KD (T²·KL)", lw=1)
        ax_loss.plot(steps, [h["ce_loss"] for h in self.history], label="CE", lw=1)
        ax_loss.plot(steps, [h["loss"] for h in self.history], "k--", label="loss (α-weighted)", lw=1)
        ax_loss.set(title="training loss", xlabel="step")
        ax_loss.legend()
        ax_sched.plot(steps, [h["T"] for h in self.history], label="T", color="tab:red")
        ax_sched.set(title="schedules", xlabel="step", ylabel="temperature T")
        ax_alpha = ax_sched.twinx()
        ax_alpha.plot(steps, [h["alpha"] for h in self.history], label="α", color="tab:purple", ls="--")
        ax_alpha.set(ylabel="α", ylim=(0, 1.05))
        _legend(ax_sched, ax_alpha, "lower left")
        e_steps = [e["step"] for e in self.evals]
        ax_eval.plot(e_steps, [e["perplexity"] for e in self.evals], "o-", label="student ppl", color="tab:blue")
        ax_eval.axhline(self.teacher_perplexity, color="tab:blue", ls=":", label="teacher ppl")
        ax_eval.set(title="eval", xlabel="step", ylabel="perplexity")
        ax_kl = ax_eval.twinx()
        ax_kl.plot(e_steps, [e["kl"] for e in self.evals], "s-", color="tab:orange", label="KL to teacher")
        ax_kl.set(ylabel="KL (T=1)")
        _legend(ax_eval, ax_kl)
        return fig

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DistillReport":
        return cls(**d)


def _legend(ax, twin, loc: str = "upper right") -> None:
    """One legend for an axis and its twinx."""
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc=loc)


# ---------------------------------------------------------------------------------------------- state


@dataclass
class _State:
    fingerprint: str
    step: int = 0
    seconds: float = 0.0
    train_seconds: float = 0.0
    best_step: int = 0
    best_value: float = math.inf
    bad_evals: int = 0
    before: dict = field(default_factory=dict)
    best_eval: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    stop_reason: str = ""


def _autocast(device: torch.device, amp_dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The training device; under torchrun CUDA rank i trains on GPU i of its node."""
    if name == "cuda" and not torch.cuda.is_available():
        raise DistillError("distill.device is 'cuda' but torch sees no CUDA device; set distill.device to 'auto' or 'cpu'")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def amp_dtype_for(cfg, device: torch.device) -> torch.dtype | None:
    """Autocast dtype: None on CPU or with amp 'off'; 'auto' = bf16 where the GPU has it, else fp16."""
    if device.type != "cuda" or cfg.amp == "off":
        return None
    if cfg.amp == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.amp]


def _fingerprint(student, splits: DataSplits, cfg) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(cfg.model_dump(mode="json", exclude=set(_RESUME_INDEPENDENT)), sort_keys=True).encode())
    h.update(json.dumps([(n, list(p.shape)) for n, p in student.named_parameters()]).encode())
    for arr in (splits.train, splits.eval):
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()[:16]


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


# ---------------------------------------------------------------------------------------------- checkpoints


def _write_dir(final: Path, fill: Callable[[Path], None]) -> None:
    """Write a folder atomically: fill a temporary sibling, then swap it in."""
    tmp = final.with_name(final.name + ".tmp")
    old = final.with_name(final.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _optimizer_tensors(opt, scaler) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"state.{idx}.{k}"] = v.detach().contiguous().cpu()
            else:
                scalars[f"{idx}.{k}"] = v
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    meta = {"param_groups": sd["param_groups"], "scalars": scalars, "scaler": scaler.state_dict() if scaler else None}
    return tensors, meta


def _load_optimizer(opt, scaler, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for key, v in tensors.items():
        if key.startswith("state."):
            _, idx, k = key.split(".", 2)
            state.setdefault(int(idx), {})[k] = v
    for key, v in meta["scalars"].items():
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = v
    groups = meta["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    opt.load_state_dict({"state": state, "param_groups": groups})
    if scaler is not None and meta.get("scaler"):
        scaler.load_state_dict(meta["scaler"])
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])


def _save_last(workdir: Path, student, opt, scaler, state: _State) -> None:
    tensors, meta = _optimizer_tensors(opt, scaler)

    def fill(d: Path) -> None:
        save_model(student, str(d / "student.safetensors"))
        save_file(tensors, str(d / "optimizer.safetensors"))
        (d / "state.json").write_text(json.dumps({"state": asdict(state), "optimizer": meta}))

    _write_dir(workdir / LAST, fill)


def _load_last(workdir: Path, fingerprint: str, student, opt, scaler, may_delete: bool = True) -> _State | None:
    d = workdir / LAST
    if not (d / "state.json").is_file():
        d = workdir / (LAST + ".old")  # a crash between the two renames of _write_dir
        if not (d / "state.json").is_file():
            return None
    saved = json.loads((d / "state.json").read_text())
    state = _State(**saved["state"])
    if state.fingerprint != fingerprint:
        if not may_delete:  # another rank (rank 0) clears the folder
            return None
        log.warning("distill: the checkpoint in %s is for another config, student or data; starting afresh", workdir)
        for name in (LAST, LAST + ".old", BEST, REPORT):
            p = workdir / name
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return None
    load_model(student, str(d / "student.safetensors"))
    _load_optimizer(opt, scaler, load_file(str(d / "optimizer.safetensors")), saved["optimizer"])
    return state


def _save_best(workdir: Path, student, state: _State) -> None:
    from transformers.utils import logging as hf_logging

    def fill(d: Path) -> None:
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # one "Writing model shards" bar per eval is noise
        try:
            student.save_pretrained(d)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        (d / "best.json").write_text(json.dumps({"step": state.best_step, "eval": state.best_eval}))

    _write_dir(workdir / BEST, fill)


def _best_step_on_disk(workdir: Path) -> int | None:
    p = workdir / BEST / "best.json"
    return json.loads(p.read_text())["step"] if p.is_file() else None


def load_best(student, workdir: str | Path) -> None:
    """Load the best checkpoint's weights of ``workdir`` into ``student`` (same architecture)."""
    sd = load_file(str(Path(workdir) / BEST / "model.safetensors"))
    missing, unexpected = student.load_state_dict(sd, strict=False)
    tied = {"lm_head.weight"} if getattr(student.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise DistillError(f"best checkpoint in {workdir} does not fit the student: missing {missing}, unexpected {unexpected}")


# ---------------------------------------------------------------------------------------------- training


def _report(state: _State, resumed_from: int, device: torch.device, world: int) -> DistillReport:
    b, a = state.before, state.best_eval
    return DistillReport(
        steps=state.step, seconds=state.seconds, train_seconds=state.train_seconds, best_step=state.best_step,
        teacher_perplexity=b["teacher_perplexity"], perplexity_before=b["perplexity"], perplexity_after=a["perplexity"],
        kl_before=b["kl"], kl_after=a["kl"], top1_before=b["top1_agreement"], top1_after=a["top1_agreement"],
        stop_reason=state.stop_reason, resumed_from=resumed_from, device=str(device), world_size=world,
        history=list(state.history), evals=list(state.evals),
    )


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


def distill(student, teacher, splits: DataSplits, cfg, workdir: str | Path, masks: dict | None = None,
            on_log: Callable[[int, dict], None] | None = None, progress: bool = True) -> DistillReport:
    """Distil ``teacher`` into ``student`` in place; on return the student holds the best checkpoint.

    cfg: a DistillConfig. masks: {parameter name: bool tensor, True = keep} of unstructured pruning;
    pruned weights are zeroed before training and after every optimizer step (their gradients too).
    on_log(step, metrics) gets, after optimizer step ``step`` (1-based), {T, alpha, kd_loss, ce_loss,
    loss, lr} (the values used in that step, averaged over the global batch), and after each eval
    {eval_perplexity, eval_kl, eval_top1_agreement} (step 0 = before training). A re-run with the
    same workdir resumes from the last checkpoint (weights, optimizer, RNG, step; data order and
    schedules follow from the step), or returns the finished run's report at once. Models are moved
    back to their devices at the end. Inside a torchrun process group every rank calls this with
    the same arguments and the same workdir (see the module docstring); only rank 0 calls on_log.
    """
    workdir = Path(workdir)
    rank = distributed.current()
    per_rank_blocks(cfg, rank.world)
    if rank.main:
        workdir.mkdir(parents=True, exist_ok=True)
    distributed.barrier(rank)
    if len(splits.train) == 0 or len(splits.eval) == 0:
        raise DistillError("distillation needs train and eval blocks; raise data.train_blocks / data.eval_blocks")
    vs, vt = student.config.vocab_size, teacher.config.vocab_size
    if vs != vt:
        raise DistillError(f"student and teacher must share a vocabulary for the KL term (vocab {vs} vs {vt})")
    device = resolve_device(cfg.device, rank.local)
    amp_dtype = amp_dtype_for(cfg, device)
    home_s, home_t = next(student.parameters()).device, next(teacher.parameters()).device
    student.to(device)
    teacher.to(device)
    try:
        return _run(student, teacher, splits, cfg, workdir, masks, on_log, progress, device, amp_dtype, rank)
    finally:
        student.to(home_s)
        teacher.to(home_t)
        student.eval()


def _run(student, teacher, splits, cfg, workdir, masks, on_log, progress, device, amp_dtype, rank: Rank) -> DistillReport:
    from tqdm.auto import tqdm

    emit = on_log if on_log is not None and rank.main else (lambda step, metrics: None)
    pairs = _prepare_masks(student, masks)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scaler = torch.amp.GradScaler("cuda") if amp_dtype == torch.float16 else None
    fingerprint = _fingerprint(student, splits, cfg)
    teacher.eval()

    t_call = time.perf_counter()
    state = _load_last(workdir, fingerprint, student, opt, scaler, may_delete=rank.main)
    distributed.barrier(rank)  # rank 0 may have cleared a foreign checkpoint
    resumed_from = state.step if state else 0
    seconds_at_start = state.seconds if state else 0.0

    def elapsed() -> float:
        return seconds_at_start + time.perf_counter() - t_call

    def save_last() -> None:
        state.seconds = elapsed()
        if rank.main:
            _save_last(workdir, student, opt, scaler, state)
        distributed.barrier(rank)

    def do_eval(step: int) -> None:
        ev = evaluate(student, teacher, splits.eval, cfg.batch_size, amp_dtype, rank)
        if not state.before:
            state.before = ev
        rec = {"step": step, "perplexity": ev["perplexity"], "kl": ev["kl"], "top1_agreement": ev["top1_agreement"]}
        state.evals.append(rec)
        emit(step, {f"eval_{k}": v for k, v in rec.items() if k != "step"})
        value = ev[cfg.monitor]
        if value < state.best_value:
            state.best_value, state.best_step, state.best_eval, state.bad_evals = value, step, ev, 0
            # last before best: a crash between the two leaves a state whose best step is its own step.
            save_last()
            if rank.main:
                _save_best(workdir, student, state)
        else:
            state.bad_evals += 1
        if rank.main:
            log.info("distill step %d: eval perplexity %.3f, KL %.4f, top-1 %.3f%s", step, ev["perplexity"], ev["kl"],
                     ev["top1_agreement"], " (best)" if state.best_step == step else "")

    if state is None:
        torch.manual_seed(cfg.seed)
        _apply_masks(pairs)
        state = _State(fingerprint=fingerprint)
        do_eval(0)
    else:
        if rank.main:
            log.info("distill: resuming from step %d in %s", state.step, workdir)
        if state.stop_reason and (workdir / REPORT).is_file():
            load_best(student, workdir)
            report = DistillReport.from_dict(json.loads((workdir / REPORT).read_text()))
            report.resumed_from = state.step
            return report
        if rank.main and state.best_step == state.step and _best_step_on_disk(workdir) != state.step:
            _save_best(workdir, student, state)

    order = _DataOrder(len(splits.train), cfg.seed)
    cache = TeacherCache(len(splits.train), splits.train.shape[1] - 1, cfg.teacher_topk) if cfg.teacher_topk else None
    if cache is not None and rank.main:
        log.info("distill: teacher top-%d cache of %.1f MB per process", cfg.teacher_topk, cache.nbytes / 2**20)

    def teacher_logits(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), _autocast(device, amp_dtype):
            return teacher(input_ids=x, use_cache=False).logits[:, :-1]

    # DDP averages the ranks' gradients during backward; its constructor also makes every rank
    # start from rank 0's weights.
    model = student
    if rank.distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            student, device_ids=[device.index] if device.type == "cuda" else None)
    mine = per_rank_blocks(cfg, rank.world)
    budget_s = cfg.max_minutes * 60.0
    bar = tqdm(total=cfg.steps, initial=state.step, desc="distill", unit="step", disable=not (progress and rank.main),
               dynamic_ncols=True, mininterval=1.0)
    try:
        while not state.stop_reason:
            if state.step >= cfg.steps:
                state.stop_reason = "steps"
                break
            if distributed.rank0_says(rank, elapsed() >= budget_s, device):
                state.stop_reason = "time"
                break
            i = state.step  # 0-based index of this optimizer step
            T, alpha, lr = temperature_at(i, cfg.steps, cfg), alpha_at(i, cfg.steps, cfg), lr_at(i, cfg.steps, cfg)
            t0 = time.perf_counter()
            model.train()
            sums = {"kd_loss": 0.0, "ce_loss": 0.0, "loss": 0.0}
            chunks = step_chunks(order, i, cfg, rank)
            for c, ids in enumerate(chunks):
                share = mine / len(ids)  # = grad_accum alone: each micro-batch's mean weighs by its size
                x = torch.as_tensor(splits.train[ids], dtype=torch.long, device=device)
                sync = c == len(chunks) - 1 or not rank.distributed
                with (contextlib.nullcontext() if sync else model.no_sync()):
                    with _autocast(device, amp_dtype):
                        s_logits = model(input_ids=x, use_cache=False).logits[:, :-1]
                    t_logits = cache.get(ids, x, teacher_logits) if cache is not None else teacher_logits(x)
                    loss, parts = kd_loss(s_logits, t_logits, x[:, 1:], None, T, alpha)
                    (scaler.scale(loss / share) if scaler else loss / share).backward()
                for k in sums:
                    sums[k] += parts[k] / share
            if rank.distributed:
                sums = dict(zip(sums, distributed.mean(rank, list(sums.values()), device)))
            for p, pruned in pairs:
                if p.grad is not None:
                    p.grad.masked_fill_(pruned, 0.0)
            if scaler:
                scaler.unscale_(opt)
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            for g in opt.param_groups:
                g["lr"] = lr
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            _apply_masks(pairs)
            state.train_seconds += time.perf_counter() - t0
            state.step = step = i + 1

            rec = {"T": T, "alpha": alpha, **sums, "lr": lr}
            state.history.append({"step": step, **rec})
            emit(step, rec)
            bar.update(1)
            bar.set_postfix(loss=f"{sums['loss']:.3f}", T=f"{T:.2f}", alpha=f"{alpha:.2f}", refresh=False)

            if step % cfg.eval_every == 0 or step == cfg.steps:
                do_eval(step)
                if cfg.early_stop_patience and state.bad_evals >= cfg.early_stop_patience:
                    state.stop_reason = "early_stop"
            if step % cfg.checkpoint_every == 0 and state.best_step != step:
                save_last()
    finally:
        bar.close()

    if state.evals[-1]["step"] != state.step:
        do_eval(state.step)  # a time stop between evals: the final weights still compete for best
    save_last()
    report = _report(state, resumed_from, device, rank.world)
    if rank.main:
        (workdir / REPORT).write_text(json.dumps(report.to_dict()))
    distributed.barrier(rank)
    if state.best_step != state.step:
        load_best(student, workdir)
    if rank.main:
        log.info("distill: %d steps in %.0f s (%s); best step %d: perplexity %.3f -> %.3f (teacher %.3f), "
                 "KL %.4f -> %.4f", report.steps, report.seconds, report.stop_reason, report.best_step,
                 report.perplexity_before, report.perplexity_after, report.teacher_perplexity, report.kl_before,
                 report.kl_after)
    return report
