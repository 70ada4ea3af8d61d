"""Every registered version as an MLflow Model: ``mlflow.pyfunc.load_model("models:/NAME@champion")`` and
``mlflow models serve -m models:/NAME@champion --env-manager local`` generate with this project's engine.

The version's folder is the model: an ``MLmodel`` file beside the artifact's own files names a python_function
flavour whose loader is this module (``data: .``, so the ONNX files and manifest are the model's artifacts, never a
second copy). ``predict`` takes the forms MLflow users send (``INPUT_FORMS``, also in the MLmodel's metadata):

- the chat form of MLflow's LLM tools (``llm/v1/chat``): ``{"messages": [{"role": "user", "content": ...}, ...]}``
  is one conversation and returns one ``chat.completion`` dict (with the parameters ``tools``, ``tool_choice`` and
  ``response_format`` as JSON text, or as keys beside ``messages`` where MLflow's schema check does not drop them,
  read as the HTTP server reads them: tool calls come back as ``tool_calls``, a schema constrains the answer); a
  ``messages`` column (a DataFrame, a list of
  ``{"messages": [...]}`` records, or ``{"messages": [[...], [...]]}``) is one conversation a row and returns a
  list of them;
- prompts: a string, a list of strings, a DataFrame with a ``prompt`` column or ``{"prompt": [...]}``; returns a
  list of strings, each prompt rendered as the user's turn in the model's chat template when it has one and the
  ``chat`` parameter is true (the default), as plain text otherwise.

The signature's input is one column of any type, because MLflow's schema check drops a list of strings under a
named column and rejects a conversation under a string column; the forms are checked here, with an error that
names the form expected. ``max_tokens``, ``temperature``, ``top_p``, ``seed`` and ``chat`` are parameters (top-level
keys of an ``llm/v1/chat`` request to ``mlflow models serve``). Every prompt of a call goes to one in-process engine
at once (serve/engine/engine.py: continuous batching, the server's sampler).

Use the project's server (`compressor serve`) for traffic: the OpenAI API, streaming, the KV and result caches,
the alias follower. Use this where MLflow's own tools are the way in: a notebook's ``load_model``, batch scoring
(``spark_udf``, ``mlflow.models.predict``), or ``mlflow models serve`` behind an MLflow deployment.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

MLMODEL = "MLmodel"
EXAMPLE = "input_example.json"
# tools / tool_choice / response_format as JSON text ("" = off): MLflow's parameter schema takes no lists or free
# objects, and its input schema check drops keys beside "messages"
PARAMS = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "seed": 0, "chat": True, "tools": "",
          "tool_choice": "", "response_format": ""}
INPUT_FORMS = ('{"messages": [{"role": "user", "content": "..."}]}: one conversation -> one chat.completion dict',
               '{"messages": [[...], [...]]} or a DataFrame with a messages column: one conversation a row -> '
               'a list of chat.completion dicts',
               '"text", ["text", ...], {"prompt": [...]} or a DataFrame with a prompt column -> a list of strings')


def write_mlmodel(folder: str | Path, manifest: dict, run_id: str | None = None) -> Path:
    """Write MLmodel (and the input example) into ``folder``, the files of a version as they are uploaded."""
    import mlflow.pyfunc
    from mlflow.models import Model, ModelSignature
    from mlflow.types.schema import AnyType, ColSpec, ParamSchema, ParamSpec, Schema

    folder = Path(folder)
    model = Model(run_id=run_id, artifact_path="artifact")
    mlflow.pyfunc.add_to_model(model, loader_module=__name__, data=".")
    model.signature = ModelSignature(
        inputs=Schema([ColSpec(AnyType())]), outputs=Schema([ColSpec(AnyType())]),
        params=ParamSchema([ParamSpec(k, {bool: "boolean", int: "long", float: "double", str: "string"}[type(v)], v)
                            for k, v in PARAMS.items()]))
    (folder / EXAMPLE).write_text(json.dumps({"messages": [{"role": "user", "content": "What is a context manager?"}]}))
    model.saved_input_example_info = {"artifact_path": EXAMPLE, "type": "json_object"}
    # The ONNX flavour's metadata where it applies: what the graph is, for MLflow's UI and tools.
    model.metadata = {k: manifest.get(k) for k in ("family", "attention_layout", "num_layers", "vocab_size",
                                                    "kv_dtype", "exporter", "quantization") if manifest.get(k)}
    model.metadata["task"] = "llm/v1/chat"
    model.metadata["input_forms"] = list(INPUT_FORMS)
    model.save(str(folder / MLMODEL))
    return folder / MLMODEL


class EngineModel:
    """What ``mlflow.pyfunc.load_model`` returns the predict of: one engine over the version's files."""

    def __init__(self, path: str | Path):
        from serve.config import ServeConfig
        from serve.engine.engine import Engine

        self.engine = Engine(Path(path), ServeConfig(result_cache_size=0, verify_artifact=True))

    def _render(self, messages: list[dict], use=None) -> list[int]:
        from serve.api.chat_template import render_template, template_specials
        from serve.api.tools import with_tools
        from serve.engine.tokenizer import encode_chat

        m = self.engine.manifest
        messages, extra = with_tools(m["chat_template"], messages, use, lambda: self.engine.config.tool_call_format)
        text = render_template(m["chat_template"], messages, True,
                               **template_specials(self.engine.tokenizer, m), **extra)
        return encode_chat(self.engine.tokenizer, m, text)

    def _constraint(self, options: dict):
        """(ToolUse or None, GrammarSpec or None) of the chat form's ``tools`` / ``tool_choice`` /
        ``response_format`` (OpenAI's shapes, as the HTTP server reads them); ValueError naming the field."""
        if not options:
            return None, None
        from serve.api.schemas import ApiError, ChatCompletionRequest, parse
        from serve.api.structured import grammar_of, tool_use_of
        from serve.api.tools import detect_format

        try:
            body = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": ""}], **options})
            fmt = detect_format(self.engine.manifest.get("chat_template"), self.engine.config.tool_call_format)
            use = tool_use_of(body, fmt, self.engine.tokenizer)
            return use, grammar_of(body, use)
        except ApiError as e:
            raise ValueError(e.message) from None

    def _generate(self, prompts: list[list[int]], p: dict, structured=None) -> list:
        from serve.engine.sampling import SamplingParams

        sampling = SamplingParams(max_tokens=int(p["max_tokens"]), temperature=float(p["temperature"]),
                                  top_p=float(p["top_p"]), seed=int(p["seed"]), structured=structured)
        handles = [self.engine.add_request(ids, sampling) for ids in prompts]
        for h in handles:
            h.result()
            if h.error:
                raise RuntimeError(f"generation failed: {h.error}")
        return handles

    def predict(self, model_input, params: dict | None = None):
        p = {**PARAMS, **(params or {})}
        form = read_input(model_input)
        if isinstance(form, Conversations):
            if not self.engine.manifest.get("chat_template"):
                raise ValueError("this model has no chat template in its manifest: send prompts (a 'prompt' column "
                                 "or a list of strings) with chat=false instead of 'messages'")
            use, grammar = self._constraint({**form.options, **chat_options(p)})
            done = self._generate([self._render(c, use) for c in form.rows], p, grammar)
            out = [_completion(h, str(self.engine.manifest.get("source_model") or "model"), use) for h in done]
            return out[0] if form.single else out
        chat = bool(p["chat"]) and bool(self.engine.manifest.get("chat_template"))
        ids = [self._render([{"role": "user", "content": t}]) if chat else self.engine.encode(t) for t in form]
        return [h.text for h in self._generate(ids, p)]


def chat_options(params: dict) -> dict:
    """The JSON-text parameters tools / tool_choice / response_format as objects (a plain tool_choice such as
    "required" as it is); ValueError naming a parameter that is not JSON."""
    out = {}
    for k in CHAT_OPTIONS:
        v = params.get(k)
        if v in (None, ""):
            continue
        if isinstance(v, str) and not (k == "tool_choice" and v in ("none", "auto", "required")):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise ValueError(f"{k}: expected JSON text ({e})") from None
        out[k] = v
    return out


def _completion(handle, model: str, use=None) -> dict:
    """One answer in the ``llm/v1/chat`` response form (OpenAI's chat.completion); with tools, its calls."""
    message, finish = {"role": "assistant", "content": handle.text}, handle.finish_reason or "stop"
    if use is not None:
        content, calls = use.split(handle.text)
        if calls:
            message, finish = {"role": "assistant", "content": content, "tool_calls": calls}, \
                ("tool_calls" if finish == "stop" else finish)
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": len(handle.prompt_ids), "completion_tokens": len(handle.output_ids),
                      "total_tokens": len(handle.prompt_ids) + len(handle.output_ids)}}


@dataclass(frozen=True)
class Conversations:
    """Chat-form input: ``rows`` of message lists; ``single`` when it was one conversation (one answer back)."""

    rows: list[list[dict]]
    single: bool
    options: dict = field(default_factory=dict)  # tools / tool_choice / response_format of a dict input


CHAT_OPTIONS = ("tools", "tool_choice", "response_format")  # MLflow's chat form carries these beside messages


def _messages(value, where: str) -> list[dict]:
    """Messages as given: role and content (a string; null beside an assistant's tool_calls), and a tool call's
    fields (tool_calls, tool_call_id, name)."""
    def ok(m) -> bool:
        return isinstance(m, dict) and isinstance(m.get("role"), str) and (
            isinstance(m.get("content"), str) or m.get("content") is None and bool(m.get("tool_calls")))
    if not isinstance(value, (list, tuple)) or not value or not all(ok(m) for m in value):
        raise ValueError(f"{where}: expected a non-empty list of {{'role': str, 'content': str}} messages "
                         f"(got {str(value)[:120]})")
    keep = ("role", "content", "tool_calls", "tool_call_id", "name")
    return [{k: (m[k] if k != "content" else m[k] or "") for k in keep if k in m} for m in value]


def read_input(model_input) -> Conversations | list[str]:
    """Whichever form MLflow hands predict (after its schema check, a DataFrame for most), as conversations or as
    prompt strings; ValueError naming the forms accepted otherwise."""
    if isinstance(model_input, str):
        return [model_input]
    if isinstance(model_input, dict):
        import pandas as pd

        msgs = model_input.get("messages")
        if isinstance(msgs, list) and msgs and all(isinstance(m, dict) for m in msgs):
            options = {k: model_input[k] for k in CHAT_OPTIONS if model_input.get(k) is not None}
            return Conversations([_messages(msgs, "messages")], single=True, options=options)
        model_input = pd.DataFrame({k: v if isinstance(v, list) else [v] for k, v in model_input.items()})
    if hasattr(model_input, "columns"):
        cols = list(model_input.columns)
        if "messages" in cols:
            cells = [list(c) if not isinstance(c, dict) else c for c in model_input["messages"].tolist()]
            if cells and all(isinstance(c, dict) for c in cells):  # one conversation, a message a row
                return Conversations([_messages(cells, "messages")], single=True)
            return Conversations([_messages(c, f"messages[{i}]") for i, c in enumerate(cells)], single=False)
        col = "prompt" if "prompt" in cols else (cols[0] if cols == [0] else None)
        if col is None:
            raise ValueError(f"input needs a 'messages' or a 'prompt' column (got {cols}); forms: "
                             + " | ".join(INPUT_FORMS))
        values = model_input[col].tolist()
        # {"prompt": ["a", "b"]} reaches here as one row holding the list
        return [str(x) for v in values for x in (v if isinstance(v, (list, tuple)) else [v])]
    if isinstance(model_input, (list, tuple)) and all(isinstance(x, str) for x in model_input):
        return list(model_input)
    raise ValueError(f"unsupported input {type(model_input).__name__}; forms: " + " | ".join(INPUT_FORMS))


def _load_pyfunc(path: str) -> EngineModel:
    """MLflow's loader-module hook: ``path`` is the flavour's ``data`` folder, the version's own files."""
    return EngineModel(path)
