"""The server at several concurrency levels: tokens/s, tokens per CPU-second and peak RSS, one server per level.

    python -m benchmarks.sweep --artifact <artifact> [--concurrency 1 8 32 64] [--set ort_spinning='"always"']

Workload: ``loadtest.workloads.make_workload`` (seeded chat-like prompts, greedy), ``4 x c`` requests at
concurrency c (at least 8), each server fresh (empty caches, ``result_cache_size`` 0 so every request
runs). Run it from two checkouts on the same artifact to compare builds; the CPU flags and the load
average are printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.burst import cpu_flags
from loadtest.serve_bench import benchmark_artifact
from loadtest.workloads import make_workload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__.split("\n")[0])
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="a ServeConfig field")
    a = p.parse_args(argv)
    overrides = {"result_cache_size": 0, "max_batch_size": max(a.concurrency), "kv_memory_mb": 512}
    overrides.update({k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)})
    print(f"CPU flags: {cpu_flags()}; cores {os.cpu_count()}; load average {os.getloadavg()[0]:.1f}; {overrides}")
    print(f"{'c':>3} {'requests':>8} {'tok/s':>7} {'tok/CPU-s':>9} {'TTFT p50':>9} {'ITL p50':>8} {'peak RSS':>9} {'load':>5}")
    for c in a.concurrency:
        wl = make_workload(max(8, 4 * c), seed=0)
        m = benchmark_artifact(a.artifact, wl, concurrency=c, serve_overrides=overrides).metrics()
        print(f"{c:>3} {len(wl):>8} {m['output_tokens_per_s']:7.1f} {m['output_tokens_per_cpu_s']:9.1f} "
              f"{m['ttft_p50_s'] * 1e3:7.0f}ms {m['itl_p50_s'] * 1e3:6.1f}ms {m['peak_rss_mb']:7.0f}MiB "
              f"{os.getloadavg()[0]:5.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
