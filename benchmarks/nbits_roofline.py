"""This CPU's roofline for the decode of a quantized graph: a stack of ``MatMulNBits`` alone (Qwen2.5-1.5B's MLP shapes,
1536 x 8960 and back, random codes), at several bit widths, block sizes and numbers of rows, in GB/s of weights read
and G multiply-adds a second.

    python -m benchmarks.nbits_roofline [--layers 48] [--rows 1 8 40] [--forms 4:32 4:64 8:32] [--threads 2]
        [--out benchmarks/results/nbits_roofline.json]

One row is one user's decode step: bound by reading the weights (GB/s). From 8 rows up a step is bound by the int8
arithmetic of ``accuracy_level`` 4 (GMAC/s), which is also what a prompt costs. 48 layers hold ~420 MB at 4 bits,
beyond the caches, so the figures are memory's, not the L3's. docs/quantization.md#4-bit-weights reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from benchmarks.burst import cpu_flags

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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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


if __name__ == "__main__":
    main()
