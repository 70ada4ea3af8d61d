"""What a step's chosen tokens do to the engine's requests: each token appended and streamed (its log-probs, the
grammar's check, TTFT and inter-token times), prompt log-probs recorded, hidden states handed to their readers,
and requests finished or cancelled.

``RequestOutputs`` is a part of serve/engine/engine.py's ``Engine``, kept apart from the step loop; its methods run
with the engine's lock held and use the engine's requests (``_reqs``, ``_aborts``), ``scheduler``, ``_counters``,
``drafter``, ``_hidden_sink`` and ``max_model_len``. Choosing the tokens (sampling, accepting drafts) stays in the
engine (``Engine._process``, ``Engine._process_drafted``): tests tap ``sample_token`` and ``accept_drafts`` there.
"""

from __future__ import annotations

import numpy as np

from serve.engine.in_flight import InFlightRequest
from serve.engine.request_handle import RequestHandle, TokenEvent
from serve.engine.sampling import token_logprobs
from serve.engine.stats import FinishedRequestSample


class RequestOutputs:
    """The engine's per-request bookkeeping of a step's results (lock held)."""

    def _apply_aborts(self) -> list:
        events = []
        for rid in list(self._aborts):
            req = self._reqs.get(rid)
            if req is not None:
                events.append(self._finish(req, "cancelled"))
        self._aborts.clear()
        return events

    def _finish(self, req: InFlightRequest, reason: str, error: str | None = None, token_id: int | None = None,
                text: str = "", logprobs=None) -> tuple[RequestHandle, TokenEvent]:
        seq = req.seq
        self.scheduler.finish(seq, reason)
        self._reqs.pop(seq.request_id, None)
        self._aborts.discard(seq.request_id)
        self._counters.record_finish(reason, seq.prompt_len)
        if req.first_token_t is not None and req.scheduled_t is not None:  # vLLM v1's phases, per request
            last = req.last_token_t
            self._counters.record_request(FinishedRequestSample(
                req.scheduled_t - seq.arrival, req.first_token_t - req.scheduled_t, last - req.first_token_t,
                last - req.scheduled_t, seq.prompt_len, seq.num_output))
        req.handle.num_preemptions = seq.num_preemptions
        ev = TokenEvent(seq.request_id, token_id, text, seq.num_output, reason, error, logprobs)
        return req.handle, ev

    def _wants_prompt_logits(self, row) -> bool:
        """The row computes prompt positions whose log-probs its request asked for and does not have yet."""
        seq = row.seq
        if seq.params.prompt_logprobs is None or row.start >= seq.prompt_len - 1:
            return False
        req = self._reqs.get(seq.request_id)
        return req is not None and len(req.handle.prompt_logprobs) < seq.prompt_len - 1

    def _record_prompt_logprobs(self, row, lg: np.ndarray) -> None:
        """``lg`` [n, vocab]: the logits of positions start .. start+n-1; position p gives prompt token p+1's
        log-prob. Positions already recorded (a recompute after preemption) are skipped."""
        seq = row.seq
        req = self._reqs.get(seq.request_id)
        if req is None:
            return
        got = req.handle.prompt_logprobs
        k = seq.params.prompt_logprobs
        for i in range(lg.shape[0]):
            p = row.start + i
            if p + 1 >= seq.prompt_len:
                break
            if p == len(got):
                got.append(token_logprobs(lg[i], seq.token_ids[p + 1], k))
    def _observe(self, seq, hidden: np.ndarray, ended: bool) -> None:
        """Hand the hidden state that chose the sequence's newest token to the sink and (while it runs) the draft
        head."""
        if self._hidden_sink is not None:
            self._hidden_sink(seq.request_id, len(seq.token_ids), hidden)
        if not ended and self.drafter is not None and self.drafter.reads_hidden:
            self.drafter.observe((seq.request_id, seq.epoch), len(seq.token_ids), hidden)

    def _add_token(self, req: InFlightRequest, tok: int, lg: np.ndarray, now: float, events: list) -> bool:
        """Append one sampled token to the request, stream it; True when it ended the request."""
        seq, params, counters = req.seq, req.seq.params, self._counters
        if req.grammar is not None and not req.grammar.accept(tok):  # the mask allowed it: a matcher fault
            events.append(self._finish(req, "error", f"the grammar refused token {tok}: {req.grammar.error}"))
            return True
        # log-probs from the raw logits of the same row the sampler saw (vLLM's default raw_logprobs)
        lp = token_logprobs(lg, tok, params.logprobs) if params.logprobs is not None else None
        seq.token_ids.append(tok)
        counters.generated += 1
        if req.first_token_t is None:
            req.first_token_t = now
            ttft = now - seq.arrival
            req.handle.ttft_s = ttft
            req.handle.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
            counters.record_ttft(ttft)
        else:
            counters.record_itl(now - req.last_token_t)
        req.last_token_t = now
        reason, delta = req.add_token(tok, self.max_model_len)
        if reason is not None:
            events.append(self._finish(req, reason, token_id=tok, text=delta, logprobs=lp))
            return True
        events.append((req.handle, TokenEvent(seq.request_id, tok, delta, seq.num_output, logprobs=lp)))
        return False

    @staticmethod
    def _emit(events) -> None:
        for handle, ev in events:
            handle._push(ev)
