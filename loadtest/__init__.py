"""Load-testing library for the OpenAI-compatible server (installed with the project).

What the pipeline's benchmark stage, the CLI and the tests import:

- ``workloads``: seeded request lists as plain data (mixed lengths, a shared prefix, exact repeats);
- ``loadgen``: the async HTTP load generator and ``BenchResult`` (metrics, figure);
- ``serve_bench``: ``benchmark_artifact`` (a server on a free port, a workload, figures) and ``ratios``;
- ``baselines``: what a user would run instead (transformers ``generate``, a plain ORT loop,
  onnxruntime-genai through ``genai_worker``), each in its own process;
- ``run``: the comparison CLI, ``python -m loadtest.run`` (server vs baselines: table, JSON, plots);
- ``soak``: long mixed traffic with live swaps, ``python -m loadtest.soak --minutes 10``;
- ``kv_calc``: KV-cache sizing (``compressor kv-calc``), which the comparison uses to size the pool.

It may import compress/ and serve/, never flows/ or tasks/ (tests/test_layout.py). The one-off
measurement scripts behind the figures in docs/ live in benchmarks/ and are not installed.
"""
