"""serve.engine.heap.release_free_memory gives a thread's freed heap memory back (what model loading leaves)."""

from __future__ import annotations

import sys
import threading

import pytest
from proc_memory import rss_anon

from serve.engine.heap import release_free_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")


def test_memory_a_thread_allocated_and_freed_is_resident_until_released():
    kept_alive = []

    def load_and_drop():  # like a model loader: many heap blocks freed, a few kept, scattered among them
        blocks = [bytes(2000) + bytes([i % 251]) for i in range(60_000)]  # ~120 MiB in malloc-sized pieces
        kept_alive.extend(blocks[::50])
        del blocks

    base = rss_anon()
    t = threading.Thread(target=load_and_drop)
    t.start()
    t.join()
    kept = rss_anon() - base
    if kept < 32 << 20:
        pytest.skip(f"this libc returned the memory by itself ({kept / 2**20:.0f} MiB kept)")
    assert release_free_memory()
    after = rss_anon() - base
    assert after < kept / 4, f"{kept / 2**20:.0f} MiB kept after the thread, {after / 2**20:.0f} MiB after the release"
    assert len(kept_alive) == 1200 and kept_alive[7][-1] == (7 * 50) % 251  # what is still used is untouched
