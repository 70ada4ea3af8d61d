"""The compression flow end to end under Prefect's test harness, with a real MLflow store.

configs/tiny.yaml switches every stage on: load, export, golden, prune, distill,
student export + golden, static INT8, acceptance, registration and promotion.
"""

import json

import mlflow
import onnx
import pytest
from mlflow import MlflowClient

from compress.registry import store as registry
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
    # every auto resolved once, after load: the file and the summary's section name the same settings
    resolved = json.load(open(client.download_artifacts(out["run_id"], "resolved_config.json")))
    summary = open(client.download_artifacts(out["run_id"], "summary.md")).read()
    assert resolved and all(f"| `{r['key']}` |" in summary for r in resolved)
    assert {"quantize.smoothquant_alpha", "distill.amp"} <= {r["key"] for r in resolved}


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
    # its page tells the story: what it is, the verdict, links to the run and the accept run; an MLflow Model
    assert cand.tags["accept_run_id"] == out["verdict"]["run_id"] and cand.tags["weights"] == "copy"
    desc = registry._client().get_model_version("tiny-llama", cand.version).description
    assert desc.startswith("Champion since") and "accepted: every check passed (perplexity ratio " in desc
    assert out["verdict"]["run_id"] in desc and out["run_id"] in desc
    attached = {f.path for f in registry._client().list_artifacts(cand.run_id, "verdict")}
    assert "verdict/verdict.json" in attached  # in the version's source run, beside its files
    info = mlflow.models.get_model_info("models:/tiny-llama@champion")
    assert info.flavors["python_function"]["loader_module"] == "serve.api.mlflow_model"
    assert registry.figures("tiny-llama", cand.version)["gate_perplexity_ratio"] <= 1.5 and cand.tags["config_hash"]
    graph = onnx.load(out["candidate_artifact"] + "/model.onnx", load_external_data=False).graph
    assert any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in graph.node)
    assert read_manifest(out["candidate_artifact"])["num_layers"] == 2


def test_baseline_is_registered_with_its_files(tiny_flow_run, mlflow_store, tmp_path):
    registry.configure(mlflow_store)
    v = registry.version_for_alias("tiny-llama", "baseline")
    assert v is not None and v.tags["role"] == "baseline"
    assert registry.figures("tiny-llama", v.version)["golden_passed"] == 1.0
    folder = registry.download("models:/tiny-llama@baseline", tmp_path / "dl")
    assert read_manifest(folder)["num_layers"] == 2  # sha256 of every file verified


def test_rerun_resumes_from_cache_and_does_not_duplicate(tiny_flow_run, mlflow_store):
    from flows.pipeline import compress_flow

    before = len(registry.list_versions("tiny-llama"))
    again = compress_flow(config="configs/tiny.yaml", overrides=tiny_flow_run["overrides"])
    # Cached stages do no work, so they open no child run under the new parent.
    stages = {r.data.tags["stage"] for r in _children(MlflowClient(mlflow_store), again["run_id"])}
    assert not {"load", "export", "golden", "prune", "distill", "quantize", "accept"} & stages
    assert len(registry.list_versions("tiny-llama")) == before
    assert again["golden"] == tiny_flow_run["out"]["golden"]


def test_rejected_candidate_never_becomes_champion(tiny_flow_run, mlflow_store):
    from flows.outcome import RunNotAccepted
    from flows.pipeline import compress_flow

    champ_before = registry.version_for_alias("tiny-llama", "champion").version
    cand_before = registry.version_for_alias("tiny-llama", "candidate").version
    base_before = registry.version_for_alias("tiny-llama", "baseline").version
    overrides = tiny_flow_run["overrides"] + ["accept.min_top1_agreement=1.0", "accept.relax_trials=0"]
    # A person moves champion in the UI first: the run records the move, and every label names the new champion.
    MlflowClient().set_registered_model_alias("tiny-llama", "champion", base_before)
    state = compress_flow(config="configs/tiny.yaml", overrides=overrides, return_state=True)
    assert state.is_failed() and state.name == "Rejected"
    model = MlflowClient().get_registered_model("tiny-llama")
    last = json.loads(model.tags["champion_history"])[-1]
    assert last["version"] == base_before and last["by"].startswith("by hand, noticed by pipeline run ")
    assert model.tags["champion"] == base_before and model.description.startswith(f"Champion: version {base_before},")
    registry.set_alias("tiny-llama", "champion", champ_before, by="test")
    assert "min_top1_agreement" in state.message and "#/experiments/" in state.message
    with pytest.raises(RunNotAccepted) as e:  # a direct call raises, with the run's summary
        compress_flow(config="configs/tiny.yaml", overrides=overrides)
    out = e.value.outcome
    assert not out["verdict"]["accepted"]
    assert any("min_top1_agreement" in r for r in out["verdict"]["reasons"])
    rejected = registry.get_version("tiny-llama", out["registered"][-1]["version"])
    assert rejected.tags["verdict"] == "rejected" and rejected.aliases == []
    assert f"v{rejected.version} (no alias)" in state.message
    # A rejected run moves no alias: candidate still means "may be promoted"; the teacher's files are unchanged.
    assert registry.version_for_alias("tiny-llama", "candidate").version == cand_before
    assert registry.version_for_alias("tiny-llama", "champion").version == champ_before
    assert registry.version_for_alias("tiny-llama", "baseline").version == base_before
    with pytest.raises(registry.RegistryError, match="rejected"):
        registry.promote("tiny-llama", rejected.version)


def test_versions_carry_serving_figures_next_to_accuracy(tiny_flow_run, mlflow_store):
    registry.configure(mlflow_store)
    cand = registry.version_for_alias("tiny-llama", "candidate")
    base = registry.version_for_alias("tiny-llama", "baseline")
    fc, fb = registry.figures("tiny-llama", cand.version), registry.figures("tiny-llama", base.version)
    for k in ("bench_output_tokens_per_s", "bench_e2e_mean_s", "bench_e2e_p99_s", "bench_ttft_p50_s",
              "bench_ttft_p99_s", "bench_peak_rss_mb", "perplexity", "size_bytes"):
        assert fc[k] > 0, k
        assert fb[k] > 0, k
    assert fc["top1_agreement"] > 0  # vs the baseline, so only the candidate has it
    assert fc["bench_requests_failed"] == 0
    ratio = fc["bench_output_tokens_per_s_ratio"]
    # The baseline is one version for all runs that export the same teacher; each run records its
    # measurement (the latest is the version's figure), and the ratio is against the same run's.
    history = MlflowClient(mlflow_store).get_metric_history(base.run_id, "bench_output_tokens_per_s")
    assert any(abs(ratio - fc["bench_output_tokens_per_s"] / m.value) < 1e-6 for m in history), (ratio, history)
    # The figures are metrics of each version's source run (what MLflow's model-version Compare shows),
    # with params saying what the version is; tags only say role and verdict.
    run = MlflowClient(mlflow_store).get_run(cand.run_id)
    assert run.data.metrics["perplexity"] == fc["perplexity"] and run.data.params["role"] == "candidate"
    assert run.data.params["quantize.method"] == "static" and run.data.params["verdict"] == "accepted"
    assert not any(k.startswith("bench_") for k in cand.tags)
    from flows.cli import compare_table

    table = compare_table("tiny-llama", "baseline", "candidate")
    assert "bench_output_tokens_per_s" in table and "perplexity" in table


def test_impossible_throughput_floor_blocks_promotion(tiny_flow_run, mlflow_store, tmp_path):
    from flows.outcome import RunNotAccepted
    from flows.pipeline import compress_flow

    champ_before = registry.version_for_alias("tiny-llama", "champion").version
    cand_before = registry.version_for_alias("tiny-llama", "candidate").version
    # The same rerun of the benchmark stage also names a genai model folder that holds none: the batch-1
    # comparison is skipped with the reason, and the stage goes on.
    state = compress_flow(config="configs/tiny.yaml", return_state=True,
                          overrides=tiny_flow_run["overrides"] + ["benchmark.min_server_throughput_ratio=1000",
                                                                  f"benchmark.genai_model={tmp_path}"])
    assert state.is_failed() and state.name == "Blocked" and "min_server_throughput_ratio 1000" in state.message
    out = state.result(raise_on_failure=False)
    assert isinstance(out, RunNotAccepted)
    out = out.outcome
    assert out["verdict"]["accepted"]  # accurate enough, but too slow for this floor
    reason = out["benchmark"]["promotion_blocked"]
    assert "min_server_throughput_ratio 1000" in reason
    assert "genai_config.json" in out["benchmark"]["genai"]["skipped"]
    assert not any(k.startswith("genai_batch1_") for k in out["benchmark"]["metrics"])
    blocked = registry.get_version("tiny-llama", out["registered"][-1]["version"])
    assert blocked.tags["promotion_blocked"] == reason and blocked.aliases == []
    assert registry.version_for_alias("tiny-llama", "candidate").version == cand_before
    assert registry.version_for_alias("tiny-llama", "champion").version == champ_before


def test_candidate_worse_than_the_champion_on_chat_is_not_promoted(tiny_flow_run, mlflow_store, tmp_path):
    """Accepted against the teacher (loose limits), but worse than the champion on the chat set: blocked, and the
    run says which version is better on what. Its own workdir: the session's holds one distillation only
    (tests/test_resume.py counts them)."""
    from flows.pipeline import compress_flow

    champ_before = registry.version_for_alias("tiny-llama", "champion").version
    champ_chat = registry.figures("tiny-llama", champ_before)["chat_perplexity_ratio"]
    overrides = [f"workdir={tmp_path / 'work'}", "prune.mlp_ratio=0.75", "benchmark.enabled=false",
                                              "accept.max_perplexity_ratio=100", "accept.min_top1_agreement=0",
                                              "accept.max_chat_perplexity_ratio=100", "accept.min_chat_top1_agreement=0",
                                              "accept.max_chat_judged_ratio=100", "accept.relax_trials=0"]
    state = compress_flow(config="configs/tiny.yaml", overrides=overrides, return_state=True)
    out = state.result(raise_on_failure=False).outcome
    assert out["verdict"]["accepted"]
    cand_chat = out["verdict"]["candidate"]["chat_perplexity_ratio"]
    assert cand_chat > champ_chat * 1.001, (cand_chat, champ_chat)
    assert state.is_failed() and state.name == "Blocked"
    assert f"worse than champion v{champ_before} on the chat set" in state.message
    assert "registry.promote_when_worse" in out["promotion_blocked"]
    vs = out["versus_champion"]
    assert vs["version"] == champ_before and vs["worse_on_use"]
    assert vs["use"]["candidate"] == pytest.approx(cand_chat) and vs["use"]["champion"] == pytest.approx(champ_chat)
    blocked = registry.get_version("tiny-llama", out["registered"][-1]["version"])
    assert blocked.tags["promotion_blocked"] == out["promotion_blocked"] and blocked.aliases == []
    assert registry.version_for_alias("tiny-llama", "champion").version == champ_before


def test_no_int8_form_passing_stops_the_run_before_acceptance(tiny_flow_run, mlflow_store):
    """quantize.kv_cache auto with a gate no form can pass (KL to the source must be ~0): the run ends Rejected in the
    quantize stage, naming every form's failed checks; no accept stage, no benchmark; the most accurate form is the
    registered, rejected candidate, and the summary lists every form."""
    from mlflow import MlflowClient

    from flows.outcome import RunNotAccepted
    from flows.pipeline import compress_flow

    champ_before = registry.version_for_alias("tiny-llama", "champion").version
    overrides = tiny_flow_run["overrides"] + ["quantize.method=weight_only", "quantize.kv_cache=auto",
                                              "quantize.auto_concurrency=8", "accept.max_kl=1e-12",
                                              "accept.relax_trials=0"]
    with pytest.raises(RunNotAccepted) as e:
        compress_flow(config="configs/tiny.yaml", overrides=overrides)
    out = e.value.outcome
    v = out["verdict"]
    assert not v["accepted"] and v["split"] == "selection"
    assert v["reasons"][0].startswith("no quantized form passed the gate on the selection split (3 tried)")
    assert [r.split(":")[0] for r in v["reasons"][1:]] == [
        "weight_only with int8 K/V per tensor", "weight_only with int8 K/V per channel", "weight_only with float32 K/V"]
    assert all("kl " in r and "(limit 1e-12)" in r for r in v["reasons"][1:])
    ran = [r["stage"] for r in out["stages"]]
    assert "quantize" in ran and "accept" not in ran and "benchmark" not in ran
    rejected = registry.get_version("tiny-llama", out["registered"][-1]["version"])
    assert rejected.tags["verdict"] == "rejected" and rejected.aliases == []
    assert registry.version_for_alias("tiny-llama", "champion").version == champ_before
    summary = MlflowClient(mlflow_store).download_artifacts(out["run_id"], "summary.md")
    text = open(summary).read()
    assert "Forms judged on the selection split" in text and text.count("| weight_only") == 3


def test_links_in_descriptions_and_summary_are_relative_routes_to_real_runs(tiny_flow_run, mlflow_store):
    """Read on the UI's own pages, whatever port it runs on: markdown links to `#/...` routes of runs that exist,
    in the runs view, with nothing glued to them; read outside it (the Prefect state) the route says where to open."""
    import re

    registry.configure(mlflow_store)
    client = MlflowClient()
    out = tiny_flow_run["out"]
    cand = registry.get_version("tiny-llama", out["registered"][-1]["version"])
    desc = client.get_model_version("tiny-llama", cand.version).description
    summary = client.download_artifacts(out["run_id"], "summary.md")
    for text in (desc, open(summary).read()):
        assert "http://" not in text and "127.0.0.1:5000" not in text
        links = re.findall(r"\]\((#/experiments/(\d+)/runs/([0-9a-f]{32})\?workflowType=machine_learning)\)", text)
        assert links, text
        for _, exp, run_id in links:
            assert client.get_run(run_id).info.experiment_id == exp
    assert {r for _, _, r in re.findall(r"\]\((#/experiments/(\d+)/runs/([0-9a-f]{32})[^)]*)\)", desc)} == {
        out["run_id"], cand.tags["accept_run_id"]}
    assert out["run_url"].endswith("?workflowType=machine_learning in the MLflow UI (make ui)")
    # the scorecard for both versions, and the verdict where the accept run and the version say it
    base = registry.version_for_alias("tiny-llama", "baseline")
    for v in (base, cand):
        run = client.get_run(v.run_id)
        assert {k for k in run.data.metrics if k.startswith("_card.")} >= {"_card.1_accepted", "_card.2_size_ratio",
                                                                           "_card.4_top1_agreement"}
    assert client.get_run(base.run_id).data.params["_card.0_verdict"] == "baseline"
    assert client.get_run(cand.tags["accept_run_id"]).data.tags["verdict"] == cand.tags["verdict"]
    # the version's files are a logged model of its run (the runs table's "Logged models")
    assert cand.source.startswith("models:/m-")
    assert client.get_logged_model(cand.source[len("models:/"):]).source_run_id == cand.run_id


def test_the_draft_stage_says_what_drafting_gives_a_small_model_and_builds_a_drafter_above_its_size(
        tiny_flow_run, mlflow_store):
    """draft.enabled: below draft.min_params the stage times the accepted version's checks and says what a drafter
    could give; above it, it builds, judges and registers the drafter beside the version (the same version: the
    draft section is not part of what a candidate is)."""
    from flows.pipeline import compress_flow

    before = len(registry.list_versions("tiny-llama"))
    out = compress_flow(config="configs/tiny.yaml", overrides=tiny_flow_run["overrides"] + ["draft.enabled=true"])
    draft = out["draft"]
    assert draft["line"].startswith("skipped:") and "draft.min_params" in draft["line"], draft
    costs = draft["bound"]["costs"]
    assert costs[1] == 1.0 and len(costs) == 6 and all(c > 0.3 for c in costs[1:]), costs
    assert draft["bound"]["break_even"] == round(max(0.0, costs[2] - 1), 3)
    assert 1.0 < draft["bound"]["at"]["0.7"] < 4  # 1 + .7 + .49 + ... over a check of about a step or more
    assert len(registry.list_versions("tiny-llama")) == before
    summary = MlflowClient(mlflow_store).download_artifacts(out["run_id"], "summary.md")
    assert "**Drafter:** skipped" in open(summary).read()

    small = ["draft.min_params=0", "draft.prompts=16", "draft.max_tokens=24", "draft.tokens=5120", "draft.vocab=200",
             "draft.width=64", "draft.min_speedup=0.0001"]
    out = compress_flow(config="configs/tiny.yaml",
                        overrides=tiny_flow_run["overrides"] + ["draft.enabled=true", *small])
    version = out["registered"][-1]["version"]
    assert out["draft"]["built"]["registered"].startswith("tiny-llama-drafter/"), out["draft"]
    assert registry.get_version("tiny-llama", version).tags["drafter"] == out["draft"]["built"]["registered"]
    assert out["draft"]["line"].startswith(f"tiny-llama/{version}: one user x")
