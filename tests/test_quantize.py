"""INT8 quantization of the tiny artifact: static (3 calibrations), dynamic, weight-only, SmoothQuant, sensitivity."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from compress.artifact import read_manifest
from compress.quantize.calibration import find_linears
from compress.config import QuantizeConfig
from compress.evaluate.onnx_eval import prefill_logits
from compress.drivers import lm_for_model, load_lm
from compress.sizing.cpu import has_vnni
from compress.quantize.quantizer import QuantizeError, Quantizer, quantize_artifact, resolve_reduce_range
from compress.quantize.smoothquant import apply_smoothquant


def _ops(folder: Path) -> dict[str, int]:
    m = onnx.load(str(folder / "model.onnx"))
    out: dict[str, int] = {}
    for n in m.graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


def _agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).mean())


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).mean() / np.abs(b).mean())


@pytest.fixture(scope="module")
def fp32_logits(tiny_artifact, tiny_splits):
    return prefill_logits(tiny_artifact, tiny_splits.selection)


@pytest.fixture(scope="module")
def static_artifacts(tiny_artifact, tiny_splits, tmp_path_factory):
    out = {}
    root = tmp_path_factory.mktemp("quant_static")
    for calib in ("minmax", "entropy", "percentile"):
        cfg = QuantizeConfig(method="static", calibration=calib, keep_float=["down_proj"], keep_float_as="float", quantize_embedding=False,
                             smoothquant_alpha=0.5)
        rep = quantize_artifact(tiny_artifact, root / calib, tiny_splits.calib, cfg)
        out[calib] = (root / calib, rep)
    return out


@pytest.mark.parametrize("calib", ["minmax", "entropy", "percentile"])
def test_static_artifact_is_valid_int8_and_close_to_fp32(static_artifacts, fp32_logits, tiny_splits, tiny_artifact, calib):
    folder, rep = static_artifacts[calib]
    man = read_manifest(folder, verify=True)  # every file hashed and intact
    assert man["quantization"]["method"] == "static" and man["quantization"]["calibration"] == calib
    assert man["num_layers"] == read_manifest(tiny_artifact)["num_layers"]
    assert (folder / "tokenizer.json").is_file() and (folder / "generation_config.json").is_file()
    ops = _ops(folder)
    assert ops.get("QuantizeLinear", 0) >= 4 and ops.get("DequantizeLinear", 0) >= 10
    # int8 weights with one scale per output channel
    m = onnx.load(str(folder / "model.onnx"))
    inits = {i.name: i for i in m.graph.initializer}
    w_dq = [n for n in m.graph.node if n.op_type == "DequantizeLinear" and inits.get(n.input[0]) is not None
            and inits[n.input[0]].data_type == onnx.TensorProto.INT8]
    assert len(w_dq) == rep.quantized_linears == 12  # 2 layers x (q,k,v,o,gate,up); down_proj kept float
    for n in w_dq:
        q, s = inits[n.input[0]], numpy_helper.to_array(inits[n.input[1]])
        assert s.shape == (q.dims[1],) and (s > 0).all()
    assert rep.bytes_after < rep.bytes_before
    logits = prefill_logits(folder, tiny_splits.selection)
    assert np.isfinite(logits).all()
    assert _rel_err(logits, fp32_logits) < 0.05
    assert _agreement(logits, fp32_logits) > 0.9


def test_excluded_nodes_stay_float(static_artifacts, tiny_artifact):
    folder, rep = static_artifacts["minmax"]
    m = onnx.load(str(folder / "model.onnx"))
    producer = {o: n for n in m.graph.node for o in n.output}
    inits = {i.name for i in m.graph.initializer}
    matmuls = [n for n in m.graph.node if n.op_type == "MatMul"]
    quantized = [n for n in matmuls if any(producer.get(i) is not None and producer[i].op_type == "DequantizeLinear" for i in n.input)]
    float_mm = [n for n in matmuls if n not in quantized]
    # 2 layers x 2 attention MatMuls (activation x activation), lm_head, 2 down_proj stay float
    assert len(float_mm) == 4 + 1 + 2
    assert any("logits" in n.output for n in float_mm)
    down = [n for n in float_mm if n.input[1] in inits]
    assert len(down) == 2 and all("down_proj" in f for f in rep.float_linears)
    src_linears = find_linears(onnx.load(str(tiny_artifact / "model.onnx")))
    assert sorted(rep.float_linears) == sorted(l.module for l in src_linears if l.role == "down_proj")


def test_kept_groups_fall_back_to_weight_only_int8(tiny_artifact, tiny_splits, fp32_logits, tmp_path):
    cfg = QuantizeConfig(method="static", keep_float=["down_proj"], keep_float_as="weight_only", quantize_embedding=False,
                         smoothquant_alpha=0.5)
    rep = quantize_artifact(tiny_artifact, tmp_path / "fb", tiny_splits.calib, cfg)
    m = onnx.load(str(tmp_path / "fb" / "model.onnx"))
    nbits = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 and all("down_proj" in n.name for n in nbits)
    assert rep.quantized_linears == 12 and len(rep.float_linears) == 2
    float_inits = [i for i in m.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) == 2 and min(i.dims) >= 64]
    assert [i.name for i in float_inits] == ["model.lm_head.weight"]  # only the (unquantized) embedding table
    logits = prefill_logits(tmp_path / "fb", tiny_splits.selection)
    assert _rel_err(logits, fp32_logits) < 0.05 and _agreement(logits, fp32_logits) > 0.9


def test_calibration_reads_only_calib_blocks(static_artifacts, tiny_splits, tiny_artifact, tmp_path):
    _, rep = static_artifacts["minmax"]
    assert rep.calib_blocks == len(tiny_splits.calib)
    assert rep.calib_sha256 == hashlib.sha256(np.ascontiguousarray(tiny_splits.calib).tobytes()).hexdigest()
    assert rep.calib_sha256 != hashlib.sha256(np.ascontiguousarray(tiny_splits.selection).tobytes()).hexdigest()
    # the activation scales follow the data they were calibrated on
    cfg = QuantizeConfig(method="static", keep_float=[], quantize_embedding=False, smoothquant_alpha=None)
    a = Quantizer(tiny_artifact, tiny_splits.calib, cfg)
    b = Quantizer(tiny_artifact, tiny_splits.train[:8], cfg)
    a.prepare(), b.prepare()
    assert a.ranges.keys() == b.ranges.keys() and a.ranges != b.ranges
    # calib_samples bounds what is read
    c = Quantizer(tiny_artifact, tiny_splits.calib, cfg.model_copy(update={"calib_samples": 3}))
    c.prepare()
    assert c.calib_fed == 3


def test_calibration_cache_reuses_first_pass(tiny_artifact, tiny_splits, tmp_path):
    cfg = QuantizeConfig(method="static", keep_float=[], quantize_embedding=False)
    cache = tmp_path / "calib.npz"
    a = Quantizer(tiny_artifact, tiny_splits.calib, cfg, calibration_cache=cache)
    a.prepare()
    assert cache.is_file()
    b = Quantizer(tiny_artifact, tiny_splits.calib, cfg, calibration_cache=cache)
    b.prepare()
    assert b.ranges == a.ranges and b.calib_sha256 == a.calib_sha256 and b.calib_fed == a.calib_fed
    # other calibration data does not hit the cache
    c = Quantizer(tiny_artifact, tiny_splits.train[:8], cfg, calibration_cache=cache)
    c.prepare()
    assert c.ranges != a.ranges


def test_weight_only_uses_matmulnbits_and_shrinks(tiny_artifact, tiny_splits, fp32_logits, tmp_path):
    cfg = QuantizeConfig(method="weight_only", keep_float=[], smoothquant_alpha=None, quantize_embedding=False)
    rep = quantize_artifact(tiny_artifact, tmp_path / "wo", None, cfg)
    m = onnx.load(str(tmp_path / "wo" / "model.onnx"))
    nbits = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
    assert rep.quantized_linears == 14
    assert len(nbits) == 8  # per layer: q/k/v and gate/up packed after quantization (compress/export/graph_fusion.py)
    attrs = {a.name: a.i for a in nbits[0].attribute}
    assert attrs["bits"] == 8 and attrs["accuracy_level"] == 4 and attrs["block_size"] == 32
    assert rep.bytes_after < 0.75 * rep.bytes_before
    logits = prefill_logits(tmp_path / "wo", tiny_splits.selection)
    assert _rel_err(logits, fp32_logits) < 0.03 and _agreement(logits, fp32_logits) > 0.93
    read_manifest(tmp_path / "wo", verify=True)


def test_dynamic_int8(tiny_artifact, tiny_splits, fp32_logits, tmp_path):
    cfg = QuantizeConfig(method="dynamic", keep_float=[], quantize_embedding=False, smoothquant_alpha=0.5)
    rep = quantize_artifact(tiny_artifact, tmp_path / "dyn", tiny_splits.calib, cfg)
    ops = _ops(tmp_path / "dyn")
    assert ops.get("DynamicQuantizeLinear", 0) >= 1 and ops.get("MatMulInteger", 0) == 14
    logits = prefill_logits(tmp_path / "dyn", tiny_splits.selection)
    assert _rel_err(logits, fp32_logits) < 0.05 and _agreement(logits, fp32_logits) > 0.9
    assert rep.smoothed_tensors == 6  # 2 layers x (attention norm, mlp norm, down_proj input)


def test_dynamic_per_token_int8(tiny_artifact, tiny_splits, fp32_logits, tmp_path):
    cfg = QuantizeConfig(method="dynamic", activation_granularity="token", keep_float=[], quantize_embedding=False, smoothquant_alpha=None)
    rep = quantize_artifact(tiny_artifact, tmp_path / "tok", None, cfg)
    ops = _ops(tmp_path / "tok")
    # 2 layers x (q, k, v, o, gate, up, down): one integer product per linear, one quantized input per group
    # of linears sharing an input (q/k/v, o, gate/up, down), and no Split after the products
    assert ops.get("MatMulIntegerToFloat", 0) == 14 and ops.get("DynamicQuantizeLinear", 0) == 0
    assert ops.get("Split", 0) == _ops(tiny_artifact).get("Split", 0)
    assert ops.get("QuantizeLinear", 0) == ops.get("Abs", 0) == 8 and "Round" not in ops and "MatMulInteger" not in ops
    assert rep.calib_blocks == 0 and rep.settings["activations"].startswith("symmetric per-token")
    logits = prefill_logits(tmp_path / "tok", tiny_splits.selection)
    # one range per token: closer to fp32 than one range per batch
    tensor = quantize_artifact(tiny_artifact, tmp_path / "ten", None, cfg.model_copy(update={"activation_granularity": "tensor"}))
    per_tensor = prefill_logits(tmp_path / "ten", tiny_splits.selection)
    assert _rel_err(logits, fp32_logits) < 0.03 and _agreement(logits, fp32_logits) > 0.95
    assert _rel_err(logits, fp32_logits) < _rel_err(per_tensor, fp32_logits)
    # batch-1 decode on the rewritten graph (ranks 3 -> 2 -> 3 reshapes) matches prefill
    toks = load_lm(tmp_path / "tok", verify=False).greedy(tiny_splits.selection[0][:8].tolist(), 4)
    assert len(toks) == 4 and toks[0] == int(logits[0, 7].argmax())


def test_per_token_w8a8_is_lean_and_its_lm_head_is_int8_too(tiny_artifact, tiny_splits, fp32_logits, tmp_path):
    """The per-token form keeps the activation's rank (no Shape/Reshape/Slice/Concat per linear) and its tied
    lm_head runs the integer product too (MatMulNBits at many rows is the slow kernel), from an int8 copy of its own."""
    cfg = QuantizeConfig(method="dynamic", activation_granularity="token", keep_float=[], quantize_embedding=True,
                         smoothquant_alpha=None)
    quantize_artifact(tiny_artifact, tmp_path / "tok", None, cfg)
    ops = _ops(tmp_path / "tok")
    base = _ops(tiny_artifact)
    assert ops.get("MatMulIntegerToFloat", 0) == 15 and "MatMulNBits" not in ops and ops.get("GatherBlockQuantized") == 1
    for op in ("Shape", "Slice", "Concat"):
        assert ops.get(op, 0) == base.get(op, 0), op  # none added around the linears
    assert ops.get("Reshape", 0) == base.get("Reshape", 0) + 1  # the quantized embedding's own
    names = [i.name for i in onnx.load(str(tmp_path / "tok" / "model.onnx")).graph.initializer]
    assert len(names) == len(set(names))  # the lm_head's rewrite reuses the shared constants, never repeats them
    logits = prefill_logits(tmp_path / "tok", tiny_splits.selection)
    assert _rel_err(logits, fp32_logits) < 0.05 and _agreement(logits, fp32_logits) > 0.9
    toks = load_lm(tmp_path / "tok", verify=False).greedy(tiny_splits.selection[0][:8].tolist(), 4)
    assert toks[0] == int(logits[0, 7].argmax())


def test_tied_embedding_is_stored_once_in_8_bit(tiny_artifact, tiny_splits, fp32_logits, tmp_path):
    cfg = QuantizeConfig(method="static", keep_float=[], quantize_embedding=True, smoothquant_alpha=0.5)
    rep = quantize_artifact(tiny_artifact, tmp_path / "emb", tiny_splits.calib, cfg)
    m = onnx.load(str(tmp_path / "emb" / "model.onnx"))
    ops = [n.op_type for n in m.graph.node]
    assert "GatherBlockQuantized" in ops and "MatMulNBits" in ops and "Gather" not in ops
    big_float = [i for i in m.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and np.prod(i.dims) >= 512 * 64]
    assert not big_float  # the fp32 table is gone
    gbq = next(n for n in m.graph.node if n.op_type == "GatherBlockQuantized")
    nbits = next(n for n in m.graph.node if n.op_type == "MatMulNBits")
    assert gbq.input[0] == nbits.input[1]  # one shared uint8 table
    logits = prefill_logits(tmp_path / "emb", tiny_splits.selection)
    # every linear and the embedding quantized: a little looser than the down_proj-in-float variants
    assert _rel_err(logits, fp32_logits) < 0.08 and _agreement(logits, fp32_logits) > 0.9
    no_emb = quantize_artifact(tiny_artifact, tmp_path / "no_emb", tiny_splits.calib, cfg.model_copy(update={"quantize_embedding": False}))
    table = 512 * 64
    # fp32 table (4 B/weight) -> uint8 (1 B) + two fp32 scale copies and uint8 zero points per block of 32
    assert no_emb.bytes_after - rep.bytes_after > 4 * table - table - 9 * table // 32 - 1024


def test_a_block_wider_than_the_table_rounds_the_table_in_the_widest_block_that_fits(tiny_artifact, tiny_splits,
                                                                                       fp32_logits, tmp_path):
    """weight_block_size 128 on a 64-wide table (SmolLM2: 576 = 4.5 x 128): the table still goes to 8 bits, in
    blocks of 64, and the linears keep 128 (MatMulNBits pads K)."""
    from compress.formats.blocks import table_block

    assert (table_block(576, 128), table_block(1536, 128), table_block(640, 256), table_block(24, 128)) == (64, 128, 128, 0)
    cfg = QuantizeConfig(method="weight_only", weight_block_size=128)
    quantize_artifact(tiny_artifact, tmp_path / "b128", tiny_splits.calib, cfg)
    m = onnx.load(str(tmp_path / "b128" / "model.onnx"))
    attr = {n.name: {a.name: a.i for a in n.attribute} for n in m.graph.node if n.op_type in ("GatherBlockQuantized", "MatMulNBits")}
    gbq = next(n for n in m.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and n.input[1] == gbq.input[0])
    assert attr[gbq.name]["block_size"] == attr[head.name]["block_size"] == 64
    assert {a["block_size"] for k, a in attr.items() if k not in (gbq.name, head.name)} == {128}
    assert not [i for i in m.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and np.prod(i.dims) >= 512 * 64]
    logits = prefill_logits(tmp_path / "b128", tiny_splits.selection)
    assert _rel_err(logits, fp32_logits) < 0.05 and _agreement(logits, fp32_logits) > 0.9


def test_smoothquant_is_exact_in_float_and_flattens_outliers(tiny_artifact, tiny_splits, fp32_logits):
    cfg = QuantizeConfig(method="static", smoothquant_alpha=0.5)
    q = Quantizer(tiny_artifact, tiny_splits.calib, cfg)
    q.prepare()
    assert q.smoothed == 6 and q.inv_scales
    smoothed = np.concatenate(list(lm_for_model(q.model, q.manifest).prefill_batches(tiny_splits.selection, 2)))
    np.testing.assert_allclose(smoothed, fp32_logits, rtol=1e-4, atol=1e-3)
    outliers = 0
    for t, inv in q.inv_scales.items():
        st = q.stats[t]
        ratio_before = st.absmax.max() / np.median(st.absmax)
        after = st.absmax * inv
        ratio_after = after.max() / np.median(after)
        # alpha 0.5 leaves sqrt(act range * weight range) per channel: an input with outlier channels is
        # flattened; an already flat one (max/median ~1.3) may take on a little of its weights' spread.
        if ratio_before > 2:
            outliers += 1
            assert ratio_after < 0.8 * ratio_before, t
        else:
            assert ratio_after <= 1.05 * ratio_before, t
    assert outliers >= 1
    with pytest.raises(ValueError, match="smoothquant_alpha"):
        apply_smoothquant(onnx.load(str(tiny_artifact / "model.onnx")), q.linears, q.stats, 1.5)


def test_tied_lm_head_of_the_per_token_form_is_smoothed_exactly(tiny_artifact, tiny_splits, fp32_logits, tmp_path):
    """The per-token form's tied lm_head gets SmoothQuant too: the final norm's gamma / s and the lm_head's own int8
    copy made from E^T * s. In float the two halves cancel; the artifact carries both."""
    import copy

    from compress.quantize.smoothquant import fold_tied_lm_head, heldout_w8a8_error
    from serve.runners.onnx_external import tensor_array

    cfg = QuantizeConfig(method="dynamic", activation_granularity="token", keep_float=[], quantize_embedding=True,
                         smoothquant_alpha=0.5)
    q = Quantizer(tiny_artifact, tiny_splits.calib, cfg)
    q.prepare()
    head, s = q.lm_head_smooth
    assert s.shape == (64,) and float(s.max() / s.min()) > 1.5  # the scales do something
    assert [r.linears for r in q.smooth_report].count(["lm_head"]) == 1 and q.smoothed == 7
    # float: gamma / s with E^T * s in the lm_head gives the model's own logits
    m = copy.deepcopy(q.model)
    inits = {i.name: i for i in m.graph.initializer}
    E = tensor_array(inits[head.embedding]).astype(np.float32)
    fold_tied_lm_head(m, head, s)
    lm = next(n for n in m.graph.node if n.op_type == "MatMul" and n.input[0] == head.tensor)
    m.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(E.T * s[:, None]), "lm_head_T_s"))
    lm.input[1] = "lm_head_T_s"
    folded = np.concatenate(list(lm_for_model(m, q.manifest).prefill_batches(tiny_splits.selection, 2)))
    np.testing.assert_allclose(folded, fp32_logits, rtol=1e-4, atol=1e-3)
    # the artifact: gamma / s before the lm_head, and the int8 copy is E^T * s
    rep = q.write(tmp_path / "tok")
    assert rep.settings["lm_head_smoothquant_alpha"] == 0.5
    out = onnx.load(str(tmp_path / "tok" / "model.onnx"))
    oi = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    norm = next(n for n in out.graph.node if n.name == head.norm)
    gamma = tensor_array(inits[head.gamma])
    np.testing.assert_allclose(next(oi[i] for i in norm.input if i in oi), gamma / s, rtol=1e-6)
    mm = [n for n in out.graph.node if n.op_type == "MatMulIntegerToFloat"][-1]
    w = oi[mm.input[1]].astype(np.float32) * oi[mm.input[3]].reshape(1, -1)
    ref = E.T * s[:, None]
    assert np.abs(w - ref).max() <= 0.51 * np.abs(ref).max(0).max() / 127
    logits = prefill_logits(tmp_path / "tok", tiny_splits.selection)
    assert _rel_err(logits, fp32_logits) < 0.05 and _agreement(logits, fp32_logits) > 0.9
    # "auto" keeps it only where it lowers the held-out per-token error
    qa = Quantizer(tiny_artifact, tiny_splits.calib, cfg.model_copy(update={"smoothquant_alpha": "auto"}))
    qa.prepare()
    r = next((r for r in qa.smooth_report if r.linears == ["lm_head"]), None)
    if r is not None:
        x = qa.stats[head.tensor].sample
        assert r.w8a8_error < heldout_w8a8_error(x, [E.T.copy()], None, per_token=True)


def test_sensitivity_scan_keeps_most_sensitive_groups_float(tiny_artifact, tiny_splits, tmp_path):
    cfg = QuantizeConfig(method="static", keep_float=[], quantize_embedding=False, sensitivity_trials=4, sensitivity_keep=2)
    events = []
    q = Quantizer(tiny_artifact, tiny_splits.calib, cfg, on_event=lambda n, d: events.append(n))
    rep = q.write(tmp_path / "sens")
    assert len(rep.sensitivity) == 4 and events.count("sensitivity") == 4
    scores = [s for _, s in rep.sensitivity]
    assert scores == sorted(scores, reverse=True) and scores[0] > 0
    kept = {g for g, _ in rep.sensitivity[:2]}
    assert {l.group for l in q.linears if l.module in rep.float_linears} == kept
    assert rep.quantized_linears == 14 - len(rep.float_linears)
    assert read_manifest(tmp_path / "sens")["quantization"]["float_groups"] == [g for g, _ in rep.sensitivity[:2]]
    from compress.quantize.sensitivity import sensitivity_figure

    fig = sensitivity_figure(rep.sensitivity, kept=2)
    fig.savefig(tmp_path / "sens.png")
    assert (tmp_path / "sens.png").stat().st_size > 1000


def test_vnni_detection_and_reduce_range():
    assert has_vnni("flags\t: fpu sse avx2 avx512f avx512_vnni\n")
    assert has_vnni("flags\t: fpu avx2 avx_vnni\n")
    assert has_vnni("Features\t: fp asimd asimddp\n")
    assert not has_vnni("flags\t: fpu sse avx2 fma\n")
    assert resolve_reduce_range(QuantizeConfig(reduce_range=True)) is True
    assert resolve_reduce_range(QuantizeConfig(reduce_range=None)) is (not has_vnni())


def test_clear_errors(tiny_artifact, tmp_path):
    with pytest.raises(QuantizeError, match="smoothquant_alpha"):
        quantize_artifact(tiny_artifact, tmp_path / "x", None, QuantizeConfig(method="static"))
    with pytest.raises(Exception, match="manifest"):
        quantize_artifact(tmp_path, tmp_path / "y", None, QuantizeConfig(method="weight_only", smoothquant_alpha=None))


def test_smoothquant_auto_alpha_beats_no_smoothing_on_heldout_rows(tiny_artifact, tiny_splits):
    from compress.quantize.smoothquant import ALPHA_GRID, heldout_w8a8_error

    q = Quantizer(tiny_artifact, tiny_splits.calib, QuantizeConfig(method="static", smoothquant_alpha="auto", smoothquant_samples=128))
    q.prepare()
    assert q.smooth_report, "auto smoothing chose nothing on the tiny model"
    inits = {i.name: i for i in q.model.graph.initializer}
    src = {i.name: i for i in onnx.load(str(tiny_artifact / "model.onnx")).graph.initializer}
    for r in q.smooth_report:
        assert r.alpha in ALPHA_GRID and r.w8a8_error is not None
        st = q.stats[r.tensor]
        assert st.sample is not None and 100 <= len(st.sample) <= 160
        group = [l for l in q.linears if l.input == r.tensor]
        # the original (unsmoothed) weights, by their exporter names
        ws = [numpy_helper.to_array(src[l.weight.split("_smooth")[0]]) for l in group]
        assert r.w8a8_error <= heldout_w8a8_error(st.sample, ws, None) + 1e-12
        assert all(l.weight in inits for l in group)


def test_entropy_and_percentile_clip_outliers_but_keep_the_bulk():
    from compress.quantize.calibration import HIST_BINS, ActStats, entropy_range, percentile_range

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 1, 200_000), [60.0, -45.0]]).astype(np.float32)
    st = ActStats(np.array([x.min()]), np.array([x.max()]))
    st.lo, st.hi = float(x.min()), float(x.max())
    st.hist = np.histogram(x, bins=HIST_BINS, range=(st.lo, st.hi))[0]
    lo_p, hi_p = percentile_range(st, 99.99)
    lo_e, hi_e = entropy_range(st)
    for lo, hi in [(lo_p, hi_p), (lo_e, hi_e)]:
        assert st.lo < lo < -3.0 and 3.0 < hi < st.hi / 2  # outliers clipped, 3 sigma kept
        assert ((x >= lo) & (x <= hi)).mean() > 0.999
