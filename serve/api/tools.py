"""Tool calls: how a chat model is told about tools, how it writes a call, and how the server reads one back.

A model writes tool calls in the format its chat template taught it. ``FORMATS`` holds the three families vLLM
calls hermes (Qwen2.5, Hermes, and our fallback for templates that know no tools: `<tool_call>{json}</tool_call>`),
llama3_json (Llama 3.x: a bare `{"name", "parameters"}` object) and mistral (`[TOOL_CALLS][{...}]`);
``detect_format`` picks one from the template (``serve.tool_call_format`` overrides). Each format gives:
the grammar that forces a call (``tool_choice`` ``required`` or a named function: the arguments follow the
tool's JSON schema by construction), the parser that finds calls in finished text (``tool_choice`` ``auto``),
and the text that opens a call (a stream holds text back from there, ``ToolStream``).

Templates that render tools themselves (they read a ``tools`` variable) get them as Hugging Face passes them;
others get a system message in hermes form. Earlier turns are given back the same way: an assistant message's
``tool_calls`` (arguments as objects, as HF templates expect) and ``tool`` messages.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from serve.engine.grammar import JSON_COMPACT, GrammarSpec


def call_schema(tools: Sequence[dict], args_key: str) -> dict:
    """A JSON schema that holds exactly one call of one of ``tools``: {"name": const, args_key: its parameters}."""
    alts = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        alts.append({"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
                     "required": ["name", args_key], "additionalProperties": False})
    return {"anyOf": alts, "x-guidance": JSON_COMPACT} if len(alts) > 1 else {**alts[0], "x-guidance": JSON_COMPACT}


def added_tokens(tokenizer) -> dict[str, int]:
    """The tokenizer's added tokens (text -> id): a marker such as Qwen's `<tool_call>` that is one of them is
    written by the model as that one token, which a grammar must name as a token, not as text."""
    return {t.content: int(i) for i, t in tokenizer.get_added_tokens_decoder().items()}


def _lark(text: str, markers: dict[str, int]) -> str:
    """A literal in llguidance's Lark: the token itself where ``text`` is an added token, else the string."""
    return f"<[{markers[text]}]>" if text in markers else json.dumps(text)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    opener: str  # the text a call starts with
    args_key: str  # "arguments" or "parameters"

    def grammar(self, tools: Sequence[dict], markers: dict[str, int] | None = None) -> str:
        """Lark (llguidance) for one call of one of ``tools``; ``markers``: the tokenizer's added tokens."""
        m = markers or {}
        body = f"%json {json.dumps(call_schema(tools, self.args_key))}"
        if self.name == "hermes":
            return (f'start: {_lark("<tool_call>", m)} "\\n" call "\\n" {_lark("</tool_call>", m)}\n'
                    f"call: {body}\n")
        if self.name == "mistral":
            return f'start: {_lark("[TOOL_CALLS]", m)} "[" call "]"\ncall: {body}\n'
        return f"start: call\ncall: {body}\n"

    def render_call(self, name: str, arguments: dict) -> str:
        """An earlier call as the model would have written it (templates that know no tools)."""
        obj = json.dumps({"name": name, self.args_key: arguments}, ensure_ascii=False)
        if self.name == "hermes":
            return f"<tool_call>\n{obj}\n</tool_call>"
        if self.name == "mistral":
            return f"[TOOL_CALLS][{obj}]"
        return obj

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
        """(the text before the calls or None, [(name, arguments)]); no calls when any call is not valid JSON of
        the right shape (the whole text is then the answer)."""
        at = text.find(self.opener) if self.opener else -1
        if self.name == "llama3_json":
            stripped = text.lstrip()
            at = len(text) - len(stripped) if stripped.startswith("{") else -1
        if at == -1:
            calls = bare_call(text, self.args_key)
            return (None if calls else text), calls
        head, rest = text[:at].strip() or None, text[at:]
        if self.name == "hermes":
            bodies = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", rest, flags=re.S)
        elif self.name == "mistral":
            bodies = [rest[len(self.opener):].strip()]
        else:
            bodies = [b for b in re.split(r";\s*(?=\{)", rest.strip())]  # Llama 3.2: calls joined by ';'
        calls: list[tuple[str, dict]] = []
        for b in bodies:
            try:
                obj = json.loads(b)
            except ValueError:
                return text, []
            for item in obj if isinstance(obj, list) else [obj]:
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    return text, []
                args = item.get(self.args_key, item.get("arguments", item.get("parameters", {})))
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        return text, []
                if not isinstance(args, dict):
                    return text, []
                calls.append((item["name"], args))
        return head, calls


def bare_call(text: str, args_key: str) -> list[tuple[str, dict]]:
    """A whole answer that is one call object without the format's markers: bare, in a ```json fence, or in the
    doubled braces of a template whose example shows ``{{...}}`` (Qwen2.5's GGUF template): [(name, arguments)],
    else []. Only the whole answer counts, so an answer that merely mentions JSON stays text."""
    body = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, flags=re.S)
    body = fenced.group(1) if fenced else body
    if body.startswith("{{") and body.endswith("}}"):
        body = body[1:-1]
    try:
        obj = json.loads(body)
    except ValueError:
        return []
    if not isinstance(obj, dict) or len(obj) != 2 or not isinstance(obj.get("name"), str):
        return []
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters")))
    return [(obj["name"], args)] if isinstance(args, dict) else []


FORMATS = {"hermes": ToolFormat("hermes", "<tool_call>", "arguments"),
           "llama3_json": ToolFormat("llama3_json", "{", "parameters"),
           "mistral": ToolFormat("mistral", "[TOOL_CALLS]", "arguments")}


def detect_format(template: str | None, setting: str = "auto") -> ToolFormat:
    """The format ``setting`` names, or (``auto``) the one the chat template writes; hermes when it writes none."""
    if setting != "auto":
        return FORMATS[setting]
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return FORMATS["mistral"]
    if "<tool_call>" not in t and ("<|python_tag|>" in t or "ipython" in t):
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and re.search(r"\btools\b", template) is not None


def tools_system_text(tools: Sequence[dict]) -> str:
    """The hermes instructions for a template that renders no tools."""
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions to help with the user's request. The functions, one JSON signature per line, "
            f"are within <tools></tools> tags:\n<tools>\n{sigs}\n</tools>\n\n"
            "To call a function, answer only with a JSON object holding its name and arguments within "
            "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def _arguments(raw) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        obj = json.loads(raw or "{}")
    except ValueError:
        return {"_raw": raw}
    return obj if isinstance(obj, dict) else {"_raw": raw}


def template_messages(messages: Sequence[dict], tools: Sequence[dict] | None, fmt: ToolFormat,
                      native: bool) -> list[dict]:
    """The messages as the template gets them. ``native``: the template renders tools itself (calls with
    arguments as objects, tool messages as they are). Otherwise the tools go into the system message and earlier
    calls and results are written into the text, hermes style."""
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        if native:
            if calls:
                m["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                    "function": {"name": c["function"]["name"],
                                                 "arguments": _arguments(c["function"].get("arguments"))}}
                                   for c in calls]
            out.append(m)
            continue
        if calls:
            written = "\n".join(fmt.render_call(c["function"]["name"], _arguments(c["function"].get("arguments")))
                                for c in calls)
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + written
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        m.pop("tool_call_id", None)
        m.pop("name", None)
        out.append(m)
    if tools and not native:
        text = tools_system_text(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def with_tools(source: str | None, messages: Sequence[dict], use: ToolUse | None,
               setting: Callable[[], str] = lambda: "auto") -> tuple[list[dict], dict]:
    """The messages a chat template gets and the variables to add (``tools`` for a template that renders them),
    for the tools of ``use`` and any earlier calls and tool results; the messages as they are when there are none.
    ``setting`` gives serve.tool_call_format, read only for earlier calls without tools offered now."""
    if use is None and not any("tool_calls" in m or m["role"] == "tool" for m in messages):
        return list(messages), {}
    native = template_knows_tools(source)
    fmt = use.fmt if use is not None else detect_format(source, setting())
    msgs = template_messages(messages, use.tools if use else None, fmt, native)
    return msgs, ({"tools": use.tools} if native and use is not None else {})


@dataclass
class ToolUse:
    """One chat request's tools: the format, the tools it offered and whether a call is forced."""

    fmt: ToolFormat
    tools: list[dict]
    forced: str | None = None  # "required", a function name, or None (auto)
    markers: dict[str, int] = field(default_factory=dict)  # the tokenizer's added tokens (added_tokens)
    names: frozenset[str] = field(init=False)

    def __post_init__(self):
        self.names = frozenset(t["function"]["name"] for t in self.tools)

    def grammar(self) -> GrammarSpec | None:
        if self.forced is None:
            return None
        offered = self.tools if self.forced == "required" else [t for t in self.tools
                                                                 if t["function"]["name"] == self.forced]
        return GrammarSpec("grammar", self.fmt.grammar(offered, self.markers), "tool_choice")

    def split(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, OpenAI tool_calls) of a finished answer; calls of tools that were not offered are text."""
        head, calls = self.fmt.parse(text)
        if not calls or any(name not in self.names for name, _ in calls):
            return text, []
        return head, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                       "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
                      for name, args in calls]


class ToolStream:
    """Splits a streamed answer: text before a call goes out as content as it comes; from the call's opener on,
    the text is held and parsed at the end (one tool_calls delta)."""

    def __init__(self, use: ToolUse):
        self.use = use
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> str:
        self.text += delta
        opener = self.use.fmt.opener
        if self.sent == 0 and self.text.lstrip()[:1] in ("", "{", "`"):
            return ""  # the answer may be one bare call (bare_call): hold it while it may be
        at = self.text.find(opener)
        if at != -1:
            return self._release(at)
        hold = next((k for k in range(min(len(opener) - 1, len(self.text)), 0, -1)
                     if self.text.endswith(opener[:k])), 0)
        return self._release(len(self.text) - hold)

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content not yet sent, tool_calls)."""
        head, calls = self.use.split(self.text)
        if not calls:
            return self._release(len(self.text)), []
        sent = self.text[:self.sent]
        rest = (head or "")[len(sent):] if (head or "").startswith(sent) else ""
        return rest, calls
