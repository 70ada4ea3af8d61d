"""The 4-bit weight forms of one fp32 artifact side by side on its selection split: round-to-nearest and AWQ,
asymmetric and symmetric, with and without the 8-bit groups, against weight-only INT8 (docs/quantization.md).

    .venv/bin/python -m benchmarks.int4_variants --artifact artifacts/export/<key>/artifact \\
        --splits artifacts/load/<key>/splits.npz [--json benchmarks/results/int4_variants_smollm2.json]

Every variant is calibrated on the calib split and judged on the eval (selection) split against the fp32 artifact
(one reference pass): perplexity ratio, top-1 agreement, KL, bytes against the fp32 graph, and the batch-1 decode step
of each, steps interleaved so load on the machine hits all alike. Not a test: a few minutes for a 135M model.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


from benchmarks.burst import cpu_flags
from compress.config import QuantizeConfig
from compress.evaluate.onnx_eval import ReferencePass, evaluate_onnx
from compress.quantize.choice import decode_step_ms
from compress.quantize.quantizer import Quantizer

W4 = dict(method="weight_only", smoothquant_alpha=None, weight_bits=4)
NO_CLIP = dict(weight_clip="none")  # ORT's round-to-nearest over each block's full range
VARIANTS: dict[str, dict] = {
    "int8": dict(method="weight_only", smoothquant_alpha=None),
    "int4_rtn_asym_all": dict(W4, **NO_CLIP, weight_algorithm="rtn", int4_keep_int8=0.0),
    "int4_mse_asym_all": dict(W4, weight_algorithm="rtn", weight_clip="mse", int4_keep_int8=0.0),
    "int4_awq_asym_all": dict(W4, **NO_CLIP, int4_keep_int8=0.0),
    "int4_awq_mse_asym_all": dict(W4, weight_clip="mse", int4_keep_int8=0.0),
    "int4_awq_asym_keep25": dict(W4, **NO_CLIP, int4_keep_int8=0.25),  # the defaults (weight_clip auto: none after AWQ)
    "int4_awq_mse_asym_keep25": dict(W4, weight_clip="mse", int4_keep_int8=0.25),
    "int4_awq_sym_keep25": dict(W4, **NO_CLIP, weight_symmetric=True, int4_keep_int8=0.25),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", type=Path, required=True, help="the fp32 artifact (the export stage's)")
    ap.add_argument("--splits", type=Path, required=True, help="the load stage's splits.npz (calib, selection)")
    ap.add_argument("--only", nargs="*", default=list(VARIANTS))
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    from compress.corpus.splits import DataSplits

    sp = DataSplits.load(a.splits)  # files of any format
    calib, ev = sp.calib, sp.selection
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="int4_variants_") as tmp, ReferencePass(a.artifact, ev) as ref:
        base = ref.figures
        for name in a.only:
            t0 = time.perf_counter()
            rep = Quantizer(a.artifact, calib, QuantizeConfig(**VARIANTS[name])).write(Path(tmp) / name)
            m = evaluate_onnx(Path(tmp) / name, ev, reference=ref, latency=False)
            rows[name] = {"perplexity_ratio": m["perplexity"] / base["perplexity"], "top1_agreement": m["top1_agreement"],
                          "kl": m.get("kl"), "size_ratio": rep.size_ratio, "int8_groups": rep.settings.get("int8_groups"),
                          "awq_alphas": rep.settings.get("smoothquant_alphas"), "seconds": time.perf_counter() - t0}
            print(f"{name:22s} ppl x{rows[name]['perplexity_ratio']:.4f} top-1 {m['top1_agreement']:.4f} "
                  f"KL {m.get('kl', float('nan')):.4f} size x{rep.size_ratio:.3f} ({rows[name]['seconds']:.0f} s)", flush=True)
        ms = decode_step_ms({n: Path(tmp) / n for n in rows}, prompt=[int(t) for t in ev[0][:32]])
    for n, v in ms.items():
        rows[n]["decode_ms_per_step"] = v
        print(f"{n:22s} batch-1 decode {v:.2f} ms/step ({ms['int8'] / v:.2f}x the INT8 form's speed)" if "int8" in ms
              else f"{n:22s} {v:.2f} ms/step")
    if a.json:
        a.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                      "cpu_flags": cpu_flags(), "artifact": str(a.artifact), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
