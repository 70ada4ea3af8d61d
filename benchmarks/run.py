"""Batch-1 decode, our artifacts against onnxruntime-genai on the same weights and prompts, in one invocation.

    python -m benchmarks.run --int8 <INT8 gqa artifact> --fp32 <fp32 gqa artifact> \
        --genai-int8 .cache/bench/genai/int8 --genai-fp32 .cache/bench/genai/fp32

Systems, for each precision given (int8, fp32):

- ``engine``: the server's engine in-process (serve.engine.engine.Engine, manual stepping: scheduler, runner,
  ORT call, sampling, detokenization; no HTTP), prefix and result caches off, batch 1;
- ``graph``: the same artifact's graph alone through the offline driver (compress.drivers greedy),
  which splits the engine's own per-token cost from the graph's;
- ``genai``: onnxruntime-genai's generator in its own venv (.cache/genai-venv, loadtest/genai_worker.py:
  its onnxruntime conflicts with this venv's onnxruntime-gpu), batch 1; skipped with the reason when it
  is not installed or no model folder is given.

The prompts are ``make_workload(n, seed, shared_prefix_frac=0, repeat_frac=0)`` passages, greedy, EOS
ignored, exactly ``--max-tokens`` new tokens each. The workload is cut into ``--rounds`` chunks and the
systems take turns chunk by chunk, so load changes on a shared machine hit all of them alike.

Figures per system: tok/s (output tokens over the summed request times, prefill included), ITL p50 and
mean (decode steps), TTFT p50, and tokens per CPU-second of the measuring process (process_time; the
genai worker measures its own). Ratios are ours / genai. The CPU's flags (AVX2, AVX-512, VNNI) and the
load average before and after are printed and saved with the figures in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from loadtest.batch1 import (FLAGS, EngineSystem, GenaiSystem, cpu_info, genai_skip_reason, make_prompts,
                             take_turns)

ROOT = Path(__file__).resolve().parents[1]


class GraphSystem:
    """The artifact's graph alone: the offline driver's greedy loop (prefill + one decode call per token)."""

    def __init__(self, artifact: str, threads: int, spinning: str):
        from tokenizers import Tokenizer

        from compress.drivers import load_lm
        from serve.runners.onnx_session import artifact_session

        self.lm = load_lm(artifact, threads=threads or None)
        # the same session settings as the engine's runner, so the two differ only by the engine's own per-token work
        self.lm.session = artifact_session(artifact, self.lm.manifest, threads=threads, log_severity=3,
                                           spinning=spinning)
        self.tok = Tokenizer.from_file(str(Path(artifact) / "tokenizer.json"))
        self.run([{"prompt": "Warm-up.", "max_tokens": 4}])

    def run(self, chunk: list[dict]) -> tuple[list[dict], float]:
        recs = []
        c0 = time.process_time()
        for q in chunk:
            n = int(q["max_tokens"])
            t0 = time.perf_counter()
            ids = self.tok.encode(q["prompt"]).ids
            steps: list[float] = []
            out = self.lm.greedy(ids, n, step_seconds=steps)
            t1 = time.perf_counter()
            ttft = (t1 - t0) - sum(steps)
            recs.append({"prompt_tokens": len(ids), "tokens": len(out), "ttft_s": ttft, "e2e_s": t1 - t0,
                         "itl_s": steps, "first": out[:8]})
        return recs, time.process_time() - c0

    def close(self) -> None:
        pass


def print_results(res: dict) -> None:
    print(f"\nCPU: {res['cpu']['model']}, {res['cpu']['cpus']} logical CPUs; "
          + ", ".join(f"{f} {'yes' if res['cpu'][f] else 'no'}" for f in FLAGS))
    print(f"load average before {res['loadavg_before'][0]:.2f}, after {res['loadavg_after'][0]:.2f}; "
          f"{res['requests']} prompts, {res['max_tokens']} new tokens each, ORT threads {res['threads'] or 'default'} "
          f"(genai {res.get('genai_threads') or 'default'})")
    print("| precision | system | tok/s | ITL p50 | ITL mean | TTFT p50 | tok/CPU-s | tok/s ÷ genai | tok/CPU-s ÷ genai |")
    print("|---|---|---|---|---|---|---|---|---|")
    for prec, systems in res["results"].items():
        g = systems.get("genai")
        for name, m in systems.items():
            r1 = f"{m['tok_per_s'] / g['tok_per_s']:.2f}" if g else "–"
            r2 = f"{m['tok_per_cpu_s'] / g['tok_per_cpu_s']:.2f}" if g else "–"
            print(f"| {prec} | {name} | {m['tok_per_s']:.1f} | {m['itl_p50_ms']:.2f} ms | {m['itl_mean_ms']:.2f} ms | "
                  f"{m['ttft_p50_ms']:.0f} ms | {m['tok_per_cpu_s']:.1f} | {r1} | {r2} |")
    for prec, why in res.get("skipped", {}).items():
        print(f"{prec} genai skipped: {why}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--int8", help="our INT8 artifact folder")
    ap.add_argument("--fp32", help="our fp32 artifact folder")
    ap.add_argument("--int8-before", help="another INT8 artifact (e.g. the champion before a change), timed in "
                    "the same turns as engine_before / graph_before")
    ap.add_argument("--genai-int8", default=str(ROOT / ".cache/bench/genai/int8"))
    ap.add_argument("--genai-fp32", default=str(ROOT / ".cache/bench/genai/fp32"))
    ap.add_argument("--systems", nargs="+", default=["engine", "graph", "genai"], choices=["engine", "graph", "genai"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, nargs=2, default=(16, 96))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=4, help="chunks the systems take turns on")
    ap.add_argument("--threads", type=int, default=0, help="ORT intra-op threads for ours (0 = ORT's default)")
    ap.add_argument("--genai-threads", type=int, default=0,
                    help="ORT intra-op threads for genai (0 = its default; give --threads' value to compare like for like)")
    ap.add_argument("--ort-spinning", choices=["off", "during_runs", "always"], default="during_runs",
                    help="how ORT's intra-op threads wait for work, for ours (serve.ort_spinning; default the server's)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/batch1/results.json"))
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    precisions = {p: (art, gm) for p, art, gm in (("int8", a.int8, a.genai_int8), ("fp32", a.fp32, a.genai_fp32)) if art}
    if not precisions:
        ap.error("give --int8 and/or --fp32 (artifact folders)")
    prompts = make_prompts(a.requests, a.seed, a.max_tokens, tuple(a.prompt_words))
    res = {"cpu": cpu_info(), "loadavg_before": os.getloadavg(), "requests": a.requests, "max_tokens": a.max_tokens,
           "threads": a.threads, "genai_threads": a.genai_threads, "ort_spinning": a.ort_spinning, "artifacts": {}, "results": {}, "skipped": {},
           "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    for prec, (art, gm) in precisions.items():
        systems: dict[str, object] = {}
        if "engine" in a.systems:
            systems["engine"] = EngineSystem(art, a.threads, a.ort_spinning)
        if "graph" in a.systems:
            systems["graph"] = GraphSystem(art, a.threads, a.ort_spinning)
        if prec == "int8" and a.int8_before:
            if "engine" in a.systems:
                systems["engine_before"] = EngineSystem(a.int8_before, a.threads, a.ort_spinning)
            if "graph" in a.systems:
                systems["graph_before"] = GraphSystem(a.int8_before, a.threads, a.ort_spinning)
        if "genai" in a.systems:
            why = genai_skip_reason(gm)
            if why:
                res["skipped"][prec] = why
                print(f"{prec}: genai skipped: {why}", flush=True)
            else:
                systems["genai"] = GenaiSystem(gm, a.genai_threads)
        res["artifacts"][prec] = {"ours": art, "genai": gm if "genai" in systems else None,
                                  **({"before": a.int8_before} if prec == "int8" and a.int8_before else {})}
        print(f"{prec}: {', '.join(systems)} on {a.requests} prompts x {a.max_tokens} tokens", flush=True)
        res["results"][prec] = take_turns(systems, prompts, a.rounds)
        for s in systems.values():
            s.close()
    res["loadavg_after"] = os.getloadavg()
    print_results(res)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=float))
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
