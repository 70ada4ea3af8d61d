"""The API's request bodies and errors: reading and validating JSON bodies, the OpenAI request schemas,
and the OpenAI error body every failure is reported in ({"error": {"message", "type", "param", "code"}}).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from serve.sampling import SamplingParams


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


# ---- reading a body --------------------------------------------------------------------------
async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object, refused (413) past ``limit`` bytes before it is all read."""
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
    """``data`` validated against ``schema``; a 422 ApiError naming the field as the client wrote it."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e, data) from None


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
