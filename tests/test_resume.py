"""Kill the pipeline during distillation, run it again: earlier stages come from cache, distillation resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mlflow import MlflowClient

ROOT = Path(__file__).resolve().parent.parent


def test_killed_during_distill_resumes_from_checkpoint(tiny_flow_run, mlflow_store):
    from compress.distill.checkpoint import LAST
    from flows.pipeline import compress_flow

    work = tiny_flow_run["workdir"]  # load/export/golden/prune are shared with that run; distill differs
    # 200 steps with a checkpoint every 4: the kill below lands between the first checkpoint and the end
    # as long as 196 steps take longer than one 0.2 s poll, on any machine this suite runs on.
    overrides = [f"workdir={work}", "distill.steps=200", "distill.checkpoint_every=4", "distill.eval_every=100",
                 "registry.promote=false", "registry.model_name=tiny-resume"]
    cmd = [sys.executable, "-m", "flows", "run", "--config", "configs/tiny.yaml"]
    for o in overrides:
        cmd += ["--set", o]
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_store}
    env.pop("PREFECT_API_URL", None)  # its own temporary server, not the test harness's
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    killed_at = None
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            states = [p for p in work.glob(f"distill/*/ckpt/{LAST}/state.json")
                      if not (p.parents[2] / "DONE.json").exists()]  # not the earlier run's finished one
            if states:
                step = json.loads(states[0].read_text())["state"]["step"]
                if step >= 4:
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed_at = step
                    break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert killed_at is not None and killed_at < 200, "the run was not caught during distillation"
    assert len(list(work.glob("distill/*/DONE.json"))) == 1  # only the earlier run's distillation finished

    out = compress_flow(config="configs/tiny.yaml", overrides=overrides)
    client = MlflowClient(mlflow_store)
    exp = client.get_run(out["run_id"]).info.experiment_id
    stages = {r.data.tags["stage"] for r in client.search_runs([exp], f"tags.mlflow.parentRunId = '{out['run_id']}'")}
    assert not {"load", "export", "golden", "prune"} & stages  # finished before the kill: from cache
    assert {"distill", "export_student", "quantize", "accept"} <= stages
    distill = next(r for r in out["stages"] if r["stage"] == "distill")["metrics"]
    assert distill["distill_resumed_from"] >= killed_at
    assert distill["distill_steps"] == 200
