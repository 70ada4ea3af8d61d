"""compress/export/graph_fusion.py: the fused gqa graph (SkipSimplifiedLayerNormalization, packed q/k/v into GQA)
and the packed MatMulNBits after weight-only INT8 give the logits and greedy tokens of the unfused graphs."""

from __future__ import annotations

import collections
import copy

import numpy as np
import pytest

from compress.artifact import read_manifest
from compress.export.gqa import build_gqa_model
from compress.drivers.gqa import GqaLM


def _ops(m) -> collections.Counter:
    return collections.Counter(n.op_type for n in m.graph.node)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=int(rng.integers(4, 40))).tolist() for _ in range(n)]


def _compare(a: GqaLM, b: GqaLM, prompts: list[list[int]], new_tokens: int = 12) -> float:
    """Max |logit difference| over prefill positions; asserts equal greedy continuations."""
    worst = 0.0
    for p in prompts:
        worst = max(worst, float(np.abs(a.logits(p) - b.logits(p)).max()))
        assert a.greedy(p, new_tokens) == b.greedy(p, new_tokens)
    return worst


def test_fused_gqa_graph_equals_unfused(tiny, tiny_gqa):
    model, _ = tiny
    L = model.config.num_hidden_layers
    manifest = read_manifest(tiny_gqa)
    plain, fused = build_gqa_model(model, fuse=False), build_gqa_model(model)
    po, fo = _ops(plain), _ops(fused)
    # every residual Add that feeds an RMSNorm is fused (the last one feeds the logits Slice, not the norm)
    assert fo["SkipSimplifiedLayerNormalization"] == 2 * L - 1
    assert fo["Add"] == po["Add"] - (2 * L - 1)
    assert fo["MatMul"] == po["MatMul"] - 2 * L  # q, k, v -> one per layer
    gqa = [n for n in fused.graph.node if n.op_type == "GroupQueryAttention"]
    assert all(n.input[0].endswith("qkv_proj/MatMul_output_0") and n.input[1] == n.input[2] == "" for n in gqa)
    worst = _compare(GqaLM.from_model(plain, manifest), GqaLM(tiny_gqa), _prompts(3, seed=5))
    print(f"max |fused - unfused| logits: {worst:.2e}")
    assert worst < 1e-4


def test_packed_matmulnbits_equals_unpacked(tiny_gqa):
    """Weight-only INT8, then gate/up packed into one MatMulNBits + Split: the same numbers (per-column kernels)."""
    import onnx

    from compress.quantize.calibration import find_linears
    from compress.export.graph_fusion import pack_siblings
    from compress.quantize.graph import weight_only

    manifest = read_manifest(tiny_gqa)
    base = onnx.load(str(tiny_gqa / "model.onnx"))
    q = weight_only(base, find_linears(base), block_size=16, accuracy_level=4)
    packed = copy.deepcopy(q)
    assert pack_siblings(packed) == manifest["num_layers"]  # gate/up per layer (q/k/v came packed)
    ops = _ops(packed)
    assert ops["Split"] == manifest["num_layers"]
    assert ops["MatMulNBits"] == _ops(q)["MatMulNBits"] - manifest["num_layers"]
    worst = _compare(GqaLM.from_model(q, manifest), GqaLM.from_model(packed, manifest), _prompts(2, seed=6))
    print(f"max |packed - unpacked| logits (weight-only INT8): {worst:.2e}")
    assert worst < 1e-4


def test_forms_within_the_speed_tolerance_tie_and_the_more_accurate_wins():
    from compress.quantize.choice import pick_form

    # SmolLM2 in the demo of 2026-12-02: W8A8 timed 4 % faster, weight-only is the more accurate
    ms = {"weight_only": 11.96, "dynamic_token": 11.50}
    ppl = {"weight_only": 21.35, "dynamic_token": 21.64}
    assert pick_form(ms, ppl, 0.05) == "weight_only"
    assert pick_form(ms, ppl, 0.0) == "dynamic_token"  # no tolerance: the fastest, however slightly
    assert pick_form({"weight_only": 13.0, "dynamic_token": 11.5}, ppl, 0.05) == "dynamic_token"  # 13 % slower
    assert pick_form({"a": 10.0, "b": 10.2}, {"a": 20.0, "b": 20.0}, 0.05) == "a"  # equal quality: the faster


def test_quantize_auto_keeps_the_fastest_accepted_form(tiny_gqa, tiny_splits, tmp_path):
    """quantize.method auto: both INT8 forms gated on the selection split; the kept one is a timed, accepted form."""
    from compress.artifact import read_manifest
    from compress.config import AcceptConfig, QuantizeConfig
    from compress.quantize.choice import choose_quant_form
    from compress.quantize.quantizer import QuantizeError, Quantizer

    with pytest.raises(QuantizeError, match="auto"):
        Quantizer(tiny_gqa, tiny_splits.calib, QuantizeConfig(method="auto"))
    acfg = AcceptConfig(enabled=True, max_perplexity_ratio=1.5, min_top1_agreement=0.5, relax_trials=0)
    choice = choose_quant_form(tiny_gqa, tmp_path / "q", tiny_splits.calib, tiny_splits.selection,
                               QuantizeConfig(method="auto", auto_forms=["weight_only", "dynamic_token"],
                                              quantize_embedding=False, smoothquant_alpha=None), acfg)
    print({n: (f["accepted"], f.get("decode_ms_per_step")) for n, f in choice.forms.items()})
    assert set(choice.forms) == {"weight_only", "dynamic_token"}
    assert all(f["accepted"] for f in choice.forms.values())
    speed = {n: f["decode_ms_per_step"] for n, f in choice.forms.items()}
    ppl = {n: f["metrics"]["perplexity"] for n, f in choice.forms.items()}
    fastest = min(speed.values())
    tied = [n for n in speed if speed[n] <= 1.05 * fastest]  # quantize.auto_speed_tolerance 0.05
    assert choice.chosen == min(tied, key=lambda n: (ppl[n], speed[n]))
    method = read_manifest(tmp_path / "q")["quantization"]["method"]
    assert method == {"weight_only": "weight_only", "dynamic_token": "dynamic"}[choice.chosen]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]  # the other form's folder is gone
    assert GqaLM(tmp_path / "q").greedy([5, 6, 7], 4)


def test_quantize_auto_for_many_users_keeps_the_form_with_the_most_tokens_per_s_at_that_batch(tiny_gqa,
                                                                                              tiny_splits, tmp_path):
    """quantize.auto_concurrency N > 1: both forms timed on the serving engine at batch 1 and at N (logged); the kept
    one has the most tokens/s at N, forms within the tolerance tying on perplexity."""
    from compress.config import AcceptConfig, QuantizeConfig
    from compress.quantize.choice import choose_quant_form, profile_figure

    acfg = AcceptConfig(enabled=True, max_perplexity_ratio=1.5, min_top1_agreement=0.5, relax_trials=0)
    qcfg = QuantizeConfig(method="auto", auto_forms=["weight_only", "dynamic_token"], quantize_embedding=True,
                          smoothquant_alpha=None, auto_concurrency=8, auto_profile=[4])
    choice = choose_quant_form(tiny_gqa, tmp_path / "q", tiny_splits.calib, tiny_splits.selection, qcfg, acfg)
    forms = choice.forms
    assert all(f["accepted"] and f["tokens_per_s_b1"] > 0 and f["tokens_per_s_b8"] > 0 for f in forms.values())
    at8 = {n: f["tokens_per_s_b8"] for n, f in forms.items()}
    ppl = {n: f["metrics"]["perplexity"] for n, f in forms.items()}
    best = max(at8.values())
    tied = [n for n in at8 if 1000 / at8[n] <= 1.05 * 1000 / best]
    assert choice.chosen == min(tied, key=lambda n: (ppl[n], -at8[n]))
    m = choice.metrics()
    assert m["auto_weight_only_tokens_per_s_b8"] == at8["weight_only"] and "auto_dynamic_token_tokens_per_s_b1" in m
    assert all(f["tokens_per_s_b4"] > 0 for f in forms.values())  # the profile's extra level, measured and logged
    fig = profile_figure(forms, choice.chosen)
    assert [len(line.get_xdata()) for line in fig.axes[0].get_lines()] == [3, 3]  # 1, 4 and 8 users per form


def test_quantize_auto_judges_every_form_against_one_reference_pass(tiny_gqa, tiny_splits, tmp_path, monkeypatch):
    """The fp32 source runs once over the selection split for both forms (its logits spooled), and each form's
    figures and verdict are those of judging it alone against its own pass of the source."""
    import compress.evaluate.onnx_eval as ev
    from compress.config import AcceptConfig, QuantizeConfig
    from compress.quantize.choice import AUTO_FORMS, choose_quant_form
    from compress.quantize.relax import quantize_with_acceptance

    passes = []
    real = ev.ReferencePass.__init__

    def counted(self, artifact, *a, **k):
        passes.append(str(artifact))
        real(self, artifact, *a, **k)

    acfg = AcceptConfig(enabled=True, max_perplexity_ratio=1.5, min_top1_agreement=0.5, relax_trials=0)
    qcfg = QuantizeConfig(method="auto", auto_forms=["weight_only", "dynamic_token"], quantize_embedding=False,
                          smoothquant_alpha=None)
    monkeypatch.setattr(ev.ReferencePass, "__init__", counted)
    choice = choose_quant_form(tiny_gqa, tmp_path / "q", tiny_splits.calib, tiny_splits.selection, qcfg, acfg)
    assert passes == [str(tiny_gqa)]  # one pass for both forms
    for name in qcfg.auto_forms:
        update = AUTO_FORMS[name]
        alone = quantize_with_acceptance(tiny_gqa, tmp_path / f"alone_{name}", tiny_splits.calib, tiny_splits.selection,
                                         qcfg.model_copy(update=update), acfg)
        shared = choice.forms[name]
        assert alone.verdict.accepted == shared["accepted"] and alone.verdict.reasons == shared["reasons"]
        for k in ("perplexity", "top1_agreement", "kl_to_reference", "eval_tokens"):
            assert alone.metrics[k] == shared["metrics"][k], (name, k)
    assert len(passes) == 3  # and each form alone made its own


def test_big_graphs_are_timed_one_at_a_time(tiny_gqa, monkeypatch):
    """Over INTERLEAVED_TIMING_MAX_BYTES in all, each form is timed on its own (one graph in memory at a time); the
    records and the pick are those of the interleaved timing."""
    from compress.config import QuantizeConfig
    from compress.quantize import choice
    from compress.quantize.choice import pick_form

    seen = []
    real_step, real_engine = choice.decode_step_ms, choice.engine_tokens_per_s
    monkeypatch.setattr(choice, "decode_step_ms", lambda a, **kw: (seen.append(sorted(a)), real_step(a, **kw))[1])
    monkeypatch.setattr(choice, "engine_tokens_per_s",
                        lambda a, b, **kw: (seen.append(sorted(a)), real_engine(a, b, **kw))[1])
    forms = {"a": tiny_gqa, "b": tiny_gqa}
    qcfg = QuantizeConfig(auto_concurrency=2)
    for limit, calls in ((1 << 40, [["a", "b"]] * 3), (0, [["a"], ["b"]] * 3)):
        monkeypatch.setattr(choice, "INTERLEAVED_TIMING_MAX_BYTES", limit)
        seen.clear()
        record = {"a": {}, "b": {}}
        kept = choice.fastest_form(forms, {"a": 1.0, "b": 2.0}, record, qcfg, [3, 4, 5, 6])
        assert seen == calls
        assert all(set(r) == {"decode_ms_per_step", "tokens_per_s_b1", "tokens_per_s_b2"} for r in record.values())
        rates = {n: 1000.0 / r["tokens_per_s_b2"] for n, r in record.items()}
        assert kept == pick_form(rates, {"a": 1.0, "b": 2.0}, qcfg.auto_speed_tolerance)
