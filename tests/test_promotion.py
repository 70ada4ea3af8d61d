"""Promotion as compare-and-set (flows/promotion.py): the lock serialises real processes, and a champion that moved
while a run was judged is judged again inside it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flows.promotion import decide_promotion, lost_race, promote_if_still_best, verdict_status

ROOT = Path(__file__).resolve().parents[1]


def _vs(version, worse):
    return {"version": version, "worse_on_use": worse, "use": {"candidate": 1.05, "champion": 1.01}}


@pytest.mark.parametrize("judged, now, when_worse, lost", [
    (None, None, False, False),                      # no champion then or now
    (_vs("3", False), _vs("3", True), False, False),  # the champion it judged against: already decided before
    (_vs("3", False), _vs("4", False), False, False),  # moved, and the candidate is not worse than the new one
    (_vs("3", False), _vs("4", True), False, True),    # moved to a better one: not promoted
    (None, _vs("4", True), False, True),               # no champion when judged, a better one now
    (_vs("3", False), _vs("4", True), True, False),    # promote_when_worse lets it through
])
def test_lost_race(judged, now, when_worse, lost):
    why = lost_race(judged, now, when_worse)
    assert (why is not None) == lost
    if lost:
        assert "v4" in why and "1.0500x vs 1.0100x" in why and "promote_when_worse" in why


SLOW = "decode 0.8x < accept.min_decode_speed_ratio 1.0"


@pytest.mark.parametrize("status, promote, bench, vs, when_worse, aliases, promoted, blocked", [
    ("accepted", True, None, None, False, ("candidate",), True, None),           # no champion yet
    ("accepted", True, None, _vs("2", False), False, ("candidate",), True, None),  # better than the champion
    ("accepted", True, None, _vs("2", True), False, (), False, "v2"),             # worse on the chat set
    ("accepted", True, None, _vs("2", True), True, ("candidate",), True, None),    # ... let through
    ("accepted", True, SLOW, None, False, (), False, SLOW),                       # under the speed floor
    ("accepted", True, SLOW, _vs("2", True), True, (), False, SLOW),              # the floor whatever the chat
    ("accepted", False, None, _vs("2", True), False, ("candidate",), False, None),  # promote off: judged, kept
    ("rejected", True, None, None, False, (), False, None),                       # the gate said no
    ("rejected", True, SLOW, None, False, (), False, SLOW),
    ("unchecked", True, None, None, False, ("candidate",), False, None),          # no gate: never champion
])
def test_decide_promotion(status, promote, bench, vs, when_worse, aliases, promoted, blocked):
    d = decide_promotion(status, promote, bench, vs, when_worse)
    assert (d.aliases, d.promote) == (aliases, promoted)
    if blocked is None:
        assert d.blocked is None
    else:
        assert blocked in d.blocked
    if blocked == "v2":
        assert "1.0500x vs 1.0100x" in d.blocked and "promote_when_worse" in d.blocked


def test_verdict_status():
    from tasks.results import Judged

    verdicts = [Judged(accepted=a, reasons=[], criteria="fidelity", checks=[], metrics={}) for a in (True, False)]
    assert [verdict_status(v) for v in (None, *verdicts)] == ["unchecked", "accepted", "rejected"]


def test_a_lost_race_promotes_nothing(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    called = []
    out, why = promote_if_still_best(uri, "m", _vs("3", False), lambda: _vs("4", True), False,
                                     lambda: called.append(1) or {"ok": True})
    assert out is None and "v4" in why and called == []
    out, why = promote_if_still_best(uri, "m", _vs("3", False), lambda: _vs("3", False), False, lambda: {"ok": True})
    assert out == {"ok": True} and why is None


HOLDER = textwrap.dedent("""
    import os, sys, time
    from flows.promotion import promotion_lock
    uri, me, release = sys.argv[1], sys.argv[2], sys.argv[3]
    open(me + ".trying", "w").close()
    with promotion_lock(uri, "tiny model/x"):
        print(f"{time.time():.6f}", flush=True)
        open(me + ".held", "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(release):  # the test lets go once the other process is at the lock
            assert time.monotonic() < deadline
            time.sleep(0.02)
        print(f"{time.time():.6f}", flush=True)
""")


def _until(cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_the_lock_serialises_processes(tmp_path):
    """The first process holds the lock until the second has started and is at the lock (its .trying file, written
    just before it asks); the second then holds it only after the first let go, and not before."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    a, b, release = (str(tmp_path / n) for n in ("a", "b", "release"))

    def start(me: str, release_file: str):
        return subprocess.Popen([sys.executable, "-c", HOLDER, uri, me, release_file], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = start(a, release)
    _until(lambda: os.path.exists(a + ".held") or first.poll() is not None)
    second = start(b, b + ".go")
    _until(lambda: os.path.exists(b + ".trying") or second.poll() is not None)
    assert not os.path.exists(b + ".held")  # at the lock, not past it
    open(release, "w").close()
    open(b + ".go", "w").close()  # the second lets go as soon as it has the lock
    spans = []
    for p in (first, second):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-1500:]
        spans.append(tuple(float(x) for x in out.split()))
    (a0, a1), (b0, b1) = spans
    assert b0 >= a1 - 0.01  # the second took the lock only after the first let go
    assert list(tmp_path.glob("mlflow.db.promote-tiny_model_x.lock"))
