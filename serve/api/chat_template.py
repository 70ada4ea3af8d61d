"""The chat template: renders /v1/chat/completions messages into the prompt text the model was trained on.

The template (Jinja, Hugging Face conventions) comes from the artifact, so it runs in a sandbox.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

# At import, not at the first chat request: importing jinja2 takes ~100 ms under the import lock.
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from serve.api.schemas import ApiError, ChatMessage
from serve.api.tools import ToolUse, with_tools

if TYPE_CHECKING:  # the offline evaluator (compress/evaluate/chat.py) renders without the engine's imports
    from serve.registry.source import LoadedModel


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile_template(source: str):
    def raise_exception(message):
        raise TemplateError(message)

    # The settings Hugging Face uses for chat templates, in a sandbox: the template comes from an artifact.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    # HF's tojson: keys in the caller's order, no HTML escaping (jinja2's own sorts keys and escapes <>&'), so a
    # tool's signature reads as the model was trained on
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def template_specials(tokenizer, manifest: dict) -> dict[str, str]:
    """The special-token strings a Hugging Face chat template reads (bos_token, pad_token, eos_token), from the
    manifest's ids and the artifact's ``tokenizers`` tokenizer."""
    special = {}
    for key in ("bos_token_id", "pad_token_id"):
        tid = manifest.get(key)
        if tid is not None:
            special[key.removesuffix("_id")] = tokenizer.id_to_token(int(tid)) or ""
    eos = (manifest.get("eos_token_ids") or [None])[0]
    special["eos_token"] = tokenizer.id_to_token(int(eos)) or "" if eos is not None else ""
    return special


def render_template(source: str, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
    """A chat template rendered in the sandbox; raises jinja2.TemplateError when the template rejects the messages.
    The one rendering the server and the offline chat evaluation (compress/evaluate/chat.py) share."""
    return _compile_template(source).render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)


def render_chat(lm: LoadedModel, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict | None = None,
                tool_use: ToolUse | None = None) -> str:
    """The prompt text (with ``tool_use``: the tools offered, serve/api/tools.py). ``continue_final_message``
    (vLLM/HF): no generation prompt, and the text ends right
    after the last message's content, so the model continues it; ``template_kwargs`` are passed to the
    template (vLLM's ``chat_template_kwargs``), under the names it reserves for itself."""
    if continue_final_message and add_generation_prompt:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true",
                       param="continue_final_message")
    source = lm.chat_template
    if not source:
        raise ApiError(400, f"model {lm.name} has no chat template in its manifest; use /v1/completions",
                       param="messages", code="no_chat_template")
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in ("messages", "add_generation_prompt")}
    kwargs.update(template_specials(lm.engine.tokenizer, lm.manifest))
    msgs, extra = with_tools(source, [m.template_dict() for m in messages], tool_use,
                             lambda: lm.engine.config.tool_call_format)
    kwargs.update(extra)
    try:
        text = render_template(source, msgs, add_generation_prompt, **kwargs)
    except TemplateError as e:
        raise ApiError(400, f"the model's chat template rejected the messages: {e}", param="messages") from None
    if continue_final_message:
        last = messages[-1].text()
        at = text.rfind(last) if last else -1
        if at == -1:
            raise ApiError(400, "continue_final_message: the rendered template does not contain the last "
                           "message's content", param="continue_final_message")
        text = text[:at + len(last)]
    return text
