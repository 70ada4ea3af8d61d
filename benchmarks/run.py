"""Batch-1 decode, our artifacts against onnxruntime-genai on the same weights and prompts, in one invocation.

    python -m benchmarks.run --int8 <INT8 gqa artifact> --fp32 <fp32 gqa artifact> \
        --genai-int8 .cache/bench/genai/int8 --genai-fp32 .cache/bench/genai/fp32

Systems, for each precision given (int8, fp32):

- ``engine``: the server's engine in-process (serve.engine.Engine, manual stepping: scheduler, runner,
  ORT call, sampling, detokenization; no HTTP), prefix and result caches off, batch 1;
- ``graph``: the same artifact's graph alone through the offline driver (compress.lm_driver greedy),
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
import re
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def cpu_info(cpuinfo: str | None = None) -> dict:
    """Model name, logical CPUs and which of FLAGS the CPU has (from /proc/cpuinfo)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.lower().startswith(("flags", "features")):
            flags |= set(line.split(":", 1)[-1].split())
    m = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    return {"model": m.group(1).strip() if m else "?", "cpus": os.cpu_count(),
            **{f: f in flags for f in FLAGS}}


def summarize(recs: list[dict], cpu_s: float) -> dict:
    """recs: {"prompt_tokens", "tokens", "ttft_s", "e2e_s", "itl_s"} per request."""
    toks = sum(r["tokens"] for r in recs)
    itl = [x for r in recs for x in r["itl_s"]]
    e2e = sum(r["e2e_s"] for r in recs)
    return {"requests": len(recs), "output_tokens": toks, "prompt_tokens": sum(r["prompt_tokens"] for r in recs),
            "tok_per_s": toks / e2e if e2e > 0 else float("nan"),
            "itl_p50_ms": 1000 * float(np.median(itl)) if itl else float("nan"),
            "itl_mean_ms": 1000 * float(np.mean(itl)) if itl else float("nan"),
            "ttft_p50_ms": 1000 * float(np.median([r["ttft_s"] for r in recs])) if recs else float("nan"),
            "cpu_s": cpu_s, "tok_per_cpu_s": toks / cpu_s if cpu_s > 0 else float("nan")}


class EngineSystem:
    """The server's engine in-process, manual steps, caches off, batch 1."""

    def __init__(self, artifact: str, threads: int, spinning: bool):
        from serve.config import ServeConfig
        from serve.engine import Engine
        from serve.onnx_session import CPU
        from serve.sampling import SamplingParams

        self._params = SamplingParams
        kw = {"ort_spinning": spinning} if "ort_spinning" in ServeConfig.model_fields else {}
        cfg = ServeConfig(providers=[CPU], enable_prefix_caching=False, result_cache_size=0, max_batch_size=1,
                          intra_op_threads=threads, **kw)
        self.engine = Engine(artifact, cfg, start=False)
        self.run([{"prompt": "Warm-up.", "max_tokens": 4}])

    def run(self, chunk: list[dict]) -> tuple[list[dict], float]:
        eng, recs = self.engine, []
        c0 = time.process_time()
        for q in chunk:
            n = int(q["max_tokens"])
            t0 = time.perf_counter()
            h = eng.add_request(q["prompt"], self._params.greedy(n, ignore_eos=True))
            stamps = []
            while eng.has_work():
                eng.step()
                stamps.append(time.perf_counter())  # batch 1: one token per step (prompts fit one chunk)
            out = h.result()
            if len(out.output_ids) != n or len(stamps) != n:
                raise RuntimeError(f"engine: {len(out.output_ids)} tokens in {len(stamps)} steps, wanted {n}")
            recs.append({"prompt_tokens": len(out.prompt_ids) if hasattr(out, "prompt_ids") else len(eng.encode(q["prompt"])),
                         "tokens": n, "ttft_s": stamps[0] - t0, "e2e_s": stamps[-1] - t0,
                         "itl_s": list(np.diff(stamps)), "first": list(out.output_ids[:8])})
        return recs, time.process_time() - c0

    def close(self) -> None:
        self.engine.shutdown()


class GraphSystem:
    """The artifact's graph alone: the offline driver's greedy loop (prefill + one decode call per token)."""

    def __init__(self, artifact: str, threads: int, spinning: bool):
        import onnxruntime as ort
        from tokenizers import Tokenizer

        from compress.lm_driver import load_lm

        self.lm = load_lm(artifact, threads=threads or None)
        # the same session settings as the engine's runner (spinning off unless asked), so the two differ
        # only by the engine's own per-token work
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        self.lm.session = ort.InferenceSession(str(Path(artifact) / self.lm.manifest.get("onnx_file", "model.onnx")),
                                               opts, providers=["CPUExecutionProvider"])
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


class GenaiSystem:
    """onnxruntime-genai in its own venv (loadtest.baselines.run_isolated, loadtest/genai_worker.py)."""

    def __init__(self, model_dir: str, threads: int = 0):
        self.model_dir, self.threads = model_dir, threads

    def run(self, chunk: list[dict]) -> tuple[list[dict], float]:
        from loadtest.baselines import run_isolated

        wl = [{"id": i, "kind": "mixed", "prompt": q["prompt"], "max_tokens": q["max_tokens"]} for i, q in enumerate(chunk)]
        res = run_isolated("genai", wl, genai_model=self.model_dir, threads=self.threads)
        recs = [{"prompt_tokens": r.prompt_tokens, "tokens": r.completion_tokens, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                 "itl_s": list(r.itl_s), "first": []} for r in res.records]
        return recs, float(res.server_cpu_s or 0.0)

    def close(self) -> None:
        pass


def genai_skip_reason(model_dir: str | None) -> str | None:
    from loadtest.baselines import genai_available

    if not model_dir:
        return "no genai model folder given"
    if not (Path(model_dir) / "genai_config.json").is_file():
        return (f"{model_dir} has no genai_config.json: build it with .cache/genai-venv/bin/python -m "
                "onnxruntime_genai.models.builder (docs/benchmarks.md)")
    return genai_available()


def make_prompts(n: int, seed: int, max_tokens: int, words: tuple[int, int]) -> list[dict]:
    from loadtest.workloads import make_workload

    return make_workload(n, seed=seed, prompt_words=words, max_tokens=(max_tokens, max_tokens), shared_prefix_frac=0.0,
                         repeat_frac=0.0)


def run(systems: dict[str, object], prompts: list[dict], rounds: int) -> dict[str, dict]:
    chunks = [c for c in np.array_split(np.arange(len(prompts)), max(1, rounds)) if len(c)]
    recs: dict[str, list] = {k: [] for k in systems}
    cpu = {k: 0.0 for k in systems}
    for i, idx in enumerate(chunks):
        chunk = [prompts[j] for j in idx]
        for name, s in systems.items():
            r, c = s.run(chunk)
            recs[name] += r
            cpu[name] += c
        print(f"  round {i + 1}/{len(chunks)} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    out = {}
    for k in systems:
        out[k] = summarize(recs[k], cpu[k])
        out[k]["first_tokens"] = recs[k][0]["first"] if recs[k] else []
    return out


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
    ap.add_argument("--ort-spinning", action="store_true",
                    help="ORT intra-op threads busy-wait between runs (its default; the server turns it off)")
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
        res["results"][prec] = run(systems, prompts, a.rounds)
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
