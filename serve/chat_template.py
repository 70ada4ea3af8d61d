"""The chat template: renders /v1/chat/completions messages into the prompt text the model was trained on.

The template (Jinja, Hugging Face conventions) comes from the artifact, so it runs in a sandbox.
"""

from __future__ import annotations

import functools

from serve.api_schemas import ApiError, ChatMessage
from serve.model_source import LoadedModel


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
