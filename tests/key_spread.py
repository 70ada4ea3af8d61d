"""A gqa artifact's copy with K's channels evened out over deliberately spread ranges, for the kv_equalize tests.

The tiny seeded models' K channels are near even, so their own ranges would give most layers factors of 1: every
seventh channel's range is taken 16x larger, which makes every layer's factors other than 1. Imported as
``from key_spread import ...`` (pytest puts tests/ on sys.path: the folder has no __init__.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx


def spread_keys(absmax: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v * np.where(np.arange(v.shape[1]) % 7 == 0, 16.0, 1.0) if k.endswith(".key") else v
            for k, v in absmax.items()}


def equalized_copy(folder: Path, calib: np.ndarray, out: Path) -> tuple[int, dict, dict, dict]:
    """Copy ``folder`` to ``out`` and even out its K over the spread ranges. Returns (layers changed, the calibrated
    ranges, the spread ones, the spread ones as equalize_keys predicts them after)."""
    from compress.quantize.kv_equalize import equalize_keys
    from compress.quantize.kv_int8 import kv_absmax

    absmax = kv_absmax(folder, calib)
    spread = spread_keys(absmax)
    shutil.copytree(folder, out)
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    n, predicted = equalize_keys(model, spread, out)
    onnx.save(model, str(out / "model.onnx"))
    return n, absmax, spread, predicted
