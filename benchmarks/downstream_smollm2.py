"""The quality gate's figures on SmolLM2 artifacts: test-split and held-out-source perplexity, downstream accuracy.

  .venv/bin/python -m benchmarks.downstream_smollm2 DIR [DIR ...]    # artifact folders; the first is the baseline

Splits as configs/default.yaml (block 128; 32 test blocks, 32 blocks of the stdlib_code held-out source),
downstream items from 32 blocks of each (compress/evaluate/downstream.py). Prints a markdown table (docs/quantization.md).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(dirs: list[str]) -> None:
    from pathlib import Path

    from compress.corpus.splits import make_splits
    from compress.evaluate.downstream import downstream_scores
    from compress.evaluate.onnx_eval import evaluate_onnx
    from compress.loading.models import load_teacher

    root = Path(__file__).resolve().parent.parent
    _, tok = load_teacher(cache_dir=root / ".cache" / "models")
    sp = make_splits(tok, "embedded", block_size=128, train_blocks=256, calib_blocks=32, selection_blocks=32,
                     test_blocks=32, heldout_source="stdlib_code", heldout_blocks=32)
    rows = []
    for d in dirs:
        t0 = time.perf_counter()
        ref = dirs[0] if d != dirs[0] else None
        e = evaluate_onnx(d, sp.test, reference_artifact=ref, latency=False, threads=2)
        h = evaluate_onnx(d, sp.heldout, latency=False, threads=2)
        s = downstream_scores(d, sp.test, sp.heldout, 32, threads=2)
        rows.append((d, e, h, s, time.perf_counter() - t0))
        print(d, e["perplexity"], h["perplexity"], s, flush=True)
    b = rows[0]
    print("| artifact | test ppl (ratio) | top-1 agr. | held-out ppl (ratio) | downstream acc (test / held-out) | s |")
    print("|---|---|---|---|---|---|")
    for d, e, h, s, sec in rows:
        print(f"| {d} | {e['perplexity']:.2f} ({e['perplexity'] / b[1]['perplexity']:.3f}) | "
              f"{e.get('top1_agreement', 1.0):.3f} | {h['perplexity']:.2f} ({h['perplexity'] / b[2]['perplexity']:.3f}) | "
              f"{s['downstream_accuracy']:.3f} ({s['downstream_test_accuracy']:.3f} / {s['downstream_heldout_accuracy']:.3f}) "
              f"| {sec:.0f} |")
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main(sys.argv[1:])
