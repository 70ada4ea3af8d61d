"""Decode step time, standard layout vs gqa layout, same model, same run (ratios hold on a shared machine).

    python -m benchmarks.gqa_bench --standard .cache/bench/smollm2-fp32 --gqa .cache/bench/smollm2-gqa \
        --batch 1 8 32 --past 128

standard: session.run with right-sized past tensors [B, kv_heads, past, head_dim] (what serve/runners/standard.py feeds
after its gather; the graph concatenates past and new into fresh present tensors every call).
gqa: IOBinding with one preallocated buffer per layer bound as past and present (in place), as
serve/runners/gqa.py runs it. Both interleave step by step so load changes hit both alike.
Reports median ms per step and the process CPU-seconds per step.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def _session(folder: Path, threads: int):
    from compress.artifact import read_manifest
    from serve.runners.onnx_session import make_session

    man = read_manifest(folder, verify=False)
    return make_session(folder / man.get("onnx_file", "model.onnx"), ["CPUExecutionProvider"], threads), man


def standard_step(sess, man, B: int, past: int):
    L, H, D = man["num_layers"], man["num_kv_heads"], man["head_dim"]
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(1, min(1000, man["vocab_size"]), (B, 1)), "attention_mask": np.ones((B, past + 1), np.int64),
             "position_ids": np.full((B, 1), past, np.int64)}
    for n in man["io"]["inputs"]:
        if n.startswith("past_key_values."):
            feeds[n] = rng.standard_normal((B, H, past, D), dtype=np.float32)
    outs = ["logits", *[n for n in man["io"]["outputs"] if n.startswith("present.")]]
    return lambda: sess.run(outs, feeds)


def gqa_step(sess, man, B: int, past: int):
    from compress.drivers.gqa import bind_step

    L, H, D, V = man["num_layers"], man["num_kv_heads"], man["head_dim"], man["vocab_size"]
    rng = np.random.default_rng(0)
    cap = -(-(past + 1) // 256) * 256
    kv = [rng.standard_normal((B, H, cap, D), dtype=np.float32) for _ in range(2 * L)]
    past_names = [n for n in man["io"]["inputs"] if n.startswith("past_key_values.")]
    present_names = [n for n in man["io"]["outputs"] if n.startswith("present.")]
    logits = np.empty((B, 1, V), np.float32)
    ids = rng.integers(1, min(1000, man["vocab_size"]), (B, 1))
    seqlens = np.full(B, past, np.int32)  # the new token lands at `past`, rewritten in place each call

    def run():
        binding = sess.io_binding()
        bind_step(binding, past_names, present_names, kv, input_ids=ids, seqlens_k=seqlens, total=past + 1,
                  logits=logits)
        sess.run_with_iobinding(binding)
    return run


def measure(steps: dict, n: int) -> dict:
    for f in steps.values():  # warm-up
        f()
        f()
    wall = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    for _ in range(n):
        for k, f in steps.items():
            t, c = time.perf_counter(), time.process_time()
            f()
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    return {k: {"ms_median": 1000 * float(np.median(wall[k])), "cpu_ms_median": 1000 * float(np.median(cpu[k]))}
            for k in steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--standard", type=Path, required=True)
    ap.add_argument("--gqa", type=Path, required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    s_sess, s_man = _session(args.standard, args.threads)
    g_sess, g_man = _session(args.gqa, args.threads)
    results = []
    for B in args.batch:
        r = measure({"standard": standard_step(s_sess, s_man, B, args.past),
                     "gqa": gqa_step(g_sess, g_man, B, args.past)}, args.steps)
        s, g = r["standard"], r["gqa"]
        row = {"batch": B, "past": args.past, **{f"{k}_{m}": v[m] for k, v in r.items() for m in v},
               "speedup_wall": s["ms_median"] / g["ms_median"], "speedup_cpu": s["cpu_ms_median"] / g["cpu_ms_median"]}
        results.append(row)
        print(f"batch {B:>2}, past {args.past}: standard {s['ms_median']:.1f} ms/step ({s['cpu_ms_median']:.1f} CPU-ms), "
              f"gqa {g['ms_median']:.1f} ms/step ({g['cpu_ms_median']:.1f} CPU-ms): x{row['speedup_wall']:.2f} wall, "
              f"x{row['speedup_cpu']:.2f} CPU", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
