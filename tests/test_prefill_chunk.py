"""The prompt chunk the engine measures at start-up (serve/engine/prefill_chunk.py): the stopping rule on a runner
whose costs are known, and the real engine on the tiny model with the chunk it measured, token for token the
same as without one."""

from __future__ import annotations

import numpy as np
import pytest

from serve.config import ServeConfig
from serve.engine import prefill_chunk
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.kv.cache import BlockManager
from serve.runners.onnx_session import CPU


class CostedRunner:
    """A runner whose step of prompts of n rows in all costs ``cost(n)`` seconds on a clock it advances itself."""

    def __init__(self, cost, fail_at=None):
        self.cost, self.fail_at, self.now, self.sizes, self.released = cost, fail_at, 0.0, [], []

    def clock(self):
        return self.now

    def execute(self, rows):
        n = sum(len(r.token_ids) for r in rows)
        if n == self.fail_at:
            raise RuntimeError("no kernel for this size")
        self.sizes.append(n)
        self.now += self.cost(n)
        return [None]

    def release(self, key):
        self.released.append(key)

    def trim(self, longest):
        self.trimmed = longest


def measure(runner, most=512, blocks=64):
    bm = BlockManager(blocks, 16)
    bm.on_free = lambda seq: runner.release((seq.request_id, seq.epoch))
    chunk, costs = prefill_chunk.measure_prefill_chunk(runner, bm, most)
    assert bm.num_used == 0  # the scratch sequence's blocks are given back
    return chunk, costs


@pytest.fixture
def runner_clock(monkeypatch):
    def use(runner):
        monkeypatch.setattr(prefill_chunk.time, "perf_counter", runner.clock)
        return runner
    return use


def test_the_chunk_stops_where_doubling_saves_under_four_percent(runner_clock):
    # 40 ms a step + 10 ms a row; 1, 2, 4 prompts of 32 tokens: a token costs 11.25, 10.6, 10.3 ms
    r = runner_clock(CostedRunner(lambda n: 0.040 + 0.010 * n))
    chunk, costs = measure(r)
    assert chunk == 64
    assert sorted(costs) == [32, 64, 128]
    assert costs[32] == pytest.approx(0.01125) and costs[128] == pytest.approx(0.0103125)
    assert sorted(r.released) == sorted((f"prefill-chunk-{i}", 0) for i in range(16))  # 512 / 32 prompts
    assert r.trimmed == 0  # the rows' memory given back


def test_a_cost_that_keeps_falling_takes_the_whole_budget(runner_clock):
    r = runner_clock(CostedRunner(lambda n: 1.0 + 0.001 * n))  # a call's fixed cost dominates up to 512 rows
    assert measure(r)[0] == 512


def test_no_room_or_a_failing_call_leaves_the_budget_alone(runner_clock):
    r = runner_clock(CostedRunner(lambda n: 0.040 + 0.010 * n))
    assert measure(r, blocks=8) == (512, {})  # 8 blocks of 16 cannot hold 16 prompts of 32 tokens
    assert r.sizes == []
    failing = runner_clock(CostedRunner(lambda n: 0.040 + 0.010 * n, fail_at=64))
    chunk, costs = measure(failing)
    assert chunk == 512 and sorted(costs) == [32]
    assert len(failing.released) == 16


def test_the_engine_measures_its_chunk_and_answers_as_without_one(gqa_or_tiny):
    """Prompts of 5 to 300 tokens, 8 at once: the same greedy tokens with the measured chunk as with none."""
    rng = np.random.default_rng(7)
    reqs = [rng.integers(3, 512, size=int(n)).tolist() for n in rng.integers(5, 300, size=8)]
    outs = {}
    for chunk in ("auto", 0):
        eng = Engine(gqa_or_tiny, ServeConfig(providers=[CPU], prefill_chunk=chunk, enable_prefix_caching=False,
                                              result_cache_size=0), start=False)
        if chunk == "auto":
            assert 32 <= eng.scheduler.prefill_chunk <= 512
            assert sorted(eng.prefill_costs)[0] == 32 and all(v > 0 for v in eng.prefill_costs.values())
        else:
            assert eng.scheduler.prefill_chunk is None and eng.prefill_costs == {}
        handles = [eng.add_request(ids, SamplingParams.greedy(6, ignore_eos=True)) for ids in reqs]
        eng.run_until_done()
        outs[chunk] = [h.output_ids for h in handles]
        eng.shutdown()
    assert outs["auto"] == outs[0]


@pytest.fixture(params=["tiny_artifact", "tiny_gqa"])
def gqa_or_tiny(request):
    return request.getfixturevalue(request.param)
