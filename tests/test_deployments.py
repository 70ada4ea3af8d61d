"""prefect.yaml against a real Prefect server and process worker: deploy, run on demand, reject bad parameters."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _stop(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=20)
    except Exception:
        os.killpg(p.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefect")
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp / "home"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "COMPRESSOR_POOL": "test-pool", "PWD": str(ROOT), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}
    server = _start([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, tmp / "server.log")
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("prefect server did not become healthy:\n" + (tmp / "server.log").read_text()[-2000:])
        yield env, tmp
    finally:
        _stop(server)


def _cli(env, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "prefect"), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_deploy_and_run_on_demand(prefect_server):
    env, tmp = prefect_server
    assert _cli(env, "work-pool", "create", "test-pool", "--type", "process").returncode == 0
    dep = _cli(env, "--no-prompt", "deploy", "--all")
    assert dep.returncode == 0, dep.stdout[-2000:] + dep.stderr[-2000:]
    listing = _cli(env, "deployment", "ls").stdout
    for name in ("compress/nightly", "compress/on-demand", "deploy/on-demand", "rollback/on-demand"):
        assert name in listing.replace("\n", "").replace(" ", "") or name.split("/")[1] in listing

    nightly = _cli(env, "deployment", "inspect", "compress/nightly").stdout
    assert "0 3 * * *" in nightly

    bad = _cli(env, "deployment", "run", "compress/on-demand", "-p", "overrides=5")
    assert bad.returncode != 0 and "overrides" in (bad.stdout + bad.stderr)
    unknown = _cli(env, "deployment", "run", "compress/on-demand", "-p", "bogus=1")
    assert "bogus" in unknown.stdout + unknown.stderr

    worker = _start([str(BIN / "prefect"), "worker", "start", "--pool", "test-pool"], env, tmp / "worker.log")
    try:
        run = _cli(env, "deployment", "run", "compress/on-demand", "-p", "config=configs/tiny.yaml",
                   "-p", f'overrides=["workdir={tmp / "work"}"]', "--watch", timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + (tmp / "worker.log").read_text()[-3000:]
        assert (tmp / "work" / "export").is_dir()
        failing = _cli(env, "deployment", "run", "compress/on-demand", "-p", "config=configs/missing.yaml", "--watch",
                       timeout=600)
        assert failing.returncode == 1
    finally:
        _stop(worker)
