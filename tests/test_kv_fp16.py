"""export.kv_dtype float16: the gqa graph keeps its K/V in fp16 (compress/export/kv_fp16.py). Logits against torch,
greedy against HF generate, golden, the engine against the fp32-KV artifact, the budget's tokens, INT8 on top."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto

from compress.config import ExportConfig, QuantizeConfig, ServeConfig
from compress.export.gqa import build_gqa_artifact
from compress.drivers.gqa import GqaLM
from compress.export.kv_fp16 import KvDtypeError, kv_to_fp16
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.runners.onnx_session import CPU


@pytest.fixture(scope="module")
def kv_artifacts(tiny, tmp_path_factory):
    model, tok = tiny
    root = tmp_path_factory.mktemp("kv_fp16")
    for dt in ("float32", "float16"):
        _, manifest = build_gqa_artifact(model, tok, root / dt, kv_dtype=dt)
        assert manifest["kv_dtype"] == dt
    return root / "float32", root / "float16"


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=int(rng.integers(4, 60))).tolist() for _ in range(n)]


def test_graph_declares_fp16_caches_and_keeps_fp32_elsewhere(kv_artifacts):
    m = onnx.load(str(kv_artifacts[1] / "model.onnx"))
    types = {v.name: v.type.tensor_type.elem_type for v in list(m.graph.input) + list(m.graph.output)}
    kv = [n for n in types if n.startswith(("past_key_values.", "present."))]
    assert len(kv) == 2 * 2 * 2  # 2 layers x key/value x past/present
    assert {types[n] for n in kv} == {TensorProto.FLOAT16}
    assert types["logits"] == TensorProto.FLOAT
    gqa = [n for n in m.graph.node if n.op_type == "GroupQueryAttention"]
    casts = [n for n in m.graph.node if n.op_type == "Cast"]
    assert len(casts) == 2 * len(gqa)  # packed QKV in, attention out: one Cast each way per layer
    with pytest.raises(KvDtypeError, match="GroupQueryAttention"):
        kv_to_fp16(onnx.helper.make_model(onnx.helper.make_graph([], "empty", [], [])))


def test_logits_and_greedy_against_torch(tiny, kv_artifacts):
    model, _ = tiny
    fp32, fp16 = GqaLM(kv_artifacts[0]), GqaLM(kv_artifacts[1])
    assert fp16.kv_dtype is np.float16
    err32 = err16 = 0.0
    for s in _prompts(4, seed=1):
        with torch.no_grad():
            ref = model(torch.tensor([s])).logits[0].numpy()
        err32 = max(err32, float(np.abs(fp32.logits(s) - ref).max()))
        err16 = max(err16, float(np.abs(fp16.logits(s) - ref).max()))
    print(f"max |logits - torch|: fp32 KV {err32:.2e}, fp16 KV {err16:.2e}")
    # fp16 keeps 11 bits of mantissa: K/V rounding at ~5e-4 relative, far above fp32's kernel noise
    assert err16 < 1e-2
    assert err16 > err32  # the rewrite took effect
    p = _prompts(1, seed=2)[0][:10]
    with torch.no_grad():
        hf = model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, 10:].tolist()
    assert fp16.greedy(p, 12) == hf


def test_golden_passes(tiny, kv_artifacts):
    from compress.evaluate.golden import compare_onnx, record_golden

    model, tok = tiny
    golden = record_golden(model, tok, ["The cat sat on", "Data flows one way", "a b c"], new_tokens=8)
    report = compare_onnx(kv_artifacts[1], golden)
    report.raise_if_failed()


def _engine_run(art, reqs, **cfg):
    eng = Engine(art, ServeConfig(providers=[CPU], enable_prefix_caching=False, **cfg), start=False)
    handles = [eng.add_request(p, SamplingParams.greedy(n, ignore_eos=True)) for p, n in reqs]
    eng.run_until_done()
    assert eng.block_manager.num_used == 0
    return eng, [h.result().output_ids for h in handles]


def test_engine_serves_it_and_the_budget_holds_twice_the_tokens(kv_artifacts):
    reqs = [(p, 12) for p in _prompts(8, seed=3)]
    cfg = dict(max_batch_size=8, max_num_batched_tokens=48, kv_memory_mb=4)
    e32, want = _engine_run(kv_artifacts[0], reqs, **cfg)
    e16, got = _engine_run(kv_artifacts[1], reqs, **cfg)
    assert got == want
    assert e16.runner.bytes_per_token * 2 == e32.runner.bytes_per_token
    assert e16.block_manager.num_blocks >= 2 * e32.block_manager.num_blocks - 1
    assert e16.kv_bytes() <= 4 * 2**20


def test_int8_on_top_keeps_fp16_kv(kv_artifacts, tmp_path):
    from compress.artifact import read_manifest
    from compress.drivers import load_lm
    from compress.quantize.quantizer import quantize_artifact

    rep = quantize_artifact(kv_artifacts[1], tmp_path / "wo8", None,
                            QuantizeConfig(method="weight_only", keep_float=[], quantize_embedding=False,
                                           smoothquant_alpha=None))
    assert rep.metrics()["quant_linears_int8"] == 10
    assert read_manifest(tmp_path / "wo8")["kv_dtype"] == "float16"
    s = _prompts(1, seed=4)[0]
    a, b = load_lm(kv_artifacts[1]).logits(s), load_lm(tmp_path / "wo8").logits(s)
    assert float((a.argmax(-1) == b.argmax(-1)).mean()) >= 0.9
    _, out = _engine_run(tmp_path / "wo8", [(s, 4)])
    assert len(out[0]) == 4


def test_config_refuses_fp16_kv_without_gqa():
    with pytest.raises(ValueError, match="export.kv_dtype float16 needs the gqa layout"):
        ExportConfig(exporter="dynamo", kv_dtype="float16")
    assert ExportConfig(exporter="auto", kv_dtype="float16").kv_dtype == "float16"
