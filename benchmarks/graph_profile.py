"""Our decoder graph against onnxruntime-genai's, node by node and kernel by kernel, in one process.

    python -m benchmarks.graph_profile --graph ours=artifacts/quantize/<key>/artifact/model.onnx \
        --graph genai=.cache/bench/genai/int8/model.onnx --prompt-tokens 64 --steps 64

Both graphs run under this venv's onnxruntime (same kernels), batch 1, greedy, with the KV buffers
bound as past and present (in place), as serve/runners/gqa.py and genai (past_present_share_buffer)
run them. Two graph contracts are recognised by their inputs: ours (``seqlens_k`` +
``total_sequence_length``, compress/export/gqa.py) and genai's builder (``attention_mask``).

For each graph: the op-type histogram of the file and of ORT's optimized graph, the median ms per
decode step (steps interleaved between graphs so load hits both alike), and ORT's profiler summed
per op type over the decode steps (prefill excluded; steps interleaved too), per step.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx


def op_histogram(model: onnx.ModelProto | str | Path) -> dict[str, int]:
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    c = collections.Counter(n.op_type for n in model.graph.node)
    return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


class GraphRunner:
    """Batch-1 greedy decoding of one graph file with in-place KV, either contract."""

    def __init__(self, path: str | Path, threads: int = 0, profile_prefix: str | None = None,
                 optimized_path: str | None = None, max_len: int = 512):
        import onnxruntime as ort

        self.path = Path(path)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
        if profile_prefix:
            opts.enable_profiling = True
            opts.profile_file_prefix = profile_prefix
        if optimized_path:
            opts.optimized_model_filepath = optimized_path
        opts.log_severity_level = 3
        self.sess = ort.InferenceSession(str(self.path), opts, providers=["CPUExecutionProvider"])
        ins = {i.name: i for i in self.sess.get_inputs()}
        self.contract = "ours" if "seqlens_k" in ins else "genai" if "attention_mask" in ins else None
        if self.contract is None:
            raise ValueError(f"{path}: neither our gqa contract (seqlens_k) nor genai's (attention_mask)")
        self.past = [n for n in ins if n.startswith("past_key_values.")]
        self.present = [o.name for o in self.sess.get_outputs() if o.name.startswith("present.")]
        shp = ins[self.past[0]].shape
        self.kv_heads = int(shp[1])
        if isinstance(shp[3], int):
            self.head_dim = shp[3]
        else:  # genai's builder leaves it symbolic ("kv_cache_dim"); its config says it
            cfg = json.loads((self.path.parent / "genai_config.json").read_text())
            self.head_dim = int(cfg["model"]["decoder"]["head_size"])
        self.vocab = int(self.sess.get_outputs()[0].shape[-1])
        self.max_len = max_len
        # the graph's cache type: float16 for export.kv_dtype float16 (and genai's fp16 builds)
        self.kv_dtype = np.float16 if ins[self.past[0]].type == "tensor(float16)" else np.float32
        self.kv = [np.zeros((1, self.kv_heads, max_len, self.head_dim), self.kv_dtype) for _ in self.past]
        self.logits1 = np.empty((1, 1, self.vocab), np.float32)

    def _run(self, ids: np.ndarray, total: int, logits: np.ndarray) -> None:
        b = self.sess.io_binding()
        b.bind_cpu_input("input_ids", ids)
        if self.contract == "ours":
            b.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
            b.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
            b.bind_cpu_input("logits_to_keep", np.array([1], np.int64))
        else:
            b.bind_cpu_input("attention_mask", np.ones((1, total), np.int64))
        for pi, po, buf in zip(self.past, self.present, self.kv):
            b.bind_input(pi, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
            b.bind_output(po, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
        b.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self.sess.run_with_iobinding(b)

    def prefill(self, ids: list[int]) -> int:
        """Run the prompt; returns the greedy next token. Our graph returns only the last position's logits."""
        x = np.asarray(ids, np.int64)[None]
        n = x.shape[1]
        logits = self.logits1 if self.contract == "ours" else np.empty((1, n, self.vocab), np.float32)
        self._run(x, n, logits)
        self.length = n
        return int(logits[0, -1].argmax())

    def step(self, token: int) -> int:
        self.length += 1
        self._run(np.array([[token]], np.int64), self.length, self.logits1)
        return int(self.logits1[0, -1].argmax())

    def end_profiling(self) -> str:
        return self.sess.end_profiling()


def profile_by_op(profile_json: str | Path, skip_runs: int) -> tuple[dict[str, float], int]:
    """Kernel time (µs) per op type summed over the model runs after the first ``skip_runs``; (sums, runs)."""
    ev = json.load(open(profile_json))
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") == "Session" and e.get("name") == "model_run")
    kept = runs[skip_runs:]
    if not kept:
        return {}, 0
    t0 = kept[0][0]
    sums: dict[str, float] = collections.defaultdict(float)
    for e in ev:
        if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time") and e["ts"] >= t0:
            sums[e["args"].get("op_name", "?")] += float(e["dur"])
    return dict(sorted(sums.items(), key=lambda kv: -kv[1])), len(kept)


def compare(graphs: dict[str, str], prompt: list[int], steps: int = 64, threads: int = 0, rounds: int = 3) -> dict:
    """Histograms, interleaved decode timing and per-op kernel time for each named graph file."""
    with tempfile.TemporaryDirectory(prefix="graph_profile_") as tmp:  # optimized graphs, profiles: MBs each
        return _compare(graphs, prompt, steps, threads, rounds, tmp)


def _compare(graphs: dict[str, str], prompt: list[int], steps: int, threads: int, rounds: int, tmp: str) -> dict:
    out: dict = {"prompt_tokens": len(prompt), "steps": steps, "threads": threads, "graphs": {}}
    runners = {}
    for name, path in graphs.items():
        opt = os.path.join(tmp, f"{name}_optimized.onnx")
        runners[name] = GraphRunner(path, threads, optimized_path=opt, max_len=len(prompt) + steps + 8)
        out["graphs"][name] = {"path": str(path), "contract": runners[name].contract,
                               "nodes": op_histogram(path), "optimized_nodes": op_histogram(opt)}
    # Timing without the profiler, graphs interleaved step by step.
    times = {n: [] for n in runners}
    tokens = {n: [] for n in runners}
    cpu = {n: 0.0 for n in runners}
    for _ in range(rounds):
        nxt = {n: r.prefill(prompt) for n, r in runners.items()}
        for n in runners:
            tokens[n] = [nxt[n]]
        for _ in range(steps):
            for n, r in runners.items():
                t, c = time.perf_counter(), time.process_time()
                nxt[n] = r.step(nxt[n])
                times[n].append(time.perf_counter() - t)
                cpu[n] += time.process_time() - c
                tokens[n].append(nxt[n])
    for n in runners:
        g = out["graphs"][n]
        g["decode_ms_p50"] = 1000 * float(np.median(times[n]))
        g["decode_ms_mean"] = 1000 * float(np.mean(times[n]))
        g["decode_cpu_ms_per_step"] = 1000 * cpu[n] / len(times[n])
        g["greedy_tokens"] = tokens[n][:16]
    del runners
    # Profiled pass, steps interleaved between graphs as above: kernel time per op type over the decode steps only.
    prof = {name: GraphRunner(path, threads, profile_prefix=os.path.join(tmp, name), max_len=len(prompt) + steps + 8)
            for name, path in graphs.items()}
    nxt = {n: r.prefill(prompt) for n, r in prof.items()}
    for _ in range(steps):
        for n, r in prof.items():
            nxt[n] = r.step(nxt[n])
    for name, r in prof.items():
        sums, runs = profile_by_op(r.end_profiling(), skip_runs=1)
        g = out["graphs"][name]
        g["kernel_us_per_step"] = {k: v / max(runs, 1) for k, v in sums.items()}
        g["kernel_us_per_step_total"] = sum(g["kernel_us_per_step"].values())
        g["profiled_steps"] = runs
    return out


def print_table(res: dict) -> None:
    names = list(res["graphs"])
    ops = sorted({o for g in res["graphs"].values() for o in g["kernel_us_per_step"]},
                 key=lambda o: -max(g["kernel_us_per_step"].get(o, 0) for g in res["graphs"].values()))
    print(f"decode, batch 1, prompt {res['prompt_tokens']} tokens, {res['steps']} steps, threads {res['threads'] or 'default'}")
    print("| op type | " + " | ".join(f"{n}: nodes (optimized) | {n}: µs/step" for n in names) + " |")
    for o in ops:
        cells = []
        for n in names:
            g = res["graphs"][n]
            cells.append(f"{g['nodes'].get(o, 0)} ({g['optimized_nodes'].get(o, 0)})")
            cells.append(f"{g['kernel_us_per_step'].get(o, 0):.0f}")
        print(f"| {o} | " + " | ".join(cells) + " |")
    print("| total kernel time | " + " | ".join(
        f"{sum(res['graphs'][n]['nodes'].values())} ({sum(res['graphs'][n]['optimized_nodes'].values())}) | "
        f"{res['graphs'][n]['kernel_us_per_step_total']:.0f}" for n in names) + " |")
    for n in names:
        g = res["graphs"][n]
        print(f"{n}: decode p50 {g['decode_ms_p50']:.2f} ms/step (mean {g['decode_ms_mean']:.2f}, "
              f"CPU {g['decode_cpu_ms_per_step']:.2f} ms/step), first greedy tokens {g['greedy_tokens'][:8]}")


def default_prompt(n: int) -> list[int]:
    """A prompt of n tokens from the first request of the standard workload, SmolLM2's tokenizer."""
    from tokenizers import Tokenizer

    from compress.loading.models import resolve_source
    from loadtest.workloads import make_workload

    tok = Tokenizer.from_file(str(Path(resolve_source("embedded", None, ".cache/models")) / "tokenizer.json"))
    text = " ".join(w["prompt"] for w in make_workload(4, seed=0))
    return tok.encode(text).ids[:n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", action="append", required=True, help="NAME=path/to/model.onnx (repeat)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the full result as JSON here")
    a = ap.parse_args(argv)
    graphs = dict(g.split("=", 1) for g in a.graph)
    res = compare(graphs, default_prompt(a.prompt_tokens), a.steps, a.threads, a.rounds)
    res["loadavg"] = os.getloadavg()
    print_table(res)
    print(f"load average {res['loadavg'][0]:.2f} {res['loadavg'][1]:.2f} {res['loadavg'][2]:.2f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
