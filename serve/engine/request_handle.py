"""What a caller holds for one request: the token events it streams and its final output.

One job: hand an engine-thread's token events to a consumer on any thread, sync or async.
``Engine.add_request`` returns a ``RequestHandle``; the engine thread ``_push``es
``TokenEvent``s into it, and the caller iterates it (``for`` blocks, ``async for`` awaits
without blocking the event loop) or asks for the whole ``RequestOutput``.

Invariants: events arrive in order and exactly one of them is final (``finish_reason`` set);
after it, ``finished`` is true and ``output_ids``/``text`` hold everything streamed. Leaving
an ``async for`` before the final event cancels the request (its blocks go back at once).
With no engine thread running (``Engine(..., start=False)``) the blocking consumers drive
the engine's steps themselves.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Protocol

from serve.engine.sampling import SamplingParams


class StepDriver(Protocol):
    """What a handle needs of its engine (``serve.engine.engine.Engine`` is one); named here so that this module
    does not import the engine, which imports it (tests/test_layout.py: no import cycles)."""

    @property
    def running(self) -> bool: ...

    def cancel(self, request_id: str) -> None: ...

    def _drive_until(self, done: threading.Event) -> None: ...


@dataclass
class TokenEvent:
    request_id: str
    token_id: int | None  # None on a final event that carries no token (cancelled, error)
    text: str  # text delta
    index: int  # number of output tokens so far, this one included
    finish_reason: str | None = None
    error: str | None = None
    # with params.logprobs set: (the token's log-prob, [(id, log-prob)] the top params.logprobs, best first)
    logprobs: tuple[float, list[tuple[int, float]]] | None = None

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
    logprobs: list | None = None  # one TokenEvent.logprobs per output token, when params.logprobs is set
    # with params.prompt_logprobs set: (log-prob, top k) for prompt tokens 1 .. len-1 (token 0 has none)
    prompt_logprobs: list | None = None


class RequestHandle:
    """What ``add_request`` returns: iterate it (sync or async) for token events; cancel it.

    Leaving an ``async for`` over the handle before the last event (a disconnected client,
    a cancelled task, a ``break``) cancels the request, so its blocks go back at once.
    """

    def __init__(self, engine: StepDriver, request_id: str, prompt_ids: list[int], params: SamplingParams):
        self._engine = engine
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.output_ids: list[int] = []
        self.logprobs: list | None = [] if params.logprobs is not None else None
        # written by the engine thread as the prompt is computed, complete before the first token event
        self.prompt_logprobs: list | None = [] if params.prompt_logprobs is not None else None
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
            if self.logprobs is not None and ev.logprobs is not None:
                self.logprobs.append(ev.logprobs)
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
                             self.error, self.ttft_s, self.num_cached_prompt_tokens, self.num_preemptions,
                             list(self.logprobs) if self.logprobs is not None else None,
                             list(self.prompt_logprobs) if self.prompt_logprobs is not None else None)
