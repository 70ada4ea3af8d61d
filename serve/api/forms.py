"""What differs between /v1/completions and /v1/chat/completions: each endpoint's form.

Both endpoints run the same pipeline (serve/api/routes_openai.py: lease the model, admit each choice, answer from
the result cache or the engine, as JSON or SSE). A form is the rest: the request schema and the combinations it
refuses, how its prompts become token ids, and the shape of its choices, stream chunks and log-probs.
``CompletionForm``: a prompt, a list of prompts or token ids, echo, text choices. ``ChatForm``: messages through
the model's chat template, message choices, deltas whose first one carries the role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from serve.api.chat_template import render_chat
from serve.api.schemas import ApiError, ChatCompletionRequest, CompletionRequest
from serve.api.structured import grammar_of, tool_use_of
from serve.api.tools import ToolUse, detect_format
from serve.engine.grammar import GrammarSpec
from serve.engine.tokenizer import encode_chat, encode_prompt
from serve.registry.source import LoadedModel


@dataclass
class Prompts:
    """A request's prompts as token ids, each with its raw form (the text to echo, or the ids sent), and the
    generation settings they share."""

    items: list[tuple[list[int], Any]]
    max_tokens: int | None  # None: as long as the context allows
    logprobs: int | None
    prompt_only: bool = False  # echo with max_tokens 0: one token is run for the prompt's log-probs and dropped
    structured: GrammarSpec | None = None  # the output's constraint (serve/api/structured.py)
    tools: ToolUse | None = None  # chat: the tools offered (serve/api/tools.py)


def token_str(tok, t: int) -> str:
    return tok.decode([int(t)], skip_special_tokens=False)


def completion_logprobs(tok, ids, lps, offset: int = 0, out: dict | None = None) -> dict:
    """OpenAI's completions ``logprobs`` object; ``top_logprobs`` holds the top k and the chosen token (vLLM).
    An entry of ``lps`` that is None (the first prompt token of an echo) gives null log-probs. ``out``: extend
    that object (the prompt's, with echo) instead of a new one."""
    out = out or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, entry in zip(ids, lps):
        s = token_str(tok, t)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        lp, top = entry
        out["token_logprobs"].append(lp)
        tops = {token_str(tok, i): v for i, v in top}
        tops.setdefault(s, lp)
        out["top_logprobs"].append(tops)
    return out


def after(lp_obj: dict | None, echo_text: str) -> int:
    """The text offset of the first generated token: after the prompt's tokens (echo with logprobs), else after
    the echoed text."""
    if lp_obj and lp_obj["tokens"]:
        return lp_obj["text_offset"][-1] + len(lp_obj["tokens"][-1])
    return len(echo_text)


def echo_logprobs(tok, prompt_ids, prompt_lps) -> dict:
    """The prompt's part of an echo's ``logprobs`` (vLLM): every prompt token, null for the first."""
    return completion_logprobs(tok, prompt_ids, [None, *prompt_lps])


def chat_logprobs(tok, ids, lps) -> dict:
    """OpenAI's chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def entry(t, lp):
        s = token_str(tok, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                        for t, (lp, top) in zip(ids, lps)]}


def tool_finish(reason: str) -> str:
    """OpenAI's finish reason for an answer that is tool calls: ``tool_calls`` where the model finished them."""
    return "tool_calls" if reason == "stop" else reason


def check_stream_options(body) -> None:
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options: only allowed when stream is true", param="stream_options")


class CompletionForm:
    """/v1/completions."""

    chat: ClassVar[bool] = False
    schema: ClassVar[type] = CompletionRequest
    id_prefix: ClassVar[str] = "cmpl-"
    object: ClassVar[str] = "text_completion"
    chunk_object: ClassVar[str] = "text_completion"

    @staticmethod
    def check(body: CompletionRequest) -> None:
        """What vLLM refuses as combinations of otherwise valid fields."""
        check_stream_options(body)
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(422, "max_tokens: must be >= 1 (0 only with echo: the prompt and its log-probs alone)",
                           param="max_tokens")

    @staticmethod
    def prompts(lm: LoadedModel, body: CompletionRequest) -> Prompts:
        tok = lm.engine.tokenizer
        p = body.prompt
        items = []
        for prompt in list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]:
            # Text gets the model's BOS (manifest add_bos_token) unless add_special_tokens is false; token ids
            # are taken as sent (as vLLM does).
            if isinstance(prompt, str):
                ids = (encode_prompt(tok, lm.manifest, prompt) if body.add_special_tokens
                       else tok.encode(prompt, add_special_tokens=False).ids)
            else:
                ids = [int(t) for t in prompt]
            items.append((ids, prompt))
        # echo with logprobs: the prompt's log-probs too; max_tokens 0 runs one token and drops it
        prompt_only = body.echo and body.max_tokens == 0
        return Prompts(items, 1 if prompt_only else body.max_tokens, body.logprobs, prompt_only, grammar_of(body))

    @staticmethod
    def echo_text(body: CompletionRequest, raw, ids: list[int], tok) -> str:
        if not body.echo:
            return ""
        return (raw if isinstance(raw, str) and body.truncate_prompt_tokens is None
                else tok.decode(ids, skip_special_tokens=body.skip_special_tokens))

    @staticmethod
    def prompt_logprobs(body: CompletionRequest, logprobs: int | None) -> int | None:
        return logprobs if body.echo and logprobs is not None else None

    @staticmethod
    def choice(tok, c, result, out) -> dict:
        """A whole choice: the echo and the text, with the prompt's and the tokens' log-probs when asked."""
        lp_obj = None
        if out is not None and out.prompt_logprobs is not None:  # echo with logprobs
            lp_obj = echo_logprobs(tok, c.prompt_ids, out.prompt_logprobs)
        if out is not None and out.logprobs is not None and not c.prompt_only:
            lp_obj = completion_logprobs(tok, result.output_ids, out.logprobs, after(lp_obj, c.echo_text), lp_obj)
        return {"index": c.index, "text": c.echo_text + result.text, "logprobs": lp_obj,
                "finish_reason": result.finish_reason}

    @staticmethod
    def token_logprobs(tok, token_id: int, lp, offset: int) -> dict:
        return completion_logprobs(tok, [token_id], [lp], offset)

    @staticmethod
    def chunk_choice(index: int, text: str | None, finish: str | None, logprobs, first: bool) -> dict:
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}


class ChatForm:
    """/v1/chat/completions."""

    chat: ClassVar[bool] = True
    schema: ClassVar[type] = ChatCompletionRequest
    id_prefix: ClassVar[str] = "chatcmpl-"
    object: ClassVar[str] = "chat.completion"
    chunk_object: ClassVar[str] = "chat.completion.chunk"

    @staticmethod
    def check(body: ChatCompletionRequest) -> None:
        check_stream_options(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")

    @staticmethod
    def prompts(lm: LoadedModel, body: ChatCompletionRequest) -> Prompts:
        tools = tool_use_of(body, detect_format(lm.chat_template, lm.engine.config.tool_call_format),
                            lm.engine.tokenizer)
        structured = grammar_of(body, tools)
        text = render_chat(lm, body.messages, body.add_generation_prompt, body.continue_final_message,
                           body.chat_template_kwargs, tools)
        # The template writes the special tokens itself; BOS only if the model takes one and it did not.
        ids = encode_chat(lm.engine.tokenizer, lm.manifest, text)
        return Prompts([(ids, "")], body.max_completion_tokens or body.max_tokens,
                       (body.top_logprobs or 0) if body.logprobs else None, structured=structured, tools=tools)

    @staticmethod
    def echo_text(body: ChatCompletionRequest, raw, ids: list[int], tok) -> str:
        return ""

    @staticmethod
    def prompt_logprobs(body: ChatCompletionRequest, logprobs: int | None) -> int | None:
        return None

    @staticmethod
    def choice(tok, c, result, out) -> dict:
        lps = out.logprobs if out is not None else None
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        finish = result.finish_reason
        if c.tools is not None:
            content, calls = c.tools.split(result.text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = tool_finish(finish)
        return {"index": c.index, "message": message,
                "logprobs": chat_logprobs(tok, result.output_ids, lps) if lps is not None else None,
                "finish_reason": finish}

    @staticmethod
    def tool_calls_chunk(index: int, calls: list[dict], first: bool) -> dict:
        """The delta that carries a choice's tool calls, whole (OpenAI's stream shape, each call indexed)."""
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    @staticmethod
    def token_logprobs(tok, token_id: int, lp, offset: int) -> dict:
        return chat_logprobs(tok, [token_id], [lp])

    @staticmethod
    def chunk_choice(index: int, text: str | None, finish: str | None, logprobs, first: bool) -> dict:
        """A delta; a choice's first one carries the role (it goes out with the first token, not before)."""
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


Form = type[CompletionForm] | type[ChatForm]
