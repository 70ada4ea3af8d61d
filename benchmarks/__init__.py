"""The maintained measurement tools behind the figures in README.md and docs/ (not installed; nothing imports them).

Run from the project root as modules, so the project's packages import without path tricks:
``.venv/bin/python -m benchmarks.<tool> --help``. A tool that took in a former script runs it as a mode named by a
flag (``python -m benchmarks.ceiling --roofline --help``). Results go to benchmarks/results/; README.md here lists
each tool and the figures it produces. The reusable load-testing library is the ``loadtest`` package.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def run_modes(default: Callable, modes: dict[str, Callable], argv: list[str] | None = None):
    """Run the mode whose flag is in ``argv`` (``--roofline ...``) on the other arguments, else ``default(argv)``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for flag, mode in modes.items():
        if flag in argv:
            argv.remove(flag)
            return mode(argv)
    return default(argv)
