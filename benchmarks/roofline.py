"""A roofline for this machine: memory read bandwidth and INT8 GEMM throughput from small ONNX Runtime
microbenchmarks, and an artifact's decode step at batch 1/8/32 placed against both.

    python -m benchmarks.roofline --artifact <INT8 gqa artifact> [--batches 1 8 32] [--threads 0] [--prompt-tokens 96]

- Read bandwidth: ``ReduceSum`` over a 256 MiB float32 tensor (reads it once, writes 4 bytes), the way a
  decode step reads its weights; best of 5.
- INT8 GEMM: ``MatMulInteger`` (uint8 activations x int8 weights -> int32; the W8A8 forms' kernel) and 8-bit
  ``MatMulNBits`` (block 32, accuracy_level 4; the weight-only form's) at M = 1, 8, 32, 256 with
  K = N = 2048: ops/s = 2·M·K·N / t. fp32 ``MatMul`` beside it.
- Decode step: the engine in manual mode with B requests decoding together; the time inside ``session.run``
  per step, and the whole step (scheduling, runner inputs, sampling, detokenizing).
- Floor and roof for one step: the bytes a step must read / read bandwidth, and 2 · weight parameters · B /
  INT8 ops/s at the matching M. A step reads every weight once, whatever B, and each row's K/V for its whole
  context (B x context x the KV bytes per token: fp32 K and V of every layer); the prompts are
  ``--prompt-tokens`` long, so the context is about that plus the 15 steps before the middle of the timed ones.
  The fraction of each reached is floor / step and roof / step; what is left is the rest of the graph (norms,
  attention's compute, dynamic quantization) and the host.

Prints the CPU flags and the load average: on a shared machine read the figures with the load.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from benchmarks.burst import cpu_flags

MATMUL_OPS = {"MatMul", "MatMulInteger", "MatMulIntegerToFloat", "QLinearMatMul", "MatMulNBits", "Gemm",
              "DynamicQuantizeMatMul"}


def _session(model: onnx.ModelProto, threads: int):
    from serve.runners.onnx_session import make_session

    return make_session(model, threads=threads)


def _best(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def read_bandwidth(threads: int, mib: int = 256) -> float:
    """Bytes per second ReduceSum reads."""
    n = mib * 2**20 // 4
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    g = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=1)], "bw", [x], [y])
    sess = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), threads)
    data = np.random.default_rng(0).random(n, dtype=np.float32)
    t = _best(lambda: sess.run(None, {"x": data}))
    return n * 4 / t


def gemm_ops(threads: int, m: int, k: int = 2048, n: int = 2048) -> tuple[float, float]:
    """(INT8 MatMulInteger ops/s, fp32 MatMul ops/s) at [m, k] x [k, n]."""
    rng = np.random.default_rng(0)
    w8 = helper.make_tensor("w", TensorProto.INT8, [k, n], rng.integers(-127, 128, size=(k, n), dtype=np.int8).tobytes(),
                            raw=True)
    a = helper.make_tensor_value_info("a", TensorProto.UINT8, [m, k])
    y = helper.make_tensor_value_info("y", TensorProto.INT32, [m, n])
    g = helper.make_graph([helper.make_node("MatMulInteger", ["a", "w"], ["y"])], "i8", [a], [y], [w8])
    s8 = _session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), threads)
    a8 = rng.integers(0, 256, size=(m, k), dtype=np.uint8)
    t8 = _best(lambda: s8.run(None, {"a": a8}), reps=20)
    wf = helper.make_tensor("w", TensorProto.FLOAT, [k, n], rng.random((k, n), dtype=np.float32).tobytes(), raw=True)
    af = helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])
    yf = helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])
    gf = helper.make_graph([helper.make_node("MatMul", ["a", "w"], ["y"])], "f32", [af], [yf], [wf])
    sf = _session(helper.make_model(gf, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), threads)
    a32 = rng.random((m, k), dtype=np.float32)
    tf = _best(lambda: sf.run(None, {"a": a32}), reps=20)
    return 2 * m * k * n / t8, 2 * m * k * n / tf


def nbits_ops(threads: int, m: int, k: int = 2048, n: int = 2048) -> float:
    """Weight-only 8-bit MatMulNBits (block 32, accuracy_level 4: int8 activations per block inside the kernel, the
    artifacts' form) ops/s at [m, k] x [k, n]: the kernel a weight-only artifact runs at a batch of m rows."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    rng = np.random.default_rng(0)
    wf = helper.make_tensor("w", TensorProto.FLOAT, [k, n], (rng.random((k, n), dtype=np.float32) - 0.5).tobytes(),
                            raw=True)
    af = helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])
    yf = helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])
    g = helper.make_graph([helper.make_node("MatMul", ["a", "w"], ["y"])], "f32", [af], [yf], [wf])
    q = MatMulNBitsQuantizer(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9),
                             algo_config=DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True,
                                                                      accuracy_level=4, bits=8))
    q.process()
    s = _session(q.model.model, threads)
    a32 = rng.random((m, k), dtype=np.float32)
    return 2 * m * k * n / _best(lambda: s.run(None, {"a": a32}), reps=20)


def weight_figures(artifact: Path) -> tuple[int, int]:
    """(bytes a decode step reads: initializers of matmul-like nodes and everything but gather tables,
    parameters those matmuls multiply) of the artifact's graph."""
    m = onnx.load(str(artifact / "model.onnx"), load_external_data=True)
    inits = {i.name: i for i in m.graph.initializer}
    users: dict[str, set[str]] = {}
    for node in m.graph.node:
        for name in node.input:
            if name in inits:
                users.setdefault(name, set()).add(node.op_type)
    read = params = 0
    for name, init in inits.items():
        ops = users.get(name, set())
        nbytes = len(init.raw_data) if init.raw_data else onnx.numpy_helper.to_array(init).nbytes
        if ops and ops <= {"Gather", "GatherBlockQuantized"}:
            continue  # an embedding table: a step reads B rows of it
        read += nbytes
        if ops & MATMUL_OPS and len(init.dims) >= 2:
            count = int(np.prod(init.dims))
            # MatMulNBits packs 8-bit weights as [N, blocks, block_bytes]: one byte per parameter at 8 bits
            params += count
    return read, params


def decode_step(artifact: Path, batch: int, threads: int, steps: int = 24, prompt_tokens: int = 96) -> tuple[float, float]:
    """(seconds inside session.run per decode step, seconds per whole step) with ``batch`` rows decoding, each
    after a prompt of ``prompt_tokens``."""
    from serve.config import ServeConfig
    from serve.engine.engine import Engine
    from serve.engine.sampling import SamplingParams
    from serve.runners.onnx_session import CPU

    cfg = ServeConfig(providers=[CPU], max_batch_size=batch, max_num_batched_tokens=max(256, batch * prompt_tokens),
                      kv_memory_mb=1024, intra_op_threads=threads, enable_prefix_caching=False,
                      verify_artifact=False)
    eng = Engine(artifact, cfg, start=False)
    rng = np.random.default_rng(0)
    for _ in range(batch):
        eng.add_request(rng.integers(100, 40000, size=prompt_tokens).tolist(),
                        SamplingParams.greedy(steps + 40, ignore_eos=True))
    while any(s.num_uncomputed > 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # prefill until every row decodes
    for _ in range(3):
        eng.step()
    r = eng.runner
    run0, t0 = r.run_seconds, time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = (time.perf_counter() - t0) / steps
    run = (r.run_seconds - run0) / steps
    eng.shutdown()
    return run, wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.roofline", description=__doc__.split("\n")[0])
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: onnxruntime's default)")
    p.add_argument("--prompt-tokens", type=int, default=96, help="each row's prompt: the K/V context it decodes over")
    a = p.parse_args(argv)
    print(f"CPU flags: {cpu_flags()}; cores {os.cpu_count()}; load average {os.getloadavg()[0]:.1f}")
    bw = read_bandwidth(a.threads)
    print(f"read bandwidth (ReduceSum over 256 MiB): {bw / 1e9:.1f} GB/s")
    int8 = {}
    for m in sorted({1, 8, 32, 256, *a.batches}):
        i8, f32 = gemm_ops(a.threads, m)
        int8[m] = i8
        nb = nbits_ops(a.threads, m)
        print(f"GEMM M={m:<3} K=N=2048: INT8 MatMulInteger {i8 / 1e9:7.1f} GOPS   8-bit MatMulNBits {nb / 1e9:7.1f} GOPS"
              f"   fp32 MatMul {f32 / 1e9:7.1f} GFLOPS")
    read, params = weight_figures(a.artifact)
    from serve.artifact import read_manifest
    from serve.kv.budget import KVCacheSpec

    kv_token = KVCacheSpec.from_manifest(read_manifest(a.artifact, verify=False)).bytes_per_token
    context = a.prompt_tokens + 3 + 12  # the prompt, the warm-up steps, half the timed ones
    print(f"{a.artifact}: a decode step reads {read / 2**20:.1f} MiB of weights and {kv_token / 1024:.1f} KiB of K/V per "
          f"row and position (context ~{context}); {params / 1e6:.1f} M matmul parameters")
    print(f"{'batch':>5} {'graph ms':>9} {'step ms':>8} {'K/V MiB':>8} {'floor ms':>9} {'roof ms':>8} {'of floor':>9}"
          f" {'of roof':>8} {'tok/s':>7}")
    for b in a.batches:
        run, wall = decode_step(a.artifact, b, a.threads, prompt_tokens=a.prompt_tokens)
        kv_read = b * context * kv_token
        floor = (read + kv_read) / bw
        roof = 2 * params * b / int8[b]
        print(f"{b:>5} {run * 1e3:9.2f} {wall * 1e3:8.2f} {kv_read / 2**20:8.1f} {floor * 1e3:9.2f} {roof * 1e3:8.2f} "
              f"{floor / run:9.0%} {roof / run:8.0%} {b / wall:7.0f}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
