"""The prompt-time form of a 4-bit artifact (serve/runners/prompt_form.py) and the server running prompt rows on
it (serve.prompt_form): its logits against the 4-bit graph's at every position, the int8 bytes it adds, the cache it
is kept in, the engine's prompt calls on it with decode on the 4-bit form, and the refusals."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from compress.artifact import read_manifest
from compress.config import QuantizeConfig
from compress.drivers import lm_for_model
from serve.runners.prompt_form import GRAPH, convertible, write_prompt_form
from compress.quantize.quantizer import quantize_artifact
from serve.config import ConfigError, ServeConfig
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.runners.onnx_session import CPU
from serve.runners.prompt_form import MIN_ROWS, prompt_graph


@pytest.fixture(scope="module")
def int4_gqa(tiny_gqa, tiny_splits, tmp_path_factory):
    out = tmp_path_factory.mktemp("int4_prompt_form") / "artifact"
    quantize_artifact(tiny_gqa, out, tiny_splits.calib,
                      QuantizeConfig(method="weight_only", weight_bits=4, smoothquant_alpha=None))
    return out


@pytest.fixture(scope="module")
def form(int4_gqa, tmp_path_factory):
    root = tmp_path_factory.mktemp("prompt_forms")
    return root, prompt_graph(int4_gqa, read_manifest(int4_gqa), root)


def test_the_prompt_form_converts_the_4bit_linears_but_down_proj_and_the_head(int4_gqa, form, tmp_path):
    model = onnx.load(str(int4_gqa / "model.onnx"))
    nodes = convertible(model)
    layers = read_manifest(int4_gqa)["num_layers"]
    assert nodes and not any("down_proj" in n.name or "lm_head" in n.name for n in nodes)
    wrote = write_prompt_form(int4_gqa, tmp_path)
    sizes = {a.name: a.i for n in nodes for a in n.attribute if a.name in ("K", "N")}
    want = sum(next(a.i for a in n.attribute if a.name == "K") * next(a.i for a in n.attribute if a.name == "N")
               for n in nodes)
    assert wrote["nodes"] == len(nodes) >= 2 * layers and wrote["int8_bytes"] == want and sizes
    ops = [n.op_type for n in onnx.load(str(tmp_path / GRAPH)).graph.node]
    assert ops.count("DynamicQuantizeMatMul") == len(nodes)
    assert ops.count("MatMulNBits") == sum(n.op_type == "MatMulNBits" for n in model.graph.node) - len(nodes)


def test_the_prompt_forms_logits_agree_with_the_4bit_graphs_at_every_position(int4_gqa, form, tiny_splits):
    """Prompt-path logits against the decode path's graph: the gate's top-1 agreement (0.9) at every position of
    held-out blocks, and close logits (the tiny model's are small; a real model's figures are in docs/serving.md)."""
    manifest = read_manifest(int4_gqa)
    blocks = np.asarray(tiny_splits.test)[:4, :64]
    want = np.concatenate(list(lm_for_model(onnx.load(str(int4_gqa / "model.onnx")), manifest).prefill_batches(blocks)))
    got = np.concatenate(list(lm_for_model(onnx.load(str(form[1])), manifest).prefill_batches(blocks)))
    agree = float((got.argmax(-1) == want.argmax(-1)).mean())
    rel = float(np.abs(got - want).mean() / np.abs(want).mean())
    print(f"prompt form vs 4-bit graph: top-1 agreement {agree:.4f}, mean |diff| / mean |logit| {rel:.4f}")
    assert agree >= 0.9 and rel < 0.05


def test_the_form_is_cached_by_the_graphs_identity(int4_gqa, form):
    root, path = form
    stamp = path.stat().st_mtime_ns
    assert prompt_graph(int4_gqa, read_manifest(int4_gqa), root) == path and path.stat().st_mtime_ns == stamp
    assert len(list(root.iterdir())) == 1


def test_the_engine_runs_prompt_rows_on_the_form_and_decodes_on_the_4bit_graph(int4_gqa, form, tiny_splits,
                                                                                 monkeypatch):
    """Long prompts (64 rows) run on the form, short ones (< MIN_ROWS) and decodes on the 4-bit graph; the first
    token's logits agree with the 4-bit engine's (top-1 on most prompts), the K/V the decode reads is the one the
    form wrote (the continuations stay close)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(form[0].parent / "xdg"))
    prompts = [list(map(int, b)) for b in np.asarray(tiny_splits.test)[:6, :64]] + [[5, 9, 11]]
    runs = {}
    for setting in ("off", "w8a8"):
        eng = Engine(int4_gqa, ServeConfig(providers=[CPU], prompt_form=setting, prefill_chunk=0,
                                           enable_prefix_caching=False, result_cache_size=0), start=False)
        handles = [eng.add_request(p, SamplingParams.greedy(8, ignore_eos=True)) for p in prompts]
        eng.run_until_done()
        runs[setting] = ([h.result().output_ids for h in handles], eng.runner.prompt_form_calls, eng.runner.calls)
        eng.shutdown()
    (off, calls_off, _), (on, calls_on, total) = runs["off"], runs["w8a8"]
    assert calls_off == 0 and 1 <= calls_on < total  # prompt calls on the form, decodes not
    first_same = sum(a[0] == b[0] for a, b in zip(off, on))
    assert first_same >= len(prompts) - 1, (off, on)
    assert on[-1] == off[-1]  # 3 rows: below MIN_ROWS, on the 4-bit graph alone
    assert MIN_ROWS > 3


def test_refusals_name_the_key(tiny_gqa, int4_gqa, tmp_path):
    with pytest.raises(ValueError, match="serve.prompt_form"):
        write_prompt_form(tiny_gqa, tmp_path / "fp32")  # no 4-bit linears
    manifest = dict(read_manifest(int4_gqa), kv_dtype="int8")
    with pytest.raises(ValueError, match="serve.prompt_form.*float cache"):
        prompt_graph(int4_gqa, manifest, tmp_path)
    with pytest.raises(ConfigError, match="serve.prompt_form"):
        Engine(tiny_gqa, ServeConfig(providers=[CPU], prompt_form="w8a8"), start=False)


def test_the_form_is_refused_where_memory_cannot_hold_it(int4_gqa, form, tmp_path, monkeypatch):
    """The memory budget with the extra form: its session's bytes (the cached form's data file, or 1.3x the served
    graph before it is built) against the machine's available memory; refused, nothing written, naming the key."""
    from serve.runners import prompt_form

    graph = prompt_form.graph_size(int4_gqa, read_manifest(int4_gqa))
    built = (form[1].parent / f"{GRAPH}.data").stat().st_size
    assert graph < built < 1.3 * graph  # the estimate bounds the form of the tiny model too
    monkeypatch.setattr(prompt_form, "available_bytes", lambda: built - 1)
    with pytest.raises(ValueError, match=r"serve.prompt_form: .*GiB more memory.*set serve.prompt_form: off"):
        prompt_graph(int4_gqa, read_manifest(int4_gqa), form[0])  # cached: its data file counts
    with pytest.raises(ValueError, match="serve.prompt_form"):
        prompt_graph(int4_gqa, read_manifest(int4_gqa), tmp_path)  # not built: the estimate counts
    assert not any(tmp_path.iterdir())
    assert json.loads((int4_gqa / "manifest.json").read_text())["quantization"]["weight_bits"] == 4
