"""The compression flow end to end under Prefect's test harness, with a real MLflow store."""

from mlflow import MlflowClient

from compress import registry


def test_flow_logs_parent_and_child_runs(tiny_flow_run, mlflow_store):
    out = tiny_flow_run["out"]
    client = MlflowClient(mlflow_store)
    parent = client.get_run(out["run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["golden_max_abs_error"] < 1e-4
    assert parent.data.metrics["golden_passed"] == 1.0
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{out['run_id']}'")
    stages = {r.data.tags["stage"] for r in children}
    assert {"load", "export", "golden", "register"} <= stages
    golden = next(r for r in children if r.data.tags["stage"] == "golden")
    files = {f.path for f in client.list_artifacts(golden.info.run_id)}
    assert "golden_report.json" in files


def test_baseline_is_registered_with_its_files(tiny_flow_run, mlflow_store, tmp_path):
    registry.configure(mlflow_store)
    v = registry.version_for_alias("tiny-llama", "baseline")
    assert v is not None and v.tags["role"] == "baseline" and float(v.tags["golden_passed"]) == 1.0
    folder = registry.download("models:/tiny-llama@baseline", tmp_path / "dl")
    from compress.artifact import read_manifest

    assert read_manifest(folder)["num_layers"] == 2  # sha256 of every file verified


def test_rerun_resumes_from_cache_and_does_not_duplicate(tiny_flow_run, mlflow_store):
    from flows.compress import compress_flow

    before = len(registry.list_versions("tiny-llama"))
    again = compress_flow(config="configs/tiny.yaml", overrides=tiny_flow_run["overrides"])
    # Cached stages do no work, so they open no child run under the new parent.
    client = MlflowClient(mlflow_store)
    exp = client.get_run(again["run_id"]).info.experiment_id
    children = client.search_runs([exp], f"tags.mlflow.parentRunId = '{again['run_id']}'")
    assert not {"load", "export", "golden"} & {r.data.tags["stage"] for r in children}
    assert len(registry.list_versions("tiny-llama")) == before
    assert again["golden"] == tiny_flow_run["out"]["golden"]
