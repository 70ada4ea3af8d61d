"""Engine-side state of one request from admission to finish, and the text each new token adds.

One job: turn a request's sampled tokens into its streamed text and finish reason. An
``InFlightRequest`` ties the scheduler's ``SequenceState`` to the caller's ``RequestHandle``,
the sampler's generator and an incremental detokenizer; ``add_token`` decides, for a token
already appended to the sequence, whether the request is done (``stop``: a stop id or stop
string; ``length``: max_tokens or the context limit) and which text delta to stream.

Invariants: ``0 <= emitted <= len(detok.text)``; ``emitted`` never decreases; the streamed text
never contains a stop string, and text that might still become the start of one is held back
(at most ``max_stop_len - 1`` characters) until it is known not to be. A stop token's id adds
no text; with ``include_stop_str_in_output`` the matched stop string ends the text. Before
``min_tokens`` tokens no stop id or stop string ends the request. ``check_invariants`` verifies the first two.
"""

from __future__ import annotations

from serve.engine.grammar import RowGrammar
from serve.engine.request_handle import RequestHandle
from serve.engine.sampling import find_stop_span
from serve.engine.scheduler import SequenceState
from serve.engine.tokenizer import IncrementalDetokenizer


class InFlightRequest:
    """Engine-side state of one request from admission to finish: its scheduler sequence, the caller's
    handle, its sampler's generator and the detokenizer that turns its tokens into streamed text."""

    __slots__ = ("seq", "handle", "rng", "detok", "stop_ids", "emitted", "scheduled_t", "first_token_t",
                 "last_token_t", "max_stop_len", "grammar")

    def __init__(self, seq: SequenceState, handle: RequestHandle, detok: IncrementalDetokenizer,
                 stop_ids: frozenset[int], grammar: RowGrammar | None = None):
        self.seq = seq
        self.grammar = grammar  # constrained decoding: the request's grammar state (None: free text)
        self.handle = handle
        self.rng = seq.params.make_generator()
        self.detok = detok
        self.stop_ids = stop_ids
        self.emitted = 0  # characters of detok.text already sent
        self.scheduled_t: float | None = None  # first time the scheduler picked it (monotonic)
        self.first_token_t: float | None = None
        self.last_token_t: float | None = None
        self.max_stop_len = max((len(s) for s in seq.params.stop), default=0)

    def add_token(self, tok: int, max_model_len: int) -> tuple[str | None, str]:
        """``tok`` was just appended to ``seq.token_ids``: (finish reason or None, text delta to stream)."""
        seq = self.seq
        params = seq.params
        reason = None
        detok = self.detok
        stop_at = stop_len = -1
        # min_tokens (as vLLM): the first min_tokens tokens are never stop ids (the sampler masks them), and
        # stop strings count once that many tokens were generated
        may_stop = seq.num_output >= params.min_tokens
        if tok in self.stop_ids and seq.num_output > params.min_tokens:
            reason = "stop"
        else:
            before = len(detok.text)
            detok.add(tok)
            if params.stop and may_stop:
                stop_at, stop_len = find_stop_span(detok.text, params.stop, before)
                if stop_at != -1:
                    reason = "stop"
        if reason is None and self.grammar is not None and self.grammar.finished:
            reason = "stop"  # the grammar is complete and allows nothing more (its EOS need not be generated)
        if reason is None and (seq.num_output >= params.max_tokens or len(seq.token_ids) >= max_model_len):
            reason = "length"
        if reason is not None and stop_at == -1:
            before = len(detok.text)
            detok.flush()
            if params.stop and may_stop:
                stop_at, stop_len = find_stop_span(detok.text, params.stop, before)
        text = detok.text
        if stop_at != -1:
            end = stop_at + (stop_len if params.include_stop_str_in_output else 0)
        elif reason is None and self.max_stop_len > 1:
            end = max(self.emitted, len(text) - (self.max_stop_len - 1))  # hold back a possible stop start
        else:
            end = len(text)
        delta = text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return reason, delta

    def check_invariants(self) -> None:
        assert 0 <= self.emitted <= len(self.detok.text), (self.emitted, len(self.detok.text))
        assert self.seq.request_id == self.handle.request_id
