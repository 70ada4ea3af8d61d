"""KV buffers take resident memory page by page as they are written, not 2 MiB huge page by huge page."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from proc_memory import rss_anon

from serve.kv.memory import kv_zeros


def test_kv_zeros_is_a_zeroed_writable_array_of_the_shape_and_dtype():
    a = kv_zeros((4, 3, 1 << 16), np.float16)
    assert a.shape == (4, 3, 1 << 16) and a.dtype == np.float16 and a.flags.writeable and a.flags.c_contiguous
    assert not a.any()
    a[2, 1, 7] = 3.5
    assert a[2, 1, 7] == 3.5 and a.sum() == 3.5
    small = kv_zeros((2, 3), np.float32)  # below one huge page: plain numpy
    assert small.shape == (2, 3) and not small.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_sparse_writes_make_only_the_written_pages_resident():
    """The pool's access pattern: one block written in each of 60 layer slices of 2 MiB. With transparent huge
    pages each write would make its whole 2 MiB resident (120 MiB); here it is a page or two each."""
    layers, slice_bytes = 60, 2 << 20
    pool = kv_zeros((layers, slice_bytes // 4), np.float32)
    before = rss_anon()
    for layer in range(layers):
        pool[layer, 1000:1000 + 16 * 64] = 1.0  # one 4 KiB block of K/V
    grown = rss_anon() - before
    assert grown < 8 << 20, f"{grown / 2**20:.1f} MiB resident after writing {layers} x 4 KiB"
    assert pool.sum() == layers * 16 * 64
