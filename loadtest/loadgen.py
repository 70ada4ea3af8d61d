"""Async HTTP load generator for the OpenAI-compatible server, and the result it measures.

    result = run_workload("http://127.0.0.1:8000", workload, concurrency=8, server_pid=pid)
    result.metrics()      # flat dict of floats (requests/s, tokens/s, TTFT/ITL/e2e percentiles, RSS, KV)
    result.figure()       # matplotlib Figure: KV usage and server RSS over time

Every request is a streamed ``POST /v1/completions`` (SSE with ``stream_options.include_usage``),
so the client sees when each token arrives: TTFT is request sent -> first text chunk, ITL the gaps
between text chunks (as vLLM's benchmark_serving counts them), e2e request sent -> ``[DONE]``.
Token counts come from the server's ``usage`` chunk. Load is closed-loop (``concurrency`` clients
sending back to back) or open-loop (``request_rate``: seeded Poisson arrivals, optionally capped
by ``concurrency``). A sampler thread polls ``/metrics`` (KV usage, running/waiting) and the
server process's RSS and CPU time while the load runs.

One job, one module although over 400 lines: measuring one run of a workload. The request
records, the /metrics-and-RSS sampler and the client driver share one clock and fill one
``BenchResult``, whose ``metrics()`` and ``figure()`` are the only way the rest of loadtest/
reads them; split apart, each piece would only be used by the others.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np
import psutil

_MiB = 1024 * 1024


@dataclass
class RequestRecord:
    """One request as the client saw it. Times in seconds; ``start_s`` from the run's start."""

    id: int
    kind: str
    max_tokens: int
    ok: bool = False
    status: int = 0
    error: str = ""
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    text_chunks: int = 0
    finish_reason: str | None = None
    result_cache: str | None = None   # the server's X-Result-Cache header: hit, miss, off


@dataclass
class Sample:
    """One poll of the server: KV usage (0-1), requests running/waiting, process RSS."""

    t_s: float
    kv_usage: float | None
    running: float | None
    waiting: float | None
    rss_bytes: int | None


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else math.nan


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else math.nan


@dataclass
class BenchResult:
    """Everything one load run measured; ``metrics()`` flattens it for MLflow and tables."""

    label: str
    records: list[RequestRecord]
    samples: list[Sample]
    duration_s: float
    concurrency: int | None = None
    request_rate: float | None = None
    peak_rss_bytes: int | None = None
    server_cpu_s: float | None = None
    counters: dict[str, float] = field(default_factory=dict)   # deltas of server counters over the run
    meta: dict = field(default_factory=dict)
    kv_usage_peak: float | None = None   # the server's KV high-water mark, when this run raised it

    def ok_records(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    def metrics(self) -> dict[str, float]:
        """Flat figures, all floats (NaN where nothing was measured). Latencies in seconds, memory in MiB."""
        ok = self.ok_records()
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
        itl = [g for r in ok for g in r.itl_s]
        # Time per output token after the first (vLLM's TPOT): robust to chunks that carry several tokens.
        tpot = [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok
                if r.completion_tokens > 1 and r.ttft_s is not None and r.e2e_s is not None]
        out_tokens = sum(r.completion_tokens for r in ok)
        kv = [s.kv_usage for s in self.samples if s.kv_usage is not None]
        kv_all = kv + ([self.kv_usage_peak] if self.kv_usage_peak is not None else [])
        dur = self.duration_s if self.duration_s > 0 else math.nan
        m = {
            "requests": float(len(self.records)),
            "requests_ok": float(len(ok)),
            "requests_failed": float(len(self.records) - len(ok)),
            "duration_s": float(self.duration_s),
            "requests_per_s": len(ok) / dur,
            "output_tokens": float(out_tokens),
            "output_tokens_per_s": out_tokens / dur,
            "prompt_tokens": float(sum(r.prompt_tokens for r in ok)),
            "ttft_mean_s": _mean(ttft),
            "ttft_p50_s": _pct(ttft, 50),
            "ttft_p99_s": _pct(ttft, 99),
            "itl_p50_s": _pct(itl, 50),
            "itl_p99_s": _pct(itl, 99),
            "tpot_mean_s": _mean(tpot),
            "e2e_mean_s": _mean(e2e),
            "e2e_p50_s": _pct(e2e, 50),
            "e2e_p99_s": _pct(e2e, 99),
            "peak_rss_mb": self.peak_rss_bytes / _MiB if self.peak_rss_bytes else math.nan,
            "kv_usage_peak": max(kv_all) if kv_all else math.nan,
            "kv_usage_mean": _mean(kv),
            "server_cpu_s": self.server_cpu_s if self.server_cpu_s is not None else math.nan,
            "output_tokens_per_cpu_s": (out_tokens / self.server_cpu_s if self.server_cpu_s else math.nan),
            "concurrency": float(self.concurrency) if self.concurrency else math.nan,
            "result_cache_hits": float(sum(1 for r in ok if r.result_cache == "hit")),
        }
        q, h = self.counters.get("vllm:prefix_cache_queries_total"), self.counters.get("vllm:prefix_cache_hits_total")
        m["prefix_cache_hit_rate"] = h / q if q else math.nan
        m["preemptions"] = self.counters.get("vllm:num_preemptions_total", math.nan)
        # speculative decoding (serve.speculative): NaN when nothing was drafted
        d, t = self.counters.get("vllm:spec_decode_num_drafts_total"), self.counters.get(
            "vllm:spec_decode_num_draft_tokens_total")
        a = self.counters.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
        m["spec_acceptance_rate"] = a / t if t else math.nan
        m["spec_tokens_per_check"] = (a + d) / d if d else math.nan
        return m

    def by_kind(self) -> dict[str, dict[str, float]]:
        """TTFT and e2e per workload kind: e.g. shared-prefix TTFT against mixed."""
        out = {}
        for kind in sorted({r.kind for r in self.records}):
            rs = [r for r in self.ok_records() if r.kind == kind]
            ttft = [r.ttft_s for r in rs if r.ttft_s is not None]
            out[kind] = {"requests": float(len(rs)), "ttft_p50_s": _pct(ttft, 50), "ttft_mean_s": _mean(ttft),
                         "e2e_mean_s": _mean([r.e2e_s for r in rs if r.e2e_s is not None])}
        return out

    def prefix_ttft(self) -> dict[str, float] | None:
        """TTFT of the first shared-prefix request to start (cold: nothing cached) against the later
        ones (prefix-cache hits). Clean only at concurrency 1, where queueing adds nothing."""
        rs = sorted((r for r in self.ok_records() if r.kind == "shared_prefix"), key=lambda r: r.start_s)
        if len(rs) < 2:
            return None
        cold, hits = rs[0].ttft_s, [r.ttft_s for r in rs[1:]]
        return {"cold_ttft_s": cold, "hit_ttft_p50_s": _pct(hits, 50), "hit_over_cold": _pct(hits, 50) / cold,
                "prompt_tokens": _mean([float(r.prompt_tokens) for r in rs])}

    def to_dict(self) -> dict:
        """JSON-ready (NaN -> None): figures, per-kind figures, samples, per-request records."""
        def clean(x):
            if isinstance(x, float) and math.isnan(x):
                return None
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, list):
                return [clean(v) for v in x]
            return x
        return clean({"label": self.label, "metrics": self.metrics(), "by_kind": self.by_kind(),
                      "prefix_ttft": self.prefix_ttft(),
                      "concurrency": self.concurrency, "request_rate": self.request_rate, "meta": self.meta,
                      "counters": self.counters, "samples": [asdict(s) for s in self.samples],
                      "records": [asdict(r) for r in self.records]})

    def figure(self, title: str | None = None):
        """KV usage (%) and server RSS (MiB) over the run, with requests running/waiting."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 5.5), layout="constrained")
        ax_kv, ax_rss = fig.subplots(2, 1, sharex=True)
        t = [s.t_s for s in self.samples]
        ax_kv.plot(t, [100 * s.kv_usage if s.kv_usage is not None else math.nan for s in self.samples],
                   color="tab:blue", label="KV cache usage")
        ax_kv.set_ylabel("KV blocks used (%)")
        ax_req = ax_kv.twinx()
        ax_req.plot(t, [s.running if s.running is not None else math.nan for s in self.samples], color="tab:green",
                    lw=0.8, label="running")
        ax_req.plot(t, [s.waiting if s.waiting is not None else math.nan for s in self.samples], color="tab:gray",
                    lw=0.8, ls="--", label="waiting")
        ax_req.set_ylabel("requests")
        lines = ax_kv.get_lines() + ax_req.get_lines()
        ax_kv.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize=8)
        ax_rss.plot(t, [s.rss_bytes / _MiB if s.rss_bytes else math.nan for s in self.samples], color="tab:red")
        if self.peak_rss_bytes:
            ax_rss.axhline(self.peak_rss_bytes / _MiB, color="tab:red", ls=":", lw=0.8,
                           label=f"peak {self.peak_rss_bytes / _MiB:.0f} MiB")
            ax_rss.legend(loc="lower right", fontsize=8)
        ax_rss.set_ylabel("server RSS (MiB)")
        ax_rss.set_xlabel("time since load start (s)")
        m = self.metrics()
        fig.suptitle(title or f"{self.label}: {m['requests_ok']:.0f} requests, {m['output_tokens_per_s']:.1f} tok/s, "
                     f"TTFT p50 {m['ttft_p50_s'] * 1e3:.0f} ms", fontsize=10)
        return fig


def parse_prometheus(text: str) -> dict[str, float]:
    """Metric name -> value summed over label sets (one serving model: the sum is its value)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
             "vllm:generation_tokens_total", "vllm:prompt_tokens_total", "compressor:result_cache_hits_total",
             "compressor:engine_steps_total", "vllm:spec_decode_num_drafts_total",
             "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total")


def read_peak_rss(pid: int) -> int | None:
    """The process's high-water RSS since it started (Linux VmHWM), in bytes; None elsewhere."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Sampler:
    """A thread polling ``/metrics`` and the server process every ``interval_s`` (its own HTTP
    client: the load's event loop never waits on it)."""

    def __init__(self, base_url: str, pid: int, interval_s: float = 0.2):
        self.base_url, self.interval_s = base_url.rstrip("/"), interval_s
        self.proc = psutil.Process(pid)
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-sampler", daemon=True)
        self._client = httpx.Client(timeout=5)
        self._t0 = time.perf_counter()

    def scrape(self) -> dict[str, float]:
        try:
            return parse_prometheus(self._client.get(self.base_url + "/metrics").text)
        except httpx.HTTPError:
            return {}

    def cpu_s(self) -> float | None:
        try:
            t = self.proc.cpu_times()
            return t.user + t.system
        except psutil.Error:
            return None

    def _sample(self) -> None:
        m = self.scrape()
        try:
            rss = self.proc.memory_info().rss
        except psutil.Error:
            rss = None
        self.samples.append(Sample(time.perf_counter() - self._t0, m.get("vllm:kv_cache_usage_perc"),
                                   m.get("vllm:num_requests_running"), m.get("vllm:num_requests_waiting"), rss))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def start(self, t0: float) -> None:
        self._t0 = t0
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample()   # the state after the last request

    def close(self) -> None:
        self._client.close()


async def _one(client: httpx.AsyncClient, model: str, req: dict, rec: RequestRecord, t_run0: float) -> None:
    body = {"model": model, "prompt": req["prompt"], "max_tokens": int(req["max_tokens"]),
            "temperature": float(req.get("temperature", 0.0)), "stream": True,
            "stream_options": {"include_usage": True}}
    for k in ("ignore_eos", "seed", "top_p", "top_k", "stop"):
        if req.get(k) is not None:
            body[k] = req[k]
    t0 = time.perf_counter()
    rec.start_s = t0 - t_run0
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            rec.status = resp.status_code
            rec.result_cache = resp.headers.get("x-result-cache")
            if resp.status_code != 200:
                rec.error = (await resp.aread()).decode(errors="replace")[:300]
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    rec.e2e_s = time.perf_counter() - t0
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    rec.prompt_tokens = int(chunk["usage"]["prompt_tokens"])
                    rec.completion_tokens = int(chunk["usage"]["completion_tokens"])
                for ch in chunk.get("choices") or []:
                    if ch.get("text"):
                        now = time.perf_counter()
                        if rec.ttft_s is None:
                            rec.ttft_s = now - t0
                        else:
                            rec.itl_s.append(now - last)
                        last = now
                        rec.text_chunks += 1
                    if ch.get("finish_reason"):
                        rec.finish_reason = ch["finish_reason"]
        if rec.e2e_s is None:
            rec.error = "stream ended without [DONE]"
            return
        if rec.ttft_s is None:   # only special tokens / empty text: the first token came with the end
            rec.ttft_s = rec.e2e_s
        rec.ok = rec.finish_reason in ("stop", "length")
        if not rec.ok:
            rec.error = f"finish_reason {rec.finish_reason}"
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"


async def _drive(base_url: str, workload: list[dict], concurrency: int | None, request_rate: float | None,
                 seed: int, model: str | None, timeout_s: float, on_start) -> tuple[list[RequestRecord], float]:
    limit = concurrency or len(workload)
    limits = httpx.Limits(max_connections=limit + 2, max_keepalive_connections=limit + 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s, connect=30),
                                 limits=limits) as client:
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        records = [RequestRecord(id=int(q.get("id", i)), kind=str(q.get("kind", "")), max_tokens=int(q["max_tokens"]))
                   for i, q in enumerate(workload)]
        t0 = time.perf_counter()
        on_start(t0)
        if request_rate is None:
            # Closed loop: `limit` clients, each sends the next request when its last one is done.
            it = iter(range(len(workload)))

            async def worker():
                for i in it:
                    await _one(client, model, workload[i], records[i], t0)

            await asyncio.gather(*(worker() for _ in range(limit)))
        else:
            # Open loop: seeded Poisson arrivals; the semaphore caps in-flight requests at `concurrency`.
            gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, len(workload))
            arrivals = np.cumsum(gaps) - gaps[0]
            sem = asyncio.Semaphore(limit)

            async def launch(i: int):
                await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
                async with sem:
                    await _one(client, model, workload[i], records[i], t0)

            await asyncio.gather(*(launch(i) for i in range(len(workload))))
        return records, time.perf_counter() - t0


def _run_coro(coro):
    """asyncio.run, also from a thread that already runs an event loop (e.g. inside a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict = {}

    def target():
        try:
            box["v"] = asyncio.run(coro)
        except BaseException as e:  # re-raised in the caller's thread
            box["e"] = e
    th = threading.Thread(target=target)
    th.start()
    th.join()
    if "e" in box:
        raise box["e"]
    return box["v"]


def run_workload(base_url: str, workload: list[dict], concurrency: int | None = 8, request_rate: float | None = None,
                 *, server_pid: int | None = None, seed: int = 0, model: str | None = None, label: str = "server",
                 sample_interval_s: float = 0.2, timeout_s: float = 600.0, peak_rss_hwm: bool = False) -> BenchResult:
    """Replay ``workload`` against the server at ``base_url`` and measure it.

    ``server_pid``: the process whose RSS and CPU time are sampled (default: this one, for an
    in-process server). ``peak_rss_hwm``: take peak RSS from the kernel's high-water mark (exact, but
    only meaningful for a process that exists just to serve); else the sampled maximum.
    """
    if not workload:
        raise ValueError("workload is empty: make one with loadtest.workloads.make_workload(n_requests=...)")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1 or None (got {concurrency})")
    if request_rate is not None and request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 requests/s or None (got {request_rate})")
    pid = server_pid or os.getpid()
    sampler = Sampler(base_url, pid, sample_interval_s)
    before = sampler.scrape()
    cpu0 = sampler.cpu_s()
    records, wall = _run_coro(_drive(base_url, workload, concurrency, request_rate, seed, model, timeout_s,
                                     sampler.start))
    sampler.stop()
    cpu1 = sampler.cpu_s()
    after = sampler.scrape()
    sampler.close()
    sampled_peak = max((s.rss_bytes for s in sampler.samples if s.rss_bytes), default=None)
    # The server's own KV high-water mark catches bursts between samples; it counts for this run
    # only when the run raised it.
    hwm = "compressor:kv_cache_usage_peak_perc"
    kv_peak = after[hwm] if after.get(hwm, 0.0) > before.get(hwm, 0.0) else None
    peak = read_peak_rss(pid) if peak_rss_hwm else None
    return BenchResult(
        label=label, records=records, samples=sampler.samples, duration_s=wall, concurrency=concurrency,
        request_rate=request_rate, peak_rss_bytes=max(filter(None, [peak, sampled_peak]), default=None),
        server_cpu_s=(cpu1 - cpu0) if cpu0 is not None and cpu1 is not None else None,
        counters={k: after.get(k, 0.0) - before.get(k, 0.0) for k in _COUNTERS if k in after},
        meta={"base_url": base_url, "server_pid": pid, "seed": seed}, kv_usage_peak=kv_peak,
    )
