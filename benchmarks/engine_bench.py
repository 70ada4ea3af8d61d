"""Sequential batch-1 decoding vs the engine's continuous batching, in generated tokens per second.

    python -m benchmarks.engine_bench --artifact artifacts/<run>/fp32 --concurrency 1 8 32
    python -m benchmarks.engine_bench --artifact <standard artifact> <gqa artifact>   # layouts side by side

Baseline ("sequential"): one request after another on the same ONNX graph, batch 1, the
plain loop (present fed back as past, no block pool): what a server without batching does.
Engine at concurrency c: c client threads, each sending requests back to back until the
request list is exhausted, all through one ``Engine`` (background thread).
Both generate the same greedy tokens for the same prompts (checked and printed).
Several artifacts (e.g. the same model in the ``standard`` and ``gqa`` attention layouts) run
interleaved per concurrency level, and each is compared with the first one in the same run.

Reported per run: wall tokens/s, tokens per CPU-second of this process (robust on a shared
machine), and for the engine the share of step time outside ``session.run`` (gather,
scatter, scheduling, sampling).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # ids well inside the vocabulary, away from special tokens at the start
    return [rng.integers(100, vocab - 1, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def sequential(artifact: Path, prompts, max_tokens: int, threads: int) -> dict:
    """The batch-1 loop: the layout's offline driver (compress/drivers/), one request after another."""
    from compress.drivers import load_lm

    lm = load_lm(artifact, threads or None, verify=False)
    t0, c0 = time.perf_counter(), time.process_time()
    outputs = [lm.greedy(list(p), max_tokens) for p in prompts]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    toks = sum(len(g) for g in outputs)
    return {"mode": "sequential batch-1", "concurrency": 1, "requests": len(prompts), "tokens": toks,
            "wall_s": wall, "cpu_s": cpu, "tok_s": toks / wall, "tok_per_cpu_s": toks / cpu, "outputs": outputs}


def engine_run(artifact: Path, prompts, max_tokens: int, concurrency: int, threads: int, batch_cap: int) -> dict:
    from serve.config import ServeConfig
    from serve.engine.engine import Engine
    from serve.engine.sampling import SamplingParams

    cfg = ServeConfig(verify_artifact=False, providers=["CPUExecutionProvider"], intra_op_threads=threads,
                      max_batch_size=max(batch_cap, concurrency), max_num_batched_tokens=512, kv_memory_mb=1024,
                      max_waiting=max(64, len(prompts)))
    eng = Engine(artifact, cfg, start=True)
    params = SamplingParams.greedy(max_tokens, ignore_eos=True)
    outputs: dict[int, list[int]] = {}
    todo = list(range(len(prompts)))
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            outputs[i] = eng.add_request(prompts[i], params).result().output_ids

    t0, c0 = time.perf_counter(), time.process_time()
    run0, step0 = eng.runner.run_seconds, eng.runner.step_seconds
    ths = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = eng.stats()
    run_s, step_s = eng.runner.run_seconds - run0, eng.runner.step_seconds - step0
    eng.shutdown()
    toks = sum(len(o) for o in outputs.values())
    return {"mode": "engine", "concurrency": concurrency, "requests": len(prompts), "tokens": toks, "wall_s": wall,
            "cpu_s": cpu, "tok_s": toks / wall, "tok_per_cpu_s": toks / cpu,
            "outside_run_share": 1 - run_s / step_s if step_s else 0.0, "steps": st.steps,
            "batch_fill": st.batch_fill_ratio, "preemptions": st.preemptions,
            "outputs": [outputs[i] for i in range(len(prompts))]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True, type=Path, nargs="+",
                    help="one or more artifact folders (e.g. standard and gqa layouts of one model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default: max(concurrency, 8))")
    ap.add_argument("--baseline-requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[32, 96])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0 = default)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)

    from compress.artifact import read_manifest

    manifests = {a: read_manifest(a, verify=False) for a in args.artifact}
    first = args.artifact[0]
    n_max = max(args.requests or max(c, 8) for c in args.concurrency)
    prompts = make_prompts(max(n_max, args.baseline_requests), *args.prompt_len, int(manifests[first]["vocab_size"]))

    def tag(a: Path) -> str:
        return f"[{manifests[a].get('attention_layout', 'standard')}] " if len(args.artifact) > 1 else ""

    results = []
    base: dict[Path, dict] = {}
    for a in args.artifact:
        b = sequential(a, prompts[:args.baseline_requests], args.max_tokens, args.threads)
        b["artifact"], b["layout"] = str(a), manifests[a].get("attention_layout", "standard")
        base[a] = b
        results.append(b)
        print(f"{tag(a)}sequential batch-1: {b['tokens']} tokens in {b['wall_s']:.1f} s = {b['tok_s']:.1f} tok/s "
              f"({b['tok_per_cpu_s']:.1f} tok/CPU-s)", flush=True)
    for c in args.concurrency:
        n = args.requests or max(c, 8)
        ref = None
        for a in args.artifact:
            b = base[a]
            r = engine_run(a, prompts[:n], args.max_tokens, c, args.threads, batch_cap=c)
            r["artifact"], r["layout"] = str(a), manifests[a].get("attention_layout", "standard")
            same = sum(r["outputs"][i] == b["outputs"][i] for i in range(min(n, len(b["outputs"]))))
            r["same_tokens_as_sequential"] = f"{same}/{min(n, len(b['outputs']))}"
            extra = ""
            if ref is None:
                ref = r
            else:
                r["same_tokens_as_first"] = f"{sum(x == y for x, y in zip(r['outputs'], ref['outputs']))}/{n}"
                r["tok_per_cpu_s_vs_first"] = r["tok_per_cpu_s"] / ref["tok_per_cpu_s"]
                r["tok_s_vs_first"] = r["tok_s"] / ref["tok_s"]
                extra = (f"; vs {tag(first).strip()} x{r['tok_s_vs_first']:.2f} wall, x{r['tok_per_cpu_s_vs_first']:.2f} "
                         f"per CPU-s, same tokens {r['same_tokens_as_first']}")
            results.append(r)
            print(f"{tag(a)}engine, {c:>2} concurrent: {r['tokens']} tokens in {r['wall_s']:.1f} s = {r['tok_s']:.1f} tok/s "
                  f"({r['tok_per_cpu_s']:.1f} tok/CPU-s), x{r['tok_s'] / b['tok_s']:.2f} vs sequential wall, "
                  f"x{r['tok_per_cpu_s'] / b['tok_per_cpu_s']:.2f} per CPU-s; batch fill {r['batch_fill']:.2f}, "
                  f"time outside session.run {100 * r['outside_run_share']:.0f}%; greedy tokens equal to sequential: "
                  f"{r['same_tokens_as_sequential']}{extra}", flush=True)
    if args.json:
        for r in results:
            r.pop("outputs", None)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
