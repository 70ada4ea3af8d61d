"""The architecture matrix (issue 17): every stage on a tiny seeded model of each family users compress.

Per family (compress/loading/tiny.py): export with ``export.exporter: auto`` (the gqa graph where the builder takes
the family, the dynamo export otherwise) + golden, with a prompt longer than the sliding window and a
left-padded batch; structured pruning (KV groups, MLP, a layer) then export + golden of the student, or
the UnsupportedArchitectureError naming why; a few distillation steps; static INT8; serving through
serve.engine.engine with batched greedy outputs equal to batch 1. Plus the standard layout on the families
whose standard export has its own trap (sliding-window caches). docs/models.md has the measured table.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

from compress.config import DistillConfig, PruneConfig, QuantizeConfig, ServeConfig
from compress.export.standard import build_artifact
from compress.evaluate.golden import compare_onnx, record_golden
from compress.export.gqa import build_gqa_artifact, choose_exporter
from compress.loading.tiny import FAMILIES, SLIDING_WINDOW, build_tiny

# Families the gqa builder refuses (none of the tiny ones; test_auto_falls_back_with_the_reason covers the path).
STANDARD_ONLY: set[str] = set()
PRUNE_REFUSED = {"gpt_neox"}
LONG = ("The cat sat on the mat and then it went to the store to buy some bread and milk "
        "for the family before the rain")
PROMPTS = ["The cat sat on", LONG, "a b c"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models():
    """family -> (model, tokenizer), built on first use. Read-only."""
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            cache[family] = build_tiny(family, seed=0)
        return cache[family]
    return get


def _export(model, tok, out, requested: str = "auto") -> str:
    exporter, _ = choose_exporter(model, requested)
    if exporter == "gqa":
        build_gqa_artifact(model, tok, out)
    else:
        build_artifact(model, tok, out, exporter=exporter)
    return exporter


@pytest.fixture(scope="module")
def artifacts(models, tmp_path_factory):
    """family -> fp32 artifact folder, exported with exporter 'auto' on first use. Read-only."""
    root = tmp_path_factory.mktemp("arch")
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            model, tok = models(family)
            cache[family] = (root / family, _export(model, tok, root / family))
        return cache[family]
    return get


def _golden(model, tok, folder):
    golden = record_golden(model, tok, PROMPTS, new_tokens=6)
    assert len(golden.prompt_ids[1]) > SLIDING_WINDOW + 8  # past the window, where sliding layers differ
    report = compare_onnx(folder, golden)
    report.raise_if_failed()
    return report.metrics()


@pytest.mark.parametrize("family", FAMILIES)
def test_export_auto_and_golden(family, models, artifacts):
    model, tok = models(family)
    folder, exporter = artifacts(family)
    assert exporter == ("dynamo" if family in STANDARD_ONLY else "gqa")
    why = choose_exporter(model, "auto")[1]
    assert family.split("_")[0] in why or model.config.model_type in why  # the log line names the family
    m = _golden(model, tok, folder)
    print(f"{family}: {exporter} golden {m}")
    assert m["golden_max_abs_error"] < 1e-4 and m["golden_batched_max_abs_error"] < 1e-4


def test_auto_falls_back_with_the_reason(models):
    """A model the gqa graph cannot express gets the dynamo export, and the log line says why."""
    model = build_tiny("gpt_neox", seed=0, hidden_size=64, num_attention_heads=4)[0]  # rotates 4 of 16 dims
    exporter, why = choose_exporter(model, "auto")
    assert exporter == "dynamo" and "multiple of 8" in why and "partial rotary" in why


@pytest.mark.parametrize("family", ["mistral", "qwen3", "gemma2", "gemma3", "phi3", "gpt_neox"])
def test_standard_layout_golden_and_serving(family, models, artifacts, tmp_path):
    """The dynamo export (standard layout, the fallback) of the sliding-window families and of those the gqa
    graph was extended to: golden, and the engine's greedy tokens equal the gqa artifact's. Sliding-window
    traps it covers: the graph keeps the whole past on every layer (HF's DynamicCache(config) keeps one window
    on sliding layers), and the window follows positions, not slots (the standard runner's past has stale
    padding between a row's tokens and its new ones)."""
    model, tok = models(family)
    build_artifact(model, tok, tmp_path / "std", exporter="dynamo")
    m = _golden(model, tok, tmp_path / "std")
    assert m["golden_max_abs_error"] < 1e-4
    reqs = _requests()
    assert _engine_outputs(tmp_path / "std", reqs, max_batch_size=4) == \
        _engine_outputs(artifacts(family)[0], reqs, max_batch_size=4)


@pytest.mark.parametrize("family", FAMILIES)
def test_structured_prune_then_export(family, models, tiny_splits, tmp_path):
    from compress.prune import prune_model
    from compress.prune.structured import UnsupportedArchitectureError

    model, tok = models(family)
    cfg = PruneConfig(enabled=True, method="structured", mlp_ratio=0.5, head_ratio=0.5, layer_ratio=0.5,
                      protected_layers=[], sensitivity=False)
    if family in PRUNE_REFUSED:
        with pytest.raises(UnsupportedArchitectureError, match=model.config.model_type) as e:
            prune_model(model, tiny_splits.calib, cfg)
        assert "query_key_value" in str(e.value) and "prune.enabled=false" in str(e.value)
        return
    student, report = prune_model(model, tiny_splits.calib, cfg)
    c = student.config
    assert (c.num_hidden_layers, c.num_key_value_heads, c.intermediate_size) == (1, 1, 64)
    assert report.params_after < report.params_before
    exporter = _export(student, tok, tmp_path / "student")
    assert exporter == "gqa"
    _golden(student, tok, tmp_path / "student")


@pytest.mark.parametrize("family", FAMILIES)
def test_distillation_steps(family, models, tiny_splits, tmp_path):
    """KD from the family's teacher into a student of another seed moves it toward the teacher."""
    from compress.distill.train import distill

    teacher, _ = models(family)
    student = build_tiny(family, seed=1)[0]
    cfg = DistillConfig(enabled=True, steps=6, lr=3e-3, batch_size=4, eval_every=6, checkpoint_every=6,
                        early_stop_patience=0, warmup_steps=0, device="cpu")
    rep = distill(student, teacher, tiny_splits, cfg, tmp_path, progress=False)
    print(f"{family}: KL {rep.kl_before:.3f} -> {rep.kl_after:.3f}, top-1 {rep.top1_before:.3f} -> {rep.top1_after:.3f}")
    assert rep.steps == 6 and np.isfinite(rep.kl_after)
    assert rep.kl_after < rep.kl_before


@pytest.mark.parametrize("family", FAMILIES)
def test_static_int8(family, artifacts, tiny_splits, tmp_path):
    from compress.artifact import read_manifest
    from compress.quantize.quantizer import quantize_artifact

    folder, _ = artifacts(family)
    cfg = QuantizeConfig(enabled=True, method="static", keep_float=[], quantize_embedding=False,
                         smoothquant_alpha=0.5, calib_samples=8)
    rep = quantize_artifact(folder, tmp_path / "int8", tiny_splits.calib, cfg)
    assert read_manifest(tmp_path / "int8", verify=True)["quantization"]["method"] == "static"
    assert rep.quantized_linears >= 8 and rep.bytes_after < rep.bytes_before
    got, agree, rel = _against_fp32(folder, tmp_path / "int8", tiny_splits.selection[:4])
    print(f"{family}: int8 {rep.quantized_linears} linears, top-1 {agree:.3f}, rel err {rel:.4f}")
    assert np.isfinite(got).all() and agree > 0.85 and rel < 0.1


def _against_fp32(folder, candidate, blocks) -> tuple[np.ndarray, float, float]:
    """The candidate's prefill logits on ``blocks``, their top-1 agreement with the fp32 artifact's and the mean
    relative error."""
    from compress.evaluate.onnx_eval import prefill_logits

    ref, got = prefill_logits(folder, blocks), prefill_logits(candidate, blocks)
    return got, float((ref.argmax(-1) == got.argmax(-1)).mean()), float(np.abs(got - ref).mean() / np.abs(ref).mean())


def _requests() -> list[tuple[list[int], int]]:
    """Mixed prompt lengths (two past the sliding window) and output lengths."""
    rng = np.random.default_rng(7)
    return [(rng.integers(3, 500, size=int(n)).tolist(), int(k)) for n, k in ((5, 12), (40, 6), (23, 10), (70, 4))]


def _engine_outputs(folder, reqs, max_batch_size: int) -> list[list[int]]:
    from serve.engine.engine import Engine
    from serve.engine.sampling import SamplingParams
    from serve.runners.onnx_session import CPU

    eng = Engine(folder, ServeConfig(providers=[CPU], max_batch_size=max_batch_size, enable_prefix_caching=False,
                                     max_num_batched_tokens=64), start=False)
    handles = [eng.add_request(p, SamplingParams.greedy(n, ignore_eos=True)) for p, n in reqs]
    eng.run_until_done()
    return [h.result().output_ids for h in handles]


@pytest.mark.parametrize("family", FAMILIES)
def test_serving_batched_equals_batch_one(family, models, artifacts):
    """Greedy outputs of mixed-length requests served together (continuous batching, chunked prefill,
    prompts past the sliding window) equal each request served alone."""
    folder, _ = artifacts(family)
    model, _ = models(family)
    reqs = _requests()
    together = _engine_outputs(folder, reqs, max_batch_size=4)
    alone = [_engine_outputs(folder, [r], max_batch_size=1)[0] for r in reqs]
    assert together == alone
    assert together == [_torch_greedy(model, p, n) for p, n in reqs]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_wave_of_prompts_split_in_two_calls_equals_torch(family, models, artifacts):
    """Eight first prompts of 4 to 70 tokens in one step, run as two calls at once on the split session (cut where
    their work is even, serve/runners/gqa_split.py balanced_cut), then decoded as two halves: torch's greedy tokens."""
    from serve.engine.engine import Engine
    from serve.engine.sampling import SamplingParams
    from serve.runners.onnx_session import CPU

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the split session needs 2 cores")
    folder, _ = artifacts(family)
    model, _ = models(family)
    rng = np.random.default_rng(11)
    reqs = [(rng.integers(3, 500, size=n).tolist(), 5) for n in (4, 9, 12, 30, 6, 70, 8, 5)]
    eng = Engine(folder, ServeConfig(providers=[CPU], max_batch_size=8, enable_prefix_caching=False, prefill_chunk=0,
                                     max_num_batched_tokens=512, decode_split_rows=2), start=False)
    handles = [eng.add_request(p, SamplingParams.greedy(n, ignore_eos=True)) for p, n in reqs]
    eng.run_until_done()
    assert eng.runner.split_prompt_calls == 1 and eng.runner.split_steps > 0
    assert [h.result().output_ids for h in handles] == [_torch_greedy(model, p, n) for p, n in reqs]


@torch.no_grad()
def _torch_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy by full recomputation (no cache, EOS not suppressed, as the engine with ignore_eos)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_tiny_family_model_source(tmp_path):
    """model.source tiny-<family>[:seed] resolves to a saved HF folder of that family; a wrong one names the choices."""
    from transformers import AutoConfig

    from compress.loading.models import ModelError, resolve_source

    folder = resolve_source("tiny-gemma2:3", None, tmp_path)
    assert AutoConfig.from_pretrained(folder).model_type == "gemma2"
    assert resolve_source("tiny-gemma2:3", None, tmp_path) == folder  # saved once
    with pytest.raises(ModelError, match="gpt_neox"):
        resolve_source("tiny-gpt3", None, tmp_path)


@pytest.mark.parametrize("scales", ["channel", "tensor"])
@pytest.mark.parametrize("family", FAMILIES)
def test_int8_kv_cache(family, scales, artifacts, tiny_splits, tmp_path):
    """quantize.kv_cache int8 on every family's gqa graph (sliding windows, softcap, q/k norms, partial rotary, MHA),
    with per-channel and per-tensor scales: logits near the float32 cache's, and batched serving equal to each
    request served alone."""
    from compress.artifact import read_manifest
    from compress.quantize.quantizer import quantize_artifact

    folder, exporter = artifacts(family)
    assert exporter == "gqa"
    cfg = QuantizeConfig(enabled=True, method="weight_only", quantize_embedding=False, smoothquant_alpha=None,
                         kv_cache="int8", kv_cache_scales=scales)
    rep = quantize_artifact(folder, tmp_path / "kv8", tiny_splits.calib, cfg)
    assert read_manifest(tmp_path / "kv8", verify=True)["kv_dtype"] == "int8" and rep.settings["kv_cache_layers"] >= 2
    got, agree, rel = _against_fp32(folder, tmp_path / "kv8", tiny_splits.selection[:4])
    print(f"{family}: int8 K/V per {scales} (and weight-only int8) against fp32: top-1 {agree:.3f}, rel err {rel:.4f}, "
          f"K evened out in {rep.settings['kv_cache_equalized_layers']} of {rep.settings['kv_cache_layers']} layers")
    assert np.isfinite(got).all() and agree > 0.85 and rel < 0.1
    reqs = _requests()
    together = _engine_outputs(tmp_path / "kv8", reqs, max_batch_size=4)
    assert together == [_engine_outputs(tmp_path / "kv8", [r], max_batch_size=1)[0] for r in reqs]


@pytest.mark.parametrize("family", FAMILIES)
def test_key_equalization_keeps_the_float_model(family, artifacts, tiny_splits, tmp_path):
    """K's channels evened out for a per-tensor int8 cache (compress/quantize/kv_equalize.py): wherever Q and K come
    straight from products (packed or apart, with a bias, partial or full rotary) the logits stay bit for bit; the
    families with q/k norms are left as they are."""
    from key_spread import equalized_copy

    from compress.drivers import load_lm

    folder, _ = artifacts(family)
    out = tmp_path / "eq"
    n, absmax, _, _ = equalized_copy(folder, tiny_splits.calib[:2], out)
    assert n == (0 if family in ("qwen3", "gemma3") else sum(k.endswith(".key") for k in absmax))
    ids = [int(t) for t in tiny_splits.selection[0][:40]]
    assert np.array_equal(load_lm(folder, verify=False).prefill(ids)[0], load_lm(out, verify=False).prefill(ids)[0])


def _chat_like_prompts(n: int = 12, seed: int = 13) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=int(k)).tolist() for k in rng.integers(2, 70, size=n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_generation_and_scoring_equal_one_prompt_at_a_time(family, artifacts):
    """The pipeline's evaluation path (compress/evaluate/generate.py, chat.score_answers) against the batch-1 loop it
    replaced: every prompt's greedy tokens equal LanguageModelDriver.greedy's, with the EOS rule and with ids
    suppressed; the batched NLL and argmax of each answer equal scoring it alone."""
    from compress.drivers import load_lm
    from compress.evaluate.chat import score_answer, score_answers
    from compress.evaluate.generate import greedy_answers

    folder, _ = artifacts(family)
    lm = load_lm(folder, verify=False)
    prompts = _chat_like_prompts()
    eos = [int(e) for e in lm.manifest.get("eos_token_ids") or []]
    gen = greedy_answers(folder, prompts, 10, progress=False)
    assert gen.rows == len(prompts) and gen.tokens == sum(len(a) for a in gen.answers) > 0
    assert gen.answers == [lm.greedy(p, 10, eos_ids=eos) for p in prompts]
    # A budget for a single row: the prompts wait for it one by one, the tokens are the same.
    assert greedy_answers(folder, prompts[:3], 10, progress=False, kv_budget_mb=1).answers == gen.answers[:3]
    held = sorted({a[0] for a in gen.answers})[:2]
    suppressed = greedy_answers(folder, prompts, 6, suppress_ids=held, progress=False).answers
    assert suppressed == [lm.greedy(p, 6, suppress_ids=held) for p in prompts]
    assert all(len(a) == 6 and not set(a) & set(held) for a in suppressed)
    answers = [a if i % 5 else [] for i, a in enumerate(gen.answers)]  # an empty answer scores nothing
    batched = score_answers(lm, prompts, answers)
    for p, a, (nll, am) in zip(prompts, answers, batched):
        want_nll, want_am = score_answer(lm, p, a)
        assert nll == pytest.approx(want_nll, rel=1e-5, abs=1e-4)
        assert am.tolist() == want_am.tolist()
    assert batched[0][1].size == 0 and sum(am.size for _, am in batched) == sum(len(a) for a in answers)


def test_batched_generation_on_the_standard_layout_with_rows_to_spare_or_not(tiny_artifact):
    """The standard layout (past in, present out: its rows take twice the K/V) through the evaluation's engine, with
    room for all prompts and for a few at a time (the rest wait for a row): the batch-1 loop's tokens."""
    from compress.drivers import load_lm
    from compress.evaluate.generate import greedy_answers

    lm = load_lm(tiny_artifact, verify=False)
    assert lm.layout == "standard"
    prompts = _chat_like_prompts(24, seed=3)
    want = [lm.greedy(p, 8, eos_ids=[int(e) for e in lm.manifest.get("eos_token_ids") or []]) for p in prompts]
    every = greedy_answers(tiny_artifact, prompts, 8, progress=False)
    assert every.rows == 24 and every.answers == want
    few = greedy_answers(tiny_artifact, prompts, 8, progress=False, kv_budget_mb=1)
    assert 1 <= few.rows < 24 and few.answers == want


def _spec_outputs(folder, reqs, speculative: str):
    """Greedy outputs with speculation on (4 rows may draft, blocks of 4 tokens so drafts cross block boundaries),
    the engine's invariants checked after every step; (outputs, stats)."""
    from serve.engine.engine import Engine
    from serve.engine.sampling import SamplingParams
    from serve.runners.onnx_session import CPU

    eng = Engine(folder, ServeConfig(providers=[CPU], max_batch_size=4, enable_prefix_caching=False,
                                     max_num_batched_tokens=64, kv_block_size=4, speculative=speculative,
                                     speculative_max_rows=4), start=False)
    handles = [eng.add_request(p, SamplingParams.greedy(n, ignore_eos=True)) for p, n in reqs]
    while eng.has_work():
        eng.step()
        eng.check_invariants()
    stats = eng.stats()
    eng.shutdown()
    return [h.result().output_ids for h in handles], stats


@pytest.mark.parametrize("family", FAMILIES)
def test_speculation_keeps_greedy_tokens(family, artifacts, tiny_gqa):
    """Drafted tokens checked in one forward leave greedy outputs token for token as without speculation, with drafts
    from the prompt (prompt lookup) and from a draft model: the family's own graph (every draft stands) and the tiny
    Llama (a stranger: most are rejected, so rejected K/V is rolled back); invariants hold after every step."""
    folder, _ = artifacts(family)
    rng = np.random.default_rng(3)
    loop = rng.integers(3, 500, size=9).tolist()
    reqs = [*_requests(), (loop * 3, 16)]  # a prompt that repeats itself: prompt lookup finds its drafts there
    want = _engine_outputs(folder, reqs, max_batch_size=4)
    accepted = {}
    for spec in ("prompt_lookup", str(folder), str(tiny_gqa)):
        got, st = _spec_outputs(folder, reqs, spec)
        assert got == want, spec
        assert st.spec_draft_tokens > 0, spec
        accepted[spec] = st.spec_accepted_tokens / st.spec_draft_tokens
    assert accepted[str(folder)] == 1.0  # its own greedy drafts always stand
    assert accepted[str(tiny_gqa)] < 1.0 or family == "llama"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pipeline_built_draft_head_keeps_greedy_tokens(family, artifacts, tmp_path):
    """The draft stage's head (compress/draft/stage.py) built on the family's own graph from its own answers: greedy
    outputs token for token as without it while it drafts (how many stand depends on how predictable a random tiny
    model's answers are: tests/test_draft_head.py measures that on the tiny Llama)."""
    from compress.draft.settings import DraftConfig
    from compress.draft.stage import DraftError, build_drafter

    folder, exporter = artifacts(family)
    settings = DraftConfig(enabled=True, prompts=12, max_tokens=16, users=4, vocab=128, width=64, steps=3,
                           tokens=256 * 30, held_out=0.2)
    if exporter != "gqa":  # a head reads the hidden state that only gqa graphs output
        with pytest.raises(DraftError, match="attention layout"):
            build_drafter(folder, tmp_path / "head", settings, progress=False)
        return
    head = build_drafter(folder, tmp_path / "head", settings, progress=False).path
    reqs = _requests()
    want = _engine_outputs(folder, reqs, max_batch_size=4)
    got, st = _spec_outputs(folder, reqs, str(head))
    assert got == want
    assert st.spec_draft_tokens > 0
