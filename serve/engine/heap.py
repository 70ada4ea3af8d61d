"""Give the C heap's free memory back to the system after a model is loaded.

Loading a model allocates temporaries as large as the graph (the parsed protobuf, initializer copies before
prepacking) and frees them, but glibc keeps freed memory in its arenas for reuse, and a thread's own arena
(the runner is built in a thread of its own: serve/engine/thread_priority.py) keeps all of it. For the 151 MiB
SmolLM2 INT8 graph that was ~100 MiB of resident memory nothing used again (benchmarks/history.md run 8,
"Resident memory"). ``malloc_trim(0)`` returns it. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def release_free_memory() -> bool:
    """Return the heap's free pages to the system (glibc ``malloc_trim``); True when it released any."""
    if _LIBC is None:
        return False
    try:
        return bool(_LIBC.malloc_trim(0))
    except Exception:  # noqa: BLE001 - a musl or otherwise odd libc: memory stays as it was
        log.debug("malloc_trim unavailable", exc_info=True)
        return False
