"""One-off measurement scripts behind the figures in docs/ (not installed; nothing imports them).

Run from the project root as modules, so the project's packages import without path tricks:
``.venv/bin/python -m benchmarks.<script> --help``. Their results go to .cache/bench/ or
benchmarks/results/. The reusable load-testing library is the ``loadtest`` package.
"""
