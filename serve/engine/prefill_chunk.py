"""How many prompt tokens one step computes on this machine and graph, measured when the engine starts.

A prompt's rows cost arithmetic, not weight reads: past a few dozen rows each more row costs about the same
(Qwen2.5-Coder-1.5B's 4-bit form here: 10.6 ms a token at 32 rows, 10.3 at 64, 10.6 at 512). A larger chunk then
gains no speed and makes every waiting user wait for all of it: eight users' short prompts in one call all get their
first token when the last prompt is done. So the engine times one prompt call at doubling sizes and stops where
doubling saves less than ``gain`` of a token's cost; the prompts after a step's oldest one then share only that chunk
(serve/engine/scheduler.py), so they finish one after another, first come first served. docs/serving.md, "Prefill".
"""

from __future__ import annotations

import logging
import time

from serve.runners.protocol import RunRow

log = logging.getLogger(__name__)


class _Scratch:
    """The measurement's sequence, as the engine's block manager names sequences (its on_free hook reads these)."""

    request_id = "prefill-chunk"
    epoch = 0


def measure_prefill_chunk(runner, block_manager, most: int, *, first: int = 16, gain: float = 0.04,
                          reps: int = 2) -> tuple[int, dict[int, float]]:
    """The chunk (prompt tokens a step) and the seconds a token measured at each size tried. ``most`` when the
    pool has no room for the measurement or a call fails (then the token budget alone bounds a step)."""
    scratch = _Scratch()
    key = (scratch.request_id, scratch.epoch)  # the runner's name for its rows
    per_token: dict[int, float] = {}
    if most <= first:
        return most, per_token
    block_manager.start(scratch)
    try:
        if not block_manager.allocate(scratch, most):
            return most, per_token
        table = block_manager.block_table(scratch)
        ids = [1 + i % 97 for i in range(most)]  # any tokens: the cost of a row does not depend on its id
        runner.execute([RunRow(key, table, 0, ids[:first])])  # warm-up: first-call allocations
        n = first
        while n <= most:
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                runner.execute([RunRow(key, table, 0, ids[:n])])
                best = min(best, time.perf_counter() - t0)
            per_token[n] = best / n
            if n > first and per_token[n] > (1 - gain) * per_token[n // 2]:
                chunk = n // 2
                break
            n *= 2
        else:
            chunk = most
    except Exception:  # noqa: BLE001 - without the costs the token budget alone bounds a step
        log.exception("timing prompt chunks failed; a step's prompt tokens are bounded by the token budget alone")
        return most, per_token
    finally:
        block_manager.free(scratch)  # its on_free hook releases the runner's row
        runner.trim(0)  # nothing runs yet: the rows' memory goes back until the first request
    log.info("prompt chunk %d tokens a step (a token costs %s ms at %s rows)", chunk,
             ", ".join(f"{v * 1e3:.2f}" for v in per_token.values()), ", ".join(str(k) for k in per_token))
    return chunk, per_token
