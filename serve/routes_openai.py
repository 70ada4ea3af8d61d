"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (JSON or SSE stream), /v1/models, and
vLLM's /tokenize, /detokenize and /version.

Every request leases the model that is current when it arrives (serve/model_source.py) and keeps
it until its last byte is sent, so a live swap never cuts a response short. Deterministic requests
are answered from the result cache when they can be.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from serve.api_schemas import (ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                               TokenizeRequest, error_body, parse, read_json, refuse_unsupported)
from serve.app_state import AppState, app_state
from serve.chat_template import render_chat
from serve.engine import RequestHandle
from serve.model_source import LoadedModel
from serve.result_cache import CachedResult, cache_key
from serve.sampling import SamplingError, SamplingParams
from serve.scheduler import AdmissionError, QueueFullError, RequestTooLargeError
from serve.streaming import DisconnectAwareStream, call_at_end, sse
from serve.tokenizer import encode_chat, encode_prompt

OWNED_BY = "compressor"

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    return await generate(request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await generate(request, chat=True)


def model_card(lm: LoadedModel) -> dict:
    return {"id": lm.name, "object": "model", "created": int(lm.loaded_at), "owned_by": OWNED_BY,
            "version": lm.version, "alias": lm.alias, "uri": lm.uri, "max_model_len": lm.engine.max_model_len}


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
    finally:
        state.manager.release(lm)


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
        return {"prompt": lm.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}
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
        retry = max(1, round(e.retry_after_s))
        raise ApiError(429, str(e), "rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(retry)}) from None
    except RequestTooLargeError as e:
        raise ApiError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
    except SamplingError as e:
        field = str(e).split(" ", 1)[0]
        raise ApiError(400, str(e), param=field if field in SamplingParams.__dataclass_fields__ else None) from None
    except AdmissionError as e:
        raise ApiError(400, str(e), param="prompt") from None


def context_room(lm: LoadedModel, prompt_len: int) -> int:
    """``max_tokens`` when the client leaves it out (chat) or sends null: as long as the context allows
    (and the KV pool can ever hold)."""
    bm = lm.engine.block_manager
    room = min(lm.engine.max_model_len, bm.num_blocks * bm.block_size)
    return max(1, room - prompt_len)


def check_combinations(body, chat: bool) -> None:
    """What vLLM refuses as combinations of otherwise valid fields."""
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options")
    if chat and body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    if not chat and body.echo and body.logprobs is not None:
        raise ApiError(400, "echo with logprobs (prompt log-probs) is not supported by this server",
                       param="echo", code="unsupported_parameter")


def token_str(tok, t: int) -> str:
    return tok.decode([int(t)], skip_special_tokens=False)


def completion_logprobs(tok, ids, lps, offset: int = 0) -> dict:
    """OpenAI's completions ``logprobs`` object; ``top_logprobs`` holds the top k and the chosen token (vLLM)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, (lp, top) in zip(ids, lps):
        s = token_str(tok, t)
        out["tokens"].append(s)
        out["token_logprobs"].append(lp)
        tops = {token_str(tok, i): v for i, v in top}
        tops.setdefault(s, lp)
        out["top_logprobs"].append(tops)
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def chat_logprobs(tok, ids, lps) -> dict:
    """OpenAI's chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def entry(t, lp):
        s = token_str(tok, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                        for t, (lp, top) in zip(ids, lps)]}


def fingerprint(lm: LoadedModel) -> str:
    return f"{lm.name}-v{lm.version}" if lm.version is not None else f"{lm.name}-g{lm.generation}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def wait_result(handle: RequestHandle, request: Request):
    """The whole output; a client that disconnects meanwhile cancels the request."""
    async def watch() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                handle.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await handle.aresult()
    finally:
        watcher.cancel()


async def generate(request: Request, chat: bool):
    """/v1/completions and /v1/chat/completions: lease the model, answer from the result cache or the
    engine, as one JSON body or as a stream of events."""
    t0 = time.perf_counter()
    state = app_state(request)
    manager, cache = state.manager, state.cache
    data = await read_json(request, state.config.max_request_bytes)
    refuse_unsupported(data, chat)
    body = parse(ChatCompletionRequest if chat else CompletionRequest, data)
    check_combinations(body, chat)
    lm = state.lease()
    try:
        check_model(lm, body.model)
        tok = lm.engine.tokenizer
        echo_text = ""
        if chat:
            text = render_chat(lm, body.messages, body.add_generation_prompt, body.continue_final_message,
                               body.chat_template_kwargs)
            # The template writes the special tokens itself; BOS only if the model takes one and it did not.
            prompt_ids = encode_chat(tok, lm.manifest, text)
            max_tokens = body.max_completion_tokens or body.max_tokens
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            prompt = body.prompt
            # Text gets the model's BOS (manifest add_bos_token) unless add_special_tokens is false; token ids
            # are taken as sent (as vLLM does).
            if isinstance(prompt, str):
                prompt_ids = (encode_prompt(tok, lm.manifest, prompt) if body.add_special_tokens
                              else tok.encode(prompt, add_special_tokens=False).ids)
            else:
                prompt_ids = [int(t) for t in prompt]
            max_tokens = body.max_tokens
            logprobs = body.logprobs
        if body.truncate_prompt_tokens is not None:  # vLLM: keep the last k tokens (-1: the context)
            k = lm.engine.max_model_len if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
            prompt_ids = prompt_ids[-k:]
        if not chat and body.echo:
            echo_text = (prompt if isinstance(prompt, str) and body.truncate_prompt_tokens is None
                         else tok.decode(prompt_ids, skip_special_tokens=body.skip_special_tokens))
        if max_tokens is None:  # chat's default, or null: as long as the context allows
            max_tokens = context_room(lm, len(prompt_ids))
        params = body.sampling(max_tokens, logprobs)
        try:
            params.validate()
        except SamplingError as e:
            field = str(e).split(" ", 1)[0]
            raise ApiError(400, str(e), param=field) from None
        # log-probs are not kept in the result cache: such requests always run
        key = cache_key(lm.key, prompt_ids, params) if logprobs is None else None
        hit = cache.get(key)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        meta = dict(id=rid, created=int(time.time()), model=lm.name, system_fingerprint=fingerprint(lm))
        if hit is not None:
            handle = None
        else:
            handle = admit(lm, prompt_ids, params, rid)
    except BaseException:
        manager.release(lm)
        raise
    headers = {"X-Result-Cache": "hit" if hit is not None else ("miss" if key is not None else "off")}

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = stream_events(chat, meta, handle, hit, len(prompt_ids), include_usage, tok, echo_text)
        # no-cache / no buffering: proxies must pass each event on as it comes
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return DisconnectAwareStream(call_at_end(gen, lambda ok: done(state, lm, handle, key, len(prompt_ids), t0,
                                                                    ok)),
                                     media_type="text/event-stream", headers=headers)
    try:
        if hit is None:
            out = await wait_result(handle, request)
            if out.finish_reason == "error":
                raise ApiError(500, f"generation failed: {out.error}", "server_error", code="engine_error")
            if out.finish_reason == "cancelled":
                raise ApiError(503, "the request was cancelled (the server is shutting down or the model was "
                               "unloaded)", "service_unavailable", code="cancelled")
            result = CachedResult(out.text, tuple(out.output_ids), out.finish_reason, len(prompt_ids))
            lps = out.logprobs
            if not lm.retired:  # an answer from a swapped-out model would only occupy space
                cache.put(key, result)
        else:
            result, lps = hit, None
        state.metrics.e2e.labels(lm.name).observe(time.perf_counter() - t0)
    finally:
        manager.release(lm)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "logprobs": chat_logprobs(tok, result.output_ids, lps) if lps is not None else None,
                  "finish_reason": result.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": echo_text + result.text,
                  "logprobs": completion_logprobs(tok, result.output_ids, lps) if lps is not None else None,
                  "finish_reason": result.finish_reason}
        obj = "text_completion"
    return JSONResponse({**meta, "object": obj, "choices": [choice],
                         "usage": usage(len(prompt_ids), result.completion_tokens)}, headers=headers)


def done(state: AppState, lm: LoadedModel, handle: RequestHandle | None, key, prompt_tokens: int, t0: float,
         ok: bool) -> None:
    """End of a stream, however it ended: cancel an unfinished request, cache a finished one, free the lease."""
    try:
        if handle is not None:
            if not handle.finished:
                handle.cancel()
            elif ok and not lm.retired:
                state.cache.put(key, CachedResult(handle.text, tuple(handle.output_ids), handle.finish_reason or "",
                                            prompt_tokens))
        if ok:
            state.metrics.e2e.labels(lm.name).observe(time.perf_counter() - t0)
    finally:
        state.manager.release(lm)


def stream_events(chat: bool, meta: dict, handle: RequestHandle | None, hit: CachedResult | None,
                  prompt_tokens: int, include_usage: bool, tok=None, echo_text: str = "") -> AsyncIterator[str]:
    """The SSE events of one response, from the engine's token events or from a cached result. A chat's
    first chunk (the one with ``role``) goes out with the first token, not before; a request the server
    cancelled ends with finish_reason ``abort`` (vLLM's name)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    first = [True]
    offset = [len(echo_text)]

    def chunk(text: str | None, finish: str | None, token_id: int | None = None, lp=None) -> dict:
        logprobs = None
        if lp is not None and token_id is not None:
            if chat:
                logprobs = chat_logprobs(tok, [token_id], [lp])
            else:
                logprobs = completion_logprobs(tok, [token_id], [lp], offset[0])
                offset[0] += len(logprobs["tokens"][0])
        if chat:
            delta: dict[str, Any] = {}
            if first[0]:
                delta["role"] = "assistant"
                first[0] = False
            if text is not None:
                delta["content"] = text
            c = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            c = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        out = {**meta, "object": obj, "choices": [c]}
        if include_usage:
            out["usage"] = None
        return out

    async def events() -> AsyncIterator[str]:
        if echo_text:
            yield sse(chunk(echo_text, None))
        if hit is not None:
            if hit.text:
                yield sse(chunk(hit.text, None))
            finish, completion_tokens = hit.finish_reason, hit.completion_tokens
        else:
            finish = None
            async for ev in handle:
                if ev.text or ev.logprobs is not None:
                    yield sse(chunk(ev.text, None, ev.token_id, ev.logprobs))
                if ev.finished:
                    finish = ev.finish_reason
            if finish == "error":
                yield sse(error_body(f"generation failed: {handle.error}", "server_error", code="engine_error"))
                yield sse("[DONE]")
                return
            completion_tokens = len(handle.output_ids)
        yield sse(chunk(None, "abort" if finish == "cancelled" else finish))
        if include_usage:
            yield sse({**meta, "object": obj, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        yield sse("[DONE]")

    return events()
