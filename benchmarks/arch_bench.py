"""Decode step time per architecture family, standard layout vs gqa layout, on the tiny models (issue 17).

    python -m benchmarks.arch_bench --batch 1 8 --past 128 --json benchmarks/results/arch_decode.json

For each family of compress/tiny.py: the dynamo export (standard) and, where the builder takes the family,
the gqa graph, both built once under .cache/bench/arch/; then benchmarks.gqa_bench's interleaved step
timing (same run, so the ratio holds on a shared machine). A family the gqa builder refuses reports why.
The tiny models (hidden 64, 2 layers) measure per-call overhead and the attention/KV handling, not matmuls.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.gqa_bench import _session, gqa_step, measure, standard_step


def build(family: str, root: Path) -> tuple[Path, Path | None, str]:
    """(standard folder, gqa folder or None, why) for the family's seed-0 tiny model, built once."""
    from compress.export import build_artifact
    from compress.gqa_builder import GqaBuildError, build_gqa_artifact, check_supported
    from compress.tiny import build_tiny

    model, tok = build_tiny(family, seed=0)
    std, gqa = root / f"{family}-standard", root / f"{family}-gqa"
    if not (std / "manifest.json").is_file():
        build_artifact(model, tok, std, exporter="dynamo")
    try:
        check_supported(model)
    except GqaBuildError as e:
        return std, None, str(e)
    if not (gqa / "manifest.json").is_file():
        build_gqa_artifact(model, tok, gqa)
    return std, gqa, "gqa builder"


def golden_figures(family: str, folder: Path) -> dict:
    """The golden check (prompt past the sliding window, left-padded batch) of one artifact."""
    from compress.golden import compare_onnx, record_golden
    from compress.tiny import build_tiny

    model, tok = build_tiny(family, seed=0)
    prompts = ["The cat sat on", "The cat sat on the mat and then it went to the store to buy some bread and milk "
               "for the family before the rain", "a b c"]
    rep = compare_onnx(folder, record_golden(model, tok, prompts, new_tokens=8))
    m = rep.metrics()
    return {"passed": rep.passed, "max_abs_error": m["golden_max_abs_error"],
            "batched_max_abs_error": m["golden_batched_max_abs_error"], "prefix_match": m["golden_prefix_match"]}


def main(argv=None) -> int:
    from compress.tiny import FAMILIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--root", type=Path, default=Path(".cache/bench/arch"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    rows = []
    for fam in args.families:
        std, gqa, why = build(fam, args.root)
        gold = {"standard": golden_figures(fam, std), **({"gqa": golden_figures(fam, gqa)} if gqa else {})}
        print(f"{fam:>9} golden: " + ", ".join(f"{k} max abs {v['max_abs_error']:.1e} batched "
                                               f"{v['batched_max_abs_error']:.1e} passed {v['passed']}"
                                               for k, v in gold.items()), flush=True)
        s_sess, s_man = _session(std, args.threads)
        g = _session(gqa, args.threads) if gqa else None
        for B in args.batch:
            steps = {"standard": standard_step(s_sess, s_man, B, args.past)}
            if g:
                steps["gqa"] = gqa_step(*g, B, args.past)
            r = measure(steps, args.steps)
            row = {"family": fam, "batch": B, "past": args.past, "golden": gold, "standard_ms": r["standard"]["ms_median"],
                   "standard_cpu_ms": r["standard"]["cpu_ms_median"]}
            if g:
                row.update(gqa_ms=r["gqa"]["ms_median"], gqa_cpu_ms=r["gqa"]["cpu_ms_median"],
                           speedup_wall=r["standard"]["ms_median"] / r["gqa"]["ms_median"],
                           speedup_cpu=r["standard"]["cpu_ms_median"] / r["gqa"]["cpu_ms_median"])
                print(f"{fam:>9} batch {B:>2}: standard {row['standard_ms']:.3f} ms, gqa {row['gqa_ms']:.3f} ms "
                      f"-> x{row['speedup_wall']:.2f} wall, x{row['speedup_cpu']:.2f} CPU", flush=True)
            else:
                row["gqa"] = why
                print(f"{fam:>9} batch {B:>2}: standard {row['standard_ms']:.3f} ms, gqa n/a ({why[:80]}...)", flush=True)
            rows.append(row)
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"load_average": load, "threads": args.threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
