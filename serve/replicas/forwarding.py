"""What the Ray Serve replicas (serve/replicas/deploy.py) exchange, without Ray: a forwarded HTTP request, the routing key
read from its body, the driver that runs the ordinary server app (serve/api/app.py) on it inside a replica, and the
merge of the replicas' Prometheus texts into one.

The ingress reads the body once, computes the key, and sends a ``ForwardedRequest`` to an engine replica through a
Ray Serve handle whose request router (serve/replicas/router.py) reads the key. The replica runs the request through
the same FastAPI app the single-process server runs (routes, validation, 429s, result cache, streaming) and yields
the ASGI messages back, which the ingress turns into its own response.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import threading
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# Header every response from a replica carries: which replica answered (tests, debugging, per-replica counts).
REPLICA_HEADER = "x-compressor-replica"
# Characters per routing block: about one KV block of 16 tokens of English. Only whole blocks are keyed, as the
# engine's prefix cache keys only full KV blocks.
PREFIX_BLOCK_CHARS = 64
PREFIX_MAX_CHARS = 8192
# The request routers of serve/replicas/router.py (``--routing``).
POLICIES = ("prefix", "round_robin", "least_loaded")
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize")
# Hop-by-hop and framing headers the ingress must not copy from the replica's response (it frames its own).
_DROP_HEADERS = {b"content-length", b"transfer-encoding", b"connection", b"date", b"server", b"keep-alive"}


@dataclass
class ForwardedRequest:
    """One HTTP request as the ingress received it, plus what the router needs."""

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    # Chained digests of the routing text's whole PREFIX_BLOCK_CHARS blocks (empty: no prefix to route on).
    prefix_hashes: tuple[bytes, ...] = ()
    # A key for requests without a whole block (short prompts): identical ones go to the same replica.
    short_key: bytes = b""
    # A replica's id: only that replica may answer (per-replica /health, /metrics); it says 404 if it is another.
    target: str | None = None


def _text_of(content) -> str:
    """Message content (a string or OpenAI content parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def routing_text(path: str, body: bytes) -> str | None:
    """The text whose prefix decides the replica: the prompt of a completion, the messages of a chat in order (role
    and content, so a prefix of it is a prefix of any chat template's rendering). None when there is none."""
    if path not in ROUTED_PATHS or not body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    if isinstance(data.get("messages"), list):
        parts = []
        for m in data["messages"]:
            if isinstance(m, dict):
                parts.append(f"<{m.get('role', '')}>{_text_of(m.get('content'))}\x1e")
        return "".join(parts)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt:
        # A batch of prompts: the first decides (they are served by one replica); token ids as text.
        prompt = prompt[0]
        if isinstance(prompt, list):
            prompt = " ".join(str(t) for t in prompt)
        elif isinstance(prompt, int):
            prompt = " ".join(str(t) for t in data["prompt"])
    return prompt if isinstance(prompt, str) else None


def prefix_hashes(text: str | None, block: int = PREFIX_BLOCK_CHARS,
                  max_chars: int = PREFIX_MAX_CHARS) -> tuple[tuple[bytes, ...], bytes]:
    """(digest of text[:block], of text[:2*block], ...) over whole blocks, and a key of the whole text for short
    ones. Two texts share the first k digests exactly when they share their first k blocks."""
    if not text:
        return (), b""
    text = text[:max_chars]
    h = hashlib.blake2b(digest_size=12)
    out = []
    for i in range(0, len(text) - block + 1, block):
        h.update(text[i:i + block].encode("utf-8", "surrogatepass"))
        out.append(h.copy().digest())
    short = hashlib.blake2b(text[:block].encode("utf-8", "surrogatepass"), digest_size=12).digest()
    return tuple(out), short


def forwarded(method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
              target: str | None = None) -> ForwardedRequest:
    hashes, short = prefix_hashes(routing_text(path, body)) if method == "POST" else ((), b"")
    return ForwardedRequest(method, path, query, headers, body, hashes, short, target)


def response_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The replica's response headers the ingress passes on (framing headers are its own)."""
    out: dict[str, str] = {}
    for k, v in raw:
        if k.lower() not in _DROP_HEADERS:
            out[k.decode("latin-1")] = v.decode("latin-1")
    return out


async def run_asgi(app, req: ForwardedRequest, extra_headers: list[tuple[bytes, bytes]] = (),
                   client: tuple[str, int] = ("127.0.0.1", 0)) -> AsyncIterator[list[dict]]:
    """Run ``req`` through the ASGI ``app`` and yield its messages in batches (what is ready at once: a JSON answer
    is one batch of start + body). Closing the generator (the ingress's client went away, Ray cancelled the call)
    tells the app the client disconnected, so the engine request is cancelled and its KV blocks freed."""
    queue: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    sent_body = False

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start" and extra_headers:
            message = {**message, "headers": [*message.get("headers", []), *extra_headers]}
        await queue.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": req.method, "scheme": "http", "path": req.path, "raw_path": req.path.encode(),
             "query_string": req.query, "root_path": "", "headers": list(req.headers), "client": client,
             "server": ("127.0.0.1", 0), "state": {}}

    async def call():
        try:
            await app(scope, receive, send)
        finally:
            await queue.put(None)

    task = asyncio.get_running_loop().create_task(call())
    done = False
    try:
        while not done:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            if batch[-1] is None:
                batch.pop()
                done = True
            batch = [m for m in batch if m["type"] != "http.response.body" or m.get("body")
                     or not m.get("more_body", False)]
            if batch:
                yield batch
        await task  # the app's own exception, if it raised after answering
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 5)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - never leave it running
                task.cancel()


# ---- what the request router tells the ingress (same process) ----------------------------------------------
# Keyed by (app, deployment). The router (serve/replicas/router.py) runs in the ingress's process, in its handle to
# the engine deployment; Ray pickles the router's module by value, so the state is here.
_BOARD_LOCK = threading.Lock()
_LIVE: dict[tuple[str, str], list[str]] = {}
_ROUTING: dict[tuple[str, str], Counter] = {}
# Prefix chains the replicas reported after an ingress (re)start, (digest, replica id), until the router takes them.
_OFFERED: dict[tuple[str, str], list[tuple[bytes, str]]] = {}


def set_live_replicas(key: tuple[str, str], ids: list[str]) -> None:
    with _BOARD_LOCK:
        _LIVE[key] = list(ids)


def live_replicas(key: tuple[str, str]) -> list[str]:
    """Ids of the replicas the router in this process routes to now (empty until its first update)."""
    with _BOARD_LOCK:
        return list(_LIVE.get(key, []))


def count_routing(key: tuple[str, str], what: str, n: int = 1) -> None:
    with _BOARD_LOCK:
        _ROUTING.setdefault(key, Counter())[what] += n


def offer_chains(key: tuple[str, str], chains: list[tuple[bytes, str]]) -> None:
    """Hand the router the prefix chains the replicas hold (the ingress, after it starts): see take_chains."""
    with _BOARD_LOCK:
        _OFFERED.setdefault(key, []).extend(chains)


def take_chains(key: tuple[str, str]) -> list[tuple[bytes, str]]:
    """The offered (digest, replica id) pairs, once: the router adds those it does not know yet."""
    with _BOARD_LOCK:
        return _OFFERED.pop(key, [])


def routing_stats(key: tuple[str, str]) -> Counter:
    """The router's counters: ``routed:<replica>``, ``affinity`` (a seen prefix went to its replica),
    ``imbalanced`` (it went to the least loaded one: its replica was busier by ``imbalance``), ``new_prefix``,
    ``no_prefix``, ``targeted`` (per-replica admin calls), ``restored`` (prefix chains learnt from the replicas
    after the ingress started)."""
    with _BOARD_LOCK:
        return Counter(_ROUTING.get(key, Counter()))


# ---- Prometheus: the replicas' texts merged into one -------------------------------------------------------
# Gauges that are ratios or identities: the mean over replicas, not the sum (the rest add up).
MEAN_GAUGES = {"vllm:kv_cache_usage_perc", "compressor:kv_cache_usage_peak_perc", "compressor:batch_fill_ratio",
               "compressor:token_fill_ratio"}
# Gauges whose smallest value matters: the lowest version number some replica still serves.
MIN_GAUGES = {"compressor:served_model_version"}


def merge_metrics(texts: list[str]) -> str:
    """One exposition for several replicas: counters and histograms summed sample by sample (same name and
    labels), gauges summed except ratios (mean) and the served version (min: the lowest still served;
    compressor:served_model_info counts the replicas per version). ``*_created`` samples are left out."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str, dict]] = {}  # name -> (type, help, {(sample, labels): [values]})
    for text in texts:
        for fam in text_string_to_metric_families(text):
            typ, _, samples = families.setdefault(fam.name, (fam.type, fam.documentation, {}))
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                samples.setdefault((s.name, tuple(sorted(s.labels.items()))), []).append(s.value)
    lines = []
    for name, (typ, doc, samples) in families.items():
        if not samples:
            continue  # a *_created family
        if typ == "counter":  # as prometheus_client writes it: the TYPE line names the _total samples
            name += "_total"
        lines.append(f"# HELP {name} {_escape_help(doc)}")
        lines.append(f"# TYPE {name} {typ}")
        for (sname, labels), values in samples.items():
            if typ == "gauge" and name in MEAN_GAUGES:
                v = sum(values) / len(values)
            elif typ == "gauge" and name in MIN_GAUGES:
                v = min(values)
            else:
                v = sum(values)
            lines.append(f"{sname}{_labels(labels)} {_num(v)}")
    return "\n".join(lines) + "\n"


def _escape_help(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: tuple) -> str:
    if not labels:
        return ""
    esc = (str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for _, v in labels)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(labels, esc)) + "}"


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def metric_value(text: str, name: str, **labels) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels`` (0 when there are none)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
