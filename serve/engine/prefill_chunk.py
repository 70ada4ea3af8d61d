"""How many prompt tokens one step computes on this machine and graph, measured when the engine starts.

A prompt's rows cost arithmetic, not weight reads: past a few dozen rows each more row costs about the same
(Qwen2.5-Coder-1.5B's 4-bit form here: 10.6 ms a token at 32 rows, 10.3 at 64, 10.6 at 512). A larger chunk then
gains no speed and makes every waiting user wait for all of it: eight users' short prompts in one call all get their
first token when the last prompt is done. A small model's call, though, has a fixed cost that several prompts in one
call share. So the engine times a step of 1, 2, 4, ... chat-sized prompts as the runner runs them (one call, or two
halves at once) and stops where doubling saves less than ``gain`` of a token's cost: 32 tokens on Qwen2.5-Coder-1.5B,
256-512 on the demo's SmolLM2 champion. The prompts after a step's oldest one then join only whole, within that chunk
(serve/engine/scheduler.py), so they finish one after another, first come first served. docs/serving.md, "Prefill".
"""

from __future__ import annotations

import logging
import time

from serve.kv.cache import ScratchSequence
from serve.runners.protocol import RunRow

log = logging.getLogger(__name__)


def measure_prefill_chunk(runner, block_manager, most: int, *, prompt: int = 32, gain: float = 0.04,
                          reps: int = 2, max_prompts: int = 64) -> tuple[int, dict[int, float]]:
    """The chunk (prompt tokens a step) and the seconds a token measured at each size tried: 1, 2, 4, ... prompts
    of ``prompt`` tokens in one step, as the runner runs them (several first prompts as one call, or two halves at
    once where it splits them), until doubling saves under ``gain`` of a token's cost. ``most`` when the pool has
    no room for the measurement or a call fails (then the token budget alone bounds a step)."""
    per_token: dict[int, float] = {}
    if most <= prompt:
        return most, per_token
    count = max(1, min(most // prompt, max_prompts))
    seqs = [ScratchSequence(f"prefill-chunk-{i}") for i in range(count)]
    started = []
    chunk = most
    try:
        for q in seqs:
            block_manager.start(q)
            started.append(q)
            if not block_manager.allocate(q, prompt):
                return most, per_token
        ids = [1 + i % 97 for i in range(prompt)]  # any tokens: the cost of a row does not depend on its id
        rows = [RunRow((q.request_id, q.epoch), block_manager.block_table(q), 0, ids) for q in seqs]
        runner.execute(rows[:1])  # warm-up: first-call allocations
        k = 1
        while k <= count:
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                runner.execute(rows[:k])
                best = min(best, time.perf_counter() - t0)
            per_token[k * prompt] = best / (k * prompt)
            if k > 1 and per_token[k * prompt] > (1 - gain) * per_token[k // 2 * prompt]:
                chunk = k // 2 * prompt
                break
            k *= 2
    except Exception:  # noqa: BLE001 - without the costs the token budget alone bounds a step
        log.exception("timing prompt chunks failed; a step's prompt tokens are bounded by the token budget alone")
        return most, per_token
    finally:
        for q in started:
            block_manager.free(q)  # its on_free hook releases the runner's row
        runner.trim(0)  # nothing runs yet: the rows' memory goes back until the first request
    log.info("prompt chunk %d tokens a step (a token costs %s ms at %s prompts of %d tokens)", chunk,
             ", ".join(f"{v * 1e3:.2f}" for v in per_token.values()),
             ", ".join(str(n // prompt) for n in per_token), prompt)
    return chunk, per_token
