"""compress/quantize/kv_equalize.py: K's channels evened out for a per-tensor int8 cache, the float model unchanged."""

from __future__ import annotations

import numpy as np
import onnx

from compress.config import QuantizeConfig
from compress.quantize.kv_equalize import pair_factors


def test_pair_factors_are_powers_of_two_shared_by_rotary_pairs():
    a = np.array([[1.0, 8.0, 1.0, 0.5, 2.0, 0.0], [1.0, 1.0, 16.0, 1.0, 1.0, 1.0]])
    c = pair_factors(a, rotary_dim=4, interleaved=False)  # pairs (0, 2), (1, 3); channels 4, 5 alone
    assert np.all(np.log2(c) == np.round(np.log2(c)))
    assert np.array_equal(c[:, 0], c[:, 2]) and np.array_equal(c[:, 1], c[:, 3])
    assert c[0, 1] == 8 and c[1, 2] == 16 and c[0, 5] > 0  # a dead channel gets a finite factor
    pair = np.maximum(a, a[:, [2, 3, 0, 1, 4, 5]])
    even = pair / c
    assert np.all(even[a > 0] <= np.median(pair) * np.sqrt(2) + 1e-9)
    ci = pair_factors(a, rotary_dim=4, interleaved=True)  # pairs (0, 1), (2, 3)
    assert np.array_equal(ci[:, 0], ci[:, 1]) and np.array_equal(ci[:, 2], ci[:, 3])
    assert np.all(pair_factors(np.ones((2, 4)), 4, False) == 1)


def test_equalized_graph_computes_the_same_logits_and_the_predicted_ranges(tiny_gqa, tiny_splits, tmp_path):
    """Powers of two fold into the packed Q|K|V weight's columns exactly: prefill logits bit for bit, and the K
    ranges the equalized graph writes are the calibrated ones divided by the factors."""
    from key_spread import equalized_copy

    from compress.drivers import load_lm
    from compress.quantize.kv_int8 import kv_absmax

    out = tmp_path / "eq"
    n, absmax, spread, predicted = equalized_copy(tiny_gqa, tiny_splits.calib[:4], out)
    assert n == sum(k.endswith(".key") for k in absmax)
    ids = [int(t) for t in tiny_splits.selection[0][:48]]
    ref = load_lm(tiny_gqa, verify=False).prefill(ids)[0]
    got = load_lm(out, verify=False).prefill(ids)[0]
    assert np.array_equal(ref, got)
    written = kv_absmax(out, tiny_splits.calib[:4])
    for k, v in written.items():
        expect = predicted[k] * absmax[k] / spread[k]  # the spread was only in the ranges, not in the graph
        np.testing.assert_allclose(v, expect, rtol=1e-5, atol=1e-7)
    assert any(not np.allclose(written[k], absmax[k]) for k in written if k.endswith(".key"))


def test_per_tensor_int8_cache_is_equalized_in_the_quantize_stage(tiny_gqa, tiny_splits, tmp_path):
    """W8A8 per token with kv_cache_scales tensor: the factors land in the packed product's b_scale (query columns
    times c, key columns divided by it, value columns untouched), the report counts the layers; per channel leaves
    the scales alone."""
    from onnx import numpy_helper

    from compress.quantize.quantizer import quantize_artifact

    cfg = QuantizeConfig(enabled=True, method="dynamic", activation_granularity="token", smoothquant_alpha=None,
                         quantize_embedding=False, kv_cache="int8", kv_cache_scales="tensor")
    rep = quantize_artifact(tiny_gqa, tmp_path / "t", tiny_splits.calib, cfg)
    ch = quantize_artifact(tiny_gqa, tmp_path / "c", tiny_splits.calib,
                           cfg.model_copy(update={"kv_cache_scales": "channel"}))
    assert ch.settings["kv_cache_equalized_layers"] == 0

    def qkv_scales(folder):
        m = onnx.load(str(folder / "model.onnx"))
        return [numpy_helper.to_array(i) for i in m.graph.initializer if "qkv" in i.name and i.name.endswith("_scale")]

    t, c = qkv_scales(tmp_path / "t"), qkv_scales(tmp_path / "c")
    ratios = [a / b for a, b in zip(t, c)]
    changed = [r for r in ratios if not np.all(r == 1)]
    assert len(t) == rep.settings["kv_cache_layers"] and len(changed) == rep.settings["kv_cache_equalized_layers"] >= 1
    from compress.artifact import read_manifest

    man = read_manifest(tmp_path / "t")
    nh, nkv, hd = man["num_heads"], man["num_kv_heads"], man["head_dim"]
    for r in changed:
        q, k, v = r[:nh * hd].reshape(nkv, -1, hd), r[nh * hd:(nh + nkv) * hd].reshape(nkv, hd), r[(nh + nkv) * hd:]
        assert np.all(np.log2(k) == np.round(np.log2(k))) and np.all(v == 1)
        assert np.allclose(q, 1 / k[:, None, :])
