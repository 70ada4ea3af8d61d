"""One KV budget (issue 16): the gqa layout's block pool *and* in-place rows (the standard layout's pool and past
buffers) stay within the configured budget
under any mix of requests, the rows' memory comes back after a long request, and a context length the budget
cannot hold is refused at start-up (explicit serve.max_model_len) or advertised lower (the model's default)."""

from __future__ import annotations

import numpy as np
import pytest

from serve.config import ConfigError, ServeConfig
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.engine.scheduler import RequestTooLargeError
from serve.runners.gqa import GqaRunner
from serve.runners.onnx_session import CPU


def ids(n, seed):
    return np.random.default_rng(seed).integers(3, 512, size=n).tolist()


def drive(eng, reqs):
    """Run the requests to the end; check KV bytes against the budget after every step. Returns outputs, peak."""
    handles = [eng.add_request(p, SamplingParams.greedy(n, ignore_eos=True)) for p, n in reqs]
    budget, peak = eng.kv_budget_bytes(), 0
    while eng.has_work():
        eng.step()
        peak = max(peak, eng.kv_bytes())
        assert eng.kv_bytes() <= budget
    eng.check_invariants()
    return [h.result().output_ids for h in handles], peak


def unsqueezed(art, reqs):
    """The same requests one at a time on an engine whose KV budget squeezes nothing: the tokens to expect."""
    eng = Engine(art, ServeConfig(providers=[CPU], num_blocks=400, kv_block_size=16), start=False)
    return [eng.generate(p, SamplingParams.greedy(n, ignore_eos=True)) for p, n in reqs]


def test_max_length_request_stays_within_budget_and_gives_memory_back(tiny_gqa):
    # 40 blocks x 16 = 640 pool tokens; the rows get the same (kv_rows_share 0.5): 640 positions in all.
    cfg = ServeConfig(providers=[CPU], num_blocks=40, kv_block_size=16, max_batch_size=8, max_num_batched_tokens=64)
    eng = Engine(tiny_gqa, cfg, start=False)
    r = eng.runner
    assert isinstance(r, GqaRunner) and r.row_tokens == 640
    assert eng.max_model_len == 512  # the manifest's max positions; the budget holds 640
    budget = eng.kv_budget_bytes()
    assert budget == r.pool.nbytes + 640 * r.bytes_per_token
    idle = eng.kv_bytes()
    assert idle == r.pool.nbytes  # no rows before the first request
    long = (ids(400, 1), 512 - 400)  # prompt + max_tokens = max_model_len
    short = [(ids(20 + 5 * k, 10 + k), 30) for k in range(6)]
    out, peak = drive(eng, [long, *short])
    assert peak <= budget and r.rows.peak_kv_bytes <= budget
    assert peak > idle  # the rows were used, within the budget
    assert eng.kv_bytes() == idle and r.rows.kv.nbytes == 0  # given back once nothing runs

    assert out == unsqueezed(tiny_gqa, [long, *short])


def test_rows_shrink_after_a_long_request_while_short_ones_run(tiny_gqa):
    cfg = ServeConfig(providers=[CPU], num_blocks=64, kv_block_size=16, max_batch_size=4, max_num_batched_tokens=128)
    eng = Engine(tiny_gqa, cfg, start=False)
    r = eng.runner
    eng.add_request(ids(480, 3), SamplingParams.greedy(4, ignore_eos=True))
    eng.run_until_done()
    assert r.rows.kv.nbytes == 0
    # A long one and a short, longer-lived one: once the long one is done the rows shrink to the short one's need.
    eng.add_request(ids(480, 4), SamplingParams.greedy(2, ignore_eos=True))
    h = eng.add_request(ids(10, 5), SamplingParams.greedy(60, ignore_eos=True))
    caps = []
    while eng.has_work():
        eng.step()
        caps.append(r.rows.cap)
        assert eng.kv_bytes() <= eng.kv_budget_bytes()
    assert max(caps) >= 482
    assert min(c for c in caps if c) <= 256  # shrunk while the short one was still running
    assert len(h.result().output_ids) == 60


def test_explicit_max_model_len_the_budget_cannot_hold_fails_with_the_numbers(tiny_gqa, tiny_artifact):
    with pytest.raises(ConfigError) as e:
        Engine(tiny_gqa, ServeConfig(providers=[CPU], num_blocks=20, kv_block_size=16, max_model_len=512), start=False)
    msg = str(e.value)
    assert "serve.max_model_len 512" in msg and "at most 320 tokens" in msg and "block pool 320 tokens" in msg
    assert "KV rows 320 positions" in msg and "bytes per token" in msg and "serve.num_blocks >= 32" in msg
    # The standard layout: 160 pool tokens; its past buffers get the same share, halved for ORT's presents.
    with pytest.raises(ConfigError, match="at most 80 tokens") as e:
        Engine(tiny_artifact, ServeConfig(providers=[CPU], num_blocks=10, kv_block_size=16, max_model_len=300),
               start=False)
    assert "past buffers 80 positions" in str(e.value) and "serve.num_blocks >= 38" in str(e.value)


def test_default_context_is_lowered_to_what_the_budget_holds(tiny_gqa):
    eng = Engine(tiny_gqa, ServeConfig(providers=[CPU], num_blocks=20, kv_block_size=16), start=False)
    assert eng.max_model_len == 320  # advertised by /v1/models; the manifest says 512
    with pytest.raises(RequestTooLargeError, match="KV cache of 320 tokens"):
        eng.add_request(ids(300, 1), SamplingParams.greedy(30))
    out = eng.generate(ids(300, 1), SamplingParams.greedy(20, ignore_eos=True))
    assert len(out) == 20
    assert eng.kv_bytes() == eng.runner.pool.nbytes


def test_kv_memory_mb_is_split_between_pool_and_rows(tiny_gqa):
    eng = Engine(tiny_gqa, ServeConfig(providers=[CPU], kv_memory_mb=1, kv_rows_share=0.25), start=False)
    r = eng.runner
    assert eng.kv_budget_bytes() <= 2**20
    assert r.row_tokens * r.bytes_per_token == 2**18
    assert r.pool.nbytes <= 3 * 2**18


def test_standard_layout_past_buffers_stay_within_the_budget(tiny_artifact):
    # 40 blocks x 16 = 640 pool tokens; the past buffers get 640 / 2 = 320 positions (ORT's presents the other half).
    cfg = ServeConfig(providers=[CPU], num_blocks=40, kv_block_size=16, max_batch_size=8, max_num_batched_tokens=64)
    eng = Engine(tiny_artifact, cfg, start=False)
    r = eng.runner
    assert r.row_tokens == 320 and eng.max_model_len == 320
    assert eng.kv_budget_bytes() == r.pool.nbytes + 320 * r.bytes_per_token
    idle = eng.kv_bytes()
    long = (ids(250, 1), 60)  # 310 positions: alone, it fills the buffers
    short = [(ids(20 + 5 * k, 10 + k), 30) for k in range(6)]
    out, peak = drive(eng, [long, *short])
    assert idle < peak <= eng.kv_budget_bytes()
    assert eng.kv_bytes() == idle  # the buffers are given back once nothing runs

    assert out == unsqueezed(tiny_artifact, [long, *short])


def test_standard_layout_rows_cut_short_of_a_block_when_the_budget_says_so(tiny_artifact):
    # 213 buffer positions, not a whole number of blocks: two ~100-token rows fit (2 x 106 <= 213) only if the
    # past is not rounded up to the next block (2 x 112 > 213), which the runner then does.
    cfg = ServeConfig(providers=[CPU], num_blocks=40, kv_block_size=16, kv_rows_share=0.4, max_batch_size=4)
    eng = Engine(tiny_artifact, cfg, start=False)
    assert eng.runner.row_tokens == 213
    reqs = [(ids(90, 7), 16), (ids(88, 8), 18)]
    out, peak = drive(eng, reqs)
    assert peak <= eng.kv_budget_bytes()
    assert eng.runner._decode_buf.cut_short > 0
    assert out == unsqueezed(tiny_artifact, reqs)


def test_rows_follow_the_traffic_not_what_the_budget_could_hold(tiny_gqa):
    """One running sequence holds one row slot, however many the budget has room for; slots grow by powers of
    two with the rows of a step, and the tokens are those of one request at a time."""
    cfg = ServeConfig(providers=[CPU], num_blocks=400, kv_block_size=16, max_batch_size=8)
    eng = Engine(tiny_gqa, cfg, start=False)
    r = eng.runner
    assert r.row_tokens // 256 >= 8  # room for all 8 slots at the first length step
    one = [(ids(20, 1), 6)]
    out, _ = drive(eng, one)
    assert out == unsqueezed(tiny_gqa, one)
    handle = eng.add_request(ids(20, 2), SamplingParams.greedy(40, ignore_eos=True))
    eng.step()
    assert r.rows.slots == 1 and eng.kv_bytes() == r.pool.nbytes + r.rows.cap * r.bytes_per_token
    reqs = [(ids(12 + i, 10 + i), 8) for i in range(3)]
    handles, slots = [], []
    for p, n in reqs:  # one more sequence each step: 2, 3, then 4 rows
        handles.append(eng.add_request(p, SamplingParams.greedy(n, ignore_eos=True)))
        eng.step()
        slots.append(r.rows.slots)
    assert slots == [2, 4, 4]  # powers of two, never the 8 the budget could hold
    while eng.has_work():
        eng.step()
    assert r.rows.slots == 0 and eng.kv_bytes() == r.pool.nbytes  # idle: the rows are given back
    assert [h.result().output_ids for h in handles] == unsqueezed(tiny_gqa, reqs)
    assert handle.result().output_ids == unsqueezed(tiny_gqa, [(ids(20, 2), 40)])[0]
