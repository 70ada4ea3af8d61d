"""Pipeline faults: a truncated or altered artifact file is caught by the manifest checksum with a clear
error and nothing is registered or promoted; an unreachable MLflow fails the flows at once, naming the URI,
with no half-registered version.

Already covered elsewhere (not repeated here): a flow killed during distillation resumes from the cache and
the distillation checkpoint (tests/test_resume.py); a rejected candidate never becomes champion
(tests/test_flow.py::test_rejected_candidate_never_becomes_champion).
"""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import httpx
import pytest

from compress.registry import store as registry
from compress.artifact import ArtifactError, read_manifest
from compress.config import ServeConfig, load_config
from serve.runners.onnx_session import CPU

pytestmark = pytest.mark.timeout(180)


class CountingRefuser:
    """A listener on 127.0.0.1 that accepts each connection, counts it and closes it unanswered: an MLflow that
    cannot be reached, where a client's retries show as connections (a time bound would depend on the load)."""

    def __init__(self):
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.uri = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def unique(prefix: str) -> str:
    return f"{prefix}-{time.time_ns()}"


def versions_of(name: str) -> list:
    try:
        return registry.list_versions(name)
    except Exception:
        return []


def corrupt(folder: Path, how: str) -> str:
    """Damage one file the way a bad copy or disk would; returns what the error must mention."""
    if how == "truncate model.onnx":
        p = folder / "model.onnx"
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
        return "model.onnx has"
    if how == "truncate tokenizer.json":
        p = folder / "tokenizer.json"
        p.write_bytes(p.read_bytes()[:100])
        return "tokenizer.json has"
    if how == "flip a byte":
        p = folder / "model.onnx"
        data = bytearray(p.read_bytes())
        data[len(data) // 3] ^= 0x01
        p.write_bytes(bytes(data))
        return "model.onnx does not match its sha256"
    if how == "delete a file":
        (folder / "tokenizer.json").unlink()
        return "tokenizer.json listed in the manifest is missing"
    if how == "truncate manifest.json":
        p = folder / "manifest.json"
        p.write_text(p.read_text()[:50])
        return "manifest.json: not valid JSON"
    raise ValueError(how)


@pytest.mark.parametrize("how", ["truncate model.onnx", "truncate tokenizer.json", "flip a byte",
                                 "delete a file", "truncate manifest.json"])
def test_a_damaged_artifact_is_caught_and_never_registered(how, tiny_artifact, tmp_path, mlflow_store):
    from tasks.register import register_task

    folder = tmp_path / "artifact"
    shutil.copytree(tiny_artifact, folder)
    expect = corrupt(folder, how)
    with pytest.raises(ArtifactError, match="truncated or replaced|corrupt or replaced|missing|not valid JSON") as e:
        read_manifest(folder)
    assert expect in str(e.value) and str(folder) in str(e.value)
    name = unique("rel-damaged")
    cfg = load_config(None, [f"registry.model_name={name}"])
    registry.configure(mlflow_store)
    with pytest.raises(ArtifactError) as e2:
        register_task.fn(cfg.registry.model_name, None, str(folder), ["candidate", "champion"], {"config_hash": "h", "verdict": "accepted"})
    assert expect in str(e2.value)
    assert versions_of(name) == []
    assert registry.version_for_alias(name, "champion") is None


def test_upload_failure_midway_leaves_no_half_registered_version(tiny_artifact, mlflow_store, monkeypatch):
    """MLflow going away during registration: the files go up before the version is created, so no
    version (and no alias) points at a half-uploaded artifact."""
    import mlflow
    from mlflow import MlflowClient

    from tasks.register import register_task

    registry.configure(mlflow_store)
    name = unique("rel-upload")
    cfg = load_config(None, [f"registry.model_name={name}"])

    def broken_upload(self, run_id, local_dir, artifact_path=None):
        raise ConnectionError("MLflow tracking server went away during the upload")

    with mlflow.start_run() as run:
        monkeypatch.setattr(MlflowClient, "log_artifacts", broken_upload)  # a store without logged models
        monkeypatch.setattr(MlflowClient, "log_model_artifacts", broken_upload)
        with pytest.raises(ConnectionError, match="went away"):
            register_task.fn(cfg.registry.model_name, run.info.run_id, str(tiny_artifact), ["candidate", "champion"], {"config_hash": "h"})
        monkeypatch.undo()
    assert versions_of(name) == []
    assert registry.version_for_alias(name, "candidate") is None

    def broken_create(self, *a, **kw):
        raise ConnectionError("MLflow went away before the version was created")

    with mlflow.start_run() as run:
        monkeypatch.setattr(MlflowClient, "create_model_version", broken_create)
        with pytest.raises(ConnectionError):
            register_task.fn(cfg.registry.model_name, run.info.run_id, str(tiny_artifact), ["candidate"], {"config_hash": "h"})
        monkeypatch.undo()
    assert versions_of(name) == []
    # With MLflow back, the same call registers exactly one version.
    with mlflow.start_run() as run:
        out = register_task.fn(cfg.registry.model_name, run.info.run_id, str(tiny_artifact), ["candidate"], {"config_hash": "h"})
    assert [v.version for v in versions_of(name)] == [out.version] == ["1"]


def test_mlflow_unreachable_fails_the_flows_at_once_naming_the_uri(prefect_harness, mlflow_store, tmp_path,
                                                                   monkeypatch):
    from mlflow import MlflowClient

    from flows.pipeline import compress_flow
    from flows.deploy import deploy_flow

    store = MlflowClient(tracking_uri=mlflow_store)
    before_versions = len(store.search_model_versions("name='tiny-llama'"))
    before_runs = sum(len(store.search_runs([e.experiment_id])) for e in store.search_experiments())
    refuser = CountingRefuser()
    uri = refuser.uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    work = tmp_path / "work"
    try:
        with pytest.raises(registry.RegistryError) as e:
            compress_flow(config="configs/tiny.yaml", overrides=[f"workdir={work}"])
        msg = str(e.value)
        assert uri in msg and "unreachable" in msg and "MLFLOW_TRACKING_URI" in msg
        # One probe, no retry loop: MLflow's own retries would knock again and again, for minutes.
        assert refuser.connections == 1, f"{refuser.connections} connections before giving up"
        assert not work.exists() or not any(work.rglob("*")), "a stage ran before the reachability check"
        with pytest.raises(registry.RegistryError, match="unreachable"):
            deploy_flow(model_name="tiny-llama", version="1", server_url=None, tracking_uri=uri)
        assert refuser.connections == 2
    finally:
        refuser.close()
    monkeypatch.undo()
    assert len(store.search_model_versions("name='tiny-llama'")) == before_versions
    assert sum(len(store.search_runs([e.experiment_id])) for e in store.search_experiments()) == before_runs


def _artifact_dir(version) -> Path:
    """The registered copy of a version's artifact folder in the (file) artifact store: its logged model's."""
    from mlflow import MlflowClient

    location = version.source
    if location.startswith("models:/m-"):
        location = MlflowClient().get_logged_model(location[len("models:/"):]).artifact_location
    return Path(url2pathname(urlparse(location).path))


def test_a_version_damaged_in_the_store_is_not_promoted_by_the_deploy_flow(prefect_harness, mlflow_store,
                                                                          tiny_artifact, tmp_path_factory):
    """Files altered after registration: promotion verifies the stored copy, so the deploy flow fails with
    the file named, the alias never moves and the live server never even sees the version. (If the alias is
    moved by hand anyway, the server refuses the version and keeps serving: tests/test_live_swap.py.)"""
    import mlflow

    from flows.deploy import deploy_flow
    from serve.api.app import create_app
    from serve.api.background import BackgroundServer

    registry.configure(mlflow_store)
    name = unique("rel-deploy")
    root = tmp_path_factory.mktemp("rel_deploy_store")
    exp = mlflow.create_experiment(name, artifact_location=root.as_uri())
    versions = []
    for role in ("v1", "v2"):
        with mlflow.start_run(experiment_id=exp) as run:
            versions.append(registry.register_folder(tiny_artifact, name, run.info.run_id,
                                                     {"role": role, "verdict": "accepted"},
                                                     ["champion"] if role == "v1" else ["candidate"]))
    v1, v2 = versions
    stored = _artifact_dir(v2)
    assert (stored / "manifest.json").is_file(), stored
    corrupt(stored, "truncate model.onnx")

    app = create_app(f"models:/{name}@champion", ServeConfig(providers=[CPU], kv_memory_mb=8, poll_interval_s=0.2),
                     tracking_uri=mlflow_store)
    with BackgroundServer(app) as srv:
        t0 = time.monotonic()
        with pytest.raises(registry.RegistryError) as e:
            deploy_flow(model_name=name, version=v2.version, server_url=srv.url, wait_s=4, prompts=["hello"],
                        tracking_uri=mlflow_store)
        took = time.monotonic() - t0  # printed, not asserted
        msg = str(e.value)
        assert f"version {v2.version} of {name} is damaged" in msg and "not promoted" in msg
        assert "model.onnx has" in msg and "truncated" in msg
        assert registry.version_for_alias(name, "champion").version == v1.version  # never moved
        assert "previous_champion" not in registry.get_version(name, v2.version).tags
        mgr = app.state.manager
        polls = mgr.num_polls
        deadline = time.monotonic() + 120  # a guard against a dead poller, not a speed requirement
        while mgr.num_polls < polls + 3 and time.monotonic() < deadline:  # three polls: nothing new to load
            time.sleep(0.05)
        assert mgr.num_polls >= polls + 3
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        assert "compressor:model_load_failures_total 0.0" in metrics
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "still here", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["system_fingerprint"] == f"{name}-v{v1.version}"
    # Without a live server to smoke-test against, the same check holds.
    with pytest.raises(registry.RegistryError, match="damaged"):
        deploy_flow(model_name=name, version=v2.version, server_url=None, tracking_uri=mlflow_store)
    assert registry.version_for_alias(name, "champion").version == v1.version
    print(f"\ndamaged version: deploy refused in {took:.1f} s; v{v1.version} served throughout")


def test_a_server_on_an_unreachable_registry_exits_with_the_uri(capsys):
    from serve.__main__ import main

    refuser = CountingRefuser()
    uri = refuser.uri
    try:
        assert main(["--model", "models:/tiny-llama@champion", "--tracking-uri", uri]) == 2
        assert refuser.connections == 1  # one probe, then the exit: no retry loop
    finally:
        refuser.close()
    err = capsys.readouterr().err
    assert uri in err and "unreachable" in err
