"""Calibration for INT8: find the linear MatMuls of an exported decoder and collect activation statistics.

Why not ORT's own calibrators: they add every float tensor of the calibrated op
types as a graph output (the 60 attention MatMuls, the logits, the KV outputs)
and the histogram ones keep every batch's outputs until the end, which is what
blows the memory on a real LLM. Here the calibration graph is the decoder cut
down to exactly the activations that feed the MatMuls we quantize (no lm_head,
no present.* outputs), fed prefill blocks with an empty past, and statistics are
reduced batch by batch (per-channel min/max, then a fixed-range histogram), so
memory does not grow with the number of calibration blocks.
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnxruntime.quantization import CalibrationDataReader

from serve.runners.onnx_session import CPU, make_session

HIST_BINS = 2048

# ORT linear roles grouped the way they share an input inside one decoder layer.
_ROLE_GROUP = {
    "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
    "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down",
    # packed by compress/export/graph_fusion.py (the gqa graph's q/k/v is one MatMul)
    "qkv_proj": "qkv", "gate_up_proj": "gate_up",
}


@dataclass(frozen=True)
class Linear:
    """One nn.Linear of the source model as it appears in the ONNX graph: MatMul(activation, W[K, N])."""

    node: str  # ONNX node name
    module: str  # torch module path when the exporter recorded it, e.g. model.layers.3.mlp.down_proj
    role: str  # q_proj ... down_proj, or "linear" when unknown
    layer: int | None
    input: str  # activation tensor feeding the MatMul
    weight: str  # float initializer [K, N]

    @property
    def group(self) -> str:
        """The unit of the sensitivity scan: the linears of one layer that share an input (qkv, gate_up) or stand alone."""
        g = _ROLE_GROUP.get(self.role, self.role)
        return f"layers.{self.layer}.{g}" if self.layer is not None else f"{g}:{self.input}"


def _module_of(node: onnx.NodeProto) -> str:
    meta = {p.key: p.value for p in node.metadata_props}
    scopes = meta.get("pkg.torch.onnx.name_scopes")
    if scopes:
        try:
            parts = ast.literal_eval(scopes)
            if len(parts) >= 2 and parts[-2]:
                # the export wrapper adds one leading "model." to every module path
                return re.sub(r"^model\.", "", parts[-2])
        except (ValueError, SyntaxError):
            pass
    return ""


def find_linears(model: onnx.ModelProto) -> list[Linear]:
    """Every MatMul whose B is a 2-D float initializer, in graph order.

    The attention MatMuls (activation x activation) and a tied lm_head (B is a
    Transpose of the embedding) are not linears by this test, so they are never
    quantized to W8A8 by construction.
    """
    inits = {i.name: i for i in model.graph.initializer}
    out = []
    for idx, n in enumerate(model.graph.node):
        if n.op_type != "MatMul" or len(n.input) != 2:
            continue
        w = inits.get(n.input[1])
        if w is None or len(w.dims) != 2 or w.data_type != TensorProto.FLOAT:
            continue
        module = _module_of(n)
        role = module.rsplit(".", 1)[-1] if module else "linear"
        if role not in _ROLE_GROUP:
            role = role if module else "linear"
        m = re.search(r"layers\.(\d+)\.", module)
        layer = int(m.group(1)) if m else None
        out.append(Linear(n.name or f"MatMul_{idx}", module or (n.name or f"MatMul_{idx}"), role, layer, n.input[0], n.input[1]))
    return out


def calibration_model(model: onnx.ModelProto, tensors: list[str]) -> onnx.ModelProto:
    """The decoder pruned to the nodes that compute `tensors`, which become its only outputs."""
    g = model.graph
    producer = {}
    for i, n in enumerate(g.node):
        for o in n.output:
            producer[o] = i
    keep: set[int] = set()
    seen: set[str] = set()
    stack = list(tensors)
    while stack:
        t = stack.pop()
        if t in seen or not t:
            continue
        seen.add(t)
        i = producer.get(t)
        if i is not None and i not in keep:
            keep.add(i)
            stack.extend(g.node[i].input)
    nodes = [g.node[i] for i in sorted(keep)]
    inits = [x for x in g.initializer if x.name in seen]
    inputs = [x for x in g.input if x.name in seen]
    outputs = [helper.make_tensor_value_info(t, TensorProto.FLOAT, None) for t in tensors]
    graph = helper.make_graph(nodes, g.name + "_calib", inputs, outputs, initializer=inits)
    m = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    return m


class PrefillReader(CalibrationDataReader):
    """Feeds token blocks as batched prefill with an empty KV cache (past = 0).

    Only inputs the (pruned) graph declares are fed. Every block handed out is
    hashed into `sha256`, so callers can prove which data calibrated a model.
    """

    def __init__(self, blocks: np.ndarray, input_names: list[str], num_kv_heads: int, head_dim: int, batch_size: int = 4):
        blocks = np.asarray(blocks)
        if blocks.ndim != 2 or blocks.shape[0] == 0:
            raise ValueError(f"calibration blocks must be a non-empty [n, block_size] int array, got shape {blocks.shape}")
        self.blocks = blocks.astype(np.int64)
        self.names = list(input_names)
        self.kv = (num_kv_heads, head_dim)
        self.batch_size = max(1, int(batch_size))
        self._pos = 0
        self._hash = hashlib.sha256()
        self.blocks_fed = 0

    def __len__(self) -> int:
        return -(-len(self.blocks) // self.batch_size)

    def rewind(self) -> None:
        self._pos = 0

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def get_next(self) -> dict | None:
        if self._pos >= len(self.blocks):
            return None
        x = self.blocks[self._pos : self._pos + self.batch_size]
        self._pos += len(x)
        self._hash.update(np.ascontiguousarray(x).tobytes())
        self.blocks_fed += len(x)
        return prefill_feed(x, self.names, *self.kv)


def prefill_feed(ids: np.ndarray, names: list[str], num_kv_heads: int, head_dim: int) -> dict[str, np.ndarray]:
    b, s = ids.shape
    feed: dict[str, np.ndarray] = {}
    for n in names:
        if n == "input_ids":
            feed[n] = ids.astype(np.int64)
        elif n == "attention_mask":
            feed[n] = np.ones((b, s), np.int64)
        elif n == "position_ids":
            feed[n] = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy()
        elif n.startswith("past_key_values."):
            feed[n] = np.zeros((b, num_kv_heads, 0, head_dim), np.float32)
        elif n == "seqlens_k":  # attention layout 'gqa' (compress/export/gqa.py): every row s tokens long
            feed[n] = np.full(b, s - 1, np.int32)
        elif n == "total_sequence_length":
            feed[n] = np.array(s, np.int32)
        elif n == "logits_to_keep":  # gqa: 0 = logits at every position
            feed[n] = np.zeros(1, np.int64)
        else:
            raise ValueError(f"calibration: the graph input {n!r} is not part of the decoder contract")
    return feed


@dataclass
class ActStats:
    """Running statistics of one activation tensor over the calibration blocks."""

    cmin: np.ndarray  # per input channel (last axis)
    cmax: np.ndarray
    hist: np.ndarray | None = None
    lo: float = 0.0  # histogram range, set before the histogram pass
    hi: float = 0.0
    inv_scale: np.ndarray | None = None  # SmoothQuant divides the channel by s; histograms see x / s
    sample: np.ndarray | None = None  # a few hundred rows (tokens) spread over the calibration data, for alpha search

    @property
    def absmax(self) -> np.ndarray:
        return np.maximum(np.abs(self.cmin), np.abs(self.cmax))

    def range_after(self, inv_scale: np.ndarray | None = None) -> tuple[float, float]:
        lo, hi = self.cmin, self.cmax
        if inv_scale is not None:
            lo, hi = lo * inv_scale, hi * inv_scale
        return float(min(lo.min(), 0.0)), float(max(hi.max(), 0.0))


@dataclass
class CalibrationResult:
    stats: dict[str, ActStats]
    blocks: int
    sha256: str
    seconds: float = 0.0
    passes: int = 1
    extra: dict = field(default_factory=dict)


def _copied(first_pass: dict[str, ActStats], tensors: list[str]) -> dict[str, ActStats]:
    """Pass-1 statistics of ``tensors`` from a calibration cache, as fresh objects to update."""
    return {t: ActStats(first_pass[t].cmin.copy(), first_pass[t].cmax.copy(), sample=first_pass[t].sample)
            for t in tensors}


def _min_max_pass(sess, reader, tensors: list[str], stats: dict[str, ActStats], stride: int) -> None:
    """Pass 1 over the reader's batches: per-channel min/max into ``stats``, and every ``stride``-th token row kept
    (0: none), strided across batches."""
    row0 = 0  # global index of the batch's first row
    for feed in reader:
        outs = sess.run(tensors, feed)
        for t, x in zip(tensors, outs):
            x2 = x.reshape(-1, x.shape[-1])
            mn, mx = x2.min(0), x2.max(0)
            st = stats.get(t)
            if st is None:
                st = stats[t] = ActStats(mn, mx)
            else:
                np.minimum(st.cmin, mn, out=st.cmin)
                np.maximum(st.cmax, mx, out=st.cmax)
            if stride:
                rows = x2[(-row0) % stride :: stride].astype(np.float32)
                st.sample = rows.copy() if st.sample is None else np.concatenate([st.sample, rows])
        row0 += outs[0].reshape(-1, outs[0].shape[-1]).shape[0] if outs else 0
        del outs


def _histogram_pass(sess, reader, tensors: list[str], stats: dict[str, ActStats]) -> None:
    """Pass 2: each tensor's HIST_BINS histogram of x * inv_scale over [lo, hi] into ``stats``."""
    for feed in reader:
        outs = sess.run(tensors, feed)
        for t, x in zip(tensors, outs):
            st = stats[t]
            v = x.reshape(-1, x.shape[-1])
            if st.inv_scale is not None:
                v = v * st.inv_scale
            h, _ = np.histogram(v, bins=HIST_BINS, range=(st.lo, st.hi))
            st.hist += h
        del outs


def collect_stats(
    model: onnx.ModelProto,
    tensors: list[str],
    blocks: np.ndarray,
    num_kv_heads: int,
    head_dim: int,
    *, histogram: bool = False,
    inv_scales: Callable[[dict[str, ActStats]], dict[str, np.ndarray]] | None = None,
    batch_size: int = 4,
    threads: int | None = None,
    first_pass: dict[str, ActStats] | None = None,
    sample_rows: int = 0,
) -> CalibrationResult:
    """Run the pruned graph over `blocks` and reduce each tensor batch by batch.

    Pass 1: per-channel min/max. Pass 2 (histogram=True): a HIST_BINS histogram
    of x * inv_scale over the range known from pass 1, for entropy/percentile.
    `inv_scales(stats)` lets SmoothQuant set the per-channel 1/s between passes.
    first_pass: pass-1 statistics of these same blocks from an earlier run (a calibration cache); pass 1 is skipped.
    sample_rows: keep about this many token rows of every tensor, evenly strided over all blocks.
    """
    import time

    t0 = time.perf_counter()
    blocks = np.asarray(blocks)
    stride = max(1, blocks.size // sample_rows) if sample_rows else 0
    if first_pass is not None and not histogram:
        fp = _copied(first_pass, tensors)
        sha = hashlib.sha256(np.ascontiguousarray(np.asarray(blocks, np.int64)).tobytes()).hexdigest()
        return CalibrationResult(fp, len(blocks), sha, time.perf_counter() - t0, 0)
    calib = calibration_model(model, tensors)
    # A small graph goes to ORT as bytes; a large one (weights over protobuf's 2 GB, or a lazily loaded graph
    # whose weights are still in the artifact's data file) through a file beside its data (make_session).
    sess = make_session(calib, (CPU,), threads, log_severity=3)
    names = [i.name for i in sess.get_inputs()]
    reader = PrefillReader(blocks, names, num_kv_heads, head_dim, batch_size)
    stats: dict[str, ActStats] = {}
    if first_pass is not None:
        stats = _copied(first_pass, tensors)
        reader._hash.update(np.ascontiguousarray(reader.blocks).tobytes())
        reader.blocks_fed = len(reader.blocks)
        reader._pos = len(reader.blocks)
    _min_max_pass(sess, reader, tensors, stats, stride)
    sha, fed = reader.sha256, reader.blocks_fed
    passes = 1 if first_pass is None else 0
    if histogram:
        scales = inv_scales(stats) if inv_scales else {}
        for t, st in stats.items():
            st.inv_scale = scales.get(t)
            st.lo, st.hi = st.range_after(st.inv_scale)
            st.hist = np.zeros(HIST_BINS, np.int64)
        reader.rewind()
        _histogram_pass(sess, reader, tensors, stats)
        passes += 1
    return CalibrationResult(stats, fed, sha, time.perf_counter() - t0, passes)


def percentile_range(st: ActStats, percentile: float) -> tuple[float, float]:
    """Clip both tails so that `percentile` % of the calibration values stay inside the range."""
    if st.hist is None:
        raise ValueError("percentile calibration needs the histogram pass")
    cdf = np.cumsum(st.hist) / max(int(st.hist.sum()), 1)
    tail = (100.0 - percentile) / 200.0
    edges = np.linspace(st.lo, st.hi, HIST_BINS + 1)
    lo_i = int(np.searchsorted(cdf, tail, side="left"))
    hi_i = int(np.searchsorted(cdf, 1.0 - tail, side="left"))
    lo, hi = float(edges[lo_i]), float(edges[min(hi_i + 1, HIST_BINS)])
    return min(lo, 0.0), max(hi, 0.0)


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    m = p > 0
    return float(np.sum(p[m] * np.log(p[m] / np.maximum(q[m], 1e-12))))


def entropy_range(st: ActStats, num_quantized_bins: int = 128) -> tuple[float, float]:
    """TensorRT-style KL calibration on |x|: the clipping threshold whose 128-level version is closest to the data.

    ORT's entropy calibrator ignores num_bins (one threshold tried, see docs/facts.md);
    this one scans thresholds over the whole |x| histogram.
    """
    if st.hist is None:
        raise ValueError("entropy calibration needs the histogram pass")
    edges = np.linspace(st.lo, st.hi, HIST_BINS + 1)
    centers = (edges[:-1] + edges[1:]) / 2
    amax = max(abs(st.lo), abs(st.hi))
    nb = HIST_BINS // 2
    abs_hist, _ = np.histogram(np.abs(centers), bins=nb, range=(0, amax), weights=st.hist.astype(np.float64))
    best_t, best_kl = amax, np.inf
    step = max(1, (nb - num_quantized_bins) // 96)
    for i in range(num_quantized_bins, nb + 1, step):
        p = abs_hist[:i].copy()
        p[-1] += abs_hist[i:].sum()
        if p.sum() == 0:
            continue
        # merge i bins into num_quantized_bins and spread each back over its non-empty source bins
        idx = (np.arange(i) * num_quantized_bins) // i
        nz = (abs_hist[:i] > 0).astype(np.float64)
        qsum = np.bincount(idx, weights=abs_hist[:i], minlength=num_quantized_bins)
        qcnt = np.bincount(idx, weights=nz, minlength=num_quantized_bins)
        q = np.where(nz > 0, qsum[idx] / np.maximum(qcnt[idx], 1), 0.0)
        kl = _kl(p / p.sum(), q / max(q.sum(), 1e-12))
        if kl < best_kl:
            best_kl, best_t = kl, (i / nb) * amax
    return max(st.lo, -best_t), min(st.hi, best_t)


def save_first_pass(path, stats: dict[str, ActStats], sha256: str) -> None:
    """Cache pass-1 statistics (per-channel min/max before smoothing) keyed by the calibration data's sha256."""
    arrays = {f"min::{t}": st.cmin for t, st in stats.items()} | {f"max::{t}": st.cmax for t, st in stats.items()}
    arrays |= {f"smp::{t}": st.sample for t, st in stats.items() if st.sample is not None}
    with open(path, "wb") as f:  # a file object: np.savez would append .npz to a bare path
        np.savez(f, __sha256__=np.array(sha256), **arrays)


def load_first_pass(path, sha256: str) -> dict[str, ActStats] | None:
    """The cached statistics, or None when the file is missing or was made from other calibration data."""
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    if str(z["__sha256__"]) != sha256:
        return None
    names = [k[5:] for k in z.files if k.startswith("min::")]
    return {t: ActStats(z[f"min::{t}"].copy(), z[f"max::{t}"].copy(), sample=z[f"smp::{t}"].copy() if f"smp::{t}" in z.files else None)
            for t in names}
