"""Scheduler policy without a model: a fake step commits the scheduled tokens and 'samples' a token."""

from __future__ import annotations

import pytest

from serve.engine.sampling import SamplingParams
from serve.kv.cache import BlockManager
from serve.engine.scheduler import (
    AdmissionError,
    QueueFullError,
    RequestTooLargeError,
    Scheduler,
    SequenceState,
    SeqStatus,
)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(num_blocks=64, block_size=4, **kw):
    clock = Clock()
    bm = BlockManager(num_blocks, block_size)
    kw.setdefault("max_model_len", 4096)
    return Scheduler(bm, clock=clock, **kw), clock


def seq(rid, n_prompt, max_tokens=4, arrival=0.0, first=1):
    return SequenceState(rid, list(range(first, first + n_prompt)), SamplingParams.greedy(max_tokens), arrival=arrival)


def fake_step(s: Scheduler, out, finished: list | None = None):
    """Commit every row; rows that reach the end of their tokens get a new token; finish at max_tokens."""
    for row in out.scheduled:
        s.commit(row)
        q = row.seq
        if row.samples:
            q.token_ids.append(1000 + q.num_output)
            if q.num_output >= q.params.max_tokens:
                s.finish(q, "length")
                if finished is not None:
                    finished.append(q)


def run_all(s: Scheduler, max_steps=10_000, check=None):
    outs = []
    for _ in range(max_steps):
        if not s.has_work():
            return outs
        out = s.schedule()
        assert not out.empty, "work left but nothing scheduled"
        if check:
            check(out)
        fake_step(s, out)
        s.bm.check_invariants()
        outs.append(out)
    raise AssertionError("did not finish")


def test_budget_and_batch_size_are_respected():
    s, _ = make(max_num_batched_tokens=16, max_batch_size=3)
    for i in range(6):
        s.add(seq(f"r{i}", 7 + i, max_tokens=5, arrival=i))

    def check(out):
        assert out.num_tokens <= 16
        assert len(out.scheduled) <= 3
        assert len({id(r.seq) for r in out.scheduled}) == len(out.scheduled)

    run_all(s, check=check)
    assert s.bm.num_used == 0


def test_decodes_first_then_chunked_prefill_of_a_long_prompt():
    s, clock = make(num_blocks=128, max_num_batched_tokens=8, max_batch_size=8)
    for i in range(3):
        s.add(seq(f"short{i}", 2, max_tokens=30, arrival=i))
    out = s.schedule()
    fake_step(s, out)
    assert all(s.running[i].num_uncomputed == 1 for i in range(3))  # all three in decode now
    clock.t = 10
    s.add(seq("long", 40, max_tokens=2, arrival=10))
    chunks = []
    while any(q.request_id == "long" for q in s.waiting) or any(
            q.request_id == "long" and q.is_prefill for q in s.running):
        out = s.schedule()
        ids = [r.seq.request_id for r in out.scheduled]
        # every running decode is scheduled, ahead of the prefill chunk
        assert ids[:3] == ["short0", "short1", "short2"]
        assert all(r.num_tokens == 1 for r in out.scheduled[:3])
        long_rows = [r for r in out.scheduled if r.seq.request_id == "long"]
        assert len(long_rows) == 1 and long_rows[0].num_tokens == 5  # 8 - 3 decodes
        chunks.append(long_rows[0].num_tokens)
        fake_step(s, out)
    assert sum(chunks) == 40 and len(chunks) == 8
    run_all(s)


def test_preemption_frees_youngest_and_everything_completes():
    # 10 blocks of 4 tokens = 40 token slots; 4 requests of 8 + 12 tokens need 20 each.
    s, _ = make(num_blocks=10, block_size=4, max_num_batched_tokens=64, max_batch_size=8)
    for i in range(4):
        s.add(seq(f"r{i}", 8, max_tokens=12, arrival=i, first=10 * i + 1))
    preempted = []
    finished = []
    for _ in range(1000):
        if not s.has_work():
            break
        out = s.schedule()
        for v in out.preempted:
            # the victim is the youngest running (latest arrival) at that moment
            assert all(q.arrival <= v.arrival for q in s.running)
            preempted.append(v.request_id)
        fake_step(s, out, finished)
        s.bm.check_invariants()
    assert not s.has_work()
    assert preempted, "a pool this small must preempt"
    assert s.num_preemptions == len(preempted)
    assert sorted(q.request_id for q in finished) == ["r0", "r1", "r2", "r3"]
    for q in finished:
        assert q.output_ids == [1000 + k for k in range(12)]
    assert s.bm.num_used == 0
    # the oldest request is never preempted
    assert "r0" not in preempted


def test_no_admission_in_a_step_that_preempted():
    s, _ = make(num_blocks=5, block_size=2, max_num_batched_tokens=64, max_batch_size=8)
    s.add(seq("a", 4, max_tokens=5, arrival=0))
    s.add(seq("b", 4, max_tokens=5, arrival=1, first=50))
    out = s.schedule()
    fake_step(s, out)  # a and b hold 2 blocks each, 1 free
    assert s.bm.num_free == 1
    out = s.schedule()  # a takes the last block; b needs one -> b (youngest) is preempted and not re-admitted
    assert [v.request_id for v in out.preempted] == ["b"]
    assert [r.seq.request_id for r in out.scheduled] == ["a"]
    assert s.waiting[0].request_id == "b" and s.waiting[0].num_computed == 0


def test_preempted_sequence_is_recomputed_from_prefix_cache():
    s, _ = make(num_blocks=6, block_size=2, max_num_batched_tokens=64, max_batch_size=8)
    s.add(seq("a", 4, max_tokens=6, arrival=0))
    s.add(seq("b", 4, max_tokens=6, arrival=1, first=50))
    hits0 = s.bm.prefix_hits
    run_all(s)
    assert s.num_preemptions >= 1
    assert s.bm.prefix_hits > hits0  # the victim's blocks were still cached when it came back


def test_max_wait_aging_blocks_bypass():
    """A request that does not fit yet may be passed by smaller ones only until it has waited max_wait_s."""

    def scenario(t_last):
        s, clock = make(num_blocks=8, block_size=4, max_num_batched_tokens=64, max_batch_size=8, max_wait_s=5.0,
                        watermark=0.0)
        s.add(seq("hog", 20, max_tokens=3, arrival=0))  # 5 blocks, 6 with its outputs
        fake_step(s, s.schedule())
        s.add(seq("big", 16, max_tokens=4, arrival=1, first=100))  # needs 4 blocks: never fits next to hog
        s.add(seq("small", 2, max_tokens=2, arrival=2, first=40))  # needs 1
        clock.t = 3  # big is young: small passes it
        out = s.schedule()
        assert [r.seq.request_id for r in out.scheduled] == ["hog", "small"]
        fake_step(s, out)
        s.add(seq("small2", 2, max_tokens=2, arrival=3, first=60))
        assert s.bm.num_free == 1  # room for small2, not for big
        clock.t = t_last
        out = s.schedule()
        run_all(s)
        return [r.seq.request_id for r in out.scheduled]

    assert "small2" in scenario(t_last=4)  # big waited 3 s < 5 s: small2 passes it
    assert "small2" not in scenario(t_last=7)  # big waited 6 s: nothing passes it


def test_shortest_first_policy_and_aged_first():
    s, clock = make(max_num_batched_tokens=12, max_batch_size=1, policy="shortest_first", max_wait_s=5.0)
    s.add(seq("long", 10, arrival=0))
    s.add(seq("short", 3, arrival=1))
    clock.t = 2
    assert s.schedule().scheduled[0].seq.request_id == "short"

    s, clock = make(max_num_batched_tokens=12, max_batch_size=1, policy="shortest_first", max_wait_s=5.0)
    s.add(seq("long", 10, arrival=0))
    s.add(seq("short", 3, arrival=1))
    clock.t = 6  # long has aged: it goes first
    assert s.schedule().scheduled[0].seq.request_id == "long"

    s, clock = make(max_num_batched_tokens=12, max_batch_size=1, policy="fcfs")
    s.add(seq("long", 10, arrival=0))
    s.add(seq("short", 3, arrival=1))
    assert s.schedule().scheduled[0].seq.request_id == "long"
    with pytest.raises(ValueError, match="policy"):
        make(policy="random")


def test_admission_errors():
    s, _ = make(num_blocks=8, block_size=4, max_waiting=2, max_model_len=64)
    with pytest.raises(RequestTooLargeError, match="context of 64"):
        s.add(seq("ctx", 60, max_tokens=10))
    with pytest.raises(RequestTooLargeError, match="KV cache of 32 tokens"):
        s.add(seq("pool", 30, max_tokens=10))
    with pytest.raises(RequestTooLargeError, match="empty"):
        s.add(SequenceState("e", [], SamplingParams.greedy(2), arrival=0))
    s.add(seq("a", 4))
    s.add(seq("b", 4))
    with pytest.raises(QueueFullError, match="waiting queue is full") as ei:
        s.add(seq("c", 4))
    assert ei.value.http_status == 429 and ei.value.retry_after_s > 0
    assert RequestTooLargeError("x").http_status == 400
    assert issubclass(QueueFullError, AdmissionError) and issubclass(RequestTooLargeError, AdmissionError)
    # exactly fitting the pool is fine: 28 + 4 = 32 tokens = 8 blocks
    s2, _ = make(num_blocks=8, block_size=4, max_model_len=64)
    s2.add(seq("fit", 28, max_tokens=4))
    run_all(s2)


def test_finish_while_waiting_and_running_returns_blocks():
    s, _ = make(num_blocks=16, max_num_batched_tokens=4, max_batch_size=4)
    a, b = seq("a", 10, arrival=0), seq("b", 3, arrival=1)
    s.add(a)
    s.add(b)
    fake_step(s, s.schedule())  # a takes the whole budget; b waits
    assert a.status is SeqStatus.RUNNING and b.status is SeqStatus.WAITING
    assert s.bm.num_used > 0
    s.finish(a, "cancelled")
    s.finish(b, "cancelled")
    assert not s.has_work() and s.bm.num_used == 0
    s.bm.check_invariants()


def test_prefix_hit_skips_computed_tokens_but_keeps_one():
    s, _ = make(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    s.add(seq("a", 12, max_tokens=1, arrival=0))
    run_all(s)
    s.add(seq("b", 12, max_tokens=1, arrival=1))  # identical prompt: 3 full blocks cached
    out = s.schedule()
    row = out.scheduled[0]
    # 12 tokens = 3 full blocks, but the last token must be computed for its logits -> 2 blocks reused
    assert row.start == 8 and row.num_tokens == 4 and row.samples
    assert row.seq.num_cached_prompt_tokens == 8


# ---- prompt coalescing ----------------------------------------------------------------------
def _coalescing(**kw):
    s, clock = make(num_blocks=256, max_num_batched_tokens=2048, max_batch_size=8,
                    admit_quiet_s=0.008, admit_max_delay_s=0.1, **kw)
    return s, clock


def _arrive(s, clock, rid, t, n_prompt=6):
    clock.t = t
    s.add(seq(rid, n_prompt, max_tokens=50, arrival=t))


def test_a_request_that_comes_alone_is_admitted_at_once():
    s, clock = _coalescing()
    _arrive(s, clock, "a", 1.0)
    assert s.admit_hold_until() is None
    assert [r.seq.request_id for r in s.schedule().scheduled] == ["a"]
    _arrive(s, clock, "b", 1.5)  # 500 ms later: still no burst
    assert [r.seq.request_id for r in s.schedule().scheduled if r.seq.request_id == "b"] == ["b"]


def test_a_burst_is_held_until_arrivals_pause_then_admitted_together():
    s, clock = _coalescing()
    _arrive(s, clock, "r0", 1.0)
    first = s.schedule()  # came alone: admitted, nothing said a burst was coming
    assert [r.seq.request_id for r in first.scheduled] == ["r0"]
    fake_step(s, first)
    for i in range(1, 5):  # 3 ms apart: a burst
        _arrive(s, clock, f"r{i}", 1.0 + 0.003 * i)
        until = s.admit_hold_until()
        assert until == pytest.approx(clock.t + 0.008)
        out = s.schedule()
        assert [r.seq.request_id for r in out.scheduled] == ["r0"], "the running decode goes on, nobody admitted"
        fake_step(s, out)
    clock.t += 0.008  # quiet: the burst is over
    assert s.admit_hold_until() is None
    assert sorted(r.seq.request_id for r in s.schedule().scheduled) == ["r0", "r1", "r2", "r3", "r4"]


def test_the_next_burst_waits_from_its_first_request_and_never_past_the_max_delay():
    s, clock = make(num_blocks=1024, max_num_batched_tokens=2048, max_batch_size=64, admit_quiet_s=0.008,
                    admit_max_delay_s=0.1)
    for i in range(6):
        _arrive(s, clock, f"a{i}", 1.0 + 0.002 * i)
    clock.t = 1.02
    assert len(s.schedule().scheduled) == 6
    _arrive(s, clock, "b0", 3.0)  # 2 s later, but the recent arrivals were a burst: hold the first one too
    assert s.admit_hold_until() == pytest.approx(3.008)
    released, i = None, 0
    while released is None:  # arrivals every 5 ms, never pausing for 8: released at the oldest's max delay
        i += 1
        clock.t = 3.0 + 0.005 * i
        if s.admit_hold_until() is None:
            released = clock.t
        else:
            _arrive(s, clock, f"b{i}", clock.t)
    assert released == pytest.approx(3.1)
    assert len([r for r in s.schedule().scheduled if r.seq.request_id.startswith("b")]) == 20


def test_coalescing_never_holds_a_burst_that_fills_the_rows_or_the_budget():
    s, clock = _coalescing()
    for i in range(8):  # max_batch_size 8: the rows are full
        _arrive(s, clock, f"r{i}", 1.0 + 0.001 * i)
    assert s.admit_hold_until() is None
    assert len(s.schedule().scheduled) == 8
    s2, clock2 = make(num_blocks=256, max_num_batched_tokens=16, max_batch_size=8, admit_quiet_s=0.008,
                      admit_max_delay_s=0.1)
    _arrive(s2, clock2, "x", 1.0, n_prompt=10)
    _arrive(s2, clock2, "y", 1.001, n_prompt=10)  # 20 prompt tokens > the budget of 16
    assert s2.admit_hold_until() is None


def test_coalescing_never_holds_half_the_waiting_queue():
    """Held requests count against serve.max_waiting, where the HTTP layer sheds with 429s: released at half."""
    s, clock = make(num_blocks=256, max_num_batched_tokens=2048, max_batch_size=64, max_waiting=8,
                    admit_quiet_s=0.008, admit_max_delay_s=0.1)
    for i in range(3):
        _arrive(s, clock, f"r{i}", 1.0 + 0.001 * i)
    assert s.admit_hold_until() is not None
    _arrive(s, clock, "r3", 1.003)
    assert s.admit_hold_until() is None  # 4 waiting = half of 8


def test_coalescing_is_off_by_default():
    s, clock = make(num_blocks=256, max_num_batched_tokens=2048, max_batch_size=8)
    for i in range(3):
        _arrive(s, clock, f"r{i}", 1.0 + 0.001 * i)
    assert s.admit_hold_until() is None
    assert len(s.schedule().scheduled) == 3


@pytest.mark.parametrize("chunk", [None, 64])
def test_long_prompts_among_decoding_rows_get_their_first_token_within_the_bound(chunk):
    """Issue 70's starvation bound at the server's default budget: 8 rows decode every step, and each of 4 ~650-token
    prompts arriving together has its first token after at most ceil((its tokens + the tokens of the prompts ahead of
    it) / (budget - decoding rows)) steps without a prefill chunk; with one (the prompts after the oldest share what
    is left of it) after at most the sum of ceil(tokens / (budget - decoding rows)) over it and those ahead: prompts go
    first come, first served, and none waits for all."""
    import math

    from serve.config import ServeConfig

    budget = ServeConfig().max_num_batched_tokens
    s, clock = make(num_blocks=1024, block_size=16, max_num_batched_tokens=budget, max_batch_size=16,
                    prefill_chunk=chunk)
    for i in range(8):
        s.add(seq(f"chat{i}", 8, max_tokens=400, arrival=i * 1e-3, first=1 + 10 * i))
    fake_step(s, s.schedule())
    assert all(not q.is_prefill for q in s.running)  # eight rows decoding
    clock.t = 1.0
    lengths = [650, 660, 640, 655]
    for k, n in enumerate(lengths):
        s.add(seq(f"long{k}", n, max_tokens=4, arrival=1.0 + k * 1e-3, first=100 + 1000 * k))
    per_step = budget - 8
    first_token_step, decoded = {}, {f"chat{i}": 0 for i in range(8)}
    for step in range(1, 200):
        out = s.schedule()
        assert out.num_tokens <= budget
        assert sum(r.num_tokens for r in out.scheduled if r.start < r.seq.prompt_len) <= per_step  # prompt rows
        for r in out.scheduled:
            name = r.seq.request_id
            if name in decoded:
                decoded[name] += 1
            elif r.samples and name not in first_token_step:
                first_token_step[name] = step
        fake_step(s, out)
        if len(first_token_step) == len(lengths):
            break
    assert all(n == step for n in decoded.values())  # no decoding row missed a step
    for k in range(len(lengths)):
        bound = (sum(math.ceil(n / per_step) for n in lengths[:k + 1]) if chunk
                 else math.ceil(sum(lengths[:k + 1]) / per_step))
        assert first_token_step[f"long{k}"] <= bound, (k, first_token_step, bound)
    assert first_token_step["long0"] < first_token_step["long3"]  # the first prompt does not wait for the last


def test_a_prefill_chunk_gives_prompts_arriving_together_their_first_tokens_one_after_another():
    """8 short prompts arriving together beside 8 decoding rows: with a chunk of 48 tokens (the oldest prompt row
    takes its share, later ones join whole within what is left of the chunk) they finish in arrival order, one a
    step, none cut in two, while every decode row runs every step; with a chunk of 128, three a step; without a
    chunk all 8 come out of the same step."""
    def first_steps(chunk):
        s, clock = make(num_blocks=1024, block_size=16, max_num_batched_tokens=512, max_batch_size=16)
        for i in range(8):
            s.add(seq(f"chat{i}", 8, max_tokens=400, arrival=i * 1e-3, first=1 + 10 * i))
        fake_step(s, s.schedule())
        s.prefill_chunk = chunk  # from here: eight rows decoding, eight prompts waiting
        clock.t = 1.0
        for k in range(8):
            s.add(seq(f"new{k}", 40, max_tokens=4, arrival=1.0 + k * 1e-4, first=1000 + 100 * k))
        got = {}
        for step in range(1, 50):
            out = s.schedule()
            assert sum(1 for r in out.scheduled if r.seq.request_id.startswith("chat")) == 8
            got.update({r.seq.request_id: step for r in out.scheduled
                        if r.samples and r.seq.request_id.startswith("new") and r.seq.request_id not in got})
            assert all(r.num_tokens == 40 for r in out.scheduled if r.seq.request_id.startswith("new")
                       and r.start == 0)  # whole prompts only
            fake_step(s, out)
            if len(got) == 8:
                return [got[f"new{k}"] for k in range(8)]

    assert first_steps(None) == [1] * 8
    assert first_steps(48) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert first_steps(128) == [1, 1, 1, 2, 2, 2, 3, 3]


def test_a_lone_prompt_takes_the_whole_budget_whatever_the_chunk():
    """The chunk only shares a step between prompts: one prompt with nobody else runs 300 tokens in one step."""
    s, _ = make(num_blocks=1024, block_size=16, max_num_batched_tokens=512, prefill_chunk=64)
    s.add(seq("alone", 300, max_tokens=2))
    out = s.schedule()
    assert [(r.seq.request_id, r.num_tokens) for r in out.scheduled] == [("alone", 300)]
