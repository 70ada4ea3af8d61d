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

from compress import registry
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
        reg = register_task.fn(cfg, run.info.run_id, str(tiny_artifact), ["champion"], {"role": "candidate"})
    return name, reg["version"]


def _engine_text(artifact, prompt: str, n: int) -> str:
    engine = Engine(artifact, ServeConfig(result_cache_size=0))
    try:
        h = engine.add_request(engine.encode(prompt), SamplingParams.greedy(n))
        h.result()
        return h.text
    finally:
        engine.shutdown()


def test_pyfunc_load_model_by_alias_generates_what_the_engine_does(version, tiny_artifact):
    name, v = version
    info = mlflow.models.get_model_info(f"models:/{name}@champion")
    assert [c["name"] for c in info.signature.inputs.to_dict()] == ["prompt"]
    assert {p.name for p in info.signature.params.params} >= {"max_tokens", "temperature", "chat"}
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    prompts = ["The function returns", "A module is"]
    got = model.predict(pd.DataFrame({"prompt": prompts}), params={"max_tokens": 6, "chat": False})
    # greedy: the server's own text (random tiny weights: any bytes, the same ones)
    assert got == [_engine_text(tiny_artifact, p, 6) for p in prompts]
    assert any(got)
    chat = model.predict({"prompt": ["hello"]}, params={"max_tokens": 4})  # in the model's chat template
    assert len(chat) == 1


def test_mlflow_models_serve_answers_a_request(version, mlflow_store):
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
    finally:
        proc.terminate()
        proc.wait(timeout=30)
