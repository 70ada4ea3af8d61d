"""Batch-1 decode of an artifact through the server's engine, and of onnxruntime-genai, on the same prompts.

The pieces ``python -m benchmarks.run`` and the pipeline's benchmark stage (``benchmark.genai_model``) share:
``EngineSystem`` (the server's engine in-process, manual steps, caches off, batch 1), ``GenaiSystem``
(onnxruntime-genai in its own venv through ``loadtest/genai_worker.py``), ``take_turns`` (the systems run the
prompts chunk by chunk, in turn, so load changes on a shared machine hit all alike) and ``compare_with_genai``.
Figures per system: tok/s (output tokens over the summed request times, prefill included), ITL p50 and mean,
TTFT p50, tokens per CPU-second; ratios are ours / genai. ``cpu_info`` records the CPU flags with each result.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np

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

    def __init__(self, artifact: str, threads: int, spinning: str):
        from serve.config import ServeConfig
        from serve.engine.engine import Engine
        from serve.engine.sampling import SamplingParams
        from serve.runners.onnx_session import CPU

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
                "onnxruntime_genai.models.builder (benchmarks/history.md)")
    return genai_available()


def make_prompts(n: int, seed: int, max_tokens: int, words: tuple[int, int]) -> list[dict]:
    from loadtest.workloads import make_workload

    return make_workload(n, seed=seed, prompt_words=words, max_tokens=(max_tokens, max_tokens), shared_prefix_frac=0.0,
                         repeat_frac=0.0)


def take_turns(systems: dict[str, object], prompts: list[dict], rounds: int, progress: bool = True) -> dict[str, dict]:
    """Each system runs the prompts, chunk by chunk in turn; the summary per system (``summarize``)."""
    chunks = [c for c in np.array_split(np.arange(len(prompts)), max(1, rounds)) if len(c)]
    recs: dict[str, list] = {k: [] for k in systems}
    cpu = {k: 0.0 for k in systems}
    for i, idx in enumerate(chunks):
        chunk = [prompts[j] for j in idx]
        for name, s in systems.items():
            r, c = s.run(chunk)
            recs[name] += r
            cpu[name] += c
        if progress:
            print(f"  round {i + 1}/{len(chunks)} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    out = {}
    for k in systems:
        out[k] = summarize(recs[k], cpu[k])
        out[k]["first_tokens"] = recs[k][0]["first"] if recs[k] else []
    return out


def compare_with_genai(artifact: str | Path, genai_model: str | Path, requests: int = 16, max_tokens: int = 64,
                       seed: int = 0, prompt_words: tuple[int, int] = (16, 96), threads: int = 0,
                       genai_threads: int = 0, rounds: int = 2) -> dict:
    """Our artifact (the server's engine, its default spinning) against genai's model at batch 1, same prompts.

    Returns {"cpu", "loadavg", "engine": summary, "genai": summary, "ratios": {"tok_per_s", "tok_per_cpu_s",
    "itl_p50"}} (ratios ours / genai; itl_p50 genai / ours, so > 1 is ours faster), or {"skipped": reason}
    when genai cannot run here."""
    why = genai_skip_reason(str(genai_model))
    if why:
        return {"skipped": why}
    load0 = os.getloadavg()[0]
    prompts = make_prompts(requests, seed, max_tokens, prompt_words)
    eng = EngineSystem(str(artifact), threads, "during_runs")
    try:
        res = take_turns({"engine": eng, "genai": GenaiSystem(str(genai_model), genai_threads)}, prompts, rounds,
                         progress=False)
    finally:
        eng.close()
    e, g = res["engine"], res["genai"]
    return {"cpu": cpu_info(), "loadavg": (load0, os.getloadavg()[0]), "engine": e, "genai": g,
            "ratios": {"tok_per_s": e["tok_per_s"] / g["tok_per_s"], "tok_per_cpu_s": e["tok_per_cpu_s"] / g["tok_per_cpu_s"],
                       "itl_p50": g["itl_p50_ms"] / e["itl_p50_ms"]}}


def genai_metrics(result: dict) -> dict[str, float]:
    """compare_with_genai's result as flat MLflow metrics (none when it was skipped)."""
    if "skipped" in result:
        return {}
    out = {}
    for system, prefix in (("engine", "bench_batch1_"), ("genai", "genai_batch1_")):
        for k in ("tok_per_s", "tok_per_cpu_s", "itl_p50_ms", "ttft_p50_ms"):
            out[prefix + k] = float(result[system][k])
    out.update({f"bench_batch1_{k}_vs_genai": float(v) for k, v in result["ratios"].items()})
    return out
