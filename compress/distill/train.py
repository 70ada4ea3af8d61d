"""Knowledge distillation: the (pruned) student learns from the teacher under a temperature schedule.

The loss and the eval are in compress/distill/loss.py, checkpoints in compress/distill/checkpoint.py,
the returned report in compress/distill/report.py, one optimizer step in compress/distill/optimizer_step.py and the
device, autocast and compile choices in compress/distill/device_setup.py; this module is the training loop.

T and alpha follow the schedules of compress/distill/schedules.py, one value per optimizer step. The
training loop (:func:`distill`) runs on CPU or CUDA (autocast bf16/fp16 there), accumulates
gradients, stops at ``steps`` or ``max_minutes``, evaluates perplexity and KL-to-teacher every
``eval_every`` steps, keeps the best checkpoint, stops early, re-applies pruning masks after every
optimizer step and resumes from the last checkpoint in its work folder. Plain functions: the
caller (the Prefect task) does the MLflow logging through ``on_log``.

Several GPUs: started by torchrun (compress/distill/launch.py), each process calls :func:`distill`
inside an initialised process group; the student is wrapped in DistributedDataParallel, the teacher
is replicated, and every optimizer step's global batch (``batch_size * grad_accum`` blocks, in the
seeded order) is split evenly across the ranks. The gradient DDP averages is then the gradient of
the whole global batch, so N ranks follow the single-process trajectory (up to float summation
order) and a checkpoint resumes on any number of ranks. Evals are sharded and summed; rank 0 alone
writes checkpoints, the report and the ``on_log`` stream.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path
from typing import Callable

import torch

from compress.corpus.splits import DataSplits
from compress.distill import distributed
from compress.distill.checkpoint import (REPORT, TrainState, best_step_on_disk, load_best, load_last, run_fingerprint,
                                         save_best, save_last)
from compress.distill.device_setup import _resolve_compile, _training_attention, amp_dtype_for, resolve_device
from compress.distill.distributed import Rank
from compress.distill.fused import KDBody, TeacherRows, split_head
from compress.distill.loss import TeacherCache, TeacherOut, autocast, evaluate
from compress.distill.optimizer_step import _apply_masks, _DataOrder, _prepare_masks, per_rank_blocks, train_step
from compress.distill.plan import PROBE_STEPS, Plan, make_plan, refusal, with_token_budget
from compress.distill.report import DistillError, DistillReport

# Importers read these here (compress/resolve/auto.py, tests/test_distill_ddp.py).
from compress.distill.device_setup import COMPILE_MIN_TOKENS  # noqa: F401
from compress.distill.optimizer_step import step_chunks  # noqa: F401

log = logging.getLogger(__name__)


def _layer_map(student, teacher, cfg, teacher_layers: list[int] | None) -> list[int] | None:
    """The teacher layer of each student layer for the hidden-state loss; None when the loss is off."""
    if cfg.hidden_weight <= 0:
        return None
    hs, ht = student.config.hidden_size, teacher.config.hidden_size
    if hs != ht:
        raise DistillError(f"distill.hidden_weight needs the student's hidden size to be the teacher's ({hs} vs {ht}); "
                           f"set distill.hidden_weight: 0")
    ns, nt = student.config.num_hidden_layers, teacher.config.num_hidden_layers
    if teacher_layers is None:
        if ns != nt:
            raise DistillError(
                f"distill.hidden_weight compares each student layer with the teacher layer it was cut from, but the "
                f"student has {ns} layers and the teacher {nt} and no layer map was given; pass the prune stage's "
                f"kept layers (teacher_layers) or set distill.hidden_weight: 0")
        return list(range(ns))
    if len(teacher_layers) != ns or not all(0 <= t < nt for t in teacher_layers):
        raise DistillError(f"teacher_layers {teacher_layers} must name one of the teacher's {nt} layers for each of "
                           f"the student's {ns}")
    return list(teacher_layers)


def _report(state: TrainState, resumed_from: int, device: torch.device, world: int) -> DistillReport:
    b, a = state.before, state.best_eval
    return DistillReport(
        steps=state.step, seconds=state.seconds, train_seconds=state.train_seconds, best_step=state.best_step,
        teacher_perplexity=b["teacher_perplexity"], perplexity_before=b["perplexity"], perplexity_after=a["perplexity"],
        kl_before=b["kl"], kl_after=a["kl"], top1_before=b["top1_agreement"], top1_after=a["top1_agreement"],
        stop_reason=state.stop_reason, resumed_from=resumed_from, device=str(device), world_size=world,
        history=list(state.history), evals=list(state.evals), plan=dict(state.plan),
    )

def distill(student, teacher, splits: DataSplits, cfg, workdir: str | Path, *, masks: dict | None = None,
            on_log: Callable[[int, dict], None] | None = None, progress: bool = True,
            teacher_layers: list[int] | None = None) -> DistillReport:
    """Distil ``teacher`` into ``student`` in place; on return the student holds the best checkpoint.

    cfg: a DistillConfig. masks: {parameter name: bool tensor, True = keep} of unstructured pruning;
    pruned weights are zeroed before training and after every optimizer step (their gradients too).
    teacher_layers: the teacher layer each student layer was cut from, for cfg.hidden_weight > 0
    (None = the identity; required when the prune stage dropped layers). on_log(step, metrics)
    gets, after optimizer step ``step`` (1-based), {T, alpha, kd_loss, ce_loss, hidden_loss, loss,
    lr} (the values used in that step, averaged over the global batch), and after each eval
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
    if len(splits.train) == 0 or len(splits.selection) == 0:
        raise DistillError("distillation needs train and selection blocks; raise data.train_blocks / data.selection_blocks")
    vs, vt = student.config.vocab_size, teacher.config.vocab_size
    if vs != vt:
        raise DistillError(f"student and teacher must share a vocabulary for the KL term (vocab {vs} vs {vt})")
    teacher_layers = _layer_map(student, teacher, cfg, teacher_layers)
    cfg = with_token_budget(cfg, splits.train.shape[1] - 1)
    device = resolve_device(cfg.device, rank.local)
    amp_dtype = amp_dtype_for(cfg, device)
    home_s, home_t = next(student.parameters()).device, next(teacher.parameters()).device
    student.to(device)
    teacher.to(device)
    try:
        trainer = Trainer(student, teacher, splits, cfg, workdir, masks=masks, on_log=on_log, device=device,
                          amp_dtype=amp_dtype, rank=rank, teacher_layers=teacher_layers)
        return trainer.run(progress)
    finally:
        student.to(home_s)
        teacher.to(home_t)
        student.eval()


class Trainer:
    """One distillation run with its state in the open: the models, the optimizer, the data order, the teacher's
    cache and the TrainState that checkpoints carry. ``run`` resumes or starts, steps until a stop reason, and
    returns the report; see distill()."""

    def __init__(self, student, teacher, splits: DataSplits, cfg, workdir: Path, *, masks: dict | None,
                 on_log: Callable[[int, dict], None] | None, device: torch.device, amp_dtype: torch.dtype | None,
                 rank: Rank, teacher_layers: list[int] | None):
        self.student, self.teacher, self.splits, self.cfg, self.workdir = student, teacher, splits, cfg, workdir
        self.device, self.amp_dtype, self.rank, self.teacher_layers = device, amp_dtype, rank, teacher_layers
        self.emit = on_log if on_log is not None and rank.main else (lambda step, metrics: None)
        self.pairs = _prepare_masks(student, masks)
        # fused: one kernel over all parameters instead of a dozen passes each (0.43 -> 0.08 s a step on SmolLM2)
        self.opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=cfg.lr,
                                     weight_decay=cfg.weight_decay, fused=device.type in ("cpu", "cuda"))
        self.scaler = torch.amp.GradScaler("cuda") if amp_dtype == torch.float16 else None
        self.fingerprint = run_fingerprint(student, splits, cfg)
        teacher.eval()
        # The teacher as it runs: on a bf16 CPU a bf16 copy, since autocast would cast every weight again on every
        # forward (a third of the teacher's time on SmolLM2); it costs half the teacher's fp32 bytes.
        self.teacher_run = copy.deepcopy(teacher).to(amp_dtype) \
            if device.type == "cpu" and amp_dtype is not None else teacher
        self.student_cut, self.teacher_cut = self._cuts()
        self.compiled = _resolve_compile(cfg, device, self.student_cut, rank, splits.train.shape[1] - 1)
        self.t_call = time.perf_counter()
        self.state: TrainState | None = None
        self.resumed_from = 0
        self.seconds_at_start = 0.0
        self.cache: TeacherCache | None = None  # the teacher's top-k per train block (distill.teacher_topk)
        self.model = self.head = self.order = None  # set by prepare
        self.eval_seconds = self.checkpoint_seconds = 0.0  # the last eval's and checkpoint's, for the plan

    def _cuts(self) -> tuple[KDBody | None, KDBody | None]:
        """Student and teacher cut before their heads for the fused loss (distill.fused_loss), where both allow it."""
        if not self.cfg.fused_loss:
            return None, None
        probe = torch.as_tensor(self.splits.train[:1, :16], dtype=torch.long, device=self.device)
        student = split_head(self.student, probe)
        if student is None:
            return None, None
        # checked on the fp32 teacher: a bf16 copy's logits differ from its own matmul by bf16 rounding
        return student, (KDBody(self.teacher_run) if split_head(self.teacher, probe) is not None else None)

    def elapsed(self) -> float:
        return self.seconds_at_start + time.perf_counter() - self.t_call

    def checkpoint(self) -> None:
        t0 = time.perf_counter()
        self.state.seconds = self.elapsed()
        if self.rank.main:
            save_last(self.workdir, self.student, self.opt, self.scaler, self.state)
        distributed.barrier(self.rank)
        self.checkpoint_seconds = time.perf_counter() - t0

    def evaluate(self, step: int) -> None:
        """Eval after optimizer step ``step``: logged, and a new best is checkpointed (last, then best)."""
        state, cfg = self.state, self.cfg
        t0 = time.perf_counter()
        ev = evaluate(self.student, self.teacher_run, self.splits.selection, cfg.batch_size, self.amp_dtype, self.rank)
        self.eval_seconds = time.perf_counter() - t0
        if not state.before:
            state.before = ev
        rec = {"step": step, "perplexity": ev["perplexity"], "kl": ev["kl"], "top1_agreement": ev["top1_agreement"]}
        state.evals.append(rec)
        self.emit(step, {f"eval_{k}": v for k, v in rec.items() if k != "step"})
        value = ev[cfg.monitor]
        if value < state.best_value:
            state.best_value, state.best_step, state.best_eval, state.bad_evals = value, step, ev, 0
            # last before best: a crash between the two leaves a state whose best step is its own step.
            self.checkpoint()
            if self.rank.main:
                save_best(self.workdir, self.student, state)
        else:
            state.bad_evals += 1
        if self.rank.main:
            log.info("distill step %d: eval perplexity %.3f, KL %.4f, top-1 %.3f%s", step, ev["perplexity"], ev["kl"],
                     ev["top1_agreement"], " (best)" if state.best_step == step else "")

    def resume(self) -> DistillReport | None:
        """Load the last checkpoint or start afresh (eval of step 0); the finished run's report if it had ended."""
        rank, workdir = self.rank, self.workdir
        state = load_last(workdir, self.fingerprint, self.student, self.opt, self.scaler, may_delete=rank.main)
        distributed.barrier(rank)  # rank 0 may have cleared a foreign checkpoint
        self.resumed_from = state.step if state else 0
        self.seconds_at_start = state.seconds if state else 0.0
        if state is None:
            torch.manual_seed(self.cfg.seed)
            _apply_masks(self.pairs)
            self.state = TrainState(fingerprint=self.fingerprint)
            self.evaluate(0)
            return None
        self.state = state
        if rank.main:
            log.info("distill: resuming from step %d in %s", state.step, workdir)
        if state.stop_reason and (workdir / REPORT).is_file():
            load_best(self.student, workdir)
            report = DistillReport.from_dict(json.loads((workdir / REPORT).read_text()))
            report.resumed_from = state.step
            return report
        if rank.main and state.best_step == state.step and best_step_on_disk(workdir) != state.step:
            save_best(workdir, self.student, state)
        return None

    def _teacher_logits(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), autocast(self.device, self.amp_dtype):
            return self.teacher_run(input_ids=x, use_cache=False).logits[:, :-1]

    def teacher_for(self, ids: list[int], x: torch.Tensor) -> TeacherOut:
        """The teacher's view of train blocks ``ids`` (= ``x``): logits (or its cached top-k, or its last hidden
        states and head for the fused loss), hidden states when the hidden loss is on."""
        with_hidden = self.cfg.hidden_weight > 0  # the config refuses a top-k cache then: the teacher runs every step
        if self.teacher_cut is not None and self.cache is None:
            with torch.no_grad(), autocast(self.device, self.amp_dtype):
                last, hidden = self.teacher_cut(x, with_hidden)
            return TeacherOut(TeacherRows(hidden=last[:, :-1].reshape(-1, last.shape[-1]),
                                          weight=self.teacher_cut.weight.detach()), hidden)
        if with_hidden:
            with torch.no_grad(), autocast(self.device, self.amp_dtype):
                out = self.teacher_run(input_ids=x, use_cache=False, output_hidden_states=True)
            return TeacherOut(out.logits[:, :-1], out.hidden_states)
        cache = self.cache
        return TeacherOut(cache.get(ids, x, self._teacher_logits) if cache is not None else self._teacher_logits(x),
                          None)

    def prepare(self) -> None:
        """What the steps run on: the data order, the teacher's top-k cache, the model as trained (the student or its
        body for the fused loss; compiled; in DDP)."""
        cfg, rank, splits = self.cfg, self.rank, self.splits
        self.order = _DataOrder(len(splits.train), cfg.seed)
        self.cache = TeacherCache(len(splits.train), splits.train.shape[1] - 1, cfg.teacher_topk) \
            if cfg.teacher_topk else None
        if self.cache is not None and rank.main:
            log.info("distill: teacher top-%d cache of %.1f MB per process", cfg.teacher_topk, self.cache.nbytes / 2**20)
        model = self.student if self.student_cut is None else self.student_cut
        if self.compiled:
            model = torch.compile(model)
            if self.teacher_cut is not None:
                self.teacher_cut = torch.compile(self.teacher_cut)
        # DDP averages the ranks' gradients during backward; its constructor also makes every rank
        # start from rank 0's weights.
        if rank.distributed:
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.model = model
        self.head = self.student_cut.weight if self.student_cut is not None else None

    def step(self, i: int, probe: bool = False) -> dict[str, float]:
        """Optimizer step ``i`` (0-based); a probe runs it at learning rate 0."""
        return train_step(i, model=self.model, teacher_for=self.teacher_for, train=self.splits.train, order=self.order,
                          opt=self.opt, scaler=self.scaler, pairs=self.pairs, cfg=self.cfg, rank=self.rank,
                          device=self.device, amp_dtype=self.amp_dtype, teacher_layers=self.teacher_layers,
                          head=self.head, compile_loss=self.compiled, lr_scale=0.0 if probe else 1.0)

    def plan(self) -> Plan:
        """Times PROBE_STEPS steps after a warm-up step, all at learning rate 0 on a fresh optimizer (the weights do
        not move; the optimizer's moments and the RNG are put back as they were), and plans the rest of the run."""
        rng = torch.get_rng_state()
        times = []
        for i in range(PROBE_STEPS + 1):
            t0 = time.perf_counter()
            self.step(i, probe=True)
            times.append(time.perf_counter() - t0)
        self.opt.state.clear()
        if self.scaler is not None:
            self.scaler = torch.amp.GradScaler("cuda")
        torch.set_rng_state(rng)
        per_step = sum(times[1:]) / PROBE_STEPS

        def planned(eval_seconds: float) -> Plan:
            return make_plan(self.cfg, positions=self.splits.train.shape[1] - 1, done_steps=self.state.step,
                             seconds_per_step=per_step, warmup_seconds=max(times[0] - per_step, 0.0),
                             eval_seconds=eval_seconds, checkpoint_seconds=self.checkpoint_seconds,
                             spent_seconds=self.elapsed(), device=str(self.device))

        plan = planned(self.eval_seconds)
        if plan.evals >= 2:
            # The step-0 eval ran cold (first forwards at these shapes, 53 s against 15 s warm for 32 blocks of
            # SmolLM2 in bf16 on 2 cores): one more, warm and unlogged, is what each later eval costs.
            t0 = time.perf_counter()
            evaluate(self.student, self.teacher_run, self.splits.selection, self.cfg.batch_size, self.amp_dtype, self.rank)
            plan = planned(time.perf_counter() - t0)
        self.state.plan = plan.to_dict()
        if self.rank.main:
            log.info("distill plan: %s", plan.summary())
        return plan

    def train(self, progress: bool) -> None:
        """Optimizer steps, evals and checkpoints until a stop reason (steps, time, early stop)."""
        from tqdm.auto import tqdm

        state, cfg, rank = self.state, self.cfg, self.rank
        bar = tqdm(total=cfg.steps, initial=state.step, desc="distill", unit="step",
                   disable=not (progress and rank.main), dynamic_ncols=True, mininterval=1.0)
        try:
            while not self._stopping():
                i = state.step  # 0-based index of this optimizer step
                t0 = time.perf_counter()
                rec = self.step(i)
                state.train_seconds += time.perf_counter() - t0
                state.step = step = i + 1
                state.history.append({"step": step, **rec})
                self.emit(step, rec)
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", T=f"{rec['T']:.2f}", alpha=f"{rec['alpha']:.2f}",
                                refresh=False)
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    self.evaluate(step)
                    if cfg.early_stop_patience and state.bad_evals >= cfg.early_stop_patience:
                        state.stop_reason = "early_stop"
                if step % cfg.checkpoint_every == 0 and state.best_step != step:
                    self.checkpoint()
        finally:
            bar.close()

    def _stopping(self) -> bool:
        """Whether the run ends before the next step; sets the state's stop reason (steps or time)."""
        state = self.state
        if state.stop_reason:
            return True
        if state.step >= self.cfg.steps:
            state.stop_reason = "steps"
        elif distributed.rank0_says(self.rank, self.elapsed() >= self.cfg.max_minutes * 60.0, self.device):
            state.stop_reason = "time"
        return bool(state.stop_reason)

    def finish(self) -> DistillReport:
        """The final eval and checkpoint, the report (written by rank 0), the best weights loaded."""
        state, rank, workdir = self.state, self.rank, self.workdir
        if state.evals[-1]["step"] != state.step:
            self.evaluate(state.step)  # a time stop between evals: the final weights still compete for best
        self.checkpoint()
        report = _report(state, self.resumed_from, self.device, rank.world)
        if rank.main:
            (workdir / REPORT).write_text(json.dumps(report.to_dict()))
        distributed.barrier(rank)
        if state.best_step != state.step:
            load_best(self.student, workdir)
        if rank.main:
            log.info("distill: %d steps in %.0f s (%s); best step %d: perplexity %.3f -> %.3f (teacher %.3f), "
                     "KL %.4f -> %.4f", report.steps, report.seconds, report.stop_reason, report.best_step,
                     report.perplexity_before, report.perplexity_after, report.teacher_perplexity, report.kl_before,
                     report.kl_after)
        return report

    def run(self, progress: bool = True) -> DistillReport:
        with _training_attention(self.device, self.splits.train.shape[1], self.student, self.teacher_run):
            done = self.resume()
            if done is not None:
                return done
            self.prepare()
            if self.cfg.tokens is not None and self.state.step == 0:
                # a budget in tokens is a promise: refused up front when this device cannot keep it
                why = refusal(self.plan(), self.cfg)
                if distributed.rank0_says(self.rank, why is not None, self.device):
                    raise DistillError(why or "distill.tokens: rank 0's plan does not fit distill.max_minutes")
            self.train(progress)
            return self.finish()
