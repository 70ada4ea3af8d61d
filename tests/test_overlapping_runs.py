"""Two `compressor run`s started seconds apart against one sqlite store, one workdir and one model name, with
different configs (issue 42): both end with a verdict and no traceback; the registry holds one baseline, each
accepted candidate once, and exactly one champion, the better on the chat set (the gate's own ordering)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["prune.enabled=false", "distill.enabled=false", "benchmark.enabled=false", "accept.relax_trials=0",
          "registry.model_name=overlap", "mlflow.experiment=overlap"]


def test_two_runs_seconds_apart_on_one_store(prefect_harness, tmp_path):
    from prefect.settings import PREFECT_API_URL

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri, PREFECT_API_URL=PREFECT_API_URL.value(), PYTHONPATH=str(ROOT))
    cli = [sys.executable, "-m", "flows", "run", "--config", "configs/tiny.yaml"]
    procs = []
    for k, method in enumerate(("weight_only", "dynamic")):
        sets = COMMON + [f"quantize.method={method}", f"workdir={tmp_path / 'work'}"]
        procs.append(subprocess.Popen(cli + ["--out", str(tmp_path / f"out{k}.json")]
                                      + [a for s in sets for a in ("--set", s)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        if k == 0:  # the second starts once the first is computing (its load stage has begun), not "later"
            _until(lambda: any((tmp_path / "work" / "load").glob("*")) or procs[0].poll() is not None,
                   "the first run to start its load stage")
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert "Traceback" not in out, out[-3000:]
        assert p.returncode in (0, 1), out[-3000:]  # a verdict: accepted (0) or not accepted (1)
        assert "verdict" in out.lower() or "accepted" in out.lower(), out[-2000:]
    table = check_one_champion(uri, "overlap")
    # `--out`: each run's outcome as JSON, its state the exit code's and its versions the registry's
    for k, p in enumerate(procs):
        outcome = json.loads((tmp_path / f"out{k}.json").read_text())
        assert (outcome["state"] in ("Accepted", "Completed")) == (p.returncode == 0)
        cand = outcome["registered"][-1]
        verdict = {str(v): row[1] for v, row in table.items()}[str(cand["version"])]
        assert verdict == ("accepted" if outcome["verdict"]["accepted"] else "rejected")


def _until(cond, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def check_one_champion(uri: str, name: str) -> dict:
    """The registry after overlapping runs: one baseline, each accepted candidate once, exactly one champion (the
    better on the chat set when both were accepted). Returns {version: (role, verdict, aliases, promotion_blocked)}."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    versions = [client.get_model_version(name, v.version) for v in client.search_model_versions(f"name='{name}'")]
    roles = [v.tags.get("role") for v in versions]
    assert roles.count("baseline") == 1, roles
    accepted = [v for v in versions if v.tags.get("role") == "candidate" and v.tags.get("verdict") == "accepted"]
    digests = [v.tags.get("artifact_sha256") for v in accepted]
    assert len(digests) == len(set(digests))  # each accepted candidate once
    champions = [v for v in versions if "champion" in v.aliases]
    table = {v.version: (v.tags.get("role"), v.tags.get("verdict"), v.aliases, v.tags.get("promotion_blocked"))
             for v in versions}
    print(table)
    assert len(champions) == (1 if accepted else 0), table
    if len(accepted) == 2:
        ratio = {v.version: client.get_run(v.run_id).data.metrics.get("chat_perplexity_ratio") for v in accepted}
        assert ratio[champions[0].version] == min(ratio.values()), ratio
    return table
