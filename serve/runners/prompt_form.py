"""A prompt-time form of a 4-bit graph: the same graph, its attention and gate/up linears as W8A8 instead of 4-bit.

A prompt's rows are bound by arithmetic. ONNX Runtime's 4-bit kernel (``MatMulNBits``, int8 compute at
``accuracy_level`` 4, blocks of 32) multiplies Qwen2.5-1.5B's shapes at ~135 G multiply-adds a second on 2 cores
with AVX-512 VNNI; ``DynamicQuantizeMatMul`` (int8 weights per output channel, the activations quantized per call)
at ~350, 2.5x. One user's decode reads the weights instead, and there the 4-bit form is the fastest. So the server
may run prompt rows on this form and decode on the 4-bit one, the two sessions sharing the K/V rows
(serve/runners/gqa.py); the prompt's K/V and first logits then come from this form.

The int8 weights are the 4-bit graph's own, dequantized and rounded per output channel, so the form is a function of
the served graph: the server builds it on first use and keeps it in a cache folder named by the graph's hash, so a
restart or a replica reuses it and a new champion gets its own. ``down_proj`` (whose inputs carry the activation
outliers that per-call quantization loses to) and the lm_head (once per prompt) stay 4- and 8-bit. The cost is a
second session holding the converted linears in int8 beside the rest: on Qwen2.5-Coder-1.5B 0.9 GB of int8 weights.
docs/serving.md, "Prefill".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from serve.artifact import graph_files
from serve.kv.budget import available_bytes
from serve.runners.nbits import unpack_nbits

log = logging.getLogger(__name__)

KEEP = ("down_proj", "lm_head")  # linears that stay in the served form (see the module docstring)
GRAPH = "prompt_model.onnx"


def convertible(model) -> list:
    """The graph's MatMulNBits nodes that the prompt form converts (without a bias input, outside ``KEEP``)."""
    return [n for n in model.graph.node if n.op_type == "MatMulNBits" and n.name and not any(k in n.name for k in KEEP)
            and not (len(n.input) > 5 and n.input[5])]


def write_prompt_form(artifact_dir: str | Path, dst: str | Path) -> dict:
    """Write ``dst/prompt_model.onnx`` (+ its data file) from the artifact's graph; returns what it wrote:
    ``{"nodes": converted, "int8_bytes": the new weights' bytes, "graph": path}``. Raises ValueError when the graph
    has no weight-only linears to convert (an fp32 or W8A8 artifact: its prompts already run on its own form). An
    8-bit weight-only graph converts too: its MatMulNBits are also slower at many rows than W8A8 (153-205 against
    348 G multiply-adds a second on Qwen2.5-1.5B's shapes here)."""
    import onnx
    from onnx import helper, numpy_helper

    artifact_dir, dst = Path(artifact_dir), Path(dst)
    manifest = json.loads((artifact_dir / "manifest.json").read_text())
    model = onnx.load(str(artifact_dir / manifest.get("onnx_file", "model.onnx")))
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    targets = {n.name for n in convertible(model)}  # (node names: protobuf wrappers are made afresh per access)
    if not targets:
        raise ValueError(f"{artifact_dir}: no weight-only (MatMulNBits) linears to convert; serve.prompt_form is for "
                         f"4- and 8-bit weight-only artifacts, set it to off for this one")
    nodes, new, int8_bytes = [], [], 0
    for n in g.node:
        if n.name not in targets:
            nodes.append(n)
            continue
        w = unpack_nbits(n, inits)  # [K, N] float, the served weights
        scale = np.abs(w).max(axis=0) / 127.0
        scale[scale == 0] = 1.0
        q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
        base = n.name.strip("/").replace("/", "_") or n.output[0]
        new += [numpy_helper.from_array(q, f"{base}_w8"), numpy_helper.from_array(scale.astype(np.float32), f"{base}_s8")]
        int8_bytes += q.nbytes
        nodes.append(helper.make_node("DynamicQuantizeMatMul", [n.input[0], f"{base}_w8", f"{base}_s8"],
                                      list(n.output), name=f"{n.name}_w8a8", domain="com.microsoft"))
    g.ClearField("node")
    g.node.extend(nodes)
    g.initializer.extend(new)
    used = {i for n in nodes for i in n.input}
    for i in reversed(range(len(g.initializer))):
        if g.initializer[i].name not in used:
            del g.initializer[i]
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / f".{GRAPH}.partial"
    onnx.save(model, str(tmp), save_as_external_data=True, location=f"{GRAPH}.data", all_tensors_to_one_file=True)
    tmp.replace(dst / GRAPH)  # the data file first, the graph last: a graph present means a whole form
    return {"nodes": len(targets), "int8_bytes": int8_bytes, "graph": str(dst / GRAPH)}


# A prompt call of at least this many rows runs on the prompt form: below it a call reads the weights more than it
# multiplies them, and the 4-bit form is the faster (Qwen2.5-Coder-1.5B, 2 cores: even at ~8 rows, 1.8x at 512).
MIN_ROWS = 16


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm-compressor" / "prompt_forms"


def graph_key(artifact_dir: Path, manifest: dict) -> str:
    """The served graph's identity: its files' hashes from the manifest where it lists them, else its sizes and
    modification times."""
    parts = [f"{n}:{manifest['files'][n]['sha256']}" for n in graph_files(manifest)]
    if not parts:
        graph = manifest.get("onnx_file", "model.onnx")
        parts = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sorted(artifact_dir.glob(graph + "*"))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


FORM_OVER_GRAPH = 1.3  # Qwen2.5-Coder-1.5B: 1.59 GB of prompt form for a 1.27 GB graph


def graph_size(artifact_dir: Path, manifest: dict) -> int:
    """Bytes of the served graph's files on disk."""
    graph = manifest.get("onnx_file", "model.onnx")
    return sum(p.stat().st_size for p in artifact_dir.glob(graph + "*"))


def prompt_graph(artifact_dir: str | Path, manifest: dict, root: Path | None = None) -> Path:
    """The prompt form's graph for this artifact, written first if the cache has none; ValueError (naming the
    setting) for an int8 K/V cache or when this machine's available memory cannot hold the form's session."""
    artifact_dir = Path(artifact_dir)
    if manifest.get("kv_dtype") not in (None, "float32", "float16"):
        raise ValueError(f"serve.prompt_form: this artifact's K/V cache is {manifest.get('kv_dtype')} with scales "
                         f"calibrated on its own form; the prompt form needs a float cache (set serve.prompt_form: off)")
    folder = (root or cache_root()) / graph_key(artifact_dir, manifest)
    data = folder / f"{GRAPH}.data"
    # a second session holds the form's weights: about 1.25x the served graph's bytes (int8 where it held 4 bits)
    need = data.stat().st_size if data.is_file() else int(FORM_OVER_GRAPH * graph_size(artifact_dir, manifest))
    have = available_bytes()
    if need > have:
        raise ValueError(f"serve.prompt_form: the prompt form's session needs ~{need / 2**30:.2f} GiB more memory and "
                         f"this machine has {have / 2**30:.2f} GiB available; set serve.prompt_form: off")
    if not (folder / GRAPH).is_file():
        t = time.perf_counter()
        wrote = write_prompt_form(artifact_dir, folder)
        log.info("prompt form: %d linears as W8A8 (%.2f GiB of int8 weights) in %.1f s, %s", wrote["nodes"],
                 wrote["int8_bytes"] / 2**30, time.perf_counter() - t, folder)
    return folder / GRAPH
