"""The serving engine: a background step loop over scheduler → runner → sampler → streams.

    engine = Engine("artifacts/run/fp32", ServeConfig())
    handle = engine.add_request(prompt_ids, SamplingParams(max_tokens=32, temperature=0.7, seed=1))
    async for ev in handle:          # or: for ev in handle (blocking)
        print(ev.token_id, ev.text, ev.finish_reason)
    engine.generate(prompt_ids, SamplingParams.greedy(16))  # -> list[int], blocking helper

Threading: one engine thread runs the steps. ``add_request`` and ``cancel`` may be called
from any thread (the HTTP server's event loop); they take the engine lock, which the
step holds only while scheduling and while post-processing a step, never while the
model runs. A cancel is applied at once when the engine is between steps, otherwise
as soon as the running step ends; either way the request's blocks go back to the pool
before the next step is scheduled. ``Engine(..., start=False)`` runs no thread: call
``step()`` yourself (deterministic, used by tests); ``generate`` then drives the steps.

Token events: every generated token yields one ``TokenEvent`` (its id, the text it adds,
and on the last one the ``finish_reason``: ``stop`` (eos, stop id or stop string),
``length`` (max_tokens), ``cancelled`` or ``error``). Text that might be the start of a
stop string is held back until it is known not to be; the text never includes the stop
string itself. The stop token's id is reported (and counted) but adds no text.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from serve.artifact import read_manifest
from serve.config import ServeConfig
from serve.kv_cache import BlockManager, KVCacheSpec, num_blocks_for_budget
from serve.runner import Runner, RunRow
from serve.sampling import SamplingParams, find_stop, sample_token
from serve.scheduler import AdmissionError, Scheduler, SchedulerOutput, SequenceState
from serve.tokenizer import IncrementalDetokenizer, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class TokenEvent:
    request_id: str
    token_id: int | None  # None on a final event that carries no token (cancelled, error)
    text: str  # text delta
    index: int  # number of output tokens so far, this one included
    finish_reason: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None
    ttft_s: float | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0


class RequestHandle:
    """What ``add_request`` returns: iterate it (sync or async) for token events; cancel it.

    Leaving an ``async for`` over the handle before the last event (a disconnected client,
    a cancelled task, a ``break``) cancels the request, so its blocks go back at once.
    """

    def __init__(self, engine: Engine, request_id: str, prompt_ids: list[int], params: SamplingParams):
        self._engine = engine
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.output_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.ttft_s: float | None = None
        self.num_cached_prompt_tokens = 0
        self.num_preemptions = 0
        self._q: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self._done = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aevent: asyncio.Event | None = None

    # called by the engine thread
    def _push(self, ev: TokenEvent) -> None:
        if ev.token_id is not None:
            self.output_ids.append(ev.token_id)
        self.text += ev.text
        if ev.finish_reason is not None:
            self.finish_reason = ev.finish_reason
            self.error = ev.error
        self._q.put(ev)
        if ev.finish_reason is not None:
            self._done.set()
        loop, aev = self._loop, self._aevent
        if loop is not None and aev is not None:
            try:
                loop.call_soon_threadsafe(aev.set)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                pass

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        self._engine.cancel(self.request_id)

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            if not self._engine.running and self._q.empty():
                self._engine._drive_until(self._done)
            ev = self._q.get()
            yield ev
            if ev.finished:
                return

    async def _aiter(self) -> AsyncIterator[TokenEvent]:
        if self._aevent is None:
            self._aevent = asyncio.Event()
            self._loop = asyncio.get_running_loop()
        aev = self._aevent
        try:
            while True:
                try:
                    ev = self._q.get_nowait()
                except queue.Empty:
                    aev.clear()
                    try:
                        ev = self._q.get_nowait()  # re-check: a push may have landed before clear()
                    except queue.Empty:
                        await aev.wait()
                        continue
                yield ev
                if ev.finished:
                    return
        finally:
            # The consumer went away (client disconnected, task cancelled, loop broken): free the blocks.
            if not self._done.is_set():
                self.cancel()

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._aiter()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request finishes; the whole output."""
        if not self._engine.running:
            self._engine._drive_until(self._done)
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self._output()

    async def aresult(self) -> RequestOutput:
        async for _ in self:
            pass
        return self._output()

    def _output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt_ids, list(self.output_ids), self.text, self.finish_reason,
                             self.error, self.ttft_s, self.num_cached_prompt_tokens, self.num_preemptions)


@dataclass
class EngineStats:
    """A snapshot for /metrics (serve/metrics.py turns these into Prometheus gauges, counters, histograms)."""

    provider: str
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_usage_pct: float
    kv_usage_peak_pct: float  # highest kv_usage_pct since the engine started
    block_size: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache (counter)
    prefix_hits: int  # of those, tokens found cached (counter)
    preemptions: int  # counter
    steps: int  # counter
    batch_fill_ratio: float  # mean over steps of sequences per step / max_batch_size
    token_fill_ratio: float  # mean over steps of tokens per step / max_num_batched_tokens
    requests_added: int
    requests_finished: int  # any reason
    finish_reasons: dict[str, int]
    requests_rejected: int
    prompt_tokens: int  # counter: prompt tokens of finished requests
    generated_tokens: int  # counter
    computed_tokens: int  # counter: tokens run through the model (prefill chunks + decodes)
    ttft_s: list[float] = field(default_factory=list, repr=False)  # recent samples (window)
    itl_s: list[float] = field(default_factory=list, repr=False)  # recent samples (window)


class InFlightRequest:
    """Engine-side state of one request from admission to finish: its scheduler sequence, the caller's
    handle, its sampler's generator and the detokenizer that turns its tokens into streamed text."""

    __slots__ = ("seq", "handle", "rng", "detok", "stop_ids", "emitted", "first_token_t", "last_token_t",
                 "max_stop_len")

    def __init__(self, seq: SequenceState, handle: RequestHandle, detok: IncrementalDetokenizer,
                 stop_ids: frozenset[int]):
        self.seq = seq
        self.handle = handle
        self.rng = seq.params.make_generator()
        self.detok = detok
        self.stop_ids = stop_ids
        self.emitted = 0  # characters of detok.text already sent
        self.first_token_t: float | None = None
        self.last_token_t: float | None = None
        self.max_stop_len = max((len(s) for s in seq.params.stop), default=0)


class Engine:
    def __init__(self, artifact_dir: str | Path, config: ServeConfig | None = None, *, start: bool = True):
        self.config = config = config or ServeConfig()
        self.artifact_dir = Path(artifact_dir)
        self.manifest = read_manifest(self.artifact_dir, verify=config.verify_artifact)
        self.tokenizer = load_tokenizer(self.artifact_dir)
        spec = KVCacheSpec.from_manifest(self.manifest)
        bs = config.block_size
        num_blocks = config.num_blocks or num_blocks_for_budget(config.kv_memory_mb * 2**20, spec, bs)
        max_pos = int(self.manifest.get("max_positions") or 2048)
        self.max_model_len = min(config.max_model_len or max_pos, max_pos)
        self.eos_ids = frozenset(int(i) for i in self.manifest.get("eos_token_ids") or [])
        self.block_manager = BlockManager(num_blocks, bs, enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, max_num_batched_tokens=config.max_num_batched_tokens,
            max_batch_size=config.max_batch_size, max_waiting=config.max_waiting, max_wait_s=config.max_wait_s,
            max_model_len=self.max_model_len, policy=config.scheduling_policy)
        layout = self.manifest.get("attention_layout", "standard")
        if layout in ("gqa", "paged"):  # docs/gqa.md
            from serve.runner_gqa import GqaRunner  # in-place GroupQueryAttention rows
            from serve.runner_paged import PagedRunner  # PagedAttention over the pool (CUDA only, unverified)

            cls = GqaRunner if layout == "gqa" else PagedRunner
            self.runner = cls(self.artifact_dir, self.manifest, num_blocks, bs, providers=config.providers,
                              intra_op_threads=config.intra_op_threads, max_batch_size=config.max_batch_size,
                              max_model_len=self.max_model_len)
        else:
            self.runner = Runner(self.artifact_dir, self.manifest, num_blocks, bs, providers=config.providers,
                                 intra_op_threads=config.intra_op_threads)
        log.info("KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB (%d bytes/token); context %d; provider %s",
                 num_blocks, bs, num_blocks * bs, num_blocks * spec.bytes_per_block(bs) / 2**20,
                 spec.bytes_per_token, self.max_model_len, self.runner.provider)

        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._step_lock = threading.Lock()  # one step at a time, whoever drives it
        self._reqs: dict[str, InFlightRequest] = {}
        self._aborts: set[str] = set()
        self._executing = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        # stats
        win = config.latency_window
        self._ttft: deque[float] = deque(maxlen=win)
        self._itl: deque[float] = deque(maxlen=win)
        # since the last pop_latency_samples(); bounded in case nobody pops
        self._new_ttft: deque[float] = deque(maxlen=65536)
        self._new_itl: deque[float] = deque(maxlen=65536)
        self._steps = 0
        self._rows_sum = 0
        self._tokens_sum = 0
        self._added = 0
        self._rejected = 0
        self._finished: dict[str, int] = {}
        self._prompt_tokens = 0
        self._generated = 0
        if start:
            self.start()

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; unfinished requests end with finish_reason 'cancelled'."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._lock:
            events = [self._finish(r, "cancelled") for r in list(self._reqs.values())]
        self._emit(events)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- requests --------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> RequestHandle:
        """Queue a request. Raises SamplingError (bad params), RequestTooLargeError, QueueFullError."""
        params = (params or SamplingParams()).validate()
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        vocab = self.runner.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise AdmissionError(f"prompt token ids must be in [0, {vocab})")
        rid = request_id or f"req-{next(self._ids)}"
        handle = RequestHandle(self, rid, prompt_ids, params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        with self._cv:
            if rid in self._reqs:
                raise ValueError(f"request id {rid!r} is already in use")
            seq = SequenceState(rid, prompt_ids, params, arrival=time.monotonic())
            try:
                self.scheduler.add(seq)
            except Exception:
                self._rejected += 1
                raise
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
            self._reqs[rid] = InFlightRequest(seq, handle, detok, stop_ids)
            self._added += 1
            self._cv.notify_all()
        return handle

    def generate(self, prompt_ids: str | Sequence[int], params: SamplingParams | None = None,
                 timeout: float | None = None) -> list[int]:
        """Blocking helper: the generated token ids (greedy, 16 tokens when params is None)."""
        h = self.add_request(prompt_ids, params or SamplingParams.greedy(16))
        out = h.result(timeout)
        if out.finish_reason == "error":
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        return out.output_ids

    def cancel(self, request_id: str) -> None:
        """Cancel a request; its blocks return to the pool before the next step (at once if idle)."""
        events = []
        with self._cv:
            if request_id not in self._reqs:
                return
            if self._executing:
                self._aborts.add(request_id)
            else:
                events.append(self._finish(self._reqs[request_id], "cancelled"))
            self._cv.notify_all()
        self._emit(events)

    # ---- the step --------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborts)

    def step(self) -> int:
        """Schedule, run and sample one step. Returns how many sequences ran."""
        with self._step_lock:
            return self._step()

    def _step(self) -> int:
        events: list[tuple[RequestHandle, TokenEvent]] = []
        with self._lock:
            events += self._apply_aborts()
            out = self.scheduler.schedule()
            if not out.empty:
                self._executing = True
        if out.empty:
            self._emit(events)
            return 0
        try:
            rows = [RunRow((r.seq.request_id, r.seq.epoch), self.block_manager.block_table(r.seq), r.start,
                           r.token_ids, r.samples) for r in out.scheduled]
            logits = self.runner.execute(rows)
            error = None
        except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
            log.exception("engine step failed")
            logits, error = None, f"{type(e).__name__}: {e}"
        with self._lock:
            self._executing = False
            if error is None:
                try:
                    self._process(out, logits, events)
                except Exception as e:  # noqa: BLE001 - e.g. a sampler failure: fail this step's requests
                    log.exception("post-processing a step failed")
                    error = f"{type(e).__name__}: {e}"
            if error is not None:
                for r in out.scheduled:
                    req = self._reqs.get(r.seq.request_id)
                    if req is not None:
                        events.append(self._finish(req, "error", error))
            events += self._apply_aborts()
            self._steps += 1
            self._rows_sum += len(out.scheduled)
            self._tokens_sum += out.num_tokens
        self._emit(events)
        return len(out.scheduled)

    def run_until_done(self, max_steps: int | None = None) -> int:
        """Step until no request is left (manual mode). Returns the number of steps."""
        n = 0
        while self.has_work() and (max_steps is None or n < max_steps):
            if self.step() == 0 and self.scheduler.has_work():
                raise RuntimeError("requests are waiting but none could be scheduled (scheduler bug)")
            n += 1
        return n

    def _drive_until(self, done: threading.Event) -> None:
        """Manual mode: step until ``done`` is set (called by a handle's blocking consumers)."""
        while not done.is_set() and not self.running:
            if not self.has_work():
                break
            self.step()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self.has_work():
                    self._cv.wait()
                if self._stop:
                    return
            try:
                n = self.step()
            except Exception:  # noqa: BLE001 - keep serving
                log.exception("engine loop error")
                n = 0
            if n == 0:
                # Work exists but nothing could be scheduled (should be rare): do not spin.
                with self._cv:
                    if not self._stop:
                        self._cv.wait(0.005)

    # ---- internals (called with the lock held) ---------------------------------------------
    def _apply_aborts(self) -> list:
        events = []
        for rid in list(self._aborts):
            req = self._reqs.get(rid)
            if req is not None:
                events.append(self._finish(req, "cancelled"))
        self._aborts.clear()
        return events

    def _finish(self, req: InFlightRequest, reason: str, error: str | None = None, token_id: int | None = None,
                text: str = "") -> tuple[RequestHandle, TokenEvent]:
        seq = req.seq
        self.scheduler.finish(seq, reason)
        self._reqs.pop(seq.request_id, None)
        self._aborts.discard(seq.request_id)
        self._finished[reason] = self._finished.get(reason, 0) + 1
        self._prompt_tokens += seq.prompt_len
        req.handle.num_preemptions = seq.num_preemptions
        ev = TokenEvent(seq.request_id, token_id, text, seq.num_output, reason, error)
        return req.handle, ev

    def _process(self, out: SchedulerOutput, logits: list[np.ndarray | None], events: list) -> None:
        now = time.monotonic()
        for row, lg in zip(out.scheduled, logits):
            seq = row.seq
            self.scheduler.commit(row)
            if not row.samples:
                continue
            req = self._reqs[seq.request_id]
            if seq.request_id in self._aborts:
                continue  # cancelled while running: do not sample, _apply_aborts finishes it
            tok = sample_token(lg, seq.params, req.rng, seq.token_ids)
            seq.token_ids.append(tok)
            self._generated += 1
            if req.first_token_t is None:
                req.first_token_t = now
                ttft = now - seq.arrival
                req.handle.ttft_s = ttft
                req.handle.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
                self._ttft.append(ttft)
                self._new_ttft.append(ttft)
            else:
                itl = now - req.last_token_t
                self._itl.append(itl)
                self._new_itl.append(itl)
            req.last_token_t = now
            reason = None
            detok = req.detok
            stop_at = -1
            if tok in req.stop_ids:
                reason = "stop"
            else:
                before = len(detok.text)
                detok.add(tok)
                if seq.params.stop:
                    stop_at = find_stop(detok.text, seq.params.stop, before)
                    if stop_at != -1:
                        reason = "stop"
            if reason is None and (seq.num_output >= seq.params.max_tokens or len(seq.token_ids) >= self.max_model_len):
                reason = "length"
            if reason is not None and stop_at == -1:
                before = len(detok.text)
                detok.flush()
                if seq.params.stop:
                    stop_at = find_stop(detok.text, seq.params.stop, before)
            text = detok.text
            if stop_at != -1:
                end = stop_at
            elif reason is None and req.max_stop_len > 1:
                end = max(req.emitted, len(text) - (req.max_stop_len - 1))  # hold back a possible stop start
            else:
                end = len(text)
            delta = text[req.emitted:end]
            req.emitted = max(req.emitted, end)
            if reason is not None:
                events.append(self._finish(req, reason, token_id=tok, text=delta))
            else:
                events.append((req.handle, TokenEvent(seq.request_id, tok, delta, seq.num_output)))

    @staticmethod
    def _emit(events) -> None:
        for handle, ev in events:
            handle._push(ev)

    # ---- stats -----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        with self._lock:
            bm = self.block_manager
            steps = max(self._steps, 1)
            return EngineStats(
                provider=self.runner.provider,
                num_running=self.scheduler.num_running,
                num_waiting=self.scheduler.num_waiting,
                kv_blocks_total=bm.num_blocks,
                kv_blocks_used=bm.num_used,
                kv_blocks_free=bm.num_free,
                kv_blocks_cached=bm.num_cached,
                kv_usage_pct=100.0 * bm.usage,
                kv_usage_peak_pct=100.0 * bm.peak_usage,
                block_size=bm.block_size,
                prefix_queries=bm.prefix_queries,
                prefix_hits=bm.prefix_hits,
                preemptions=self.scheduler.num_preemptions,
                steps=self._steps,
                batch_fill_ratio=self._rows_sum / (steps * self.scheduler.max_batch_size),
                token_fill_ratio=self._tokens_sum / (steps * self.scheduler.max_num_batched_tokens),
                requests_added=self._added,
                requests_finished=sum(self._finished.values()),
                finish_reasons=dict(self._finished),
                requests_rejected=self._rejected,
                prompt_tokens=self._prompt_tokens,
                generated_tokens=self._generated,
                computed_tokens=self._tokens_sum,
                ttft_s=list(self._ttft),
                itl_s=list(self._itl),
            )

    def pop_latency_samples(self) -> tuple[list[float], list[float]]:
        """TTFT and inter-token latency samples recorded since the last call (for histograms)."""
        with self._lock:
            ttft, itl = list(self._new_ttft), list(self._new_itl)
            self._new_ttft.clear()
            self._new_itl.clear()
            return ttft, itl
