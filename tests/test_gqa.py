"""The GroupQueryAttention layout: builder vs torch, golden, engine with the gqa runner vs the standard runner,
prefix hits, slot eviction/preemption, INT8 quantization of the gqa artifact."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from compress.artifact import read_manifest
from compress.config import QuantizeConfig, ServeConfig
from compress.export.gqa import GqaBuildError, build_gqa_artifact, build_gqa_model
from compress.drivers.gqa import GqaCache, GqaLM
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.runners.gqa import GqaRunner, balanced_cut
from serve.runners.onnx_session import CPU

SPECIAL = 3


@pytest.fixture(scope="module")
def gqa_artifact(tiny_gqa):
    """The session's tiny gqa artifact (conftest.py), checked as built."""
    manifest = read_manifest(tiny_gqa)
    assert manifest["attention_layout"] == "gqa"
    return tiny_gqa


def prompts(n, lo, hi, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(SPECIAL, 512, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


class Tap:
    """The logits the engine samples from, keyed by context (equal tokens alone hide K/V mistakes)."""

    def __enter__(self):
        import serve.engine.engine as mod

        self.rows, self._mod, self._orig = {}, mod, mod.sample_token

        def tapped(logits, params, rng, token_ids=(), *rest):
            self.rows[tuple(token_ids)] = np.array(logits, np.float32, copy=True)
            return self._orig(logits, params, rng, token_ids, *rest)

        mod.sample_token = tapped
        return self

    def __exit__(self, *exc):
        self._mod.sample_token = self._orig


def run_engine(art, reqs, first_alone=False, **cfg):
    cfg.setdefault("providers", [CPU])
    # these tests count the runner's calls and which prompts share one; the chunk that spreads prompts over steps
    # (and the calls that measure it) is tested in tests/test_scheduler.py and tests/test_prefill_chunk.py
    cfg.setdefault("prefill_chunk", 0)
    eng = Engine(art, ServeConfig(**cfg), start=False)
    released, release = [], eng.runner.release
    eng.runner.release = lambda key: (released.append(key), release(key))
    eng.released = released  # the sequences whose blocks the engine freed, as the runner heard of them
    with Tap() as tap:
        handles = []
        for k, (p, n) in enumerate(reqs):
            handles.append(eng.add_request(p, SamplingParams.greedy(n, ignore_eos=True)))
            if first_alone and k == 0:  # its blocks are computed and cached before the others arrive
                eng.run_until_done()
        eng.run_until_done()
    eng.block_manager.check_invariants()
    assert eng.block_manager.num_used == 0
    return eng, [h.result().output_ids for h in handles], tap.rows


def test_builder_matches_torch(tiny, gqa_artifact):
    model, _ = tiny
    lm = GqaLM(gqa_artifact)
    seqs = prompts(4, 2, 40, seed=1)
    worst = 0.0
    for s in seqs:  # prefill
        worst = max(worst, float(np.abs(lm.logits(s) - torch_logits(model, s)).max()))
    # ragged batched decode in one shared buffer: each row prefilled alone into its slot, then one call
    cache = lm.new_cache(len(seqs), 64)
    for b, s in enumerate(seqs):
        row = GqaCache.__new__(GqaCache)
        row.arrays, row.max_len = [a[b:b + 1] for a in cache.arrays], 64
        lm.forward(np.array([s[:-1]]), np.array([len(s) - 2]), row)
    dec = lm.forward(np.array([[s[-1]] for s in seqs]), np.array([len(s) - 1 for s in seqs]), cache)
    for b, s in enumerate(seqs):
        worst = max(worst, float(np.abs(dec[b, -1] - torch_logits(model, s)[-1]).max()))
    print(f"max |gqa - torch| logits: {worst:.2e}")
    assert worst < 1e-3
    # greedy through the in-place cache equals HF generate
    p = seqs[1][:10]
    with torch.no_grad():
        hf = model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, 10:].tolist()
    assert lm.greedy(p, 12) == hf


def test_golden_passes_on_gqa(tiny, gqa_artifact):
    from compress.evaluate.golden import compare_onnx, record_golden

    model, tok = tiny
    golden = record_golden(model, tok, ["The cat sat on", "Data flows one way", "a b c"], new_tokens=8)
    report = compare_onnx(gqa_artifact, golden)  # driver picked from manifest attention_layout
    print(report.metrics())
    report.raise_if_failed()
    assert report.metrics()["golden_max_abs_error"] < 1e-3


def test_rope_scaling_checked(tiny):
    from compress.loading.tiny import build_tiny_llama

    model, _ = build_tiny_llama(0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    from compress.export.gqa import _rope_type

    assert _rope_type(model.config) == "llama3"  # the scaling really reached the config
    sess_model = build_gqa_model(model)
    import onnxruntime as ort

    sess = ort.InferenceSession(sess_model.SerializeToString(), providers=[CPU])
    ids = prompts(1, 150, 150, seed=4)[0]  # past the original 64 positions, where llama3 scaling matters
    feed = {"input_ids": np.array([ids]), "seqlens_k": np.array([len(ids) - 1], np.int32),
            "total_sequence_length": np.array(len(ids), np.int32), "logits_to_keep": np.zeros(1, np.int64)}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values."):
            feed[i.name] = np.zeros((1, 2, 0, 16), np.float32)
    got = sess.run(["logits"], feed)[0][0]
    assert np.abs(got - torch_logits(model, ids)).max() < 1e-3
    dyn, _ = build_tiny_llama(0, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(GqaBuildError, match="dynamic"):
        build_gqa_model(dyn)


def test_engine_gqa_equals_standard(tiny_artifact, gqa_artifact):
    """Mixed prompt lengths and output lengths, chunked prefill, batch 8: same tokens and logits as `standard`."""
    rng = np.random.default_rng(3)
    reqs = [(p, int(rng.integers(1, 30))) for p in prompts(16, 1, 70, seed=2)]
    cfg = dict(enable_prefix_caching=False, max_batch_size=8, max_num_batched_tokens=48)
    _, want, ref = run_engine(tiny_artifact, reqs, **cfg)
    eng, got, rows = run_engine(gqa_artifact, reqs, **cfg)
    assert got == want
    assert rows.keys() == ref.keys()
    worst = max(float(np.abs(rows[k] - ref[k]).max()) for k in ref)
    print(f"gqa vs standard runner: {len(ref)} sampled steps, max |logits diff| {worst:.2e}; "
          f"calls {eng.runner.calls}, gathered {eng.runner.gathered_tokens}, moved {eng.runner.moved_tokens}")
    assert worst < 1e-4
    assert isinstance(eng.runner, GqaRunner)
    assert eng.runner.batched_prompts > 0  # some steps ran several first prompts in one call


def test_split_decode_equals_one_call(tiny_artifact, gqa_artifact):
    """Decode steps of 3 to 8 rows, and steps' new prompts, run as two halves on the split session: the standard
    runner's tokens and logits."""
    rng = np.random.default_rng(4)
    reqs = [(p, int(rng.integers(2, 20))) for p in prompts(12, 2, 30, seed=9)]
    cfg = dict(enable_prefix_caching=False, max_batch_size=8, max_num_batched_tokens=64)
    _, want, ref = run_engine(tiny_artifact, reqs, **cfg)
    eng, got, rows = run_engine(gqa_artifact, reqs, decode_split_rows=3, **cfg)
    assert got == want
    assert max(float(np.abs(rows[k] - ref[k]).max()) for k in ref) < 1e-4
    assert eng.runner.split_steps > 0 and eng.runner.decode_split_rows == 3
    assert eng.runner.split_prompt_calls > 0  # new prompts of a step, shorter and longer half at once


def test_balanced_cut_evens_the_two_prompt_calls():
    """The split point of a wave's first prompts: even rows for even lengths; a long prompt with one short one (the
    call the other 30 make is still the longer) rather than fifteen short ones padded to its length; the kept
    logits positions counted."""
    assert balanced_cut([40] * 32, 0.27) == 16
    assert balanced_cut([40] * 31 + [400], 0.27) == 30
    assert balanced_cut([10, 10, 10, 100], 0.0) == 3
    # 37-43 tokens (the sweep's chat prompts): n // 2 leaves the longer call 705 against 637 units, 17 evens it
    lens = [37] * 4 + [38] * 6 + [39] * 6 + [40] * 2 + [41] * 5 + [42] * 5 + [43] * 4
    assert balanced_cut(lens, 0.2666) == 17


def test_first_prompts_in_one_call(tiny_artifact, gqa_artifact):
    """Eight prompts of 3 to 40 tokens admitted in one step run as one right-padded call: the same logits as
    the standard runner's one call per prompt, then the same decode."""
    reqs = [(p, 6) for p in prompts(8, 3, 40, seed=11)]
    cfg = dict(enable_prefix_caching=False, max_batch_size=8, max_num_batched_tokens=512)
    _, want, ref = run_engine(tiny_artifact, reqs, **cfg)
    eng, got, rows = run_engine(gqa_artifact, reqs, **cfg)
    assert got == want
    assert max(float(np.abs(rows[k] - ref[k]).max()) for k in ref) < 1e-4
    assert eng.runner.batched_prompts == 8
    assert eng.runner.calls == 1 + 5  # one prefill call, then five decode steps of all eight


def test_first_prompts_admitted_together_run_as_one_prompt_call(gqa_artifact):
    """Six first prompts admitted in one step go to the runner as one prompt call, then decode together; the same
    prompts arriving one step apart take a call each. Outputs equal batch 1. Stepped by hand, no clock: when the
    engine's loop admits arrivals together (serve.admit_quiet_ms) is the scheduler's, tested with a fake clock in
    tests/test_scheduler.py."""
    reqs = prompts(6, 5, 20, seed=21)
    cfg = ServeConfig(providers=[CPU], verify_artifact=False, enable_prefix_caching=False, max_batch_size=8, prefill_chunk=0,
                      decode_split_rows=0)

    def serve(together: bool):
        with Engine(gqa_artifact, cfg, start=False) as eng:
            handles = []
            for p in reqs:
                handles.append(eng.add_request(p, SamplingParams.greedy(4, ignore_eos=True)))
                if not together:
                    eng.step()
            eng.run_until_done()
            return ({tuple(h.prompt_ids): h.result(60).output_ids for h in handles}, eng.runner.calls,
                    eng.runner.batched_prompts)

    out, calls, batched = serve(together=True)
    assert batched == 6 and calls == 1 + 3  # one prompt call for all six, then three decode steps
    with Engine(gqa_artifact, ServeConfig(providers=[CPU], verify_artifact=False, prefill_chunk=0), start=False) as alone:
        ref = {tuple(p): alone.generate(p, SamplingParams.greedy(4, ignore_eos=True)) for p in reqs}
    assert out == ref
    apart, calls_apart, batched_apart = serve(together=False)
    assert apart == ref and batched_apart == 0 and calls_apart > calls


def test_prefix_hits_copy_cached_blocks(tiny_artifact, gqa_artifact):
    shared = prompts(1, 40, 40, seed=5)[0]
    reqs = [(shared + tail, 10) for tail in prompts(6, 1, 9, seed=6)]
    _, want, ref = run_engine(tiny_artifact, reqs, enable_prefix_caching=False, kv_block_size=4)
    eng, got, rows = run_engine(gqa_artifact, reqs, first_alone=True, enable_prefix_caching=True, kv_block_size=4,
                                max_batch_size=4)
    assert got == want
    assert max(float(np.abs(rows[k] - ref[k]).max()) for k in ref) < 1e-4
    assert eng.block_manager.prefix_hits >= 5 * 40 - 5 * 4  # later requests reuse the shared prompt's blocks
    assert eng.runner.gathered_tokens > 0  # the hits reached the rows by copying blocks into them


def test_next_turn_reuses_blocks_its_answer_filled(tiny_artifact, gqa_artifact):
    """Decode K/V reaches the pool a block at a time: a second turn whose prompt is the first turn's prompt and
    answer hits the blocks the answer filled (published while the first request ran), with the logits of the
    standard runner, which writes every position as it comes."""
    first = prompts(1, 10, 10, seed=12)[0]
    eng, (answer,), _ = run_engine(gqa_artifact, [(first, 23)], enable_prefix_caching=True, kv_block_size=4)
    second = first + answer + prompts(1, 3, 3, seed=13)[0]
    reqs = [(first, 23), (second, 8)]
    _, want, ref = run_engine(tiny_artifact, reqs, first_alone=True, enable_prefix_caching=False, kv_block_size=4)
    eng, got, rows = run_engine(gqa_artifact, reqs, first_alone=True, enable_prefix_caching=True, kv_block_size=4)
    assert got == want
    assert max(float(np.abs(rows[k] - ref[k]).max()) for k in ref) < 1e-4
    # 33 tokens of the second prompt are in 8 full blocks, 5 of them filled by the first request's decode steps
    assert eng.block_manager.prefix_hits >= 32


def test_released_sequence_never_writes_into_reused_blocks(gqa_artifact):
    """A sequence freed with K/V still only in its row (a partial block) is released by the engine: when its row
    is later overwritten, nothing is written into the blocks, which by then belong to another sequence."""
    from serve.artifact import read_manifest
    from serve.runners.protocol import RunRow

    r = GqaRunner(gqa_artifact, read_manifest(gqa_artifact, verify=False), num_blocks=8, block_size=4,
                  providers=[CPU], max_batch_size=2, decode_split_rows=0)
    r.execute([RunRow("A", [0, 1, 2], 0, list(range(10, 15))), RunRow("D", [6, 7], 0, list(range(50, 54)))])
    for pos in range(5, 9):  # position 7 fills block 1 (flushed); position 8 sits in block 2, not yet written
        r.execute([RunRow("A", [0, 1, 2], pos, [20 + pos])])
    a = [sl.key for sl in r.rows.slot].index("A")
    assert r.rows.slot[a].flushed == 8 and r.rows.slot[a].valid == 9
    r.release("A")  # the engine freed A's blocks: block 2 goes to B
    r.execute([RunRow("B", [2, 3], 0, list(range(30, 36)))])
    b = [sl.key for sl in r.rows.slot].index("B")
    written = r.pool[:, 2].copy()
    assert np.array_equal(written, r.rows.kv[:, b, :, 0:4, :])  # B's first block, written by its prefill
    r.execute([RunRow("C", [4, 5], 0, list(range(40, 46)))])  # takes the least recently used row
    assert {sl.key for sl in r.rows.slot} == {"B", "C"}
    assert np.array_equal(r.pool[:, 2], written)  # B's block is untouched


def test_eviction_and_preemption(tiny_artifact, gqa_artifact):
    """A 12-block pool and 3 KV rows for 10 requests: rows are evicted and refilled, sequences preempted."""
    reqs = [(p, 20) for p in prompts(10, 3, 20, seed=7)]
    _, want, _ = run_engine(tiny_artifact, reqs, enable_prefix_caching=False)
    eng, got, _ = run_engine(gqa_artifact, reqs, num_blocks=12, kv_block_size=4, max_batch_size=3,
                             max_num_batched_tokens=16)
    assert got == want
    assert eng.stats().preemptions > 0
    assert eng.runner.gathered_tokens > 0  # rows refilled from the pool after eviction or preemption
    # every finish and every preemption freed blocks, and the runner heard of each (its K/V there is dead)
    assert len(eng.released) == len(reqs) + eng.stats().preemptions == len(set(eng.released))


@pytest.mark.parametrize("scales", ["channel", "tensor"])
def test_int8_kv_cache(gqa_artifact, tiny_splits, tmp_path, scales):
    """quantize.kv_cache int8: GroupQueryAttention keeps an int8 cache with calibrated per-channel (or per-tensor)
    scales; logits stay near the float32 cache's, and the engine's batched tokens equal batch-1 greedy on the same
    artifact."""
    import onnx
    from onnx import TensorProto

    from compress.artifact import read_manifest
    from compress.drivers import load_lm
    from compress.quantize import quantize_artifact

    base = QuantizeConfig(method="weight_only", smoothquant_alpha=None, quantize_embedding=False)
    quantize_artifact(gqa_artifact, tmp_path / "f32", tiny_splits.calib, base)
    rep = quantize_artifact(gqa_artifact, tmp_path / "i8", tiny_splits.calib,
                            base.model_copy(update={"kv_cache": "int8", "kv_cache_scales": scales}))
    assert read_manifest(tmp_path / "i8")["kv_dtype"] == "int8"  # and every file's sha256 checks
    assert rep.settings["kv_cache_layers"] == 2 and rep.settings["kv_key_absmax_p50_max"][1] > 0
    assert rep.settings["kv_cache"].startswith(f"int8 per {scales}")
    g = onnx.load(str(tmp_path / "i8" / "model.onnx"), load_external_data=False).graph
    inits = {i.name: i for i in g.initializer}
    for node in (n for n in g.node if n.op_type == "GroupQueryAttention"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["k_quant_type"] == attrs["v_quant_type"] == (b"PER_CHANNEL" if scales == "channel" else b"PER_TENSOR")
        n_scales = [int(np.prod(inits[node.input[i]].dims)) for i in (12, 13)]
        assert (n_scales[0] == n_scales[1] > 1) if scales == "channel" else n_scales == [1, 1], n_scales
    past = [i for i in g.input if i.name.startswith("past_key_values.")]
    assert past and all(i.type.tensor_type.elem_type == TensorProto.INT8 for i in past)
    blocks = tiny_splits.selection[:4]
    f32 = load_lm(tmp_path / "f32", verify=False).prefill_batch(blocks)
    i8 = load_lm(tmp_path / "i8", verify=False).prefill_batch(blocks)
    rel = float(np.abs(i8 - f32).max() / np.abs(f32).max())
    agree = float((i8.argmax(-1) == f32.argmax(-1)).mean())
    print(f"int8 K/V against float32 K/V: max rel logit diff {rel:.4f}, top-1 agreement {agree:.3f}")
    assert rel < 0.05 and agree > 0.95
    reqs = [(p, 8) for p in prompts(6, 3, 30, seed=21)]
    eng, got, _ = run_engine(tmp_path / "i8", reqs, enable_prefix_caching=True, max_batch_size=6, kv_block_size=4,
                             max_num_batched_tokens=64)
    lm = load_lm(tmp_path / "i8", verify=False)
    assert got == [lm.greedy(p, 8) for p, _ in reqs]
    assert eng.runner.pool.dtype == np.int8 and eng.runner.bytes_per_token * 4 == \
        load_lm(tmp_path / "f32", verify=False).num_layers * 2 * eng.runner.kv_heads * eng.runner.head_dim * 4
    with pytest.raises(Exception, match="calib split"):
        quantize_artifact(gqa_artifact, tmp_path / "x", None, base.model_copy(update={"kv_cache": "int8"}))


@pytest.mark.parametrize("method", ["weight_only", "static", "dynamic", "dynamic_token"])
def test_quantize_gqa_artifact(tiny_artifact, gqa_artifact, tiny_splits, tmp_path, method):
    """INT8 selects the same 14 linears by name and drifts from fp32 as much as the standard graph does.

    dynamic_token also covers the opset: the gqa graph is opset 17, where ReduceMax takes axes as an attribute.
    """
    from compress.artifact import read_manifest
    from compress.drivers import load_lm
    from compress.quantize.quantizer import quantize_artifact

    kind = {"method": "dynamic", "activation_granularity": "token"} if method == "dynamic_token" else {"method": method}
    cfg = QuantizeConfig(**kind, keep_float=[], quantize_embedding=False, smoothquant_alpha=None)
    calib = tiny_splits.calib if method == "static" else None
    drift = {}
    for name, art in (("standard", tiny_artifact), ("gqa", gqa_artifact)):
        rep = quantize_artifact(art, tmp_path / name, calib, cfg)
        # 2 layers x 7 linears; the gqa graph packs q/k/v into one MatMul (compress/export/graph_fusion.py)
        assert rep.metrics()["quant_linears_int8"] == {"standard": 14, "gqa": 10}[name]
        assert read_manifest(tmp_path / name)["attention_layout"] == name
        fp, q = load_lm(art), load_lm(tmp_path / name)
        agree, err = [], []
        for block in tiny_splits.selection[:4]:
            a, b = fp.logits(block.tolist()), q.logits(block.tolist())
            agree.append(float((a.argmax(-1) == b.argmax(-1)).mean()))
            err.append(float(np.abs(a - b).mean()))
        drift[name] = (float(np.mean(agree)), float(np.mean(err)))
    print(method, "(top-1 agreement, mean |logit error|) vs fp32:", drift)
    assert drift["gqa"][0] >= drift["standard"][0] - 0.05
    assert drift["gqa"][1] <= 1.5 * drift["standard"][1] + 1e-3
    if method == "dynamic_token":
        # SmoothQuant folds into the gqa graph's fused RMSNorm (SimplifiedLayerNormalization) as into the
        # standard graph's Mul: the same tensors are smoothed in both.
        sq = cfg.model_copy(update={"smoothquant_alpha": 0.5})
        smoothed = {name: quantize_artifact(art, tmp_path / f"{name}_sq", tiny_splits.calib, sq).smoothed_tensors
                    for name, art in (("standard", tiny_artifact), ("gqa", gqa_artifact))}
        assert smoothed == {"standard": 6, "gqa": 6}  # 2 layers x (attention norm, mlp norm, down_proj input)
    # the quantized gqa artifact serves through the gqa runner
    _, out, _ = run_engine(tmp_path / "gqa", [(prompts(1, 5, 5, seed=8)[0], 4)])
    assert len(out[0]) == 4


def test_auto_exporter_picks_gqa_where_the_model_allows(tiny):
    import copy

    from compress.export.gqa import choose_exporter

    assert choose_exporter(tiny[0], "auto")[0] == "gqa"
    biased = copy.deepcopy(tiny[0])
    biased.config.mlp_bias = True  # a Llama option the gqa graph would get wrong
    used, why = choose_exporter(biased, "auto")
    assert used == "dynamo" and "mlp_bias" in why
    assert choose_exporter(tiny[0], "torchscript")[0] == "torchscript"  # an explicit choice is kept


def test_pruned_student_builds_and_passes_golden(tiny, tiny_splits, tmp_path):
    """`auto` sends pruned students to the gqa builder too: fewer heads, KV groups, neurons and layers."""
    from compress.config import GoldenConfig, PruneConfig
    from compress.evaluate.golden import compare_onnx, record_golden
    from compress.export.gqa import build_gqa_artifact, choose_exporter
    from compress.prune import prune_model

    model, tok = tiny
    cfg = PruneConfig(enabled=True, method="structured", mlp_ratio=0.25, head_ratio=0.5, layer_ratio=0.5,
                      sensitivity=False, protected_layers=[])
    student, _ = prune_model(model, tiny_splits.calib, cfg)
    c = student.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (1, 2, 1)
    assert choose_exporter(student, "auto")[0] == "gqa"
    build_gqa_artifact(student, tok, tmp_path / "student")
    report = compare_onnx(tmp_path / "student", record_golden(student, tok, GoldenConfig().prompts, 8, 8))
    assert report.passed, report.failures
    assert report.metrics()["golden_max_abs_error"] < 1e-4


def test_prompt_profile_times_the_servers_batched_prompt_call(gqa_artifact, tiny_artifact, tmp_path):
    """benchmarks.ceiling --prompt-profile: the call of a wave's first prompts (sorted, right-padded), timed and split by op."""
    from bench_cli import run_bench

    out = tmp_path / "pp.json"
    run = run_bench("ceiling", "--prompt-profile", "--artifact", f"g={gqa_artifact}", "--prompts", "3", "--runs", "2", "--profile",
                    "--json", out)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())["results"]["g"]
    lens = r["prompt_tokens"]
    assert len(lens) == 3 and (r["tokens"], r["padded_tokens"]) == (sum(lens), 3 * max(lens))
    assert r["median_ms"] > 0 and len(r["runs_ms"]) == 2
    assert r["op_ms"]["GroupQueryAttention"] > 0 and "MatMul" in r["op_ms"]
    refused = run_bench("ceiling", "--prompt-profile", "--artifact", f"s={tiny_artifact}")
    assert refused.returncode != 0 and "attention layout 'standard'" in refused.stderr


def test_prompt_cut_times_a_wave_cut_both_ways(gqa_artifact, tiny_artifact):
    """benchmarks.ceiling --prompt-cut: one wave of first prompts per engine step, cut at half and by balanced_cut, paired."""
    import os

    from bench_cli import run_bench

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the split session (two prompt calls at once) needs 2 cores")
    run = run_bench("ceiling", "--prompt-cut", "--artifact", gqa_artifact, "--prompts", "6", "--long", "1", "--trials", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("trial ") == 2 and "balanced / half" in run.stdout
    refused = run_bench("ceiling", "--prompt-cut", "--artifact", tiny_artifact)
    assert refused.returncode != 0 and "needs a gqa artifact" in refused.stderr


def test_no_split_session_for_a_graph_over_the_weight_limit(gqa_artifact, monkeypatch):
    """The split decode's second session is a second copy of the weights: a graph over SPLIT_MAX_WEIGHT_BYTES (a 7B's
    8.6 GB) gets none, so the server holds its weights once."""
    from serve.artifact import graph_bytes, read_manifest
    from serve.runners import gqa_split

    manifest = read_manifest(gqa_artifact, verify=False)
    assert 0 < graph_bytes(manifest) < gqa_split.SPLIT_MAX_WEIGHT_BYTES
    kw = dict(num_blocks=8, block_size=4, providers=[CPU], max_batch_size=8, decode_split_rows=3, intra_op_threads=2)
    split = GqaRunner(gqa_artifact, manifest, **kw)
    assert split.decode_split_rows == 3 and split.split.session is not None
    monkeypatch.setattr(gqa_split, "SPLIT_MAX_WEIGHT_BYTES", graph_bytes(manifest) - 1)
    whole = GqaRunner(gqa_artifact, manifest, **kw)
    assert whole.decode_split_rows == 0 and whole.split.session is None


def test_the_gqa_builder_honours_the_external_data_threshold(tmp_path):
    """export.external_data_threshold_mb reaches the gqa builder: under it one model.onnx, over it the weights go
    to model.onnx.data beside it; both hold the same weights."""
    import onnx
    from onnx import numpy_helper

    from compress.loading.tiny import build_tiny_llama

    model, tok = build_tiny_llama(seed=0, intermediate_size=1024)  # ~1.3 MB of weights: over a 1 MB threshold
    build_gqa_artifact(model, tok, tmp_path / "one")
    build_gqa_artifact(model, tok, tmp_path / "two", external_data_threshold_mb=1)
    assert not (tmp_path / "one" / "model.onnx.data").exists()
    data = tmp_path / "two" / "model.onnx.data"
    assert data.stat().st_size > 2**20 > (tmp_path / "two" / "model.onnx").stat().st_size
    one, two = (onnx.load(str(tmp_path / d / "model.onnx")) for d in ("one", "two"))
    w1 = {t.name: numpy_helper.to_array(t) for t in one.graph.initializer}
    w2 = {t.name: numpy_helper.to_array(t) for t in two.graph.initializer}
    assert w1.keys() == w2.keys() and all(np.array_equal(w1[k], w2[k]) for k in w1)
