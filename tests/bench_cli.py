"""Benchmark entry points run as their users run them: ``python -m benchmarks.<name> ...`` in a process of its own.

``from bench_cli import run_bench`` (pytest puts tests/ on sys.path). Tests never import a benchmark script: what
they need from one is its command line and the results file it writes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench(name: str, *args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run benchmarks.<name> with ``args`` from the project root; ``env`` on top of this process's environment."""
    return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *map(str, args)], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})
