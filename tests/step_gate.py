"""Helpers that make the serving tests independent of how fast the machine is.

A 480-token request on the tiny model takes well under a second on a quiet machine and several on a
loaded one, so no test may count on a request being still running (or already finished) "by now".
Instead a test holds the engine's steps, so the request is provably still running for as long as it
needs, and waits for the event it is about (the server calling ``cancel``) instead of sleeping.

Both helpers patch one engine *instance* for the length of a ``with`` block (its runner's ``execute``
and its ``cancel``); nothing in serve/ knows about them. Imported by the test modules as
``from step_gate import ...`` (pytest puts tests/ on sys.path: the folder has no __init__.py).
"""

from __future__ import annotations

import contextlib
import threading
import time

# Only matters when a test forgets to release a hold or a cancel never comes: then the step goes on
# (or the wait fails) instead of the test hanging until pytest-timeout.
SAFETY_S = 60.0


class StepHold:
    """What ``held_steps`` yields: ``release()`` lets the held step (and all later ones) run;
    ``wait_held()`` blocks until a step is waiting at the gate, i.e. the engine has scheduled the
    request(s) and cannot produce another token until released."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.waiting = threading.Event()
        self.steps = 0  # steps that reached the runner while the hold was installed

    def release(self) -> None:
        self.gate.set()

    def wait_held(self, timeout: float = SAFETY_S) -> None:
        if not self.waiting.wait(timeout):
            raise AssertionError(f"no engine step reached the held gate within {timeout:.0f} s")


@contextlib.contextmanager
def held_steps(eng, after: int = 0, until_shutdown: bool = False):
    """The engine's steps past the first ``after`` wait (inside ``runner.execute``, so with the
    request scheduled and its blocks held) until the block is left or ``release()`` is called.

    ``until_shutdown``: the held step also goes on once ``eng.shutdown()`` has begun (its stop flag is
    set), so the step loop exits right after it and unfinished requests end ``cancelled``; for a test
    whose release is the engine being shut down.
    """
    hold, execute = StepHold(), eng.runner.execute

    def held(rows):
        hold.steps += 1
        if hold.steps > after:
            hold.waiting.set()
            deadline = time.monotonic() + SAFETY_S
            while not hold.gate.wait(0.01):
                if until_shutdown and eng._stop or time.monotonic() > deadline:
                    break
        return execute(rows)

    eng.runner.execute = held
    try:
        yield hold
    finally:
        hold.release()
        eng.runner.execute = execute


class SeenCancels:
    """The request ids ``Engine.cancel`` was called with while ``seen_cancels`` was installed."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self._cv = threading.Condition()

    def _add(self, request_id: str) -> None:
        with self._cv:
            self.ids.append(request_id)
            self._cv.notify_all()

    def wait(self, n: int = 1, timeout: float = SAFETY_S) -> list[str]:
        """Until ``cancel`` has been called for ``n`` distinct requests."""
        with self._cv:
            if not self._cv.wait_for(lambda: len(set(self.ids)) >= n, timeout):
                raise AssertionError(f"the server cancelled {len(set(self.ids))} request(s), not {n}, "
                                     f"within {timeout:.0f} s")
            return list(dict.fromkeys(self.ids))


@contextlib.contextmanager
def seen_cancels(eng):
    """Records every ``eng.cancel(request_id)`` (a handle's ``cancel()`` and the HTTP layer's disconnect
    handling both go through it): a test waits for the server to have noticed a client going away
    before it lets the engine go on, instead of racing the request to its end."""
    seen, cancel = SeenCancels(), eng.cancel

    def recording(request_id: str) -> None:
        cancel(request_id)
        seen._add(request_id)

    eng.cancel = recording
    try:
        yield seen
    finally:
        del eng.cancel  # back to the class's method
