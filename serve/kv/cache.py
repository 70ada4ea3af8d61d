"""KV block manager: a fixed pool of fixed-size blocks, block tables, ref counts, prefix caching.

Pure Python bookkeeping; the K/V numbers themselves live in the runner's pool arrays,
indexed by the block ids handed out here.

* The pool is sized once from a memory budget: one token costs
  ``2 (K and V) x layers x kv_heads x head_dim x dtype bytes``.
* Every sequence owns a block table (list of block ids covering positions
  ``[i * block_size, (i + 1) * block_size)``). A block may be in several tables at
  once (a shared prompt prefix); its ref count is the number of tables holding it.
* A *full* block whose K/V has been computed is hashed by ``(parent block hash, its
  token ids)``; the chain makes a hash identify the whole prefix up to that block.
  A later sequence whose prompt starts with the same full blocks takes references on
  them instead of recomputing them (prefix caching).
* A block whose ref count drops to 0 goes back to the free list if it has no hash,
  or to the *evictable* LRU if it does: its content stays reusable until the pool
  runs short, when the least recently freed cached block is evicted first.
  Only full blocks are ever shared, and a full block is never written again, so
  no copy-on-write is needed.

Every block is in exactly one of three states: used (ref > 0), free (ref 0, no hash)
or evictable (ref 0, hashed). ``check_invariants`` verifies that and the counts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

# The KV shape, dtype table and budget arithmetic live in serve/kv/budget.py; importable from here as before.
from serve.kv.budget import (  # noqa: F401
    DTYPE_BYTES,
    ROW_COPIES,
    SERVED_KV_DTYPES,
    KVCacheSpec,
    dtype_bytes,
    num_blocks_for_budget,
    served_kv_dtype,
)

ROOT_HASH = b""


@dataclass(frozen=True)
class ScratchSequence:
    """A sequence the engine runs for its own measurements at start-up, named as the block manager and its
    ``on_free`` hook name sequences (request id + admission epoch)."""

    request_id: str
    epoch: int = 0


class KVCacheError(RuntimeError):
    """Misuse of the block manager (unknown sequence, double free): a bug, not a user error."""


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of one full block given its parent block's hash: identifies the whole prefix."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[bytes]:
    """Chain hashes of the full blocks of ``token_ids`` (at most ``max_blocks``)."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[bytes] = []
    parent = ROOT_HASH
    for i in range(n):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


class BlockManager:
    """Hands out KV blocks to sequences; keeps full computed blocks for prefix reuse.

    Sequences are identified by any hashable id. The typical life of one:
    ``match_prefix`` → ``start(seq, matched)`` → (``allocate(seq, n_tokens)`` →
    K/V written by the runner → ``commit(seq, token_ids, n_computed)``)* → ``free(seq)``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (got {num_blocks})")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # first = least recently freed
        self._cached: dict[bytes, int] = {}  # hash -> block id, for every hashed block (used or evictable)
        self._tables: dict[Hashable, list[int]] = {}
        self._chains: dict[Hashable, list[bytes]] = {}  # per sequence: hashes of its committed full blocks
        # Called with the sequence id before its blocks are released (the engine tells its runner: a runner that
        # holds K/V not yet written to the blocks must drop it then, never write it into reused blocks).
        self.on_free: Callable[[Hashable], None] | None = None
        # counters (monotonic)
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found cached
        self.evictions = 0
        self.peak_used = 0  # most blocks held at once since start: samplers miss short bursts

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks holding a reusable hashed prefix (in use or evictable)."""
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    @property
    def peak_usage(self) -> float:
        return self.peak_used / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: Hashable) -> list[int]:
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KVCacheError(f"sequence {seq_id!r} has no block table") from None

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def stats(self) -> dict:
        return {
            "blocks_total": self.num_blocks,
            "blocks_used": self.num_used,
            "blocks_free": self.num_free,
            "blocks_cached": self.num_cached,
            "blocks_evictable": self.num_evictable,
            "usage": self.usage,
            "prefix_queries": self.prefix_queries,
            "prefix_hits": self.prefix_hits,
            "evictions": self.evictions,
        }

    # ---- prefix cache ----------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Block ids of the longest cached run of full blocks that starts ``token_ids``.

        At most ``max_tokens`` tokens are matched (the caller keeps at least one prompt
        token to compute, because it needs that token's logits). No side effects.
        """
        if not self.enable_prefix_caching:
            return []
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        bs = self.block_size
        matched: list[int] = []
        parent = ROOT_HASH
        for i in range(limit // bs):
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs])
            block = self._cached.get(parent)
            if block is None:
                break
            matched.append(block)
        return matched

    def blocks_needed(self, seq_id: Hashable | None, num_tokens: int, matched: Sequence[int] = ()) -> int:
        """New blocks a sequence needs so its table covers ``num_tokens`` positions.

        For a sequence not started yet, pass ``seq_id=None`` and the blocks ``match_prefix`` found.
        """
        have = len(self._tables[seq_id]) if seq_id is not None else len(matched)
        return max(0, self.blocks_for_tokens(num_tokens) - have)

    def can_start(self, matched: Sequence[int], num_tokens: int, reserve: int = 0) -> bool:
        """Whether a new sequence reusing ``matched`` could cover ``num_tokens`` now, leaving ``reserve`` blocks."""
        # Matched blocks that are evictable stop being allocatable once referenced.
        taken_from_pool = sum(1 for b in matched if self._ref[b] == 0)
        need = self.blocks_needed(None, num_tokens, matched)
        return need <= self.num_free - taken_from_pool - reserve

    # ---- sequence life ---------------------------------------------------------------------
    def start(self, seq_id: Hashable, matched: Sequence[int] = (), num_prompt_tokens: int | None = None) -> int:
        """Create ``seq_id``'s block table, referencing the prefix blocks ``matched``.

        Returns the number of tokens whose K/V is already there (``len(matched) * block_size``).
        ``num_prompt_tokens`` feeds the prefix-cache counters (tokens queried / hit).
        """
        if seq_id in self._tables:
            raise KVCacheError(f"sequence {seq_id!r} already has a block table")
        table: list[int] = []
        chain: list[bytes] = []
        for b in matched:
            h = self._hash[b]
            if h is None:
                raise KVCacheError(f"block {b} is not a cached block")
            self._take(b)
            table.append(b)
            chain.append(h)
        self._tables[seq_id] = table
        self._chains[seq_id] = chain
        cached = len(table) * self.block_size
        if num_prompt_tokens is not None and self.enable_prefix_caching:
            self.prefix_queries += num_prompt_tokens
            self.prefix_hits += cached
        return cached

    def allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Grow ``seq_id``'s table to cover ``num_tokens`` positions.

        All or nothing: returns False, changing nothing, when the pool has too few blocks.
        """
        table = self.block_table(seq_id)
        need = self.blocks_for_tokens(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            table.append(self._pop_free())
        return True

    def shrink(self, seq_id: Hashable, num_tokens: int) -> None:
        """Release the blocks of ``seq_id``'s table beyond the first ``num_tokens`` positions (rejected drafted
        positions: their blocks hold nothing anyone reads, and were never hashed)."""
        table = self.block_table(seq_id)
        keep = self.blocks_for_tokens(num_tokens)
        if keep < len(self._chains[seq_id]):
            raise KVCacheError(f"sequence {seq_id!r}: cannot shrink below its {len(self._chains[seq_id])} committed "
                               f"blocks to {keep}")
        while len(table) > keep:
            self._release(table.pop())

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Record that positions ``[0, num_computed)`` of the sequence hold K/V for ``token_ids``.

        Newly completed full blocks get their chain hash and become reusable by other sequences.
        If an identical block is already cached (two equal prompts computed at once), this
        copy stays private and goes back to the free list when released.
        """
        if not self.enable_prefix_caching:
            return
        table = self.block_table(seq_id)
        chain = self._chains[seq_id]
        bs = self.block_size
        full = min(num_computed // bs, len(table))
        parent = chain[-1] if chain else ROOT_HASH
        for i in range(len(chain), full):
            parent = hash_block(parent, token_ids[i * bs:(i + 1) * bs])
            chain.append(parent)
            b = table[i]
            if self._hash[b] is None and parent not in self._cached:
                self._hash[b] = parent
                self._cached[parent] = b

    def free(self, seq_id: Hashable) -> None:
        """Release every block of ``seq_id``: unhashed ones become free, cached ones evictable.

        The tail is released first, so under LRU the deepest (least shareable) blocks go first.
        """
        table = self._tables.pop(seq_id, None)
        if table is None:
            raise KVCacheError(f"sequence {seq_id!r} has no block table (double free?)")
        if self.on_free is not None:
            self.on_free(seq_id)
        self._chains.pop(seq_id, None)
        for b in reversed(table):
            self._release(b)

    # ---- internals -------------------------------------------------------------------------
    def _take(self, b: int) -> None:
        if self._ref[b] == 0:
            self._evictable.pop(b, None)
            self.peak_used = max(self.peak_used, self.num_used)
        self._ref[b] += 1

    def _release(self, b: int) -> None:
        if self._ref[b] <= 0:
            raise KVCacheError(f"block {b} released with ref count {self._ref[b]}")
        self._ref[b] -= 1
        if self._ref[b] == 0:
            if self._hash[b] is not None:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def _pop_free(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                del self._cached[h]
            self._hash[b] = None
            self.evictions += 1
        self._ref[b] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return b

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by the tests)."""
        free = set(self._free)
        evictable = set(self._evictable)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not (free & evictable), "a block is both free and evictable"
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            assert len(set(table)) == len(table), "a block appears twice in one table"
            for b in table:
                refs[b] += 1
        for b in range(self.num_blocks):
            r = self._ref[b]
            assert r >= 0, f"block {b} has a negative ref count"
            assert r == refs[b], f"block {b}: ref count {r} but in {refs[b]} tables"
            if r > 0:
                assert b not in free and b not in evictable, f"block {b} is used and also free/evictable"
            else:
                assert (b in free) != (b in evictable), f"block {b} has ref 0 but is neither free nor evictable"
            if b in free:
                assert self._hash[b] is None, f"free block {b} still has a hash"
            if b in evictable:
                assert self._hash[b] is not None, f"evictable block {b} has no hash"
        for h, b in self._cached.items():
            assert self._hash[b] == h, f"cached hash maps to block {b} that has another hash"
        assert sum(1 for h in self._hash if h is not None) == len(self._cached), "hashed blocks missing from the cache map"
        assert self.num_used + len(free) + len(evictable) == self.num_blocks, "block counts do not add up"
        assert sum(1 for r in self._ref if r > 0) == self.num_used, "used count disagrees with ref counts"
        for seq, table in self._tables.items():
            assert len(self._chains[seq]) <= len(table), f"sequence {seq!r} has more hashes than blocks"
