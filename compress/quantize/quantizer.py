"""Quantization of an exported decoder artifact: static W8A8 (QDQ), dynamic INT8, weight-only INT8 or 4-bit.

Entry point: `quantize_artifact(src_artifact, out_dir, calib_blocks, cfg) -> QuantReport`.
`Quantizer` loads the fp32 artifact and calibrates once, then writes as many quantized variants as the
caller asks for (the sensitivity scan and the accuracy-aware loop of compress/quantize/relax.py re-quantize
with more groups in float, never recalibrating). The steps live beside it:

  prepare.py      calibration on the calib split + SmoothQuant, once
  sensitivity.py  which groups to keep in float (range ranking, KL scan)
  graph.py        the ONNX rewrites for each method

What is quantized: the linear MatMuls (B is a float initializer) found by
compress.quantize.calibration.find_linears. Attention MatMuls (activation x activation)
and the lm_head never get activation quantization; with quantize_embedding the
tied embedding/lm_head table is stored once as 8-bit blocks and read by both a
GatherBlockQuantized and a MatMulNBits (weight-only, float activations), except in the per-token W8A8 form,
whose tied lm_head gets its own int8 copy behind per-token activations (compress/quantize/graph.py).

``QUANT_FORMAT`` (version.py) is part of the quantize stage's cache key: bump it when the graph a config produces changes.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

from compress.artifact import read_manifest, write_manifest
from compress.quantize.calibration import ActStats, Linear, find_linears
from compress.config import QuantizeConfig
from compress.sizing.cpu import has_vnni
from compress.export.graph_fusion import pack_siblings
from compress.quantize.kv_int8 import int8_kv_artifact
from compress.quantize.graph import (QuantizeError, dynamic_per_tensor, insert_dynamic_per_token, insert_qdq, pow2_block,
                                  quantize_tied_embedding, save_model, weight_only)
from compress.quantize.prepare import calibrate_and_smooth
from compress.quantize.sensitivity import sensitivity_scan
from compress.quantize.smoothquant import fold_tied_lm_head, smooth_tied_lm_head, tied_lm_head
from serve.runners.onnx_external import inline_bytes, load_lazy, spill

MODEL_FILE = "model.onnx"
# Smoothed weights held in memory beyond this go to a scratch file (Quantizer.prepare).
SPILL_BYTES = 256 << 20

# ---------------------------------------------------------------- CPU capability

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


# ---------------------------------------------------------------- the quantizer

def _matches(l: Linear, patterns: list[str]) -> bool:
    return any(p and (p in l.module or p == l.node or p == l.group) for p in patterns)


class Quantizer:
    """Loads an fp32 artifact once, calibrates once, then builds quantized variants on demand."""

    def __init__(self, src_artifact: str | Path, calib_blocks: np.ndarray | None, cfg: QuantizeConfig,
                 threads: int | None = None, on_event: Callable[[str, dict], None] | None = None,
                 calibration_cache: str | Path | None = None):
        if cfg.kv_cache == "int8" and (calib_blocks is None or len(calib_blocks) == 0):
            # before any work: the cache scales are calibrated last, on the written graph
            raise QuantizeError("quantize.kv_cache int8 calibrates its scales on the calib split: pass calib_blocks "
                                "(the pipeline does), or set quantize.kv_cache: float32")
        if cfg.method == "auto" or cfg.kv_cache == "auto":
            raise QuantizeError("quantize.method and quantize.kv_cache 'auto' pick among forms in the quantize stage "
                                "(compress.quantize.choice.choose_quant_form); give Quantizer concrete ones")
        self.src = Path(src_artifact)
        self.calibration_cache = Path(calibration_cache) if calibration_cache else None
        self.cfg = cfg
        self.threads = threads
        self.on_event = on_event or (lambda name, data: None)
        self.manifest = read_manifest(self.src, verify=True)
        self.onnx_path = self.src / self.manifest.get("onnx_file", MODEL_FILE)
        # The graph without its weights: every rewrite reads one weight at a time from the artifact's files
        # (serve/runners/onnx_external.py), so a 1B model is never in memory as a whole fp32 proto, let alone twice.
        self.model = load_lazy(self.onnx_path)
        self._scratch = None  # a temporary folder for SmoothQuant's rewritten weights (prepare)
        self.linears = find_linears(self.model)
        if not self.linears:
            raise QuantizeError(f"{self.onnx_path}: no MatMul with a constant 2-D weight; nothing to quantize")
        self.reduce_range = resolve_reduce_range(cfg)
        self.per_token_lm_head = cfg.method == "dynamic" and cfg.activation_granularity == "token"
        self.calib = None if calib_blocks is None else np.asarray(calib_blocks)[: cfg.calib_samples]
        self.stats: dict[str, ActStats] = {}
        self.inv_scales: dict[str, np.ndarray] = {}
        self.smoothed = 0
        self.smooth_report: list = []
        self.lm_head_smooth = None  # (TiedLmHead, s): SmoothQuant for the per-token form's tied lm_head
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
        # 4-bit weights: AWQ's scaling replaces SmoothQuant's, and the groups kept at 8 bits are measured on the
        # calib rows (compress/quantize/int4.py)
        self.int4 = cfg.method == "weight_only" and cfg.weight_bits == 4
        if self.int4:
            self.alpha = None
        self.awq = self.int4 and cfg.weight_algorithm == "awq"
        self.int8_groups: list[str] | None = None  # the 4-bit form's groups kept at 8 bits (int4_keep_int8)
        if self.int4 and (self.calib is None or len(self.calib) == 0):
            raise QuantizeError("quantize.weight_bits 4 measures which groups keep 8 bits (and AWQ's scales) on the "
                                "calib split: pass calib_blocks (the pipeline does), or set quantize.weight_bits: 8")
        needs_calib = cfg.method == "static" or self.alpha is not None
        if needs_calib and (self.calib is None or len(self.calib) == 0):
            raise QuantizeError(
                f"quantize.method={cfg.method!r} with smoothquant_alpha={self.alpha} needs calibration blocks "
                f"(the calib split); pass calib_blocks or set quantize.smoothquant_alpha: null for dynamic/weight_only"
            )

    def prepare(self) -> None:
        """Calibrate and smooth self.model once (in place); nothing to do for methods that need neither."""
        if self._prepared:
            return
        t_prepare = time.perf_counter()
        cfg = self.cfg
        if self.calib is not None and (cfg.method == "static" or self.alpha is not None or self.int4):
            head = (tied_lm_head(self.model) if self.per_token_lm_head and cfg.quantize_embedding
                    and self.alpha is not None else None)
            c = calibrate_and_smooth(self.model, self.linears, self.calib, cfg, self.alpha,
                                     reduce_range=self.reduce_range, num_kv_heads=int(self.manifest["num_kv_heads"]),
                                     head_dim=int(self.manifest["head_dim"]), threads=self.threads, calibration_cache=self.calibration_cache,
                                     on_event=self.on_event, extra_tensors=(head.tensor,) if head else (),
                                     awq=(cfg.w4_block(), cfg.weight_symmetric, cfg.w4_clip(True)) if self.awq else None)
            self.stats, self.inv_scales, self.ranges, self.linears = c.stats, c.inv_scales, c.ranges, c.linears
            self.smooth_report = list(c.smooth_report)
            if head is not None:
                smoothed_head = smooth_tied_lm_head(self.model, c.stats, self.alpha, self.reduce_range)
                if smoothed_head is not None:
                    self.lm_head_smooth = smoothed_head[:2]
                    self.smooth_report.append(smoothed_head[2])
            self.smoothed = len(self.smooth_report)
            self.calib_seconds, self.calib_sha256, self.calib_fed = c.seconds, c.sha256, c.blocks
            if inline_bytes(self.model) > SPILL_BYTES:
                # SmoothQuant rewrote the weights in memory; to disk with them, or every variant's copy holds them too
                self._scratch = tempfile.TemporaryDirectory(prefix="quant_smoothed_")
                self.model = spill(self.model, self._scratch.name)
        self.prepare_seconds = time.perf_counter() - t_prepare  # calibration + smoothing (+ alpha search)
        self._prepared = True

    def groups(self) -> list[str]:
        return list(dict.fromkeys(l.group for l in self.linears))

    def selected(self, extra_float_groups: list[str] | tuple[str, ...] = ()) -> tuple[list[Linear], list[Linear]]:
        """(linears to quantize, linears kept in float) under keep_float + the given groups. With 4-bit weights an
        untied lm_head is always kept (at 8 bits): a 4-bit lm_head has caused repetition loops."""
        q, f = [], []
        for l in self.linears:
            kept = _matches(l, self.cfg.keep_float) or l.group in extra_float_groups or (self.int4 and l.role == "lm_head")
            (f if kept else q).append(l)
        return q, f

    def int4_int8_groups(self) -> list[str]:
        """The 4-bit form's groups kept at 8 bits: the int4_keep_int8 share of them with the largest measured 4-bit
        output error on the calib rows (compress/quantize/sensitivity.py candidate_ranking), worst first."""
        if self.int8_groups is None:
            from compress.quantize.sensitivity import candidate_ranking

            ranked = candidate_ranking(self) if self.int4 else []
            self.int8_groups = ranked[: int(np.ceil(self.cfg.int4_keep_int8 * len(ranked)))]
        return self.int8_groups

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
            model = dynamic_per_tensor(model, linears, cfg.per_channel, self.reduce_range)
        else:
            model = weight_only(model, linears, cfg.w4_block() if self.int4 else cfg.weight_block_size,
                                cfg.accuracy_level, bits=cfg.weight_bits,
                                symmetric=cfg.weight_symmetric if self.int4 else True, clip=cfg.w4_clip(self.awq))
        if fallback and rest and cfg.keep_float_as == "weight_only" and (cfg.method != "weight_only" or self.int4):
            model = weight_only(model, rest, pow2_block(cfg.weight_block_size), cfg.accuracy_level)
        if cfg.quantize_embedding if embedding is None else embedding:
            head, scales = (self.lm_head_smooth if self.per_token_lm_head and self.lm_head_smooth else (None, None))
            done = quantize_tied_embedding(model, pow2_block(cfg.weight_block_size), cfg.accuracy_level,
                                           lm_head_per_token=self.per_token_lm_head, per_channel=cfg.per_channel,
                                           reduce_range=self.reduce_range, lm_head_scales=scales)
            if done and head is not None:
                fold_tied_lm_head(model, head, scales)  # the other half: the lm_head's input divided by s
        # gate/up (and q/k/v where the export did not) as one MatMulNBits / MatMul each: fewer, larger
        # kernels per step; done here, after SmoothQuant no longer needs up_proj apart (compress/export/graph_fusion.py)
        pack_siblings(model)
        return model

    def write(self, out_dir: str | Path, extra_float_groups: list[str] | tuple[str, ...] = ()) -> QuantReport:
        """A complete artifact folder (tokenizer, manifest, ...) with the model quantized, `extra_float_groups` in float.

        Built in a sibling .tmp folder and renamed into place; the manifest, written last, makes it an artifact.
        """
        self.prepare()
        cfg = self.cfg
        if cfg.sensitivity_trials and not self.sensitivity:
            t_scan = time.perf_counter()
            self.sensitivity = sensitivity_scan(self)
            self.scan_seconds = time.perf_counter() - t_scan
        t0 = time.perf_counter()
        extra = list(extra_float_groups) + [g for g, _ in self.sensitivity[: cfg.sensitivity_keep]]
        extra += [g for g in self.int4_int8_groups() if g not in extra]
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
        save_model(model, tmp / onnx_file)
        del model
        settings = self.settings(extra)
        fields = {k: v for k, v in self.manifest.items() if k not in ("files", "manifest_version")}
        fields["quantization"] = settings
        fields["source_artifact_sha256"] = self.manifest.get("files", {}).get(onnx_file, {}).get("sha256")
        if cfg.kv_cache == "int8":
            write_manifest(tmp, fields)  # the float32-KV graph, loadable, to calibrate the cache scales on
            settings.update(int8_kv_artifact(tmp, self.calib, onnx_file, scales=cfg.kv_cache_scales))
            fields["kv_dtype"] = "int8"
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

    def use_kv_cache(self, kv_cache: str, kv_cache_scales: str = "channel") -> None:
        """Write the next variants with this K/V cache; the weights' calibration and smoothing stay as they are
        (quantize.kv_cache auto writes each cache form of one weight form from one Quantizer)."""
        if kv_cache == "int8" and (self.calib is None or len(self.calib) == 0):
            raise QuantizeError("quantize.kv_cache int8 calibrates its scales on the calib split: pass calib_blocks "
                                "(the pipeline does), or set quantize.kv_cache: float32")
        self.cfg = self.cfg.model_copy(update={"kv_cache": kv_cache, "kv_cache_scales": kv_cache_scales})

    def settings(self, extra_float_groups: list[str] | tuple[str, ...] = ()) -> dict:
        cfg = self.cfg
        s = {
            "method": cfg.method,
            "weights": "int8 symmetric " + ("per-channel" if cfg.per_channel else "per-tensor") if cfg.method != "weight_only"
            else (f"int4 block-wise ({'symmetric' if cfg.weight_symmetric else 'asymmetric'}, {cfg.weight_algorithm}, "
                  f"{'mse-clipped, ' if cfg.w4_clip(self.awq) else ''}"
                  f"block {cfg.w4_block()}, MatMulNBits accuracy_level {cfg.accuracy_level}); "
                  f"{len(self.int8_groups or [])} groups at 8 bits")
            if self.int4 else f"int8 block-wise (block {cfg.weight_block_size}, MatMulNBits accuracy_level {cfg.accuracy_level})",
            "weight_bits": cfg.weight_bits,
            **({"int8_groups": list(self.int8_groups or [])} if self.int4 else {}),
            "reduce_range": self.reduce_range,
            "cpu_vnni": has_vnni(),
            "smoothquant_alpha": self.alpha,
            "smoothquant_alphas": sorted({r.alpha for r in self.smooth_report}),
            "keep_float": list(cfg.keep_float),
            "keep_float_as": cfg.keep_float_as if cfg.method != "weight_only" or self.int4 else "float",
            "float_groups": list(extra_float_groups),
            "embedding": ("float" if not cfg.quantize_embedding else
                          "int8 block-wise for Gather; lm_head int8 per channel, per-token activations"
                          if self.per_token_lm_head else "int8 block-wise, shared by Gather and lm_head"),
            "calib_blocks": self.calib_fed,
            "calib_sha256": self.calib_sha256,
        }
        if self.per_token_lm_head and cfg.quantize_embedding:
            head = next((r for r in self.smooth_report if r.linears == ["lm_head"]), None)
            s["lm_head_smoothquant_alpha"] = head.alpha if head else None
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


def quantize_artifact(src_artifact: str | Path, out_dir: str | Path, calib_blocks: np.ndarray | None, cfg: QuantizeConfig,
                      threads: int | None = None, on_event: Callable[[str, dict], None] | None = None,
                      calibration_cache: str | Path | None = None) -> QuantReport:
    """Quantize the fp32 artifact in `src_artifact` into a complete new artifact folder `out_dir`.

    calib_blocks: the calib split ([n, block] int64); only its first cfg.calib_samples blocks are used.
    on_event(name, data): progress for the caller's logging (calibration, smoothquant, sensitivity).
    calibration_cache: an .npz of the first calibration pass (per-channel ranges, keyed by the calib data's
    sha256); reused when it matches, written when it does not, so re-quantizing skips the model run.
    cfg.target "cuda": the fp16 CUDA form instead (compress/quantize/cuda_fp16.py; no calibration).
    """
    if cfg.target == "cuda":
        from compress.quantize.cuda_fp16 import write_fp16_artifact

        t0 = time.perf_counter()
        manifest = write_fp16_artifact(src_artifact, out_dir)
        return QuantReport(method="fp16", settings=manifest["quantization"], out_dir=str(out_dir),
                           bytes_before=artifact_onnx_bytes(Path(src_artifact)),
                           bytes_after=artifact_onnx_bytes(Path(out_dir)), seconds=time.perf_counter() - t0,
                           peak_rss_mb=_peak_rss_mb())
    return Quantizer(src_artifact, calib_blocks, cfg, threads=threads, on_event=on_event,
                     calibration_cache=calibration_cache).write(out_dir)
