"""The 4-bit block grid of ONNX Runtime's MatMulNBits quantizer, in numpy: shared by the quantize stage (AWQ's search,
the mixed-precision ranking: compress/quantize/int4.py) and the export that writes 4-bit weights straight from the
checkpoint (compress/export/weights.py int4_plan), so both score the grid the kernel will use."""

from __future__ import annotations

import numpy as np


def fake_quant_w4(w: np.ndarray, block: int, symmetric: bool = False) -> np.ndarray:
    """w [K, N] rounded to 4 bits in blocks of ``block`` rows per column and back (float32)."""
    K, N = w.shape
    pad = (-K) % block
    wb = np.pad(w.astype(np.float32), ((0, pad), (0, 0))).reshape(-1, block, N)
    if symmetric:
        hi = wb.max(axis=1, keepdims=True)
        lo = wb.min(axis=1, keepdims=True)
        extreme = np.where(np.abs(lo) >= np.abs(hi), lo, hi)
        scale = extreme / -8.0
        scale = np.where(scale == 0, 1.0, scale)
        q = np.clip(np.round(wb / scale), -8, 7)
        out = q * scale
    else:
        lo = np.minimum(wb.min(axis=1, keepdims=True), 0.0)
        hi = np.maximum(wb.max(axis=1, keepdims=True), 0.0)
        scale = (hi - lo) / 15.0
        scale = np.where(scale == 0, 1.0, scale)
        zp = np.clip(np.round(-lo / scale), 0, 15)
        q = np.clip(np.round(wb / scale) + zp, 0, 15)
        out = (q - zp) * scale
    return out.reshape(-1, N)[:K].astype(np.float32)


def w4_weight_error(w: np.ndarray, block: int, symmetric: bool = False) -> float:
    """||W - Q4(W)||^2 / ||W||^2: how much of a weight 4-bit rounding loses, with no activations to weigh it."""
    w = np.asarray(w, np.float32)
    return float(((fake_quant_w4(w, block, symmetric) - w) ** 2).sum() / max(float((w**2).sum()), 1e-30))
