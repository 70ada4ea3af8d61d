"""Structured outputs on the API: a request's constraint fields made into the engine's one ``GrammarSpec``.

The fields, as OpenAI and vLLM name them: ``response_format`` (``json_object``, ``json_schema``), vLLM's
``structured_outputs`` (json / regex / choice / grammar / json_object) and its older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``; and, on chat, ``tools`` with a forced ``tool_choice``
(serve/api/tools.py). A request sets at most one of them; two are a 400 naming the second.
"""

from __future__ import annotations

import dataclasses

from serve.api.schemas import ApiError
from serve.api.tools import ToolUse, added_tokens
from serve.engine.grammar import GrammarSpec
from serve.engine.sampling import SamplingError


def _one(body) -> list[tuple[str, GrammarSpec]]:
    specs: list[tuple[str, GrammarSpec]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        specs.append(("response_format", GrammarSpec.json_schema({"type": "object"}, "response_format")))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ApiError(400, "response_format.json_schema.schema: required with type json_schema",
                           param="response_format.json_schema.schema")
        specs.append(("response_format",
                      GrammarSpec.json_schema(rf.json_schema.schema_, "response_format.json_schema.schema")))
    so = body.structured_outputs
    if so is not None:
        set_ = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                    ("grammar", so.grammar), ("json_object", so.json_object))
                if v is not None and v is not False]
        if len(set_) != 1:
            raise ApiError(400, "structured_outputs: set exactly one of json, regex, choice, grammar, json_object "
                           f"(got {[k for k, _ in set_] or 'none'})", param="structured_outputs")
        spec = _spec(*set_[0], f"structured_outputs.{set_[0][0]}")
        if so.disable_any_whitespace and spec.kind == "json":
            spec = dataclasses.replace(spec, compact=True)
        specs.append(("structured_outputs", spec))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        v = getattr(body, name)
        if v:
            specs.append((name, _spec(name.removeprefix("guided_"), v, name)))
    return specs


def _spec(kind: str, value, field: str) -> GrammarSpec:
    import json

    try:
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise SamplingError(field, f"{field}: not valid JSON: {e}") from None
            return GrammarSpec.json_schema(value, field)
        if kind == "json_object":
            return GrammarSpec.json_schema({"type": "object"}, field)
        if kind == "choice":
            return GrammarSpec.choice(value, field)
        return GrammarSpec("regex" if kind == "regex" else "grammar", value, field)
    except SamplingError as e:
        raise ApiError(400, str(e), param=e.field) from None


def grammar_of(body, tool_use: ToolUse | None = None) -> GrammarSpec | None:
    """The request's constraint, or None; a 400 when it sets two (a forced tool call counts as one)."""
    specs = _one(body)
    forced = tool_use.grammar() if tool_use is not None else None
    if forced is not None:
        specs.insert(0, ("tool_choice", forced))
    if len(specs) > 1:
        raise ApiError(400, f"{specs[1][0]}: only one constraint per request (already {specs[0][0]})",
                       param=specs[1][0])
    return specs[0][1] if specs else None


def tool_use_of(body, fmt, tokenizer) -> ToolUse | None:
    """The chat request's tools as the server uses them (None: no tools, or ``tool_choice`` none); 400s for a
    ``tool_choice`` without tools or naming a tool that is not offered, and for ``n`` > 1 with a forced call."""
    tools = [t.model_dump() for t in body.tools or []]
    choice = body.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise ApiError(400, "tool_choice: needs tools", param="tool_choice")
    if not tools or choice == "none":
        return None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: function names must be unique", param="tools")
    forced = None
    if choice == "required":
        forced = "required"
    elif choice is not None and choice != "auto":
        forced = choice.function.name
        if forced not in names:
            raise ApiError(400, f"tool_choice.function.name: {forced!r} is not one of the tools ({names})",
                           param="tool_choice.function.name")
    if forced is not None and body.n > 1:
        raise ApiError(400, "n: must be 1 when tool_choice forces a call", param="n")
    return ToolUse(fmt, tools, forced, added_tokens(tokenizer) if forced is not None else {})
