"""What a user would run instead of the server, on the same requests: the baselines of loadtest/run.py.

- ``hf_sequential``: transformers ``generate``, batch 1, one request after another (greedy).
- ``hf_static``: transformers ``generate`` on left-padded batches of ``batch_size`` requests in
  workload order; every row runs until the batch's longest ``max_tokens`` (static batching's waste).
- ``ort_static``: the artifact's own ONNX graph (layout ``standard``) in a plain left-padded batch
  loop, present fed back as past; ``batch_size=1`` is sequential ORT.
- ``genai``: onnxruntime-genai's generator on a model folder made by its model builder. It needs
  the CPU ``onnxruntime`` wheel, which conflicts with this venv's onnxruntime-gpu, so it runs in
  its own venv (``.cache/genai-venv``) as a subprocess: see ``loadtest/genai_worker.py``.

Every request generates exactly its ``max_tokens`` (EOS ignored, as the workload asks the server),
and only those tokens count: a static batch's extra rows are waste. Latencies are service times:
from the moment the request's batch starts (the baselines have no arrival process).

Each baseline runs in a subprocess of its own (``python -m loadtest.baselines KIND ...``), so
its peak RSS (kernel high-water mark) and CPU time are its own and torch's threads never compete
with the server's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from loadtest.loadgen import BenchResult, RequestRecord, read_peak_rss

_ROOT = Path(__file__).resolve().parent.parent
GENAI_PYTHON = _ROOT / ".cache" / "genai-venv" / "bin" / "python"


class _Clock:
    """Per-row token arrival times of one ``generate`` call (a transformers streamer): the
    first ``put`` is the prompt, each later one a step's new tokens."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _finish(recs: list[RequestRecord], t_start: float, step_times: list[float], n_tokens: list[int]) -> None:
    """Fill TTFT/ITL/e2e of the rows of one batch from its step times (row i stops at n_tokens[i])."""
    for rec, n in zip(recs, n_tokens):
        ts = step_times[:n]
        rec.ttft_s = ts[0] - t_start
        rec.itl_s = [b - a for a, b in zip(ts, ts[1:])]
        rec.e2e_s = ts[-1] - t_start
        rec.completion_tokens = n
        rec.text_chunks = n
        rec.finish_reason = "length"
        rec.ok = True


def _records(workload: list[dict]) -> list[RequestRecord]:
    return [RequestRecord(id=int(q.get("id", i)), kind=str(q.get("kind", "")), max_tokens=int(q["max_tokens"]))
            for i, q in enumerate(workload)]


def _result(label: str, recs: list[RequestRecord], wall: float, cpu: float, batch_size: int, meta: dict) -> BenchResult:
    return BenchResult(label=label, records=recs, samples=[], duration_s=wall, concurrency=batch_size,
                       peak_rss_bytes=read_peak_rss(os.getpid()), server_cpu_s=cpu, meta=meta)


def hf_generate(model_dir: str, workload: list[dict], batch_size: int = 1, threads: int | None = None) -> BenchResult:
    """transformers ``generate`` (greedy) over the workload in batches of ``batch_size`` (1 = sequential)."""
    import torch

    from compress.loading.models import load_teacher
    from compress.loading.special_tokens import special_tokens

    if threads:
        torch.set_num_threads(threads)
    model, tok = load_teacher(model_dir)
    tok.padding_side = "left"
    # The prompts as the server encodes them: BOS first when the model takes one (the decision the
    # artifact's manifest records), the text without the tokenizer's own special tokens.
    st = special_tokens(tok, model)

    def encode(prompts: list[str]) -> dict:
        return tok.pad({"input_ids": [st.encode(tok, p) for p in prompts]}, padding=True, return_tensors="pt")

    recs = _records(workload)
    # Warm-up outside the clock, as the server gets one.
    with torch.inference_mode():
        model.generate(**encode(["Warm-up."]), max_new_tokens=2, min_new_tokens=2, do_sample=False,
                       pad_token_id=tok.pad_token_id)
    t0, c0 = time.perf_counter(), time.process_time()
    for b in range(0, len(workload), batch_size):
        batch = workload[b:b + batch_size]
        enc = encode([q["prompt"] for q in batch])
        want = [int(q["max_tokens"]) for q in batch]
        clock = _Clock()
        t_b = time.perf_counter()
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=max(want), min_new_tokens=max(want), do_sample=False,
                           pad_token_id=tok.pad_token_id, streamer=clock)
        for rec, m in zip(recs[b:b + batch_size], enc["attention_mask"].sum(1).tolist()):
            rec.prompt_tokens = int(m)
            rec.start_s = t_b - t0
        _finish(recs[b:b + batch_size], t_b, clock.times, want)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    label = "hf_sequential" if batch_size == 1 else f"hf_static_b{batch_size}"
    return _result(label, recs, wall, cpu, batch_size, {"model_dir": model_dir, "torch_threads": torch.get_num_threads()})


def ort_static(artifact_dir: str | Path, workload: list[dict], batch_size: int = 1, threads: int = 0) -> BenchResult:
    """The artifact's ONNX graph in a plain left-padded static-batch loop (no block pool, no scheduler)."""
    from tokenizers import Tokenizer

    from serve.engine.tokenizer import encode_prompt
    from serve.runners.onnx_session import artifact_session

    artifact_dir = Path(artifact_dir)
    man = json.loads((artifact_dir / "manifest.json").read_text())
    if man.get("attention_layout", "standard") != "standard":
        raise ValueError(f"{artifact_dir}: ort_static drives the 'standard' layout only "
                         f"(this artifact is {man['attention_layout']!r}); pass a standard-layout artifact")
    sess = artifact_session(artifact_dir, man, threads=threads)
    tok = Tokenizer.from_file(str(artifact_dir / "tokenizer.json"))
    L, H, D = man["num_layers"], man["num_kv_heads"], man["head_dim"]
    pad = int(man.get("pad_token_id") or 0)
    past_names = [n for n in man["io"]["inputs"] if n.startswith("past_key_values.")]
    out_names = ["logits", *[n for n in man["io"]["outputs"] if n.startswith("present.")]]

    def generate(prompts: list[list[int]], steps: int, clock: list[float] | None) -> None:
        B, S = len(prompts), max(len(p) for p in prompts)
        ids = np.full((B, S), pad, np.int64)
        mask = np.zeros((B, S), np.int64)
        for i, p in enumerate(prompts):
            ids[i, S - len(p):], mask[i, S - len(p):] = p, 1
        pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
        # The exported graph returns logits for every prompt position: [B, S, vocab] floats (32 x 650 x
        # 49152 x 4 B = 4 GB for SmolLM2). Prefill in row groups that keep them near 256 MiB; the rows
        # are independent, so this equals one batch-B call. Decode steps then run the whole batch.
        rows = max(1, (256 << 20) // (S * int(man["vocab_size"]) * 4))
        parts = []
        for g in range(0, B, rows):
            empty = [np.zeros((min(rows, B - g), H, 0, D), np.float32) for _ in range(2 * L)]
            parts.append(sess.run(out_names, {"input_ids": ids[g:g + rows], "attention_mask": mask[g:g + rows],
                                              "position_ids": pos[g:g + rows], **dict(zip(past_names, empty))}))
            parts[-1][0] = parts[-1][0][:, -1:]   # keep only the last position's logits
        res = [np.concatenate(xs, 0) for xs in zip(*parts)]
        for step in range(steps):
            if step:
                res = sess.run(out_names, {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                                           **dict(zip(past_names, past))})
            nxt = res[0][:, -1].argmax(-1).astype(np.int64)
            if clock is not None:
                clock.append(time.perf_counter())
            past = res[1:]
            ids = nxt[:, None]
            pos = pos[:, -1:] + 1
            mask = np.concatenate([mask, np.ones((B, 1), np.int64)], 1)

    # The prompts as the server encodes them (BOS first when the manifest says add_bos_token).
    generate([encode_prompt(tok, man, "Warm-up.")], 2, None)
    recs = _records(workload)
    t0, c0 = time.perf_counter(), time.process_time()
    for b in range(0, len(workload), batch_size):
        batch = workload[b:b + batch_size]
        prompts = [encode_prompt(tok, man, q["prompt"]) for q in batch]
        want = [int(q["max_tokens"]) for q in batch]
        clock: list[float] = []
        t_b = time.perf_counter()
        generate(prompts, max(want), clock)
        for rec, p in zip(recs[b:b + batch_size], prompts):
            rec.prompt_tokens, rec.start_s = len(p), t_b - t0
        _finish(recs[b:b + batch_size], t_b, clock, want)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    label = "ort_sequential" if batch_size == 1 else f"ort_static_b{batch_size}"
    return _result(label, recs, wall, cpu, batch_size, {"artifact": str(artifact_dir)})


def genai_available() -> str | None:
    """None when onnxruntime-genai runs in its venv, else why not."""
    if not GENAI_PYTHON.exists():
        return (f"no {GENAI_PYTHON}: python -m venv .cache/genai-venv && .cache/genai-venv/bin/pip install "
                "onnxruntime-genai (its onnxruntime conflicts with onnxruntime-gpu in .venv)")
    r = subprocess.run([str(GENAI_PYTHON), "-c", "import onnxruntime_genai"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"onnxruntime_genai does not import: {r.stderr.strip()[-300:]}"


def run_isolated(kind: str, workload: list[dict], *, model_dir: str | None = None, artifact: str | None = None,
                 genai_model: str | None = None, batch_size: int = 1, threads: int = 0,
                 timeout_s: float = 3600) -> BenchResult:
    """One baseline in a fresh subprocess (its own RSS and CPU); returns its BenchResult."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-baseline-") as tmp:
        wl, out = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        wl.write_text(json.dumps(workload))
        if kind == "genai":
            why = genai_available()
            if why:
                raise RuntimeError(why)
            cmd = [str(GENAI_PYTHON), str(Path(__file__).with_name("genai_worker.py")), "--model", str(genai_model),
                   "--workload", str(wl), "--out", str(out), "--batch-size", str(batch_size),
                   "--threads", str(threads)]
        else:
            cmd = [sys.executable, "-m", "loadtest.baselines", kind, "--workload", str(wl), "--out", str(out),
                   "--batch-size", str(batch_size), "--threads", str(threads)]
            cmd += ["--model-dir", str(model_dir)] if kind.startswith("hf") else ["--artifact", str(artifact)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])),
               "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        r = subprocess.run(cmd, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            raise RuntimeError(f"baseline {kind} failed (status {r.returncode}):\n{(r.stderr or r.stdout)[-2000:]}")
        return result_from_json(json.loads(out.read_text()))


def result_to_json(res: BenchResult) -> dict:
    from dataclasses import asdict

    return {"label": res.label, "duration_s": res.duration_s, "concurrency": res.concurrency,
            "peak_rss_bytes": res.peak_rss_bytes, "server_cpu_s": res.server_cpu_s, "meta": res.meta,
            "records": [asdict(r) for r in res.records]}


def result_from_json(d: dict) -> BenchResult:
    return BenchResult(label=d["label"], records=[RequestRecord(**r) for r in d["records"]], samples=[],
                       duration_s=d["duration_s"], concurrency=d["concurrency"], peak_rss_bytes=d["peak_rss_bytes"],
                       server_cpu_s=d["server_cpu_s"], meta=d.get("meta", {}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.baselines", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=["hf", "ort"])
    p.add_argument("--workload", required=True, help="JSON list of requests (loadtest.workloads)")
    p.add_argument("--out", required=True, help="where to write the result JSON")
    p.add_argument("--model-dir", help="hf: a HF model folder or 'embedded'")
    p.add_argument("--artifact", help="ort: an artifact folder (layout standard)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="0 = the runtime's default")
    a = p.parse_args(argv)
    workload = json.loads(Path(a.workload).read_text())
    if a.kind == "hf":
        res = hf_generate(a.model_dir or "embedded", workload, a.batch_size, a.threads or None)
    else:
        if not a.artifact:
            p.error("ort needs --artifact")
        res = ort_static(a.artifact, workload, a.batch_size, a.threads)
    Path(a.out).write_text(json.dumps(result_to_json(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
