"""onnxruntime-genai baseline, run by ``loadtest.baselines.run_isolated`` inside ``.cache/genai-venv``.

Standalone on purpose (no project imports): that venv holds the CPU ``onnxruntime`` wheel
onnxruntime-genai needs, which must not meet this project's onnxruntime-gpu. Batch 1, greedy,
exactly ``max_tokens`` new tokens per request (min_length = max_length), one request after another.
Writes the result JSON that ``loadtest.baselines.result_from_json`` reads.

    .cache/genai-venv/bin/python loadtest/genai_worker.py --model <builder output> --workload w.json --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import time


def _peak_rss() -> int | None:
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _generate(og, model, ids: list[int], n_new: int) -> list[float]:
    params = og.GeneratorParams(model)
    total = len(ids) + n_new
    params.set_search_options(do_sample=False, max_length=total, min_length=total)
    gen = og.Generator(model, params)
    gen.append_tokens([ids])   # prefill runs here; the first new token comes from it
    times = []
    while not gen.is_done():
        gen.generate_next_token()
        times.append(time.perf_counter())
        if len(times) >= n_new:
            break
    return times


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a folder written by onnxruntime_genai.models.builder")
    p.add_argument("--workload", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (0 = genai's default)")
    a = p.parse_args()
    if a.batch_size != 1:
        raise SystemExit("genai_worker runs batch 1 only (the genai baseline is one request after another)")
    import onnxruntime_genai as og

    workload = json.load(open(a.workload))
    config = og.Config(a.model)
    if a.threads:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": a.threads}}}}))
    model = og.Model(config)
    tok = og.Tokenizer(model)
    _generate(og, model, list(tok.encode("Warm-up.")), 2)
    records = []
    t0, c0 = time.perf_counter(), time.process_time()
    for i, q in enumerate(workload):
        ids = [int(x) for x in tok.encode(q["prompt"])]
        n = int(q["max_tokens"])
        t_b = time.perf_counter()
        ts = _generate(og, model, ids, n)
        records.append({"id": int(q.get("id", i)), "kind": q.get("kind", ""), "max_tokens": n, "ok": len(ts) == n,
                        "status": 0, "error": "" if len(ts) == n else f"generated {len(ts)} of {n}",
                        "start_s": t_b - t0, "ttft_s": ts[0] - t_b, "e2e_s": ts[-1] - t_b,
                        "itl_s": [b - x for x, b in zip(ts, ts[1:])], "prompt_tokens": len(ids),
                        "completion_tokens": len(ts), "text_chunks": len(ts), "finish_reason": "length",
                        "result_cache": None})
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    json.dump({"label": "genai_sequential", "duration_s": wall, "concurrency": 1, "peak_rss_bytes": _peak_rss(),
               "server_cpu_s": cpu, "meta": {"model": a.model, "onnxruntime_genai": og.__version__,
                                                     "threads": a.threads},
               "records": records}, open(a.out, "w"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
