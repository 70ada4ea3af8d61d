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

Speculative decoding (``serve.speculative``, serve/engine/drafter.py): after scheduling, a lone decode row may
get drafted tokens (prompt lookup, or a draft model, run outside the lock); the runner computes them with the
decode token in one forward, ``_process_drafted`` keeps the drafts that the acceptance rule accepts
(serve/engine/speculative.py) and the scheduler gives back the rejected positions' blocks (``commit_drafted``).

Constrained decoding (``SamplingParams.structured``, serve/engine/grammar.py): a request's grammar is compiled (or
copied from the compiled cache) when it is added; at each step its rows' logits are masked to the tokens the grammar
allows before sampling (a drafted row position by position), each kept token advances the grammar, and a grammar
that is complete ends the request with ``stop``. Log-probs stay the raw model's. Unconstrained rows do no grammar work.

One job: run the steps (schedule, run the model, sample, stream) and own the requests'
lifecycle. The parts it drives live beside it: serve/engine/request_handle.py (what the caller
iterates), serve/engine/in_flight.py (one request's state and the text each token adds),
serve/engine/request_outputs.py (what a step's chosen tokens do to the requests: streamed, finished) and
serve/engine/stats.py (counters and the /metrics snapshot).

Invariants (``check_invariants``): an in-flight request is keyed by its own id, its sequence
is waiting or running (never finished) and its handle has had no final event; the block
pool's, each request's and the counters' own invariants hold.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from serve.artifact import read_manifest, refuse_record
from serve.config import ServeConfig
from serve.engine.heap import release_free_memory
from serve.engine.in_flight import InFlightRequest
from serve.engine.drafter import make_drafter
from serve.engine.grammar import GrammarCompiler
from serve.engine.request_handle import RequestHandle, RequestOutput, TokenEvent
from serve.engine.prefill_chunk import measure_prefill_chunk
from serve.engine.request_outputs import RequestOutputs
from serve.engine.runner_factory import make_runner
from serve.engine.sampling import SamplingError, SamplingParams, sample_token
from serve.engine.scheduler import AdmissionError, Scheduler, SchedulerOutput, SeqStatus, SequenceState
from serve.engine.speculative import accept_drafts
from serve.engine.stats import EngineCounters, EngineStats, FinishedRequestSample
from serve.engine.thread_priority import lower_this_thread
from serve.engine.tokenizer import IncrementalDetokenizer, encode_prompt, load_tokenizer
from serve.kv.budget import KVCacheSpec, context_length, kv_layout
from serve.kv.cache import BlockManager
from serve.runners.protocol import ModelRunner, RunRow

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineStats", "RequestHandle", "RequestOutput", "TokenEvent"]


class Engine(RequestOutputs):
    def __init__(self, artifact_dir: str | Path, config: ServeConfig | None = None, *, start: bool = True,
                 hidden_sink: Callable[[str, int, np.ndarray], None] | None = None):
        self.config = config = config or ServeConfig()
        self.artifact_dir = Path(artifact_dir)
        self.manifest = read_manifest(self.artifact_dir, verify=config.verify_artifact)
        refuse_record(self.artifact_dir, self.manifest)
        self.tokenizer = load_tokenizer(self.artifact_dir)
        spec = KVCacheSpec.from_manifest(self.manifest)
        bs = config.kv_block_size
        layout = self.manifest.get("attention_layout", "standard")
        num_blocks, row_tokens = kv_layout(config, spec, layout)
        # Served (advertised) context: the model's, within what the KV budget holds for one sequence.
        self.max_model_len = context_length(config, spec, self.manifest, num_blocks, row_tokens, layout)
        max_pos = int(self.manifest.get("max_positions") or 2048)
        model_context = min(config.max_model_len or max_pos, max_pos)
        self.eos_ids = frozenset(int(i) for i in self.manifest.get("eos_token_ids") or [])
        self.block_manager = BlockManager(num_blocks, bs, enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, max_num_batched_tokens=config.max_num_batched_tokens,
            max_batch_size=config.max_batch_size, max_waiting=config.max_waiting, max_wait_s=config.max_wait_s,
            # The scheduler refuses beyond the model's context, and beyond the pool or rows naming the KV budget.
            max_model_len=model_context, policy=config.scheduling_policy, max_row_tokens=row_tokens)
        self.drafter = make_drafter(config, self.manifest, self.tokenizer)
        # hidden_sink(request id, tokens so far, hidden state at the position that chose the newest token): every
        # sampled token's hidden state, for whoever records them (compress/draft/conversations.py)
        self._hidden_sink = hidden_sink
        self._observe_hidden = hidden_sink is not None or (self.drafter is not None and self.drafter.reads_hidden)
        self.runner: ModelRunner = make_runner(self.artifact_dir, self.manifest, config, num_blocks, row_tokens,
                                               self.max_model_len, hidden_states=self._observe_hidden)
        # a finished, cancelled or preempted sequence's K/V is dead for the runner too (RunRow key = id + epoch)
        # (the hook holds the runner, not the engine: no cycle, so a dropped engine frees its weights at once)
        runner, drafter = self.runner, self.drafter

        def on_free(seq) -> None:
            key = (seq.request_id, seq.epoch)
            runner.release(key)
            if drafter is not None:
                drafter.release(key)
        self.block_manager.on_free = on_free
        if drafter is not None:  # what a check of k drafts costs here decides how many pay
            drafter.calibrate(runner, self.block_manager)
        chunk, self.prefill_costs = config.prefill_chunk, {}
        if chunk == "auto":  # what a prompt call costs here decides how large a chunk pays
            most = min(config.max_num_batched_tokens, self.max_model_len, row_tokens or self.max_model_len)
            chunk, self.prefill_costs = measure_prefill_chunk(runner, self.block_manager, most,
                                                              max_prompts=config.max_batch_size)
        self.scheduler.prefill_chunk = chunk or None
        release_free_memory()  # the loader's freed temporaries, ~100 MiB for SmolLM2 (serve/engine/heap.py)
        pool_bytes = num_blocks * spec.bytes_per_block(bs)
        log.info("KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB (%d bytes/token)%s; context %d; provider %s",
                 num_blocks, bs, num_blocks * bs, pool_bytes / 2**20, spec.bytes_per_token,
                 f"; KV rows up to {row_tokens} positions, {row_tokens * spec.bytes_per_token / 2**20:.1f} MiB"
                 if row_tokens else "", self.max_model_len, self.runner.provider)

        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._step_lock = threading.Lock()  # one step at a time, whoever drives it
        self._reqs: dict[str, InFlightRequest] = {}
        self._aborts: set[str] = set()
        self._executing = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._counters = EngineCounters(config.latency_window)  # stats, updated with the lock held
        self._grammars: GrammarCompiler | None = None  # built at the first constrained request
        self._grammars_lock = threading.Lock()
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
        # Coalescing only where requests arrive while the engine steps; a manual-mode caller adds its own first.
        self.scheduler.admit_quiet_s = self.config.admit_quiet_ms / 1e3
        self.scheduler.admit_max_delay_s = self.config.admit_max_delay_ms / 1e3
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
        """Prompt text as the model expects it (BOS by the manifest's rule), as the HTTP routes encode it."""
        return encode_prompt(self.tokenizer, self.manifest, text)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> RequestHandle:
        """Queue a request. Raises SamplingError (bad params), RequestTooLargeError, QueueFullError."""
        params = (params or SamplingParams()).validate()
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        vocab = self.runner.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise AdmissionError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias):
            raise SamplingError("logit_bias", f"logit_bias token ids must be in [0, {vocab})")
        # compiled here, in the caller's thread (the HTTP routes call from a worker), never on the step loop
        grammar = self.grammars().matcher(params.structured) if params.structured is not None else None
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
                self._counters.rejected += 1
                raise
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
            self._reqs[rid] = InFlightRequest(seq, handle, detok, stop_ids, grammar)
            self._counters.added += 1
            self._cv.notify_all()
        return handle

    def grammars(self) -> GrammarCompiler:
        """The compiler of this model's grammars (serve/engine/grammar.py), built on first use."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.to_str(), self.runner.vocab_size, self.eos_ids)
            return self._grammars

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
                self._trim_kv()
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
                now = time.monotonic()
                for r in out.scheduled:  # first scheduling time, for the queue/prefill histograms
                    req = self._reqs.get(r.seq.request_id)
                    if req is not None and req.scheduled_t is None:
                        req.scheduled_t = now
            wanted = self.drafter.candidates(out.scheduled, self.max_model_len) if self.drafter else []
        if out.empty:
            self._emit(events)
            return 0
        if wanted:
            self._add_drafts(out, wanted)
        try:
            rows = [RunRow((r.seq.request_id, r.seq.epoch), self.block_manager.block_table(r.seq), r.start,
                           r.token_ids, r.samples, self._wants_prompt_logits(r) or bool(r.drafts))
                    for r in out.scheduled]
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
            self._counters.record_step(len(out.scheduled), out.num_tokens)
            self._trim_kv()
        self._emit(events)
        return len(out.scheduled)

    def _add_drafts(self, out: SchedulerOutput, wanted) -> None:
        """Draft for the step's chosen decode rows (outside the lock: a draft model runs here), then give the
        drafts to the scheduler, which grows the rows' blocks if the pool allows without preempting."""
        drafts = self.drafter.propose(wanted)
        with self._lock:
            for (row, _), d in zip(wanted, drafts):
                self.scheduler.add_drafts(out, row, d)

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
        lower_this_thread(self.config.model_thread_nice)  # the HTTP event loop gets a core first (thread_priority)
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
                # Work exists but nothing was scheduled: new requests held to coalesce a burst (until the hold
                # ends or another arrives), or (rare) nothing fits: do not spin.
                with self._cv:
                    if not self._stop:
                        until = self.scheduler.admit_hold_until()
                        self._cv.wait(max(until - time.monotonic(), 1e-4) if until is not None else 0.005)

    # ---- KV memory -------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes held for K/V now, whatever the layout keeps (block pool, in-place rows, past buffers)."""
        return int(self.runner.kv_bytes())

    def device_memory(self) -> dict[str, int]:
        """GPU bytes when the runner keeps its K/V on the device (serve/kv/device.py), else {}."""
        store = getattr(self.runner, "store", None)
        return store.memory() if store is not None else {}

    def kv_budget_bytes(self) -> int:
        """The most ``kv_bytes`` reaches by design (docs/serving.md, "One KV budget")."""
        return int(self.runner.kv_budget_bytes())

    def _trim_kv(self) -> None:
        """Let the runner give back KV memory beyond what the running sequences need (lock held, not executing)."""
        running = self.scheduler.running
        if running or not self.scheduler.waiting:  # keep the rows for queued requests
            self.runner.trim(max((len(s.token_ids) for s in running), default=0))

    # ---- internals (called with the lock held; the per-request part: request_outputs.py) -
    def _process(self, out: SchedulerOutput, logits: list[np.ndarray | None], events: list) -> None:
        now = time.monotonic()
        hidden = self.runner.last_hidden if self._observe_hidden else [None] * len(out.scheduled)
        for row, lg, hd in zip(out.scheduled, logits, hidden):
            seq = row.seq
            if row.drafts:
                self._process_drafted(row, lg, events, now, hd)
                continue
            self.scheduler.commit(row)
            if lg is not None and lg.ndim == 2:  # all positions' logits: prompt log-probs, then the last row
                self._record_prompt_logprobs(row, lg)
                lg = lg[-1]
            if not row.samples:
                continue
            req = self._reqs[seq.request_id]
            if seq.request_id in self._aborts:
                continue  # cancelled while running: do not sample, _apply_aborts finishes it
            params = seq.params
            if req.grammar is None:
                tok = sample_token(lg, params, req.rng, seq.token_ids, seq.prompt_len, req.stop_ids)
            else:
                tok = req.grammar.choose(lg, lambda x: sample_token(x, params, req.rng, seq.token_ids, seq.prompt_len,
                                                                    req.stop_ids), params.is_greedy,
                                         params.top_k == 0 and params.top_p >= 1.0 and params.min_p == 0.0)
            ended = self._add_token(req, tok, lg, now, events)
            if hd is not None:
                self._observe(seq, hd if hd.ndim == 1 else hd[-1], ended)

    def _process_drafted(self, row, lg: np.ndarray, events: list, now: float, hidden: np.ndarray | None) -> None:
        """A decode row checked with drafts (``lg`` [1 + k, vocab]): the drafts that stand and the token after them
        join the sequence one by one (each may end it), and the rejected positions' K/V and blocks go."""
        seq = row.seq
        req = self._reqs[seq.request_id]
        if seq.request_id in self._aborts:
            self.scheduler.commit_drafted(row, 0)  # _apply_aborts finishes it
            return
        # a constrained row: each position masked under the grammar's state after the drafts before it
        masked = req.grammar.mask_drafts(lg, row.drafts) if req.grammar is not None else lg
        toks = accept_drafts(masked, row.drafts, seq.params, req.rng, seq.token_ids, seq.prompt_len, req.stop_ids)
        self.drafter.verified((seq.request_id, seq.epoch), len(row.drafts), len(toks) - 1)
        for i, tok in enumerate(toks):
            if self._add_token(req, tok, lg[i], now, events):
                if hidden is not None:
                    self._observe(seq, hidden[i], True)
                return  # finished: its blocks are already back in the pool
        self.scheduler.commit_drafted(row, len(toks) - 1)
        if hidden is not None:
            self._observe(seq, hidden[len(toks) - 1], False)

    # ---- stats -----------------------------------------------------------------------------
    def stats(self, wait: bool = True) -> EngineStats:
        """The counters now. ``wait=False`` reads them without the engine's lock, which a step holds while it
        samples and detokenizes a whole batch: figures may then be from either side of a step boundary, which a
        Prometheus scrape tolerates and which keeps /metrics from waiting on the model (serve/api/metrics.py)."""
        if not wait:
            return self._snapshot()
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> EngineStats:
        st = self._counters.snapshot(self.runner.provider, self.scheduler, self.block_manager)
        if self.drafter is not None:
            c = self.drafter.counters
            st.spec_drafts, st.spec_draft_tokens, st.spec_accepted_tokens = c.drafts, c.draft_tokens, c.accepted_tokens
        return st

    def check_invariants(self) -> None:
        """Consistency of the requests, the block pool and the counters (tests; call between steps)."""
        with self._lock:
            self.block_manager.check_invariants()
            self._counters.check_invariants()
            bm = self.block_manager
            for rid, req in self._reqs.items():
                assert req.seq.request_id == rid and not req.handle.finished, rid
                assert req.seq.status is not SeqStatus.FINISHED, rid
                req.check_invariants()
                if bm.has(req.seq):  # no blocks beyond the sequence's tokens (rejected drafts gave theirs back)
                    assert len(bm.block_table(req.seq)) <= bm.blocks_for_tokens(len(req.seq.token_ids)), rid
            if self.drafter is not None and self.drafter.model is not None:
                self.drafter.model.check_invariants()

    def pop_latency_samples(self) -> tuple[list[float], list[float]]:
        """TTFT and inter-token latency samples recorded since the last call (for histograms; lock-free)."""
        return self._counters.pop_latency_samples()

    def pop_request_samples(self) -> list[FinishedRequestSample]:
        """Finished requests' phases and token counts recorded since the last call (for histograms; lock-free)."""
        return self._counters.pop_request_samples()
