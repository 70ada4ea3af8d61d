"""Quantize SmolLM2-135M every way compress/quantize/quantizer.py offers and measure each variant (docs/quantization.md).

  .venv/bin/python -m benchmarks.quantize_smollm2                 # every variant, then the table
  .venv/bin/python -m benchmarks.quantize_smollm2 --only w8a8_sq  # one variant (results are cached per variant)
  .venv/bin/python -m benchmarks.quantize_smollm2 --table         # print the table from the cached results

The fp32 teacher artifact is exported once to .cache/bench/smollm2-fp32 (dynamo, ~1-4 min) and reused.
Each variant runs in its own process so its peak RSS is its own. Eval: 32 blocks of 128 tokens of the
embedded corpus (the eval split; calibration reads only the calib split), 2 threads.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / ".cache" / "bench"
FP32 = BENCH / "smollm2-fp32"
RESULTS = BENCH / "quantize"
THREADS = 2

# name -> QuantizeConfig overrides
VARIANTS: dict[str, dict] = {
    "fp32": {},
    # "naive": every linear, no smoothing, ORT-style defaults
    "naive_static": dict(method="static", smoothquant_alpha=None, keep_float=[], quantize_embedding=False, reduce_range=False),
    "naive_dynamic": dict(method="dynamic", smoothquant_alpha=None, keep_float=[], quantize_embedding=False, reduce_range=False),
    # the best static recipe of the first probes (docs/facts.md): down_proj in float
    "static_keep_down": dict(method="static", smoothquant_alpha=None, keep_float=["down_proj"], keep_float_as="float", quantize_embedding=False),
    "static_sq": dict(method="static", smoothquant_alpha=0.5, keep_float=[]),
    "static_sq_auto": dict(method="static", smoothquant_alpha="auto", keep_float=[]),
    "static_sq_mixed": dict(method="static", smoothquant_alpha=0.5, keep_float=["down_proj"], keep_float_as="weight_only"),
    "static_sq_auto_mixed": dict(method="static", smoothquant_alpha="auto", keep_float=["down_proj"], keep_float_as="weight_only"),
    "static_sq_auto_entropy_mixed": dict(method="static", smoothquant_alpha="auto", calibration="entropy", keep_float=["down_proj"]),
    "static_sq_auto_percentile_mixed": dict(method="static", smoothquant_alpha="auto", calibration="percentile", keep_float=["down_proj"]),
    "dynamic_token": dict(method="dynamic", activation_granularity="token", smoothquant_alpha=None, keep_float=[]),
    "dynamic_token_sq": dict(method="dynamic", activation_granularity="token", smoothquant_alpha=0.5, keep_float=[]),
    "dynamic_token_sq_auto": dict(method="dynamic", activation_granularity="token", smoothquant_alpha="auto", keep_float=[]),
    "dynamic_token_sq_fp32emb": dict(method="dynamic", activation_granularity="token", smoothquant_alpha=0.5, keep_float=[], quantize_embedding=False),
    "weight_only": dict(method="weight_only", smoothquant_alpha=None, keep_float=[], quantize_embedding=False),
    "weight_only_emb": dict(method="weight_only", smoothquant_alpha=None, keep_float=[]),
}


def ensure_fp32():
    from compress.corpus.splits import make_splits
    from compress.loading.models import load_teacher

    model, tok = load_teacher(cache_dir=ROOT / ".cache" / "models")
    if not (FP32 / "manifest.json").is_file():
        from compress.export.standard import build_artifact

        tmp = FP32.with_name(FP32.name + ".tmp")
        build_artifact(model, tok, tmp)
        tmp.rename(FP32)
    splits = make_splits(tok, "embedded", block_size=128, train_blocks=16, calib_blocks=32, selection_blocks=32)
    return model, tok, splits


def run_variant(name: str) -> dict:
    from compress.config import QuantizeConfig
    from compress.evaluate.onnx_eval import evaluate_onnx
    from compress.quantize.quantizer import quantize_artifact

    model, tok, splits = ensure_fp32()
    row: dict = {"variant": name, "overrides": VARIANTS[name]}
    if name == "fp32":
        from compress.evaluate.torch_eval import perplexity

        row["torch_perplexity"] = perplexity(model, splits.selection)
        art = FP32
    else:
        del model
        cfg = QuantizeConfig(**VARIANTS[name])
        art = BENCH / name
        t0 = time.perf_counter()
        rep = quantize_artifact(FP32, art, splits.calib, cfg, threads=THREADS,
                                on_event=lambda ev, d: print(f"  {ev}: {d}", flush=True),
                                calibration_cache=BENCH / "calib_first_pass.npz")
        row["quant_seconds"] = time.perf_counter() - t0
        row["quant_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        row["report"] = rep.to_dict()
    import numpy as np

    top1_file = BENCH / "fp32_eval_top1.npy"
    if not top1_file.is_file():
        from compress.evaluate.onnx_eval import prefill_logits

        np.save(top1_file, prefill_logits(FP32, splits.selection, threads=THREADS).argmax(-1))
    row.update(evaluate_onnx(art, splits.selection, reference_top1=np.load(top1_file), threads=THREADS, decode_steps=40))
    row["size_ratio"] = row["size_bytes"] / sum(p.stat().st_size for p in FP32.glob("model.onnx*"))
    return row


def gate_loop(name: str, qoverrides: dict, groups_per_trial: int = 12, trials: int = 3) -> dict:
    """The accuracy-aware loop on SmolLM2: W8A8 targets, relax by moving groups to 8-bit weight-only."""
    import numpy as np

    from compress.quantize.relax import quantize_with_acceptance
    from compress.config import AcceptConfig, QuantizeConfig

    _, _, splits = ensure_fp32()
    base = json.loads((RESULTS / "fp32.json").read_text())
    acfg = AcceptConfig(max_perplexity_ratio=1.02, min_top1_agreement=0.95, max_size_ratio=0.30,
                        relax_trials=trials, relax_groups_per_trial=groups_per_trial)
    top1 = np.load(BENCH / "fp32_eval_top1.npy")
    res = quantize_with_acceptance(FP32, BENCH / name, splits.calib, splits.selection, QuantizeConfig(**qoverrides), acfg,
                                   baseline=base, threads=THREADS, eval_kwargs={"reference_top1": top1, "latency": False},
                                   on_trial=lambda i, rec: print(f"  trial {i}: ppl {rec['metrics']['perplexity']:.3f} "
                                                                 f"agr {rec['metrics']['top1_agreement']:.4f} float groups "
                                                                 f"{len(rec['extra_float_groups'])} -> {rec['accepted']} {rec['reasons']}", flush=True))
    out = {"variant": name, "accepted": res.verdict.accepted, "reasons": res.verdict.reasons,
           "trials": [{k: v for k, v in t.items() if k != "float_groups"} for t in res.trials]}
    (RESULTS / f"gate_{name}.json").write_text(json.dumps(out, indent=1, default=str))
    return out


def latency_interleaved(rounds: int = 4, steps: int = 16) -> None:
    """Batch-1 decode ms/token of every built variant, measured round-robin so load from other processes
    hits all variants alike; stored as decode_ms_interleaved in each result."""
    import numpy as np

    from compress.drivers import load_lm

    rows = load_rows()
    arts = {n: (FP32 if n == "fp32" else BENCH / n) for n in rows if (FP32 if n == "fp32" else BENCH / n).is_dir()}
    drivers = {n: load_lm(a, THREADS, verify=False) for n, a in arts.items()}
    times: dict[str, list[float]] = {n: [] for n in drivers}
    prompt = list(range(1000, 1032))
    for _ in range(rounds):
        for n, lm in drivers.items():
            t: list[float] = []
            lm.greedy(prompt, steps + 2, step_seconds=t)
            times[n] += t[2:]
    for n, t in times.items():
        row = rows[n]
        row["decode_ms_interleaved"] = 1000 * float(np.median(t))
        (RESULTS / f"{n}.json").write_text(json.dumps(row, indent=1, default=str))
        print(f"{n}: {row['decode_ms_interleaved']:.1f} ms/token", flush=True)


def verdicts(rows: dict[str, dict]) -> dict[str, str]:
    from compress.evaluate.gate import accept
    from compress.config import AcceptConfig

    base = rows.get("fp32")
    if base is None:
        return {}
    cfg = AcceptConfig(max_perplexity_ratio=1.02, min_top1_agreement=0.95, max_size_ratio=0.30)
    out = {}
    for name, r in rows.items():
        v = accept(r, base, cfg)
        out[name] = "accept" if v.accepted else "reject: " + "; ".join(v.reasons)
    return out


def table(rows: dict[str, dict]) -> str:
    base = rows.get("fp32", {})
    v = verdicts(rows)
    lines = ["| variant | perplexity | vs fp32 | top-1 agr. | size MiB | size ratio | b1 decode ms/tok | quant s | peak RSS GB | gate (ppl<=1.02x, agr>=0.95, size<=0.30x) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in VARIANTS:
        r = rows.get(name)
        if r is None:
            continue
        rel = (r["perplexity"] / base["perplexity"] - 1) * 100 if base else float("nan")
        lines.append(
            f"| {name} | {r['perplexity']:.2f} | {rel:+.1f}% | {r.get('top1_agreement', float('nan')):.3f} | {r['size_bytes'] / 2**20:.0f} | "
            f"{r['size_ratio']:.2f} | {r.get('decode_ms_interleaved', r.get('decode_ms_per_token', float('nan'))):.1f} | {r.get('quant_seconds', 0):.0f} | "
            f"{r.get('quant_peak_rss_mb', 0) / 1024:.1f} | {v.get(name, '')} |"
        )
    return "\n".join(lines)


def load_rows() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json")) if not p.stem.startswith("gate_")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", help="variants to run (default: all)")
    ap.add_argument("--table", action="store_true", help="only print the table of cached results")
    ap.add_argument("--latency", action="store_true", help="re-measure decode latency of all built variants round-robin")
    ap.add_argument("--gate-loop", action="store_true", help="run the accuracy-aware loop on W8A8 per-token (docs)")
    ap.add_argument("--inproc", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.table:
        print(table(load_rows()))
        return
    if args.latency:
        latency_interleaved()
        print(table(load_rows()))
        return
    if args.gate_loop:
        print(json.dumps(gate_loop("gate_dynamic_token", dict(method="dynamic", activation_granularity="token",
                                                            smoothquant_alpha="auto", keep_float=[])), indent=1, default=str))
        return
    names = args.only or list(VARIANTS)
    if args.inproc:
        for n in names:
            row = run_variant(n)
            (RESULTS / f"{n}.json").write_text(json.dumps(row, indent=1, default=str))
            print(json.dumps({k: v for k, v in row.items() if k not in ("report",)}, default=str), flush=True)
        return
    for n in names:
        print(f"== {n}", flush=True)
        subprocess.run([sys.executable, "-m", "benchmarks.quantize_smollm2", "--inproc", "--only", n], cwd=ROOT,
                       check=False)
    print(table(load_rows()))


if __name__ == "__main__":
    main()
