"""Where one batch-1 decode step goes: graph, runner, scheduling, sampling, detokenizing, and the HTTP path.

    python -m benchmarks.step_split --artifact <artifact> [--steps 64] [--set ort_spinning='"always"']

Engine part: one request decoding alone, the engine stepped by hand; per step the time inside
``session.run`` (graph), the rest of ``runner.execute`` (runner: inputs, bindings, K/V write-back, logits
copy), ``sample_token`` (sampling), ``InFlightRequest.add_token`` (detokenizing and stop checks) and the
remainder of the step (scheduling, bookkeeping, events). Sampling and detokenizing are timed by wrapping the
two functions the engine calls (the benchmark's own instrumentation; serve/ has no timers for them).

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


def engine_split(artifact: Path, steps: int, overrides: dict) -> dict[str, float]:
    import serve.engine as engine_mod
    import serve.in_flight as in_flight_mod
    from serve.config import ServeConfig
    from serve.engine import Engine
    from serve.runner import CPU
    from serve.sampling import SamplingParams

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

    cfg = ServeConfig(**{"providers": [CPU], "verify_artifact": False, **overrides})
    eng = Engine(artifact, cfg, start=False)
    engine_mod.sample_token, in_flight_mod.InFlightRequest.add_token = timed_sample, timed_add
    try:
        prompt = eng.encode("Write a short story about a lighthouse keeper and a storm.")
        eng.add_request(prompt, SamplingParams.greedy(steps + 8, ignore_eos=True))
        for _ in range(4):  # prefill and a few warm decode steps
            eng.step()
        r = eng.runner
        run0, exe0 = r.run_seconds, r.step_seconds
        spent.update(sampling=0.0, detokenize=0.0)
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        total = time.perf_counter() - t0
        graph, execute = r.run_seconds - run0, r.step_seconds - exe0
    finally:
        engine_mod.sample_token, in_flight_mod.InFlightRequest.add_token = sample_token, add_token
        eng.shutdown()
    out = {"graph": graph, "runner": execute - graph, "sampling": spent["sampling"],
           "detokenize": spent["detokenize"]}
    out["engine rest"] = total - sum(out.values())
    out["step"] = total
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
    a = p.parse_args(argv)
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}
    print(f"CPU flags: {cpu_flags()}; cores {os.cpu_count()}; load average {os.getloadavg()[0]:.1f}; {overrides}")
    split = engine_split(a.artifact, a.steps, overrides)
    itl = http_itl(a.artifact, a.steps, overrides)
    for k, v in split.items():
        print(f"  {k:<12} {v:7.3f} ms")
    print(f"  HTTP ITL p50 {itl:7.3f} ms  (HTTP/SSE path ~ {itl - split['step']:+.3f} ms over the engine step)")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
