"""The server applies the model's BOS rule from its manifest (issue 17, serve side), over a real socket.

The BOS artifact is tests/test_special_tokens.py's: the seed-0 tiny Llama exported with a tokenizer that
adds BOS ``<|im_start|>`` (id 1), manifest ``add_bos_token``, ``eos_token_ids`` [2, 100]. Its tokenizer.json
post-processor adds the BOS itself too, so a server that let the tokenizer add special tokens and also
prepended one would send two. The expected continuations are computed here from the ONNX graph alone
(full recompute, no serve/ or compress/ driver).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from tokenizers import Tokenizer

from serve.api.app import create_app
from serve.api.background import BackgroundServer
from serve.config import ServeConfig
from serve.engine.tokenizer import bos_id, encode_chat, encode_prompt
from serve.runners.onnx_session import CPU
from test_special_tokens import bos_artifact, bos_tok  # noqa: F401  (module fixtures, reused)

pytestmark = pytest.mark.timeout(300)

BOS = 1
TEXT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
MAX_LEN = 48


def cfg(**kw) -> ServeConfig:
    return ServeConfig(**{"providers": [CPU], "kv_memory_mb": 8, "result_cache_size": 64, **kw})


@pytest.fixture(scope="module")
def bos_http(bos_artifact):  # noqa: F811
    with BackgroundServer(create_app(str(bos_artifact), cfg(max_model_len=MAX_LEN), admin_token=None)) as srv:
        srv.wait_ready()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            yield c


@pytest.fixture(scope="module")
def plain_http(tiny_artifact):
    with BackgroundServer(create_app(str(tiny_artifact), cfg(), admin_token=None)) as srv:
        srv.wait_ready()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            yield c


@contextlib.contextmanager
def serve_copy(src: Path, tmp_path: Path, drop: tuple[str, ...] = (), **changes):
    """A client of a server on a copy of ``src`` whose manifest has ``changes`` and lacks ``drop``."""
    art = tmp_path / "copy"
    shutil.copytree(src, art)
    man = json.loads((art / "manifest.json").read_text())
    (art / "manifest.json").write_text(json.dumps({**{k: v for k, v in man.items() if k not in drop}, **changes}))
    with BackgroundServer(create_app(str(art), cfg(), admin_token=None)) as srv:
        srv.wait_ready()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            yield c


def tokenizer_of(folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))


def onnx_greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after ``prompt``, every step a full forward pass of the graph (empty past)."""
    import onnxruntime as ort

    man = json.loads((Path(folder) / "manifest.json").read_text())
    sess = ort.InferenceSession(str(Path(folder) / man.get("onnx_file", "model.onnx")),
                                providers=["CPUExecutionProvider"])
    past = {name: np.zeros((1, man["num_kv_heads"], 0, man["head_dim"]), np.float32)
            for name in man["io"]["inputs"] if name.startswith("past_key_values.")}
    ids, out = list(prompt), []
    for _ in range(n):
        s = len(ids)
        feed = {"input_ids": np.asarray([ids], np.int64), "attention_mask": np.ones((1, s), np.int64),
                "position_ids": np.arange(s, dtype=np.int64)[None], **past}
        logits = sess.run(["logits"], feed)[0]
        out.append(int(logits[0, -1].argmax()))
        ids.append(out[-1])
    return out


def complete(http: httpx.Client, prompt, max_tokens: int = 8, **kw) -> httpx.Response:
    return http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                              "ignore_eos": True, **kw})


def chat(http: httpx.Client, max_tokens: int = 8) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
                                                   "ignore_eos": True})


def test_manifest_rule(bos_artifact, tiny_artifact):  # noqa: F811
    bos_man = json.loads((bos_artifact / "manifest.json").read_text())
    assert bos_id(bos_man) == BOS and bos_man["eos_token_ids"] == [2, 100]
    assert bos_id(json.loads((tiny_artifact / "manifest.json").read_text())) is None
    # A manifest from before the fields: no BOS, whatever bos_token_id says.
    old = {k: v for k, v in bos_man.items() if k not in ("add_bos_token", "chat_template_adds_bos")}
    assert bos_id(old) is None and bos_id({**bos_man, "bos_token_id": None}) is None
    tok = tokenizer_of(bos_artifact)
    assert tok.encode(TEXT).ids[0] == BOS  # the tokenizer's own post-processor adds one too ...
    assert encode_prompt(tok, bos_man, TEXT) == [BOS] + tok.encode(TEXT, add_special_tokens=False).ids  # ... one only
    assert encode_prompt(tok, old, TEXT) == tok.encode(TEXT, add_special_tokens=False).ids
    assert encode_chat(tok, bos_man, "<|im_start|>user\nhi") == tok.encode("<|im_start|>user\nhi",
                                                                          add_special_tokens=False).ids
    assert encode_chat(tok, bos_man, "hi") == [BOS] + tok.encode("hi", add_special_tokens=False).ids


def test_completion_starts_with_one_bos(bos_http, bos_artifact):  # noqa: F811
    tok = tokenizer_of(bos_artifact)
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    want = onnx_greedy(bos_artifact, [BOS] + ids, 8)
    assert want != onnx_greedy(bos_artifact, ids, 8)  # the BOS changes the answer: the check below means something
    r = complete(bos_http, TEXT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == tok.decode(want)
    assert body["usage"] == {"prompt_tokens": len(ids) + 1, "completion_tokens": 8, "total_tokens": len(ids) + 9}
    # Streamed, the usage chunk counts the BOS too.
    with bos_http.stream("POST", "/v1/completions", json={"prompt": TEXT, "max_tokens": 8, "temperature": 0,
                                                          "ignore_eos": True, "stream": True,
                                                          "stream_options": {"include_usage": True}}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == tok.decode(want)
    assert events[-1]["usage"]["prompt_tokens"] == len(ids) + 1


def test_token_id_prompt_gets_no_bos_and_the_cache_key_holds_it(bos_http, bos_artifact):  # noqa: F811
    tok = tokenizer_of(bos_artifact)
    ids = tok.encode("Once upon a time", add_special_tokens=False).ids
    text_r = complete(bos_http, "Once upon a time")
    assert text_r.headers["X-Result-Cache"] == "miss"
    # Token ids are taken as sent (vLLM's rule): no BOS added.
    raw = complete(bos_http, ids)
    assert raw.headers["X-Result-Cache"] == "miss"  # not the text prompt's entry: that key holds the BOS
    assert raw.json()["usage"]["prompt_tokens"] == len(ids)
    assert raw.json()["choices"][0]["text"] == tok.decode(onnx_greedy(bos_artifact, ids, 8))
    # The same ids with the BOS are the text prompt's request: answered from its cache entry.
    same = complete(bos_http, [BOS] + ids)
    assert same.headers["X-Result-Cache"] == "hit"
    assert same.json()["choices"] == text_r.json()["choices"]
    assert same.json()["usage"] == text_r.json()["usage"] and text_r.json()["usage"]["prompt_tokens"] == len(ids) + 1


def test_max_model_len_counts_the_bos(bos_http, bos_artifact):  # noqa: F811
    assert bos_http.get("/v1/models").json()["data"][0]["max_model_len"] == MAX_LEN
    ids = tokenizer_of(bos_artifact).encode(TEXT, add_special_tokens=False).ids
    fits_without_bos = MAX_LEN - len(ids)
    r = complete(bos_http, TEXT, max_tokens=fits_without_bos)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert complete(bos_http, TEXT, max_tokens=fits_without_bos - 1).status_code == 200
    assert complete(bos_http, ids, max_tokens=fits_without_bos).status_code == 200  # ids: no BOS, it fits


def test_chat_does_not_add_a_second_bos(bos_http, bos_artifact, bos_tok):  # noqa: F811
    # The tiny template starts every message with <|im_start|>, this model's BOS: the template wrote it.
    rendered = bos_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    tok = tokenizer_of(bos_artifact)
    ids = tok.encode(rendered, add_special_tokens=False).ids
    assert ids[0] == BOS and ids[1] != BOS
    r = chat(bos_http)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert r.json()["choices"][0]["message"]["content"] == tok.decode(onnx_greedy(bos_artifact, ids, 8))


def test_chat_template_without_bos_gets_one(bos_artifact, tmp_path):  # noqa: F811
    """A template that does not write the BOS: the server puts it first (once)."""
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    tok = tokenizer_of(bos_artifact)
    ids = tok.encode("system: Be brief.\nuser: Name a colour.\nassistant:", add_special_tokens=False).ids
    assert ids[0] != BOS
    with serve_copy(bos_artifact, tmp_path, chat_template=template, chat_template_adds_bos=False) as http:
        r = chat(http).json()
    assert r["usage"]["prompt_tokens"] == len(ids) + 1
    assert r["choices"][0]["message"]["content"] == tok.decode(onnx_greedy(bos_artifact, [BOS] + ids, 8))


def test_manifest_without_the_fields_adds_no_bos(bos_artifact, tmp_path):  # noqa: F811
    """A manifest written before add_bos_token: no BOS (the behaviour then), though the tokenizer.json would add one."""
    tok = tokenizer_of(bos_artifact)
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    with serve_copy(bos_artifact, tmp_path, drop=("add_bos_token", "chat_template_adds_bos")) as http:
        r = complete(http, TEXT).json()
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert r["choices"][0]["text"] == tok.decode(onnx_greedy(bos_artifact, ids, 8))


def test_generation_stops_on_any_eos_id(bos_artifact, tmp_path):  # noqa: F811
    """A second EOS id in the manifest (an end-of-turn token) ends generation like the first."""
    tok = tokenizer_of(bos_artifact)
    free = onnx_greedy(bos_artifact, [BOS] + tok.encode(TEXT, add_special_tokens=False).ids, 8)
    # The seed-0 tiny repeats one token; the first that is neither listed EOS id becomes the second EOS.
    k = next(i for i in range(8) if free[i] not in (2, 100) and 2 not in free[:i])
    with serve_copy(bos_artifact, tmp_path, eos_token_ids=[2, free[k]]) as http:
        r = http.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 8, "temperature": 0}).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == k + 1  # the EOS is counted, adds no text
    assert r["choices"][0]["text"] == tok.decode(free[:k])


def test_model_without_bos_is_unchanged(plain_http, tiny_artifact, tiny_tokenizer):
    """The default tiny (add_bos_token false): the prompt is its text's tokens, as before BOS support."""
    tok = tokenizer_of(tiny_artifact)
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    assert tok.encode(TEXT).ids == ids
    r = complete(plain_http, TEXT).json()
    assert r["usage"]["prompt_tokens"] == len(ids)
    assert r["choices"][0]["text"] == tok.decode(onnx_greedy(tiny_artifact, ids, 8))
    rendered = tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    c = chat(plain_http).json()
    assert c["usage"]["prompt_tokens"] == len(tok.encode(rendered, add_special_tokens=False).ids)


def test_ort_baseline_encodes_like_the_server(bos_artifact, tiny_artifact):  # noqa: F811
    from loadtest.baselines import ort_static
    from loadtest.run import kv_budget_mb

    workload = [{"id": 0, "prompt": TEXT, "max_tokens": 2}]
    n = len(tokenizer_of(tiny_artifact).encode(TEXT, add_special_tokens=False).ids)
    assert ort_static(bos_artifact, workload).records[0].prompt_tokens == n + 1
    assert ort_static(tiny_artifact, workload).records[0].prompt_tokens == n
    assert kv_budget_mb(bos_artifact, workload, 1) >= 256
