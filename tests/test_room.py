"""Refusals before work: disk room (compress/sizing/disk.py) and the evaluation stages' memory (compress/sizing/memory.py).

A stage that cannot fit must say so before it starts, with the bytes needed and free and the way out, as a user
error (no traceback), and leave nothing half-written behind.
"""

from __future__ import annotations

import pytest

from compress.sizing import disk as room
from compress.config import load_config
from compress.sizing.memory import GIB, MemoryBudgetError, Shape, accept_bytes, check_stage_memory
from compress.sizing.disk import DiskSpaceError, check_room, folder_bytes, free_bytes, int8_bytes, local_artifact_dir
from compress.sizing.shapes import shape_config
from flows.errors import is_user_error


def test_check_room_names_both_figures_and_the_place(tmp_path):
    with pytest.raises(DiskSpaceError, match=r"export writes about 28\.0 GiB under .* has 20\.0 GiB free \(free it\)"):
        check_room("export", tmp_path, 28 * GIB, "free it", free=20 * GIB)
    assert check_room("export", tmp_path, 1 * GIB, "free it", free=20 * GIB) == 1 * GIB
    # the slack: a write that would leave the disk all but full is refused too
    with pytest.raises(DiskSpaceError):
        check_room("export", tmp_path, 20 * GIB - 2**20, "free it", free=20 * GIB)
    assert free_bytes(tmp_path / "not" / "made" / "yet") == free_bytes(tmp_path) > 0
    (tmp_path / "a").write_bytes(b"x" * 1000)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_bytes(b"y" * 24)
    assert folder_bytes(tmp_path) == 1024


def test_artifact_stores_that_are_local_are_checked_remote_ones_are_not(tmp_path):
    assert local_artifact_dir(f"file://{tmp_path}") == tmp_path
    assert local_artifact_dir(str(tmp_path)) == tmp_path
    assert local_artifact_dir("s3://bucket/mlflow/1/abc/artifacts") is None
    assert local_artifact_dir("mlflow-artifacts:/1/abc/artifacts") is None


def test_refusals_are_user_errors():
    assert is_user_error(DiskSpaceError("x")) and is_user_error(MemoryBudgetError("x"))


def test_a_7b_is_refused_golden_and_quantize_on_24_gib_but_its_accept_stage_fits():
    s7 = Shape.of_config(shape_config("qwen2.5-7b"))
    with pytest.raises(MemoryBudgetError, match=r"golden on the CPU needs about 3\d\.\d GiB .* 24\.0 GiB are free"):
        check_stage_memory("golden", s7, available=24 * GIB)
    with pytest.raises(MemoryBudgetError, match="quantize.enabled=false"):
        check_stage_memory("quantize", s7, available=24 * GIB)
    # the bf16 checkpoint as the reference (accept.reference: auto from 1B) fits where the fp32 graph does not
    assert check_stage_memory("accept", s7, available=24 * GIB) / GIB < 20
    assert accept_bytes(s7, checkpoint=False) > 24 * GIB
    with pytest.raises(MemoryBudgetError, match="accept.reference=checkpoint"):
        check_stage_memory("accept", s7, available=24 * GIB, need=accept_bytes(s7, checkpoint=False))
    # an INT8 form of the 1B shape as written was 1.465 GB
    s1 = Shape.of_config(shape_config("llama-3.2-1b"))
    assert int8_bytes(s1) == pytest.approx(1.465e9, rel=0.02)


def test_the_export_stage_refuses_a_full_disk_before_writing(tiny_model_dir, tmp_path, monkeypatch):
    from tasks.common import StageRun
    from tasks.export import export_task

    cfg = load_config("configs/tiny.yaml", [f"workdir={tmp_path}", f"model.source={tiny_model_dir}"])
    monkeypatch.setattr(room, "free_bytes", lambda where: 2**20)
    with pytest.raises(DiskSpaceError, match=r"export writes about \d+\.\d MiB .* has 1\.0 MiB free"):
        export_task.fn(StageRun(str(tmp_path), "export", "k"), export=cfg.export, quantize=cfg.quantize, model=cfg.model,
                       model_dir=str(tiny_model_dir))
    assert not list(tmp_path.rglob("model.onnx*"))  # nothing written
