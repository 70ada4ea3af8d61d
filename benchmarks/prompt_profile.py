"""One batched first-prompt call of gqa artifacts, timed and split by op type: where a wave's prompt phase goes.

    python -m benchmarks.prompt_profile --artifact champion=<dir> --artifact f32kv=<dir> --prompts 16 --threads 1

The call is the one serve/runners/gqa.py makes for a wave of new requests (``_run_first_prompts``): the sweep's chat
prompts (benchmarks/sweep.py) in the artifact's own template, sorted by length, right-padded to the longest,
``seqlens_k`` = each length - 1, ``total_sequence_length`` = the padded length, the last positions' logits only,
K/V bound in place as past and present. At 32 users the server runs two such calls of 16 at once, one thread
each, so ``--prompts 16 --threads 1`` is one of them. Artifacts alternate run by run, so load hits them alike.
Prints the CPU flags, the median ms per call and, with ``--profile``, ORT's kernel time per op type per call
(the warm-up call left out).
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

from benchmarks.burst import cpu_flags
from benchmarks.sweep import chats


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prompt_profile", description=__doc__.split("\n")[0])
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


if __name__ == "__main__":
    raise SystemExit(main())
