"""Soak: bounded mixed traffic against the server; counts every outcome, then checks that every KV block
came back and how RSS moved (least-squares slope), with live model swaps under load.

    python -m loadtest.soak --minutes 10                       # tiny seeded model, server in this process
    python -m loadtest.soak --minutes 60 --swap-every 30       # longer, a forced reload every 30 s
    python -m loadtest.soak --model artifacts/export/<hash>/artifact --minutes 10
    python -m loadtest.soak --url http://127.0.0.1:8000 --minutes 10   # an external server (KV via /metrics)

Traffic (``concurrency`` closed-loop clients, seeded): whole and streamed completions, chat, repeats
(result cache), prompts sharing prefixes (prefix cache), streams the client drops after a few events,
whole requests the client abandons (read timeout), and bad bodies. Outcome classes: ``ok``,
``cancelled`` (the client went away on purpose), ``rejected_4xx`` (a bad body got its 4xx),
``throttled_429``, ``server_5xx``, ``unexpected_4xx``, ``incomplete`` (200 but a stream without
``[DONE]`` or a token count that disagrees with finish_reason), ``bad_event`` (a body or SSE event
that is not JSON to httpx's line reader) and ``transport`` (connection errors). A run passes when
there is none of ``server_5xx``, ``unexpected_4xx``, ``incomplete``, ``bad_event``, ``transport``,
no KV block is still referenced once the server is idle, and every swapped-out engine drained.
The test suite runs a 20 s form (tests/test_reliability_server.py); docs/reliability.md has figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

_MiB = 1024 * 1024
FAIL_CLASSES = ("server_5xx", "unexpected_4xx", "incomplete", "bad_event", "transport")
KINDS = {"complete": 5, "stream": 4, "chat": 2, "repeat": 2, "stream_drop": 2, "abandon": 1, "bad": 1}
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega the quick brown fox jumps over lazy dog once upon a time").split()
BAD_BODIES = [b"{not json", b"[1, 2]", b'{"prompt": "x", "temperature": "hot"}', b'{"max_tokens": 4}',
              b'{"prompt": "x", "max_tokens": 100000}', b'{"prompt": "\\ud800"}', b'{"prompt": "x", "best_of": 3}']


@dataclass
class SoakReport:
    seconds: float = 0.0
    requests: int = 0
    by_class: dict = field(default_factory=dict)
    by_kind: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)  # the first few, for the log
    tokens_generated: int = 0
    swaps: list = field(default_factory=list)  # seconds each swap took
    rss_mb: list = field(default_factory=list)  # [(t_s, MiB)]
    rss_slope_mb_per_min: float | None = None
    rss_growth_mb: float | None = None  # last sample - first sample after warm-up
    kv: dict = field(default_factory=dict)  # leak check once idle
    ok: bool = False

    def summary(self) -> str:
        lines = [f"soak: {self.seconds:.0f} s, {self.requests} requests, {self.tokens_generated} tokens generated",
                 "  by class: " + ", ".join(f"{k}={v}" for k, v in sorted(self.by_class.items())),
                 "  by kind:  " + ", ".join(f"{k}={v}" for k, v in sorted(self.by_kind.items())),
                 f"  swaps: {len(self.swaps)} ({', '.join(f'{s:.2f} s' for s in self.swaps)})",
                 f"  RSS: slope {self.rss_slope_mb_per_min} MiB/min, growth {self.rss_growth_mb} MiB "
                 f"over {len(self.rss_mb)} samples",
                 f"  KV once idle: {self.kv}",
                 f"  {'PASS' if self.ok else 'FAIL'}"]
        lines += [f"  failure: {f}" for f in self.failures[:10]]
        return "\n".join(lines)


def slope_per_min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t_s, value) in value per minute."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return None
    return round(60.0 * sum((t - mt) * (v - mv) for t, v in samples) / var, 3)


def _prompt(rng: random.Random) -> str:
    # A few shared openings so prefix blocks get reused, then a random tail.
    head = ["Once upon a time in a land far away there lived", "The quick brown fox jumps over the lazy dog and",
            "alpha beta gamma delta epsilon zeta eta theta iota"][rng.randrange(3)]
    return head + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 30)))


async def _one(client: httpx.AsyncClient, kind: str, rng: random.Random, model: str | None) -> tuple[str, str, int]:
    """Send one request of ``kind``; returns (class, detail, tokens generated)."""
    max_tokens = rng.randrange(1, 48)
    body: dict = {"prompt": _prompt(rng), "max_tokens": max_tokens}
    if model:
        body["model"] = model
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, seed=rng.randrange(1000))
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    path = "/v1/completions"
    if kind == "repeat":
        body = {"prompt": "a request that repeats", "max_tokens": 8, "temperature": 0, **({"model": model} if model else {})}
    elif kind == "chat":
        path = "/v1/chat/completions"
        body = {k: v for k, v in body.items() if k != "prompt"}
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
    elif kind == "bad":
        r = await client.post(path, content=rng.choice(BAD_BODIES))
        if 400 <= r.status_code < 500 and r.status_code != 429:
            err = r.json().get("error", {})
            if err.get("message") and (err.get("param") or err.get("code")):
                return "rejected_4xx", "", 0
            return "unexpected_4xx", f"bad body: 4xx without a named field: {r.text[:200]}", 0
        return _status_class(r.status_code), f"bad body got {r.status_code}: {r.text[:200]}", 0

    if kind in ("stream", "stream_drop"):
        body.update(stream=True, stream_options={"include_usage": True})
        drop_after = rng.randrange(1, 4) if kind == "stream_drop" else None
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return _status_class(r.status_code), f"{kind} {r.status_code}: {r.text[:200]}", 0
            events, done, finish, usage = 0, False, None, None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if drop_after is not None and events >= drop_after:
                    return "cancelled", "", 0  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    done = True
                    break
                ev = json.loads(line[6:])
                if "error" in ev:
                    return "server_5xx", f"stream error event: {ev['error']}", 0
                if ev.get("choices") and ev["choices"][0].get("finish_reason"):
                    finish = ev["choices"][0]["finish_reason"]
                if ev.get("usage"):
                    usage = ev["usage"]
            if drop_after is not None:  # finished before the client dropped it
                return "ok", "", (usage or {}).get("completion_tokens", 0)
            return _check_done(kind, done, finish, usage, max_tokens)

    if kind == "abandon":
        try:
            r = await client.post(path, json={**body, "max_tokens": 48, "ignore_eos": True},
                                  timeout=httpx.Timeout(30, read=rng.uniform(0.02, 0.2)))
        except httpx.ReadTimeout:
            return "cancelled", "", 0
        return ("ok", "", r.json()["usage"]["completion_tokens"]) if r.status_code == 200 else \
            (_status_class(r.status_code), f"abandon {r.status_code}: {r.text[:200]}", 0)

    r = await client.post(path, json=body)
    if r.status_code != 200:
        return _status_class(r.status_code), f"{kind} {r.status_code}: {r.text[:200]}", 0
    out = r.json()
    return _check_done(kind, True, out["choices"][0]["finish_reason"], out["usage"], body["max_tokens"])


def _check_done(kind: str, done: bool, finish: str | None, usage: dict | None, max_tokens: int) -> tuple[str, str, int]:
    n = (usage or {}).get("completion_tokens", -1)
    if not done or finish not in ("length", "stop") or n < 1 and finish == "length" or n > max_tokens \
            or finish == "length" and n != max_tokens:
        return "incomplete", f"{kind}: done={done} finish={finish} usage={usage} max_tokens={max_tokens}", 0
    return "ok", "", n


def _status_class(status: int) -> str:
    if status == 429:
        return "throttled_429"
    if status >= 500:
        return "server_5xx"
    return "unexpected_4xx"


async def run_traffic(url: str, seconds: float, concurrency: int = 6, seed: int = 0, model: str | None = None,
                      swap=None, swap_every_s: float = 0.0, report: SoakReport | None = None,
                      min_requests_per_client: int = 0) -> SoakReport:
    """Closed-loop mixed traffic for ``seconds``; ``swap`` (a blocking callable) runs at every multiple of
    ``swap_every_s`` up to ``seconds - 1``.

    How much happens must not depend on how fast the machine is: the traffic goes on past ``seconds``
    until every planned swap has run under it, and until each client has sent at least
    ``min_requests_per_client`` requests. Each client's sequence of kinds is seeded, so its first N
    requests are always the same kinds (a test can count on the classes they produce)."""
    report = report or SoakReport()
    classes, kinds = Counter(), Counter()
    names, weights = list(KINDS), list(KINDS.values())
    deadline = time.monotonic() + seconds
    t0 = time.monotonic()
    n_swaps = int(max(0.0, seconds - 1) // swap_every_s) if swap is not None and swap_every_s > 0 else 0
    swaps_done = asyncio.Event()
    if n_swaps == 0:
        swaps_done.set()

    def more(sent: int) -> bool:
        return time.monotonic() < deadline or sent < min_requests_per_client or not swaps_done.is_set()

    async def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=2)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            sent = 0
            while more(sent):
                sent += 1
                kind = rng.choices(names, weights)[0]
                try:
                    cls, detail, n = await _one(client, kind, rng, model)
                except httpx.TransportError as e:
                    cls, detail, n = "transport", f"{kind}: {type(e).__name__}: {e}", 0
                except json.JSONDecodeError as e:  # a body or SSE event that is not JSON
                    cls, detail, n = "bad_event", f"{kind}: {type(e).__name__}: {e}", 0
                classes[cls] += 1
                kinds[kind] += 1
                report.tokens_generated += n
                if cls in FAIL_CLASSES and len(report.failures) < 50:
                    report.failures.append(detail)
                if cls == "throttled_429":
                    await asyncio.sleep(0.2)

    async def swapper() -> None:
        try:
            for k in range(1, n_swaps + 1):
                await asyncio.sleep(max(0.0, t0 + k * swap_every_s - time.monotonic()))
                s0 = time.monotonic()
                await asyncio.to_thread(swap)
                report.swaps.append(round(time.monotonic() - s0, 3))
        finally:
            swaps_done.set()  # also when a swap raised: the clients must not wait for it forever

    tasks = [asyncio.create_task(client_loop(i)) for i in range(concurrency)]
    sw = asyncio.create_task(swapper()) if n_swaps else None
    await asyncio.gather(*tasks)
    if sw is not None:
        sw.cancel()
        try:
            await sw
        except asyncio.CancelledError:
            pass
    report.seconds = round(time.monotonic() - t0, 1)
    report.requests = sum(classes.values())
    report.by_class, report.by_kind = dict(classes), dict(kinds)
    return report


class RssSampler:
    """Samples a process's RSS every ``interval_s`` in a thread."""

    def __init__(self, pid: int, interval_s: float = 0.5):
        self.proc, self.interval_s = psutil.Process(pid), interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            self.samples.append((round(time.monotonic() - t0, 2), round(self.proc.memory_info().rss / _MiB, 1)))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def kv_check(manager, idle_timeout_s: float = 15.0) -> dict:
    """Once idle: blocks still referenced by any live engine (0 = nothing leaked; cached prefix blocks with
    ref count 0 are evictable, not leaked) and whether swapped-out engines drained."""
    deadline = time.monotonic() + idle_timeout_s
    while time.monotonic() < deadline:
        if all(s.num_running == 0 and s.num_waiting == 0 for s in manager.stats()):
            break
        time.sleep(0.05)
    drained = manager.wait_drained(max(0.1, deadline - time.monotonic()))
    engine = manager.current.engine
    st = engine.stats()
    bm = engine.block_manager
    with engine._lock:  # a consistent view: the step loop holds this lock while it changes the pool
        referenced = sum(1 for b in range(bm.num_blocks) if bm.ref_count(b) > 0)
        try:
            bm.check_invariants()
            invariants = "ok"
        except AssertionError as e:
            invariants = str(e)
    return {"blocks_total": st.kv_blocks_total, "blocks_used": st.kv_blocks_used, "blocks_referenced": referenced,
            "blocks_cached_evictable": bm.num_evictable, "running": st.num_running, "waiting": st.num_waiting,
            "invariants": invariants, "old_engines_drained": drained, "live_engines": len(manager.live_models()),
            "preemptions": st.preemptions, "finish_reasons": st.finish_reasons}


def kv_check_http(url: str) -> dict:
    """The same, from /metrics, for an external server."""
    text = httpx.get(url + "/metrics", timeout=10).text
    vals = {}
    for line in text.splitlines():
        for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
            if line.startswith(name + " ") or line.startswith(name + "{"):
                vals[name] = float(line.rsplit(" ", 1)[1])
    return {"kv_usage": vals.get("vllm:kv_cache_usage_perc"), "running": vals.get("vllm:num_requests_running"),
            "waiting": vals.get("vllm:num_requests_waiting")}


def finish(report: SoakReport, samples: list[tuple[float, float]], kv: dict, warmup_frac: float = 0.2) -> SoakReport:
    report.rss_mb = samples
    steady = [s for s in samples if s[0] >= warmup_frac * (samples[-1][0] if samples else 0)]
    report.rss_slope_mb_per_min = slope_per_min(steady)
    report.rss_growth_mb = round(steady[-1][1] - steady[0][1], 1) if len(steady) >= 2 else None
    report.kv = kv
    leak = kv.get("blocks_referenced", 0) or kv.get("blocks_used", 0) or kv.get("kv_usage", 0) \
        or kv.get("invariants", "ok") != "ok" or kv.get("old_engines_drained") is False
    report.ok = not any(report.by_class.get(c, 0) for c in FAIL_CLASSES) and not leak \
        and report.by_class.get("ok", 0) > 0
    return report


def soak_server(server, seconds: float, concurrency: int = 6, seed: int = 0, swap_every_s: float = 0.0,
                model: str | None = None, min_requests_per_client: int = 0) -> SoakReport:
    """Soak a BackgroundServer running in this process: swaps are forced reloads of its ModelManager."""
    import os

    manager = server.app.state.manager
    swap = (lambda: manager.reload(force=True)) if swap_every_s > 0 else None
    with RssSampler(os.getpid()) as rss:
        report = asyncio.run(run_traffic(server.url, seconds, concurrency, seed, model, swap, swap_every_s,
                                         min_requests_per_client=min_requests_per_client))
        kv = kv_check(manager)
    return finish(report, rss.samples, kv)


def _tiny_artifact(root: Path) -> Path:
    from compress.export import build_artifact
    from compress.loading.tiny import build_tiny_llama

    model, tok = build_tiny_llama(seed=0)
    out = root / "tiny"
    build_artifact(model, tok, out, exporter="torchscript")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=None, help="overrides --minutes")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="artifact folder or models:/NAME@alias (default: the tiny seeded model)")
    p.add_argument("--url", default=None, help="soak an external server instead (KV checked through /metrics)")
    p.add_argument("--swap-every", type=float, default=60.0, help="seconds between forced reloads (0 = none; in-process only)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="serve config override for the in-process server, e.g. --set serve.max_batch_size=8")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    import logging

    logging.getLogger("asyncio").setLevel(logging.ERROR)  # "socket.send() raised exception" after each drop
    seconds = args.seconds if args.seconds is not None else 60.0 * args.minutes

    if args.url:
        with RssSampler(psutil.Process().pid) as rss:  # the client's own RSS; the server is elsewhere
            report = asyncio.run(run_traffic(args.url.rstrip("/"), seconds, args.concurrency, args.seed))
        time.sleep(2)
        report = finish(report, rss.samples, kv_check_http(args.url.rstrip("/")))
    else:
        from compress.config import load_config
        from serve.api.app import create_app
        from serve.api.background import BackgroundServer

        base = ["serve.providers=[CPUExecutionProvider]", "serve.kv_memory_mb=16", "serve.max_batch_size=8",
                "serve.max_waiting=32"]
        cfg = load_config(None, base + args.set)
        with tempfile.TemporaryDirectory() as tmp:
            model = args.model or str(_tiny_artifact(Path(tmp)))
            app = create_app(model, cfg.serve, admin_token=None)
            with BackgroundServer(app) as srv:
                report = soak_server(srv, seconds, args.concurrency, args.seed, args.swap_every)
    print(report.summary())
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
