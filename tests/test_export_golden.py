"""Export with KV cache + golden validation on the tiny model, and that golden catches real breakage."""

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from compress.artifact import ArtifactError, read_manifest
from compress.config import GoldenConfig
from compress.evaluate.golden import GoldenMismatch, GoldenSet, compare_onnx, record_golden
from compress.drivers.standard import OnnxLM

PROMPTS = GoldenConfig().prompts


@pytest.fixture(scope="module")
def golden(tiny, tmp_path_factory):
    model, tok = tiny
    g = record_golden(model, tok, PROMPTS, top_k=8, new_tokens=8)
    folder = g.save(tmp_path_factory.mktemp("golden"))
    return GoldenSet.load(folder)


def test_manifest_describes_the_graph(tiny_artifact):
    m = read_manifest(tiny_artifact)
    assert m["attention_layout"] == "standard" and m["num_layers"] == 2 and m["num_kv_heads"] == 2
    assert "model.onnx" in m["files"] and "tokenizer.json" in m["files"]
    graph = onnx.load(str(tiny_artifact / "model.onnx"), load_external_data=False).graph
    assert [i.name for i in graph.input] == m["io"]["inputs"]
    assert [o.name for o in graph.output] == m["io"]["outputs"]
    assert m["chat_template"] and m["eos_token_ids"]


def test_export_passes_golden(tiny_artifact, golden):
    report = compare_onnx(tiny_artifact, golden)
    assert report.passed, report.failures
    m = report.metrics()
    assert m["golden_max_abs_error"] < 1e-4
    assert m["golden_top1_agreement"] == 1.0 and m["golden_prefix_match"] == 1.0


def test_greedy_check_holds_eos_off_as_the_reference_does(tiny, tiny_artifact):
    """generate(min_new_tokens=N) never picks EOS; the ONNX greedy decode must not either.

    Found on a distilled SmolLM2 student whose top-1 at the 16th token was EOS: the reference went on
    with its second choice and golden reported a divergence that was no export error.
    """
    import copy

    model, tok = tiny
    lm = OnnxLM(tiny_artifact)
    prompt = tok(PROMPTS[0], add_special_tokens=False)["input_ids"]
    free = lm.greedy(prompt, 8)
    eos_model = copy.deepcopy(model)
    eos_model.generation_config.eos_token_id = free[3]  # the model's own 4th greedy token now counts as EOS
    g = record_golden(eos_model, tok, PROMPTS[:1], top_k=8, new_tokens=8)
    assert g.suppressed_ids == [free[3]] and free[3] not in g.continuations[0]  # the reference held it off
    assert lm.greedy(prompt, 8)[3] == free[3]  # unconstrained, the ONNX decode picks it
    report = compare_onnx(lm, g, check_batched=False)
    assert report.passed, report.failures
    assert report.metrics()["golden_prefix_match"] == 1.0


def test_left_padded_batch_matches_single_runs(tiny_artifact, golden):
    lm = OnnxLM(tiny_artifact)
    seqs = [golden.sequence(i) for i in range(len(PROMPTS))]
    assert len({len(s) for s in seqs}) > 1  # really ragged
    for s, batched in zip(seqs, lm.logits_left_padded(seqs)):
        assert np.abs(batched - lm.logits(s)).max() < 1e-4


def test_kv_cache_decode_matches_full_prefill(tiny_artifact, golden):
    lm = OnnxLM(tiny_artifact)
    seq = golden.sequence(0)
    full = lm.logits(seq)
    logits, past = lm.forward(np.array([seq[:3]]), np.ones((1, 3)), np.arange(3)[None])
    steps = [logits[0, -1]]
    for n in range(3, len(seq)):
        logits, past = lm.forward(np.array([[seq[n]]]), np.ones((1, n + 1)), np.array([[n]]), past)
        steps.append(logits[0, -1])
    assert past[0].shape[2] == len(seq)
    assert np.abs(np.stack(steps) - full[2:]).max() < 1e-4


def test_perturbed_weight_fails_golden_naming_prompt_and_position(tiny_artifact, golden, tmp_path):
    art = tmp_path / "broken"
    shutil.copytree(tiny_artifact, art)
    model = onnx.load(str(art / "model.onnx"))
    target = next(i for i in model.graph.initializer if "mlp" in i.name or "down_proj" in i.name)
    w = numpy_helper.to_array(target).copy()
    w *= 1.5
    target.CopyFrom(numpy_helper.from_array(w, target.name))
    onnx.save(model, str(art / "model.onnx"))
    report = compare_onnx(OnnxLM(art, verify=False), golden)
    assert not report.passed
    first = report.failures[0]
    assert "prompt 0" in first and "position" in first
    with pytest.raises(GoldenMismatch, match="prompt"):
        report.raise_if_failed()


def test_truncated_file_is_caught_by_manifest(tiny_artifact, tmp_path):
    art = tmp_path / "trunc"
    shutil.copytree(tiny_artifact, art)
    data = (art / "model.onnx").read_bytes()
    (art / "model.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="model.onnx.*truncated"):
        read_manifest(art)
    tj = json.loads((art / "tokenizer.json").read_text())
    tj["added_tokens"] = []
    (art / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ArtifactError):
        OnnxLM(art)


def test_torchscript_exporter_also_matches(tiny, golden, tmp_path):
    from compress.export.standard import build_artifact

    model, tok = tiny
    build_artifact(model, tok, tmp_path / "ts", exporter="torchscript")
    report = compare_onnx(tmp_path / "ts", golden)
    assert report.passed, report.failures
