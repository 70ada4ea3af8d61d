"""What the server tests share: a small CPU ServeConfig and a real server on a socket with an httpx client.

``from served import ...`` (pytest puts tests/ on sys.path: the folder has no __init__.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from serve.api.background import BackgroundServer
from serve.config import ServeConfig
from serve.runners.onnx_session import CPU


def serve_cfg(**kw) -> ServeConfig:
    """A ServeConfig on the CPU EP with an 8 MiB KV pool (the tiny models' size), ``kw`` on top."""
    kw.setdefault("providers", [CPU])
    kw.setdefault("kv_memory_mb", 8)
    return ServeConfig(**kw)


@contextmanager
def on_socket(app) -> Iterator[BackgroundServer]:
    """``app`` on a real socket (127.0.0.1, a free port) for the block."""
    with BackgroundServer(app) as srv:
        yield srv


@contextmanager
def http_on(srv: BackgroundServer, timeout: float = 30) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=timeout) as c:
        yield c


def tiny_chat_artifact(tmp_path_factory, seed: int = 0):
    """The gqa artifact of a tiny Llama of ``seed`` with a 2,048-token context: tools rendered into the prompt take
    ~300 tokens of its 512-token vocabulary, more than the session's tiny artifacts hold."""
    from compress.export.gqa import build_gqa_artifact
    from compress.loading.tiny import build_tiny_llama

    model, tok = build_tiny_llama(seed=seed, max_position_embeddings=2048)
    out = tmp_path_factory.mktemp(f"tiny_chat_seed{seed}") / "fp32"
    build_gqa_artifact(model, tok, out)
    return out
