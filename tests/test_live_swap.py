"""Live model swaps: the server follows the MLflow alias, keeps serving through a corrupt version,
lets an in-flight stream finish on the old model, rolls back, and drains old engines."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import time

import httpx
import pytest

from serve.api.app import create_app
from serve.api.background import BackgroundServer
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.registry.resolver import ModelSourceError, parse_model_uri
from serve.registry.source import ModelManager
from step_gate import held_steps
from served import on_socket, serve_cfg

pytestmark = pytest.mark.timeout(180)

NAME = "tiny-serve-swap"
POLL_S = 0.2


cfg = serve_cfg


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def wait_for(cond, timeout=60.0, what="condition"):
    """Poll ``cond``; the timeout only matters if something hangs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return time.monotonic()
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def alias_polls(mgr, poller_only: bool = True):
    """Every alias poll (the poller thread's ``reload()``; with ``poller_only=False`` also the first-load
    retries) from now on: [(monotonic start, ReloadResult)], each appended once that reload has returned.
    Tests count polls instead of sleeping a number of poll intervals (a loaded machine polls less often)."""
    polls, reload = [], mgr.reload

    def counted(force=False):
        t = time.monotonic()
        res = reload(force)
        if not poller_only or threading.current_thread().name == "alias-poller":
            polls.append((t, res))
        return res

    mgr.reload = counted
    try:
        yield polls
    finally:
        del mgr.reload  # back to the class's method


@pytest.fixture(scope="module")
def versions(mlflow_store, tiny_artifact, seed1_artifact, tmp_path_factory):
    """v1 = seed 0 (champion), v2 = seed 1, v3 = a corrupt copy of v1 (model.onnx altered after hashing)."""
    import mlflow

    from compress.registry import store as registry

    corrupt = tmp_path_factory.mktemp("swap") / "corrupt"
    shutil.copytree(tiny_artifact, corrupt)
    data = bytearray((corrupt / "model.onnx").read_bytes())
    data[-100] ^= 0xFF  # same size, different sha256
    (corrupt / "model.onnx").write_bytes(bytes(data))

    root = tmp_path_factory.mktemp("swap_mlruns")
    exp = mlflow.create_experiment(f"{NAME}-{time.time_ns()}", artifact_location=root.as_uri())
    out = {}
    for key, folder in (("v1", tiny_artifact), ("v2", seed1_artifact), ("v3", corrupt)):
        with mlflow.start_run(experiment_id=exp) as run:  # one run per version: each logs its own "artifact/"
            v = registry.register_folder(folder, NAME, run.info.run_id, {"role": key},
                                         ["champion"] if key == "v1" else [])
        out[key] = str(v.version)
    assert [out["v1"], out["v2"], out["v3"]] == ["1", "2", "3"]
    return out


@pytest.fixture(scope="module")
def refs(tiny_artifact, seed1_artifact):
    engines = {"v1": Engine(tiny_artifact, cfg(), start=False), "v2": Engine(seed1_artifact, cfg(), start=False)}
    yield engines
    for e in engines.values():
        e.shutdown()


@pytest.fixture(scope="module")
def server(versions, mlflow_store):
    app = create_app(f"models:/{NAME}@champion", cfg(poll_interval_s=POLL_S), tracking_uri=mlflow_store)
    with on_socket(app) as srv:
        yield srv


def served(http) -> str | None:
    [m] = http.get("/v1/models").json()["data"]
    assert m["id"] == NAME
    return m["version"]


def greedy(http, prompt: str, n: int = 12) -> dict:
    r = http.post("/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                           "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def expected(refs, key: str, prompt: str, n: int = 12) -> str:
    return refs[key].add_request(prompt, SamplingParams.greedy(n, ignore_eos=True)).result(timeout=60).text


def test_model_uri_parsing(tmp_path):
    spec = parse_model_uri("models:/m@champion")
    assert (spec.name, spec.alias, spec.version, spec.follows_alias) == ("m", "champion", None, True)
    spec = parse_model_uri("models:/m/7")
    assert (spec.name, spec.alias, spec.version, spec.follows_alias) == ("m", None, "7", False)
    for bad in ("models:/", "models:/m", "models:/m@", "models:/m/x"):
        with pytest.raises(ModelSourceError, match="models:/NAME@ALIAS"):
            parse_model_uri(bad)
    with pytest.raises(ModelSourceError, match="no manifest.json"):
        parse_model_uri(str(tmp_path))


def test_serves_the_champion(server, http, refs):
    assert served(http) == "1"
    [m] = http.get("/v1/models").json()["data"]
    assert m["alias"] == "champion" and m["uri"] == f"models:/{NAME}@champion"
    out = greedy(http, "swap me")
    assert out["choices"][0]["text"] == expected(refs, "v1", "swap me")
    assert out["system_fingerprint"] == f"{NAME}-v1"
    assert metric(http.get("/metrics").text, "compressor:served_model_version") == 1


def test_corrupt_version_is_refused_and_the_old_one_keeps_serving(server, http, refs, versions):
    from compress.registry import store as registry

    mgr = server.app.state.manager
    with alias_polls(mgr) as polls:
        registry.set_alias(NAME, "champion", versions["v3"])
        # Until the failing poll has returned: the failure counter goes up a moment before last_error is set.
        wait_for(lambda: any(res.error for _, res in polls), what="the corrupt version's load failure")
    assert metric(http.get("/metrics").text, "compressor:model_load_failures_total") == 1
    assert "sha256" in mgr.last_error and "still serving version 1" in mgr.last_error
    with alias_polls(mgr) as polls:  # three more polls: it is not retried, nothing changes
        wait_for(lambda: len(polls) >= 3, what="three more alias polls")
    assert all(not res.changed and res.previous == "1" for _, res in polls), polls
    assert metric(http.get("/metrics").text, "compressor:model_load_failures_total") == 1
    assert served(http) == "1" and http.get("/ready").status_code == 200
    assert greedy(http, "still here")["choices"][0]["text"] == expected(refs, "v1", "still here")


def test_alias_move_swaps_while_an_inflight_stream_finishes_on_the_old_model(server, http, refs, versions):
    from compress.registry import store as registry

    n = 450
    prompt = "a stream that spans the swap"
    want_old = expected(refs, "v1", prompt, n)
    greedy(http, "fill the cache")
    assert metric(http.get("/metrics").text, "compressor:result_cache_entries") >= 1
    mgr = server.app.state.manager
    old_engine = mgr.current.engine
    # The old engine's steps after the first are held until the swap has landed and been checked: the
    # stream is provably still generating on the old model across the swap (unheld, its 450 tokens can
    # be done in a fraction of a second, before the alias is even moved). The prompt's first greedy token
    # has text of its own, so the first event comes from the first step.
    with httpx.Client(base_url=server.url, timeout=30) as slow, held_steps(old_engine, after=1) as hold, \
            alias_polls(mgr) as polls:
        body = {"model": NAME, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with slow.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = json.loads(next(lines)[6:])
            assert first["system_fingerprint"] == f"{NAME}-v1"
            hold.wait_held()
            wait_for(lambda: polls, what="an alias poll")  # any poll begun before `polls` existed is over
            t0 = time.monotonic()
            registry.set_alias(NAME, "champion", versions["v2"])
            # Until the poll that swapped has returned: /v1/models shows the new version a moment before
            # the swap's callbacks (the result cache is emptied there) have run.
            t1 = wait_for(lambda: any(res.changed for _, res in polls), what="a poll to swap the model")
            assert served(http) == "2"
            # Picked up by the poll under way when the alias moved or, at the latest, the next one
            # (each poll: read the alias, then download, verify, load, warm up).
            changed = [i for i, (_, res) in enumerate(polls) if res.changed]
            next_poll = next((i for i, (start, _) in enumerate(polls) if start >= t0), len(polls))
            assert len(changed) == 1 and changed[0] <= next_poll and polls[changed[0]][1].version == "2", polls
            text = http.get("/metrics").text
            assert metric(text, "compressor:served_model_version") == 2
            assert metric(text, "compressor:result_cache_entries") == 0  # emptied by the swap
            # The stream is still running on the old model, which drains instead of stopping.
            assert old_engine.stats().num_running == 1 and metric(text, "compressor:models_draining") == 1
            # New requests already go to the new model while the old stream is open.
            assert greedy(http, "swap me")["choices"][0]["text"] == expected(refs, "v2", "swap me")
            hold.release()
            chunks = [first] + [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    print(f"\nalias moved -> new version served in {t1 - t0:.2f} s")
    assert all(c["system_fingerprint"] == f"{NAME}-v1" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want_old
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == n
    wait_for(lambda: metric(http.get("/metrics").text, "compressor:models_draining") == 0, what="old model freed")
    assert server.app.state.manager.wait_drained(60)
    assert metric(http.get("/metrics").text, "compressor:model_swaps_total") == 1
    assert expected(refs, "v2", "swap me") != expected(refs, "v1", "swap me")  # the two models do differ


def test_rollback_follows_the_alias_back(server, http, refs, versions):
    from compress.registry import store as registry

    gen_before = metric(http.get("/metrics").text, "vllm:generation_tokens_total")
    registry.rollback(NAME, to_version=versions["v1"])
    wait_for(lambda: served(http) == "1", what="rollback to version 1")
    assert greedy(http, "swap me")["choices"][0]["text"] == expected(refs, "v1", "swap me")
    # Counters survive swaps (Prometheus counters never go down).
    assert metric(http.get("/metrics").text, "vllm:generation_tokens_total") >= gen_before + 12


def test_a_hand_move_the_server_follows_is_recorded_as_champion(server, http, versions):
    """A person gives v2 the alias in MLflow's UI (MlflowClient, what the UI calls): the server follows it and its
    poll records the move, so the registered model names the version it serves, and says it was moved by hand."""
    import mlflow

    from compress.registry import store as registry

    client = mlflow.MlflowClient()
    client.set_registered_model_alias(NAME, "champion", versions["v2"])
    wait_for(lambda: served(http) == "2", what="the hand move to version 2")
    wait_for(lambda: client.get_registered_model(NAME).tags.get("champion") == "2",
             what="the champion tag naming version 2")
    model = client.get_registered_model(NAME)
    last = json.loads(model.tags["champion_history"])[-1]
    assert last["version"] == "2" and last["until"] is None and last["by"] == "by hand, noticed by server poll"
    assert model.description.startswith("Champion: version 2,")
    assert client.get_model_version(NAME, versions["v2"]).tags["champion"].startswith("since ")
    assert "champion" not in client.get_model_version(NAME, versions["v1"]).tags
    registry.rollback(NAME)  # the previous champion: the hand move undone
    wait_for(lambda: served(http) == "1", what="rollback to version 1")


def test_the_deploy_flows_view_of_the_server(server, versions, tiny_artifact):
    """flows/deploy.py's plain helpers (no Prefect run) against this server: the contract it relies on."""
    from compress.registry import store as registry
    from flows.deploy import SmokeTestFailed, served_model, served_version, smoke_test, wait_for_version

    assert served_version(server.url, NAME) == "1"
    registry.set_alias(NAME, "champion", versions["v2"])
    wait_for_version(server.url, NAME, versions["v2"], timeout_s=60)
    texts = smoke_test(server.url, NAME, ["swap me", "Hello"], max_tokens=6)
    assert len(texts) == 2 and all(texts)
    registry.set_alias(NAME, "champion", versions["v1"])
    wait_for_version(server.url, NAME, versions["v1"], timeout_s=60)
    # The server reports the digest of what it serves: the registry's for that version, so a deploy can tell
    # this store's version 1 from another store's (which it refuses at once instead of smoke-testing).
    from serve.artifact import sha256_file

    digest = sha256_file(tiny_artifact / "manifest.json")  # what tasks/register.py tags a version with
    assert served_model(server.url, NAME) == (versions["v1"], digest)
    wait_for_version(server.url, NAME, versions["v1"], timeout_s=60, artifact_sha256=digest)
    with pytest.raises(SmokeTestFailed, match="follows another MLflow store"):
        wait_for_version(server.url, NAME, versions["v1"], timeout_s=60, artifact_sha256="0" * 64)


def test_server_started_before_the_alias_exists_becomes_ready_when_it_does(versions, mlflow_store):
    import mlflow

    from compress.registry import store as registry

    name = "tiny-serve-late"  # a registered model with a version but no alias yet
    src = registry.get_version(NAME, versions["v1"])
    mlflow.MlflowClient().create_registered_model(name)
    mlflow.MlflowClient().create_model_version(name, src.source, run_id=src.run_id)
    app = create_app(f"models:/{name}@champion", cfg(poll_interval_s=POLL_S), tracking_uri=mlflow_store)
    with alias_polls(app.state.manager, poller_only=False) as attempts:
        srv = BackgroundServer(app).start()
        try:
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                assert c.get("/health").status_code == 200
                # /ready says why once the first load attempt has failed (it runs in the background).
                wait_for(lambda: attempts, what="the first load attempt")
                r = c.get("/ready")
                assert r.status_code == 503 and "no alias 'champion'" in r.json()["error"]
                r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
                assert c.get("/v1/models").json()["data"] == []
                registry.set_alias(name, "champion", "1")
                wait_for(lambda: c.get("/ready").status_code == 200, what="ready once the alias exists")
                assert c.get("/v1/models").json()["data"][0]["version"] == "1"
                assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        finally:
            srv.stop()


def test_old_engine_drains_then_shuts_down(tiny_artifact):
    """No HTTP: a leased model outlives the swap and stops when its last lease is returned."""
    mgr = ModelManager(str(tiny_artifact), cfg())
    try:
        old = mgr.load_initial()
        lease = mgr.acquire()
        assert lease is old
        res = mgr.reload(force=True)  # a local folder: force reloads it as a new generation
        assert res.changed and mgr.current is not old and mgr.current.generation == old.generation + 1
        assert old.engine.running and len(mgr.live_models()) == 2
        ids = old.engine.generate("still usable", SamplingParams.greedy(4))
        assert len(ids) == 4
        assert not mgr.wait_drained(0.3)  # still leased
        mgr.release(lease)
        assert mgr.wait_drained(60)
        assert old.closed and not old.engine.running and mgr.live_models() == [mgr.current]
    finally:
        mgr.shutdown()


def test_drain_timeout_shuts_down_a_model_that_is_never_released(tiny_artifact):
    mgr = ModelManager(str(tiny_artifact), cfg(drain_timeout_s=0.5))
    try:
        old = mgr.load_initial()
        mgr.acquire()
        # Its steps after the first are held until the drain timeout shuts the engine down, so the request
        # is still running then however fast the machine is (480 tokens take ~0.15 s unheld).
        with held_steps(old.engine, after=1, until_shutdown=True) as hold:
            h = old.engine.add_request("forever", SamplingParams.greedy(480, ignore_eos=True))
            hold.wait_held()
            t0 = time.monotonic()
            mgr.reload(force=True)
            assert mgr.wait_drained(30)
            assert time.monotonic() - t0 >= 0.4
        out = h.result(timeout=30)
        assert out.finish_reason == "cancelled" and 1 <= len(out.output_ids) < 480  # cut short
        assert not old.engine.running
    finally:
        mgr.shutdown()


def test_a_killed_servers_download_root_is_swept_by_the_next(tmp_path):
    import subprocess
    import sys

    from serve.registry.resolver import ROOT_PREFIX, sweep_orphan_roots

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"{ROOT_PREFIX}{dead.pid}-abc"
    (orphan / "m-v1-1").mkdir(parents=True)
    (orphan / "m-v1-1" / "model.onnx").write_bytes(b"x" * 10)
    live = tmp_path / f"{ROOT_PREFIX}{os.getpid()}-def"
    live.mkdir()
    legacy = tmp_path / f"{ROOT_PREFIX}g4zowxti"
    legacy.mkdir()
    assert sweep_orphan_roots(tmp_path) == [orphan]
    assert not orphan.exists() and live.is_dir() and legacy.is_dir()
