"""Golden for the INT8 graph written from the checkpoint (compress/evaluate/golden_int8.py): tolerances derived from
the weights' own rounding pass a correct graph and fail a graph with one broken layer, on every tiny family (fp32
checkpoints) and on the Qwen2.5-7B shape scaled down, stored in bf16 as the real one is."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from compress.evaluate import compare_from_config, record_golden
from compress.evaluate.golden_int8 import _round_blocks, fake_quantize_, int8_thresholds
from compress.config import GoldenConfig
from compress.export.gqa import build_gqa_artifact
from compress.sizing.shapes import SHAPES, build_shape, scaled_shape
from compress.loading.tiny import FAMILIES, build_tiny

INT8 = (32, 4)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "In a hole in the ground there lived"]


def _check(model, tok, golden_model, folder):
    """The golden report of the INT8 graph of ``model`` against ``golden_model``'s golden outputs."""
    cfg = GoldenConfig(prompts=PROMPTS, new_tokens=8)
    golden = record_golden(golden_model, tok, cfg.prompts, cfg.top_k, cfg.new_tokens)
    thresholds, expected = int8_thresholds(copy.deepcopy(golden_model), golden, *INT8, cfg.int8_margin)
    build_gqa_artifact(model, tok, folder, int8=INT8)
    return compare_from_config(folder, golden, cfg, thresholds=thresholds, decode_against="self"), expected


def _break_mlp(model, layer: int) -> None:
    """Swap one layer's gate and up projections: a packing mistake of the kind a graph builder makes."""
    mlp = model.get_decoder().layers[layer].mlp
    if hasattr(mlp, "gate_proj"):
        g, u = mlp.gate_proj.weight.data.clone(), mlp.up_proj.weight.data.clone()
        mlp.gate_proj.weight.data.copy_(u)
        mlp.up_proj.weight.data.copy_(g)
    else:  # packed gate_up (phi3) or a plain MLP (gpt_neox): the output projection dropped instead
        out = getattr(mlp, "down_proj", None) or getattr(mlp, "dense_4h_to_h")
        out.weight.data.zero_()


@pytest.mark.parametrize("family", FAMILIES)
def test_golden_passes_the_int8_graph_and_fails_a_broken_layer(family, tmp_path):
    model, tok = build_tiny(family, 0)
    report, expected = _check(model, tok, model, tmp_path / "ok")
    assert report.passed, report.failures
    assert report.metrics()["golden_prefix_match"] == 1.0  # decode = the graph's own prefill argmax
    # the graph is the rounded checkpoint: its distance to the reference is the rounding's, to within fp32 noise
    assert report.metrics()["golden_max_abs_error"] <= 1.5 * max(expected["golden_int8_expected_max_abs_error"], 1e-3)
    broken = copy.deepcopy(model)
    _break_mlp(broken, 1)
    bad, _ = _check(broken, tok, model, tmp_path / "broken")
    assert not bad.passed
    assert any("max abs logit error" in f for f in bad.failures), bad.failures


def _as_at_full_width(model, name: str) -> None:
    """Scale the linear weights (std 0.02 at every width) by sqrt(full width / scaled width): a layer's output is
    std x sqrt(fan-in) per unit input, so at width 64 each layer adds almost nothing to the residual and any
    layer, broken or not, barely moves the logits; at 3,584 (and in trained models) each layer counts."""
    f = math.sqrt(SHAPES[name]["hidden_size"] / model.config.hidden_size)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings():
                m.weight.mul_(f)


def test_the_7b_shape_in_bf16_passes_and_a_broken_layer_fails(tmp_path):
    model, tok = build_shape("qwen2.5-7b", 0, config=scaled_shape("qwen2.5-7b", num_hidden_layers=4))
    assert next(model.parameters()).dtype == torch.bfloat16
    _as_at_full_width(model, "qwen2.5-7b")
    report, expected = _check(model, tok, model, tmp_path / "ok")
    assert report.passed, report.failures
    broken = copy.deepcopy(model)
    _break_mlp(broken, 2)
    bad, _ = _check(broken, tok, model, tmp_path / "broken")
    assert not bad.passed
    # the graph computes in fp32 what the rounded bf16 checkpoint computes in bf16: within the margin of it
    assert report.metrics()["golden_max_abs_error"] <= 1.5 * expected["golden_int8_expected_max_abs_error"]
    # a broken middle layer is off by several times the whole tolerance (measured 4.8x: 0.34 against 0.070)
    assert bad.metrics()["golden_max_abs_error"] > 3 * bad.thresholds["max_abs_error"]


def test_the_rounding_is_onnx_runtimes_block_quantizer():
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                 DefaultWeightOnlyQuantizer)

    wt = np.random.default_rng(0).standard_normal((96, 40)).astype(np.float32)  # [K, N], K not a block multiple
    q = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(block_size=64, is_symmetric=True, bits=8))
    packed, scales, _ = q.qbits_block_quant(wt)
    n, blocks = scales.shape
    ort = ((packed.reshape(n, blocks, 64).astype(np.float32) - 128) * scales[..., None]).reshape(n, -1)[:, :96]
    assert np.array_equal(ort, _round_blocks(torch.tensor(wt.T), 64).numpy())


def test_fake_quantize_rounds_the_tied_table_once_and_hooks_the_inputs():
    model, _ = build_tiny("llama", 0)
    emb = model.get_input_embeddings().weight
    before = emb.detach().clone()
    hooks = fake_quantize_(model, 32, 4)
    assert len(hooks) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert torch.equal(emb, _round_blocks(before, 32, signed_max=False))  # not rounded a second time as the head
    for h in hooks:
        h.remove()


def test_each_failed_golden_threshold_is_a_line_naming_the_prompt_and_the_position():
    from compress.evaluate.golden import PromptResult, _prompt_failures

    r = PromptResult("hello", max_abs_error=0.5, off_count=3, positions=12, top1_agreement=0.75, greedy_prefix=2,
                     greedy_len=8, first_bad_position=5)
    t = dict(max_abs_error=1e-2, off_threshold=1e-2, max_off_count=0, min_top1_agreement=1.0, min_prefix_match=1.0)
    lines = _prompt_failures("prompt 0 'hello'", r, t, worst=7, prompt_len=4,
                             against=lambda: "the graph's own prefill argmax (its token 0.3 below it, more than 0.1)")
    assert lines == [
        "prompt 0 'hello': max abs logit error 0.5 > 0.01, first diverging position 5 (worst 7) of 12",
        "prompt 0 'hello': 3 top-k logits off by > 0.01 (allowed 0)",
        "prompt 0 'hello': top-1 agreement 0.750 < 1.0, first diverging position 5",
        "prompt 0 'hello': greedy continuation diverges from the graph's own prefill argmax (its token 0.3 below it, "
        "more than 0.1) at generated token 2 (position 6); matched 2/8"]
    ok = PromptResult("hello", 0.0, 0, 12, 1.0, 8, 8, None)
    assert _prompt_failures("p", ok, t, worst=0, prompt_len=4, against=lambda: 1 / 0) == []  # not asked for
