"""The most tokens/s a served graph could make on this CPU with ONNX Runtime's kernels: its own MatMulNBits, timed
alone, priced over a sweep's workload. An upper bound to set beside the sweep's measured figures and a target's.

    python -m benchmarks.ceiling --sweep <sweep.json> --artifact int4=<dir> [--artifact int8=<dir>]
        [--target "int4@1>=1.4*int8@1" ...] [--prefill-rows 64 256] [--out benchmarks/results/ceiling.json]

Every MatMulNBits of the artifact's graph, with its own weights (the artifact's data file, read where it lies), is
copied into a graph of those nodes alone, each fed a random input of its width: the lm_head in one graph, the rest in
another. Each is timed at the sweep's levels (c rows: a decode step of c users) and at ``--prefill-rows`` (a prompt's
rows; the fastest per row counts). The bound of a level is the sweep's workload at those times: its requests, their
prompts counted with the artifact's chat template, ``tokens - 1`` decode steps per request, the lm_head once per
prompt (the runner asks for the last logits only). Attention, norms, sampling, scheduling and HTTP count zero, so a
real server stays below the bound. Time the artifacts in the same sitting as the sweep (this VM's memory speed
varies between sittings); each is timed on its own, one session at a time.

A target ``A@c>=k*B@d`` asks system A at c users for k times system B's measured tokens/s at d users; it is
*reachable* only if that figure is under A's bound.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.burst import cpu_flags
from benchmarks.prompt_profile import chat_prompts
from benchmarks.sweep import chats

TARGET = re.compile(r"^(?P<a>[\w.-]+)@(?P<c>\d+)>=(?P<k>[\d.]+)\*(?P<b>[\w.-]+)@(?P<d>\d+)$")


def kernel_graphs(artifact: Path, folder: Path) -> dict:
    """Write ``body.onnx`` and ``head.onnx`` into ``folder``: the artifact's MatMulNBits alone (the lm_head, N = the
    vocabulary, in head), their weights read from the artifact's own data file. Returns bytes and multiply-adds per
    row of each, and the input widths."""
    import onnx
    from onnx import TensorProto, helper

    manifest = json.loads((artifact / "manifest.json").read_text())
    model = onnx.load(str(artifact / manifest.get("onnx_file", "model.onnx")), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    for t in inits.values():  # the data file goes beside the new graphs (ORT reads no path outside a graph's folder,
        for e in t.external_data:  # symlinks resolved): a hard link, a copy across file systems
            if e.key == "location" and not (folder / e.value).exists():
                try:
                    os.link((artifact / e.value).resolve(), folder / e.value)
                except OSError:
                    shutil.copyfile(artifact / e.value, folder / e.value)
    parts: dict[str, dict] = {"body": {"nodes": [], "bytes": 0, "macs": 0}, "head": {"nodes": [], "bytes": 0, "macs": 0}}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        part = parts["head" if a["N"] == manifest["vocab_size"] else "body"]
        part["nodes"].append((node, a))
        part["macs"] += a["K"] * a["N"]
        for name in node.input[1:]:
            t = inits.get(name)
            if t is not None:
                length = {e.key: e.value for e in t.external_data}.get("length")
                part["bytes"] += int(length) if length is not None else len(t.raw_data)
    if not parts["body"]["nodes"]:
        raise SystemExit(f"--artifact {artifact}: its graph has no MatMulNBits; the bound prices quantized graphs only")
    for key, part in parts.items():
        widths = sorted({a["K"] for _, a in part["nodes"]})
        nodes, outputs, used = [], [], set()
        for i, (node, a) in enumerate(part["nodes"]):
            ins = [f"x{a['K']}", *node.input[1:]]
            used.update(n for n in node.input[1:] if n)
            nodes.append(helper.make_node("MatMulNBits", ins, [f"y{i}"], domain="com.microsoft", **a))
            outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["M", a["N"]]))
        g = helper.make_graph(nodes, key, [helper.make_tensor_value_info(f"x{w}", TensorProto.FLOAT, ["M", w])
                                           for w in widths], outputs, [inits[n] for n in sorted(used)])
        onnx.save(helper.make_model(g, ir_version=10, opset_imports=list(model.opset_import)), str(folder / f"{key}.onnx"))
        part.update(widths=widths, nodes=len(nodes))
    return parts


def time_graph(path: Path, widths: list[int], rows: list[int], threads: int, reps: int) -> dict[int, float]:
    """Median seconds of one run of the graph at each number of rows."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    out = {}
    for m in rows:
        feed = {f"x{w}": np.random.default_rng(m).standard_normal((m, w), dtype=np.float32) for w in widths}
        for _ in range(2):
            sess.run(None, feed)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            sess.run(None, feed)
            times.append(time.perf_counter() - t)
        out[m] = statistics.median(times)
    return out


def bound(times: dict, prefill_rows: list[int], c: int, prompts: list[int], tokens_per_request: int) -> dict:
    """Seconds and tokens/s of one level's workload at the kernels' times (see the module docstring)."""
    per_row = min(times["body"][r] / r for r in prefill_rows)
    prefill = sum(prompts) * per_row + len(prompts) * times["head"][1]
    step = times["body"][c] + times["head"][c]
    decode = len(prompts) / c * (tokens_per_request - 1) * step
    tokens = len(prompts) * tokens_per_request
    return {"c": c, "prompt_tokens": sum(prompts), "prefill_s": round(prefill, 3), "decode_step_ms": round(step * 1e3, 3),
            "decode_s": round(decode, 3), "ceiling_tokens_per_s": round(tokens / (prefill + decode), 1)}


def measured(sweep: dict, name: str, c: int) -> float:
    for row in sweep["rows"].get(name, []):
        if row["c"] == c:
            return row["tokens_per_s"]
    raise SystemExit(f"the sweep has no system {name!r} at {c} users (it has {sorted(sweep['rows'])})")


def judge(text: str, sweep: dict, ceilings: dict) -> dict:
    m = TARGET.match(text.replace(" ", ""))
    if not m:
        raise SystemExit(f"--target {text!r}: write it as A@C>=K*B@D, e.g. int4@1>=1.2*llama-server-q4_k_m@1")
    a, c, k, b, d = m["a"], int(m["c"]), float(m["k"]), m["b"], int(m["d"])
    need = round(k * measured(sweep, b, d), 1)
    ceiling = ceilings.get(a, {}).get(c)
    return {"target": text, "needs_tokens_per_s": need, "measured": measured(sweep, a, c), "ceiling": ceiling,
            "reachable": None if ceiling is None else need <= ceiling}


def one_system(name: str, artifact: Path, levels: list[dict], prefill_rows: list[int], threads: int, reps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="ceiling-") as tmp:
        parts = kernel_graphs(artifact, Path(tmp))
        rows = sorted({1, *prefill_rows, *(row["c"] for row in levels)})
        times = {k: time_graph(Path(tmp) / f"{k}.onnx", p["widths"], rows, threads, reps) for k, p in parts.items()}
    out = []
    for row in levels:
        n, c = row["requests"], row["c"]  # the sweep's own prompts at that level, as the server renders them
        b = bound(times, prefill_rows, c, [len(ids) for ids in chat_prompts(artifact, n, seed=c)],
                  row["output_tokens"] // n)
        b.update(prompts=[m[0]["content"] for m in chats(n, seed=c)], measured_tokens_per_s=row["tokens_per_s"],
                 share_of_ceiling=round(row["tokens_per_s"] / b["ceiling_tokens_per_s"], 2))
        out.append(b)
        print(f"{name:>10} c{row['c']:<3} measured {row['tokens_per_s']:6.1f}  ceiling {b['ceiling_tokens_per_s']:6.1f} "
              f"tokens/s ({b['share_of_ceiling']:.2f}; MatMulNBits alone: a step {b['decode_step_ms']} ms, the "
              f"prompts {b['prefill_s']} s)", flush=True)
    return {"nodes": {k: p["nodes"] for k, p in parts.items()},
            "weights_read_per_step_bytes": sum(p["bytes"] for p in parts.values()),
            "macs_per_row": {k: p["macs"] for k, p in parts.items()},
            "kernel_ms": {k: {r: round(s * 1e3, 6) for r, s in t.items()} for k, t in times.items()}, "levels": out}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", type=Path, required=True, help="benchmarks.sweep's JSON, this sitting's")
    p.add_argument("--artifact", action="append", required=True, metavar="NAME=DIR",
                   help="an artifact of the sweep, under the sweep's name for it")
    p.add_argument("--target", action="append", default=[], metavar="A@C>=K*B@D")
    p.add_argument("--prefill-rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    sweep = json.loads(a.sweep.read_text())
    systems = {}
    for spec in a.artifact:
        name, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"--artifact {spec!r}: write it as NAME=DIR, NAME as the sweep names the system")
        if name not in sweep["rows"]:
            raise SystemExit(f"--artifact {name}: the sweep has no such system (it has {sorted(sweep['rows'])})")
        systems[name] = one_system(name, Path(path), sweep["rows"][name], a.prefill_rows, a.threads, a.reps)
    ceilings = {n: {lv["c"]: lv["ceiling_tokens_per_s"] for lv in s["levels"]} for n, s in systems.items()}
    targets = [judge(t, sweep, ceilings) for t in a.target]
    for t in targets:
        print(f"{t['target']}: needs {t['needs_tokens_per_s']}, measured {t['measured']}, ceiling {t['ceiling']}: "
              f"{'reachable' if t['reachable'] else 'out of reach' if t['reachable'] is False else 'no ceiling'}")
    result = {"cpu_flags": cpu_flags(), "cores": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2),
              "threads": a.threads, "sweep": str(a.sweep), "command": "python -m benchmarks.ceiling " + " ".join(
                  str(x) for x in (argv if argv is not None else sys.argv[1:])), "systems": systems,
              "targets": targets}
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
