"""This process's anonymous resident memory (Linux), for the tests that check what memory a change keeps."""

from __future__ import annotations


def rss_anon() -> int:
    """Bytes of anonymous memory resident now (/proc/self/status RssAnon: the heap and mappings, not files)."""
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")
