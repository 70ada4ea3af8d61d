"""Weight-only INT8 written straight from the checkpoint (compress/export/gqa.py ``int8=``): the graph the quantize
stage's weight_only form makes of the fp32 export, without the fp32 graph in between (the 7B path: no 4-bytes-a-
parameter copy in memory or on disk). On every tiny family the two give the same logits, bit for bit."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest

from compress.artifact import read_manifest
from compress.config import QuantizeConfig
from compress.drivers import load_lm
from compress.export.gqa import build_gqa_artifact
from compress.quantize import quantize_artifact
from compress.loading.tiny import FAMILIES, build_tiny


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_from_the_checkpoint_is_the_quantize_stages_weight_only_form(family, tmp_path):
    model, tok = build_tiny(family, 0)
    cfg = QuantizeConfig(method="weight_only", smoothquant_alpha=None)
    build_gqa_artifact(model, tok, tmp_path / "fp32")
    quantize_artifact(tmp_path / "fp32", tmp_path / "stage", None, cfg)
    build_gqa_artifact(model, tok, tmp_path / "direct", int8=(cfg.weight_block_size, cfg.accuracy_level))
    blocks = np.random.default_rng(0).integers(3, 200, (2, 24))
    stage, direct = load_lm(tmp_path / "stage"), load_lm(tmp_path / "direct")
    assert np.array_equal(stage.prefill_batch(blocks), direct.prefill_batch(blocks))
    assert stage.greedy(blocks[0][:8].tolist(), 8) == direct.greedy(blocks[0][:8].tolist(), 8)  # the KV path too
    ops = collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "direct" / "model.onnx"),
                                                           load_external_data=False).graph.node)
    assert ops["MatMul"] == 0 and ops["MatMulNBits"] > 0 and ops["GatherBlockQuantized"] == 1
    q = read_manifest(tmp_path / "direct")["quantization"]
    assert q["method"] == "weight_only" and q["written_from"] == "checkpoint"
    size = {k: sum(p.stat().st_size for p in (tmp_path / k).glob("model.onnx*")) for k in ("stage", "direct")}
    assert abs(size["direct"] - size["stage"]) / size["stage"] < 0.02


def test_a_block_wider_than_the_tied_table_matches_the_quantize_stage(tmp_path):
    """weight_block_size 128 over a 64-wide tied table: both paths round the table in blocks of 64 (golden's rounded
    reference too: compress/formats/blocks.py), the linears in 128; logits equal bit for bit."""
    model, tok = build_tiny("llama", 0)
    cfg = QuantizeConfig(method="weight_only", smoothquant_alpha=None, weight_block_size=128)
    build_gqa_artifact(model, tok, tmp_path / "fp32")
    quantize_artifact(tmp_path / "fp32", tmp_path / "stage", None, cfg)
    build_gqa_artifact(model, tok, tmp_path / "direct", int8=(cfg.weight_block_size, cfg.accuracy_level))
    blocks = np.random.default_rng(0).integers(3, 200, (2, 24))
    assert np.array_equal(load_lm(tmp_path / "stage").prefill_batch(blocks), load_lm(tmp_path / "direct").prefill_batch(blocks))
    nodes = onnx.load(str(tmp_path / "direct" / "model.onnx"), load_external_data=False).graph.node
    table = {a.name: a.i for n in nodes if n.op_type == "GatherBlockQuantized" for a in n.attribute}
    assert table["block_size"] == 64
