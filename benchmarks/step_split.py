"""Where a decode step goes: graph (by op type), runner, scheduling, sampling, detokenizing, and the HTTP path.

    python -m benchmarks.step_split --artifact <artifact> [--steps 64] [--set ort_spinning='"always"']
    python -m benchmarks.step_split --artifact <artifact> --batch 1 8 32 64 --ops   # batched steps, op split

Engine part: ``--batch`` requests decoding together (default 1), the engine stepped by hand; per step the time inside
``session.run`` (graph), the rest of ``runner.execute`` (runner: inputs, bindings, K/V write-back, logits
copy), ``sample_token`` (sampling), ``InFlightRequest.add_token`` (detokenizing and stop checks) and the
remainder of the step (scheduling, bookkeeping, events). Sampling and detokenizing are timed by wrapping the
two functions the engine calls (the benchmark's own instrumentation; serve/ has no timers for them). With
``--ops`` the session runs under ORT's profiler and the graph time of the measured steps is split by op type
(MatMulNBits, GroupQueryAttention, ...), per step.

HTTP part: the same artifact behind the real server (subprocess), one streamed completion of ``--steps``
tokens; the client's inter-token latency p50 minus the engine step p50 is what the HTTP/SSE path adds.
Prints the CPU flags and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.burst import cpu_flags
from loadtest.serve_bench import running_server


class _Profiled:
    """ORT's profiler on every session made while active (the benchmark's own switch; serve/ has none)."""

    def __init__(self):
        import onnxruntime as ort

        self.ort, self.orig = ort, ort.SessionOptions
        self.folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"step_split_{os.getpid()}"

    def __enter__(self):
        orig, folder = self.orig, self.folder
        folder.mkdir(parents=True, exist_ok=True)

        class Options(orig):
            def __init__(self):
                super().__init__()
                self.enable_profiling = True
                self.profile_file_prefix = str(folder / "ort")

        self.ort.SessionOptions = Options
        return self

    def __exit__(self, *exc):
        self.ort.SessionOptions = self.orig


def op_split(profile_json: str, last_runs: int) -> dict[str, float]:
    """Seconds per op type inside the last ``last_runs`` session runs of an ORT profile."""
    events = json.loads(Path(profile_json).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[-last_runs:]
    out: dict[str, float] = {}
    if not runs:
        return out
    lo = runs[0][0]
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= lo:
            if any(a <= e["ts"] < b for a, b in runs):
                op = e.get("args", {}).get("op_name", "?")
                out[op] = out.get(op, 0.0) + e["dur"] / 1e6
    return out


def engine_split(artifact: Path, steps: int, overrides: dict, batch: int = 1, ops: bool = False) -> dict[str, float]:
    import serve.engine.engine as engine_mod
    import serve.engine.in_flight as in_flight_mod
    from serve.config import ServeConfig
    from serve.engine.engine import Engine
    from serve.engine.sampling import SamplingParams
    from serve.runners.onnx_session import CPU

    spent = {"sampling": 0.0, "detokenize": 0.0}
    sample_token, add_token = engine_mod.sample_token, in_flight_mod.InFlightRequest.add_token

    def timed_sample(*a, **k):
        t = time.perf_counter()
        try:
            return sample_token(*a, **k)
        finally:
            spent["sampling"] += time.perf_counter() - t

    def timed_add(self, *a, **k):
        t = time.perf_counter()
        try:
            return add_token(self, *a, **k)
        finally:
            spent["detokenize"] += time.perf_counter() - t

    cfg = ServeConfig(**{"providers": [CPU], "verify_artifact": False, "max_batch_size": max(batch, 16),
                         **overrides})
    prof = _Profiled() if ops else None
    if prof:
        prof.__enter__()
    try:
        eng = Engine(artifact, cfg, start=False)
    finally:
        if prof:
            prof.__exit__()
    engine_mod.sample_token, in_flight_mod.InFlightRequest.add_token = timed_sample, timed_add
    try:
        topics = ["a lighthouse keeper and a storm", "a cat who learns to fly", "the last train home",
                  "a robot gardener", "two rival bakers", "a map with no roads", "the quiet library", "snow in May"]
        handles = []
        for i in range(batch):
            prompt = eng.encode(f"Write a short story about {topics[i % len(topics)]} (part {i // len(topics) + 1}).")
            handles.append(eng.add_request(prompt, SamplingParams.greedy(steps + 64, ignore_eos=True)))
        while any(len(h.output_ids) < 2 for h in handles):  # every prefill done, every row decoding
            eng.step()
        for _ in range(3):
            eng.step()
        r = eng.runner
        run0, exe0 = r.run_seconds, r.step_seconds
        spent.update(sampling=0.0, detokenize=0.0)
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        total = time.perf_counter() - t0
        graph, execute = r.run_seconds - run0, r.step_seconds - exe0
        by_op = op_split(r.session.end_profiling(), steps) if ops else {}
    finally:
        engine_mod.sample_token, in_flight_mod.InFlightRequest.add_token = sample_token, add_token
        eng.shutdown()
    out = {"graph": graph, "runner": execute - graph, "sampling": spent["sampling"],
           "detokenize": spent["detokenize"]}
    out["engine rest"] = total - sum(out.values())
    out["step"] = total
    for op, sec in sorted(by_op.items(), key=lambda kv: -kv[1]):
        out[f"  op {op}"] = sec
    return {k: v / steps * 1e3 for k, v in out.items()}


def http_itl(artifact: Path, steps: int, overrides: dict) -> float:
    with running_server(artifact, {"result_cache_size": 0, **overrides}) as (url, _):
        body = {"prompt": "Write a short story about a lighthouse keeper and a storm.", "max_tokens": steps,
                "temperature": 0, "ignore_eos": True, "stream": True}
        httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=300)
        times = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
        gaps = np.diff(times[1:])  # from the second token on: decode steps only
        return float(np.median(gaps) * 1e3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_split", description=__doc__.split("\n")[0])
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="a ServeConfig field")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="rows decoding together (one split each)")
    p.add_argument("--ops", action="store_true", help="split the graph time by op type (ORT's profiler)")
    p.add_argument("--no-http", action="store_true", help="skip the HTTP part")
    a = p.parse_args(argv)
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}
    print(f"CPU flags: {cpu_flags()}; cores {os.cpu_count()}; load average {os.getloadavg()[0]:.1f}; {overrides}")
    for b in a.batch:
        split = engine_split(a.artifact, a.steps, overrides, b, a.ops)
        print(f"batch {b}: {split['step']:.2f} ms per step, {b / split['step'] * 1e3:.0f} tok/s of engine steps")
        for k, v in split.items():
            print(f"  {k:<28} {v:8.3f} ms  {100 * v / split['step']:5.1f} %")
    if not a.no_http:
        itl = http_itl(a.artifact, a.steps, overrides)
        print(f"  HTTP ITL p50 {itl:7.3f} ms  (one client; HTTP/SSE path ~ {itl - split['step']:+.3f} ms over the "
              f"last engine step)")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
