"""Every registered version is an MLflow Model (serve/api/mlflow_model.py): MLflow's own loaders and its scoring server
generate with the project's engine over the version's files. A real sqlite store, a real `mlflow models serve`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import mlflow
import pandas as pd
import pytest

from compress.registry import store as registry
from compress.config import load_config
from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from tasks.register import register_task


@pytest.fixture(scope="module")
def version(tiny_artifact, mlflow_store):
    registry.configure(mlflow_store)
    name = f"pyfunc-{time.time_ns()}"
    cfg = load_config(None, [f"registry.model_name={name}"])
    with mlflow.start_run() as run:
        reg = register_task.fn(cfg.registry.model_name, run.info.run_id, str(tiny_artifact), ["champion"], {"role": "candidate"})
    return name, reg.version


def _engine_text(artifact, prompt: str | list[dict], n: int) -> str:
    """Greedy text of the engine itself, for a prompt or (rendered in the model's chat template) a conversation."""
    from serve.api.chat_template import render_template, template_specials
    from serve.engine.tokenizer import encode_chat

    engine = Engine(artifact, ServeConfig(result_cache_size=0))
    try:
        m = engine.manifest
        ids = engine.encode(prompt) if isinstance(prompt, str) else encode_chat(
            engine.tokenizer, m, render_template(m["chat_template"], prompt, True,
                                                 **template_specials(engine.tokenizer, m)))
        h = engine.add_request(ids, SamplingParams.greedy(n))
        h.result()
        return h.text
    finally:
        engine.shutdown()


CONVERSATIONS = [[{"role": "user", "content": "What is a module?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a builtin."}]]


@pytest.fixture(scope="module")
def champion(version):
    name, _ = version
    return mlflow.pyfunc.load_model(f"models:/{name}@champion")


def test_signature_names_the_params_and_the_chat_task(version):
    name, _ = version
    info = mlflow.models.get_model_info(f"models:/{name}@champion")
    assert {p.name for p in info.signature.params.params} >= {"max_tokens", "temperature", "chat"}
    assert info.metadata["task"] == "llm/v1/chat"
    assert any("messages" in f for f in info.metadata["input_forms"])


def test_pyfunc_prompts_as_dataframe_list_and_string_generate_what_the_engine_does(champion, tiny_artifact):
    prompts = ["The function returns", "A module is"]
    want = [_engine_text(tiny_artifact, p, 6) for p in prompts]
    params = {"max_tokens": 6, "chat": False}
    # greedy: the server's own text (random tiny weights: any bytes, the same ones)
    assert champion.predict(pd.DataFrame({"prompt": prompts}), params=params) == want
    assert champion.predict(prompts, params=params) == want
    assert champion.predict({"prompt": prompts}, params=params) == want
    assert champion.predict(prompts[1], params=params) == want[1:]
    assert any(want)


def test_pyfunc_chat_form_one_conversation_and_many(champion, tiny_artifact):
    one = champion.predict({"messages": CONVERSATIONS[1]}, params={"max_tokens": 5})
    assert one["object"] == "chat.completion" and one["choices"][0]["message"]["role"] == "assistant"
    assert one["choices"][0]["message"]["content"] == _engine_text(tiny_artifact, CONVERSATIONS[1], 5)
    assert one["usage"]["completion_tokens"] <= 5 and one["usage"]["prompt_tokens"] > 0
    many = champion.predict(pd.DataFrame({"messages": CONVERSATIONS}), params={"max_tokens": 5})
    assert [c["choices"][0]["message"]["content"] for c in many] == [
        _engine_text(tiny_artifact, c, 5) for c in CONVERSATIONS]
    # the user's turn in the template: a prompt with chat on is the one-message conversation
    assert champion.predict(["What is a module?"], params={"max_tokens": 5}) == [
        many[0]["choices"][0]["message"]["content"]]


def test_pyfunc_names_the_forms_on_bad_input(champion):
    with pytest.raises(Exception, match="'messages' or a 'prompt' column"):
        champion.predict(pd.DataFrame({"question": ["x"]}))
    with pytest.raises(Exception, match="role"):
        champion.predict({"messages": [[{"role": "user"}]]})


def test_mlflow_models_serve_answers_the_chat_form(version, mlflow_store, tiny_artifact):
    name, _ = version
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # mlflow starts its scoring server as `uvicorn` from PATH: the environment's bin first, as an activated venv has
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_store,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/{name}@champion",
                             "--env-manager", "local", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ping", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        r = httpx.post(f"http://127.0.0.1:{port}/invocations", timeout=60,
                       json={"dataframe_split": {"columns": ["prompt"], "data": [["A module is"]]},
                             "params": {"max_tokens": 4, "chat": False}})
        assert r.status_code == 200, r.text
        preds = r.json()["predictions"]
        assert len(preds) == 1 and isinstance(preds[0], str)
        # the llm/v1/chat request MLflow's LLM tools send: messages and sampling keys at the top level
        r = httpx.post(f"http://127.0.0.1:{port}/invocations", timeout=60,
                       json={"messages": CONVERSATIONS[1], "max_tokens": 5, "temperature": 0.0})
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["content"] == _engine_text(tiny_artifact, CONVERSATIONS[1], 5)
        r = httpx.post(f"http://127.0.0.1:{port}/invocations", timeout=60,
                       json={"inputs": ["A module is"], "params": {"max_tokens": 4, "chat": False}})
        assert r.status_code == 200 and r.json()["predictions"] == [preds[0]], r.text
        r = httpx.post(f"http://127.0.0.1:{port}/invocations", timeout=60, json={"messages": [{"role": "user"}]})
        assert r.status_code == 400 and "role" in r.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_pyfunc_chat_form_passes_tools_and_response_format(champion):
    """MLflow's chat form carries tools / tool_choice / response_format as parameters (JSON text): a forced call comes back as
    tool_calls whose arguments validate, a schema constrains the answer (random weights: never JSON unconstrained),
    and a field at fault is named."""
    import json as _json

    tool = {"type": "function", "function": {"name": "zone", "parameters": {
        "type": "object", "properties": {"z": {"enum": ["UTC", "CET"]}}, "required": ["z"], "additionalProperties": False}}}
    out = champion.predict({"messages": CONVERSATIONS[0]}, params={
        "max_tokens": 100, "tools": _json.dumps([tool]), "tool_choice": "required"})
    call = out["choices"][0]["message"]["tool_calls"][0]
    assert out["choices"][0]["finish_reason"] == "tool_calls" and call["function"]["name"] == "zone"
    assert _json.loads(call["function"]["arguments"])["z"] in ("UTC", "CET")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = champion.predict({"messages": CONVERSATIONS[0]}, params={"max_tokens": 120, "response_format": _json.dumps(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})})
    assert isinstance(_json.loads(out["choices"][0]["message"]["content"])["ok"], bool)
    with pytest.raises(Exception, match="tool_choice"):
        champion.predict({"messages": CONVERSATIONS[0]}, params={"tool_choice": "required"})
