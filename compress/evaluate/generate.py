"""Greedy answers to many prompts at once, on the serving engine (serve/engine/engine.py) in this process.

The pipeline's generation (the chat set's teacher and candidate answers, golden's continuations) used to run one
prompt at a time through a driver's batch-1 loop: 33 s a prompt for a 1B on 2 cores. Here every prompt is a
request to the engine the server runs (continuous batching, the same runner, sampler and KV rows), stepped by
hand: the prompts go in as batched calls and all rows decode together. The tokens are the batch-1 loop's
(``LanguageModelDriver.greedy``): tests/test_architectures.py holds the two equal on every tiny family.

The engine is sized for the work, not for a deployment: K/V for every row at once within ``kv_budget_mb`` (rows
beyond it wait for a free one), no prefix cache (a cached prefix would change which call computes a position, not
the answer, but this way the work is the same on every run), no second session for split decode steps (a second
copy of the weights: a 7B's fp32 graph twice), the calling thread at its own priority.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

log = logging.getLogger(__name__)

# K/V the evaluation's engine may hold for its rows (pool and rows together); more prompts than fit wait for a row.
KV_BUDGET_MB = 1024
MAX_ROWS = 64


@dataclass
class Generated:
    """The answers, in the order of the prompts (the stop token included where the model stopped), and the rate."""

    answers: list[list[int]]
    seconds: float
    rows: int  # requests decoding together at most
    # with logprobs: each answer's NLL (minus the sum of its tokens' log-probs, from the logits they were picked from)
    nll: list[float] | None = None

    @property
    def tokens(self) -> int:
        return sum(len(a) for a in self.answers)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.inf


def engine_config(manifest: dict, prompts: Sequence[Sequence[int]], max_new_tokens: int, threads: int | None = None,
                  kv_budget_mb: int = KV_BUDGET_MB):
    """A ServeConfig whose K/V holds as many of the prompts' rows at once as ``kv_budget_mb`` allows."""
    from serve.config import ServeConfig
    from serve.kv.budget import ROW_COPIES, KVCacheSpec
    from serve.runners.onnx_session import CPU

    bpt = KVCacheSpec.from_manifest(manifest).exact_bytes_per_token
    longest = max(len(p) for p in prompts) + max_new_tokens
    block = 16
    per_row = -(-longest // block) * block + block  # a row's blocks, rounded up, and one to spare
    # The block pool and the layout's dense rows (the gqa rows, or twice that for the standard layout's past and
    # present) each hold every running row: the budget splits 1 : copies (serve/kv/budget.py).
    copies = ROW_COPIES.get(manifest.get("attention_layout", "standard"), 1)
    rows = max(1, min(MAX_ROWS, len(prompts), int(kv_budget_mb * 2**20 // ((1 + copies) * per_row * bpt))))
    mb = max(1, math.ceil((1 + copies) * rows * per_row * bpt / 2**20) + 1)
    # the context this work needs, which the budget holds (a longer one would only be logged as lowered)
    context = min(longest, int(manifest.get("max_positions") or longest))
    return ServeConfig(providers=[CPU], max_batch_size=rows, kv_memory_mb=mb, kv_block_size=block,
                       kv_rows_share=copies / (1 + copies), enable_prefix_caching=False, decode_split_rows=0,
                       model_thread_nice=0,
                       intra_op_threads=threads or 0, verify_artifact=False, result_cache_size=0,
                       max_waiting=max(len(prompts), 1), max_wait_s=1e9, max_model_len=max(2, context))


@contextmanager
def evaluation_engine(artifact_dir: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      threads: int | None = None, kv_budget_mb: int = KV_BUDGET_MB) -> Iterator:
    """An engine (manual mode) sized for these prompts; shut down on exit. Its runner's session also serves
    ``scoring_driver``: generate and score with one copy of the weights. Keep no reference past the block (the
    engine frees its model when the last one goes)."""
    from serve.artifact import read_manifest
    from serve.engine.engine import Engine

    manifest = read_manifest(artifact_dir, verify=False)
    engine = Engine(artifact_dir, engine_config(manifest, prompts, max_new_tokens, threads, kv_budget_mb), start=False)
    try:
        yield engine
    finally:
        engine.shutdown()


def scoring_driver(engine):
    """A LanguageModelDriver over the engine's own session (compress/drivers/), for scoring with the loaded weights."""
    from compress.drivers import lm_for_session

    return lm_for_session(engine.runner.session, engine.manifest, engine.artifact_dir)


def greedy_answers(artifact_dir: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   *, suppress_ids: Sequence[int] = (), threads: int | None = None, progress: bool = True,
                   desc: str = "greedy answers", kv_budget_mb: int = KV_BUDGET_MB,
                   check: Callable[[str], None] | None = None, stop_at_eos: bool = True,
                   logprobs: bool = False) -> Generated:
    """generate_on a new evaluation_engine of ``artifact_dir``, gone (its weights freed) when this returns."""
    if not prompts:
        return Generated([], 0.0, 0)
    with evaluation_engine(artifact_dir, prompts, max_new_tokens, threads, kv_budget_mb) as engine:
        return generate_on(engine, prompts, max_new_tokens, suppress_ids=suppress_ids, progress=progress, desc=desc,
                           check=check, stop_at_eos=stop_at_eos, logprobs=logprobs)


def generate_on(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, suppress_ids: Sequence[int] = (),
                progress: bool = True, desc: str = "greedy answers", check: Callable[[str], None] | None = None,
                stop_at_eos: bool = True, logprobs: bool = False) -> Generated:
    """Each prompt's greedy continuation of at most ``max_new_tokens`` (ending at the model's EOS, which is kept,
    unless ``stop_at_eos`` is false), all prompts as requests to ``engine``, stepped here. ``suppress_ids`` are
    never picked and EOS is no stop (golden holds EOS off to compare a fixed number of tokens): every answer then
    has ``max_new_tokens``, as the driver's ``greedy(..., suppress_ids=...)`` gives them. ``check(doing)`` runs
    before every engine step (a budget's: it may raise to stop). ``logprobs``: each answer's NLL too, from the
    logits each token was picked from (what the model's own prefill of prompt + answer gives, to float32 rounding),
    so the answers need no second pass to be scored by the model that wrote them."""
    from serve.engine.sampling import SamplingParams

    if not prompts:
        return Generated([], 0.0, 0)
    suppress = sorted({int(t) for t in suppress_ids})
    # min_tokens masks the stop ids until the last token; with ignore_eos they are the suppressed ids alone
    params = SamplingParams.greedy(max_new_tokens, min_tokens=max_new_tokens if suppress else 0,
                                   stop_token_ids=suppress, ignore_eos=bool(suppress) or not stop_at_eos,
                                   logprobs=0 if logprobs else None)
    t0 = time.perf_counter()
    handles = [engine.add_request(list(p), params) for p in prompts]
    done = 0
    with tqdm(total=len(handles), desc=desc, unit="prompt", disable=not progress) as bar:
        while engine.has_work():
            if check is not None:
                check(f"{desc}: {done} of {len(handles)} prompts done")
            engine.step()
            now = sum(h.finished for h in handles)
            if now > done:
                bar.update(now - done)
                done = now
                bar.set_postfix_str(f"{sum(len(h.output_ids) for h in handles) / (time.perf_counter() - t0):.0f} tok/s")
    outs = [h.result() for h in handles]
    bad = [o for o in outs if o.finish_reason not in ("stop", "length")]
    if bad:
        raise RuntimeError(f"{engine.artifact_dir}: generation failed for {len(bad)} of {len(outs)} prompts: "
                           f"{bad[0].error}")
    gen = Generated([list(o.output_ids) for o in outs], time.perf_counter() - t0, engine.config.max_batch_size,
                    [-sum(lp for lp, _ in o.logprobs) for o in outs] if logprobs else None)
    log.info("%s: %d prompts, %d tokens in %.1f s (%.1f tok/s, up to %d rows at once)", desc, len(prompts),
             gen.tokens, gen.seconds, gen.tokens_per_s, gen.rows)
    return gen
