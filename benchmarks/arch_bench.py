"""Decode step time per architecture family, standard layout vs gqa layout, on the tiny models (issue 17).

    python -m benchmarks.arch_bench --batch 1 8 --past 128 --json benchmarks/results/arch_decode.json

For each family of compress/loading/tiny.py: the dynamo export (standard) and, where the builder takes the family,
the gqa graph, both built once under .cache/bench/arch/; then benchmarks.gqa_bench's interleaved step
timing (same run, so the ratio holds on a shared machine). A family the gqa builder refuses reports why.
The tiny models (hidden 64, 2 layers) measure per-call overhead and the attention/KV handling, not matmuls;
``--size small`` widens them (hidden 256, 4 layers, 8 query heads of 32) so the attention part weighs more.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.gqa_bench import _session, gqa_step, measure, standard_step


def size_overrides(family: str, size: str) -> dict:
    """Config overrides of the --size preset ('tiny' = compress/loading/tiny.py as it is)."""
    if size == "tiny":
        return {}
    kw = dict(hidden_size=256, intermediate_size=1024 if family == "gpt_neox" else 512, num_hidden_layers=4,
              num_attention_heads=8, max_position_embeddings=2048)
    if family not in ("phi3", "gpt_neox"):
        kw["head_dim"] = 32
    if family == "gpt_neox":  # Pythia's head size 64 (a quarter of it rotated: what GQA can take)
        kw["num_attention_heads"] = 4
    if family.startswith("gemma"):
        kw.update(query_pre_attn_scalar=32, layer_types=["sliding_attention", "full_attention"] * 2)
    return kw


def build(family: str, root: Path, size: str = "tiny") -> tuple[Path, Path | None, str]:
    """(standard folder, gqa folder or None, why) for the family's seed-0 model of that size, built once."""
    from compress.export.standard import build_artifact
    from compress.export.gqa import GqaBuildError, build_gqa_artifact, check_supported
    from compress.loading.tiny import build_tiny

    model, tok = build_tiny(family, seed=0, **size_overrides(family, size))
    std, gqa = root / f"{family}-{size}-standard", root / f"{family}-{size}-gqa"
    if not (std / "manifest.json").is_file():
        build_artifact(model, tok, std, exporter="dynamo")
    try:
        check_supported(model)
    except GqaBuildError as e:
        return std, None, str(e)
    if not (gqa / "manifest.json").is_file():
        build_gqa_artifact(model, tok, gqa)
    return std, gqa, "gqa builder"


def golden_figures(family: str, folder: Path, size: str = "tiny") -> dict:
    """The golden check (prompt past the sliding window, left-padded batch) of one artifact."""
    from compress.evaluate.golden import compare_onnx, record_golden
    from compress.loading.tiny import build_tiny

    model, tok = build_tiny(family, seed=0, **size_overrides(family, size))
    prompts = ["The cat sat on", "The cat sat on the mat and then it went to the store to buy some bread and milk "
               "for the family before the rain", "a b c"]
    rep = compare_onnx(folder, record_golden(model, tok, prompts, new_tokens=8))
    m = rep.metrics()
    return {"passed": rep.passed, "max_abs_error": m["golden_max_abs_error"],
            "batched_max_abs_error": m["golden_batched_max_abs_error"], "prefix_match": m["golden_prefix_match"]}


def main(argv=None) -> int:
    from compress.loading.tiny import FAMILIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--size", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--root", type=Path, default=Path(".cache/bench/arch"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    rows = []
    for fam in args.families:
        std, gqa, why = build(fam, args.root, args.size)
        gold = {"standard": golden_figures(fam, std, args.size),
                **({"gqa": golden_figures(fam, gqa, args.size)} if gqa else {})}
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
            row = {"family": fam, "size": args.size, "batch": B, "past": args.past, "golden": gold, "standard_ms": r["standard"]["ms_median"],
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
        args.json.write_text(json.dumps({"load_average": load, "threads": args.threads, "size": args.size,
                                         "overrides": {f: size_overrides(f, args.size) for f in args.families},
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
