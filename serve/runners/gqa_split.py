"""The ``gqa`` runner's optional split: a step's calls as two halves at once, on a second session with half the
intra-op threads (serve.decode_split_rows).

From ``decode_split_rows`` decode rows on, a decode step runs as two calls, one on this thread and one on a worker
(onnxruntime releases the GIL while it runs, so the halves use both cores); a step's first prompts run as the
shorter and the longer half, cut where the two calls' work is even (``balanced_cut``). On 2 cores (one thread
each) that beat one call on two threads by 5-16 % in wall time and 10-25 % in CPU time at 32-64 rows
(benchmarks/history.md, run 10): the ~300 small ops of a step no longer hand work between threads. The second
session is a second copy of the weights, so it is made only on the CPU EP with two threads or more, for graphs
small enough to hold twice, and when max_batch_size reaches decode_split_rows.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from serve.runners.onnx_session import CPU, artifact_session

log = logging.getLogger(__name__)

# The split decode's second session is a second copy of the weights: worth 5-16 % tokens/s for SmolLM2 (0.2 GB), not
# 8.6 GB more for a 7B. Qwen2.5-Coder-1.5B's 4-bit graph (1.29 GiB) gained 6 % at 8 users and 3 % at 32 for 1.5 GiB
# more RSS (1.8x llama.cpp's Q4_K_M server against 1.07x without; benchmarks/results/sweep_qwen_coder_1.5b_int4_anchor.json):
# a 4-bit graph is chosen for its memory, so from 1 GiB of weights the server holds one copy.
SPLIT_MAX_WEIGHT_BYTES = 2**30


def balanced_cut(lens: Sequence[int], head_share: float) -> int:
    """Where to cut ``lens`` (ascending prompt lengths, at least two) into two calls that run at once, so that the
    longer of the two ends first: a call costs its rows x (its padded length + its kept logits positions x
    ``head_share``, the lm_head's multiply-adds per position over the rest of the model's). Cut at n // 2, one
    long prompt padded half the wave to its length and widened that call's logits to its span: 32 chat prompts,
    one of them 8x longer, took 9.6 s against 1.5 s (benchmarks/history.md run 15)."""
    n = len(lens)

    def work(lo: int, hi: int) -> float:
        longest = lens[hi - 1]
        return (hi - lo) * (longest + (longest - lens[lo] + 1) * head_share)

    return min(range(1, n), key=lambda k: (max(work(0, k), work(k, n)), abs(n - 2 * k)))


class SplitDecode:
    """The half-threads session and the worker that runs the second half; ``rows_from`` 0 when off."""

    def __init__(self, artifact: tuple, provider: str, *, intra_op_threads: int, rows_from: int, weights: int,
                 max_slots: int, hidden: bool = False):
        self.hidden = hidden  # the second session outputs the hidden state too, as the main one
        threads = intra_op_threads or len(os.sched_getaffinity(0))
        self.half_threads = max(1, threads // 2)
        self.rows_from = int(rows_from) if provider == CPU and threads >= 2 else 0
        if self.rows_from and weights > SPLIT_MAX_WEIGHT_BYTES:
            log.info("decode split off: its second session would hold a second copy of the graph's %.2f GiB of "
                     "weights (split only up to %.0f GiB)", weights / 2**30, SPLIT_MAX_WEIGHT_BYTES / 2**30)
            self.rows_from = 0
        self._artifact = artifact
        self.session = None
        self._exec: ThreadPoolExecutor | None = None
        self.steps = 0  # decode steps run as two halves
        self.prompt_calls = 0  # first-prompt batches run as two halves
        if self.rows_from and max_slots >= self.rows_from:
            self.open()  # at start-up, not in the middle of serving (a session load is a pause of its own)

    def open(self):
        """The half-threads session (made once)."""
        if self.session is None:
            self.session = artifact_session(*self._artifact, [CPU], self.half_threads, hidden=self.hidden,
                                            spinning="off" if self.half_threads == 1 else "during_runs")
            self._exec = ThreadPoolExecutor(1, thread_name_prefix="decode-half")
        return self.session

    def decodes(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` rows runs as two halves."""
        return bool(self.rows_from) and rows >= self.rows_from

    def prompts(self, n: int) -> bool:
        """Whether ``n`` first prompts of a step run as two halves."""
        return self.session is not None and n >= 4

    def submit(self, session, binding):
        """Run ``binding`` on the worker thread; the future's result() waits for it."""
        return self._exec.submit(session.run_with_iobinding, binding)
