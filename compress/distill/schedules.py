"""Per-optimizer-step schedules for distillation: temperature T, loss weight alpha, learning rate.

Every schedule is a pure function of the 0-based optimizer step ``i`` (the step about to be
taken) and the planned total ``N`` (``DistillConfig.steps``), so a resumed run recomputes exactly
the value an uninterrupted run would have used; there is no scheduler state to save.

With progress ``p = min(max(i, 0), N - 1) / (N - 1)`` (``p = 0`` when ``N == 1``), from ``start``
to ``end``:

- ``constant``: ``v = start`` (``end`` is ignored)
- ``linear``:   ``v = start + (end - start) * p``
- ``cosine``:   ``v = end + (start - end) * (1 + cos(pi * p)) / 2``
- ``step``:     a staircase of equal rises held ``every`` steps each: stage ``k = i // every``,
  last stage ``K = (N - 1) // every``, ``v = start + (end - start) * min(k, K) / K``
  (``v = start`` when ``K == 0``).

Linear, cosine and step reach ``start`` at ``i = 0`` and ``end`` exactly at ``i = N - 1``.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine", "step")


def progress(step: int, total_steps: int) -> float:
    """Fraction of the schedule done at 0-based ``step``: 0 at the first step, 1 at the last."""
    if total_steps <= 1:
        return 0.0
    return min(max(step, 0), total_steps - 1) / (total_steps - 1)


def schedule_value(kind: str, start: float, end: float, step: int, total_steps: int, every: int = 1) -> float:
    """Value of a ``kind`` schedule from ``start`` to ``end`` at 0-based ``step`` of ``total_steps``."""
    if kind == "constant":
        return float(start)
    if kind == "linear":
        return start + (end - start) * progress(step, total_steps)
    if kind == "cosine":
        return end + (start - end) * (1.0 + math.cos(math.pi * progress(step, total_steps))) / 2.0
    if kind == "step":
        if every < 1:
            raise ValueError(f"step schedule: every must be >= 1 (got {every})")
        last_stage = max(total_steps - 1, 0) // every
        if last_stage == 0:
            return float(start)
        stage = min(max(step, 0) // every, last_stage)
        return start + (end - start) * stage / last_stage
    raise ValueError(f"unknown schedule {kind!r}; expected one of {SCHEDULES}")


def temperature_at(step: int, total_steps: int, cfg) -> float:
    """T for 0-based optimizer ``step``; cfg: a DistillConfig (t_start, t_end, t_schedule, t_step_every)."""
    return schedule_value(cfg.t_schedule, cfg.t_start, cfg.t_end, step, total_steps, cfg.t_step_every)


def alpha_at(step: int, total_steps: int, cfg) -> float:
    """KD weight alpha for 0-based ``step``; the step schedule shares ``t_step_every`` with T."""
    return schedule_value(cfg.alpha_schedule, cfg.alpha_start, cfg.alpha_end, step, total_steps, cfg.t_step_every)


def lr_at(step: int, total_steps: int, cfg) -> float:
    """Learning rate for 0-based ``step``.

    ``lr * w * d`` with warm-up ``w = min(1, (step + 1) / warmup_steps)`` (1 without warm-up) and
    decay ``d`` = the ``lr_schedule`` from 1 to ``lr_end_ratio`` over the steps after warm-up.
    """
    warm = cfg.warmup_steps
    w = min(1.0, (step + 1) / warm) if warm > 0 else 1.0
    d = schedule_value(cfg.lr_schedule, 1.0, cfg.lr_end_ratio, step - warm, total_steps - warm)
    return cfg.lr * w * d
