"""The prepared GPU window for pruning + distillation (benchmarks/gpu_distill.py) rehearsed on the CPU with the tiny
model: prune, the teacher's conversations, KD on a token budget with its plan, INT8 of teacher and student, the accept
stage's verdict, both served through the openai SDK."""

from __future__ import annotations

import json
import math

import pytest

from bench_cli import run_bench

pytestmark = pytest.mark.timeout(600)


def test_cpu_rehearsal_of_the_gpu_window(tmp_path):
    out = tmp_path / "out"
    r = run_bench("gpu_distill", "--cpu", "--model", "tiny", "--config", "configs/tiny.yaml", "--tokens", "2000",
                  "--conversations", "16", "--batch-size", "4", "--eval-every", "4", "--levels", "1", "4",
                  "--max-tokens", "8", "--distill-minutes", "10", "--out", out, "--work", tmp_path / "work",
                  OMP_NUM_THREADS="1")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "gpu_distill.json").read_text())
    stages = report["stages"]
    assert list(stages) == ["prune", "data", "distill", "export_int8", "verdict", "serve"]
    before, after = stages["prune"]["params"]
    assert after < before  # the cut removed MLP neurons
    # 64 corpus train blocks and 16 conversations; the selection split gains as many conversations as it had blocks
    assert stages["data"]["train_blocks"] == 64 + 16 and stages["data"]["selection_blocks"] == 8 + 8
    d = stages["distill"]
    assert d["distill_steps"] == math.ceil(2000 / (4 * 31)) and d["plan"]["steps"] == d["distill_steps"]
    assert d["distill_planned_seconds"] > 0 and d["evals"][-1]["step"] == d["distill_steps"]
    assert stages["export_int8"]["mib"]["student"] < stages["export_int8"]["mib"]["teacher"]
    v = stages["verdict"]
    assert isinstance(v["accepted"], bool) and v["checks"] and "chat_perplexity_ratio" in v["chat"]
    served = stages["serve"]["served"]
    for name in ("teacher", "student"):
        assert [lv["ok"] for lv in served[name]["levels"]] == [2, 8], served[name]
        assert all(lv["completion_tokens"] > 0 for lv in served[name]["levels"])
    assert set(stages["serve"]["student_over_int8_teacher"]) == {"c1", "c4"}
    assert report["summary"]["accepted"] == v["accepted"]
