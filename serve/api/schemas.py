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

from serve.engine.sampling import SamplingParams


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
# vLLM/OpenAI parameters this server does not implement: refused (400, code unsupported_parameter) unless
# absent or at a value that changes nothing (name -> is the value harmless). Nothing is accepted and ignored.
def _off(v) -> bool:
    return v is None or v is False or v == [] or v == {} or v == ""


UNSUPPORTED_PARAMS: dict[str, Any] = {
    "best_of": lambda v: v in (None, 1),  # n > 1 is honoured; best_of (rank by log-prob) is not
    "suffix": _off,
    "use_beam_search": _off,
    "length_penalty": lambda v: v in (None, 1, 1.0),
    "prompt_logprobs": _off,
    # constrained decoding runs on llguidance alone (serve/engine/grammar.py)
    "guided_decoding_backend": lambda v: v in (None, "", "auto", "guidance", "llguidance"),
    "guided_whitespace_pattern": _off, "structural_tag": _off,
    "functions": _off,
    "function_call": lambda v: v in (None, "none"),
    "logits_processors": _off,
    "allowed_token_ids": _off,
    "bad_words": _off,
    "spaces_between_special_tokens": lambda v: v in (None, True),
    "return_tokens_as_token_ids": _off,
    "prompt_embeds": _off,
    "documents": _off,
    "chat_template": _off,
    "mm_processor_kwargs": _off,
    "priority": lambda v: v in (None, 0),
    "modalities": lambda v: v in (None, ["text"]),
    "audio": _off,
    "prediction": _off,
    "reasoning_effort": _off,
    "web_search_options": _off,
    "store": _off,
}
UNSUPPORTED_COMPLETION_PARAMS: dict[str, Any] = {
    "tools": _off,  # tool calls are a chat feature
    "tool_choice": lambda v: v in (None, "none"),
}
UNSUPPORTED_CHAT_PARAMS: dict[str, Any] = {
    "echo": _off,  # vLLM's chat echo (repeat the last message) is not implemented
    "add_special_tokens": _off,  # chat default False: the template writes the special tokens
}


def refuse_unsupported(data: dict, chat: bool) -> None:
    """A 400 naming the first parameter this server does not implement, if the body sets one."""
    table = {**UNSUPPORTED_PARAMS, **(UNSUPPORTED_CHAT_PARAMS if chat else UNSUPPORTED_COMPLETION_PARAMS)}
    for name, harmless in table.items():
        if name in data and not harmless(data[name]):
            raise ApiError(400, f"{name}: not supported by this server (got {data[name]!r}); see "
                           "docs/serving-api.md for the parameters it honours", param=name,
                           code="unsupported_parameter")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of json / regex / choice / grammar / json_object."""
    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: None = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: ToolFunction


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


class _SamplingRequest(BaseModel):
    # Unknown fields are ignored (clients send extras such as `user`); known vLLM/OpenAI parameters this
    # server does not implement are refused by refuse_unsupported before parsing.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # -1 (vLLM) and 0 both mean off
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    # constrained decoding (serve/api/structured.py): at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        if v:
            for k, b in v.items():
                if not k.strip().isdigit():
                    raise ValueError(f"keys must be token ids (got {k!r})")
                if not -100 <= b <= 100:
                    raise ValueError(f"biases must be in [-100, 100] (got {b!r} for {k})")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v):
        if v == 0:
            raise ValueError("must be >= 1, or -1 for the model's context")
        return v

    def sampling(self, max_tokens: int, logprobs: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=max(self.top_k, 0),
                              top_p=self.top_p, seed=self.seed, repetition_penalty=self.repetition_penalty,
                              stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                              min_tokens=self.min_tokens, min_p=self.min_p, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty,
                              logit_bias={int(k): float(b) for k, b in (self.logit_bias or {}).items()},
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens, logprobs=logprobs)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # null: as long as the context allows; 0 only with echo
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    add_special_tokens: bool = True  # False: a text prompt gets no BOS

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        many = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        for p in many:
            if isinstance(p, str) and p == "" or isinstance(p, list) and not p:
                raise ValueError("the prompt is empty")
        return v


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    def template_dict(self) -> dict:
        """The message as a chat template reads it (HF conventions)."""
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d

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
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    force: bool = False


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a ``prompt`` (BOS as /v1/completions adds it) or ``messages`` (as /v1/chat/completions
    renders them)."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
