"""The accept stage judged against the fp32 graph and against the checkpoint as stored, on the same artifacts.

    python -m benchmarks.accept_reference --config configs/large.yaml --candidate artifacts/quantize/<key>/artifact \
        --baseline artifacts/export/<key>/artifact --model-dir .cache/models/<checkpoint> [--json out.json]

Both in one process, one after the other, each with an empty chat cache (the stage's first run): the accept stage's
function (tasks/accept.py, without Prefect or MLflow) with ``accept.reference: artifact``, then ``checkpoint``.
Printed: the seconds of each part and the whole, their ratio, each run's peak RSS growth, and the verdict's figures
side by side (the checkpoint in 16 bits is another reference than the fp32 graph: the figures move by what bf16
rounding moves them, which is the point of printing them).
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time

from compress.config import load_config

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    a = ap.parse_args()
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
    main()
