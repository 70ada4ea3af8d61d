"""MLflow plumbing for tasks: one child run per stage under the pipeline's parent run.

Prefect runs tasks in worker threads and MLflow's active run is per thread, so
each stage opens its child run explicitly by the parent's id.
"""

from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager
from pathlib import Path

import mlflow


@contextmanager
def child_run(parent_run_id: str | None, stage: str):
    """Start a nested run for a stage in this thread; yields the run (or None without a parent)."""
    if parent_run_id is None:
        yield None
        return
    parent = mlflow.get_run(parent_run_id)
    with mlflow.start_run(run_name=stage, experiment_id=parent.info.experiment_id, nested=True,
                          parent_run_id=parent_run_id, tags={"stage": stage}) as run:
        yield run


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def log_params(params: dict) -> None:
    flat = {k: (json.dumps(v) if isinstance(v, (list, tuple)) else v) for k, v in flatten(params).items()}
    # MLflow caps a value at 6000 chars; long prompt lists are cut rather than failing the run.
    mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})


def log_metrics(metrics: dict, step: int | None = None) -> None:
    clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and v == v}
    if clean:
        mlflow.log_metrics(clean, step=step)


def log_json(obj, name: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / name
        p.write_text(json.dumps(obj, indent=2, default=str))
        mlflow.log_artifact(str(p))


def log_figure(fig, name: str) -> None:
    import matplotlib.pyplot as plt

    mlflow.log_figure(fig, name)
    plt.close(fig)


def log_rows(rows: list[dict], name: str) -> None:
    """A list of row dicts as an MLflow table (columns = keys of the rows)."""
    cols: dict[str, list] = {}
    for r in rows:
        for k in r:
            cols.setdefault(k, [])
    for r in rows:
        for k in cols:
            cols[k].append(r.get(k))
    mlflow.log_table(cols, artifact_file=name)
