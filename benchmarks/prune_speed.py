"""Why a narrower MLP decodes no faster: batch-1 decode of SmolLM2 and its MLP-pruned students, per op (docs/pruning.md).

  .venv/bin/python -m benchmarks.prune_speed                    # teacher + mlp 0.25, fp32 and W8A8, profiled
  .venv/bin/python -m benchmarks.prune_speed --ratios 0.25 0.5 --quant dynamic weight_only

Each model is built with the gqa builder (the `auto` exporter's graph for SmolLM2), quantized with the
default config's W8A8 (dynamic, per-token, SmoothQuant auto) and/or weight-only INT8, then:
- decode ms/token: median over `--steps` greedy steps after a 32-token prompt, the models taking turns
  `--rounds` times (the CPU is shared: turns spread the noise over every model alike);
- an ORT profile of the same decode, summed per role (lm_head, mlp gate/up/down, attention projections,
  GroupQueryAttention, norms, rest) and per op type, in ms per decode step.
Results: .cache/bench/prune_speed/results.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".cache" / "bench" / "prune_speed"

QUANT = {
    "dynamic": dict(method="dynamic", activation_granularity="token", smoothquant_alpha="auto"),
    "weight_only": dict(method="weight_only"),
}


def role(name: str) -> str:
    for pat, r in ((r"lm_head", "lm_head"), (r"mlp/(gate_up|gate_proj|up_proj)", "mlp_gate_up"),
                   (r"mlp/down_proj", "mlp_down"), (r"mlp", "mlp_other"),
                   (r"self_attn/(q_proj|k_proj|v_proj|qkv)", "attn_qkv"), (r"self_attn/o_proj", "attn_o"),
                   (r"GroupQueryAttention|self_attn", "attention"), (r"[Nn]orm|RMS|Skip", "norms"),
                   (r"embed|Gather", "embedding")):
        if re.search(pat, name):
            return r
    return "other"


def build(name: str, model, tok, splits, quant: list[str]) -> dict[str, Path]:
    from compress.config import QuantizeConfig
    from compress.export.gqa import build_gqa_artifact
    from compress.quantize.quantizer import Quantizer

    out = {}
    fp32 = OUT / name / "fp32"
    if not (fp32 / "manifest.json").is_file():
        build_gqa_artifact(model, tok, fp32)
    out["fp32"] = fp32
    for q in quant:
        d = OUT / name / q
        if not (d / "manifest.json").is_file():
            t0 = time.perf_counter()
            Quantizer(fp32, splits.calib, QuantizeConfig(**QUANT[q])).write(d, [])
            print(f"{name} {q}: quantized in {time.perf_counter() - t0:.0f} s", flush=True)
        out[q] = d
    return out


def _driver(folder: Path, profile: bool):
    import onnxruntime as ort

    from compress.artifact import read_manifest
    from compress.drivers import load_lm

    lm = load_lm(folder, threads=2, verify=False)
    if profile:
        man = read_manifest(folder, verify=False)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        opts.enable_profiling = True
        opts.profile_file_prefix = str(OUT / f"prof-{folder.parent.name}-{folder.name}")
        opts.log_severity_level = 3
        lm._setup(man, ort.InferenceSession(str(folder / man.get("onnx_file", "model.onnx")), opts,
                                            providers=["CPUExecutionProvider"]))
    return lm


def decode_cpu_ms(folder: Path, prompt: list[int], steps: int, rounds: int) -> list[float]:
    """CPU ms per decode step on one intra-op thread: what the step costs, whatever else the cores run
    (wall time on a shared 2-core machine mostly measures the neighbours)."""
    from compress.drivers import load_lm

    lm = load_lm(folder, threads=1, verify=False)
    out: list[float] = []
    for _ in range(rounds):
        logits, past = lm.prefill(prompt, room=steps + 2, last_only=True)
        tok = int(logits[-1].argmax())
        for i in range(steps):
            c0 = time.process_time()
            logits, past = lm.decode([tok], past)
            if i >= 2:
                out.append(1000 * (time.process_time() - c0))
            tok = int(logits[-1].argmax())
    return out


def decode_ms(lm, prompt: list[int], steps: int) -> list[float]:
    times: list[float] = []
    lm.greedy(prompt, steps + 1, step_seconds=times)
    return [1000 * t for t in times[2:]]


class Profiled:
    """A profiling session of one artifact; decode runs accumulate, then per-step kernel times by role."""

    def __init__(self, folder: Path, prompt: list[int]):
        self.lm = _driver(folder, profile=True)
        self.prompt = prompt
        self.steps, self.bursts = 0, 0

    def run(self, steps: int) -> None:
        self.steps, self.bursts = steps, self.bursts + 1
        logits, past = self.lm.prefill(self.prompt, room=steps + 2, last_only=True)
        tok = int(logits[-1].argmax())
        for _ in range(steps):
            logits, past = self.lm.decode([tok], past)
            tok = int(logits[-1].argmax())

    def summary(self) -> dict:
        import numpy as np

        path = self.lm.session.end_profiling()
        events = json.loads(Path(path).read_text())
        Path(path).unlink()
        runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                      if e.get("cat") == "Session" and e.get("name") == "model_run")
        # Each run() is one prefill then `steps` decodes: drop every burst's first run (the prefill).
        per_run: dict[int, dict[str, float]] = {}
        per_run_op: dict[int, dict[str, float]] = {}
        burst = self.steps + 1
        if len(runs) != self.bursts * burst:
            raise RuntimeError(f"profile has {len(runs)} runs, expected {self.bursts} x {burst}")
        prefill_runs = set(range(0, len(runs), burst))
        starts = [r[0] for r in runs]
        shapes = {}
        import bisect

        for e in events:
            if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
                continue
            node = e["name"][: -len("_kernel_time")]
            a = e.get("args", {})
            i = bisect.bisect_right(starts, e["ts"]) - 1
            if i < 0:
                continue
            per_run.setdefault(i, defaultdict(float))[role(node)] += e["dur"] / 1000
            per_run_op.setdefault(i, defaultdict(float))[a.get("op_name", "?")] += e["dur"] / 1000
            if "/layers/0/mlp" in node and node not in shapes and i not in prefill_runs:
                shapes[node] = {"op": a.get("op_name"), "in": a.get("input_type_shape"),
                                "out": a.get("output_type_shape"), "provider": a.get("provider")}
        dec = [i for i in per_run if i not in prefill_runs]
        roles = sorted({r for i in dec for r in per_run[i]})
        ops = sorted({o for i in dec for o in per_run_op[i]})
        med = {r: float(np.median([per_run[i].get(r, 0.0) for i in dec])) for r in roles}
        low = {r: float(np.percentile([per_run[i].get(r, 0.0) for i in dec], 10)) for r in roles}
        total = [sum(per_run[i].values()) for i in dec]
        return {"decode_runs": len(dec), "by_role_median": med, "by_role_p10": low,
                "by_op_median": {o: float(np.median([per_run_op[i].get(o, 0.0) for i in dec])) for o in ops},
                "kernel_ms_median": float(np.median(total)), "kernel_ms_p10": float(np.percentile(total, 10)),
                "mlp_layer0": shapes}


def main():
    import numpy as np

    from compress.config import PruneConfig
    from compress.corpus.splits import make_splits
    from compress.loading.models import load_teacher
    from compress.prune import prune_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--ratios", type=float, nargs="*", default=[0.25], help="MLP ratios")
    ap.add_argument("--layer-ratios", type=float, nargs="*", default=[], help="depth pruning ratios, for comparison")
    ap.add_argument("--quant", nargs="*", default=["dynamic"])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile-steps", type=int, default=24)
    ap.add_argument("--cpu-only", action="store_true", help="only CPU ms per decode step on one thread")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    model, tok = load_teacher(cache_dir=ROOT / ".cache" / "models")
    splits = make_splits(tok, "embedded", block_size=128, train_blocks=64, calib_blocks=32, selection_blocks=32)
    arts: dict[str, dict[str, Path]] = {"teacher": build("teacher", model, tok, splits, args.quant)}
    widths = {"teacher": model.config.intermediate_size}
    specs = [(f"mlp{int(round(r * 1000)):03d}", dict(mlp_ratio=r)) for r in args.ratios]
    specs += [(f"layers{int(round(r * 1000)):03d}", dict(mlp_ratio=0.0, layer_ratio=r)) for r in args.layer_ratios]
    for name, spec in specs:
        width_file = OUT / name / "intermediate_size.txt"
        if not width_file.is_file():
            student, _ = prune_model(model, splits.calib, PruneConfig(enabled=True, sensitivity=False,
                                                                      reconstruct=False, **spec))
            build(name, student, tok, splits, [])
            width_file.write_text(str(student.config.intermediate_size))
            del student
        arts[name] = build(name, None, tok, splits, args.quant)
        widths[name] = int(width_file.read_text())
    prompt = splits.selection[0][:32].tolist()
    kinds = ["fp32", *args.quant]
    if args.cpu_only:
        cpu = {(n, k): decode_cpu_ms(a[k], prompt, args.steps, args.rounds) for n, a in arts.items() for k in kinds}
        print("| model | kind | I | MiB | CPU ms per decode step, 1 thread (median, p10) |")
        print("|---|---|---|---|---|")
        rows = []
        for (n, k), ts in cpu.items():
            size = sum(p.stat().st_size for p in arts[n][k].glob("model.onnx*")) / 2**20
            rows.append({"model": n, "kind": k, "intermediate": widths.get(n), "size_mib": size,
                         "cpu_ms_median": float(np.median(ts)), "cpu_ms_p10": float(np.percentile(ts, 10))})
            print(f"| {n} | {k} | {widths.get(n)} | {size:.0f} | {np.median(ts):.2f}, {np.percentile(ts, 10):.2f} |")
        (OUT / "cpu.json").write_text(json.dumps({"rows": rows, "loadavg": os.getloadavg()}, indent=1))
        print("load average", os.getloadavg())
        return
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    drivers = {(n, k): _driver(a[k], profile=False) for n, a in arts.items() for k in kinds}
    profs = {(n, k): Profiled(a[k], prompt) for n, a in arts.items() for k in kinds}
    for _ in range(args.rounds):
        for key, lm in drivers.items():  # taking turns, timing and profile alike
            times[key] += decode_ms(lm, prompt, args.steps)
            profs[key].run(args.profile_steps)
    results = []
    for (n, k), ts in times.items():
        prof = profs[(n, k)].summary()
        size = sum(p.stat().st_size for p in arts[n][k].glob("model.onnx*"))
        results.append({"model": n, "kind": k, "intermediate": widths.get(n), "size_mib": size / 2**20,
                        "decode_ms_median": float(np.median(ts)), "decode_ms_p10": float(np.percentile(ts, 10)),
                        "profile": prof})
        print(n, k, f"{np.median(ts):.2f} ms/token", {r: round(v, 3) for r, v in sorted(prof['by_role_p10'].items())},
              flush=True)
    res = {"results": results, "loadavg": os.getloadavg(), "rounds": args.rounds, "steps": args.steps}
    (OUT / "results.json").write_text(json.dumps(res, indent=1))
    roles = sorted({r for x in results for r in x["profile"]["by_role_p10"]})
    print("| model | kind | I | MiB | decode ms/token (median, p10) | kernel ms/step (median, p10) | "
          + " | ".join(roles) + " |")
    print("|---" * (6 + len(roles)) + "|")
    for x in results:
        p = x["profile"]
        print(f"| {x['model']} | {x['kind']} | {x['intermediate']} | {x['size_mib']:.0f} | "
              f"{x['decode_ms_median']:.2f}, {x['decode_ms_p10']:.2f} | {p['kernel_ms_median']:.2f}, {p['kernel_ms_p10']:.2f} | "
              + " | ".join(f"{p['by_role_p10'].get(r, 0):.3f}" for r in roles) + " |")
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
