"""A wall-clock budget for an evaluation stage: each part is timed, and once the budget is spent the next check
stops the stage with a message that says what it was doing, how long it took and which setting to change.

    budget = Budget(cfg.accept.max_minutes, "accept.max_minutes")
    with budget.part("chat"):
        ... budget.check("teacher chat answers: 30 of 48 prompts")  # inside long loops
    budget.seconds  # {"chat": 41.2, ...}
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class BudgetExceeded(ValueError):
    pass


class Budget:
    def __init__(self, minutes: float | None = None, setting: str = "accept.max_minutes"):
        self.minutes = minutes
        self.setting = setting
        self.start = time.monotonic()
        self.seconds: dict[str, float] = {}
        self._part: str | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def check(self, doing: str = "") -> None:
        """Raise BudgetExceeded once the budget is spent."""
        if self.minutes is None or self.elapsed() <= 60 * self.minutes:
            return
        done = ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items()) or "nothing finished"
        where = doing or self._part or "between parts"
        raise BudgetExceeded(
            f"{self.setting}={self.minutes:g} spent after {self.elapsed() / 60:.1f} min, while {where} ({done}). "
            f"Raise {self.setting} (or null for no budget), or make the work smaller: fewer accept.chat_sets prompts "
            f"or accept.chat_max_new_tokens, fewer data.test_blocks")

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time a part under ``name`` (added up when it repeats); the budget is checked as it starts."""
        self._part = name
        self.check(f"starting {name}")
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - t0
            self._part = None
