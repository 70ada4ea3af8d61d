"""INT8 quantization of an exported decoder artifact: static W8A8 (QDQ), dynamic INT8, weight-only INT8.

Entry point: `quantize_artifact(src_artifact, out_dir, calib_blocks, cfg) -> QuantReport`.
`Quantizer` keeps the calibration statistics so the sensitivity scan and the
accuracy-aware loop (compress/accept.py) can re-quantize without recalibrating.

What is quantized: the linear MatMuls (B is a float initializer) found by
compress.calibration.find_linears. Attention MatMuls (activation x activation)
and the lm_head never get activation quantization; with quantize_embedding the
tied embedding/lm_head table is stored once as 8-bit blocks and read by both a
GatherBlockQuantized and a MatMulNBits (weight-only, float activations).

Static W8A8 writes its own QDQ pairs (uint8 asymmetric per-tensor activations,
int8 symmetric per-output-channel weights) from our own calibration, which is
the graph ORT's quantizer would emit with nodes_to_quantize +
OpTypesToExcludeOutputQuantization=['MatMul'], minus its calibrator's memory
problem and its QDQ quirks (FACTS.md); ORT fuses DQ->MatMul into integer kernels.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from compress.artifact import read_manifest, write_manifest
from compress.calibration import (ActStats, Linear, collect_stats, entropy_range, find_linears, load_first_pass, percentile_range,
                                  save_first_pass)
from compress.config import QuantizeConfig
from compress.smoothquant import apply_smoothquant, refresh_linears

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
_MS_DOMAIN = "com.microsoft"


class QuantizeError(ValueError):
    """A quantization request that cannot be carried out, phrased for the user."""


# ---------------------------------------------------------------- CPU capability

def has_vnni(cpuinfo: str | None = None) -> bool:
    """True when the CPU has an 8-bit dot-product instruction (x86 VNNI, ARM dotprod).

    Without it ORT's u8 x s8 kernels add pairs of products in int16 and saturate
    (FACTS.md: perplexity 35k-2.1M instead of 17); 7-bit weights avoid that.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set(re.findall(r"[a-z0-9_]+", " ".join(l for l in cpuinfo.splitlines() if l.lower().startswith(("flags", "features")))))
    return bool(flags & {"avx512_vnni", "avx_vnni", "avxvnni", "amx_int8", "asimddp", "dotprod"})


def resolve_reduce_range(cfg: QuantizeConfig) -> bool:
    return (not has_vnni()) if cfg.reduce_range is None else bool(cfg.reduce_range)


# ---------------------------------------------------------------- report

@dataclass
class QuantReport:
    method: str
    settings: dict
    out_dir: str
    bytes_before: int
    bytes_after: int
    seconds: float
    calib_seconds: float = 0.0
    calib_blocks: int = 0
    calib_sha256: str = ""
    quantized_linears: int = 0
    float_linears: list[str] = field(default_factory=list)  # modules kept in float
    smoothed_tensors: int = 0
    sensitivity: list[tuple[str, float]] = field(default_factory=list)  # (group, KL on calib blocks), most sensitive first
    peak_rss_mb: float = 0.0

    @property
    def size_ratio(self) -> float:
        return self.bytes_after / max(self.bytes_before, 1)

    def metrics(self) -> dict[str, float]:
        """Flat numbers for MLflow."""
        return {
            "quant_bytes_before": float(self.bytes_before),
            "quant_bytes_after": float(self.bytes_after),
            "quant_size_ratio": round(self.size_ratio, 4),
            "quant_seconds": round(self.seconds, 2),
            "quant_calib_seconds": round(self.calib_seconds, 2),
            "quant_calib_blocks": float(self.calib_blocks),
            "quant_linears_int8": float(self.quantized_linears),
            "quant_linears_float": float(len(self.float_linears)),
            "quant_smoothed_tensors": float(self.smoothed_tensors),
            "quant_peak_rss_mb": round(self.peak_rss_mb, 1),
        }

    def to_dict(self) -> dict:
        d = asdict(self)
        d["size_ratio"] = self.size_ratio
        return d


def _peak_rss_mb() -> float:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except Exception:  # not on every platform
        return 0.0


def artifact_onnx_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("model.onnx*"))


# ---------------------------------------------------------------- graph edits

def _weight_qdq(w: np.ndarray, per_channel: bool, reduce_range: bool) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 weights [K, N], one scale per output channel N (or one for the tensor)."""
    qmax = 64.0 if reduce_range else 127.0  # ORT's reduced int8 range is [-64, 64]
    amax = np.abs(w).max(axis=0) if per_channel else np.array(np.abs(w).max())
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    q = np.clip(np.round(w / scale), -qmax, qmax).astype(np.int8)
    return q, scale


def _act_params(lo: float, hi: float) -> tuple[np.float32, np.uint8]:
    """uint8 asymmetric: [lo, hi] (containing 0) onto [0, 255]."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi - lo < 1e-8:
        hi = lo + 1e-8
    scale = (hi - lo) / 255.0
    zp = int(np.clip(round(-lo / scale), 0, 255))
    return np.float32(scale), np.uint8(zp)


def insert_qdq(model: onnx.ModelProto, linears: list[Linear], ranges: dict[str, tuple[float, float]],
               per_channel: bool, reduce_range: bool) -> None:
    """In place: Q/DQ on each linear's activation (shared by the linears that read it) and DQ on its int8 weight."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    todo = {l.node: l for l in linears}
    act_done: dict[str, str] = {}
    new_nodes = []
    drop_inits: set[str] = set()
    for n in g.node:
        l = todo.get(n.name)
        if l is not None:
            a = n.input[0]
            if a not in act_done:
                if a not in ranges:
                    raise QuantizeError(f"no calibration range for {a!r} (input of {l.module}); calibrate with the same model")
                scale, zp = _act_params(*ranges[a])
                s_name, z_name = f"{a}_scale", f"{a}_zero_point"
                g.initializer.extend([numpy_helper.from_array(np.array(scale), s_name), numpy_helper.from_array(np.array(zp), z_name)])
                new_nodes.append(helper.make_node("QuantizeLinear", [a, s_name, z_name], [f"{a}_quantized"], name=f"{a}_QuantizeLinear"))
                new_nodes.append(helper.make_node("DequantizeLinear", [f"{a}_quantized", s_name, z_name], [f"{a}_dequantized"], name=f"{a}_DequantizeLinear"))
                act_done[a] = f"{a}_dequantized"
            w_name = n.input[1]
            w = numpy_helper.to_array(inits[w_name])
            q, scale = _weight_qdq(w, per_channel, reduce_range)
            q_name, s_name, z_name = f"{w_name}_quantized", f"{w_name}_scale", f"{w_name}_zero_point"
            g.initializer.extend([
                numpy_helper.from_array(q, q_name),
                numpy_helper.from_array(scale, s_name),
                numpy_helper.from_array(np.zeros(scale.shape, np.int8), z_name),
            ])
            attrs = {"axis": 1} if per_channel else {}
            new_nodes.append(helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [f"{w_name}_dequantized"], name=f"{w_name}_DequantizeLinear", **attrs))
            n.input[0] = act_done[a]
            n.input[1] = f"{w_name}_dequantized"
            drop_inits.add(w_name)
        new_nodes.append(n)
    still = {i for n in new_nodes for i in n.input}
    keep = [t for t in g.initializer if t.name not in drop_inits or t.name in still]
    g.ClearField("initializer")
    g.initializer.extend(keep)
    g.ClearField("node")
    g.node.extend(new_nodes)


def insert_dynamic_per_token(model: onnx.ModelProto, linears: list[Linear], per_channel: bool, reduce_range: bool) -> None:
    """In place: W8A8 with int8 activations quantized per token (row) at run time, symmetric.

    ORT's dynamic quantization (DynamicQuantizeLinear) uses one range per call, i.e. per tensor over the
    whole batch x sequence; per-token ranges keep a token with outliers from crushing its neighbours
    (FACTS.md: torch fake-quant 17.2 per-token vs 26.3 per-tensor). Per group sharing an input:
      x2 = Reshape(x, [-1, K]); s = max|x2|_row / 127; xq = Cast<uint8>(Round(x2 / s) + 128)  (zero point 128)
      per linear: y = Reshape(Cast<float>(MatMulInteger(xq, Wq)) * s * w_scale, [..., N])
    """
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    todo = {l.node: l for l in linears}
    done: dict[str, tuple[str, str, str]] = {}
    new_nodes = []
    drop: set[str] = set()
    consts_added: set[str] = set()

    def const(name: str, arr: np.ndarray) -> str:
        if name not in consts_added:
            g.initializer.append(numpy_helper.from_array(arr, name))
            consts_added.add(name)
        return name

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)

    def row_max(x: str, out: str, name: str) -> onnx.NodeProto:
        # ReduceMax takes its axes as an input from opset 18 on, as an attribute before (the gqa graph is opset 17).
        if opset >= 18:
            return helper.make_node("ReduceMax", [x, const("ptq_axis_1", np.array([1], np.int64))], [out], keepdims=1,
                                    name=name)
        return helper.make_node("ReduceMax", [x], [out], axes=[1], keepdims=1, name=name)

    for n in g.node:
        l = todo.get(n.name)
        if l is None:
            new_nodes.append(n)
            continue
        a = n.input[0]
        w_name = n.input[1]
        w = numpy_helper.to_array(inits[w_name])
        K, N = w.shape
        if a not in done:
            p = f"{a}_ptq"
            new_nodes += [
                helper.make_node("Shape", [a], [f"{p}_shape"], name=f"{p}_Shape"),
                helper.make_node("Reshape", [a, const(f"ptq_rows_{K}", np.array([-1, K], np.int64))], [f"{p}_2d"], name=f"{p}_Reshape"),
                helper.make_node("Abs", [f"{p}_2d"], [f"{p}_abs"], name=f"{p}_Abs"),
                row_max(f"{p}_abs", f"{p}_amax", f"{p}_ReduceMax"),
                helper.make_node("Max", [f"{p}_amax", const("ptq_eps", np.array(1e-8, np.float32))], [f"{p}_amax_pos"], name=f"{p}_Max"),
                helper.make_node("Div", [f"{p}_amax_pos", const("ptq_127", np.array(127.0, np.float32))], [f"{p}_scale"], name=f"{p}_Scale"),
                helper.make_node("Div", [f"{p}_2d", f"{p}_scale"], [f"{p}_scaled"], name=f"{p}_Div"),
                helper.make_node("Round", [f"{p}_scaled"], [f"{p}_round"], name=f"{p}_Round"),
                # uint8 with a fixed zero point 128: ORT's s8 x s8 MatMulInteger is a slow path (5 ms vs 0.02 ms
                # for u8 x s8 at 1x576x1536 on this CPU); the per-row scale stays outside the integer MatMul.
                helper.make_node("Add", [f"{p}_round", const("ptq_128f", np.array(128.0, np.float32))], [f"{p}_shifted"], name=f"{p}_Shift"),
                helper.make_node("Cast", [f"{p}_shifted"], [f"{p}_q"], to=TensorProto.UINT8, name=f"{p}_Cast"),
                helper.make_node("Slice", [f"{p}_shape", const("ptq_zero", np.array([0], np.int64)), const("ptq_minus1", np.array([-1], np.int64))],
                                 [f"{p}_lead"], name=f"{p}_Lead"),
            ]
            done[a] = (f"{p}_q", f"{p}_scale", f"{p}_lead")
        xq, xs, lead = done[a]
        q, scale = _weight_qdq(w, per_channel, reduce_range)
        o = n.output[0]
        qn, sn = f"{w_name}_quantized", f"{w_name}_scale"
        g.initializer.extend([numpy_helper.from_array(q, qn), numpy_helper.from_array(scale.reshape(-1).astype(np.float32), sn)])
        new_nodes += [
            helper.make_node("MatMulInteger", [xq, qn, const("ptq_zp128", np.array(128, np.uint8))], [f"{o}_i32"], name=f"{n.name}_MatMulInteger"),
            helper.make_node("Cast", [f"{o}_i32"], [f"{o}_f"], to=TensorProto.FLOAT, name=f"{n.name}_Cast"),
            helper.make_node("Mul", [f"{o}_f", sn], [f"{o}_w"], name=f"{n.name}_MulW"),
            helper.make_node("Mul", [f"{o}_w", xs], [f"{o}_2d"], name=f"{n.name}_MulX"),
            helper.make_node("Concat", [lead, const(f"ptq_cols_{N}", np.array([N], np.int64))], [f"{o}_shape"], axis=0, name=f"{n.name}_OutShape"),
            helper.make_node("Reshape", [f"{o}_2d", f"{o}_shape"], [o], name=f"{n.name}_Reshape"),
        ]
        drop.add(w_name)
    still = {i for n in new_nodes for i in n.input}
    keep = [t for t in g.initializer if t.name not in drop or t.name in still]
    g.ClearField("initializer")
    g.initializer.extend(keep)
    g.ClearField("node")
    g.node.extend(new_nodes)


def quantize_tied_embedding(model: onnx.ModelProto, block_size: int = 32, accuracy_level: int = 4) -> bool:
    """Store the embedding table once as 8-bit blocks, shared by the token Gather and a tied lm_head.

    Gather(E, ids)            -> GatherBlockQuantized(Eq[V, K/b, b]) -> Reshape [.., K]
    MatMul(x, Transpose(E))   -> MatMulNBits(x, Eq) (weight-only, bits=8)
    Returns False (model untouched) when the graph has no such pattern.
    """
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    gather = next((n for n in g.node if n.op_type == "Gather" and n.input[0] in inits and len(inits[n.input[0]].dims) == 2), None)
    if gather is None:
        return False
    e_name = gather.input[0]
    V, K = inits[e_name].dims
    if K % block_size:
        return False
    consumers = [n for n in g.node if e_name in n.input]
    transposes = [n for n in consumers if n.op_type == "Transpose"]
    if len(consumers) != 1 + len(transposes):
        return False
    lm_heads = []
    for t in transposes:
        users = [n for n in g.node if t.output[0] in n.input]
        if not all(u.op_type == "MatMul" and u.input[1] == t.output[0] for u in users):
            return False
        lm_heads += users
    E = numpy_helper.to_array(inits[e_name]).astype(np.float32)
    kb = K // block_size
    Eb = E.reshape(V, kb, block_size)
    scale = (np.abs(Eb).max(-1) / 127.0).astype(np.float32)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = (np.clip(np.round(Eb / scale[..., None]), -127, 127) + 128).astype(np.uint8)
    qn = f"{e_name}_q8"
    g.initializer.extend([
        numpy_helper.from_array(q, qn),
        numpy_helper.from_array(scale.reshape(V, kb, 1), f"{qn}_gather_scales"),
        numpy_helper.from_array(np.full((V, kb, 1), 128, np.uint8), f"{qn}_gather_zero_points"),
        numpy_helper.from_array(scale.reshape(-1), f"{qn}_matmul_scales"),
        numpy_helper.from_array(np.array([0, 0, K], np.int64), f"{qn}_shape"),
    ])
    new_nodes = []
    for n in g.node:
        if n is gather:
            out = n.output[0]
            new_nodes.append(helper.make_node("GatherBlockQuantized", [qn, n.input[1], f"{qn}_gather_scales", f"{qn}_gather_zero_points"],
                                              [f"{out}_blocks"], name=f"{n.name}_q8", domain=_MS_DOMAIN,
                                              gather_axis=0, quantize_axis=2, block_size=block_size, bits=8))
            new_nodes.append(helper.make_node("Reshape", [f"{out}_blocks", f"{qn}_shape"], [out], name=f"{n.name}_q8_reshape"))
        elif n in transposes:
            continue
        elif n in lm_heads:
            new_nodes.append(helper.make_node("MatMulNBits", [n.input[0], qn, f"{qn}_matmul_scales"], list(n.output), name=f"{n.name}_q8",
                                              domain=_MS_DOMAIN, K=K, N=V, bits=8, block_size=block_size, accuracy_level=accuracy_level))
        else:
            new_nodes.append(n)
    g.ClearField("node")
    g.node.extend(new_nodes)
    keep = [t for t in g.initializer if t.name != e_name]
    g.ClearField("initializer")
    g.initializer.extend(keep)
    _ensure_ms_opset(model)
    return True


def _ensure_ms_opset(model: onnx.ModelProto) -> None:
    if not any(o.domain == _MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_MS_DOMAIN, 1))


def _weight_only(model: onnx.ModelProto, linears: list[Linear], block_size: int, accuracy_level: int) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    if block_size & (block_size - 1):
        raise QuantizeError(f"quantize.block_size must be a power of two >= 16 for weight_only, got {block_size}")
    chosen = {l.node for l in linears}
    # The quantizer takes every MatMul of the listed op types; exclude the rest by name.
    exclude = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name not in chosen]
    q = MatMulNBitsQuantizer(model, bits=8, block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level,
                             nodes_to_exclude=exclude, op_types_to_quantize=("MatMul",))
    qlog = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = qlog.level
    qlog.setLevel(logging.WARNING)  # it logs one INFO line per graph node
    try:
        q.process()
    finally:
        qlog.setLevel(level)
    return q.model.model


def _dynamic(model: onnx.ModelProto, linears: list[Linear], per_channel: bool, reduce_range: bool) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="quant_dyn_") as tmp:
        src, dst = Path(tmp) / "in.onnx", Path(tmp) / "out.onnx"
        _save(model, src)
        quantize_dynamic(src, dst, op_types_to_quantize=["MatMul"], per_channel=per_channel, reduce_range=reduce_range,
                         weight_type=QuantType.QInt8, nodes_to_quantize=[l.node for l in linears],
                         extra_options={"MatMulConstBOnly": True})
        return onnx.load(str(dst))


def _save(model: onnx.ModelProto, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # protobuf cannot serialize 2 GB; bigger models keep their weights in model.onnx.data
    external = model.ByteSize() > 1_800_000_000
    onnx.save_model(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=path.name + ".data" if external else None)


# ---------------------------------------------------------------- the quantizer

def _pow2_block(n: int) -> int:
    return n if n >= 16 and n & (n - 1) == 0 else 32


def _matches(l: Linear, patterns: list[str]) -> bool:
    return any(p and (p in l.module or p == l.node or p == l.group) for p in patterns)


class Quantizer:
    """Loads an fp32 artifact once, calibrates once, then builds quantized variants on demand."""

    def __init__(self, src_artifact: str | Path, calib_blocks: np.ndarray | None, cfg: QuantizeConfig,
                 threads: int | None = None, on_event: Callable[[str, dict], None] | None = None,
                 calibration_cache: str | Path | None = None):
        self.src = Path(src_artifact)
        self.calibration_cache = Path(calibration_cache) if calibration_cache else None
        self.cfg = cfg
        self.threads = threads
        self.on_event = on_event or (lambda name, data: None)
        self.manifest = read_manifest(self.src, verify=True)
        self.onnx_path = self.src / self.manifest.get("onnx_file", MODEL_FILE)
        self.model = onnx.load(str(self.onnx_path))
        self.linears = find_linears(self.model)
        if not self.linears:
            raise QuantizeError(f"{self.onnx_path}: no MatMul with a constant 2-D weight; nothing to quantize")
        self.reduce_range = resolve_reduce_range(cfg)
        self.calib = None if calib_blocks is None else np.asarray(calib_blocks)[: cfg.calib_samples]
        self.stats: dict[str, ActStats] = {}
        self.inv_scales: dict[str, np.ndarray] = {}
        self.smoothed = 0
        self.smooth_report: list = []
        self.ranges: dict[str, tuple[float, float]] = {}
        self.calib_seconds = 0.0
        self.calib_sha256 = ""
        self.calib_fed = 0
        self.sensitivity: list[tuple[str, float]] = []
        self._prepared = False
        self.prepare_seconds = 0.0
        self.scan_seconds = 0.0
        # "auto" scores W8A8 error; weight-only keeps float activations, so it smooths only when asked for a number
        self.alpha = None if (cfg.method == "weight_only" and cfg.smoothquant_alpha == "auto") else cfg.smoothquant_alpha
        needs_calib = cfg.method == "static" or self.alpha is not None
        if needs_calib and (self.calib is None or len(self.calib) == 0):
            raise QuantizeError(
                f"quantize.method={cfg.method!r} with smoothquant_alpha={self.alpha} needs calibration blocks "
                f"(the calib split); pass calib_blocks or set quantize.smoothquant_alpha: null for dynamic/weight_only"
            )

    # -- calibration + smoothing (once)
    def prepare(self) -> None:
        if self._prepared:
            return
        t_prepare = time.perf_counter()
        cfg = self.cfg
        if self.calib is not None and (cfg.method == "static" or self.alpha is not None):
            tensors = list(dict.fromkeys(l.input for l in self.linears))
            hist = cfg.method == "static" and cfg.calibration in ("entropy", "percentile")
            alpha = self.alpha
            model = self.model
            linears = self.linears

            def smooth(stats: dict[str, ActStats]) -> dict[str, np.ndarray]:
                if alpha is None:
                    return {}
                inv, rep = apply_smoothquant(model, linears, stats, alpha, reduce_range=self.reduce_range,
                                             per_token=cfg.method == "dynamic" and cfg.activation_granularity == "token")
                self.smooth_report = rep
                self.smoothed = len(rep)
                self.on_event("smoothquant", {"tensors": len(rep), "max_before": max((r.max_before for r in rep), default=0.0),
                                              "max_after": max((r.max_after for r in rep), default=0.0)})
                return inv

            kv_heads, head_dim = int(self.manifest["num_kv_heads"]), int(self.manifest["head_dim"])
            first = None
            if self.calibration_cache is not None:
                sha = hashlib.sha256(np.ascontiguousarray(self.calib.astype(np.int64)).tobytes()).hexdigest()
                first = load_first_pass(self.calibration_cache, sha)
                if first is not None and (not set(tensors) <= set(first) or any(first[t].sample is None for t in tensors)):
                    first = None
            # stats keep the raw (unsmoothed) per-channel ranges; smoothing only sets inv_scale beside them
            res = collect_stats(self.model, tensors, self.calib, kv_heads, head_dim, histogram=hist, inv_scales=smooth,
                                batch_size=cfg.calib_batch_size, threads=self.threads, first_pass=first,
                                sample_rows=cfg.smoothquant_samples)
            if self.calibration_cache is not None and first is None:
                save_first_pass(self.calibration_cache, res.stats, res.sha256)
            if not hist:
                self.inv_scales = smooth(res.stats)
            else:
                self.inv_scales = {t: st.inv_scale for t, st in res.stats.items() if st.inv_scale is not None}
            self.stats = res.stats
            self.linears = refresh_linears(self.model, self.linears)
            self.calib_seconds, self.calib_sha256, self.calib_fed = res.seconds, res.sha256, res.blocks
            for t, st in self.stats.items():
                if cfg.calibration == "percentile" and st.hist is not None:
                    self.ranges[t] = percentile_range(st, cfg.percentile)
                elif cfg.calibration == "entropy" and st.hist is not None:
                    self.ranges[t] = entropy_range(st)
                else:
                    self.ranges[t] = st.range_after(self.inv_scales.get(t))
            self.on_event("calibration", {"blocks": res.blocks, "seconds": res.seconds, "tensors": len(tensors)})
        self.prepare_seconds = time.perf_counter() - t_prepare  # calibration + smoothing (+ alpha search)
        self._prepared = True

    def groups(self) -> list[str]:
        return list(dict.fromkeys(l.group for l in self.linears))

    def selected(self, extra_float_groups: list[str] | tuple[str, ...] = ()) -> tuple[list[Linear], list[Linear]]:
        """(linears to quantize, linears kept in float) under keep_float + the given groups."""
        q, f = [], []
        for l in self.linears:
            (f if _matches(l, self.cfg.keep_float) or l.group in extra_float_groups else q).append(l)
        return q, f

    def build(self, linears: list[Linear], embedding: bool | None = None, fallback: bool = True) -> onnx.ModelProto:
        """A quantized copy of the (smoothed) model with exactly `linears` quantized by cfg.method.

        fallback: the other linears get 8-bit weight-only when cfg.keep_float_as == "weight_only".
        """
        self.prepare()
        cfg = self.cfg
        model = copy.deepcopy(self.model)
        chosen = {l.node for l in linears}
        rest = [l for l in self.linears if l.node not in chosen]
        if cfg.method == "static":
            insert_qdq(model, linears, self.ranges, cfg.per_channel, self.reduce_range)
        elif cfg.method == "dynamic" and cfg.activation_granularity == "token":
            insert_dynamic_per_token(model, linears, cfg.per_channel, self.reduce_range)
        elif cfg.method == "dynamic":
            model = _dynamic(model, linears, cfg.per_channel, self.reduce_range)
        else:
            model = _weight_only(model, linears, cfg.block_size, cfg.accuracy_level)
        if fallback and rest and cfg.keep_float_as == "weight_only" and cfg.method != "weight_only":
            model = _weight_only(model, rest, _pow2_block(cfg.block_size), cfg.accuracy_level)
        if cfg.quantize_embedding if embedding is None else embedding:
            quantize_tied_embedding(model, _pow2_block(cfg.block_size), cfg.accuracy_level)
        return model

    # -- sensitivity scan
    def candidate_ranking(self) -> list[str]:
        """Quantizable groups, worst first, by a cheap local measure computed on calib data only.

        With calibration samples: the W8A8 output error of the group's linears (smoothed weights,
        per-tensor or per-token activations as configured, activation range fitted on half the rows and
        scored on the other half). Without: how badly one 8-bit range fits the input, max/median channel range.
        """
        from compress.smoothquant import heldout_w8a8_error

        self.prepare()
        cfg = self.cfg
        inits = {i.name: i for i in self.model.graph.initializer}
        per_token = cfg.method == "dynamic" and cfg.activation_granularity == "token"
        q, _ = self.selected()
        by_group: dict[str, list[Linear]] = {}
        for l in q:
            by_group.setdefault(l.group, []).append(l)
        score: dict[str, float] = {}
        for g, ls in by_group.items():
            st = self.stats.get(ls[0].input)
            inv = self.inv_scales.get(ls[0].input)
            if st is None:
                score[g] = 0.0
            elif st.sample is not None and cfg.method != "weight_only":
                x = st.sample * inv if inv is not None else st.sample
                ws = [numpy_helper.to_array(inits[l.weight]) for l in ls]
                score[g] = heldout_w8a8_error(x.astype(np.float32), ws, None, self.reduce_range, per_token=per_token)
            else:
                am = st.absmax * (inv if inv is not None else 1.0)
                score[g] = float(am.max() / max(np.median(am), 1e-12))
        return sorted(score, key=lambda k: -score[k])

    def sensitivity_scan(self, trials: int | None = None, blocks: int | None = None) -> list[tuple[str, float]]:
        """Quantize one group at a time; score = mean KL(float || group-quantized) on calib blocks. Most sensitive first."""
        from compress.evaluate import _logits_batches, make_session

        self.prepare()
        trials = self.cfg.sensitivity_trials if trials is None else trials
        if trials <= 0 or self.calib is None:
            return []
        t_scan = time.perf_counter()
        data = self.calib[: blocks or self.cfg.sensitivity_blocks]
        kv = (int(self.manifest["num_kv_heads"]), int(self.manifest["head_dim"]))
        ref_sess = make_session(self.model, self.threads)
        ref = [_log_softmax(x) for x in _logits_batches(ref_sess, data, *kv)]
        del ref_sess
        q, _ = self.selected()
        by_group: dict[str, list[Linear]] = {}
        for l in q:
            by_group.setdefault(l.group, []).append(l)
        results = []
        for g in self.candidate_ranking()[:trials]:
            t0 = time.perf_counter()
            sess = make_session(self.build(by_group[g], embedding=False, fallback=False), self.threads)
            kl, n = 0.0, 0
            for r, x in zip(ref, _logits_batches(sess, data, *kv)):
                lp = _log_softmax(x)
                kl += float((np.exp(r) * (r - lp)).sum())
                n += r.shape[0] * r.shape[1]
            del sess
            results.append((g, kl / max(n, 1)))
            self.on_event("sensitivity", {"group": g, "kl": kl / max(n, 1), "seconds": time.perf_counter() - t0})
        results.sort(key=lambda x: -x[1])
        self.sensitivity = results
        self.scan_seconds = time.perf_counter() - t_scan
        return results

    def float_groups_by_sensitivity(self) -> list[str]:
        """Every quantizable group, most sensitive first: scanned ones by KL, then the rest by the range proxy."""
        scanned = [g for g, _ in self.sensitivity]
        return scanned + [g for g in self.candidate_ranking() if g not in scanned]

    # -- write an artifact
    def write(self, out_dir: str | Path, extra_float_groups: list[str] | tuple[str, ...] = ()) -> QuantReport:
        self.prepare()
        cfg = self.cfg
        if cfg.sensitivity_trials and not self.sensitivity:
            self.sensitivity_scan()
        t0 = time.perf_counter()
        extra = list(extra_float_groups) + [g for g, _ in self.sensitivity[: cfg.sensitivity_keep]]
        q, f = self.selected(extra)
        model = self.build(q)
        out_dir = Path(out_dir)
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        onnx_file = self.manifest.get("onnx_file", MODEL_FILE)
        for p in self.src.iterdir():
            if p.is_file() and p.name != "manifest.json" and not p.name.startswith(Path(onnx_file).name):
                shutil.copy2(p, tmp / p.name)
        _save(model, tmp / onnx_file)
        del model
        settings = self.settings(extra)
        fields = {k: v for k, v in self.manifest.items() if k not in ("files", "manifest_version")}
        fields["quantization"] = settings
        fields["source_artifact_sha256"] = self.manifest.get("files", {}).get(onnx_file, {}).get("sha256")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
        write_manifest(out_dir, fields)
        report = QuantReport(
            method=cfg.method, settings=settings, out_dir=str(out_dir),
            bytes_before=artifact_onnx_bytes(self.src), bytes_after=artifact_onnx_bytes(out_dir),
            seconds=time.perf_counter() - t0 + self.prepare_seconds + self.scan_seconds, calib_seconds=self.calib_seconds,
            calib_blocks=self.calib_fed, calib_sha256=self.calib_sha256, quantized_linears=len(q),
            float_linears=[l.module for l in f], smoothed_tensors=self.smoothed, sensitivity=list(self.sensitivity),
            peak_rss_mb=_peak_rss_mb(),
        )
        return report

    def settings(self, extra_float_groups: list[str] | tuple[str, ...] = ()) -> dict:
        cfg = self.cfg
        s = {
            "method": cfg.method,
            "weights": "int8 symmetric " + ("per-channel" if cfg.per_channel else "per-tensor") if cfg.method != "weight_only"
            else f"int8 block-wise (block {cfg.block_size}, MatMulNBits accuracy_level {cfg.accuracy_level})",
            "reduce_range": self.reduce_range,
            "cpu_vnni": has_vnni(),
            "smoothquant_alpha": self.alpha,
            "smoothquant_alphas": sorted({r.alpha for r in self.smooth_report}),
            "keep_float": list(cfg.keep_float),
            "keep_float_as": cfg.keep_float_as if cfg.method != "weight_only" else "float",
            "float_groups": list(extra_float_groups),
            "embedding": "int8 block-wise, shared by Gather and lm_head" if cfg.quantize_embedding else "float",
            "calib_blocks": self.calib_fed,
            "calib_sha256": self.calib_sha256,
        }
        if cfg.method == "static":
            s["activations"] = "uint8 asymmetric per-tensor (static)"
            s["calibration"] = cfg.calibration
            if cfg.calibration == "percentile":
                s["percentile"] = cfg.percentile
        elif cfg.method == "dynamic" and cfg.activation_granularity == "token":
            s["activations"] = "symmetric per-token, range per call (dynamic; stored uint8, zero point 128)"
        elif cfg.method == "dynamic":
            s["activations"] = "uint8 per-tensor, range per call (dynamic)"
        return s


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def quantize_artifact(src_artifact: str | Path, out_dir: str | Path, calib_blocks: np.ndarray | None, cfg: QuantizeConfig,
                      threads: int | None = None, on_event: Callable[[str, dict], None] | None = None,
                      calibration_cache: str | Path | None = None) -> QuantReport:
    """Quantize the fp32 artifact in `src_artifact` into a complete new artifact folder `out_dir`.

    calib_blocks: the calib split ([n, block] int64); only its first cfg.calib_samples blocks are used.
    on_event(name, data): progress for the caller's logging (calibration, smoothquant, sensitivity).
    calibration_cache: an .npz of the first calibration pass (per-channel ranges, keyed by the calib data's
    sha256); reused when it matches, written when it does not, so re-quantizing skips the model run.
    """
    return Quantizer(src_artifact, calib_blocks, cfg, threads=threads, on_event=on_event,
                     calibration_cache=calibration_cache).write(out_dir)


def sensitivity_figure(sensitivity: list[tuple[str, float]], kept: int = 0):
    """Bar chart of a sensitivity scan (KL per group, most sensitive first; the first `kept` bars are the float ones)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(4.0, 0.35 * len(sensitivity) + 1.5), 3.2))
    ax = fig.add_subplot(1, 1, 1)
    names = [g for g, _ in sensitivity]
    vals = [v for _, v in sensitivity]
    ax.bar(range(len(vals)), vals, color=["tab:red" if i < kept else "tab:blue" for i in range(len(vals))])
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels(names, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("KL(float || group int8)")
    ax.set_title("sensitivity scan (red: kept in float)")
    fig.tight_layout()
    return fig
