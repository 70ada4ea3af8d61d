"""The compression flow end to end under Prefect's test harness, with a real MLflow store.

configs/tiny.yaml switches every stage on: load, export, golden, prune, distill,
student export + golden, static INT8, acceptance, registration and promotion.
"""

import onnx
from mlflow import MlflowClient

from compress import registry
from compress.artifact import read_manifest


def _children(client, run_id):
    exp = client.get_run(run_id).info.experiment_id
    return client.search_runs([exp], f"tags.mlflow.parentRunId = '{run_id}'")


def test_flow_logs_parent_and_child_runs(tiny_flow_run, mlflow_store):
    out = tiny_flow_run["out"]
    client = MlflowClient(mlflow_store)
    parent = client.get_run(out["run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["golden_max_abs_error"] < 1e-4
    assert parent.data.metrics["golden_passed"] == 1.0
    children = _children(client, out["run_id"])
    stages = {r.data.tags["stage"] for r in children}
    assert {"load", "export", "golden", "register_baseline", "prune", "distill", "export_student", "golden_student",
            "quantize", "accept", "benchmark", "register"} <= stages
    golden = next(r for r in children if r.data.tags["stage"] == "golden")
    assert "golden_report.json" in {f.path for f in client.list_artifacts(golden.info.run_id)}
    assert "summary.md" in {f.path for f in client.list_artifacts(out["run_id"])}


def test_distillation_curves_are_logged_per_step(tiny_flow_run, mlflow_store):
    client = MlflowClient(mlflow_store)
    run = next(r for r in _children(client, tiny_flow_run["out"]["run_id"]) if r.data.tags["stage"] == "distill")
    temps = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "T"), key=lambda m: m.step)]
    assert len(temps) == 8 and temps[0] > temps[-1]  # cosine 4 -> 1 over 8 steps
    assert "distill_curves.png" in {f.path for f in client.list_artifacts(run.info.run_id)}


def test_accepted_int8_candidate_is_registered_and_promoted(tiny_flow_run, mlflow_store):
    out = tiny_flow_run["out"]
    assert out["verdict"]["accepted"], out["verdict"]["reasons"]
    registry.configure(mlflow_store)
    cand = registry.version_for_alias("tiny-llama", "candidate")
    champ = registry.version_for_alias("tiny-llama", "champion")
    base = registry.version_for_alias("tiny-llama", "baseline")
    assert cand.version == champ.version != base.version
    assert cand.tags["verdict"] == "accepted" and cand.tags["parent_run_id"] == out["run_id"]
    assert float(cand.tags["gate_perplexity_ratio"]) <= 1.5 and cand.tags["config_hash"]
    graph = onnx.load(out["candidate_artifact"] + "/model.onnx", load_external_data=False).graph
    assert any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in graph.node)
    assert read_manifest(out["candidate_artifact"])["num_layers"] == 2


def test_baseline_is_registered_with_its_files(tiny_flow_run, mlflow_store, tmp_path):
    registry.configure(mlflow_store)
    v = registry.version_for_alias("tiny-llama", "baseline")
    assert v is not None and v.tags["role"] == "baseline" and float(v.tags["golden_passed"]) == 1.0
    folder = registry.download("models:/tiny-llama@baseline", tmp_path / "dl")
    assert read_manifest(folder)["num_layers"] == 2  # sha256 of every file verified


def test_rerun_resumes_from_cache_and_does_not_duplicate(tiny_flow_run, mlflow_store):
    from flows.compress import compress_flow

    before = len(registry.list_versions("tiny-llama"))
    again = compress_flow(config="configs/tiny.yaml", overrides=tiny_flow_run["overrides"])
    # Cached stages do no work, so they open no child run under the new parent.
    stages = {r.data.tags["stage"] for r in _children(MlflowClient(mlflow_store), again["run_id"])}
    assert not {"load", "export", "golden", "prune", "distill", "quantize", "accept"} & stages
    assert len(registry.list_versions("tiny-llama")) == before
    assert again["golden"] == tiny_flow_run["out"]["golden"]


def test_rejected_candidate_never_becomes_champion(tiny_flow_run, mlflow_store):
    from flows.compress import compress_flow

    champ_before = registry.version_for_alias("tiny-llama", "champion").version
    out = compress_flow(config="configs/tiny.yaml",
                        overrides=tiny_flow_run["overrides"] + ["accept.min_top1_agreement=1.0", "accept.relax_trials=0"])
    assert not out["verdict"]["accepted"]
    assert any("min_top1_agreement" in r for r in out["verdict"]["reasons"])
    cand = registry.version_for_alias("tiny-llama", "candidate")
    assert cand.tags["verdict"] == "rejected"
    assert registry.version_for_alias("tiny-llama", "champion").version == champ_before
    import pytest

    with pytest.raises(registry.RegistryError, match="rejected"):
        registry.promote("tiny-llama", cand.version)


def test_versions_carry_serving_figures_next_to_accuracy(tiny_flow_run, mlflow_store):
    registry.configure(mlflow_store)
    cand = registry.version_for_alias("tiny-llama", "candidate")
    base = registry.version_for_alias("tiny-llama", "baseline")
    for k in ("bench_output_tokens_per_s", "bench_e2e_mean_s", "bench_e2e_p99_s", "bench_ttft_p50_s",
              "bench_ttft_p99_s", "bench_peak_rss_mb", "perplexity"):
        assert float(cand.tags[k]) > 0, k
        assert float(base.tags[k]) > 0, k
    assert float(cand.tags["top1_agreement"]) > 0  # vs the baseline, so only the candidate has it
    assert float(cand.tags["bench_requests_failed"]) == 0
    ratio = float(cand.tags["bench_output_tokens_per_s_ratio"])
    assert abs(ratio - float(cand.tags["bench_output_tokens_per_s"]) / float(base.tags["bench_output_tokens_per_s"])) < 1e-6
    from flows.cli import compare_table

    table = compare_table("tiny-llama", "baseline", "candidate")
    assert "bench_output_tokens_per_s" in table and "perplexity" in table


def test_impossible_throughput_floor_blocks_promotion(tiny_flow_run, mlflow_store):
    from flows.compress import compress_flow

    champ_before = registry.version_for_alias("tiny-llama", "champion").version
    out = compress_flow(config="configs/tiny.yaml",
                        overrides=tiny_flow_run["overrides"] + ["benchmark.min_throughput_ratio=1000"])
    assert out["verdict"]["accepted"]  # accurate enough, but too slow for this floor
    reason = out["benchmark"]["promotion_blocked"]
    assert "min_throughput_ratio 1000" in reason
    cand = registry.version_for_alias("tiny-llama", "candidate")
    assert cand.tags["promotion_blocked"] == reason
    assert registry.version_for_alias("tiny-llama", "champion").version == champ_before
