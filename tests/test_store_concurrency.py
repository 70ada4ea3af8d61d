"""The embedded sqlite store under writers from several processes at once (serve/registry/client.use_wal): every
write lands, none fails with "database is locked"."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WRITER = textwrap.dedent("""
    import sys
    import mlflow
    from serve.registry.client import connect
    connect(sys.argv[1])
    mlflow.set_experiment("race")
    with mlflow.start_run(run_name=sys.argv[2]):
        for i in range(40):
            mlflow.log_metric("step", i, step=i)
            mlflow.set_tag(f"t{i}", i)
    print("ok")
""")


def test_three_processes_write_one_store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), MLFLOW_ARTIFACT_ROOT=str(tmp_path / "art"))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, uri, f"w{k}"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-1500:] for o in outs]
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("SELECT COUNT(*) FROM metrics WHERE key = 'step'").fetchone()[0] == 3 * 40
        assert db.execute("SELECT COUNT(*) FROM tags WHERE key LIKE 't%'").fetchone()[0] == 3 * 40
