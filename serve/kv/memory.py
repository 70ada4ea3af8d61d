"""Zeroed KV buffers whose memory is taken page by page, as it is written.

numpy asks the kernel for transparent huge pages on every large array (``madvise(MADV_HUGEPAGE)``). For the KV
block pool and the in-place rows that is the wrong trade: both are written sparsely (one block, one slot of
each layer's slice), and the first write into any 2 MiB of a huge-page region makes all 2 MiB resident. With
60 layer slices, one request's first step made ~120 MiB of the pool and ~120 MiB of the rows resident
(benchmarks/history.md run 8, "Resident memory"). These buffers come from an anonymous mapping advised
``MADV_NOHUGEPAGE`` instead, so resident memory follows the blocks and slots actually written. Where the
platform has no madvise, this is plain ``np.zeros``.
"""

from __future__ import annotations

import mmap

import numpy as np

_NO_HUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", None)
MIN_BYTES = 1 << 21  # below one huge page numpy's allocation is as good


def kv_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed, writable array of ``shape`` and ``dtype`` that does not use transparent huge pages."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if _NO_HUGEPAGE is None or nbytes < MIN_BYTES:
        return np.zeros(shape, dtype)
    buf = mmap.mmap(-1, nbytes)  # anonymous, private, zero-filled; unmapped when the array is collected
    buf.madvise(_NO_HUGEPAGE)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)
