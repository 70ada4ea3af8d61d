"""The test suite's figures for docs/results.md: `make test` run as CI runs it, timed, its counts and its slowest
tests written to benchmarks/results/test_suite.json.

    python3 -m benchmarks.test_suite [--out benchmarks/results/test_suite.json]

Run it on a fresh clone with nothing else running, with any Python 3 (it needs only the standard library; `make
setup` is part of what it times, apart from the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    from compress.sizing.cpu import cpu_flags

    return sorted(f for f in cpu_flags() if f.startswith(("avx512_vnni", "avx512_bf16", "amx")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "test_suite.json"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    subprocess.run(["make", "setup"], cwd=ROOT, check=True)
    setup_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        xml = Path(d) / "junit.xml"
        t1 = time.perf_counter()
        rc = subprocess.run(["make", "test", f"PYTEST_ARGS=--junitxml={xml}"], cwd=ROOT).returncode
        test_s = time.perf_counter() - t1
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        cases = [(c.get("classname", "") + "::" + c.get("name", ""), float(c.get("time", 0))) for c in suite.iter("testcase")]
    total, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    result = {"date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "cores": os.cpu_count(),
              "cpu": _cpu_name(), "cpu_flags": _cpu_flags(),
              "load_average": os.getloadavg(), "returncode": rc, "passed": total - failures - errors - skipped,
              "failed": failures + errors, "skipped": skipped, "make_test_seconds": round(test_s, 1),
              "setup_seconds": round(setup_s, 1),
              "slowest": [{"test": n, "seconds": round(s, 1)} for n, s in sorted(cases, key=lambda c: -c[1])[:5]]}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
