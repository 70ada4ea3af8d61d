"""A disk that fills (issue 42): the pipeline on a real 64 MiB tmpfs is refused before the export writes, naming
the bytes it needs and has; on the same workdir with room the next run resumes from the cached load stage and
succeeds; the refused run left no model version. Needs root to mount the tmpfs (skipped otherwise)."""

from __future__ import annotations

import subprocess

import pytest

from compress.sizing.disk import DiskSpaceError

SETS = ["prune.enabled=false", "distill.enabled=false", "benchmark.enabled=false", "accept.relax_trials=0",
        "registry.model_name=disk-full", "mlflow.experiment=disk-full"]


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_full_disk_is_refused_then_the_run_resumes_with_room(prefect_harness, mlflow_store, small_disk):
    from mlflow.tracking import MlflowClient

    from flows.pipeline import compress_flow

    sets = SETS + [f"workdir={small_disk / 'work'}"]
    with pytest.raises(DiskSpaceError) as e:
        compress_flow(config="configs/tiny.yaml", overrides=sets)
    msg = str(e.value)
    assert "export writes about" in msg and "MiB free" in msg and str(small_disk) in msg
    assert not list(small_disk.rglob("model.onnx*"))
    client = MlflowClient(tracking_uri=mlflow_store)
    assert client.search_model_versions("name='disk-full'") == []  # nothing registered, not even the baseline
    loads = list((small_disk / "work" / "load").glob("*/DONE.json"))
    assert len(loads) == 1
    subprocess.run(["mount", "-o", "remount,size=1g", str(small_disk)], check=True)
    out = compress_flow(config="configs/tiny.yaml", overrides=sets)
    assert out["verdict"]["accepted"], out["verdict"]["reasons"]
    assert list((small_disk / "work" / "load").glob("*/DONE.json")) == loads  # resumed: the load stage reused
    roles = sorted(v.tags.get("role") for v in (client.get_model_version("disk-full", m.version)
                                               for m in client.search_model_versions("name='disk-full'")))
    assert roles == ["baseline", "candidate"]
