"""Run the model's threads at a lower CPU priority than the HTTP event loop.

On a machine with few cores the model's threads (the engine's step loop and onnxruntime's intra-op pool)
would otherwise take the cores in equal shares with the event loop, so during a burst a 429 or /health waits
for a time slice behind model work. With the model threads ``serve.model_thread_nice`` steps nicer, the
kernel hands a core to the loop as soon as it has work, and the model gets everything the loop leaves:
throughput does not change when the loop is idle (docs/serving.md, "The event loop under bursts").

Linux sets nice values per thread (``setpriority`` on a thread id) and a new thread inherits its creator's,
so onnxruntime's pool, made inside the session's constructor, is lowered by building the session in a
lowered thread (``call_in_lowered_thread``). Raising a nice value needs no privilege; it cannot be undone
without one, which is why the session is built in a thread of its own. Elsewhere this does nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_NICE = 19


def supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "setpriority")


def thread_nice() -> int:
    """This thread's nice value (0 where per-thread priorities are not supported)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if supported() else 0


def lower_this_thread(by: int) -> int:
    """Make the calling thread ``by`` steps nicer (capped at 19); returns its nice value after."""
    if by <= 0 or not supported():
        return thread_nice()
    tid = threading.get_native_id()
    target = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + by)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError as e:  # a seccomp'd container, say: serve anyway, at the same priority
        log.warning("could not lower the model thread's priority (%s); serve.model_thread_nice has no effect", e)
    return thread_nice()


def call_in_lowered_thread(fn: Callable[[], T], by: int, name: str = "model-init") -> T:
    """``fn()`` in a new thread made ``by`` steps nicer first, so the threads it starts inherit that."""
    if by <= 0 or not supported():
        return fn()
    box: dict[str, object] = {}

    def run() -> None:
        lower_this_thread(by)
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
