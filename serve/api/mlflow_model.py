"""Every registered version as an MLflow Model: ``mlflow.pyfunc.load_model("models:/NAME@champion")`` and
``mlflow models serve -m models:/NAME@champion --env-manager local`` generate with this project's engine.

The version's folder is the model: an ``MLmodel`` file beside the artifact's own files names a python_function
flavour whose loader is this module (``data: .``, so the ONNX files and manifest are the model's artifacts, never a
second copy), with a signature (a ``prompt`` string column in, a ``text`` string column out; ``max_tokens``,
``temperature``, ``top_p``, ``seed`` and ``chat`` as parameters) and an input example. ``predict`` sends every
prompt to one in-process engine at once (serve/engine/engine.py: continuous batching, the server's sampler), rendered with
the model's chat template when it has one and ``chat`` is true (each prompt the user's turn), as text otherwise.

Use the project's server (`compressor serve`) for traffic: the OpenAI API, streaming, the KV and result caches,
the alias follower. Use this where MLflow's own tools are the way in: a notebook's ``load_model``, batch scoring
(``spark_udf``, ``mlflow.models.predict``), or ``mlflow models serve`` behind an MLflow deployment.
"""

from __future__ import annotations

import json
from pathlib import Path

MLMODEL = "MLmodel"
EXAMPLE = "input_example.json"
PARAMS = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "seed": 0, "chat": True}


def write_mlmodel(folder: str | Path, manifest: dict, run_id: str | None = None) -> Path:
    """Write MLmodel (and the input example) into ``folder``, the files of a version as they are uploaded."""
    import mlflow.pyfunc
    from mlflow.models import Model, ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    folder = Path(folder)
    model = Model(run_id=run_id, artifact_path="artifact")
    mlflow.pyfunc.add_to_model(model, loader_module=__name__, data=".")
    model.signature = ModelSignature(
        inputs=Schema([ColSpec("string", "prompt")]), outputs=Schema([ColSpec("string", "text")]),
        params=ParamSchema([ParamSpec(k, {bool: "boolean", int: "long", float: "double"}[type(v)], v)
                            for k, v in PARAMS.items()]))
    (folder / EXAMPLE).write_text(json.dumps({"columns": ["prompt"], "data": [["What is a context manager?"]]}))
    model.saved_input_example_info = {"artifact_path": EXAMPLE, "type": "dataframe", "pandas_orient": "split"}
    # The ONNX flavour's metadata where it applies: what the graph is, for MLflow's UI and tools.
    model.metadata = {k: manifest.get(k) for k in ("family", "attention_layout", "num_layers", "vocab_size",
                                                    "kv_dtype", "exporter", "quantization") if manifest.get(k)}
    model.save(str(folder / MLMODEL))
    return folder / MLMODEL


class EngineModel:
    """What ``mlflow.pyfunc.load_model`` returns the predict of: one engine over the version's files."""

    def __init__(self, path: str | Path):
        from serve.config import ServeConfig
        from serve.engine.engine import Engine

        self.engine = Engine(Path(path), ServeConfig(result_cache_size=0, verify_artifact=True))

    def _ids(self, prompt: str, chat: bool) -> list[int]:
        from serve.api.chat_template import render_template, template_specials
        from serve.engine.tokenizer import encode_chat

        m = self.engine.manifest
        if chat and m.get("chat_template"):
            text = render_template(m["chat_template"], [{"role": "user", "content": prompt}], True,
                                   **template_specials(self.engine.tokenizer, m))
            return encode_chat(self.engine.tokenizer, m, text)
        return self.engine.encode(prompt)

    def predict(self, model_input, params: dict | None = None) -> list[str]:
        from serve.engine.sampling import SamplingParams

        p = {**PARAMS, **(params or {})}
        prompts = _prompts(model_input)
        sampling = SamplingParams(max_tokens=int(p["max_tokens"]), temperature=float(p["temperature"]),
                                  top_p=float(p["top_p"]), seed=int(p["seed"]))
        handles = [self.engine.add_request(self._ids(t, bool(p["chat"])), sampling) for t in prompts]
        out = []
        for h in handles:
            h.result()
            out.append(h.text)
        return out


def _prompts(model_input) -> list[str]:
    """The prompts of whatever MLflow hands predict: a DataFrame with a ``prompt`` column, a dict of lists, a list
    of strings, one string."""
    if hasattr(model_input, "columns"):
        if "prompt" not in model_input.columns:
            raise ValueError(f"input needs a 'prompt' column (got {list(model_input.columns)})")
        return [str(x) for x in model_input["prompt"].tolist()]
    if isinstance(model_input, dict):
        v = model_input.get("prompt")
        if v is None:
            raise ValueError(f"input needs a 'prompt' key (got {list(model_input)})")
        return [v] if isinstance(v, str) else [str(x) for x in v]
    if isinstance(model_input, str):
        return [model_input]
    return [str(x) for x in model_input]


def _load_pyfunc(path: str) -> EngineModel:
    """MLflow's loader-module hook: ``path`` is the flavour's ``data`` folder, the version's own files."""
    return EngineModel(path)
