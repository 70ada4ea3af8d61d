"""4-bit weights (quantize.weight_bits 4): the kernel's grid, AWQ's scaling, mixed precision, the gate and auto.

The tiny models are random or barely trained, so these assert what the 4-bit form is (the kernel computes the
weights it holds, AWQ lowers the measured error, the groups kept at 8 bits are the measured worst), what the gate does
with a broken one, and that ``auto`` falls back to INT8 with the reason; accuracy on trained weights is measured in
benchmarks and docs/quantization.md.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compress.artifact import read_manifest, write_manifest
from compress.config import AcceptConfig, QuantizeConfig
from compress.drivers import lm_for_model
from compress.loading.tiny import FAMILIES
from compress.evaluate.gate import accept
from compress.evaluate.onnx_eval import evaluate_onnx
from compress.quantize.calibration import Linear
from compress.quantize.graph import weight_only
from compress.quantize.int4 import choose_awq, dequantized_model, fake_quant_w4, w4_output_error
from compress.quantize.quantizer import QuantizeError, Quantizer, quantize_artifact

W4 = dict(method="weight_only", weight_bits=4, smoothquant_alpha=None)


def _nbits(folder) -> dict[int, int]:
    """MatMulNBits nodes of an artifact by their bits attribute."""
    m = onnx.load(str(folder / "model.onnx"))
    out: dict[int, int] = {}
    for n in m.graph.node:
        if n.op_type == "MatMulNBits":
            b = next(a.i for a in n.attribute if a.name == "bits")
            out[b] = out.get(b, 0) + 1
    return out


def _one_matmul(w: np.ndarray) -> onnx.ModelProto:
    K, N = w.shape
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, N])],
                          initializer=[numpy_helper.from_array(w, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.mark.parametrize("symmetric", [False, True])
def test_without_clipping_the_4bit_tensors_are_ort_s_own(symmetric):
    """compress/formats/nbits.py pack_w4 with quantize.weight_clip none writes what ORT's block quantizer writes, bit for bit
    (its layout: codes low nibble first, scales per block, zero points two a byte); with mse the block ranges shrink
    where that lowers the error, so the weight error falls and every scale is at most ORT's."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                 DefaultWeightOnlyQuantizer)

    from compress.formats.nbits import pack_w4, w4_weight_error

    rng = np.random.default_rng(3)
    w = rng.standard_normal((96, 40)).astype(np.float32)  # 3 blocks along K: an odd count of zero points a column
    w[:, 3] += 2.0
    w[5, 7] = 9.0  # an outlier: its block is where clipping pays
    ort_q = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=symmetric,
                                                                    accuracy_level=4, bits=4))
    ref = ort_q.qbits_block_quant(w)
    ours = pack_w4(w, 32, symmetric, clip=False)
    np.testing.assert_array_equal(ours[0], ref[0])
    np.testing.assert_array_equal(ours[1], ref[1].reshape(ours[1].shape))
    if not symmetric:
        np.testing.assert_array_equal(ours[2], ref[2])
    clipped = pack_w4(w, 32, symmetric, clip=True)
    assert (np.abs(clipped[1]) <= np.abs(ours[1]) + 1e-12).all() and (np.abs(clipped[1]) < np.abs(ours[1])).any()
    assert w4_weight_error(w, 32, symmetric, clip=True) < w4_weight_error(w, 32, symmetric, clip=False)


@pytest.mark.parametrize("symmetric,clip", [(False, True), (True, True), (False, False)])
def test_the_search_scores_the_grid_the_kernel_uses(symmetric, clip):
    """fake_quant_w4 (what AWQ and the mixed-precision ranking score) is the weight the writer writes, and the kernel
    at accuracy_level 0 computes exactly that weight's product."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 40)).astype(np.float32)
    w[:, 3] += 2.0  # a column all of one sign: the asymmetric grid's zero point moves
    m = weight_only(_one_matmul(w), [Linear("mm", "mm", "linear", None, "x", "W")], 32, 0, bits=4, symmetric=symmetric,
                    clip=clip)
    node = next(n for n in m.graph.node if n.op_type == "MatMulNBits")
    assert next(a.i for a in node.attribute if a.name == "bits") == 4
    assert len(node.input) == (3 if symmetric else 4)  # zero points only when asymmetric
    d = dequantized_model(m)
    held = numpy_helper.to_array(next(i for i in d.graph.initializer if i.name.endswith("_dequantized")))
    np.testing.assert_array_equal(held, fake_quant_w4(w, 32, symmetric, clip))
    x = rng.standard_normal((5, 96)).astype(np.float32)
    y = ort.InferenceSession(m.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ held, rtol=1e-5, atol=1e-4)
    # 4 bits lose what they lose: the error against the float product is far above the kernel's own
    assert np.abs(y - x @ w).max() > 100 * np.abs(y - x @ held).max()


def test_awq_scales_lower_the_measured_error_where_channels_are_loud():
    """One input channel 30x louder than the rest: AWQ's scale (found by the grid search) lowers the 4-bit output
    error against plain rounding, and the scaled product is the float one (x / s)(s W) = x W."""
    from compress.quantize.calibration import ActStats

    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    x[:, 5] *= 30.0
    w = rng.standard_normal((64, 48)).astype(np.float32) * 0.05
    st = ActStats(cmin=x.min(0), cmax=x.max(0), sample=x)
    s, alpha, err = choose_awq(st, [w], 32)
    plain = w4_output_error(x, [w], 32)
    assert 0 < alpha <= 1 and err < 0.8 * plain
    np.testing.assert_allclose((x / s) @ (w * s[:, None]), x @ w, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def int4_tiny(tiny_gqa, tiny_splits, tmp_path_factory):
    """The tiny gqa artifact in the 4-bit form (AWQ, asymmetric), at accuracy_level 0 and 4."""
    root = tmp_path_factory.mktemp("int4")
    out = {}
    for level in (0, 4):
        rep = quantize_artifact(tiny_gqa, root / f"l{level}", tiny_splits.calib, QuantizeConfig(**W4, accuracy_level=level))
        out[level] = (root / f"l{level}", rep)
    return out


def _kernel_error(folder, blocks) -> tuple[float, float]:
    """(mean |graph - dequantized graph| / mean |logit|, top-1 agreement between them) over ``blocks``."""
    m = onnx.load(str(folder / "model.onnx"))
    man = read_manifest(folder)
    got = np.concatenate(list(lm_for_model(m, man).prefill_batches(blocks)))
    want = np.concatenate(list(lm_for_model(dequantized_model(m), man).prefill_batches(blocks)))
    return float(np.abs(got - want).mean() / np.abs(want).mean()), float((got.argmax(-1) == want.argmax(-1)).mean())


def test_the_4bit_graph_computes_its_dequantized_weights(int4_tiny, tiny_gqa, tiny_splits, tmp_path):
    """The artifact's logits against the same graph with every MatMulNBits a float MatMul on the weights it holds.
    accuracy_level 0 (float compute): equal. Level 4 (the default: the kernel rounds each input to int8 per block of
    32): the error is that rounding's alone, so it is the 8-bit form's at level 4 on the same inputs, within a
    factor of 2 (4-bit weights make the products the rounding errors pass through a little different)."""
    blocks = tiny_splits.selection[:4]
    rel0, agree0 = _kernel_error(int4_tiny[0][0], blocks)
    rel4, agree4 = _kernel_error(int4_tiny[4][0], blocks)
    quantize_artifact(tiny_gqa, tmp_path / "w8", tiny_splits.calib, QuantizeConfig(method="weight_only", smoothquant_alpha=None))
    rel8, _ = _kernel_error(tmp_path / "w8", blocks)
    print(f"kernel vs dequantized weights: 4-bit level 0 {rel0:.1e}, 4-bit level 4 {rel4:.2e}, 8-bit level 4 {rel8:.2e}")
    assert rel0 < 1e-5 and agree0 == 1.0
    assert 0 < rel4 < 2 * rel8 and agree4 > 0.95


def test_mixed_precision_keeps_the_measured_worst_groups_at_8_bits(int4_tiny, tiny_gqa, tiny_splits):
    folder, rep = int4_tiny[4]
    q = Quantizer(tiny_gqa, tiny_splits.calib, QuantizeConfig(**W4))
    from compress.quantize.sensitivity import candidate_ranking

    ranking = candidate_ranking(q)
    groups = rep.settings["int8_groups"]
    # int4_keep_int8 0.25 of the 8 groups (2 layers x qkv, o, gate_up, down) -> 2, the worst by measured error
    assert groups == ranking[:2] and len(ranking) == 8
    bits = _nbits(folder)
    # gate/up and q/k/v come packed: 2 layers x (qkv, o, gate_up, down) = 8 products, two groups of them at 8 bits,
    # plus the tied lm_head's 8-bit table
    assert bits[4] == 6 and bits[8] == 3, bits
    assert rep.settings["weight_bits"] == 4 and "awq" in rep.settings["weights"]
    assert rep.settings["smoothquant_alphas"], "AWQ scaled no activation of the tiny model"
    # 4 bits: smaller than the 8-bit form of the same graph
    w8 = quantize_artifact(tiny_gqa, folder.parent / "w8", tiny_splits.calib,
                           QuantizeConfig(method="weight_only", smoothquant_alpha=None))
    assert rep.bytes_after < w8.bytes_after


def test_4bit_needs_the_calib_split(tiny_gqa):
    with pytest.raises(QuantizeError, match="weight_bits 4.*calib split.*weight_bits: 8"):
        Quantizer(tiny_gqa, None, QuantizeConfig(**W4))


def _destroy_layer(folder, layer: int) -> None:
    """Every 4-bit block of one decoder layer's products rounded to its lowest level (all nibbles 0)."""
    m = onnx.load(str(folder / "model.onnx"), load_external_data=True)
    inits = {i.name: i for i in m.graph.initializer}
    hit = 0
    for n in m.graph.node:
        if n.op_type == "MatMulNBits" and f"layers/{layer}/" in n.name and next(
                a.i for a in n.attribute if a.name == "bits") == 4:
            b = inits[n.input[1]]
            b.CopyFrom(numpy_helper.from_array(np.zeros(numpy_helper.to_array(b).shape, np.uint8), b.name))
            hit += 1
    assert hit
    onnx.save(m, str(folder / "model.onnx"))


def test_the_gate_rejects_a_4bit_form_with_one_destroyed_layer(trained_tiny4, tiny_splits, tmp_path):
    """On a trained tiny model the 4-bit form passes a gate its figures meet; the same form with one decoder layer's
    4-bit blocks destroyed fails it, on perplexity and agreement."""
    from compress.export.gqa import build_gqa_artifact
    from compress.loading.tiny import build_tiny_llama

    tok = build_tiny_llama(seed=1, num_hidden_layers=4)[1]
    src = tmp_path / "fp32"
    build_gqa_artifact(trained_tiny4, tok, src)
    quantize_artifact(src, tmp_path / "w4", tiny_splits.calib, QuantizeConfig(**W4, int4_keep_int8=0.0))
    base = evaluate_onnx(src, tiny_splits.selection, latency=False)
    cfg = AcceptConfig(max_perplexity_ratio=1.10, min_top1_agreement=0.80)

    def verdict(label):
        m = evaluate_onnx(tmp_path / "w4", tiny_splits.selection, reference_artifact=src, latency=False)
        v = accept(m, base, cfg, criteria="fidelity")
        print(f"{label}: perplexity ratio {m['perplexity'] / base['perplexity']:.3f}, top-1 {m['top1_agreement']:.3f}",
              v.reasons)
        return v

    v = verdict("intact 4-bit")
    assert v.accepted, v.reasons
    _destroy_layer(tmp_path / "w4", 2)
    v = verdict("layer 2 destroyed")
    assert not v.accepted
    assert any(c["name"].startswith("perplexity") and not c["passed"] for c in v.checks)


def test_auto_keeps_int8_when_4bit_fails_and_says_why(tiny_gqa, tiny_splits, tmp_path):
    """Random tiny weights: 4 bits move the argmax on about a third of the positions, 8 bits on a few; with the
    agreement limit between them auto keeps weight-only INT8 and the 4-bit form's record names the failed check."""
    from compress.quantize.choice import choose_quant_form

    qcfg = QuantizeConfig(method="auto", auto_forms=["weight_only", "weight_only_int4"])
    acfg = AcceptConfig(min_top1_agreement=0.9, max_perplexity_ratio=1.5, relax_trials=0)
    choice = choose_quant_form(tiny_gqa, tmp_path / "q", tiny_splits.calib, tiny_splits.selection, qcfg, acfg)
    f4 = choice.forms["weight_only_int4"]
    print({n: (f["accepted"], round(f["metrics"]["top1_agreement"], 3)) for n, f in choice.forms.items()})
    assert choice.chosen == "weight_only"
    assert not f4["accepted"] and any("top1_agreement" in r for r in f4["reasons"])
    assert f4["metrics"]["top1_agreement"] < 0.9 <= choice.forms["weight_only"]["metrics"]["top1_agreement"]
    assert _nbits(tmp_path / "q") == {8: max(_nbits(tmp_path / "q").values())}  # the kept artifact is 8-bit only


def test_auto_for_size_keeps_the_smallest_form_that_passes_and_times_none(tiny_gqa, tiny_splits, tmp_path):
    """quantize.auto_objective size: with limits both forms meet, the 4-bit graph (the fewer bytes) is kept, by its
    bytes, and no form is timed."""
    from compress.quantize.choice import choose_quant_form

    qcfg = QuantizeConfig(method="auto", auto_forms=["weight_only", "weight_only_int4"], auto_objective="size",
                          auto_concurrency=4)
    acfg = AcceptConfig(min_top1_agreement=0.3, max_perplexity_ratio=3.0, relax_trials=0)
    choice = choose_quant_form(tiny_gqa, tmp_path / "q", tiny_splits.calib, tiny_splits.selection, qcfg, acfg)
    assert all(f["accepted"] for f in choice.forms.values())
    size = {n: f["graph_bytes"] for n, f in choice.forms.items()}
    assert choice.chosen == "weight_only_int4" and size["weight_only_int4"] < size["weight_only"]
    assert size["weight_only_int4"] == sum(p.stat().st_size for p in (tmp_path / "q").glob("model.onnx*"))
    assert not any(k.startswith(("decode_ms", "tokens_per_s")) for f in choice.forms.values() for k in f)


@pytest.mark.parametrize("family", FAMILIES)
def test_4bit_written_from_the_checkpoint_passes_its_golden_and_a_wrong_one_does_not(family, tmp_path):
    """export.weights int4: the gqa builder writes 4-bit MatMulNBits straight from the checkpoint (the plan's worst
    group, the lm_head and the embedding at 8 bits); golden derives its tolerances from the checkpoint rounded the same
    way (golden_int8.py) and passes; the same graph with its 4-bit codes drawn at random fails it."""
    import copy

    from compress.config import GoldenConfig
    from compress.evaluate.golden import compare_from_config, record_golden
    from compress.evaluate.golden_int8 import int8_thresholds
    from compress.export.gqa import build_gqa_artifact
    from compress.export.weights import Int4Plan, int4_plan
    from compress.loading.tiny import build_tiny

    model, tok = build_tiny(family, seed=0)
    plan = int4_plan(model, 32, False, 0.1)
    assert len(plan.int8_groups) == 1 and len(plan.errors) == 8  # 2 layers x qkv, o, gate_up, down
    assert max(plan.errors, key=plan.errors.get) in plan.int8_groups
    _, man = build_gqa_artifact(model, tok, tmp_path / "a", int8=(32, 4), int4=plan)
    q = man["quantization"]
    assert q["weight_bits"] == 4 and q["int8_groups"] == sorted(plan.int8_groups)
    bits = _nbits(tmp_path / "a")
    assert bits[4] >= 6 and bits[8] >= 1, bits
    gathers = [n for n in onnx.load(str(tmp_path / "a" / "model.onnx"), load_external_data=False).graph.node
               if n.op_type == "GatherBlockQuantized"]
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert [a.i for n in gathers for a in n.attribute if a.name == "bits"] == [8 if tied else 4]
    assert q["embedding_bits"] == plan.embedding_bits == (8 if tied else 4)
    golden = record_golden(model, tok, ["The cat sat on the mat", "a b c"], 8, 6)
    # what the golden task rebuilds from the manifest
    again = Int4Plan.from_quantization(q)
    assert again == plan
    thr, _ = int8_thresholds(copy.deepcopy(model), golden, 32, 4, GoldenConfig().int8_margin, int4=again)
    assert not compare_from_config(tmp_path / "a", golden, GoldenConfig(), thresholds=thr, decode_against="self").failures
    m = onnx.load(str(tmp_path / "a" / "model.onnx"))
    inits = {i.name: i for i in m.graph.initializer}
    rng = np.random.default_rng(0)
    for victim in [n for n in m.graph.node if n.op_type == "MatMulNBits" and n.name.endswith("_Q4")]:
        b = inits[victim.input[1]]  # the 4-bit codes replaced by others drawn at random: a wrong graph
        b.CopyFrom(numpy_helper.from_array(rng.integers(0, 256, numpy_helper.to_array(b).shape, np.uint8), b.name))
    onnx.save(m, str(tmp_path / "a" / "model.onnx"))
    write_manifest(tmp_path / "a", {k: v for k, v in man.items() if k not in ("files", "manifest_version")})
    assert compare_from_config(tmp_path / "a", golden, GoldenConfig(), thresholds=thr, decode_against="self").failures


def test_weight_clip_auto_searches_ranges_only_where_no_activations_guided_the_rounding():
    """quantize.weight_clip auto: the range search for round-to-nearest (the graph written from a checkpoint, or
    weight_algorithm rtn), none after AWQ; mse and none force either."""
    from compress.config import QuantizeConfig

    auto = QuantizeConfig(method="weight_only", weight_bits=4)
    assert auto.weight_clip == "auto" and auto.w4_clip(awq=False) and not auto.w4_clip(awq=True)
    assert QuantizeConfig(weight_clip="mse").w4_clip(awq=True)
    assert not QuantizeConfig(weight_clip="none").w4_clip(awq=False)


def test_an_untied_lm_head_at_4_bits_when_asked_and_golden_rounds_it_the_same_way(tmp_path):
    """quantize.int4_lm_head: the untied lm_head of the graph written from the checkpoint is a 4-bit MatMulNBits, the
    manifest says so, and golden's rounded reference (rebuilt from the manifest) passes it; a tied one stays 8-bit."""
    import copy

    from compress.config import GoldenConfig
    from compress.evaluate.golden import compare_from_config, record_golden
    from compress.evaluate.golden_int8 import int8_thresholds
    from compress.export.gqa import build_gqa_artifact
    from compress.export.weights import Int4Plan, int4_plan
    from compress.loading.tiny import build_tiny

    assert int4_plan(build_tiny("llama", seed=0)[0], 32, False, 0.1, lm_head_4bit=True).lm_head_bits == 8  # tied
    model, tok = build_tiny("phi3", seed=0)
    plan = int4_plan(model, 32, False, 0.1, lm_head_4bit=True)
    _, man = build_gqa_artifact(model, tok, tmp_path / "a", int8=(32, 4), int4=plan)
    head = [n for n in onnx.load(str(tmp_path / "a" / "model.onnx"), load_external_data=False).graph.node
            if n.name.startswith("/lm_head/")]
    assert [a.i for n in head for a in n.attribute if a.name == "bits"] == [4]
    again = Int4Plan.from_quantization(man["quantization"])
    assert again == plan and again.lm_head_bits == 4
    golden = record_golden(model, tok, ["The cat sat on the mat", "a b c"], 8, 6)
    thr, _ = int8_thresholds(copy.deepcopy(model), golden, 32, 4, GoldenConfig().int8_margin, int4=again)
    assert not compare_from_config(tmp_path / "a", golden, GoldenConfig(), thresholds=thr, decode_against="self").failures


def test_a_4bit_block_of_its_own_keeps_the_8bit_parts_at_theirs_and_golden_rounds_both(tmp_path):
    """quantize.int4_block_size: the 4-bit MatMulNBits (and the untied 4-bit table) use their own block, the 8-bit parts
    (the kept group, the lm_head) keep weight_block_size; the manifest records it, and golden's rounded reference,
    rebuilt from the manifest, rounds each part (and each input, at accuracy_level 4) in its own blocks and passes."""
    import copy

    from compress.config import GoldenConfig, QuantizeConfig
    from compress.evaluate.golden import compare_from_config, record_golden
    from compress.evaluate.golden_int8 import int8_thresholds
    from compress.export.gqa import build_gqa_artifact
    from compress.export.weights import Int4Plan, int4_plan
    from compress.loading.tiny import build_tiny

    assert QuantizeConfig(int4_block_size=64).w4_block() == 64 and QuantizeConfig().w4_block() == 32
    model, tok = build_tiny("phi3", seed=0)  # untied: a 4-bit table too
    plan = int4_plan(model, 16, False, 0.1, block4=32)
    assert plan.block == 32 and plan.block4(16) == 32
    _, man = build_gqa_artifact(model, tok, tmp_path / "a", int8=(16, 4), int4=plan)
    assert man["quantization"]["int4_block_size"] == 32 and man["quantization"]["block_size"] == 16
    g = onnx.load(str(tmp_path / "a" / "model.onnx"), load_external_data=False).graph
    blocks = {(next(a.i for a in n.attribute if a.name == "bits"), next(a.i for a in n.attribute if a.name == "block_size"))
              for n in g.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")}
    assert blocks == {(4, 32), (8, 16)}, blocks
    again = Int4Plan.from_quantization(man["quantization"])
    assert again == plan
    golden = record_golden(model, tok, ["The cat sat on the mat", "a b c"], 8, 6)
    thr, _ = int8_thresholds(copy.deepcopy(model), golden, 16, 4, GoldenConfig().int8_margin, int4=again)
    assert not compare_from_config(tmp_path / "a", golden, GoldenConfig(), thresholds=thr, decode_against="self").failures
    # rounded as if every part had the 8-bit parts' block, the reference is further from the graph than its tolerance
    wrong, _ = int8_thresholds(copy.deepcopy(model), golden, 16, 4, 1.0, int4=Int4Plan(**{**again.__dict__, "block": 0}))
    assert wrong["max_abs_error"] != thr["max_abs_error"]
