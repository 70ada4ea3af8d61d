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

from benchmarks import run_modes
from benchmarks.sweep import chats, cpu_flags
import collections

TARGET = re.compile(r"^(?P<a>[\w.-]+)@(?P<c>\d+)>=(?P<k>[\d.]+)\*(?P<b>[\w.-]+)@(?P<d>\d+)$")


MODES_HELP = 'modes (each with its own --help): --roofline: a stack of MatMulNBits alone per bit width and block (formerly benchmarks/nbits_roofline.py); --prompt-profile: one batched first-prompt call timed and split by op type; --prompt-cut: a wave of first prompts cut at half or where the work is even; --prefill-forms: what a prompt costs in each weight form of one model, with its agreement'


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
    p = argparse.ArgumentParser(epilog=MODES_HELP, description=__doc__.split("\n\n")[0])
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


# --- `--roofline`: formerly benchmarks/nbits_roofline.py ----------------------------

ROOFLINE_DOC = """This CPU's roofline for the decode of a quantized graph: a stack of ``MatMulNBits`` alone (Qwen2.5-1.5B's MLP shapes,
1536 x 8960 and back, random codes), at several bit widths, block sizes and numbers of rows, in GB/s of weights read
and G multiply-adds a second.

    python -m benchmarks.ceiling --roofline [--layers 48] [--rows 1 8 40] [--forms 4:32 4:64 8:32] [--threads 2]
        [--out benchmarks/results/nbits_roofline.json]

One row is one user's decode step: bound by reading the weights (GB/s). From 8 rows up a step is bound by the int8
arithmetic of ``accuracy_level`` 4 (GMAC/s), which is also what a prompt costs. 48 layers hold ~420 MB at 4 bits,
beyond the caches, so the figures are memory's, not the L3's. docs/quantization.md#4-bit-weights reads them.
"""

HIDDEN, INTER = 1536, 8960
FORMS = ("4:32", "4:64", "8:32")


def parse_form(text: str) -> tuple[int, int]:
    """``BITS:BLOCK`` (``4:32``) as a pair; argparse's type, so a bad one is a usage error naming the form."""
    try:
        bits, block = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--forms takes BITS:BLOCK, e.g. 4:32 or 8:128, not {text!r}") from None
    if bits not in (4, 8) or block < 16 or block & (block - 1):
        raise argparse.ArgumentTypeError(f"--forms {text!r}: bits must be 4 or 8, the block a power of two >= 16")
    return bits, block


def stack(bits: int, block: int, layers: int) -> tuple[bytes, int]:
    """A graph of ``layers`` MatMulNBits (up, down, up, ...) with asymmetric blocks; its bytes of weights."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x, size = [], [], "x", 0
    for i in range(layers):
        k, n = (HIDDEN, INTER) if i % 2 == 0 else (INTER, HIDDEN)
        kb = k // block
        arrays = {f"w{i}": rng.integers(0, 255, (n, kb, block * bits // 8), dtype=np.uint8),
                  f"s{i}": (rng.random(n * kb, dtype=np.float32) * 0.01).astype(np.float32),
                  f"z{i}": rng.integers(0, 255, n * ((kb * bits + 7) // 8), dtype=np.uint8)}
        inits += [numpy_helper.from_array(a, name) for name, a in arrays.items()]
        size += sum(a.nbytes for a in arrays.values())
        nodes.append(helper.make_node("MatMulNBits", [x, f"w{i}", f"s{i}", f"z{i}"], [f"y{i}"], domain="com.microsoft",
                                      K=k, N=n, bits=bits, block_size=block, accuracy_level=4))
        x = f"y{i}"
    g = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", HIDDEN])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["M", HIDDEN if layers % 2 == 0 else INTER])],
                          inits)
    model = helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 17),
                                                               helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString(), size


def measure(bits: int, block: int, layers: int, rows: list[int], threads: int, reps: int) -> list[dict]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    graph, size = stack(bits, block, layers)
    sess = ort.InferenceSession(graph, so, providers=["CPUExecutionProvider"])
    macs = layers * HIDDEN * INTER
    out = []
    for m in rows:
        x = np.random.default_rng(1).standard_normal((m, HIDDEN), dtype=np.float32)
        for _ in range(3):
            sess.run(None, {"x": x})
        t = time.perf_counter()
        for _ in range(reps):
            sess.run(None, {"x": x})
        s = (time.perf_counter() - t) / reps
        out.append({"bits": bits, "block": block, "rows": m, "ms": round(s * 1e3, 2), "weight_mb": round(size / 1e6),
                    "gb_per_s": round(size / s / 1e9, 1), "gmac_per_s": round(m * macs / s / 1e9, 1)})
        print(f"{bits}-bit block {block:>3}, {m:>3} rows: {s * 1e3:7.2f} ms  {size / s / 1e9:5.1f} GB/s of weights  "
              f"{m * macs / s / 1e9:6.1f} GMAC/s", flush=True)
    return out


def roofline_main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ceiling --roofline", description=ROOFLINE_DOC.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 40])
    p.add_argument("--forms", type=parse_form, nargs="+", default=[parse_form(f) for f in FORMS],
                   help="BITS:BLOCK pairs to measure (default: 4:32 4:64 8:32)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    rows = [r for bits, block in a.forms for r in measure(bits, block, a.layers, a.rows, a.threads, a.reps)]
    result = {"cpu_flags": cpu_flags(), "cores": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2),
              "layers": a.layers, "shape": [HIDDEN, INTER], "threads": a.threads, "rows": rows}
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")


# --- `--prompt-profile`: formerly benchmarks/prompt_profile.py ----------------------

PROMPT_PROFILE_DOC = """One batched first-prompt call of gqa artifacts, timed and split by op type: where a wave's prompt phase goes.

    python -m benchmarks.ceiling --prompt-profile --artifact champion=<dir> --artifact f32kv=<dir> --prompts 16 --threads 1

The call is the one serve/runners/gqa.py makes for a wave of new requests (``_run_first_prompts``): the sweep's chat
prompts (benchmarks/sweep.py) in the artifact's own template, sorted by length, right-padded to the longest,
``seqlens_k`` = each length - 1, ``total_sequence_length`` = the padded length, the last positions' logits only,
K/V bound in place as past and present. At 32 users the server runs two such calls of 16 at once, one thread
each, so ``--prompts 16 --threads 1`` is one of them. Artifacts alternate run by run, so load hits them alike.
Prints the CPU flags, the median ms per call and, with ``--profile``, ORT's kernel time per op type per call
(the warm-up call left out).
"""

def chat_prompts(artifact: Path, n: int, seed: int = 32) -> list[list[int]]:
    """The sweep's first ``n`` chat prompts as token ids, through the artifact's chat template and tokenizer (the
    user text alone for a model without a template)."""
    from serve.api.chat_template import render_template
    from serve.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(artifact)
    template = json.loads((artifact / "manifest.json").read_text()).get("chat_template")
    texts = [render_template(template, m) if template else m[0]["content"] for m in chats(n, seed=seed)]
    return [tok.encode(t, add_special_tokens=False).ids for t in texts]


class PromptCall:
    """A session on one gqa artifact and the bound inputs of one batched first-prompt call."""

    def __init__(self, artifact: Path, prompts: list[list[int]], threads: int, profile_dir: str | None = None):
        import onnxruntime as ort

        man = json.loads((artifact / "manifest.json").read_text())
        if man.get("attention_layout") != "gqa":
            raise SystemExit(f"{artifact}: attention layout {man.get('attention_layout')!r}; this profiles 'gqa' "
                             "artifacts (the server's batched first-prompt call)")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.log_severity_level = 3
        if threads == 1:  # as the server's split session (serve/runners/gqa.py _halves)
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if profile_dir:
            opts.enable_profiling = True
            opts.profile_file_prefix = str(Path(profile_dir) / artifact.name)
        self.session = ort.InferenceSession(str(artifact / man.get("onnx_file", "model.onnx")), opts,
                                            providers=["CPUExecutionProvider"])
        self.dtype = np.int8 if man.get("kv_dtype") == "int8" else np.float32
        prompts = sorted(prompts, key=len)
        lens = [len(p) for p in prompts]
        S = max(lens)
        self.tokens, self.padded, self.lens = sum(lens), len(prompts) * S, lens
        ids = np.zeros((len(prompts), S), np.int64)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = p
        names = {i.name for i in self.session.get_inputs()}
        self.feeds = {"input_ids": ids, "seqlens_k": np.array([n - 1 for n in lens], np.int32),
                      "total_sequence_length": np.array(S, np.int32)}
        if "logits_to_keep" in names:
            self.feeds["logits_to_keep"] = np.array([S - min(lens) + 1], np.int64)
        self.past = [i.name for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        self.present = [o.name for o in self.session.get_outputs() if o.name.startswith("present.")]
        cap = -(-S // 256) * 256  # the runner's row length for this step (CAP_STEP)
        self.kv = np.zeros((len(self.past), len(prompts), int(man["num_kv_heads"]), cap, int(man["head_dim"])),
                           self.dtype)

    def run(self) -> float:
        binding = self.session.io_binding()
        for name, arr in self.feeds.items():
            binding.bind_cpu_input(name, arr)
        for j, (pin, pout) in enumerate(zip(self.past, self.present)):
            rows = self.kv[j]
            binding.bind_input(pin, "cpu", 0, self.dtype, list(rows.shape), rows.ctypes.data)
            binding.bind_output(pout, "cpu", 0, self.dtype, list(rows.shape), rows.ctypes.data)
        binding.bind_output("logits")
        t = time.perf_counter()
        self.session.run_with_iobinding(binding)
        return time.perf_counter() - t

    def op_times(self) -> dict[str, float]:
        """ms per call by op type from ORT's profile, the first (warm-up) call left out (ends profiling)."""
        path = self.session.end_profiling()
        events = json.loads(Path(path).read_text())
        os.unlink(path)
        runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
        warm_end = runs[0][1] if runs else 0
        per_op: collections.Counter = collections.Counter()
        for e in events:
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= warm_end:
                per_op[e["args"]["op_name"]] += e["dur"]
        calls = max(len(runs) - 1, 1)
        return {op: us / calls / 1e3 for op, us in per_op.most_common()}


def prompt_profile_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ceiling --prompt-profile", description=PROMPT_PROFILE_DOC.split("\n")[0])
    p.add_argument("--artifact", action="append", required=True, metavar="NAME=DIR", help="a gqa artifact (repeat)")
    p.add_argument("--prompts", type=int, default=16, help="prompts in the call (16: half of a 32-user wave)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs", type=int, default=5, help="timed calls per artifact, after one warm-up")
    p.add_argument("--profile", action="store_true", help="also ORT's kernel time per op type")
    p.add_argument("--json", type=Path, help="write the figures here")
    a = p.parse_args(argv)
    arts = {}
    for item in a.artifact:
        name, sep, path = item.partition("=")
        if not sep or not (Path(path) / "manifest.json").is_file():
            p.error(f"--artifact {item!r}: NAME=DIR with DIR an artifact folder (manifest.json)")
        arts[name] = Path(path)
    print("CPU flags:", cpu_flags())
    with tempfile.TemporaryDirectory(prefix="prompt_profile_") as tmp:
        calls = {name: PromptCall(d, chat_prompts(d, a.prompts), a.threads, tmp if a.profile else None)
                 for name, d in arts.items()}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for c in calls.values():
            c.run()  # warm-up: first-call allocations
        for _ in range(a.runs):
            for name, c in calls.items():
                times[name].append(c.run())
        out = {}
        for name, c in calls.items():
            ms = sorted(t * 1e3 for t in times[name])
            out[name] = {"median_ms": round(ms[len(ms) // 2], 1), "runs_ms": [round(t, 1) for t in ms],
                         "prompts": a.prompts, "tokens": c.tokens, "padded_tokens": c.padded, "threads": a.threads,
                         "prompt_tokens": sorted(c.lens)}
            if a.profile:
                out[name]["op_ms"] = {k: round(v, 2) for k, v in c.op_times().items()}
    for name, r in out.items():
        print(f"{name}: {r['median_ms']} ms per call ({r['prompts']} prompts, {r['tokens']} tokens, "
              f"{r['padded_tokens']} padded, {r['threads']} thread(s))")
        total = sum(r.get("op_ms", {}).values())
        for op, ms in list(r.get("op_ms", {}).items())[:10]:
            print(f"    {op:34s} {ms:8.1f} ms  {100 * ms / total:5.1f} %")
    if a.json:
        a.json.write_text(json.dumps({"cpu_flags": cpu_flags(), "results": out}, indent=1))
    return 0


# --- `--prompt-cut`: formerly benchmarks/prompt_cut.py ------------------------------

PROMPT_CUT_DOC = """A wave of first prompts through the engine, its two split calls cut at half the rows or where their work is even.

    python -m benchmarks.ceiling --prompt-cut --artifact <gqa artifact> [--prompts 32] [--long 4] [--trials 8]

One wave: ``--prompts`` of the sweep's chat prompts (benchmarks/sweep.py) in the artifact's template, the first
``--long`` of them made ~8x longer (the prompt repeated), admitted in one engine step (prefix and result caches
off, one new token each), so the step is the runner's batched first-prompt call, run as two calls at once on the
split session (serve/runners/gqa.py). Each trial runs the same wave twice, cut at n // 2 and by ``balanced_cut``
(the order alternating), a new seed per trial; prints each trial's pair, the medians, and balanced / half.
"""

def prompt_cut_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ceiling --prompt-cut", description=PROMPT_CUT_DOC.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--long", type=int, default=0, help="how many of the prompts are made ~8x longer")
    p.add_argument("--trials", type=int, default=8)
    a = p.parse_args(argv)

    import serve.runners.gqa as runner_gqa
    from serve.config import ServeConfig
    from serve.engine.engine import Engine
    from serve.engine.sampling import SamplingParams
    from serve.runners.onnx_session import CPU

    eng = Engine(a.artifact, ServeConfig(providers=[CPU], verify_artifact=False, max_batch_size=max(a.prompts, 16),
                                         enable_prefix_caching=False, result_cache_size=0,
                                         max_num_batched_tokens=65536, prefill_chunk=0), start=False)
    if not isinstance(eng.runner, runner_gqa.GqaRunner) or eng.runner.split.session is None:
        raise SystemExit("--artifact: needs a gqa artifact on a CPU with 2+ cores (the split session)")
    cuts = {"half": lambda lens, share: len(lens) // 2, "balanced": runner_gqa.balanced_cut}
    print(f"CPU flags: {cpu_flags()}; {a.prompts} prompts, {a.long} long")
    times: dict[str, list[float]] = {k: [] for k in cuts}
    try:
        for trial in range(a.trials + 1):  # trial 0 warms both up and is not counted
            wave = chat_prompts(a.artifact, a.prompts, seed=32 + trial)
            wave[:a.long] = [ids * 8 for ids in wave[:a.long]]
            pair = {}
            for name in (("half", "balanced") if trial % 2 else ("balanced", "half")):
                runner_gqa.balanced_cut = cuts[name]
                handles = [eng.add_request(ids, SamplingParams.greedy(1, ignore_eos=True)) for ids in wave]
                t = time.perf_counter()
                eng.step()
                pair[name] = time.perf_counter() - t
                if any(len(h.output_ids) != 1 for h in handles):
                    raise SystemExit("the wave did not run as one step (raise max_num_batched_tokens)")
                eng.run_until_done()
            if trial:
                for k, v in pair.items():
                    times[k].append(v)
                print(f"trial {trial}: half {pair['half'] * 1e3:7.0f} ms  balanced {pair['balanced'] * 1e3:7.0f} ms")
    finally:
        runner_gqa.balanced_cut = cuts["balanced"]
        eng.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"median: half {med['half'] * 1e3:.0f} ms, balanced {med['balanced'] * 1e3:.0f} ms, "
          f"balanced / half {med['balanced'] / med['half']:.3f}")
    return 0


# --- `--prefill-forms`: what a prompt costs in each weight form (issue 70) ---------------------------------------

PREFILL_DOC = """What a prompt costs on this CPU in each weight form of one model: one call of ``--tokens`` prompt tokens at
batch 1 (the last position's logits only, as the server asks), the fastest of ``--reps``, in prompt tokens/s and
G multiply-adds a second (the decoder's linears: parameters less the embedding table, per token). Beside it, each
form's top-1 agreement and largest logit difference against the first form (the reference, e.g. fp32) at every
position of ``--prompts`` prompts cut from the load stage's selection split.

    python -m benchmarks.ceiling --prefill-forms --form fp32=<dir> --form wo8=<dir> --form w8a8=<dir>
        --splits <load stage>/splits.npz [--tokens 512] [--out benchmarks/results/prefill_forms_<model>.json]
"""


def prefill_forms_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=PREFILL_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--form", action="append", required=True, metavar="NAME=DIR", help="a gqa artifact (repeat; the first is the reference)")
    p.add_argument("--splits", type=Path, required=True, help="the load stage's splits.npz (its selection blocks are the prompts)")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    from compress.corpus.splits import DataSplits
    from compress.drivers import load_lm

    test = np.asarray(DataSplits.load(a.splits).selection).reshape(-1)
    if test.size < a.tokens * a.prompts:
        raise SystemExit(f"--splits: {test.size} selection tokens, fewer than --tokens x --prompts ({a.tokens * a.prompts})")
    prompts = test[:a.tokens * a.prompts].reshape(a.prompts, a.tokens).tolist()
    forms, ref = {}, None
    for spec in a.form:
        name, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"--form {spec!r}: write it as NAME=DIR")
        manifest = json.loads((Path(path) / "manifest.json").read_text())
        macs = int(manifest["num_parameters"]) - int(manifest["vocab_size"]) * int(manifest["hidden_size"])
        lm = load_lm(path)
        lm.prefill(prompts[0][:64], last_only=True)  # warm-up
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            lm.prefill(prompts[0], last_only=True)
            times.append(time.perf_counter() - t0)
        logits = [lm.prefill(q)[0] for q in prompts]
        ref = ref or logits
        agree = float(np.mean([np.mean(x.argmax(-1) == r.argmax(-1)) for x, r in zip(logits, ref)]))
        diff = float(max(np.abs(x - r).max() for x, r in zip(logits, ref)))
        q = manifest.get("quantization") or {}
        t = min(times)
        forms[name] = {"artifact": path, "method": q.get("method", "float32"), "kv_dtype": manifest.get("kv_dtype"),
                       "seconds": round(t, 6), "prompt_tokens_per_s": round(a.tokens / t, 1),
                       "gmac_per_s": round(macs * a.tokens / t / 1e9, 1), "top1_agreement_vs_first": round(agree, 4),
                       "max_abs_logit_diff_vs_first": round(diff, 3)}
        print(f"{name:>12}: {a.tokens / t:7.0f} prompt tokens/s, {forms[name]['gmac_per_s']:6.1f} GMAC/s, top-1 "
              f"agreement {agree:.4f} with {a.form[0].split('=')[0]}", flush=True)
        del lm
    result = {"cpu_flags": cpu_flags(), "cores": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2),
              "tokens": a.tokens, "prompts": a.prompts, "forms": forms,
              "command": "python -m benchmarks.ceiling --prefill-forms " + " ".join(argv if argv is not None else sys.argv[1:])}
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_modes(main, {"--roofline": roofline_main, "--prompt-profile": prompt_profile_main,
                                      "--prompt-cut": prompt_cut_main, "--prefill-forms": prefill_forms_main}))
