"""SmolLM2 INT8 forms for batch-1 decode: held-out quality and graph speed, before and after the fusions.

    python -m benchmarks.batch1_forms --out .cache/bench/forms [--before artifacts/quantize/<key>/artifact]

Builds, from the embedded SmolLM2 with the default config's data splits:
  fp32   the fused gqa graph (compress.export.gqa, fuse=True)
  w8a8   W8A8 dynamic per-token + SmoothQuant auto (the demo's W8A8 candidate), on the fused graph
  wo8    weight-only INT8 (MatMulNBits 8-bit, block 32, accuracy_level 4) + 8-bit tied embedding, fused
and scores each (and ``--before``, an artifact made before the fusions) with compress.evaluate.onnx_eval.evaluate_onnx
on the held-out test split and the held-out source (stdlib code), fp32 as the reference; then times decode
steps of all of them interleaved (benchmarks.graph_profile). Prints a table and writes ``forms.json``.

``--kv16`` adds ``fp32_kv16`` and ``wo8_kv16``: the same two built with ``export.kv_dtype: float16``
(compress/export/kv_fp16.py), scored against the fp32-KV fp32 graph.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".cache/bench/forms")
    ap.add_argument("--before", default=None, help="an INT8 artifact built before the fusions, scored alongside")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--skip", nargs="*", default=[], help="forms not to build (fp32 w8a8 wo8 fp32_kv16 wo8_kv16)")
    ap.add_argument("--kv16", action="store_true", help="also the fp16-KV fp32 and weight-only forms")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from compress.config import load_config
    from compress.corpus.splits import splits_from_config
    from compress.evaluate.onnx_eval import evaluate_onnx
    from compress.export.gqa import build_gqa_artifact
    from compress.loading.models import load_teacher
    from compress.quantize.quantizer import quantize_artifact

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config("configs/default.yaml")
    model, tok = load_teacher("embedded")
    splits = splits_from_config(tok, cfg.data)
    arts: dict[str, Path] = {"fp32": out / "fp32"}
    if "fp32" not in a.skip or not (out / "fp32" / "manifest.json").is_file():
        build_gqa_artifact(model, tok, out / "fp32")
    if a.kv16:
        arts["fp32_kv16"] = out / "fp32_kv16"
        if "fp32_kv16" not in a.skip or not (out / "fp32_kv16" / "manifest.json").is_file():
            build_gqa_artifact(model, tok, out / "fp32_kv16", kv_dtype="float16")
    del model
    wo8 = cfg.quantize.model_copy(update={"method": "weight_only", "smoothquant_alpha": None, "kv_cache": "float32"})
    forms = {
        # W8A8 as the demo's w8a8 candidate makes it (quantize.method auto tries both forms)
        "w8a8": ("fp32", cfg.quantize.model_copy(update={"method": "dynamic", "activation_granularity": "token",
                                                         "smoothquant_alpha": "auto", "kv_cache": "float32"})),
        "wo8": ("fp32", wo8),
        **({"wo8_kv16": ("fp32_kv16", wo8)} if a.kv16 else {}),
    }
    seconds = {}
    for name, (base, qcfg) in forms.items():
        if name in a.skip and (out / name / "manifest.json").is_file():
            arts[name] = out / name
            continue
        t = time.perf_counter()
        quantize_artifact(out / base, out / name, splits.calib, qcfg)
        seconds[name] = time.perf_counter() - t
        arts[name] = out / name
        print(f"{name}: quantized in {seconds[name]:.0f} s", flush=True)
    if a.before:
        arts["before"] = Path(a.before)
    res: dict = {"quantize_seconds": seconds, "forms": {}}
    for name, art in arts.items():
        row = {}
        for split, blocks in (("test", splits.test), ("heldout", splits.heldout)):
            if blocks is None:
                continue
            m = evaluate_onnx(art, blocks, reference_artifact=None if name == "fp32" else arts["fp32"],
                              latency=False, threads=a.threads or None)
            row[split] = {k: m.get(k) for k in ("perplexity", "top1_agreement", "kl_to_reference", "size_bytes")}
        res["forms"][name] = row
        print(name, json.dumps(row), flush=True)
    from benchmarks.graph_profile import compare, default_prompt, print_table

    graphs = {n: str(p / "model.onnx") for n, p in arts.items()}
    prof = compare(graphs, default_prompt(64), steps=64, threads=a.threads, rounds=3)
    prof["loadavg"] = os.getloadavg()
    print_table(prof)
    res["profile"] = prof
    fp = res["forms"]["fp32"]
    print("\n| form | test ppl (× fp32) | agreement | stdlib ppl (× fp32) | size MiB | decode ms/step p50 | CPU ms/step |")
    for n, row in res["forms"].items():
        t, h = row.get("test", {}), row.get("heldout", {})
        g = prof["graphs"][n]
        print(f"| {n} | {t['perplexity']:.2f} ({t['perplexity'] / fp['test']['perplexity']:.3f}) | "
              f"{t.get('top1_agreement') or 1:.3f} | {h.get('perplexity', float('nan')):.2f} "
              f"({h.get('perplexity', float('nan')) / fp.get('heldout', {}).get('perplexity', float('nan')):.3f}) | "
              f"{t['size_bytes'] / 2**20:.0f} | {g['decode_ms_p50']:.2f} | {g['decode_cpu_ms_per_step']:.2f} |")
    print(f"load average {prof['loadavg']}")
    (out / "forms.json").write_text(json.dumps(res, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
