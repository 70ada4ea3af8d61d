"""4-bit block weights in MatMulNBits' layout, with the rounding we choose: shared by the quantize stage (AWQ's search,
the mixed-precision ranking, the writer: compress/quantize/int4.py, compress/quantize/graph.py), the export that writes
4-bit weights straight from the checkpoint (compress/export/gqa.py, compress/export/weights.py int4_plan) and golden's
rounded reference, so every score is of the grid the kernel will read.

The grid is ONNX Runtime's (asymmetric: 16 levels from a block minimum that keeps 0 in range, zero point
round(-min / scale); symmetric: scale = the block's signed extreme / -8). ``clip`` adds what ORT's round-to-nearest
lacks and llama.cpp's k-quants do: each block's range may shrink (``CLIP_GRID``) where that lowers the block's
squared error, trading the one or two extreme weights for a finer step over the other thirty. No activations are
needed, so the export from a checkpoint gets it too. With ``clip`` False the tensors equal ORT's
``DefaultWeightOnlyQuantizer.qbits_block_quant`` bit for bit where K is a multiple of the block
(tests/test_int4.py).
"""

from __future__ import annotations

import numpy as np
import torch

CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
_CHUNK = 1 << 23  # elements of a weight rounded at once (torch, in fp32): bounds the search's memory on a large lm_head


def _grid(wb: torch.Tensor, symmetric: bool, shrink: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes 0..15, scale, zero point) of blocks ``wb`` [kb, block, n] with each block's range times ``shrink``."""
    if symmetric:
        hi, lo = wb.amax(1, keepdim=True), wb.amin(1, keepdim=True)
        scale = torch.where(lo.abs() >= hi.abs(), lo, hi) * (shrink / -8.0)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zp = torch.full_like(scale, 8.0)
    else:
        lo = wb.amin(1, keepdim=True).clamp(max=0.0) * shrink
        hi = wb.amax(1, keepdim=True).clamp(min=0.0) * shrink
        scale = (hi - lo) / 15.0
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zp = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(wb / scale) + zp).clamp(0, 15)
    return q, scale, zp


def _blocks(w: torch.Tensor, block: int, symmetric: bool, clip: bool):
    """(codes [kb, block, n], scale [kb, 1, n], zero point [kb, 1, n]) of w [K, n] (K padded with zeros)."""
    K, n = w.shape
    pad = (-K) % block
    wb = torch.nn.functional.pad(w, (0, 0, 0, pad)).reshape(-1, block, n)
    best = None
    for shrink in (CLIP_GRID if clip else (1.0,)):
        q, scale, zp = _grid(wb, symmetric, shrink)
        err = (((q - zp) * scale - wb) ** 2).sum(1, keepdim=True)
        if best is None:
            best = [q, scale, zp, err]
            continue
        better = err < best[3]
        best = [torch.where(better, new, old) for new, old in zip((q, scale, zp, err), best)]
    return best[0], best[1], best[2]


def _columns(w: np.ndarray, block: int):
    """w [K, N] as fp32 torch column chunks of at most _CHUNK elements: (start, chunk)."""
    step = max(1, _CHUNK // (w.shape[0] + block))
    for j in range(0, w.shape[1], step):  # copied a chunk at a time: w may be a transposed view of a large table
        yield j, torch.from_numpy(np.array(w[:, j:j + step], dtype=np.float32, order="C"))


def fake_quant_w4(w: np.ndarray, block: int, symmetric: bool = False, clip: bool = True) -> np.ndarray:
    """w [K, N] rounded to 4 bits in blocks of ``block`` rows per column and back (float32)."""
    K, N = w.shape
    out = np.empty((K, N), np.float32)
    with torch.no_grad():
        for j, c in _columns(w, block):
            q, scale, zp = _blocks(c, block, symmetric, clip)
            out[:, j:j + c.shape[1]] = ((q - zp) * scale).reshape(-1, c.shape[1])[:K].numpy()
    return out


def pack_w4(w: np.ndarray, block: int, symmetric: bool = False,
            clip: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """MatMulNBits' 4-bit tensors of w [K, N]: packed codes [N, kb, block / 2] (low nibble first), scales [N, kb],
    and packed zero points [N, ceil(kb / 2)] (None when symmetric: the kernel's default is 8)."""
    K, N = w.shape
    kb = -(-K // block)
    packed = np.empty((N, kb, block // 2), np.uint8)
    scales = np.empty((N, kb), np.float32)
    zps = np.empty((N, kb + kb % 2), np.uint8)
    with torch.no_grad():
        for j, c in _columns(w, block):
            q, scale, zp = _blocks(c, block, symmetric, clip)
            codes = q.to(torch.uint8).permute(2, 0, 1).reshape(c.shape[1], -1)  # [n, kb * block]
            codes[:, K:] = 0  # past K: never read by the kernel
            codes = codes.reshape(c.shape[1], kb, block).numpy()
            cols = slice(j, j + c.shape[1])
            packed[cols] = codes[..., 0::2] | (codes[..., 1::2] << 4)
            scales[cols] = scale[:, 0, :].T.numpy()
            zps[cols, :kb] = zp[:, 0, :].T.to(torch.uint8).numpy()
    if symmetric:
        return packed, scales, None
    zps[:, kb:] = 8  # the unused nibble of an odd block count, as ORT writes it
    return packed, scales, (zps[:, 0::2] | (zps[:, 1::2] << 4)).astype(np.uint8)


def w4_weight_error(w: np.ndarray, block: int, symmetric: bool = False, clip: bool = True) -> float:
    """||W - Q4(W)||^2 / ||W||^2: how much of a weight 4-bit rounding loses, with no activations to weigh it."""
    w = np.asarray(w, np.float32)
    return float(((fake_quant_w4(w, block, symmetric, clip) - w) ** 2).sum() / max(float((w**2).sum()), 1e-30))
