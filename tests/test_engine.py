"""The engine end to end on the tiny model artifact: batching exactness, prefix cache, preemption, cancel,
sampling, stop conditions, admission errors, streaming, stats."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingError, SamplingParams
from serve.engine.scheduler import AdmissionError, QueueFullError, RequestTooLargeError
from serve.runners.onnx_session import CPU, choose_providers
from step_gate import held_steps, seen_cancels

SPECIAL = 3  # ids 0..2 are the tiny tokenizer's special tokens


def engine(art, start=False, **cfg) -> Engine:
    cfg.setdefault("providers", [CPU])
    return Engine(art, ServeConfig(**cfg), start=start)


def random_prompts(n, lo, hi, seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    return [rng.integers(SPECIAL, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


class LogitTap:
    """Records the logits the engine samples from, keyed by the context (prompt + tokens so far).

    The tiny random model soon repeats one token, so equal tokens alone would hide K/V
    mistakes; equal logits at every step do not.
    """

    def __init__(self):
        self.rows: dict[tuple, np.ndarray] = {}

    def __enter__(self):
        import serve.engine.engine as mod

        self._mod, self._orig = mod, mod.sample_token

        def tapped(logits, params, rng, token_ids=(), *rest):
            self.rows[tuple(token_ids)] = np.array(logits, dtype=np.float32, copy=True)
            return self._orig(logits, params, rng, token_ids, *rest)

        mod.sample_token = tapped
        return self

    def __exit__(self, *exc):
        self._mod.sample_token = self._orig


class Solo:
    """Runs one request at a time (batch 1, no prefix cache): the reference for every batching test."""

    def __init__(self, art):
        self.eng = engine(art, enable_prefix_caching=False)
        self.cache: dict = {}
        self.logits: dict[tuple, np.ndarray] = {}

    def __call__(self, prompt, params):
        key = (tuple(prompt), repr(params))
        if key not in self.cache:
            assert not self.eng.has_work()
            with LogitTap() as tap:
                self.cache[key] = self.eng.generate(prompt, params)
            self.logits.update(tap.rows)
        return self.cache[key]

    def assert_same_logits(self, tap: LogitTap, atol=1e-4):
        assert tap.rows
        worst = 0.0
        for ctx, lg in tap.rows.items():
            ref = self.logits.get(ctx)
            assert ref is not None, "a context the batch-1 run never saw"
            worst = max(worst, float(np.abs(lg - ref).max()))
        print(f"max |logits - batch-1 logits| over {len(tap.rows)} steps: {worst:.2e}")
        assert worst <= atol, f"logits differ from batch-1 by up to {worst}"
        return worst


@pytest.fixture(scope="module")
def solo(tiny_artifact):
    return Solo(tiny_artifact)


def check_clean(eng: Engine):
    bm = eng.block_manager
    bm.check_invariants()
    assert bm.num_used == 0, "blocks still held after every request ended"
    assert bm.num_used + bm.num_free == bm.num_blocks
    assert not eng.has_work()
    eng.check_invariants()


def test_invariants_hold_between_steps(tiny_artifact):
    """Engine, request and counter invariants after every step, with stop strings holding text back."""
    eng = engine(tiny_artifact, max_batch_size=4, max_num_batched_tokens=24)
    handles = [eng.add_request(p, SamplingParams.greedy(12, ignore_eos=True, stop=["\x00never", "zz"]))
               for p in random_prompts(6, 4, 20, seed=5)]
    while eng.has_work():
        eng.step()
        eng.check_invariants()
    assert all(h.finished for h in handles)
    st = eng.stats()
    assert st.requests_added == st.requests_finished == 6 and st.generated_tokens == sum(
        len(h.output_ids) for h in handles)
    check_clean(eng)


def test_a_dropped_engine_frees_its_model_at_once(tiny_artifact, tiny_gqa):
    """No reference cycle keeps an engine (and its session's weights) alive after its last reference goes: the
    pipeline's evaluation makes one engine per model and loads the next right after (compress/evaluate/generate.py)."""
    import gc
    import weakref

    gc.disable()  # only reference counting may free it
    try:
        for art in (tiny_artifact, tiny_gqa):
            eng = engine(art)
            h = eng.add_request([5, 6, 7], SamplingParams.greedy(4))
            eng.run_until_done()
            assert h.result().finish_reason in ("stop", "length")
            refs = [weakref.ref(eng), weakref.ref(eng.runner)]
            eng.shutdown()
            del eng, h
            assert [r() for r in refs] == [None, None], f"{art.name}: the engine outlived its last reference"
    finally:
        gc.enable()


def test_every_runner_implements_the_whole_runner_protocol(tiny_artifact):
    """The engine calls its runner through serve.runners.protocol.ModelRunner without probing: every runner class
    defines every method of it, and a live runner has every attribute, with the KV figures the engine reports."""
    import inspect
    import typing

    from serve.runners.gqa import GqaRunner
    from serve.runners.protocol import ModelRunner
    from serve.runners.standard import Runner

    methods = [n for n, v in vars(ModelRunner).items() if inspect.isfunction(v) and not n.startswith("_")]
    attrs = list(typing.get_type_hints(ModelRunner))
    assert {"execute", "kv_bytes", "kv_budget_bytes", "trim"} <= set(methods) and "provider" in attrs
    for cls in (Runner, GqaRunner):
        for name in methods:
            own = getattr(cls, name, None)
            assert callable(own) and own is not getattr(ModelRunner, name), f"{cls.__name__} lacks {name}()"
    eng = engine(tiny_artifact, kv_memory_mb=1)
    assert isinstance(eng.runner, ModelRunner) and all(hasattr(eng.runner, a) for a in attrs)
    assert eng.kv_budget_bytes() == eng.runner.kv_budget_bytes() > eng.runner.pool.nbytes > 0
    assert eng.kv_bytes() == eng.runner.pool.nbytes  # nothing ran: no past buffers yet


def test_greedy_matches_a_plain_torch_loop(tiny, tiny_artifact):
    """The runner (gather, masks, positions, scatter) computes what the model computes."""
    import torch

    model, _ = tiny
    eng = engine(tiny_artifact, kv_block_size=4, max_num_batched_tokens=8)  # small blocks and chunks: many gathers
    for prompt in random_prompts(3, 5, 21, seed=1):
        ids = list(prompt)
        ref = {}
        with torch.no_grad():
            for _ in range(12):
                logits = model(torch.tensor([ids])).logits[0, -1]
                ref[tuple(ids)] = logits.numpy()
                ids.append(int(torch.argmax(logits)))
        want = ids[len(prompt):]
        with LogitTap() as tap:
            got = eng.generate(prompt, SamplingParams.greedy(12, ignore_eos=True))
        assert got == want
        assert tap.rows.keys() == ref.keys()
        for ctx, lg in tap.rows.items():
            np.testing.assert_allclose(lg, ref[ctx], atol=2e-3, rtol=0)
    check_clean(eng)


def test_continuous_batching_equals_batch_one(tiny_artifact, solo):
    """>= 16 requests with different prompt lengths and max_tokens, joining and leaving at different steps."""
    prompts = random_prompts(20, 1, 70, seed=2)
    rng = np.random.default_rng(3)
    params = [SamplingParams.greedy(int(rng.integers(1, 40))) for _ in prompts]
    eng = engine(tiny_artifact, enable_prefix_caching=False, max_batch_size=8, max_num_batched_tokens=48)
    handles = []
    sizes = []
    waves = [(0, 5), (5, 9), (9, 14), (14, 20)]
    with LogitTap() as tap:
        for w, (a, b) in enumerate(waves):
            handles += [eng.add_request(p, sp) for p, sp in zip(prompts[a:b], params[a:b])]
            for _ in range(3 + 2 * w):
                sizes.append(eng.step())
        while eng.has_work():
            sizes.append(eng.step())
    outs = [h.result().output_ids for h in handles]
    for p, sp, got in zip(prompts, params, outs):
        assert got == solo(p, sp)
    solo.assert_same_logits(tap)
    assert max(sizes) == 8, "the batch never filled"
    assert len({tuple(o) for o in outs if len(o) > 3}) > 10, "outputs are suspiciously alike"
    assert {h.finish_reason for h in handles} <= {"stop", "length"}
    st = eng.stats()
    assert st.batch_fill_ratio > 0.4 and st.requests_finished == 20 and st.preemptions == 0
    check_clean(eng)


def test_background_thread_and_async_streams(tiny_artifact, solo):
    prompts = random_prompts(16, 2, 40, seed=4)
    params = [SamplingParams.greedy(5 + i % 7) for i in range(16)]
    with engine(tiny_artifact, start=True, max_batch_size=16) as eng:

        async def consume(p, sp):
            h = eng.add_request(p, sp)
            events = [ev async for ev in h]
            return h, events

        async def main():
            return await asyncio.gather(*(consume(p, sp) for p, sp in zip(prompts, params)))

        with LogitTap() as tap:
            results = asyncio.run(main())
        for (h, events), p, sp in zip(results, prompts, params):
            ids = [ev.token_id for ev in events]
            assert ids == solo(p, sp) == h.output_ids
            assert [ev.index for ev in events] == list(range(1, len(ids) + 1))
            assert events[-1].finished and not any(ev.finished for ev in events[:-1])
            assert "".join(ev.text for ev in events) == h.text
            assert h.text == eng.tokenizer.decode(h.output_ids, skip_special_tokens=True)
            assert h.ttft_s is not None and h.ttft_s >= 0
        solo.assert_same_logits(tap)
        # blocking iteration from plain threads too
        out = {}

        def worker(i):
            out[i] = [ev.token_id for ev in eng.add_request(prompts[i], params[i])]

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(out[i] == solo(prompts[i], params[i]) for i in range(8))
        st = eng.stats()
        assert len(st.ttft_s) == 24 and len(st.itl_s) > 0
        ttft, itl = eng.pop_latency_samples()
        assert len(ttft) == 24 and eng.pop_latency_samples() == ([], [])
    check_clean(eng)


def test_shared_prefix_hits_the_cache_and_matches_a_cold_run(tiny_artifact, solo):
    shared = random_prompts(1, 53, 53, seed=5)[0]  # 3 full blocks of 16 + 5
    a = shared + [7, 8, 9]
    b = shared + [11, 12, 13, 14]
    params = SamplingParams.greedy(20)
    eng = engine(tiny_artifact)
    assert eng.generate(a, params) == solo(a, params)
    hits = eng.stats().prefix_hits
    hb = eng.add_request(b, params)
    with LogitTap() as tap:
        eng.run_until_done()
    solo(b, params)
    solo.assert_same_logits(tap)
    assert eng.stats().prefix_hits - hits == 48  # 3 full blocks reused
    assert hb.num_cached_prompt_tokens == 48
    assert hb.output_ids == solo(b, params)
    # while the first one still runs (blocks in use, ref count 2)
    h1 = eng.add_request(a + [1, 2], params)
    eng.step()
    eng.step()
    h2 = eng.add_request(a + [3], params)
    eng.step()
    shared_blocks = eng.block_manager.block_table(eng._reqs[h2.request_id].seq)[:3]
    assert all(eng.block_manager.ref_count(bk) == 2 for bk in shared_blocks)
    eng.run_until_done()
    assert h1.output_ids == solo(a + [1, 2], params) and h2.output_ids == solo(a + [3], params)
    st = eng.stats()
    assert st.prefix_hits > 0 and st.prefix_queries >= st.prefix_hits and st.kv_blocks_cached > 0
    check_clean(eng)


def test_preemption_in_a_tiny_pool_gives_identical_outputs(tiny_artifact, solo):
    prompts = random_prompts(16, 10, 40, seed=6)
    rng = np.random.default_rng(7)
    params = [SamplingParams.greedy(int(rng.integers(10, 30)), ignore_eos=True) for _ in prompts]
    # 12 blocks x 8 tokens = 96 token slots; 16 requests need up to 70 each
    # kv_rows_share 0.8: the past buffers are not what this test squeezes (12 blocks, 96 tokens, are)
    eng = engine(tiny_artifact, num_blocks=12, kv_block_size=8, max_batch_size=16, max_num_batched_tokens=64,
                 kv_rows_share=0.8)
    handles = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps = 0
    with LogitTap() as tap:
        while eng.has_work():
            eng.step()
            eng.block_manager.check_invariants()
            steps += 1
            assert steps < 5000
    st = eng.stats()
    assert st.preemptions > 0
    assert sum(h.num_preemptions for h in handles) == st.preemptions
    for h, p, sp in zip(handles, prompts, params):
        assert h.finish_reason == "length"
        assert h.output_ids == solo(p, sp)
    solo.assert_same_logits(tap)
    check_clean(eng)


def test_cancel_returns_blocks(tiny_artifact):
    eng = engine(tiny_artifact, max_batch_size=1)
    p1, p2 = random_prompts(2, 30, 30, seed=8)
    h1 = eng.add_request(p1, SamplingParams.greedy(300, ignore_eos=True))
    h2 = eng.add_request(p2, SamplingParams.greedy(10))  # waits: batch size 1
    for _ in range(5):
        eng.step()
    assert eng.block_manager.num_used > 0 and len(h1.output_ids) == 5
    h1.cancel()  # engine idle between steps: applied at once
    assert h1.finished and h1.finish_reason == "cancelled"
    assert eng.block_manager.num_used == 0
    h2.cancel()  # a waiting request
    assert h2.finish_reason == "cancelled" and h2.output_ids == []
    events = list(h1)
    assert events[-1].finish_reason == "cancelled" and events[-1].token_id is None
    check_clean(eng)
    assert eng.stats().finish_reasons == {"cancelled": 2}


def test_cancel_while_the_thread_runs(tiny_artifact):
    with engine(tiny_artifact, start=True) as eng:
        # Steps after the first wait until the cancel is in: 400 tokens take a fraction of a second, so
        # a loaded machine could otherwise run them all before this thread calls cancel().
        with held_steps(eng, after=1):
            h = eng.add_request(random_prompts(1, 20, 20, seed=9)[0], SamplingParams.greedy(400, ignore_eos=True))
            it = iter(h)
            first = next(it)
            assert first.token_id is not None
            h.cancel()
        rest = list(it)
        assert rest[-1].finish_reason == "cancelled"
        assert len(h.output_ids) < 400
        assert eng.block_manager.num_used == 0  # freed before the final event was sent
        eng.block_manager.check_invariants()


def test_seeded_sampling_is_reproducible(tiny_artifact):
    p = random_prompts(1, 12, 12, seed=10)[0]
    sp = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    eng = engine(tiny_artifact)
    a = eng.generate(p, sp)
    # same seed inside a busy batch
    others = [eng.add_request(q, SamplingParams(max_tokens=20, temperature=1.0)) for q in random_prompts(5, 3, 30, 11)]
    h = eng.add_request(p, sp)
    eng.run_until_done()
    assert h.output_ids == a
    assert all(o.finished for o in others)
    b = eng.generate(p, SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True))
    assert b != a
    check_clean(eng)


def test_stop_strings_and_stop_ids(tiny_artifact):
    eng = engine(tiny_artifact)
    p = random_prompts(1, 8, 8, seed=12)[0]
    full = eng.add_request(p, SamplingParams.greedy(40, ignore_eos=True)).result()
    text = full.text
    assert len(text) > 20
    stop = text[12:15]
    cut = text.find(stop)
    h = eng.add_request(p, SamplingParams.greedy(40, ignore_eos=True, stop=[stop, "\x00never"]))
    events = list(h)
    assert h.finish_reason == "stop"
    assert h.text == text[:cut]
    assert "".join(ev.text for ev in events) == text[:cut]
    assert stop not in h.text and len(h.output_ids) < 40
    # stop token ids end the output with that token (reported, but no text for it)
    ids = full.output_ids
    stop_id = ids[6]
    k = ids.index(stop_id)
    h = eng.add_request(p, SamplingParams.greedy(40, ignore_eos=True, stop_token_ids=[stop_id])).result()
    assert h.finish_reason == "stop" and h.output_ids == ids[:k + 1]
    # max_tokens
    h = eng.add_request(p, SamplingParams.greedy(3, ignore_eos=True)).result()
    assert h.finish_reason == "length" and len(h.output_ids) == 3
    check_clean(eng)


def test_eos_stops_generation(tiny_artifact):
    eng = engine(tiny_artifact)
    eos = sorted(eng.eos_ids)[0]
    p = random_prompts(1, 8, 8, seed=13)[0]
    ids = eng.generate(p, SamplingParams.greedy(20, ignore_eos=True))
    # make the 4th generated token an eos id via stop_token_ids-free route: treat ids[3] as eos
    eng.eos_ids = frozenset({ids[3], eos})
    h = eng.add_request(p, SamplingParams.greedy(20)).result()
    assert h.finish_reason == "stop" and h.output_ids == ids[:ids.index(ids[3]) + 1]


def test_admission_errors(tiny_artifact):
    eng = engine(tiny_artifact, max_waiting=2, num_blocks=8, kv_block_size=16)
    with pytest.raises(RequestTooLargeError, match="context of 512"):
        eng.add_request([5] * 500, SamplingParams.greedy(20))
    with pytest.raises(RequestTooLargeError, match="KV cache of 128 tokens"):
        eng.add_request([5] * 100, SamplingParams.greedy(40))
    with pytest.raises(SamplingError):
        eng.add_request([5, 6], SamplingParams(max_tokens=0))
    with pytest.raises(AdmissionError, match="token ids"):
        eng.add_request([5, 9999], SamplingParams.greedy(2))
    eng.add_request([5, 6], SamplingParams.greedy(2))
    eng.add_request([5, 7], SamplingParams.greedy(2))
    with pytest.raises(QueueFullError) as ei:
        eng.add_request([5, 8], SamplingParams.greedy(2))
    assert ei.value.http_status == 429
    assert eng.stats().requests_rejected == 3
    eng.run_until_done()
    check_clean(eng)


def test_text_prompt_and_stats_snapshot(tiny_artifact):
    eng = engine(tiny_artifact, num_blocks=64)
    h = eng.add_request("def fibonacci(n):", SamplingParams.greedy(8, ignore_eos=True))
    eng.step()
    st = eng.stats()
    assert st.num_running == 1 and st.num_waiting == 0 and st.kv_blocks_used == 1
    assert st.kv_usage_pct == pytest.approx(100 / 64) and st.provider == CPU
    eng.run_until_done()
    assert h.prompt_ids == eng.encode("def fibonacci(n):") and len(h.output_ids) == 8
    st = eng.stats()
    assert st.generated_tokens == 8 and st.requests_finished == 1 and st.steps == 8
    assert st.finish_reasons == {"length": 1} and 0 < st.batch_fill_ratio <= 1 and 0 < st.token_fill_ratio <= 1


def test_runner_reuses_past_buffers(tiny_artifact):
    eng = engine(tiny_artifact, kv_block_size=16)
    eng.generate(random_prompts(1, 20, 20, seed=14)[0], SamplingParams.greedy(100, ignore_eos=True))
    buf = eng.runner._decode_buf
    # one re-layout per block boundary, not per step; gathers only at those re-layouts
    assert buf.reshapes <= 100 // 16 + 2
    assert buf.gathered_tokens < sum(range(20, 120)) / 8


def test_provider_choice_falls_back_to_cpu(tiny_artifact):
    assert choose_providers(["FooExecutionProvider", CPU]) == [CPU]
    import onnxruntime as ort

    eng = engine(tiny_artifact, providers=["CUDAExecutionProvider", CPU])
    assert eng.runner.provider in ort.get_available_providers()
    assert eng.runner.provider == eng.runner.session.get_providers()[0]


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(tiny_artifact):
    eng = engine(tiny_artifact)
    p1, p2 = random_prompts(2, 10, 20, seed=15)
    h1 = eng.add_request(p1, SamplingParams.greedy(5))
    real = eng.runner.execute

    def boom(rows):
        raise RuntimeError("device lost")

    eng.runner.execute = boom
    eng.step()
    assert h1.finish_reason == "error" and "device lost" in h1.error
    eng.runner.execute = real
    assert len(eng.generate(p2, SamplingParams.greedy(5, ignore_eos=True))) == 5
    check_clean(eng)


def test_leaving_an_async_stream_early_cancels_the_request(tiny_artifact):
    with engine(tiny_artifact, start=True) as eng:
        p = random_prompts(1, 20, 20, seed=16)[0]

        async def client():
            h = eng.add_request(p, SamplingParams.greedy(400, ignore_eos=True))
            n = 0
            async for _ in h:
                n += 1
                if n == 2:
                    break  # the client disconnects
            return h

        async def main():
            h = await client()
            # Leaving the loop closes the async generator soon after (the loop's asyncgen finalizer),
            # and its finally cancels the request: wait for that, not for a number of sleeps.
            await asyncio.to_thread(cancels.wait, 1)
            return h

        # Steps after the second are held until the cancel is in: else a loaded machine could run all
        # 400 tokens before the generator is closed.
        with held_steps(eng, after=2), seen_cancels(eng) as cancels:
            h = asyncio.run(main())
        h.result(timeout=60)
        assert h.finish_reason == "cancelled" and len(h.output_ids) < 400
        assert eng.block_manager.num_used == 0
