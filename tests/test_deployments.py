"""Every deployment in prefect.yaml, run as the README says, against a real Prefect server, a process worker,
a real MLflow store and live model servers: compress (accepted, rejected, bad input), deploy (smoke test passes;
a failing smoke test moves the alias back), rollback, and two compress runs at once through the one worker.
Asserts final states, `--watch` exit codes and output, and where the aliases point."""

from __future__ import annotations

import json
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
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
           # As `make prefect-server`: `--watch` streams the flow's logs (the verdict and its reasons) only with these.
           "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true", "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true",
           # The worker looks for scheduled runs every second, not every 10 (Prefect's default): ten runs here.
           "PREFECT_WORKER_QUERY_SECONDS": "1"}
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
    for name in ("compress/nightly", "compress/on-demand", "deploy/on-demand", "rollback/on-demand", "draft/on-demand",
                 "draft/weekly"):
        assert name in listing.replace("\n", "").replace(" ", "") or name.split("/")[1] in listing

    nightly = _cli(env, "deployment", "inspect", "compress/nightly").stdout
    assert "0 3 * * *" in nightly

    bad = _cli(env, "deployment", "run", "compress/on-demand", "-p", "overrides=5")
    assert bad.returncode != 0 and "overrides" in (bad.stdout + bad.stderr)
    unknown = _cli(env, "deployment", "run", "compress/on-demand", "-p", "bogus=1")
    assert "bogus" in unknown.stdout + unknown.stderr

    worker = _start([str(BIN / "prefect"), "worker", "start", "--pool", "test-pool"], env, tmp / "worker.log")
    try:
        _operator_loop(env, tmp)
        _overlapping_runs(env, tmp)
    finally:
        _stop(worker)


def _overlapping_runs(env, tmp):
    """Two `prefect deployment run`s 3 s apart through the one worker, on one store, workdir and a new model name
    (issue 42): both end in a verdict state, one baseline, each accepted candidate once, one champion."""
    from test_overlapping_runs import COMMON, check_one_champion

    sets = [s for s in COMMON if not s.startswith(("registry.model_name", "mlflow.experiment"))]
    sets += ["registry.model_name=overlap-worker", f"workdir={tmp / 'work'}"]
    procs = []
    for k, method in enumerate(("weight_only", "dynamic")):
        overrides = json.dumps(sets + [f"quantize.method={method}"])
        procs.append(subprocess.Popen(
            [str(BIN / "prefect"), "deployment", "run", "compress/on-demand", "--watch", "-p",
             "config=configs/tiny.yaml", "-p", f"overrides={overrides}"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        if k == 0:  # the second starts once the first's flow run is computing (its load stage has begun)
            deadline = time.monotonic() + 300
            while not any((tmp / "work" / "load").glob("*")) and procs[0].poll() is None:
                assert time.monotonic() < deadline, "the first run never started its load stage"
                time.sleep(0.05)
    outs = [" ".join(p.communicate(timeout=600)[0].split()) for p in procs]
    log = (tmp / "worker.log").read_text()
    for p, out in zip(procs, outs):
        assert p.returncode in (0, 1), out[-3000:] + log[-3000:]
        assert "Traceback" not in out, out[-3000:]
        assert any(f"in state '{v}'" in out or f"in '{v}'" in out for v in ("Accepted", "Rejected", "Blocked")), \
            out[-3000:]
    check_one_champion(env["MLFLOW_TRACKING_URI"], "overlap-worker")


def _watch(env, tmp, *args) -> tuple[int, str]:
    run = _cli(env, "deployment", "run", *args, "--watch", timeout=600)
    out = " ".join((run.stdout + run.stderr).split())  # rich wraps long lines
    return run.returncode, out + "\n--- worker log ---\n" + (tmp / "worker.log").read_text()[-3000:]


def _aliases(env) -> dict:
    from mlflow import MlflowClient

    model = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_registered_model("tiny-llama")
    return {k: str(v) for k, v in model.aliases.items()}


def _served(url: str) -> str | None:
    try:
        data = httpx.get(url + "/v1/models", timeout=5).json()["data"]
    except httpx.HTTPError:
        return None
    return str(data[0]["version"]) if data else None


def _serve(env, tmp, model: str, name: str, *settings: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    extra = [x for s in settings for x in ("--set", s)]
    proc = _start([sys.executable, "-m", "serve", "--model", model, "--port", str(port),
                   "--set", "serve.poll_interval_s=0.5", "--set", "serve.kv_memory_mb=8", *extra], env,
                  tmp / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while _served(url) is None:
        assert proc.poll() is None and time.monotonic() < deadline, (tmp / f"{name}.log").read_text()[-2000:]
        time.sleep(0.5)
    return proc, url


def _card(url: str) -> dict:
    return httpx.get(url + "/v1/models", timeout=5).json()["data"][0]


def _wait_served(url: str, version: str) -> None:
    deadline = time.monotonic() + 60
    while _served(url) != version:
        assert time.monotonic() < deadline, f"{url} serves {_served(url)}, not {version}"
        time.sleep(0.5)


def _operator_loop(env, tmp):
    work = f"workdir={tmp / 'work'}"
    # compress/on-demand, accepted: the README's command (plus a scratch workdir).
    rc, out = _watch(env, tmp, "compress/on-demand", "-p", "config=configs/tiny.yaml", "-p", f'overrides=["{work}"]')
    assert rc == 0 and "Flow run finished successfully in 'Accepted'" in out, out[-4000:]
    assert "tiny-llama v1 (baseline)" in out and "tiny-llama v2 (candidate, champion)" in out, out[-4000:]
    assert "#/experiments/" in out  # the MLflow link
    assert (tmp / "work" / "export").is_dir()
    assert _aliases(env) == {"baseline": "1", "candidate": "2", "champion": "2"}

    # compress/on-demand, rejected by the gate: exit 1, the verdict and its reason on screen, no alias moves.
    rc, out = _watch(env, tmp, "compress/on-demand", "-p", "config=configs/tiny.yaml",
                     "-p", f'overrides=["{work}", "accept.min_top1_agreement=1.0", "accept.relax_trials=0"]')
    assert rc == 1 and "Flow run finished in state 'Rejected'" in out, out[-4000:]
    assert "min_top1_agreement" in out and "tiny-llama v3 (no alias)" in out, out[-4000:]
    assert "Traceback" not in out.split("--- worker log ---")[0], out[-4000:]  # a verdict, not an engine crash
    assert _aliases(env) == {"baseline": "1", "candidate": "2", "champion": "2"}

    # Bad input: exit 1, the state names the error and the output names the key.
    rc, out = _watch(env, tmp, "compress/on-demand", "-p", "config=configs/tiny.yaml",
                     "-p", f'overrides=["{work}", "data.bogus=1"]')
    assert rc == 1 and "Flow run finished in state 'ConfigError'" in out and "data.bogus: unknown key" in out, out[-4000:]
    assert "Traceback" not in out.split("--- worker log ---")[0], out[-4000:]
    missing = _watch(env, tmp, "compress/on-demand", "-p", "config=configs/missing.yaml")
    assert missing[0] == 1 and "configs/missing.yaml" in missing[1], missing[1][-4000:]

    # deploy/on-demand against a live server that follows the alias; `-p version=1` is a JSON int, as typed.
    live, live_url = _serve(env, tmp, "models:/tiny-llama@champion", "live")
    pinned = None
    try:
        assert _served(live_url) == "2"
        rc, out = _watch(env, tmp, "deploy/on-demand", "-p", "model_name=tiny-llama", "-p", "version=1",
                         "-p", f"server_url={live_url}")
        assert rc == 0 and "Flow run finished successfully in 'Deployed'" in out, out[-4000:]
        assert "tiny-llama@champion: 2 -> 1; smoke test passed" in out, out[-4000:]
        assert _aliases(env)["champion"] == "1" and _served(live_url) == "1"

        # A server that does not pick the version up fails the smoke test: the alias moves back.
        pinned, pinned_url = _serve(env, tmp, "models:/tiny-llama/1", "pinned")
        rc, out = _watch(env, tmp, "deploy/on-demand", "-p", "model_name=tiny-llama", "-p", "version=2",
                         "-p", f"server_url={pinned_url}", "-p", "wait_s=4")
        assert rc == 1 and "Flow run finished in state 'Reverted'" in out, out[-4000:]
        assert "tiny-llama@champion moved back to 1" in out, out[-4000:]
        assert _aliases(env)["champion"] == "1"

        # A rejected version is refused before anything moves.
        rc, out = _watch(env, tmp, "deploy/on-demand", "-p", "model_name=tiny-llama", "-p", "version=3",
                         "-p", f"server_url={live_url}")
        assert rc == 1 and "Flow run finished in state 'RegistryError'" in out and "rejected" in out, out[-4000:]
        assert _aliases(env)["champion"] == "1"

        # rollback/on-demand: back to the version champion pointed at before; the live server follows.
        rc, out = _watch(env, tmp, "rollback/on-demand", "-p", "model_name=tiny-llama")
        assert rc == 0 and "Flow run finished successfully in 'RolledBack'" in out, out[-4000:]
        assert "tiny-llama@champion: 1 -> 2" in out, out[-4000:]
        assert _aliases(env)["champion"] == "2"
        _wait_served(live_url, "2")

        # A pipeline run that promotes smoke-tests the server of its `serve` section when one serves the model.
        port = live_url.rsplit(":", 1)[1]
        rc, out = _watch(env, tmp, "compress/on-demand", "-p", "config=configs/tiny.yaml",
                         "-p", f'overrides=["{work}", "serve.port={port}"]')
        assert rc == 0 and "Flow run finished successfully in 'Accepted'" in out, out[-4000:]
        assert f"champion 2 -> 4, smoke test passed on {live_url}" in out, out[-4000:]
        assert _aliases(env) == {"baseline": "1", "candidate": "4", "champion": "4"}
        assert _served(live_url) == "4"

        # draft/on-demand: the champion's drafter, built, judged at one user and registered beside it (a tiny model's
        # speed proves nothing, so the bar is lowered); a server on `serve.speculative: auto` drafts with it.
        small = ["draft.prompts=16", "draft.max_tokens=24", "draft.tokens=5120", "draft.vocab=200",
                 "draft.width=64", "draft.min_speedup=0.0001"]
        rc, out = _watch(env, tmp, "draft/on-demand", "-p", "config=configs/tiny.yaml",
                         "-p", f"overrides={json.dumps([work, *small])}")
        assert rc == 0 and "Flow run finished successfully in 'Registered'" in out, out[-4000:]
        assert "tiny-llama/4: one user x" in out and "registered tiny-llama-drafter/1" in out, out[-4000:]
        from mlflow import MlflowClient

        tags = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_model_version("tiny-llama", "4").tags
        assert tags["drafter"] == "tiny-llama-drafter/1"
        drafting, drafting_url = _serve(env, tmp, "models:/tiny-llama@champion", "drafting", "serve.speculative=auto")
        try:
            for _ in range(3):
                r = httpx.post(drafting_url + "/v1/completions", json={"model": "tiny-llama", "prompt": "Hello",
                                                                       "max_tokens": 24, "temperature": 0})
                assert r.status_code == 200
            metrics = httpx.get(drafting_url + "/metrics").text
            drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total")]
            assert drafts and float(drafts[0].split()[-1]) > 0, metrics[-2000:]
            assert _card(drafting_url)["speculative"] == "tiny-llama-drafter/1"
            # The drafter follows the alias: a rollback to a version without one drafts by prompt lookup, and a deploy
            # of the drafter's target brings it back, both live.
            rc, out = _watch(env, tmp, "rollback/on-demand", "-p", "model_name=tiny-llama")
            assert rc == 0 and "tiny-llama@champion: 4 -> 2" in out, out[-4000:]
            _wait_served(drafting_url, "2")
            assert _card(drafting_url)["speculative"] == "prompt_lookup"
            rc, out = _watch(env, tmp, "deploy/on-demand", "-p", "model_name=tiny-llama", "-p", "version=4",
                             "-p", f"server_url={drafting_url}")
            assert rc == 0, out[-4000:]
            _wait_served(drafting_url, "4")
            assert _card(drafting_url)["speculative"] == "tiny-llama-drafter/1"
        finally:
            _stop(drafting)
    finally:
        _stop(live)
        if pinned is not None:
            _stop(pinned)
