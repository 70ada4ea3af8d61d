"""Config: defaults load, overrides apply, bad keys and values name the key and what is allowed."""

import pytest

from compress.config import ConfigError, load_config


def test_default_and_tiny_configs_are_valid():
    d = load_config("configs/default.yaml")
    t = load_config("configs/tiny.yaml")
    assert d.model.source == "embedded" and t.model.source == "tiny"
    assert d.section_hash("export") == t.section_hash("export")  # same export section -> same cache key part
    assert d.section_hash("model") != t.section_hash("model")


@pytest.mark.parametrize("path", sorted(str(p) for p in __import__("pathlib").Path("configs").glob("*.yaml")))
def test_every_shipped_config_is_valid(path):
    cfg = load_config(path)
    assert cfg.registry.model_name and cfg.name


def test_overrides_are_typed():
    cfg = load_config("configs/tiny.yaml", ["distill.steps=10", "golden.prompts=[a, b]", "quantize.reduce_range=null"])
    assert cfg.distill.steps == 10
    assert cfg.golden.prompts == ["a", "b"]
    assert cfg.quantize.reduce_range is None


def test_unknown_key_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("export:\n  exportr: dynamo\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "export.exportr" in str(e.value) and "unknown key" in str(e.value)


def test_bad_value_names_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["export.exporter=onnxmlir"])
    msg = str(e.value)
    assert "export.exporter" in msg and "'dynamo'" in msg and "'torchscript'" in msg and "onnxmlir" in msg


def test_bad_number_and_missing_file():
    with pytest.raises(ConfigError, match=r"data\.block_size"):
        load_config(None, ["data.block_size=-3"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("configs/nope.yaml")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["distill.steps"])


def test_cli_reports_config_errors_without_traceback(capsys):
    from flows.cli import main

    rc = main(["config", "check", "--config", "configs/tiny.yaml", "--set", "serve.port=99999"])
    err = capsys.readouterr().err
    assert rc == 2 and "serve.port" in err and "Traceback" not in err


def test_heldout_source_must_be_another_text():
    assert load_config(None, []).data.heldout_source == "stdlib_code"
    with pytest.raises(ConfigError, match=r"data\.heldout_source 'embedded' is data\.source itself.*none"):
        load_config(None, ["data.heldout_source=embedded"])
    with pytest.raises(ConfigError, match=r"data\.source 'stdlib_code' names a held-out source"):
        load_config(None, ["data.source=stdlib_code"])
    with pytest.raises(ConfigError, match=r"data\.test_blocks"):
        load_config(None, ["data.test_blocks=0"])
    assert load_config(None, ["data.heldout_source=none"]).data.heldout_source == "none"


def test_renamed_speed_floors_keep_their_old_name_with_a_warning():
    """min_throughput_ratio meant batch-1 decode speed in accept and server tokens/s in benchmark: renamed for
    what each measures, the old name still read (with a FutureWarning, which users see by default)."""
    from compress.config import load_config

    with pytest.warns(FutureWarning, match="accept.min_throughput_ratio is deprecated.*min_decode_speed_ratio"):
        cfg = load_config("configs/tiny.yaml", ["accept.min_throughput_ratio=0.5"])
    assert cfg.accept.min_decode_speed_ratio == 0.5
    with pytest.warns(FutureWarning, match="benchmark.min_server_throughput_ratio"):
        cfg = load_config("configs/tiny.yaml", ["benchmark.min_throughput_ratio=0.7"])
    assert cfg.benchmark.min_server_throughput_ratio == 0.7
    with pytest.raises(Exception, match="give only min_decode_speed_ratio"):
        load_config("configs/tiny.yaml", ["accept.min_throughput_ratio=0.5", "accept.min_decode_speed_ratio=0.6"])


def test_block_sizes_have_one_meaning_each():
    """quantize.block_size (weights per scale) and serve.block_size (tokens per KV block) are renamed; the server
    reads its old name too, through its own loader."""
    from serve.config import load_serve_config

    with pytest.warns(FutureWarning, match="quantize.block_size is deprecated.*quantize.weight_block_size"):
        cfg = load_config("configs/tiny.yaml", ["quantize.block_size=64"])
    assert cfg.quantize.weight_block_size == 64 and cfg.data.block_size != 64
    with pytest.warns(FutureWarning, match="serve.kv_block_size"):
        server = load_serve_config(None, ["serve.block_size=8"])
    assert server.serve.kv_block_size == 8


def test_the_selection_split_has_one_name():
    """data.eval_blocks is now data.selection_blocks, as its figures (selection_*) and DataSplits.selection are."""
    with pytest.warns(FutureWarning, match="data.eval_blocks is deprecated.*data.selection_blocks"):
        cfg = load_config(None, ["data.eval_blocks=12"])
    assert cfg.data.selection_blocks == 12
    with pytest.raises(ConfigError, match="give only selection_blocks"):  # configs/tiny.yaml sets the new name
        load_config("configs/tiny.yaml", ["data.eval_blocks=12"])


def test_the_top_level_seed_that_did_nothing_is_refused_with_the_seeds_that_act():
    with pytest.raises(ConfigError, match=r"seed \(top level\) was removed.*data\.seed.*distill\.seed.*benchmark\.seed"):
        load_config(None, ["seed=1"])
    with pytest.raises(ConfigError, match="docs/configuration.md lists every key"):
        load_config(None, ["export.exportr=dynamo"])


def test_the_export_key_leaves_out_what_the_exporter_ignores():
    """export.opset changes the dynamo/torchscript graph, not the gqa one: only the former's cache key moves."""
    for exporter, moves in (("gqa", False), ("dynamo", True), ("auto", True)):
        a = load_config(None, [f"export.exporter={exporter}", "export.opset=17"]).section_hash("export")
        b = load_config(None, [f"export.exporter={exporter}", "export.opset=18"]).section_hash("export")
        assert (a != b) == moves, exporter
    a = load_config(None, ["export.exporter=gqa", "export.external_data_threshold_mb=1"]).section_hash("export")
    assert a != load_config(None, ["export.exporter=gqa"]).section_hash("export")  # the gqa builder honours it
