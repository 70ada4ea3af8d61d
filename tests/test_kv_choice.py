"""quantize.kv_cache auto (compress/quantize/choice.py): the K/V cache is judged per model with the weight forms, in the
order of its speed at the declared concurrency, and the first form that passes the gate is kept (issue 46).

A failing int8 cache is made by calibrating its scales on ranges 100x too small (every K and V clipped): on the tiny
Llama that takes the selection split's top-1 agreement from 0.97 to 0.05, while the float cache is untouched.
"""

from __future__ import annotations

import pytest

from compress.artifact import read_manifest
from compress.config import AcceptConfig, QuantizeConfig
from compress.quantize.choice import choose_quant_form, kv_forms

GATE = AcceptConfig(enabled=True, max_perplexity_ratio=1.1, min_top1_agreement=0.9, relax_trials=1)


@pytest.fixture
def clipped_int8_cache(monkeypatch):
    import compress.quantize.kv_int8 as kv_int8

    real = kv_int8.kv_absmax
    monkeypatch.setattr(kv_int8, "kv_absmax", lambda *a, **k: {n: v * 0.01 for n, v in real(*a, **k).items()})


def test_the_cache_forms_in_the_order_of_their_speed():
    gqa = {"attention_layout": "gqa", "kv_dtype": "float32"}
    many = QuantizeConfig(kv_cache="auto", auto_concurrency=32)
    assert list(kv_forms(many, gqa)) == ["int8_tensor", "int8_channel", "float32"]
    assert list(kv_forms(many.model_copy(update={"auto_concurrency": 1}), gqa)) == ["float32", "int8_tensor",
                                                                                    "int8_channel"]
    # an int8 cache needs the gqa layout with a float32 cache; a configured cache is the only form
    assert list(kv_forms(many, {"attention_layout": "standard"})) == ["float32"]
    assert list(kv_forms(many, {"attention_layout": "gqa", "kv_dtype": "float16"})) == ["float32"]
    assert kv_forms(QuantizeConfig(kv_cache="int8", kv_cache_scales="tensor"), gqa) == {"int8_tensor": {}}


def test_auto_keeps_a_float_cache_where_int8_fails_the_gate_and_says_what_it_cost(tiny_gqa, tiny_splits, tmp_path,
                                                                                 clipped_int8_cache):
    qcfg = QuantizeConfig(method="weight_only", kv_cache="auto", auto_concurrency=32, smoothquant_alpha=None)
    choice = choose_quant_form(tiny_gqa, tmp_path / "q", tiny_splits.calib, tiny_splits.selection, qcfg, GATE)
    assert choice.chosen == "weight_only" and choice.kv_chosen == "float32"
    att = choice.forms["weight_only"]["kv_attempts"]
    assert [a["kv"] for a in att] == ["int8_tensor", "int8_channel", "float32"]
    assert [a["accepted"] for a in att] == [False, False, True]
    assert [a["trials"] for a in att[:2]] == [1, 1]  # a faster cache gets one trial: more float linears fix no cache
    assert all(a["top1_agreement"] < 0.5 and "top1_agreement" in a["failed"] and "(limit 0.9)" in a["failed"]
               for a in att[:2])
    assert att[2]["top1_agreement"] >= 0.9
    assert read_manifest(tmp_path / "q").get("kv_dtype", "float32") == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # the rejected attempts' folders are gone
    hints = choice.hints()
    assert len(hints) == 2 and hints[0].startswith("weight_only: int8 K/V per tensor: top-1 agreement 0.0")
    assert f"with float32 K/V {att[2]['top1_agreement']:.3f}" in hints[0]
    m = choice.metrics()
    assert m["auto_weight_only_kv_int8_tensor_accepted"] == 0 and m["auto_weight_only_kv_float32_accepted"] == 1
    assert m["auto_weight_only_kv_int8_channel_top1_agreement"] == att[1]["top1_agreement"]


def test_for_many_users_an_int8_cache_that_passes_is_kept_after_one_attempt(tiny_gqa, tiny_splits, tmp_path):
    qcfg = QuantizeConfig(method="weight_only", kv_cache="auto", auto_concurrency=32, smoothquant_alpha=None)
    choice = choose_quant_form(tiny_gqa, tmp_path / "q", tiny_splits.calib, tiny_splits.selection, qcfg, GATE)
    assert (choice.chosen, choice.kv_chosen) == ("weight_only", "int8_tensor")
    assert [a["kv"] for a in choice.forms["weight_only"]["kv_attempts"]] == ["int8_tensor"]
    assert read_manifest(tmp_path / "q")["kv_dtype"] == "int8" and choice.hints() == []


def test_a_failed_cache_is_compared_with_the_one_that_passed():
    """Gemma 3 270M's figures (docs/models.md): per tensor failed, per channel passed; the hint names both."""
    from compress.quantize.choice import FormChoice

    att = [{"kv": "int8_tensor", "accepted": False, "top1_agreement": 0.8812, "perplexity_ratio": 1.056},
           {"kv": "int8_channel", "accepted": True, "top1_agreement": 0.9366, "perplexity_ratio": 1.0256}]
    choice = FormChoice("dynamic_token", None, {"dynamic_token": {"kv_attempts": att}}, "int8_channel", True)
    assert choice.hints() == ["dynamic_token: int8 K/V per tensor: top-1 agreement 0.881, perplexity ratio 1.056; "
                              "with int8 K/V per channel 0.937, 1.026"]
    none = FormChoice(None, None, {"w": {"kv_attempts": [dict(att[0]), {**att[1], "accepted": False}]}}, None, True)
    assert none.hints() == []  # nothing passed and no float32 measured: nothing to compare with
