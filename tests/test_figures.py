"""Every figure of README.md and docs/results.md names the results file it comes from, and is in it.

A unit is a paragraph or a table row; a row names its file itself or inherits the files its table's caption (the
paragraph above the table) names. A figure is a number with a decimal point or thousands separator, or one with a
unit (s, ms, MiB, GiB, tokens/s, %, x). It is in a file when a number there rounds to it (as written: bytes may be
shown in KiB/MiB/GiB, shares in %, seconds in ms), or, for a ratio (x), when two numbers there divide to it.
Limits ("limit 1.10"), counts ("16 of 16"), dates and the digits of model names are not figures.
"""

from __future__ import annotations

import bisect
import json
import re
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILE = re.compile(r"benchmarks/results/[\w./*-]+\.json")
FIGURE = re.compile(r"(?<![\w.\-/])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+(?:e-?\d+)?|\d+(?=\s?(?:s\b|ms\b|MiB|GiB|KiB|"
                    r"tokens/s|×|x\b|%)))(?![\w.])")
NOT_FIGURES = re.compile(
    r"`[^`]*`|\[[^\]]*\]\([^)]*\)|[A-Za-z][\w.]*?\d[\w.]*-\d[\w.]*|\b\d+(?:\.\d+)?[BMK]\b|Qwen\d\.\d|Llama-\d\.\d|"
    r"[Gg]emma \d|SmolLM\d|runs? [\d–-]+|\d{4}-\d\d-\d\d|\d\d:\d\d|\(?limit \d[\d.]*|\b[cb]\d+\b|Q\d_\w+|"
    r"block \d+|\d+ of \d+|\d+ ?× ?\d+|(?<![\d.,])\d+ (?:users|requests|prompts|tokens|cores|rows|branches)\b(?!/)")
RATIO_AFTER = re.compile(r"(?:–[\d.,]+)?\s?[×x]")  # "1.25x", "6.5–7.8×": a ratio (the range's start too)
SCALES = (1.0, 2**-30, 2**-20, 2**-10, 100.0, 1000.0)


def _numbers(obj, out: list[float]) -> None:
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        out.append(float(obj))
    elif isinstance(obj, dict):
        for v in obj.values():
            _numbers(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _numbers(v, out)


@lru_cache(maxsize=None)
def values_of(pattern: str) -> tuple[float, ...]:
    paths = sorted(ROOT.glob(pattern))
    assert paths, f"{pattern}: no such results file"
    out: list[float] = []
    for p in paths:
        _numbers(json.loads(p.read_text()), out)
    return tuple(sorted({v for v in out if v == v}))


def _in(x: float, tol: float, vals: tuple[float, ...]) -> bool:
    i = bisect.bisect_left(vals, x - tol)
    return i < len(vals) and vals[i] <= x + tol


def found(token: str, ratio: bool, vals: tuple[float, ...]) -> bool:
    t = token.replace(",", "")
    x = float(t)
    decimals = len(t.split(".")[1].split("e")[0]) if "." in t else 0
    tol = abs(x) * 0.05 if "e" in t else 0.5 * 10 ** -decimals + 1e-9
    if any(_in(x / s, tol / s, vals) for s in SCALES):
        return True
    if ratio and x > 0:  # a / b == x: look for b near a / x
        return any(_in(a / x, tol * abs(a) / x**2 + 1e-12, vals) for a in vals if a > 0)
    return False


def units(text: str):
    """(unit, files it names or inherits) for every paragraph and table row."""
    caption: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.strip().splitlines()
        if lines and all(line.startswith("|") for line in lines):
            for line in lines[2:]:
                yield line, FILE.findall(line) or caption
        elif block.strip() and not block.lstrip().startswith("#"):
            caption = FILE.findall(block)
            yield block, caption


def problems(text: str) -> list[str]:
    out = []
    for unit, files in units(text):
        plain = NOT_FIGURES.sub(" ", unit)
        figures = [(m.group(1), bool(RATIO_AFTER.match(plain, m.end()))) for m in FIGURE.finditer(plain)]
        if not figures:
            continue
        short = " ".join(unit.split())[:100]
        if not files:
            out.append(f"names no results file: {short!r} ({', '.join(f for f, _ in figures)})")
            continue
        vals = tuple(sorted(set().union(*(values_of(f) for f in files))))
        missing = [f for f, ratio in figures if not found(f, ratio, vals)]
        if missing:
            out.append(f"not in {files}: {missing} in {short!r}")
    return out


@pytest.mark.parametrize("name, text", [("README.md", lambda: (ROOT / "README.md").read_text()),
                                        ("docs/results.md", lambda: (ROOT / "docs" / "results.md").read_text())])
def test_every_figure_names_its_results_file_and_is_in_it(name, text):
    bad = problems(text())
    assert not bad, f"{name}:\n  " + "\n  ".join(bad)


def test_the_check_finds_a_figure_that_is_not_in_its_file(tmp_path, monkeypatch):
    """The rules above, on a file of our own: what rounds, converts or divides to a figure passes; another number,
    or a paragraph with figures and no file, is reported."""
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "x.json").write_text(json.dumps({"tps": 14.23, "rss_bytes": 2_157_969_408, "base_gib": 2.3,
                                                "peak_gib": 5.41, "share": 0.318}))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    values_of.cache_clear()
    ok = "Ours made 14.2 tokens/s in 2,058 MiB (2.35× the 2.30 GiB of weights), 31.8 % of it; limit 1.10.\n" \
         "Its file: `benchmarks/results/x.json`."
    assert problems(ok) == []
    assert problems(ok.replace("14.2", "14.4")) == [
        "not in ['benchmarks/results/x.json']: ['14.4'] in " + repr(" ".join(ok.replace("14.2", "14.4").split())[:100])]
    assert problems("A caption.\n\n| h |\n|---|\n| 14.2 |") == ["names no results file: '| 14.2 |' (14.2)"]
    values_of.cache_clear()


def test_every_benchmark_script_is_listed_once_in_its_readme():
    """benchmarks/ holds a handful of maintained tools (issue 72: at most 12 Python files, __init__.py counted), and
    benchmarks/README.md lists each once, in its table of maintained tools, with the results files it writes."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    assert "\n## " not in text.split("## Maintained tools", 1)[1], "one section: every script is a maintained tool"
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \| (.*?) \| (.+?) \|$", text, re.M)
    names = [name for name, *_ in rows]
    scripts = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")
    assert names and sorted(names) == scripts and len(set(names)) == len(names), (names, scripts)
    assert len(list((ROOT / "benchmarks").glob("*.py"))) <= 12
    silent = [name for name, _what, results, _quoted in rows if ".json`" not in results]
    assert not silent, f"tools listed without the results files they write: {silent}"
