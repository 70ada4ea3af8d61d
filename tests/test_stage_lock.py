"""Two runs that reach the same stage key at once (tasks/common.py): one computes, the other waits and reuses its
result, with real processes; a lock left by a dead process is broken; DONE.json appears whole or not at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from compress.config import load_config
from flows.stages import workdir
from tasks.common import DONE, StageRun, lock_path, mark_done, open_stage
from tasks.results import Distilled, Exported, Judged, Loaded, ResultFormatError

ROOT = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent("""
    import json, logging, os, sys, time
    logging.basicConfig(level=logging.INFO)
    from compress.config import load_config
    from tasks.common import StageRun, mark_done, open_stage
    from tasks.results import Distilled
    workdir, peer_log = sys.argv[1], sys.argv[2]
    cfg = load_config("configs/tiny.yaml", [f"workdir={workdir}"])
    folder, done = open_stage(StageRun(cfg.workdir, "export", "samekey"), Distilled)
    if done is None:
        with open(os.path.join(workdir, "computed"), "a") as fh:
            fh.write(f"{os.getpid()}\\n")
        (folder / "artifact.bin").write_bytes(b"x" * 1000)
        deadline = time.monotonic() + 60
        # finish only once the other run says it waits on this one's lock: the wait path is what is tested
        while "waiting to reuse its result" not in open(peer_log).read():
            assert time.monotonic() < deadline, "the second run never waited"
            time.sleep(0.05)
        done = mark_done(folder, Distilled(model_dir=str(folder), metrics={"by": os.getpid()}))
    print(json.dumps(done.to_json()))
""")


def _at(cfg, stage: str, key: str) -> StageRun:
    return StageRun(str(workdir(cfg)), stage, key)


def _until(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_two_runs_on_one_key_compute_it_once(tmp_path):
    """The second run starts once the first holds the lock and is computing; the first finishes only after the
    second has logged that it waits, so the second's result is the first's, reused after a real wait."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    for log in logs:
        log.write_text("")
    work = tmp_path / "work"
    work.mkdir()

    def start(own: Path, peer: Path):
        return subprocess.Popen([sys.executable, "-c", WORKER, str(work), str(peer)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=open(own, "w"), text=True)

    first = start(logs[0], logs[1])
    _until(lambda: (work / "computed").exists() or first.poll() is not None, "the first run to take the lock")
    second = start(logs[1], logs[0])
    outs = [p.communicate(timeout=120)[0] for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], [log.read_text()[-2000:] for log in logs]
    computed = (work / "computed").read_text().split()
    assert computed == [str(first.pid)]  # one computed, the other waited
    assert "waiting to reuse its result" in logs[1].read_text()
    results = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert results[0]["metrics"] == results[1]["metrics"] == {"by": first.pid}
    cfg = load_config("configs/tiny.yaml", [f"workdir={work}"])
    assert not lock_path(_at(cfg, "export", "samekey").folder).exists()


def test_a_dead_runs_lock_is_broken_and_its_folder_redone(tmp_path):
    cfg = load_config("configs/tiny.yaml", [f"workdir={tmp_path}"])
    folder = _at(cfg, "export", "k").folder
    folder.mkdir(parents=True)
    (folder / "half-written.bin").write_bytes(b"x")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    lock_path(folder).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    got, done = open_stage(_at(cfg, "export", "k"), Exported)
    assert done is None and got == folder and list(folder.iterdir()) == []  # wiped: redone from scratch
    assert json.loads(lock_path(folder).read_text())["pid"] == os.getpid()
    got, done = open_stage(_at(cfg, "export", "k"), Exported)  # a retry in the same process: its own lock
    assert done is None


def test_an_empty_lock_left_by_a_crash_is_broken_once_old(tmp_path):
    cfg = load_config("configs/tiny.yaml", [f"workdir={tmp_path}"])
    folder = _at(cfg, "export", "e").folder
    folder.parent.mkdir(parents=True)
    lock = lock_path(folder)
    lock.write_text("")  # a process died between creating the lock and writing its owner
    old = os.stat(lock).st_mtime - 120
    os.utime(lock, (old, old))
    got, done = open_stage(_at(cfg, "export", "e"), Exported)
    assert done is None and json.loads(lock.read_text())["pid"] == os.getpid()


def test_a_result_of_another_format_is_computed_again_not_handed_on(tmp_path):
    """A DONE.json whose fields are not the stage's result class (older code, a renamed field) is refused by name,
    and open_stage treats the stage as not finished; a whole result of the class is reused as it was written."""
    cfg = load_config("configs/tiny.yaml", [f"workdir={tmp_path}"])
    folder = _at(cfg, "load", "k").folder
    folder.mkdir(parents=True)
    written = Loaded(model_dir="m", splits="s.npz", heldout="h.npz", info={"family": "llama"},
                     exporter_auto=["gqa", "fits"], metrics={"blocks": 3})
    old = {**written.to_json(), "split_file": "s.npz"}
    del old["splits"]  # the field as an older version named it
    with pytest.raises(ResultFormatError, match=r"unknown fields \['split_file'\]; missing fields \['splits'\]"):
        Loaded.from_json(old)
    (folder / DONE).write_text(json.dumps(old))
    got, done = open_stage(_at(cfg, "load", "k"), Loaded)
    assert done is None and not (folder / DONE).exists()
    mark_done(folder, written)
    assert open_stage(_at(cfg, "load", "k"), Loaded)[1] == written
    with pytest.raises(ResultFormatError, match="not the fields of Exported"):
        Exported.from_json(written.to_json())


def test_a_verdict_round_trips_and_names_its_figures_once():
    v = Judged(accepted=False, reasons=["r"], criteria="fidelity", metrics={"gate_perplexity_ratio": 1.2},
               checks=[{"name": "perplexity_ratio", "value": 1.2, "limit": 1.1, "passed": False}],
               gate={"gate_perplexity_ratio": 1.2, "gate_top1_agreement": 0.8}, candidate={"perplexity": 12.0,
               "size_bytes": 50, "note": "x"}, baseline={"perplexity": 10.0, "size_bytes": 200},
               side={"heldout_perplexity_ratio": 1.3, "heldout_baseline_perplexity": 9.0})
    assert Judged.from_json(json.loads(json.dumps(v.to_json()))) == v
    assert v.status == "rejected" and v.value("perplexity_ratio") == 1.2 and v.size_ratio() == 0.25
    assert v.gate_figures() == {"perplexity_ratio": 1.2, "top1_agreement": 0.8}
    assert v.figures() == {"perplexity": 12.0, "size_bytes": 50, "gate_perplexity_ratio": 1.2,
                           "gate_top1_agreement": 0.8, "heldout_perplexity_ratio": 1.3,
                           "heldout_baseline_perplexity": 9.0}
    assert v.baseline_figures() == {"perplexity": 10.0, "size_bytes": 200, "heldout_perplexity": 9.0}
    assert Distilled.from_json({"model_dir": "d", "metrics": {}}).model_dir == "d"


def test_the_docs_table_of_stage_results_is_the_code():
    """docs/architecture.md "What a stage hands on" lists every result class of tasks/results.py with its fields."""
    import dataclasses
    import re

    from tasks import results

    doc = (ROOT / "docs" / "architecture.md").read_text().split("### What a stage hands on", 1)[1].split("\n\n")[1]
    rows = {m.group(1): [f.strip() for f in m.group(2).split(",")]
            for m in re.finditer(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|$", doc, re.M)}
    classes = {name: [f.name for f in dataclasses.fields(c)] for name, c in vars(results).items()
               if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__ == results.__name__
               and c is not results.StageResult}
    assert rows == classes


def test_the_prefect_cache_key_follows_the_result_classes_fields(monkeypatch):
    """A renamed field changes RESULTS_FORMAT (a digest of every class's fields), so Prefect never hands on a result
    it pickled under the old layout."""
    import dataclasses

    from tasks import results

    before = results._layout()
    renamed = dataclasses.make_dataclass("Loaded", [("model_dir", str), ("split_file", str), ("heldout", str),
                                                    ("info", dict), ("exporter_auto", list), ("metrics", dict)],
                                         bases=(results.StageResult,), frozen=True)
    renamed.__module__ = results.__name__
    monkeypatch.setattr(results, "Loaded", renamed)
    assert results._layout() != before
    monkeypatch.undo()
    assert results._layout() == before == results.RESULTS_FORMAT
