"""The server against what a user would run instead, in one invocation, on the same model and requests.

    python -m loadtest.run --model-dir embedded --artifact .cache/bench/smollm2-fp32 --requests 16 --concurrency 1 16
    python -m loadtest.run --model-dir <hf folder> --artifact <artifact> --requests 32 --concurrency 32 \
        --genai-model .cache/bench/genai/int8 --systems server hf_sequential hf_static ort_static genai

Systems (each on the same seeded workload, one after another, each in its own process):
``server`` (the OpenAI server over HTTP at each ``--concurrency``), ``hf_sequential`` (transformers
generate, batch 1), ``hf_static`` (transformers generate, left-padded batches of the largest
concurrency), ``ort_sequential`` / ``ort_static`` (the artifact's graph in a plain batch-1 / static
batch loop), ``genai`` (onnxruntime-genai, batch 1, on ``--genai-model``; skipped with the reason
when it is not installed). Prints a table with ratios to ``hf_sequential`` (or the first system)
and writes ``results.json``, ``throughput.png`` and ``server_c<N>.png`` (KV usage and RSS over time)
under ``--out`` (default ``benchmarks/results/<UTC time>``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from loadtest.loadgen import BenchResult

SYSTEMS = ("server", "hf_sequential", "hf_static", "ort_sequential", "ort_static", "genai")


def _fmt(x: float, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(rows: list[tuple[str, dict]], base: str) -> str:
    """Text table of the key figures (TTFT and ITL in ms, e2e in s); ratios are to the row named ``base``."""
    ref = dict(rows).get(base) or rows[0][1]
    head = (f"{'system':<22}{'tok/s':>8}{'x':>7}{'tok/CPU-s':>10}{'x':>7}{'req/s':>7}{'TTFT p50':>10}"
            f"{'p99 ms':>8}{'ITL p50':>9}{'p99 ms':>8}{'e2e mean':>10}{'p99 s':>7}{'RSS MiB':>9}{'fail':>5}")
    lines = [head, "-" * len(head)]
    for name, m in rows:
        r_tok = m["output_tokens_per_s"] / ref["output_tokens_per_s"]
        r_cpu = m["output_tokens_per_cpu_s"] / ref["output_tokens_per_cpu_s"]
        lines.append(f"{name:<22}{_fmt(m['output_tokens_per_s'], '8.1f')}{_fmt(r_tok, '7.2f')}"
                     f"{_fmt(m['output_tokens_per_cpu_s'], '10.1f')}{_fmt(r_cpu, '7.2f')}"
                     f"{_fmt(m['requests_per_s'], '7.2f')}{_fmt(1e3 * m['ttft_p50_s'], '10.0f')}{_fmt(1e3 * m['ttft_p99_s'], '8.0f')}"
                     f"{_fmt(1e3 * m['itl_p50_s'], '9.1f')}{_fmt(1e3 * m['itl_p99_s'], '8.1f')}"
                     f"{_fmt(m['e2e_mean_s'], '10.2f')}{_fmt(m['e2e_p99_s'], '7.2f')}"
                     f"{_fmt(m['peak_rss_mb'], '9.0f')}{m['requests_failed']:5.0f}")
    return "\n".join(lines)


def throughput_figure(rows: list[tuple[str, dict]], base: str, title: str):
    from matplotlib.figure import Figure

    ref = dict(rows).get(base) or rows[0][1]
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    names = [n for n, _ in rows]
    for ax, key, label in ((ax1, "output_tokens_per_s", "output tokens/s (wall)"),
                           (ax2, "output_tokens_per_cpu_s", "output tokens per CPU-second")):
        vals = [m[key] for _, m in rows]
        bars = ax.barh(names, vals, color=["tab:blue" if n.startswith("server") else "tab:gray" for n in names])
        for b, v in zip(bars, vals):
            ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" {v / ref[key]:.2f}x", va="center", fontsize=8)
        ax.set_xlabel(label)
        ax.invert_yaxis()
    ax2.set_yticklabels([])
    fig.suptitle(title, fontsize=10)
    return fig


def kv_budget_mb(artifact: Path, workload: list[dict], concurrency: int, block_size: int = 16) -> int:
    """A KV pool that holds ``concurrency`` of the workload's longest requests at once (+10%), at
    least the server's default 256 MiB: the baselines keep every sequence's K/V without limit, so an
    undersized pool would measure preemption, not batching."""
    from tokenizers import Tokenizer

    from loadtest.kv_calc import kv_memory_bytes, shape_from_manifest
    from serve.artifact import read_manifest
    from serve.engine.tokenizer import encode_prompt

    tok = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    man = read_manifest(artifact, verify=False)
    # Counted as the server encodes them: BOS included when the manifest says add_bos_token.
    longest = max(len(encode_prompt(tok, man, q["prompt"])) + int(q["max_tokens"]) for q in workload)
    need = kv_memory_bytes(shape_from_manifest(artifact), longest, concurrency, block_size)
    return max(256, int(1.1 * need / 2**20) + 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="embedded", help="HF model folder (or 'embedded') for the transformers baselines")
    p.add_argument("--artifact", required=True, help="artifact folder the server (and ort baselines) run")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8], help="server concurrency levels; the largest is "
                   "also the static batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-words", type=int, nargs=2, default=[16, 96])
    p.add_argument("--max-tokens", type=int, nargs=2, default=[16, 32])
    p.add_argument("--shared-prefix-words", type=int, default=384, help="words of the shared prefix (384 words = 639 SmolLM2 tokens)")
    p.add_argument("--max-len", type=int, default=1024, help="prompts are cut so prompt + max_tokens fits this")
    p.add_argument("--systems", nargs="+", default=["server", "hf_sequential", "hf_static", "ort_static", "genai"],
                   choices=SYSTEMS)
    p.add_argument("--genai-model", default=None, help="onnxruntime-genai model folder (its model builder's output)")
    p.add_argument("--serve-set", action="append", default=[], metavar="KEY=VALUE",
                   help="ServeConfig override for the server, e.g. max_num_batched_tokens=256 (repeatable)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/<UTC time>)")
    a = p.parse_args(argv)

    import yaml

    from loadtest.baselines import genai_available, run_isolated
    from loadtest.serve_bench import benchmark_artifact
    from loadtest.workloads import fit_to_context, make_workload, summarize

    artifact = Path(a.artifact)
    man = json.loads((artifact / "manifest.json").read_text())
    max_len = min(a.max_len, int(man["max_positions"]))
    workload = fit_to_context(make_workload(a.requests, a.seed, tuple(a.prompt_words), tuple(a.max_tokens),
                                            shared_prefix_words=a.shared_prefix_words), artifact, max_len)
    big = max(a.concurrency)
    out = Path(a.out or Path("benchmarks/results") / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    overrides = {"providers": ["CPUExecutionProvider"], "max_batch_size": big, "max_waiting": max(64, a.requests),
                 "kv_memory_mb": kv_budget_mb(artifact, workload, big)}
    for item in a.serve_set:
        k, _, v = item.partition("=")
        overrides[k.strip()] = yaml.safe_load(v)
    print(f"workload: {summarize(workload)}; artifact {artifact} ({man.get('architecture')}, {man['num_layers']} layers); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)

    results: list[BenchResult] = []
    skipped: dict[str, str] = {}

    def save(final_table: str = "") -> None:
        # After every system, so a long run that is stopped still leaves what it measured.
        (out / "results.json").write_text(json.dumps({
            "argv": sys.argv[1:] if argv is None else argv, "artifact": str(artifact), "model_dir": a.model_dir,
            "workload": summarize(workload), "serve_overrides": overrides, "loadavg": os.getloadavg(),
            "skipped": skipped, "table": final_table, "results": [r.to_dict() for r in results]}, indent=1))
    for system in a.systems:
        t = time.perf_counter()
        try:
            if system == "server":
                for c in a.concurrency:
                    r = benchmark_artifact(artifact, workload, c, overrides, label=f"server_c{c}", seed=a.seed)
                    results.append(r)
                    r.figure().savefig(out / f"server_c{c}.png", dpi=110)
                    save()
                    print(f"  server c={c}: {time.perf_counter() - t:.0f} s", flush=True)
                continue
            if system == "genai":
                why = genai_available() or (None if a.genai_model else "no --genai-model given")
                if why:
                    skipped[system] = why
                    print(f"  genai skipped: {why}", flush=True)
                    continue
                r = run_isolated("genai", workload, genai_model=a.genai_model)
            elif system.startswith("hf"):
                r = run_isolated("hf", workload, model_dir=a.model_dir, batch_size=1 if system == "hf_sequential" else big)
            else:
                r = run_isolated("ort", workload, artifact=str(artifact),
                                 batch_size=1 if system == "ort_sequential" else big)
            results.append(r)
            print(f"  {r.label}: {time.perf_counter() - t:.0f} s", flush=True)
            save()
        except Exception as e:   # one failing system should not lose the others' figures
            skipped[system] = f"{type(e).__name__}: {str(e)[-500:]}"
            print(f"  {system} FAILED: {skipped[system]}", flush=True)

    if not results:
        print("nothing ran", file=sys.stderr)
        return 1
    rows = [(r.label, r.metrics()) for r in results]
    base = "hf_sequential" if any(n == "hf_sequential" for n, _ in rows) else rows[0][0]
    txt = table(rows, base)
    load = os.getloadavg()
    print(f"\nratios (x) vs {base}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}\n{txt}")
    for r in results:
        if r.label.startswith("server"):
            pf = r.prefix_ttft()
            if pf:
                print(f"{r.label}: shared-prefix TTFT cold {1e3 * pf['cold_ttft_s']:.0f} ms, hits p50 "
                      f"{1e3 * pf['hit_ttft_p50_s']:.0f} ms ({pf['hit_over_cold']:.2f}x cold; "
                      f"{pf['prompt_tokens']:.0f}-token prompts); prefix-cache hit rate "
                      f"{r.metrics()['prefix_cache_hit_rate']:.2f}")
    throughput_figure(rows, base, f"{man.get('architecture')} {artifact.name}, {len(workload)} requests").savefig(
        out / "throughput.png", dpi=110)
    save(txt)
    print(f"wrote {out}/results.json, throughput.png" + "".join(f", server_c{c}.png" for c in a.concurrency
                                                                 if "server" in a.systems))
    return 0


if __name__ == "__main__":
    sys.exit(main())
