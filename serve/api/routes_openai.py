"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (JSON or SSE stream), /v1/models, and
vLLM's /tokenize, /detokenize and /version. The two completion endpoints share one pipeline here; what differs
between them (schema, prompts, choice and chunk shapes) is their form (serve/api/forms.py).

Every request leases the model that is current when it arrives (serve/registry/source.py) and keeps
it until its last byte is sent, so a live swap never cuts a response short. Deterministic requests
are answered from the result cache when they can be.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from serve.api.forms import ChatForm, CompletionForm, Form, after, echo_logprobs, tool_finish
from serve.api.schemas import (ApiError, DetokenizeRequest, TokenizeRequest, error_body, parse, read_json,
                               refuse_unsupported)
from serve.api.chat_template import render_chat
from serve.api.result_cache import CachedResult, cache_key
from serve.api.state import AppState, app_state
from serve.api.streaming import DisconnectAwareStream, call_at_end, sse
from serve.api.tools import ToolStream, ToolUse
from serve.engine.engine import RequestHandle
from serve.engine.sampling import SamplingError, SamplingParams
from serve.engine.scheduler import AdmissionError, QueueFullError, RequestTooLargeError
from serve.engine.tokenizer import encode_chat, encode_prompt
from serve.registry.source import LoadedModel

OWNED_BY = "compressor"
MAX_CHOICES = 64  # n x prompts in one request

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    return await generate(request, CompletionForm)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await generate(request, ChatForm)


def model_card(lm: LoadedModel) -> dict:
    return {"id": lm.name, "object": "model", "created": int(lm.loaded_at), "owned_by": OWNED_BY,
            "version": lm.version, "alias": lm.alias, "uri": lm.uri, "max_model_len": lm.engine.max_model_len,
            "artifact_sha256": lm.artifact_sha256, "speculative": lm.speculative}


@router.get("/v1/models")
async def models(request: Request):
    lm = app_state(request).manager.current
    return {"object": "list", "data": [model_card(lm)] if lm is not None else []}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    lm = app_state(request).manager.current
    if lm is None or model_id not in (lm.name, lm.uri):
        raise ApiError(404, f"the model {model_id!r} does not exist", "not_found_error", "model",
                       "model_not_found")
    return model_card(lm)


# ---- vLLM's utility endpoints -----------------------------------------------------------------
def server_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llm-compressor-pipeline")
    except PackageNotFoundError:
        return "0.1.0"


@router.get("/version")
async def version_route():
    return {"version": server_version()}


@router.post("/tokenize")
async def tokenize(request: Request):
    """vLLM's /tokenize: the prompt ids /v1/completions (``prompt``) or /v1/chat/completions (``messages``)
    would run, with the same BOS rule: {count, max_model_len, tokens, token_strs}."""
    state = app_state(request)
    body = parse(TokenizeRequest, await read_json(request, state.config.max_request_bytes))
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send exactly one of prompt and messages", param="prompt")
    lm = state.lease()
    try:
        check_model(lm, body.model)
        return await state.off_loop(tokenize_body, lm, body)
    finally:
        state.manager.release(lm)


def tokenize_body(lm: LoadedModel, body: TokenizeRequest) -> dict:
    tok = lm.engine.tokenizer
    if body.messages is not None:
        if not body.messages:
            raise ApiError(400, "messages is empty", param="messages")
        text = render_chat(lm, body.messages, body.add_generation_prompt, body.continue_final_message,
                           body.chat_template_kwargs)
        if body.add_special_tokens:  # as /v1/chat/completions refuses it
            raise ApiError(400, "add_special_tokens: not supported with messages (the chat template writes "
                           "the special tokens)", param="add_special_tokens", code="unsupported_parameter")
        ids = encode_chat(tok, lm.manifest, text)
    else:
        ids = (encode_prompt(tok, lm.manifest, body.prompt) if body.add_special_tokens in (None, True)
               else tok.encode(body.prompt, add_special_tokens=False).ids)
    strs = [tok.id_to_token(i) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": lm.engine.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(request: Request):
    """vLLM's /detokenize: {tokens} -> {prompt} (special tokens kept, as vLLM)."""
    state = app_state(request)
    body = parse(DetokenizeRequest, await read_json(request, state.config.max_request_bytes))
    lm = state.lease()
    try:
        check_model(lm, body.model)
        vocab = lm.engine.runner.vocab_size
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise ApiError(400, f"tokens: token ids must be in [0, {vocab})", param="tokens")
        text = await state.off_loop(functools.partial(lm.engine.tokenizer.decode, skip_special_tokens=False),
                                    body.tokens)
        return {"prompt": text}
    finally:
        state.manager.release(lm)


# ---- generation --------------------------------------------------------------------------------
def check_model(lm: LoadedModel, requested: str | None) -> None:
    if requested not in (None, "", lm.name, lm.uri):
        raise ApiError(404, f"the model {requested!r} does not exist; this server serves {lm.name!r}",
                       "not_found_error", "model", "model_not_found")


def admit(lm: LoadedModel, prompt, params: SamplingParams, rid: str) -> RequestHandle:
    try:
        return lm.engine.add_request(prompt, params, request_id=rid)
    except QueueFullError as e:
        raise queue_full(e) from None
    except RequestTooLargeError as e:
        raise ApiError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
    except SamplingError as e:
        raise ApiError(400, str(e), param=e.field) from None
    except AdmissionError as e:
        raise ApiError(400, str(e), param="prompt") from None


def context_room(lm: LoadedModel, prompt_len: int) -> int:
    """``max_tokens`` when the client leaves it out (chat) or sends null: as long as the context allows
    (and the KV pool can ever hold)."""
    bm = lm.engine.block_manager
    room = min(lm.engine.max_model_len, bm.num_blocks * bm.block_size)
    return max(1, room - prompt_len)


def fingerprint(lm: LoadedModel) -> str:
    return f"{lm.name}-v{lm.version}" if lm.version is not None else f"{lm.name}-g{lm.generation}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Choice:
    """One choice of a response: prompt ``prompt_idx`` (of a list of prompts), sample ``index`` (n > 1)."""
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    echo_text: str = ""
    prompt_only: bool = False  # echo with max_tokens 0: the generated token is dropped
    key: tuple | None = None
    hit: CachedResult | None = None
    handle: RequestHandle | None = None
    tools: ToolUse | None = None  # chat with tools: the answer may be tool calls


async def wait_results(handles: list[RequestHandle], request: Request):
    """The whole outputs; a client that disconnects meanwhile cancels the requests."""
    async def watch() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                for h in handles:
                    h.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await asyncio.gather(*(h.aresult() for h in handles))
    finally:
        watcher.cancel()


def refuse_if_queue_full(state: AppState, lm: LoadedModel) -> None:
    """429 before any tokenizing when the waiting queue, counting the requests still being tokenized for it, is
    full (read without the engine's lock; the engine decides again, exactly, when a request is added)."""
    if state.queue_full(lm):
        raise queue_full(lm.engine.scheduler.queue_full_error())


def queue_full(e: QueueFullError) -> ApiError:
    retry = max(1, round(e.retry_after_s))
    return ApiError(429, str(e), "rate_limit_error", code="queue_full", headers={"Retry-After": str(retry)})


def admit_choices(lm: LoadedModel, body, form: Form, cache, choices: list[Choice]) -> dict:
    """Render and tokenize the prompts, look each choice up in the result cache and admit the misses to the
    engine, appending to ``choices`` as it goes (so the caller can cancel what was admitted if a later choice
    fails). Returns the response's id fields. Blocking: runs in a worker thread."""
    tok = lm.engine.tokenizer
    prompts = form.prompts(lm, body)
    if len(prompts.items) * body.n > MAX_CHOICES:
        raise ApiError(400, f"n x prompts = {len(prompts.items) * body.n} choices exceeds {MAX_CHOICES}", param="n")
    for p_idx, (ids, raw) in enumerate(prompts.items):
        if body.truncate_prompt_tokens is not None:  # vLLM: keep the last k tokens (-1: the context)
            k = lm.engine.max_model_len if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
            ids = ids[-k:]
        echo_text = form.echo_text(body, raw, ids, tok)
        # chat's default, or null: as long as the context allows
        max_tokens = prompts.max_tokens if prompts.max_tokens is not None else context_room(lm, len(ids))
        base = body.sampling(max_tokens, prompts.logprobs)
        base.prompt_logprobs = form.prompt_logprobs(body, prompts.logprobs)
        base.structured = prompts.structured
        if prompts.tools is not None:  # a call's marker may be a special token ([TOOL_CALLS]): keep it to parse
            base.skip_special_tokens = False
        try:
            base.validate()
        except SamplingError as e:
            raise ApiError(400, str(e), param=e.field) from None
        for j in range(body.n):
            # n > 1 with a seed: sample j draws from seed + j (as vLLM), so the samples differ reproducibly
            params = base if j == 0 or base.seed is None else dataclasses.replace(base, seed=base.seed + j)
            choices.append(Choice(p_idx * body.n + j, ids, params, echo_text, prompt_only=prompts.prompt_only,
                                  tools=prompts.tools))
    rid = form.id_prefix + uuid.uuid4().hex
    meta = dict(id=rid, created=int(time.time()), model=lm.name, system_fingerprint=fingerprint(lm))
    for c in choices:
        # log-probs are not kept in the result cache: such requests always run
        c.key = cache_key(lm.key, c.prompt_ids, c.params) if prompts.logprobs is None and not c.prompt_only else None
        c.hit = cache.get(c.key)
        if c.hit is None:
            c.handle = admit(lm, c.prompt_ids, c.params, rid if len(choices) == 1 else f"{rid}-{c.index}")
    return meta


async def generate(request: Request, form: Form):
    """/v1/completions and /v1/chat/completions: lease the model, answer each choice (n per prompt, a list of
    prompts) from the result cache or the engine, as one JSON body or as a stream of events."""
    t0 = time.perf_counter()
    state = app_state(request)
    manager, cache = state.manager, state.cache
    data = await read_json(request, state.config.max_request_bytes)
    refuse_unsupported(data, form.chat)
    body = parse(form.schema, data)
    form.check(body)
    lm = state.lease()
    choices: list[Choice] = []
    try:
        check_model(lm, body.model)
        refuse_if_queue_full(state, lm)
        # Chat template, tokenization, cache look-ups and admission (which waits for the engine's lock) run in a
        # worker thread: the event loop keeps answering /health, /metrics and 429s during a burst. Requests on
        # their way to the engine count as waiting, so the ones behind them are refused now, not after the wait.
        state.admitting += 1
        try:
            meta = await state.off_loop(admit_choices, lm, body, form, cache, choices)
        finally:
            state.admitting -= 1
    except BaseException:
        for c in choices:
            if c.handle is not None:
                c.handle.cancel()
        manager.release(lm)
        raise
    tok = lm.engine.tokenizer
    cache_state = ("hit" if all(c.hit is not None for c in choices)
                   else "off" if all(c.key is None for c in choices) else "miss")
    headers = {"X-Result-Cache": cache_state}
    prompt_tokens = sum(len(c.prompt_ids) for c in choices if c.index % body.n == 0)  # each prompt once

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = stream_events(form, meta, choices, prompt_tokens, include_usage, tok)
        # no-cache / no buffering: proxies must pass each event on as it comes
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return DisconnectAwareStream(call_at_end(gen, lambda ok: done(state, lm, choices, t0, ok)),
                                     media_type="text/event-stream", headers=headers)
    try:
        running = [c for c in choices if c.handle is not None]
        outs = dict(zip((c.index for c in running), await wait_results([c.handle for c in running], request)))
        results = [results_of(lm, cache, c, outs.get(c.index)) for c in choices]
        state.metrics.e2e.labels(lm.name).observe(time.perf_counter() - t0)
    except BaseException:
        for c in choices:
            if c.handle is not None and not c.handle.finished:
                c.handle.cancel()
        raise
    finally:
        manager.release(lm)
    out_choices = [form.choice(tok, c, result, out) for c, (result, out) in zip(choices, results)]
    completion_tokens = sum(r.completion_tokens for r, _ in results)
    return JSONResponse({**meta, "object": form.object, "choices": out_choices,
                         "usage": usage(prompt_tokens, completion_tokens)}, headers=headers)


def results_of(lm: LoadedModel, cache, c: Choice, out) -> tuple:
    """(result, engine output) of one choice: its cache hit, or the engine's answer (cached unless the model was
    swapped out meanwhile). An engine error is a 500, a cancellation a 503."""
    if out is None:
        return c.hit, None
    if out.finish_reason == "error":
        raise ApiError(500, f"generation failed: {out.error}", "server_error", code="engine_error")
    if out.finish_reason == "cancelled":
        raise ApiError(503, "the request was cancelled (the server is shutting down or the model was "
                       "unloaded)", "service_unavailable", code="cancelled")
    result = CachedResult(out.text, tuple(out.output_ids), out.finish_reason, len(c.prompt_ids))
    if not lm.retired:  # an answer from a swapped-out model would only occupy space
        cache.put(c.key, result)
    if c.prompt_only:
        result = CachedResult("", (), "length", len(c.prompt_ids))
    return result, out


def done(state: AppState, lm: LoadedModel, choices: list[Choice], t0: float, ok: bool) -> None:
    """End of a stream, however it ended: cancel unfinished requests, cache finished ones, free the lease."""
    try:
        for c in choices:
            handle = c.handle
            if handle is None:
                continue
            if not handle.finished:
                handle.cancel()
            elif ok and not lm.retired:
                state.cache.put(c.key, CachedResult(handle.text, tuple(handle.output_ids),
                                                    handle.finish_reason or "", len(c.prompt_ids)))
        if ok:
            state.metrics.e2e.labels(lm.name).observe(time.perf_counter() - t0)
    finally:
        state.manager.release(lm)


class _Chunks:
    """Builds one stream's chunk bodies: a choice's first chunk is marked (a chat's carries the role), and a
    completion's log-probs carry text offsets that move on with each token."""

    def __init__(self, form: Form, meta: dict, choices: list[Choice], include_usage: bool, tok):
        self.form, self.meta, self.include_usage, self.tok = form, meta, include_usage, tok
        self.first = {c.index: True for c in choices}
        self.offset = {c.index: len(c.echo_text) for c in choices}

    def __call__(self, index: int, text: str | None, finish: str | None, token_id: int | None = None, lp=None,
                 lp_obj: dict | None = None) -> dict:
        logprobs = lp_obj
        if lp is not None and token_id is not None:
            logprobs = self.form.token_logprobs(self.tok, token_id, lp, self.offset[index])
            if "tokens" in logprobs:  # a completion's: the next token's text offset moves on
                self.offset[index] += len(logprobs["tokens"][0])
        c = self.form.chunk_choice(index, text, finish, logprobs, self.first[index])
        self.first[index] = False
        out = {**self.meta, "object": self.form.chunk_object, "choices": [c]}
        if self.include_usage:
            out["usage"] = None
        return out


def stream_events(form: Form, meta: dict, choices: list[Choice], prompt_tokens: int, include_usage: bool,
                  tok=None) -> AsyncIterator[str]:
    """The SSE events of one response, from the engine's token events or cached results; several choices' chunks
    interleave as tokens come, each naming its ``index``. A chat choice's first chunk (with ``role``) goes out with
    its first token; a request the server cancelled ends with finish_reason ``abort`` (vLLM's name)."""
    chunk = _Chunks(form, meta, choices, include_usage, tok)
    # chat with tools: text from a call's opener on is held and sent at the end as one tool_calls delta
    splitters = {c.index: ToolStream(c.tools) for c in choices if c.tools is not None}

    def text_events(c: Choice, text: str, token_id=None, lp=None):
        split = splitters.get(c.index)
        if split is not None:
            text = split.feed(text)
            if not text:
                return
        yield sse(chunk(c.index, text, None, token_id, lp))

    def finish_events(c: Choice, reason: str):
        split = splitters.get(c.index)
        if split is not None:
            rest, calls = split.finish()
            if rest:
                yield sse(chunk(c.index, rest, None))
            if calls:
                first = chunk.first[c.index]
                body = chunk(c.index, None, None)  # the chunk's envelope (it marks the choice's first chunk sent)
                yield sse({**body, "choices": [form.tool_calls_chunk(c.index, calls, first)]})
                reason = tool_finish(reason)
        yield sse(chunk(c.index, None, reason))
    # echo with logprobs: the echo chunk carries the prompt's log-probs, so it waits for the prompt's computation
    deferred = {c.index for c in choices if c.echo_text and c.params.prompt_logprobs is not None}

    async def events() -> AsyncIterator[str]:
        completion_tokens = 0
        for c in choices:
            if c.echo_text and c.index not in deferred:
                yield sse(chunk(c.index, c.echo_text, None))
        for c in choices:
            if c.hit is not None:
                if c.hit.text:
                    for e in text_events(c, c.hit.text):
                        yield e
                for e in finish_events(c, c.hit.finish_reason):
                    yield e
                completion_tokens += c.hit.completion_tokens
        running = [c for c in choices if c.handle is not None]
        if running:
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(c: Choice) -> None:
                async for ev in c.handle:
                    await queue.put((c, ev))

            pumps = [asyncio.create_task(pump(c)) for c in running]
            try:
                left = len(running)
                while left:
                    c, ev = await queue.get()
                    if c.index in deferred:
                        deferred.discard(c.index)
                        lp_obj = echo_logprobs(tok, c.prompt_ids, c.handle.prompt_logprobs or [])
                        chunk.offset[c.index] = after(lp_obj, c.echo_text)
                        yield sse(chunk(c.index, c.echo_text, None, lp_obj=lp_obj))
                    if (ev.text or ev.logprobs is not None) and not c.prompt_only:
                        for e in text_events(c, ev.text, ev.token_id, ev.logprobs):
                            yield e
                    if not ev.finished:
                        continue
                    left -= 1
                    if ev.finish_reason == "error":
                        yield sse(error_body(f"generation failed: {c.handle.error}", "server_error",
                                             code="engine_error"))
                        yield sse("[DONE]")
                        return
                    completion_tokens += 0 if c.prompt_only else len(c.handle.output_ids)
                    reason = "abort" if ev.finish_reason == "cancelled" else ev.finish_reason
                    for e in finish_events(c, "length" if c.prompt_only and reason == "stop" else reason):
                        yield e
            finally:
                for t in pumps:
                    t.cancel()
        if include_usage:
            yield sse({**meta, "object": form.chunk_object, "choices": [],
                       "usage": usage(prompt_tokens, completion_tokens)})
        yield sse("[DONE]")

    return events()
