"""Speculative decoding (serve/engine/speculative.py, drafter.py, draft_model.py): the acceptance rule keeps the
target's distribution, greedy outputs do not change, rejected drafts give their K/V and blocks back (at block
boundaries, under preemption), the back-off under load, config errors, and the server's API and metrics.

Greedy equality on every tiny family is in tests/test_architectures.py (test_speculation_keeps_greedy_tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from serve.config import ConfigError, ServeConfig
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.engine.speculative import DraftLength, accept_drafts, prompt_lookup
from serve.runners.onnx_session import CPU

pytestmark = pytest.mark.timeout(300)


def cfg(**kw) -> ServeConfig:
    return ServeConfig(**{"providers": [CPU], "kv_memory_mb": 8, "enable_prefix_caching": False, **kw})


def run(folder, reqs, check=True, **kw):
    """Greedy outputs of (prompt ids, max tokens) requests served together; invariants after every step."""
    eng = Engine(folder, cfg(**kw), start=False)
    handles = [eng.add_request(p, SamplingParams.greedy(n, ignore_eos=True)) for p, n in reqs]
    while eng.has_work():
        eng.step()
        if check:
            eng.check_invariants()
    out = [h.result().output_ids for h in handles]
    return out, eng


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    seq = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 2, 6, 7]
    assert prompt_lookup(seq, 2, max_ngram=2) == [3, 4]  # "6 7" last seen before 3 4
    assert prompt_lookup(seq, 9, max_ngram=2) == [3, 4, 2, 6, 7]  # up to the end of what is known
    assert prompt_lookup([1, 2, 3, 9, 2, 3], 3, max_ngram=3) == [9, 2, 3]  # the 2-gram "2 3"; the 3-gram never occurs
    assert prompt_lookup([1, 2, 3], 3) == []
    assert prompt_lookup([4, 4], 2) == [4]
    assert prompt_lookup([1, 2, 1], 0) == []


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
def test_the_acceptance_rule_keeps_the_target_distribution(params):
    """Two drafts on a 5-token vocabulary, 40,000 checks: the first token is distributed as the target's p1 (whether
    the draft stood or a replacement was drawn), and after the first draft stood, the second token as p2."""
    from serve.engine.sampling import process_logits, token_distribution

    logits = np.array([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.5, 1.4, -0.5, 0.3], [1.0, 1.0, 1.0, 1.0, 1.0]], np.float32)
    drafts = [1, 2]

    def dist(row):
        cand, p = token_distribution(process_logits(logits[row], params), params)
        full = np.zeros(5)
        full[cand] = p
        return full

    rng = np.random.default_rng(0)
    n = 40_000
    first, second = np.zeros(5), np.zeros(5)
    lengths = np.zeros(4, int)
    for _ in range(n):
        toks = accept_drafts(logits, drafts, params, rng, [0], 1)
        lengths[len(toks)] += 1
        first[toks[0]] += 1
        if toks[0] == drafts[0]:
            second[toks[1]] += 1
    p1, p2 = dist(0), dist(1)
    assert np.abs(first / n - p1).max() < 0.01, (first / n, p1)
    assert np.abs(second / second.sum() - p2).max() < 0.015, (second / second.sum(), p2)
    # how many tokens a check yields: 1 when the first draft falls, 3 when both stand
    assert lengths[1] / n == pytest.approx(1 - p1[1], abs=0.01)
    assert lengths[3] / n == pytest.approx(p1[1] * p2[2], abs=0.01)


def test_greedy_checks_keep_a_draft_only_where_it_is_the_argmax():
    lg = np.array([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]], np.float32)
    p = SamplingParams.greedy()
    assert accept_drafts(lg, [1, 0], p, None, [2], 1) == [1, 0, 2]  # both stand, then the argmax after them
    assert accept_drafts(lg, [1, 2], p, None, [2], 1) == [1, 0]  # the second falls: the argmax replaces it
    assert accept_drafts(lg, [2, 0], p, None, [2], 1) == [1]
    # penalties see the drafts accepted before them: with repetition_penalty, token 1 just drafted is discouraged
    lg2 = np.array([[0.0, 3.0, 1.0], [0.0, 2.0, 1.9], [0.0, 0.0, 0.0]], np.float32)
    assert accept_drafts(lg2, [1, 1], SamplingParams.greedy(repetition_penalty=2.0), None, [0], 1) == [1, 2]


def test_draft_length_grows_shrinks_and_pauses():
    d = DraftLength(6)
    assert d.want() == 6
    d.update(6, 6)
    assert d.k == 6
    d.update(6, 2)
    assert d.k == 5
    for _ in range(6):  # drafts keep failing: the moving average falls under MIN_RATE and drafting pauses
        d.update(d.k, 0)
        if d.pause:
            break
    assert d.pause == 4 and d.k == 1
    assert [d.want() for _ in range(5)] == [0, 0, 0, 0, 1]  # four steps without drafts, then a probe of one
    d.update(1, 0)
    assert d.pause == 8  # the next pause doubles
    d.want()
    for _ in range(8):
        d.want()
    d.update(1, 1)
    assert d.k == 3 and d.next_pause == 4


@pytest.mark.parametrize("layout", ["gqa", "standard"])
def test_rejected_drafts_give_back_blocks_at_boundaries_and_under_preemption(layout, tiny_gqa, tiny_artifact):
    """A stranger draft model (the tiny Llama of seed 1) on blocks of 4 tokens and a pool so small that sequences are
    preempted: greedy outputs equal the run without drafts, the block invariants hold after every step, rejected
    drafts past a block boundary gave their block back, and sequences preempted after drafting recomputed."""
    from compress.export.gqa import build_gqa_artifact
    from compress.loading.tiny import build_tiny_llama

    folder = tiny_gqa if layout == "gqa" else tiny_artifact
    stranger = tiny_gqa.parent.parent / "stranger"
    if not (stranger / "manifest.json").is_file():
        m, t = build_tiny_llama(seed=1)
        build_gqa_artifact(m, t, stranger)
    rng = np.random.default_rng(11)
    reqs = [(rng.integers(3, 500, size=int(n)).tolist(), 40) for n in (6, 9, 13, 7)]
    # the pool, not the rows, is what runs short (kv_rows_share 0.8: the rows hold 4x the pool)
    small = dict(kv_block_size=4, num_blocks=30, kv_rows_share=0.8, max_batch_size=4, max_num_batched_tokens=32)
    want, plain = run(folder, reqs, **small)
    assert plain.scheduler.num_preemptions > 0
    released = []
    from serve.engine import scheduler as sched

    orig = sched.Scheduler.commit_drafted

    def tapped(self, row, accepted):
        before = len(self.bm.block_table(row.seq))
        orig(self, row, accepted)
        released.append((before - len(self.bm.block_table(row.seq)), len(row.drafts) - accepted))
    sched.Scheduler.commit_drafted = tapped
    try:
        got, eng = run(folder, reqs, speculative=str(stranger), speculative_max_rows=4, speculative_tokens=4, **small)
    finally:
        sched.Scheduler.commit_drafted = orig
    assert got == want
    st = eng.stats()
    assert st.spec_draft_tokens > st.spec_accepted_tokens > 0 or st.spec_accepted_tokens == 0
    assert any(freed > 0 for freed, rejected in released), "no rejected draft crossed a block boundary"
    assert all(rejected > 0 for freed, rejected in released if freed > 0)
    assert eng.scheduler.num_preemptions > 0
    assert eng.block_manager.num_used == 0 and eng.drafter.model.bm.num_used == 0  # everything went back
    eng.shutdown()


def test_speculation_backs_off_in_steps_with_more_rows(tiny_gqa):
    """speculative_max_rows 1: while three requests decode together nobody drafts; the last one left does."""
    from serve.engine import drafter as dr

    rows_when_drafting = []
    orig = dr.Drafter.candidates

    def tapped(self, rows, max_model_len):
        out = orig(self, rows, max_model_len)
        if out:
            rows_when_drafting.append(len(rows))
        return out
    dr.Drafter.candidates = tapped
    loop = [7, 8, 9, 10] * 4
    try:
        got, eng = run(tiny_gqa, [(loop, 8), (loop[1:], 12), (loop[2:], 40)], speculative="prompt_lookup",
                       speculative_max_rows=1, max_batch_size=4)
    finally:
        dr.Drafter.candidates = orig
    want, _ = run(tiny_gqa, [(loop, 8), (loop[1:], 12), (loop[2:], 40)], max_batch_size=4)
    assert got == want
    assert rows_when_drafting and set(rows_when_drafting) == {1}
    eng.shutdown()


def test_seeded_sampling_with_drafts_repeats_itself(tiny_gqa):
    """A seeded sampled request gives the same tokens twice with speculation on (the checks draw from the request's
    own generator, in a fixed order)."""
    outs = []
    for _ in range(2):
        eng = Engine(tiny_gqa, cfg(speculative="prompt_lookup"), start=False)
        h = eng.add_request([5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=30, temperature=0.5, top_k=3, seed=4,
                                                                       ignore_eos=True))
        eng.run_until_done()
        outs.append(h.result().output_ids)
        assert eng.stats().spec_draft_tokens > 0
        eng.shutdown()
    assert outs[0] == outs[1] and len(outs[0]) == 30


def test_a_draft_that_is_no_artifact_or_has_another_tokenizer_is_refused(tiny_gqa, tmp_path):
    from compress.export.gqa import build_gqa_artifact
    from compress.loading.tiny import build_tiny_tokenizer, tiny_llama_config
    from transformers import LlamaForCausalLM

    with pytest.raises(ConfigError, match="serve.speculative.*neither 'off', 'prompt_lookup' nor an artifact"):
        Engine(tiny_gqa, cfg(speculative=str(tmp_path / "nowhere")), start=False)
    tok = build_tiny_tokenizer(vocab_size=300)
    other = LlamaForCausalLM(tiny_llama_config(len(tok)))
    build_gqa_artifact(other.eval(), tok, tmp_path / "other")
    with pytest.raises(ConfigError, match="another tokenizer than the served model"):
        Engine(tiny_gqa, cfg(speculative=str(tmp_path / "other")), start=False)


def test_uniform_kernels_make_drafted_checks_compute_as_decode_steps(tmp_path, tiny_splits):
    """A 4-bit graph (MatMulNBits rounds its inputs to int8): with serve.uniform_kernels a lone decode step runs the
    multi-row kernels a drafted check runs, so the logits of one position are bit for bit the same either way and
    greedy text with drafts equals text without; the one-row kernel's logits are compared too (printed)."""
    from compress.export.gqa import build_gqa_artifact
    from compress.export.weights import int4_plan
    from compress.loading.tiny import build_tiny_llama
    from serve.engine import engine as engine_mod

    model, tok = build_tiny_llama(seed=0, hidden_size=128, intermediate_size=256)
    build_gqa_artifact(model, tok, tmp_path / "a", int8=(32, 4), int4=int4_plan(model, 32, False, 0.0))
    loop = [9, 10, 11, 12, 13] * 3
    reqs = [(loop, 40), (tiny_splits.test[0][:12].tolist(), 40)]
    seen: dict[str, dict[int, np.ndarray]] = {}

    def tap_logits(name):
        store = seen.setdefault(name, {})
        sample, accept = engine_mod.sample_token, engine_mod.accept_drafts

        def s(lg, params, rng, token_ids, *a, **k):
            store.setdefault(len(token_ids), np.array(lg))
            return sample(lg, params, rng, token_ids, *a, **k)

        def c(lg, drafts, params, rng, token_ids, *a, **k):
            toks = accept(lg, drafts, params, rng, token_ids, *a, **k)
            for i in range(len(toks)):  # the positions whose context stood (after a rejection it was a wrong draft)
                store.setdefault(len(token_ids) + i, np.array(lg[i]))
            return toks
        return s, c

    results = {}
    for name, kw in {"plain": {}, "uniform": {"uniform_kernels": True},
                     "drafts": {"uniform_kernels": True, "speculative": "prompt_lookup"}}.items():
        s, c = tap_logits(name)
        orig = engine_mod.sample_token, engine_mod.accept_drafts
        engine_mod.sample_token, engine_mod.accept_drafts = s, c
        try:
            results[name], eng = run(tmp_path / "a", reqs[:1], max_batch_size=1, **kw)
        finally:
            engine_mod.sample_token, engine_mod.accept_drafts = orig
        eng.shutdown()
    assert results["drafts"] == results["uniform"]
    common = sorted(set(seen["uniform"]) & set(seen["drafts"]))
    assert len(common) > 30
    assert max(np.abs(seen["uniform"][p] - seen["drafts"][p]).max() for p in common) == 0.0
    one_row = max(np.abs(seen["plain"][p] - seen["uniform"][p]).max() for p in common if p in seen["plain"])
    print(f"\none-row kernel vs multi-row kernels, max |logit difference|: {one_row:.2e}")


def test_the_server_streams_the_same_text_and_reports_the_drafts(tiny_gqa):
    """openai SDK against a server with prompt lookup on: streamed greedy text equals the engine's without drafts,
    the API is unchanged, and /metrics carries vLLM's spec-decode counters and the acceptance rate."""
    import httpx
    import openai

    from serve.api.app import create_app
    from serve.api.background import BackgroundServer

    prompt = "a b c d a b c d a b c d a b"
    plain = Engine(tiny_gqa, cfg(), start=False)
    want = plain.tokenizer.decode(plain.generate(prompt, SamplingParams.greedy(24, ignore_eos=True)))
    plain.shutdown()
    app = create_app(str(tiny_gqa), cfg(speculative="prompt_lookup", result_cache_size=0), served_name="tiny")
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == want and chunks[-1].choices[0].finish_reason == "length"
        metrics = httpx.get(srv.url + "/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith(("vllm:spec_decode", "compressor:spec_decode"))}
    drafts, proposed = values["vllm:spec_decode_num_drafts_total"], values["vllm:spec_decode_num_draft_tokens_total"]
    accepted = values["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and proposed >= drafts and 0 < accepted <= proposed
    assert values["compressor:spec_decode_acceptance_rate"] == pytest.approx(accepted / proposed)
    assert values["compressor:spec_decode_tokens_per_check"] == pytest.approx((accepted + drafts) / drafts)


def test_the_speculative_docs_name_keys_commands_and_paths_that_exist():
    """docs/serving.md "Speculative decoding": its serve.* keys, metrics, result files and benchmark flags exist."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from serve.api.metrics import _ENGINE_COUNTERS

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs/serving.md").read_text()
    section = text[text.index("## Speculative decoding"):text.index("## Throughput")]
    names = {" ".join(n.split()) for n in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", section, flags=re.S))}
    keys = {n.split("=")[0].split(":")[0] for n in names if n.startswith("serve.")}
    assert {"serve.speculative", "serve.speculative_tokens", "serve.speculative_max_rows", "serve.uniform_kernels",
            "serve.speculative_ngram", "serve.speculative_draft_kv_mb"} <= keys
    for key in keys:
        assert key.split(".")[1] in ServeConfig.model_fields, key
    counters = {name for name, _, _ in _ENGINE_COUNTERS}
    for metric in (n for n in names if n.startswith("vllm:spec")):
        assert metric in counters, metric
    for path in (n for n in names if n.startswith("benchmarks/results/")):
        assert (root / path).is_file(), path
    help_text = subprocess.run([sys.executable, "-m", "benchmarks.speculative", "--help"], cwd=root,
                               capture_output=True, text=True, check=True).stdout
    commands = [n for n in names if n.startswith("python -m benchmarks.speculative")]
    assert len(commands) >= 2
    for flag in set(re.findall(r"--[a-z][a-z-]+", " ".join(commands))):
        assert flag in help_text, flag
    assert ".venv/bin/compressor serve --model models:/smollm2-135m@champion --set serve.speculative=prompt_lookup" \
        in section  # the serve command's flags are the README's (tests/test_docs.py)


def test_a_failing_draft_model_leaves_the_step_without_drafts(tiny_gqa):
    """The draft model's forward raising: the step runs without drafts, the output is unchanged and the draft's
    half-written state for the request is dropped."""
    eng = Engine(tiny_gqa, cfg(speculative=str(tiny_gqa)), start=False)
    model = eng.drafter.model
    calls = {"n": 0}
    orig = model.runner.execute

    def flaky(rows):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("draft forward failed")
        return orig(rows)
    model.runner.execute = flaky
    got = eng.generate([5, 6, 7, 8], SamplingParams.greedy(20, ignore_eos=True))
    eng.check_invariants()
    plain = Engine(tiny_gqa, cfg(), start=False)
    assert got == plain.generate([5, 6, 7, 8], SamplingParams.greedy(20, ignore_eos=True))
    assert calls["n"] > 3 and eng.stats().spec_accepted_tokens > 0
    assert model.bm.num_used == 0
    eng.shutdown()
    plain.shutdown()
