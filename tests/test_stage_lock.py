"""Two runs that reach the same stage key at once (tasks/common.py): one computes, the other waits and reuses its
result, with real processes; a lock left by a dead process is broken; DONE.json appears whole or not at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from compress.config import load_config
from tasks.common import lock_path, open_stage, stage_dir

ROOT = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent("""
    import json, os, sys, time
    from compress.config import load_config
    from tasks.common import mark_done, open_stage
    cfg = load_config("configs/tiny.yaml", [f"workdir={sys.argv[1]}"])
    folder, done = open_stage(cfg, "export", "samekey")
    if done is None:
        with open(os.path.join(sys.argv[1], "computed"), "a") as fh:
            fh.write(f"{os.getpid()}\\n")
        (folder / "artifact.bin").write_bytes(b"x" * 1000)
        time.sleep(3)  # the other run arrives while this one computes
        done = mark_done(folder, {"by": os.getpid()})
    print(json.dumps(done))
""")


def test_two_runs_on_one_key_compute_it_once(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    computed = (tmp_path / "computed").read_text().split()
    assert len(computed) == 1  # one computed, the other waited
    results = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert results[0] == results[1] == {"by": int(computed[0])}
    cfg = load_config("configs/tiny.yaml", [f"workdir={tmp_path}"])
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
