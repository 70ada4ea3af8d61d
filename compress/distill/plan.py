"""A distillation budget in tokens, planned before it runs: the steps it is, the time they take on this device.

``distill.tokens`` is what KD results are quoted in (recovery per token). Before training, the stage times a few
probe steps at learning rate 0 (the weights do not move; the first step warms up, and compiles under
distill.compile), takes the step-0 eval's and checkpoint's measured seconds, and adds them up for the whole run.
A budget that cannot finish within ``distill.max_minutes`` is refused with the figures and the ways out.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

PROBE_STEPS = 3  # timed probe steps, after one untimed warm-up step


def tokens_per_step(cfg, positions: int) -> int:
    """Training tokens (scored positions) per optimizer step: batch_size x grad_accum blocks of ``positions``."""
    return cfg.batch_size * cfg.grad_accum * positions


def with_token_budget(cfg, positions: int):
    """cfg with ``steps`` derived from ``tokens`` (rounded up to whole steps); cfg itself without a token budget."""
    if cfg.tokens is None:
        return cfg
    return cfg.model_copy(update={"steps": max(1, math.ceil(cfg.tokens / tokens_per_step(cfg, positions)))})


@dataclass
class Plan:
    """The measured pieces of a run and what they add up to."""

    tokens: int
    steps: int  # optimizer steps still to run
    tokens_per_step: int
    seconds_per_step: float  # mean of the timed probe steps
    warmup_seconds: float  # the first probe step beyond a normal step (compilation, first-touch allocation)
    evals: int  # evals still to run
    eval_seconds: float  # the step-0 eval, measured
    checkpoints: int  # checkpoint writes still to come (every checkpoint_every steps, and one per eval's new best)
    checkpoint_seconds: float  # the step-0 checkpoint, measured
    spent_seconds: float  # the stage's clock when the plan was made (load, step-0 eval, probe)
    device: str

    @property
    def estimate_seconds(self) -> float:
        return (self.spent_seconds + self.steps * self.seconds_per_step + self.evals * self.eval_seconds
                + self.checkpoints * self.checkpoint_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / max(self.seconds_per_step, 1e-9)

    def to_dict(self) -> dict:
        return {**asdict(self), "estimate_seconds": round(self.estimate_seconds, 1),
                "tokens_per_second": round(self.tokens_per_second, 1)}

    def summary(self) -> str:
        return (f"{self.tokens:,} tokens = {self.steps} steps of {self.tokens_per_step:,} tokens at "
                f"{self.seconds_per_step:.2f} s each on {self.device} ({self.tokens_per_second:,.0f} tokens/s), "
                f"{self.evals} evals of {self.eval_seconds:.1f} s, {self.checkpoints} checkpoints of "
                f"{self.checkpoint_seconds:.1f} s, {self.spent_seconds:.0f} s spent setting up: about "
                f"{self.estimate_seconds / 60:.1f} min")


def make_plan(cfg, *, positions: int, done_steps: int, seconds_per_step: float, warmup_seconds: float,
              eval_seconds: float, checkpoint_seconds: float, spent_seconds: float, device: str) -> Plan:
    """The plan for the steps after ``done_steps`` of ``cfg.steps`` (a DistillConfig with its token budget
    resolved)."""
    left = max(cfg.steps - done_steps, 0)
    evals = left // cfg.eval_every + (0 if cfg.steps % cfg.eval_every == 0 else 1)
    return Plan(tokens=cfg.tokens or cfg.steps * tokens_per_step(cfg, positions), steps=left,
                tokens_per_step=tokens_per_step(cfg, positions), seconds_per_step=seconds_per_step,
                warmup_seconds=warmup_seconds, evals=evals, eval_seconds=eval_seconds,
                checkpoints=left // cfg.checkpoint_every + evals, checkpoint_seconds=checkpoint_seconds,
                spent_seconds=spent_seconds, device=device)


def refusal(plan: Plan, cfg) -> str | None:
    """The message that refuses a budget the device cannot finish within distill.max_minutes, or None."""
    budget = cfg.max_minutes * 60.0
    if plan.estimate_seconds <= budget:
        return None
    fixed = plan.estimate_seconds - plan.steps * plan.seconds_per_step
    fits = max(int((budget - fixed) / plan.seconds_per_step), 0) * plan.tokens_per_step
    return (f"distill.tokens: {plan.summary()}, over distill.max_minutes = {cfg.max_minutes:g}. Train on a GPU "
            f"(distill.device: cuda), lower distill.tokens to about {fits:,}, or raise distill.max_minutes to "
            f"{math.ceil(plan.estimate_seconds / 60 * 1.1)}")
