"""Every `auto` of a run's config resolved in one step after load (compress/resolve): the config the rest of the run
uses, one row per `auto` with its value and why, logged once (resolved_config.json and summary.md)."""

from __future__ import annotations

import json

import pytest

from compress.config import ConfigError, load_config
from compress.resolve import resolve_config

GQA = ("gqa", "auto: llama fits the gqa builder")


def _rows(resolved) -> dict:
    return {s.key: s for s in resolved.settings}


def test_a_small_pruned_model_resolves_to_the_fp32_graph_judged_on_quality():
    cfg = load_config("configs/tiny.yaml", ["export.exporter=auto", "export.weights=auto", "accept.criteria=auto",
                                            "accept.reference=auto", "accept.max_chat_judged_ratio=auto"])
    r = resolve_config(cfg, params=2_000_000, model_dir="/nonexistent", exporter_auto=GQA)
    rows = _rows(r)
    assert (r.cfg.export.exporter, r.cfg.export.weights) == ("gqa", "float32") and "pruning" in rows["export.weights"].why
    assert r.cfg.accept.criteria == "quality" and r.cfg.accept.max_chat_judged_ratio == 1.25
    assert r.cfg.accept.reference == "artifact"
    assert all(rows[k].fixed for k in ("export.exporter", "export.weights", "accept.criteria", "accept.reference"))
    assert not rows["distill.amp"].fixed and rows["distill.amp"].value in ("bfloat16", "off")
    assert r.cfg.distill.amp == "auto"  # where it trains decides; the row says what this machine gives
    assert json.loads(json.dumps(r.to_json()))[0]["key"] == "export.exporter"
    assert "| `accept.criteria` | quality |" in r.markdown()


def test_a_1b_checkpoint_is_written_int8_and_judged_against_itself_unless_a_speed_floor_needs_the_graph():
    cfg = load_config("configs/tiny.yaml", ["prune.enabled=false", "distill.enabled=false", "quantize.method=weight_only", "export.weights=auto",
                                            "accept.reference=auto", "accept.criteria=auto"])
    r = resolve_config(cfg, params=1_240_000_000, model_dir="/nonexistent", exporter_auto=GQA)
    assert (r.cfg.export.weights, r.cfg.accept.reference, r.cfg.accept.criteria) == ("int8", "checkpoint", "fidelity")
    assert "no fp32 graph" in _rows(r)["accept.reference"].why
    floor = load_config("configs/tiny.yaml", ["prune.enabled=false", "distill.enabled=false", "quantize.method=weight_only", "export.weights=auto",
                                              "accept.reference=auto", "accept.min_decode_speed_ratio=0.9"])
    r = resolve_config(floor, params=1_240_000_000, model_dir="/nonexistent", exporter_auto=GQA)
    assert (r.cfg.export.weights, r.cfg.accept.reference) == ("float32", "artifact")
    assert "decode speed" in _rows(r)["export.weights"].why


def test_auto_values_that_conflict_are_refused_naming_what_they_became():
    cfg = load_config("configs/tiny.yaml", ["prune.enabled=false", "distill.enabled=false", "quantize.method=weight_only", "export.exporter=auto",
                                            "export.weights=int8"])
    with pytest.raises(ConfigError, match=r"export.exporter auto -> dynamo.*set the conflicting setting explicitly"):
        resolve_config(cfg, params=1_240_000_000, model_dir="/nonexistent",
                       exporter_auto=("dynamo", "auto: the gqa builder does not take this model"))
