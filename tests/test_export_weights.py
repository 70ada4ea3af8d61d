"""export.weights int8 (compress/export/weights.py): the INT8 graph written straight from the checkpoint is the
candidate, the checkpoint (recorded by digest, no weights copied) the baseline and the reference; the settings that
need the fp32 graph are refused up front; auto picks int8 from 1B parameters only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compress.artifact import checkpoint_digest, read_manifest
from compress.config import ConfigError, load_config
from compress.export.weights import fallback_weights, fp32_needed_by, int4_wanted_by, resolve_weights
from compress.sizing.memory import GIB, MemoryBudgetError, Shape, check_stage_memory
from serve.artifact import ArtifactError

INT8_RUN = ["prune.enabled=false", "distill.enabled=false", "quantize.method=weight_only", "accept.relax_trials=0",
            "export.weights=int8", "registry.model_name=tiny-int8", "mlflow.experiment=tiny-int8"]


def test_auto_writes_int8_from_1b_parameters_unless_a_stage_needs_fp32():
    assert resolve_weights("auto", 1_240_000_000, None)[0] == "int8"
    weights, why = resolve_weights("auto", 1_240_000_000, None, "quantize.method auto weighs weight_only_int4")
    assert weights == "int4" and "int8 where it fails" in why
    assert resolve_weights("auto", 135_000_000, None, "quantize.weight_bits 4")[0] == "float32"
    assert resolve_weights("auto", 135_000_000, None)[0] == "float32"
    weights, why = resolve_weights("auto", 7_600_000_000, "pruning or distillation starts from the fp32 model")
    assert weights == "float32" and "pruning" in why
    assert resolve_weights("float32", 7_600_000_000, None)[0] == "float32"
    assert fp32_needed_by(load_config("configs/large.yaml")) is None
    assert "pruning" in fp32_needed_by(load_config("configs/tiny.yaml"))
    w8a8 = load_config("configs/large.yaml", ["quantize.method=static"])
    assert "quantize.method static" in fp32_needed_by(w8a8)


def test_4_bits_first_only_where_the_quantize_section_weighs_them_and_8_bits_only_as_auto_s_fallback():
    shipped = load_config("configs/default.yaml")
    assert "weight_only_int4" in int4_wanted_by(shipped)
    assert fallback_weights("auto", "int4", shipped) == "int8"
    assert fallback_weights("int4", "int4", shipped) is None  # the user named the weights: judged as they are
    int8_only = load_config("configs/default.yaml", ['quantize.auto_forms=["weight_only","dynamic_token"]'])
    assert int4_wanted_by(int8_only) is None
    asked = load_config("configs/default.yaml", ["quantize.method=weight_only", "quantize.weight_bits=4"])
    assert int4_wanted_by(asked) == "quantize.weight_bits 4" and fallback_weights("auto", "int4", asked) is None


@pytest.mark.parametrize("extra, names", [
    (["prune.enabled=true"], "prune.enabled"),
    (["quantize.method=static"], "quantize.method"),
    (["accept.reference=artifact"], "accept.reference"),
    (["export.exporter=dynamo"], "export.exporter"),
])
def test_settings_that_need_the_fp32_graph_are_refused_by_name(extra, names):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", INT8_RUN + extra)
    assert names in str(e.value) and "export.weights" in str(e.value)


def test_golden_of_the_int8_graph_refuses_up_front_with_its_figures():
    seven_b = Shape(params=7_615_616_512, vocab=152_064, hidden=3584, tied=False)
    with pytest.raises(MemoryBudgetError) as e:
        check_stage_memory("golden_int8", seven_b, available=8 * GIB)
    msg = str(e.value)
    assert "golden_int8" in msg and "7.62B parameters" in msg and "8.0 GiB are free" in msg
    need = check_stage_memory("golden_int8", seven_b, available=64 * GIB)
    assert 2 * seven_b.params < need < 2.5 * seven_b.params  # the checkpoint as stored, never an fp32 copy


@pytest.fixture(scope="module")
def int8_run(prefect_harness, mlflow_store, tmp_path_factory):
    from flows.pipeline import compress_flow

    work = tmp_path_factory.mktemp("work_int8")
    out = compress_flow(config="configs/tiny.yaml", overrides=INT8_RUN + [f"workdir={work}"])
    return out, work


def test_the_int8_export_is_the_candidate_judged_against_the_checkpoint(int8_run):
    out, work = int8_run
    stages = [row["stage"] for row in out["stages"]]
    assert "quantize" not in stages and "prune" not in stages
    assert out["verdict"]["accepted"], out["verdict"]["reasons"]
    assert out["verdict"]["reference"] == "checkpoint"
    cand = read_manifest(out["candidate_artifact"])
    assert cand["quantization"]["written_from"] == "checkpoint" and cand["quantization"]["block_size"] == 32
    assert out["candidate_artifact"] == out["teacher_artifact"]
    # the rounding's own distance to the checkpoint bounds the graph's (an fp32 tiny: the same arithmetic)
    g = out["golden"]
    assert g["golden_passed"] == 1.0
    assert g["golden_max_abs_error"] <= 1.5 * g["golden_int8_expected_max_abs_error"] + 1e-3


def test_the_baseline_version_records_the_checkpoint_by_digest(int8_run, tmp_path):
    from compress.registry import store as registry
    from serve.engine.engine import Engine
    from serve.registry.client import download

    out, _ = int8_run
    base, cand = out["registered"][0], out["registered"][-1]
    assert base["version"] != cand["version"]
    version = registry.get_version("tiny-int8", base["version"])
    assert version.tags["weights"] == "checkpoint_record" and "baseline" in version.aliases
    folder = download(f"models:/tiny-int8/{base['version']}", tmp_path / "base")
    names = {p.name for p in folder.iterdir()}
    assert "MLmodel" not in names and not any(n.endswith((".onnx", ".data", ".safetensors")) for n in names)
    manifest = read_manifest(folder)
    assert manifest["kind"] == "checkpoint_record"
    source = Path(manifest["source_model"])
    assert manifest["checkpoint"]["sha256"] == checkpoint_digest(source)["sha256"]
    assert json.loads((folder / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    with pytest.raises(ArtifactError, match="records the source checkpoint"):
        Engine(folder)
    served = download(f"models:/tiny-int8/{cand['version']}", tmp_path / "cand")
    assert (served / "MLmodel").is_file() and read_manifest(served)["quantization"]["written_from"] == "checkpoint"


def run_as_large(tmp_path_factory, name: str, extra: list[str]) -> dict:
    """compress_flow on configs/tiny.yaml with export.weights auto, the tiny model taken for a large one (the 1B
    threshold lowered), into registered model and experiment ``name``."""
    import compress.export.weights as weights
    from flows.pipeline import compress_flow

    work = tmp_path_factory.mktemp(name)
    over = ["prune.enabled=false", "distill.enabled=false", "quantize.method=auto", "accept.relax_trials=0",
            "export.weights=auto", f"registry.model_name={name}", f"mlflow.experiment={name}", f"workdir={work}",
            *extra]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weights, "CHECKPOINT_FROM_PARAMS", 1000)
        return compress_flow(config="configs/tiny.yaml", overrides=over)


@pytest.fixture(scope="module")
def auto_run(prefect_harness, mlflow_store, tmp_path_factory):
    """With an agreement limit its 4-bit graphs miss (0.68 on the selection split) and its 8-bit one meets (0.97)."""
    return run_as_large(tmp_path_factory, "tiny-auto-weights",
                        ["accept.min_top1_agreement=0.8", "quantize.int4_keep_int8_tries=[0.0]"])


def test_auto_writes_4_bits_first_and_8_bits_where_the_gate_rejects_them_saying_why(auto_run):
    out = auto_run
    stages = [row["stage"] for row in out["stages"]]
    # the ladder: 4 bits with no group at 8 bits (int4_keep_int8_tries), then with int4_keep_int8's share, then 8 bits
    assert stages.count("export") == 3 and stages.count("export_gate") == 3 and "quantize" not in stages
    gates = [row["metrics"] for row in out["stages"] if row["stage"] == "export_gate"]
    assert gates[0]["auto_weight_only_int4_accepted"] == gates[1]["auto_weight_only_int4_accepted"] == 0.0
    assert gates[1]["auto_weight_only_int4_top1_agreement"] < 0.8 <= gates[2]["auto_weight_only_top1_agreement"]
    assert gates[2]["auto_weight_only_accepted"] == 1.0
    # each try keeps more at 8 bits, so each is larger: what the fallback gave up, in the same table
    assert (gates[0]["auto_weight_only_int4_size_ratio"] < gates[1]["auto_weight_only_int4_size_ratio"]
            < gates[2]["auto_weight_only_size_ratio"])
    cand = read_manifest(out["candidate_artifact"])
    assert cand["quantization"]["written_from"] == "checkpoint" and cand["quantization"]["weight_bits"] == 8
    verdict = out["verdict"]
    assert verdict["accepted"], verdict["reasons"]
    # the accept stage reused the kept form's selection figures instead of measuring them again
    assert verdict["evaluated_in"] == "quantize"
    assert verdict["side"]["selection_top1_agreement"] == pytest.approx(gates[2]["auto_weight_only_top1_agreement"])


@pytest.fixture(scope="module")
def timed_run(prefect_harness, mlflow_store, tmp_path_factory):
    """Under tiny.yaml's loose limits, which its 4-bit graph passes: the INT8 graph is written and gated too, and the
    two timed at 4 users."""
    return run_as_large(tmp_path_factory, "tiny-timed-weights", ["quantize.auto_concurrency=4"])


def test_a_passing_4_bit_graph_is_timed_against_int8_and_the_faster_at_the_users_kept(timed_run):
    from compress.quantize.choice import pick_form

    out = timed_run
    stages = [row["stage"] for row in out["stages"]]
    assert stages.count("export") == 2 and stages.count("export_gate") == 2 and stages.count("export_timing") == 1
    gates = [row["metrics"] for row in out["stages"] if row["stage"] == "export_gate"]
    assert gates[0]["auto_weight_only_int4_accepted"] == gates[1]["auto_weight_only_accepted"] == 1.0
    timing = next(row["metrics"] for row in out["stages"] if row["stage"] == "export_timing")
    tps = {f: timing[f"auto_{f}_tokens_per_s_b4"] for f in ("weight_only_int4", "weight_only")}
    assert all(v > 0 for v in tps.values()) and "auto_weight_only_int4_tokens_per_s_b1" in timing
    ppl = {"weight_only_int4": gates[0]["auto_weight_only_int4_perplexity_ratio"],
           "weight_only": gates[1]["auto_weight_only_perplexity_ratio"]}
    kept = pick_form({f: 1000.0 / v for f, v in tps.items()}, ppl, 0.05)
    bits = read_manifest(out["candidate_artifact"])["quantization"]["weight_bits"]
    assert bits == (4 if kept == "weight_only_int4" else 8)
    assert out["verdict"]["accepted"] and out["verdict"]["evaluated_in"] == "quantize"


def test_auto_for_size_stops_at_the_first_4_bit_graph_that_passes(prefect_harness, mlflow_store, tmp_path_factory):
    """quantize.auto_objective size: the 4-bit graph passes, so no INT8 graph is written and nothing timed; the
    4-bit graph is the candidate the accept stage judges."""
    out = run_as_large(tmp_path_factory, "tiny-size-weights", ["quantize.auto_objective=size",
                                                                "quantize.auto_concurrency=4"])
    stages = [row["stage"] for row in out["stages"]]
    assert stages.count("export") == 1 and stages.count("export_gate") == 1 and "export_timing" not in stages
    gate = next(row["metrics"] for row in out["stages"] if row["stage"] == "export_gate")
    assert gate["auto_weight_only_int4_accepted"] == 1.0
    assert read_manifest(out["candidate_artifact"])["quantization"]["weight_bits"] == 4
    assert out["verdict"]["accepted"] and out["verdict"]["evaluated_in"] == "quantize"


def test_the_forms_table_names_each_4_bit_try_by_its_8_bit_groups_and_marks_one_kept():
    from flows.summary import forms_markdown

    row = {"kv": "float32", "kv_label": "as exported", "perplexity_ratio": 1.0, "top1_agreement": 0.9, "failed": ""}
    attempts = [{**row, "form": "weight_only_int4", "int8_share": 0.0, "int8_groups": 0, "accepted": False,
                 "failed": "top1_agreement 0.7 (limit 0.8)"},
                {**row, "form": "weight_only_int4", "int8_share": 0.25, "int8_groups": 3, "accepted": True}]
    table = forms_markdown({"attempts": attempts, "chosen": "weight_only_int4", "kv": "float32", "hints": []})
    lines = [ln for ln in table.splitlines() if ln.startswith("| weight_only_int4")]
    assert lines[0].startswith("| weight_only_int4 (0 groups at 8 bits) |") and "(kept)" not in lines[0]
    assert lines[1].startswith("| weight_only_int4 (3 groups at 8 bits) (kept) |")
    timed = forms_markdown({"attempts": [{**attempts[1], "tokens_per_s_b1": 34.0, "tokens_per_s_b32": 153.6}],
                            "chosen": "weight_only_int4", "kv": "float32", "hints": []})
    assert "| 34 / 154 at 1 / 32 |" in timed  # every level timed, the deployment's among them


def test_the_keep_ladder_tries_each_share_once_and_checks_them():
    from compress.config import ConfigError, QuantizeConfig, load_config
    from compress.export.weights import int4_keep_ladder

    assert int4_keep_ladder(QuantizeConfig(int4_keep_int8_tries=[0.1, 0.25], int4_keep_int8=0.25)) == [0.1, 0.25]
    assert int4_keep_ladder(QuantizeConfig()) == [0.25]
    assert int4_keep_ladder(load_config("configs/default.yaml").quantize)[0] < 0.25
    with pytest.raises(ConfigError, match="int4_keep_int8_tries"):
        load_config("configs/tiny.yaml", ["quantize.int4_keep_int8_tries=[1.5]"])


def test_the_docs_name_the_keys_and_paths_that_exist():
    from compress.config import PipelineConfig, project_root

    root = project_root()
    cfg = PipelineConfig()
    assert cfg.export.weights == "auto" and cfg.golden.int8_margin == 2.0
    models = (root / "docs" / "models.md").read_text()
    assert "### No fp32 copy: the INT8 export" in models
    assert "#no-fp32-copy-the-int8-export" in (root / "docs" / "getting-started.md").read_text()
    for path in ("compress/export/weights.py", "compress/evaluate/golden_int8.py", "tests/test_golden_int8.py"):
        assert path in models and (root / path).is_file()
    for key in ("export.weights", "golden.int8_margin", "quantize.weight_block_size", "quantize.accuracy_level"):
        assert key in models
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name)
