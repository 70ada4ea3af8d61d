"""OpenAI-compatible HTTP API over the engine: completions, chat, SSE streaming, models, health, metrics, admin.

    app = create_app("models:/smollm2-135m@champion", ServeConfig())   # or an artifact folder
    uvicorn.run(app, host="127.0.0.1", port=8000)

Every request leases the model that is current when it arrives (serve/model_source.py)
and keeps it until its last byte is sent, so a live swap never cuts a response short.
Errors use OpenAI's body: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from compress.config import ServeConfig
from serve.engine import RequestHandle
from serve.metrics import CONTENT_TYPE, ServerMetrics
from serve.model_source import LoadedModel, ModelManager, NotReadyError
from serve.result_cache import CachedResult, ResultCache, cache_key
from serve.sampling import SamplingError, SamplingParams
from serve.scheduler import AdmissionError, QueueFullError, RequestTooLargeError

log = logging.getLogger(__name__)

OWNED_BY = "compressor"


# ---- errors ----------------------------------------------------------------------------------
class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status,
                            headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _field_path(loc: tuple, data: Any, missing: bool) -> str | None:
    """The error's location as the client wrote it: pydantic adds union member names ("stop.str")."""
    parts, node = [], data
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            if missing and isinstance(node, dict):
                parts.append(str(part))
            break
        parts.append(str(part))
    return ".".join(parts) or None


def _validation_error(e: ValidationError, data: Any) -> ApiError:
    err = e.errors()[0]
    param = _field_path(err["loc"], data, err["type"] == "missing")
    got = err.get("input")
    got_s = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    msg = err["msg"].removeprefix("Value error, ")
    return ApiError(422, f"{param}: {msg}{got_s}{more}", "invalid_request_error", param, err["type"])


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate_path(data: Any) -> str | None:
    """The dotted path of the first string (or key) that is not valid Unicode, else None (iterative:
    the body may be nested as deep as json.loads allows)."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return path
            continue
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in reversed(list(items)):
            k_s = str(k).encode("utf-8", "backslashreplace").decode()  # the path goes into the error body
            sub = f"{path}.{k_s}" if path else k_s
            stack.append((v, sub))
            if isinstance(k, str):
                stack.append((k, sub))
    return None


# ---- request schemas -------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    # Unknown fields are ignored (clients send extras such as `user`); fields we cannot honour are refused below.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # -1 (vLLM) and 0 both mean off
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("not supported (use repetition_penalty)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("not supported")
        return v

    def sampling(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=max(self.top_k, 0),
                              top_p=self.top_p, seed=self.seed, repetition_penalty=self.repetition_penalty,
                              stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("logprobs", "suffix")
    @classmethod
    def _unsupported(cls, v):
        if v:
            raise ValueError("not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("one prompt per request is supported (got a batch of "
                                 f"{len(v)}); send them as separate requests")
            v = v[0]
        if isinstance(v, str) and v == "" or isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        return v


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("not supported")
        return v


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    force: bool = False


# ---- chat template ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _compile_template(source: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    # The settings Hugging Face uses for chat templates, in a sandbox: the template comes from an artifact.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def render_chat(lm: LoadedModel, messages: list[ChatMessage]) -> str:
    source = lm.chat_template
    if not source:
        raise ApiError(400, f"model {lm.name} has no chat template in its manifest; use /v1/completions",
                       param="messages", code="no_chat_template")
    from jinja2 import TemplateError

    tok = lm.engine.tokenizer
    special = {}
    for key in ("bos_token_id", "pad_token_id"):
        tid = lm.manifest.get(key)
        if tid is not None:
            special[key.removesuffix("_id")] = tok.id_to_token(int(tid)) or ""
    eos = (lm.manifest.get("eos_token_ids") or [None])[0]
    special["eos_token"] = tok.id_to_token(int(eos)) or "" if eos is not None else ""
    try:
        return _compile_template(source).render(messages=[{"role": m.role, "content": m.text()} for m in messages],
                                                add_generation_prompt=True, **special)
    except TemplateError as e:
        raise ApiError(400, f"the model's chat template rejected the messages: {e}", param="messages") from None


# ---- SSE -------------------------------------------------------------------------------------
# Line breaks to str.splitlines (and so to httpx's iter_lines) that JSON leaves unescaped: an SSE
# event whose text holds one would reach such clients cut in two. Escaped, the JSON is the same.
_SPLITLINES_EXTRA = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict | str) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False).translate(_SPLITLINES_EXTRA)
    return f"data: {text}\n\n"


class DisconnectAwareStream(StreamingResponse):
    """Streams while listening for the client going away; either way the body iterator is closed,
    so its ``finally`` cancels the engine request and frees its KV blocks at once (starlette's own
    ASGI>=2.4 path only notices a disconnect at the next send and leaves the generator to the GC)."""

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:
            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away while we were sending
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()
        await self.body_iterator.aclose()


# ---- the app ---------------------------------------------------------------------------------
class _Unset:
    pass


def create_app(model: str | ModelManager, config: ServeConfig | None = None, *, tracking_uri: str | None = None,
               served_name: str | None = None, admin_token: str | None | type[_Unset] = _Unset) -> FastAPI:
    """The ASGI app. ``model``: models:/NAME@alias, models:/NAME/VERSION, an artifact folder, or a
    ModelManager (already loaded, e.g. by the CLI). ``admin_token``: default from the environment
    variable named by ``serve.admin_token_env``; None or "" turns /admin/* off. ``served_name``: the
    model id clients use (default: the registered model name or the folder name)."""
    config = config or ServeConfig()
    manager = (model if isinstance(model, ModelManager)
               else ModelManager(model, config, tracking_uri=tracking_uri, served_name=served_name))
    cache = ResultCache(config.result_cache_size)
    manager.on_swap.append(lambda new, old: cache.clear())
    metrics = ServerMetrics(manager, cache)
    token = os.environ.get(config.admin_token_env) if admin_token is _Unset else admin_token
    token = token or None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = None
        if not manager.ready:
            loader = asyncio.get_running_loop().run_in_executor(None, manager.load_until_ready)
        manager.start_polling()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(manager.shutdown)
            if loader is not None:
                await loader

    app = FastAPI(title="compressor OpenAI-compatible server", lifespan=lifespan)
    app.state.manager, app.state.cache, app.state.metrics, app.state.config = manager, cache, metrics, config

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), e.status_code, headers=getattr(e, "headers", None))

    app.add_middleware(_CountRequests, counter=metrics.requests)

    # ---- plumbing ----
    async def read_json(request: Request) -> dict:
        limit = config.max_request_bytes
        declared = request.headers.get("content-length")
        too_big = ApiError(413, f"the request body exceeds serve.max_request_bytes={limit} bytes",
                           code="request_too_large")
        if declared and declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise too_big
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:  # ValueError: bad JSON or UTF-8, an int over 4300 digits
            if isinstance(e, RecursionError):
                e = "nested too deeply"
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        if _SURROGATE.search(raw):
            bad = _lone_surrogate_path(data)
            if bad is not None:  # JSON allows "\ud800"; the tokenizer cannot encode it
                raise ApiError(400, f"{bad or 'the body'}: a string holds a lone UTF-16 surrogate escape "
                               "(\\ud800-\\udfff); send valid Unicode text", param=bad or None,
                               code="invalid_unicode")
        return data

    def parse(schema: type[BaseModel], data: dict):
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e, data) from None

    def lease() -> LoadedModel:
        try:
            return manager.acquire()
        except NotReadyError as e:
            raise ApiError(503, f"no model is loaded yet: {e}", "service_unavailable", code="model_not_ready",
                           headers={"Retry-After": "1"}) from None

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
        t0 = time.perf_counter()
        body = parse(ChatCompletionRequest if chat else CompletionRequest, await read_json(request))
        lm = lease()
        try:
            check_model(lm, body.model)
            if chat:
                text = render_chat(lm, body.messages)
                # The template writes the special tokens itself; the tokenizer must not add a second BOS.
                prompt_ids = lm.engine.tokenizer.encode(text, add_special_tokens=False).ids
                max_tokens = body.max_completion_tokens or body.max_tokens
                if max_tokens is None:
                    # OpenAI's chat default: as long as the context allows (and the KV pool can ever hold).
                    bm = lm.engine.block_manager
                    room = min(lm.engine.max_model_len, bm.num_blocks * bm.block_size)
                    max_tokens = max(1, room - len(prompt_ids))
            else:
                prompt = body.prompt
                prompt_ids = lm.engine.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
                max_tokens = body.max_tokens
            params = body.sampling(max_tokens)
            try:
                params.validate()
            except SamplingError as e:
                field = str(e).split(" ", 1)[0]
                raise ApiError(400, str(e), param=field) from None
            key = cache_key(lm.key, prompt_ids, params)
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
            gen = _stream(chat, meta, handle, hit, len(prompt_ids), include_usage)
            # no-cache / no buffering: proxies must pass each event on as it comes
            headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return DisconnectAwareStream(_finally(gen, lambda ok: done(lm, handle, key, len(prompt_ids), t0, ok)),
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
                if not lm.retired:  # an answer from a swapped-out model would only occupy space
                    cache.put(key, result)
            else:
                result = hit
            metrics.e2e.labels(lm.name).observe(time.perf_counter() - t0)
        finally:
            manager.release(lm)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                      "finish_reason": result.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
            obj = "text_completion"
        return JSONResponse({**meta, "object": obj, "choices": [choice],
                             "usage": usage(len(prompt_ids), result.completion_tokens)}, headers=headers)

    def done(lm: LoadedModel, handle: RequestHandle | None, key, prompt_tokens: int, t0: float, ok: bool) -> None:
        """End of a stream, however it ended: cancel an unfinished request, cache a finished one, free the lease."""
        try:
            if handle is not None:
                if not handle.finished:
                    handle.cancel()
                elif ok and not lm.retired:
                    cache.put(key, CachedResult(handle.text, tuple(handle.output_ids), handle.finish_reason or "",
                                                prompt_tokens))
            if ok:
                metrics.e2e.labels(lm.name).observe(time.perf_counter() - t0)
        finally:
            manager.release(lm)

    def _stream(chat: bool, meta: dict, handle: RequestHandle | None, hit: CachedResult | None,
                prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None, first: bool = False) -> dict:
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            out = {**meta, "object": obj, "choices": [c]}
            if include_usage:
                out["usage"] = None
            return out

        async def events() -> AsyncIterator[str]:
            if chat:
                yield sse(chunk("", None, first=True))
            if hit is not None:
                if hit.text:
                    yield sse(chunk(hit.text, None))
                finish, completion_tokens = hit.finish_reason, hit.completion_tokens
            else:
                finish = None
                async for ev in handle:
                    if ev.text:
                        yield sse(chunk(ev.text, None))
                    if ev.finished:
                        finish = ev.finish_reason
                if finish == "error":
                    yield sse(error_body(f"generation failed: {handle.error}", "server_error", code="engine_error"))
                    yield sse("[DONE]")
                    return
                completion_tokens = len(handle.output_ids)
            yield sse(chunk(None, finish))
            if include_usage:
                yield sse({**meta, "object": obj, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
            yield sse("[DONE]")

        return events()

    # ---- endpoints ----
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    def model_card(lm: LoadedModel) -> dict:
        return {"id": lm.name, "object": "model", "created": int(lm.loaded_at), "owned_by": OWNED_BY,
                "version": lm.version, "alias": lm.alias, "uri": lm.uri, "max_model_len": lm.engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        lm = manager.current
        return {"object": "list", "data": [model_card(lm)] if lm is not None else []}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        lm = manager.current
        if lm is None or model_id not in (lm.name, lm.uri):
            raise ApiError(404, f"the model {model_id!r} does not exist", "not_found_error", "model",
                           "model_not_found")
        return model_card(lm)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        lm = manager.current
        if lm is None:
            return JSONResponse({"status": "loading", "error": manager.last_error}, 503, headers={"Retry-After": "1"})
        return {"status": "ready", "model": lm.name, "version": lm.version}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/admin/reload")
    async def admin_reload(request: Request):
        if token is None:
            # Off unless an operator configured a token: indistinguishable from a missing route.
            raise ApiError(404, "admin endpoints are off; set the environment variable "
                           f"{config.admin_token_env} to enable them", "not_found_error")
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise ApiError(401, "missing or wrong bearer token", "authentication_error",
                           headers={"WWW-Authenticate": "Bearer"})
        has_body = request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers
        body = parse(ReloadRequest, await read_json(request)) if has_body else ReloadRequest()
        result = await anyio.to_thread.run_sync(manager.reload, body.force)
        out = {"changed": result.changed, "version": result.version, "previous": result.previous,
               "error": result.error}
        if result.error:
            return JSONResponse({**out, **error_body(result.error, "server_error", code="model_load_failed")}, 500)
        return out

    return app


async def _finally(gen: AsyncIterator[str], on_end) -> AsyncIterator[str]:
    """Run ``on_end(completed)`` once the stream ends, is cancelled or the client disconnects."""
    ok = False
    try:
        async for item in gen:
            yield item
        ok = True
    finally:
        try:
            await gen.aclose()
        finally:
            on_end(ok)


class _CountRequests:
    """Pure ASGI middleware (it must not buffer streams): counts responses by route and status."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.counter.labels(path, str(status["code"])).inc()
