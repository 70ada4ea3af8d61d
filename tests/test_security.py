"""Security: loopback bind by default, the admin bearer token (constant-time comparison, off without a
token), bounded request bodies and prompts, nothing pickled is ever loaded, trust_remote_code off unless
the config turns it on, and the chat template runs in a sandbox. See docs/reliability.md."""

from __future__ import annotations

import hmac
import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from compress.config import ModelConfig, PipelineConfig, ServeConfig, load_config, project_root
from serve.__main__ import build_parser
from serve.api.app import create_app
from serve.api.background import BackgroundServer
from served import on_socket, serve_cfg

pytestmark = pytest.mark.timeout(120)

TOKEN = "s3cret-admin-token-for-tests"
LIMIT = 4096  # serve.max_request_bytes in this file's server
ROOT = project_root()
LOOPBACK = ("127.0.0.1", "localhost", "::1")


cfg = serve_cfg


@pytest.fixture(scope="module")
def server(tiny_artifact):
    app = create_app(str(tiny_artifact), cfg(max_request_bytes=LIMIT), admin_token=TOKEN)
    with on_socket(app) as srv:
        yield srv


# ---- bind address ------------------------------------------------------------------------------------
def test_the_server_binds_loopback_unless_told_otherwise(monkeypatch, caplog, tiny_artifact):
    import uvicorn

    import serve.api.app
    import serve.registry.source

    assert ServeConfig().host == "127.0.0.1" and PipelineConfig().serve.host == "127.0.0.1"
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        assert load_config(path).serve.host in LOOPBACK, path
    args = build_parser().parse_args(["--model", str(tiny_artifact)])
    assert args.host is None  # no CLI default that would override serve.host

    bound = []

    class FakeManager:
        def __init__(self, *a, **kw):
            pass

        def load_initial(self):
            return SimpleNamespace(name="m", version=None, path="p")

    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, **kw: bound.append((host, port)))
    monkeypatch.setattr(serve.registry.source, "ModelManager", FakeManager)
    monkeypatch.setattr(serve.api.app, "create_app", lambda *a, **kw: object())
    from serve.__main__ import run

    assert run(args) == 0
    assert bound[-1] == ("127.0.0.1", 8000)
    with caplog.at_level(logging.WARNING, logger="serve"):
        assert run(build_parser().parse_args(["--model", str(tiny_artifact), "--host", "0.0.0.0"])) == 0
    assert bound[-1][0] == "0.0.0.0"
    assert "no authentication" in caplog.text  # binding beyond loopback is said out loud
    srv = BackgroundServer(object())  # binds its socket in the constructor; not started
    try:
        assert srv.host == "127.0.0.1"
    finally:
        srv.sock.close()


# ---- admin token -------------------------------------------------------------------------------------
@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer wrong", f"Basic {TOKEN}",
                                    f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", f"Bearer  {TOKEN}",
                                    f"Token {TOKEN}", f"{TOKEN}"])
def test_admin_refuses_a_missing_or_wrong_token(http, header):
    headers = {} if header is None else {"Authorization": header}
    r = http.post("/admin/reload", headers=headers)
    assert r.status_code in (401, 403), r.text
    assert r.headers.get("www-authenticate") == "Bearer"
    assert r.json()["error"]["type"] == "authentication_error"


def test_admin_token_check_survives_non_ascii_headers(server):
    # Header bytes are latin-1 on the wire; a non-ASCII guess must be a 401, not a 500.
    raw = b"Bearer " + "jalape\u00f1o-\u00ff".encode("latin-1")
    r = httpx.post(server.url + "/admin/reload", headers=[(b"Authorization", raw)], timeout=30)
    assert r.status_code == 401


def test_admin_compares_the_token_in_constant_time(http, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)  # serve.api.app calls hmac.compare_digest
    assert http.post("/admin/reload", headers={"Authorization": "Bearer guess"}).status_code == 401
    assert calls and {calls[-1][0], calls[-1][1]} == {b"guess", TOKEN.encode()}
    calls.clear()
    r = http.post("/admin/reload", headers={"Authorization": f"bearer {TOKEN}"})  # the scheme is case-insensitive
    assert r.status_code == 200 and r.json()["changed"] is False
    assert calls and calls[-1][0] == calls[-1][1] == TOKEN.encode()


def test_admin_is_off_without_a_token(tiny_artifact, monkeypatch):
    from fastapi.testclient import TestClient  # no lifespan (no `with`): nothing is loaded, the routes answer

    for env in (None, ""):
        if env is None:
            monkeypatch.delenv("COMPRESSOR_ADMIN_TOKEN", raising=False)
        else:
            monkeypatch.setenv("COMPRESSOR_ADMIN_TOKEN", env)
        c = TestClient(create_app(str(tiny_artifact), cfg()))
        for h in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer anything"}):
            r = c.post("/admin/reload", headers=h)
            assert r.status_code == 404 and "admin endpoints are off" in r.json()["error"]["message"]
    monkeypatch.setenv("COMPRESSOR_ADMIN_TOKEN", "from-env")
    c = TestClient(create_app(str(tiny_artifact), cfg()))
    assert c.post("/admin/reload", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert c.post("/admin/reload", headers={"Authorization": "Bearer from-env"}).status_code != 401


# ---- bounded bodies and prompts ----------------------------------------------------------------------
def test_request_bodies_are_bounded(http):
    big = json.dumps({"prompt": "x" * LIMIT}).encode()
    r = http.post("/v1/completions", content=big)  # declared Content-Length over the limit
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert f"max_request_bytes={LIMIT}" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: chunked transfer, counted as it arrives
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"y" * 128
        yield b'"}'

    r = http.post("/v1/completions", content=chunks())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = http.post("/admin/reload", content=big, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 413
    ok = json.dumps({"prompt": "z", "max_tokens": 2, "stop": ["q" * (LIMIT - 200)]}).encode()
    assert len(ok) < LIMIT and http.post("/v1/completions", content=ok).status_code == 200


def test_prompt_length_is_bounded_by_the_context(http):
    for body in ({"prompt": "word " * 700, "max_tokens": 1},  # ~2000 tokens in < LIMIT bytes
                 {"prompt": [1 + i % 500 for i in range(600)], "max_tokens": 1},
                 {"prompt": "hi", "max_tokens": 513}):
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "context of 512 tokens" in err["message"]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 700}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


# ---- what gets loaded --------------------------------------------------------------------------------
SCANNED = ["compress", "serve", "tasks", "flows", "loadtest", "benchmarks", "tests"]
FORBIDDEN = {
    r"\bpickle\.loads?\(": "pickle.load",
    r"\b(c?Pickle|dill|cloudpickle|joblib|marshal)\.loads?\(": "a pickle-family loader",
    r"\ballow_pickle\s*=\s*True": "allow_pickle=True",
    r"\btrust_remote_code\s*=\s*True": "trust_remote_code=True hard-coded",
    r"\bweights_only\s*=\s*False": "weights_only=False",
    r"\buse_safetensors\s*=\s*False": "use_safetensors=False",
    r"\byaml\.(unsafe_)?load\((?![^)]*SafeLoader)": "yaml.load without SafeLoader (use yaml.safe_load)",
    r"(?<![\w.])(eval|exec)\(": "eval/exec",
    r"\bimport\s+(pickle|dill|cloudpickle|joblib)\b": "a pickle-family import",
}


def _python_files():
    for d in SCANNED:
        for p in sorted((ROOT / d).rglob("*.py")):
            if p.name != "test_security.py":
                yield p


def test_no_pickle_or_remote_code_anywhere_in_the_code_base():
    found = []
    for p in _python_files():
        text = p.read_text()
        for m in re.finditer(r"\btorch\.load\(", text):
            call = text[m.end():m.end() + 300].split("\n\n", 1)[0]
            if not re.search(r"weights_only\s*=\s*True", call):
                found.append(f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: torch.load without "
                             f"weights_only=True")
        for pat, what in FORBIDDEN.items():
            for m in re.finditer(pat, text):
                found.append(f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {what}")
    assert not found, "\n".join(found)
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        assert load_config(path).model.trust_remote_code is False, path


def test_trust_remote_code_is_off_unless_the_config_turns_it_on(monkeypatch):
    import transformers

    from compress.loading import models

    def load_from_config(cfg: ModelConfig):
        return models.load_teacher(cfg.source, cfg.gguf_file, cfg.cache_dir, cfg.revision, cfg.trust_remote_code)

    seen = []

    class Stop(Exception):
        pass

    def fake(kind):
        def from_pretrained(*a, **kw):
            seen.append((kind, kw.get("trust_remote_code")))
            if kind == "model":
                raise Stop
            return SimpleNamespace()
        return from_pretrained

    monkeypatch.setattr(models, "resolve_source", lambda *a, **kw: "some/folder")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake("tokenizer"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake("model"))
    assert ModelConfig().trust_remote_code is False
    with pytest.raises(Stop):
        load_from_config(ModelConfig(source="some/folder"))
    assert seen == [("tokenizer", False), ("model", False)]
    seen.clear()
    with pytest.raises(Stop):
        load_from_config(load_config(None, ["model.source=x", "model.trust_remote_code=true"]).model)
    assert seen == [("tokenizer", True), ("model", True)]


class _Trap:
    """Unpickling this writes a marker file: proof that something unpickled the artifact."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path(self.marker).write_text, ("unpickled",))


def test_the_server_never_unpickles_anything_in_an_artifact(tiny_artifact, tmp_path):
    import pickle as pkl  # only to build the trap  # noqa: F401 (scanned files exclude this one)

    from compress.artifact import read_manifest, write_manifest
    from serve.engine.engine import Engine
    from serve.engine.sampling import SamplingParams

    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    marker = tmp_path / "marker"
    for name in ("pytorch_model.bin", "model.pkl", "training_args.bin", "golden.pt"):
        (art / name).write_bytes(pkl.dumps(_Trap(str(marker))))
    fields = read_manifest(art, verify=False)
    fields.pop("files"), fields.pop("manifest_version")
    write_manifest(art, fields)  # the trap files are listed and hashed like any other
    with Engine(art, cfg()) as eng:
        assert len(eng.generate("hello", SamplingParams.greedy(4), timeout=60)) == 4
    assert not marker.exists()


def test_serve_imports_neither_torch_nor_transformers():
    code = ("import sys, serve.api.app, serve.engine.engine, serve.registry.source, serve.__main__, serve.config, "
            "serve.artifact, serve.registry.client; "
            "print(sorted(m for m in ('torch', 'transformers', 'compress') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch pwned').read() }}",
    "{% for m in messages %}{{ m.__class__.__init__.__globals__ }}{% endfor %}",
    "{{ raise_exception('refused by the template') }}",
])
def test_the_chat_template_runs_in_a_sandbox(template, tmp_path, monkeypatch):
    from serve.api.app import ApiError, ChatMessage, render_chat

    monkeypatch.chdir(tmp_path)
    tok = SimpleNamespace(id_to_token=lambda i: "<s>")
    lm = SimpleNamespace(name="m", chat_template=template, manifest={"eos_token_ids": [0]},
                         engine=SimpleNamespace(tokenizer=tok))
    with pytest.raises(ApiError) as e:
        render_chat(lm, [ChatMessage(role="user", content="hi")])
    assert e.value.status == 400 and "chat template" in e.value.message
    assert not (tmp_path / "pwned").exists()
