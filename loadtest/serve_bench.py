"""Benchmark one artifact behind the real HTTP server: the function the pipeline's benchmark stage calls.

    from loadtest.serve_bench import benchmark_artifact
    from loadtest.workloads import make_workload
    res = benchmark_artifact(artifact_dir, make_workload(16, seed=0), concurrency=8)
    res.metrics(); res.figure()

The server runs in a **subprocess** (``python -m serve`` on a free 127.0.0.1 port) by default:
its RSS is then the serving process's own (not the caller's torch, MLflow or pipeline state), its
CPU time is counted apart from the load generator's, and the client and the server do not share
one GIL. Start-up costs ~2-3 s on the tiny model. ``isolate=False`` runs it in this process
(uvicorn in a thread via ``serve.api.background.BackgroundServer``): faster to start, but RSS and CPU
are then this whole process's.

Deterministic for a given workload: greedy requests in workload order (closed loop), a fresh
server each call (empty prefix and result caches), one warm-up request outside the workload.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from loadtest.loadgen import BenchResult, run_workload

_ROOT = Path(__file__).resolve().parent.parent


class ServerStartError(RuntimeError):
    pass


def _check_overrides(overrides: dict) -> None:
    from serve.config import ServeConfig

    unknown = sorted(set(overrides) - set(ServeConfig.model_fields))
    if unknown:
        raise ValueError(f"serve_overrides: unknown ServeConfig field(s) {unknown}; "
                         f"valid: {sorted(ServeConfig.model_fields)}")
    for bad in ("host", "port"):
        if bad in overrides:
            raise ValueError(f"serve_overrides: {bad!r} is chosen by the benchmark (a free 127.0.0.1 port); remove it")
    ServeConfig(**overrides)   # validate values now, with pydantic's message, not inside the subprocess


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the benchmarks' servers bind there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen | None, timeout_s: float, log_path: Path | None,
               path: str = "/ready") -> None:
    """Poll ``url + path`` until it answers 200; ServerStartError with the log's tail if ``proc`` exits first or
    ``timeout_s`` passes (also for other servers: llama.cpp's answers on /health)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path else ""
            raise ServerStartError(f"the server exited with status {proc.returncode} before it was ready:\n{tail}")
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise ServerStartError(f"{url}{path} did not answer 200 within {timeout_s:.0f} s")


def _warmup(url: str) -> None:
    # First ORT runs allocate and pick kernels; one short request keeps that out of the figures.
    r = httpx.post(url + "/v1/completions", timeout=300,
                   json={"prompt": "Warm-up.", "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    if r.status_code != 200:
        raise ServerStartError(f"warm-up request failed with HTTP {r.status_code}: {r.text[:300]}")


def benchmark_artifact(artifact_dir: Path, workload: list[dict], concurrency: int = 8,
                       serve_overrides: dict | None = None, *, request_rate: float | None = None,
                       isolate: bool = True, label: str | None = None, seed: int = 0,
                       sample_interval_s: float = 0.2, ready_timeout_s: float = 300.0,
                       warmup: bool = True) -> BenchResult:
    """Start the server on ``artifact_dir``, replay ``workload`` at ``concurrency`` (or at
    ``request_rate`` requests/s, capped by ``concurrency``), stop the server, return the figures.

    ``serve_overrides``: ServeConfig fields (e.g. ``{"max_batch_size": 32, "kv_memory_mb": 512}``);
    unknown fields raise ValueError. Failed requests do not raise: they count in
    ``metrics()["requests_failed"]`` (check it). A server that does not start raises
    ServerStartError with its log's tail.
    """
    artifact_dir = Path(artifact_dir)
    if not (artifact_dir / "manifest.json").is_file():
        raise FileNotFoundError(f"{artifact_dir}: no manifest.json; pass an artifact folder (compress.export.build_artifact)")
    overrides = dict(serve_overrides or {})
    _check_overrides(overrides)
    label = label or artifact_dir.name
    meta = {"artifact": str(artifact_dir), "serve_overrides": overrides, "isolate": isolate,
            "workload_requests": len(workload)}
    if not isolate:
        return _in_process(artifact_dir, workload, concurrency, overrides, request_rate, label, seed,
                           sample_interval_s, ready_timeout_s, warmup, meta)

    with running_server(artifact_dir, overrides, ready_timeout_s) as (url, proc):
        if warmup:
            _warmup(url)
        res = run_workload(url, workload, concurrency, request_rate, server_pid=proc.pid, seed=seed, label=label,
                           sample_interval_s=sample_interval_s, peak_rss_hwm=True)
    res.meta.update(meta)
    return res


@contextlib.contextmanager
def running_server(artifact_dir: Path, overrides: dict | None = None,
                   ready_timeout_s: float = 300.0, source: Path | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``python -m serve`` on ``artifact_dir`` in a subprocess on a free 127.0.0.1 port, ready to serve:
    yields (base URL, process); stops it (SIGTERM, then kill) on exit. ServerStartError with the log's
    tail if it does not come up. ``source``: the source tree whose ``serve`` runs (default this one; e.g. a
    ``git worktree`` of an older commit, to measure the server as it was)."""
    overrides = dict(overrides or {})
    _check_overrides(overrides)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "serve", "--model", str(artifact_dir), "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"]
    for k, v in overrides.items():
        cmd += ["--set", f"serve.{k}={json.dumps(v)}"]
    root = Path(source).resolve() if source else _ROOT
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.NamedTemporaryFile("w+b", prefix="bench-server-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc, ready_timeout_s, log_path)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)   # uvicorn shuts down gracefully; the engine thread stops
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log_path.unlink(missing_ok=True)


def _in_process(artifact_dir, workload, concurrency, overrides, request_rate, label, seed, sample_interval_s,
                ready_timeout_s, warmup, meta) -> BenchResult:
    from serve.api.app import create_app
    from serve.api.background import BackgroundServer
    from serve.config import ServeConfig

    app = create_app(str(artifact_dir), ServeConfig(**overrides), admin_token=None)
    srv = BackgroundServer(app, ready_timeout_s=ready_timeout_s)
    with srv:
        if warmup:
            _warmup(srv.url)
        res = run_workload(srv.url, workload, concurrency, request_rate, seed=seed, label=label,
                           sample_interval_s=sample_interval_s, peak_rss_hwm=False)
    res.meta.update(meta)
    return res


# Figures whose ratio to the baseline the pipeline records (higher is better for the first two,
# lower for the rest).
RATIO_KEYS = ("output_tokens_per_s", "requests_per_s", "output_tokens_per_cpu_s", "ttft_p50_s", "ttft_p99_s",
              "itl_p50_s", "e2e_mean_s", "e2e_p99_s", "peak_rss_mb")


def ratios(candidate: dict[str, float], baseline: dict[str, float]) -> dict[str, float]:
    """``{key}_ratio`` = candidate / baseline for RATIO_KEYS, from two ``BenchResult.metrics()`` dicts
    measured in the same run (NaN where the baseline is 0 or missing). E.g. a promotion floor
    ``output_tokens_per_s_ratio >= 1.5``; latency and RSS ratios below 1 are improvements."""
    out = {}
    for k in RATIO_KEYS:
        c, b = candidate.get(k, float("nan")), baseline.get(k, float("nan"))
        out[f"{k}_ratio"] = c / b if b and b == b and c == c else float("nan")
    return out
