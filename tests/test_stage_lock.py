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

from compress.config import load_config
from tasks.common import lock_path, open_stage, stage_dir

ROOT = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent("""
    import json, logging, os, sys, time
    logging.basicConfig(level=logging.INFO)
    from compress.config import load_config
    from tasks.common import mark_done, open_stage
    workdir, peer_log = sys.argv[1], sys.argv[2]
    cfg = load_config("configs/tiny.yaml", [f"workdir={workdir}"])
    folder, done = open_stage(cfg, "export", "samekey")
    if done is None:
        with open(os.path.join(workdir, "computed"), "a") as fh:
            fh.write(f"{os.getpid()}\\n")
        (folder / "artifact.bin").write_bytes(b"x" * 1000)
        deadline = time.monotonic() + 60
        # finish only once the other run says it waits on this one's lock: the wait path is what is tested
        while "waiting to reuse its result" not in open(peer_log).read():
            assert time.monotonic() < deadline, "the second run never waited"
            time.sleep(0.05)
        done = mark_done(folder, {"by": os.getpid()})
    print(json.dumps(done))
""")


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
    assert results[0] == results[1] == {"by": first.pid}
    cfg = load_config("configs/tiny.yaml", [f"workdir={work}"])
    assert not lock_path(stage_dir(cfg, "export", "samekey")).exists()


def test_a_dead_runs_lock_is_broken_and_its_folder_redone(tmp_path):
    cfg = load_config("configs/tiny.yaml", [f"workdir={tmp_path}"])
    folder = stage_dir(cfg, "export", "k")
    folder.mkdir(parents=True)
    (folder / "half-written.bin").write_bytes(b"x")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    lock_path(folder).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    got, done = open_stage(cfg, "export", "k")
    assert done is None and got == folder and list(folder.iterdir()) == []  # wiped: redone from scratch
    assert json.loads(lock_path(folder).read_text())["pid"] == os.getpid()
    got, done = open_stage(cfg, "export", "k")  # a retry in the same process: its own lock
    assert done is None


def test_an_empty_lock_left_by_a_crash_is_broken_once_old(tmp_path):
    cfg = load_config("configs/tiny.yaml", [f"workdir={tmp_path}"])
    folder = stage_dir(cfg, "export", "e")
    folder.parent.mkdir(parents=True)
    lock = lock_path(folder)
    lock.write_text("")  # a process died between creating the lock and writing its owner
    old = os.stat(lock).st_mtime - 120
    os.utime(lock, (old, old))
    got, done = open_stage(cfg, "export", "e")
    assert done is None and json.loads(lock.read_text())["pid"] == os.getpid()
