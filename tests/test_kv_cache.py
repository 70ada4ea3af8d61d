"""Block manager: pool sizing, tables, ref counts, prefix caching, LRU eviction, invariants. No model."""

from __future__ import annotations

import random

import pytest

from serve.kv.cache import (
    BlockManager,
    KVCacheError,
    KVCacheSpec,
    num_blocks_for_budget,
    prefix_block_hashes,
)


def test_bytes_per_token_and_pool_sizing():
    # SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, fp32
    spec = KVCacheSpec(30, 3, 64, "float32")
    assert spec.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert spec.bytes_per_block(16) == 46080 * 16
    assert num_blocks_for_budget(256 * 2**20, spec, 16) == (256 * 2**20) // (46080 * 16) == 364
    assert KVCacheSpec(2, 2, 16, "float16").bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert KVCacheSpec.from_manifest({"num_layers": 2, "num_kv_heads": 2, "head_dim": 16}).bytes_per_token == 512


def test_budget_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_memory_mb"):
        num_blocks_for_budget(1000, KVCacheSpec(30, 3, 64), 16)
    with pytest.raises(ValueError, match="unknown KV dtype 'float64'"):
        KVCacheSpec(1, 1, 1, "float64")


def test_allocate_is_all_or_nothing_and_free_returns_everything():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.start("a")
    assert bm.allocate("a", 9)  # 3 blocks
    assert len(bm.block_table("a")) == 3 and bm.num_used == 3 and bm.num_free == 1
    bm.start("b")
    assert not bm.allocate("b", 8)  # needs 2, only 1 free: nothing taken
    assert bm.block_table("b") == [] and bm.num_free == 1
    assert bm.allocate("b", 4)
    assert bm.num_free == 0
    assert bm.allocate("a", 12)  # still 3 blocks: no new one needed
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    assert bm.num_used == 0 and bm.num_free == 4
    bm.check_invariants()
    # The high-water mark keeps the burst (4 of 4 blocks) after everything was returned.
    assert bm.peak_used == 4 and bm.peak_usage == 1.0


def test_double_free_and_unknown_sequence_raise():
    bm = BlockManager(2, 4)
    bm.start("a")
    bm.free("a")
    with pytest.raises(KVCacheError):
        bm.free("a")
    with pytest.raises(KVCacheError):
        bm.block_table("zzz")
    bm.start("b")
    with pytest.raises(KVCacheError):
        bm.start("b")


def test_prefix_blocks_are_shared_and_counted():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2
    bm.start("a", num_prompt_tokens=len(prompt))
    bm.allocate("a", len(prompt))
    bm.commit("a", prompt, len(prompt))
    assert bm.num_cached == 2
    assert bm.prefix_queries == 10 and bm.prefix_hits == 0

    other = prompt[:8] + [1, 2, 3]  # same first 2 blocks
    matched = bm.match_prefix(other, max_tokens=len(other) - 1)
    assert matched == bm.block_table("a")[:2]
    cached = bm.start("b", matched, num_prompt_tokens=len(other))
    assert cached == 8
    assert bm.prefix_queries == 21 and bm.prefix_hits == 8
    for b in matched:
        assert bm.ref_count(b) == 2
    assert bm.allocate("b", len(other))
    assert len(bm.block_table("b")) == 3 and bm.num_used == 4  # 3 of a + 1 new for b
    bm.check_invariants()

    bm.free("a")
    for b in matched:
        assert bm.ref_count(b) == 1  # still held by b
    bm.free("b")
    assert bm.num_used == 0 and bm.num_cached == 2 and bm.num_evictable == 2
    # Freed cached blocks still match.
    assert bm.match_prefix(other, max_tokens=10) == matched
    bm.check_invariants()


def test_match_respects_max_tokens_and_block_boundaries():
    bm = BlockManager(8, 4)
    toks = list(range(8))
    bm.start("a")
    bm.allocate("a", 8)
    bm.commit("a", toks, 8)
    assert len(bm.match_prefix(toks)) == 2
    assert len(bm.match_prefix(toks, max_tokens=7)) == 1  # must leave a token to compute
    assert bm.match_prefix([9] + toks[1:]) == []  # first block differs -> nothing (chain hash)
    assert len(bm.match_prefix(toks[:4] + [0, 0, 0, 0])) == 1
    bm.free("a")


def test_chain_hash_depends_on_the_whole_prefix():
    a = prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = prefix_block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, different parent


def test_lru_eviction_of_freed_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    for name, toks in (("old", [1, 2, 3, 4]), ("new", [5, 6, 7, 8])):
        bm.start(name)
        bm.allocate(name, 4)
        bm.commit(name, toks, 4)
        bm.free(name)
    assert bm.num_free == 4 and bm.num_cached == 4 and bm.num_evictable == 4
    # Allocating 2 blocks evicts the least recently freed ones: "old" goes, "new" stays.
    bm.start("x")
    assert bm.allocate("x", 4)
    assert bm.evictions == 2
    assert bm.match_prefix([1, 2, 3, 4]) == []
    assert len(bm.match_prefix([5, 6, 7, 8])) == 2
    bm.check_invariants()
    # Within one freed sequence the tail goes first: allocate one more block -> "new"'s 2nd block.
    bm.start("y")
    assert bm.allocate("y", 2)
    assert len(bm.match_prefix([5, 6, 7, 8])) == 1
    bm.check_invariants()


def test_unhashed_free_blocks_are_used_before_evicting_cached_ones():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.start("a")
    bm.allocate("a", 2)
    bm.commit("a", [1, 2], 2)
    bm.free("a")
    bm.start("b")
    assert bm.allocate("b", 4)  # 2 free unhashed blocks are enough
    assert bm.evictions == 0 and len(bm.match_prefix([1, 2, 3])) == 1
    bm.check_invariants()


def test_identical_blocks_computed_twice_are_registered_once():
    bm = BlockManager(8, 2)
    for s in ("a", "b"):  # both computed before either was committed (same step)
        bm.start(s)
        bm.allocate(s, 4)
    for s in ("a", "b"):
        bm.commit(s, [1, 2, 3, 4], 4)
    assert bm.num_cached == 2
    bm.free("a")
    bm.free("b")
    assert bm.num_evictable == 2 and bm.num_free == 8
    bm.check_invariants()


def test_prefix_caching_off():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    bm.start("a", num_prompt_tokens=4)
    bm.allocate("a", 4)
    bm.commit("a", [1, 2, 3, 4], 4)
    assert bm.num_cached == 0 and bm.match_prefix([1, 2, 3, 4, 5]) == []
    bm.free("a")
    assert bm.num_free == 4 and bm.prefix_queries == 0
    bm.check_invariants()


@pytest.mark.parametrize("seed", range(5))
def test_invariants_hold_under_random_operations(seed):
    """Long random sequences of start/match/allocate/commit/free on a small pool."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    bm = BlockManager(num_blocks=rng.choice([6, 12, 24]), block_size=bs)
    vocab = [1, 2, 3]  # tiny vocab: many shared prefixes
    live: dict[int, dict] = {}
    next_id = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.25 or not live:
            toks = [rng.choice(vocab) for _ in range(rng.randint(1, 5 * bs))]
            matched = bm.match_prefix(toks, max_tokens=len(toks) - 1)
            if bm.can_start(matched, len(toks)):
                cached = bm.start(next_id, matched, num_prompt_tokens=len(toks))
                assert cached == len(matched) * bs
                assert bm.allocate(next_id, len(toks))
                live[next_id] = {"toks": toks, "computed": cached}
                next_id += 1
        elif op < 0.6:
            sid = rng.choice(list(live))
            st = live[sid]
            st["toks"] += [rng.choice(vocab) for _ in range(rng.randint(1, 3))]
            used_before, free_before = bm.num_used, bm.num_free
            if bm.allocate(sid, len(st["toks"])):
                assert len(bm.block_table(sid)) * bs >= len(st["toks"])
            else:
                assert (bm.num_used, bm.num_free) == (used_before, free_before)
                st["toks"] = st["toks"][: len(bm.block_table(sid)) * bs]
        elif op < 0.85:
            sid = rng.choice(list(live))
            st = live[sid]
            st["computed"] = min(len(st["toks"]), len(bm.block_table(sid)) * bs)
            bm.commit(sid, st["toks"], st["computed"])
        else:
            sid = rng.choice(list(live))
            bm.free(sid)
            del live[sid]
        bm.check_invariants()
        assert bm.num_used + bm.num_free == bm.num_blocks
        assert bm.prefix_hits <= bm.prefix_queries
    for sid in list(live):
        bm.free(sid)
    bm.check_invariants()
    assert bm.num_used == 0 and bm.num_free == bm.num_blocks
