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


from benchmarks import run_modes
from benchmarks.sweep import cpu_flags
from compress.config import QuantizeConfig
from compress.evaluate.onnx_eval import ReferencePass, evaluate_onnx
from compress.quantize.choice import decode_step_ms
from compress.quantize.quantizer import Quantizer
import resource
from compress.config import load_config

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


MODES_HELP = 'modes (each with its own --help): --accept-reference: the accept stage against the fp32 graph and against the checkpoint'


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(epilog=MODES_HELP, description=__doc__.split("\n\n")[0])
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


# --- `--accept-reference`: formerly benchmarks/accept_reference.py ------------------

ACCEPT_REFERENCE_DOC = """The accept stage judged against the fp32 graph and against the checkpoint as stored, on the same artifacts.

    python -m benchmarks.int4_variants --accept-reference --config configs/large.yaml --candidate artifacts/quantize/<key>/artifact \\
        --baseline artifacts/export/<key>/artifact --model-dir .cache/models/<checkpoint> [--json out.json]

Both in one process, one after the other, each with an empty chat cache (the stage's first run): the accept stage's
function (tasks/accept.py, without Prefect or MLflow) with ``accept.reference: artifact``, then ``checkpoint``.
Printed: the seconds of each part and the whole, their ratio, each run's peak RSS growth, and the verdict's figures
side by side (the checkpoint in 16 bits is another reference than the fp32 graph: the figures move by what bf16
rounding moves them, which is the point of printing them).
"""

FIGURES = ("gate_perplexity_ratio", "gate_top1_agreement", "candidate_kl_to_reference", "gate_chat_perplexity_ratio",
           "gate_chat_top1_agreement", "gate_chat_judged_ratio", "gate_chat_late_divergence_share")


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run(config: str, reference: str, candidate: str, baseline: str, model_dir: str, splits: str, heldout: str,
        sets: list[str]) -> dict:
    import mlflow

    from tasks.accept import accept_task

    with tempfile.TemporaryDirectory(prefix="accept_ref_") as work:
        cfg = load_config(config, [f"workdir={work}", f"accept.reference={reference}", "accept.max_minutes=null",
                                   f"accept.chat_sets={json.dumps(sets)}"])
        mlflow.set_tracking_uri(f"sqlite:///{work}/mlflow.db")  # a store of its own, gone with the folder
        t0 = time.perf_counter()
        with mlflow.start_run() as parent:
            out = accept_task.fn(cfg, "accept", reference, parent_run_id=parent.info.run_id, candidate=candidate,
                                 baseline=baseline, splits=splits, heldout=heldout, model_dir=model_dir)
        return {"seconds": time.perf_counter() - t0, "parts": out.seconds, "accepted": out.accepted,
                "reference": out.reference, "peak_gib": peak_gib(),
                "figures": {k: out.metrics.get(k) for k in FIGURES}}


def drift(baseline: str, model_dir: str, heldout: str, dtype: str) -> dict:
    """The fp32 graph judged against the checkpoint read in ``dtype``, on the test split: what the 16-bit reference
    alone moves (an INT8 candidate's agreement with it cannot be expected above this one's)."""
    from compress.corpus.splits import load_heldout
    from compress.evaluate.checkpoint_ref import CheckpointReference
    from compress.evaluate.verdict import against_baseline

    t0 = time.perf_counter()
    base, graph = against_baseline(baseline, baseline, load_heldout(heldout).test,
                                   reference=CheckpointReference(model_dir, dtype=dtype))
    return {"reference_perplexity": base["perplexity"], "graph_perplexity": graph["perplexity"],
            "graph_top1_agreement": graph["top1_agreement"], "graph_kl_to_reference": graph["kl_to_reference"],
            "seconds": time.perf_counter() - t0}


def accept_reference_main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.int4_variants --accept-reference", description=ACCEPT_REFERENCE_DOC.splitlines()[0])
    ap.add_argument("--config", default="configs/large.yaml")
    ap.add_argument("--candidate")
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--splits", help="the load stage's splits.npz")
    ap.add_argument("--heldout", required=True, help="the load stage's heldout.npz")
    ap.add_argument("--chat-sets", default='["builtin"]', help="JSON list, as accept.chat_sets")
    ap.add_argument("--order", default="artifact,checkpoint")
    ap.add_argument("--drift", metavar="DTYPE", help="only judge the fp32 graph against the checkpoint read in DTYPE "
                    "(auto = as stored, bfloat16) on the test split, and print what the reference alone moves")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.drift:
        d = drift(a.baseline, a.model_dir, a.heldout, a.drift)
        print(json.dumps(d, indent=2))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(d, f, indent=2)
        return
    res = {}
    for ref in a.order.split(","):
        res[ref] = run(a.config, ref, a.candidate, a.baseline, a.model_dir, a.splits, a.heldout,
                       json.loads(a.chat_sets))
        print(f"{ref}: {res[ref]['seconds']:.1f} s, peak RSS so far {res[ref]['peak_gib']:.2f} GiB, "
              f"accepted={res[ref]['accepted']}, parts {json.dumps({k: round(v, 1) for k, v in res[ref]['parts'].items()})}",
              flush=True)
    if {"artifact", "checkpoint"} <= set(res):
        g, c = res["artifact"], res["checkpoint"]
        print(f"checkpoint reference: {g['seconds'] / c['seconds']:.2f}x faster ({g['seconds']:.1f} s -> {c['seconds']:.1f} s)")
        for k in FIGURES:
            print(f"  {k:34s} graph {g['figures'][k]}  checkpoint {c['figures'][k]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    raise SystemExit(run_modes(main, {"--accept-reference": accept_reference_main}))
