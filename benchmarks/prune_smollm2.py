"""Prune SmolLM2-135M several ways and measure each variant, without fine-tuning (docs/pruning.md).

  .venv/bin/python -m benchmarks.prune_smollm2                       # every variant, then the table
  .venv/bin/python -m benchmarks.prune_smollm2 --only mlp25_kv1      # some variants (results cached per variant)
  .venv/bin/python -m benchmarks.prune_smollm2 --export mlp25_kv1    # also export it to ONNX, size + ORT check
  .venv/bin/python -m benchmarks.prune_smollm2 --table               # print the table from the cached results
  .venv/bin/python -m benchmarks.prune_smollm2 --stage mlp35         # what tasks/prune.py does, timed by part

Data: compress.corpus.splits.make_splits(tok, 'embedded', block_size=128, train_blocks=64, calib_blocks=16,
selection_blocks=32). Importance and sensitivity read only the calib split; perplexity, KL and top-1 agreement
to the teacher are measured on the eval split. The sensitivity scan (needed by the *_sens variants) runs
once and is cached in .cache/bench/prune/sensitivity.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".cache" / "bench" / "prune"

# name -> PruneConfig fields (over the defaults below)
VARIANTS: dict[str, dict] = {
    "mlp35": dict(method="structured", mlp_ratio=0.35),
    "mlp25_kv1": dict(method="structured", mlp_ratio=0.25, head_ratio=0.34),
    "mlp25_kv1_wnorm": dict(method="structured", mlp_ratio=0.25, head_ratio=0.34, importance="weight_norm"),
    "mlp35_wnorm": dict(method="structured", mlp_ratio=0.35, importance="weight_norm"),
    "mlp25_layers3": dict(method="structured", mlp_ratio=0.25, layer_ratio=0.1),
    "layers8": dict(method="structured", mlp_ratio=0.0, layer_ratio=0.27),
    "layers8_sens": dict(method="structured", mlp_ratio=0.0, layer_ratio=0.27, use_sensitivity=True),
    "unstr50": dict(method="unstructured", sparsity=0.5, allocation="per_layer", protected_layers=[]),
    "unstr50_global": dict(method="unstructured", sparsity=0.5, allocation="global", protected_layers=[]),
    "unstr50_sens": dict(method="unstructured", sparsity=0.5, allocation="sensitivity", protected_layers=[],
                         use_sensitivity=True),
    "unstr50_protected": dict(method="unstructured", sparsity=0.5, allocation="per_layer"),
    "2to4": dict(method="unstructured", sparsity=0.5, pattern="2:4", protected_layers=[]),
    "wanda50": dict(method="unstructured", sparsity=0.5, unstructured_score="wanda", protected_layers=[]),
    "wanda50_protected": dict(method="unstructured", sparsity=0.5, unstructured_score="wanda"),
    "2to4_wanda": dict(method="unstructured", sparsity=0.5, pattern="2:4", unstructured_score="wanda",
                       protected_layers=[]),
    # Reconstruction (compress/prune/reconstruct.py): one-shot, the same cuts with and without the re-fit.
    "mlp12": dict(method="structured", mlp_ratio=0.125),
    "mlp12_rec": dict(method="structured", mlp_ratio=0.125, reconstruct=True, reconstruct_inputs="student"),
    "mlp12_rec_teacher": dict(method="structured", mlp_ratio=0.125, reconstruct=True, reconstruct_inputs="teacher"),
    "mlp25": dict(method="structured", mlp_ratio=0.25),
    "mlp25_rec": dict(method="structured", mlp_ratio=0.25, reconstruct=True, reconstruct_inputs="student"),
    "mlp25_rec_teacher": dict(method="structured", mlp_ratio=0.25, reconstruct=True, reconstruct_inputs="teacher"),
    "mlp37": dict(method="structured", mlp_ratio=0.375),
    "mlp37_rec": dict(method="structured", mlp_ratio=0.375, reconstruct=True, reconstruct_inputs="student"),
    "mlp37_rec_teacher": dict(method="structured", mlp_ratio=0.375, reconstruct=True, reconstruct_inputs="teacher"),
    "mlp25_kv1_rec": dict(method="structured", mlp_ratio=0.25, head_ratio=0.34, reconstruct=True),
    # More calibration tokens for the re-fit: 64 train blocks (8192 tokens) instead of the 16 calib blocks.
    "mlp25_rec_calib64": dict(method="structured", mlp_ratio=0.25, reconstruct=True, calib_from_train=64),
}
# reconstruct off unless a variant says so: the rows above it were measured before it existed.
BASE = dict(enabled=True, head_ratio=0.0, layer_ratio=0.0, sensitivity_blocks=8, reconstruct=False)
# One scan covers every group the variants use.
SCAN = dict(enabled=True, method="both", mlp_ratio=0.25, head_ratio=0.34, sparsity=0.5, sensitivity_blocks=8)


def setup():
    from compress.corpus.splits import make_splits
    from compress.loading.models import load_teacher

    model, tok = load_teacher(cache_dir=ROOT / ".cache" / "models")
    splits = make_splits(tok, "embedded", block_size=128, train_blocks=64, calib_blocks=16, selection_blocks=32)
    return model, tok, splits


def sensitivity(model, splits):
    from compress.config import PruneConfig
    from compress.prune import SensitivityReport, sensitivity_scan

    path = OUT / "sensitivity.json"
    if path.is_file():
        d = json.loads(path.read_text())
        return SensitivityReport(**d)
    rep = sensitivity_scan(model, splits.calib, PruneConfig(**SCAN))
    path.write_text(json.dumps(rep.__dict__, indent=1))
    rep.figure().savefig(OUT / "sensitivity.png")
    print(f"sensitivity scan: {rep.seconds:.0f} s, {len(rep.rows)} probes", flush=True)
    return rep


class EvalSet:
    """Eval blocks with the teacher's log-probs kept (32 x 128 x 49152 fp32 = 768 MiB), so each variant
    costs one forward for perplexity, KL(teacher || student) and top-1 agreement."""

    def __init__(self, teacher, blocks, batch_size: int = 4):
        import torch

        self.batches = [torch.as_tensor(blocks[i:i + batch_size]) for i in range(0, len(blocks), batch_size)]
        with torch.no_grad():
            self.teacher = [torch.log_softmax(teacher(input_ids=x).logits.float(), -1) for x in self.batches]

    def measure(self, student) -> dict:
        import math

        import torch
        import torch.nn.functional as F

        nll, kl, agree, n_tok, n_pos = 0.0, 0.0, 0, 0, 0
        with torch.no_grad():
            for x, t in zip(self.batches, self.teacher):
                s = torch.log_softmax(student(input_ids=x).logits.float(), -1)
                nll += float(F.nll_loss(s[:, :-1].reshape(-1, s.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"))
                n_tok += x[:, 1:].numel()
                kl += float((t.exp() * (t - s)).sum())
                agree += int((s.argmax(-1) == t.argmax(-1)).sum())
                n_pos += x.numel()
        return {"ppl": math.exp(nll / n_tok), "kl": kl / n_pos, "top1_agreement": agree / n_pos}


def run_variant(name, model, tok, splits, ev: EvalSet, teacher_ppl, export: bool):
    import numpy as np

    from compress.config import PruneConfig
    from compress.prune import prune_model

    spec = dict(VARIANTS[name])
    use_sens = spec.pop("use_sensitivity", False)
    n_train = spec.pop("calib_from_train", 0)
    cfg = PruneConfig(**{**BASE, **spec})
    sens = sensitivity(model, splits) if use_sens else None
    cpu0 = time.process_time()
    student, rep = prune_model(model, splits.train[:n_train] if n_train else splits.calib, cfg, sens)
    cpu = time.process_time() - cpu0
    t0 = time.perf_counter()
    m = ev.measure(student)
    ppl, agree = m["ppl"], m
    res = {
        "variant": name, "config": cfg.model_dump(), "prune_seconds": rep.seconds, "prune_cpu_seconds": cpu,
        "eval_seconds": time.perf_counter() - t0, "params_before": rep.params_before, "params_after": rep.params_after,
        "nonemb_before": rep.nonembedding_params_before, "nonemb_after": rep.nonembedding_params_after,
        "nonemb_removed": rep.nonembedding_removed_fraction, "shape_after": rep.shape_after,
        "sparsity": rep.sparsity, "decoder_linear_sparsity": float(np.mean(list(rep.layer_sparsity.values())))
        if rep.layer_sparsity else 0.0,
        "ppl_before": teacher_ppl, "ppl_after": ppl, "kl": agree["kl"], "top1_agreement": agree["top1_agreement"],
        "fp32_mib": rep.params_after * 4 / 2**20, "drop_layers": rep.removed.get("drop_layers", []),
        "loadavg": os.getloadavg()[0],
        "reconstruction": rep.reconstruction.metrics() if rep.reconstruction is not None else None,
    }
    if export:
        res.update(export_check(student, tok, splits, OUT / f"{name}-onnx"))
    (OUT / f"{name}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "config"}), flush=True)
    return res


def export_check(student, tok, splits, folder):
    import numpy as np
    import torch

    from compress.export.standard import build_artifact
    from compress.drivers.standard import OnnxLM

    result, _ = build_artifact(student, tok, folder)
    lm = OnnxLM(folder)
    ids = splits.selection[0]
    with torch.no_grad():
        ref = student(input_ids=torch.as_tensor(ids[None])).logits[0].numpy()
    diff = float(np.abs(lm.logits(ids) - ref).max())
    return {"onnx_mib": result.onnx_bytes / 2**20, "export_seconds": result.seconds, "onnx_vs_torch_max_abs": diff}


def stage(name):
    """The prune task's work for one variant (scan, prune, perplexity before/after, save), timed by part."""
    import tempfile

    from compress.config import PruneConfig
    from compress.prune import prune_model, sensitivity_scan
    from compress.evaluate.torch_eval import perplexity

    spec = {k: v for k, v in VARIANTS[name].items() if k != "use_sensitivity"}
    cfg = PruneConfig(**{**BASE, **spec})
    times = {}

    def timed(part, fn):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        times[part] = {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1)}
        print(part, times[part], flush=True)
        return out

    model, tok, splits = timed("load", setup)
    sens = timed("sensitivity_scan", lambda: sensitivity_scan(model, splits.calib, cfg))
    student, rep = timed("prune_model", lambda: prune_model(model, splits.calib, cfg, sens))
    before = timed("ppl_before", lambda: perplexity(model, splits.selection))
    after = timed("ppl_after", lambda: perplexity(student, splits.selection))
    with tempfile.TemporaryDirectory() as d:
        timed("save_pretrained", lambda: student.save_pretrained(d))
    total = {k: round(sum(t[k] for p, t in times.items() if p != "load"), 1) for k in ("wall_s", "cpu_s")}
    res = {"variant": name, "times": times, "stage_total_without_load": total, "ppl": [before, after],
           "sensitivity_probes": len(sens.rows), "loadavg": os.getloadavg(), "metrics": rep.metrics()}
    (OUT / f"stage-{name}.txt").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "metrics"}))


def table():
    rows = [json.loads(p.read_text()) for p in sorted(OUT.glob("*.json")) if p.name != "sensitivity.json"]
    order = list(VARIANTS)
    rows.sort(key=lambda r: order.index(r["variant"]) if r["variant"] in order else 99)
    print("| variant | params | non-emb removed | shape after (L/H/KV/I) | decoder sparsity "
          "| ppl before -> after | KL | top-1 | prune s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["shape_after"]
        shape = "/".join(str(s[k]) for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                              "intermediate_size"))
        print(f"| {r['variant']} | {r['params_before'] / 1e6:.1f}M -> {r['params_after'] / 1e6:.1f}M | "
              f"{r['nonemb_removed']:.1%} | {shape} | {r['decoder_linear_sparsity']:.1%} | "
              f"{r['ppl_before']:.2f} -> {r['ppl_after']:.2f} | "
              f"{r['kl']:.3f} | {r['top1_agreement']:.3f} | {r['prune_seconds']:.1f} |")
    for r in rows:
        if "onnx_mib" in r:
            print(f"{r['variant']}: ONNX {r['onnx_mib']:.1f} MiB, export {r['export_seconds']:.0f} s, "
                  f"ORT vs torch max abs {r['onnx_vs_torch_max_abs']:.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--export", nargs="*", default=[])
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--force", action="store_true", help="re-run variants that have cached results")
    ap.add_argument("--stage", default=None, help="time the prune task's work for one variant")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.stage:
        return stage(args.stage)
    if not args.table:
        from compress.evaluate.torch_eval import perplexity

        names = args.only or list(VARIANTS)
        todo = [n for n in names if args.force or n in args.export or not (OUT / f"{n}.json").is_file()]
        if todo:
            t0 = time.perf_counter()
            model, tok, splits = setup()
            ev = EvalSet(model, splits.selection)
            teacher_ppl = perplexity(model, splits.selection)
            assert abs(ev.measure(model)["ppl"] / teacher_ppl - 1) < 1e-4  # same number as compress.evaluate.torch_eval
            print(f"teacher loaded + eval ppl {teacher_ppl:.3f} in {time.perf_counter() - t0:.0f} s", flush=True)
            for n in todo:
                run_variant(n, model, tok, splits, ev, teacher_ppl, n in args.export)
    table()


if __name__ == "__main__":
    main()
