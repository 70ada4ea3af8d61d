"""The K/V rows of the ``gqa`` runner: one row ("slot") per running sequence, kept in step with the block pool.

``pool`` [2 x layers, num_blocks, kv_heads, block_size, head_dim] is the source of truth (prefix caching,
preemption and recompute read it); ``kv`` [2 x layers, slots, kv_heads, cap, head_dim] holds each sequence's
positions contiguously, so GroupQueryAttention reads and appends them in place. This module owns which slot holds
which sequence, the copies between pool and rows (a prompt's K/V after its call, decode K/V a block at a time, a
row's unwritten tail before anything overwrites or drops it), and the rows' shape within their budget
(``slots x cap <= row_tokens``: docs/serving.md, "One KV budget"). serve/runners/gqa.py runs the calls.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from serve.runners.protocol import RunnerError, RunRow

log = logging.getLogger(__name__)

CAP_STEP = 256


@dataclass(slots=True)
class Slot:
    """One row of the K/V rows buffer: whose sequence it holds and how much of it.

    Invariant: ``flushed <= valid``; positions [0, valid) of the occupant ``key`` are in the row, and [0, flushed)
    are in its blocks of the pool too (decode K/V reaches the pool a block at a time: KvRows.flush writes
    [flushed, valid) with ``table``, the occupant's block table, the engine's live list). A free slot has no key,
    nothing valid and no table. ``used`` is the step that last used it (least recently used goes first)."""

    key: Hashable | None = None
    valid: int = 0
    flushed: int = 0
    table: Sequence[int] | None = None
    used: int = 0

    def hold(self, key: Hashable, table: Sequence[int] | None, valid: int, flushed: int, used: int) -> None:
        if flushed > valid:
            raise RunnerError(f"slot of {key!r}: {flushed} positions flushed of {valid} valid")
        self.key, self.table, self.valid, self.flushed, self.used = key, table, valid, flushed, used

    def truncate(self, cap: int) -> None:
        """The rows buffer shrank to ``cap`` positions."""
        self.valid, self.flushed = min(self.valid, cap), min(self.flushed, cap)

    def clear(self) -> None:
        self.key, self.table, self.valid, self.flushed = None, None, 0, 0


class KvRows:
    """The pool and the rows, on ``store`` (host arrays, or GPU tensors for the CUDA form: serve/kv/device.py)."""

    def __init__(self, store, dtype, *, n_kv: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 max_slots: int, max_len: int, row_tokens: int, bytes_per_token: int):
        self.store, self.dtype, self.block_size = store, dtype, block_size
        self.n_kv, self.kv_heads, self.head_dim = n_kv, kv_heads, head_dim
        self.max_slots, self.max_len, self.row_tokens = max_slots, max_len, row_tokens
        self.bytes_per_token = bytes_per_token
        self.pool = store.zeros((self.n_kv, num_blocks, self.kv_heads, block_size, self.head_dim))
        self.slots = 0
        self.cap = 0
        self.kv = store.zeros((self.n_kv, 0, self.kv_heads, 0, self.head_dim))
        self.slot: list[Slot] = []  # one per row of the buffer
        self.reshapes = 0
        self.peak_kv_bytes = self.kv_bytes()  # most KV bytes (pool + rows) held at once, copies included
        self.tick = 0  # the runner's step count: a slot's `used`
        self.gathered_tokens = 0  # positions copied from the pool into rows (prefix hits, refills)
        self.moved_tokens = 0  # positions copied between rows (a decode row moving below B)

    # ---- memory ----------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes held for K/V now: the block pool plus the rows."""
        return int(self.pool.nbytes + self.kv.nbytes)

    def kv_budget_bytes(self) -> int:
        """The most ``kv_bytes`` can reach: the pool plus the rows' share."""
        return int(self.pool.nbytes + self.row_tokens * self.bytes_per_token)

    def trim(self, longest: int) -> None:
        """Give row memory back: all of it when ``longest`` (the longest running sequence) is 0, else shrink
        to ``longest`` rounded up once that is at most half the current length axis."""
        if longest <= 0:
            if self.store.numel(self.kv):
                self.reshape(0, 0)
            return
        if not self.cap or -(-longest // CAP_STEP) * CAP_STEP > self.cap // 2:
            return  # the common case, checked cheaply: no shrink
        slots, cap = self.layout(self.slots, min(longest, self.max_len))
        if cap <= self.cap // 2:
            self.reshape(slots, cap)

    def layout(self, rows: int, need: int) -> tuple[int, int]:
        """(slots, cap) for a step of ``rows`` rows, the longest reaching position ``need``."""
        if need > self.max_len:
            raise RunnerError(f"a sequence needs {need} positions; max_model_len is {self.max_len}")
        cap = min(self.max_len, -(-need // CAP_STEP) * CAP_STEP, self.row_tokens // max(rows, 1))
        if cap < need:
            raise RunnerError(f"{rows} rows up to position {need} need {rows * need} row positions; the KV rows "
                              f"hold {self.row_tokens} (the scheduler keeps steps within that)")
        # Slots for the traffic there is, rounded up to a power of two (at most log2(max_batch_size) reshapes as
        # it grows), not for as many sequences as the budget could hold: the rows are written in full once
        # bound, so every unused slot would be resident memory (docs/serving.md, "One KV budget").
        grow = 1 << (rows - 1).bit_length() if rows > 0 else 1
        return max(rows, min(self.max_slots, self.row_tokens // cap, grow)), cap

    def ensure(self, rows: int, need: int) -> None:
        if need <= self.cap and rows <= self.slots:
            return
        self.reshape(*self.layout(rows, need))

    def reshape(self, slots: int, cap: int) -> None:
        self.flush_all()  # what a reshape drops or truncates is then in the pool, the source of truth
        old, n_old = self.kv, self.slots
        shape = (self.n_kv, slots, self.kv_heads, cap, self.head_dim)
        new_bytes = int(np.prod(shape)) * np.dtype(self.dtype).itemsize
        keep = self.store.numel(old) > 0 and slots > 0 and cap > 0 and \
            old.nbytes + new_bytes <= self.row_tokens * self.bytes_per_token
        if not keep:  # drop the old rows before allocating: the rows never hold more than row_tokens
            # an empty array, not None: /metrics reads kv_bytes() from another thread at any moment
            self.kv, old = self.store.zeros((0,)), None
        new = self.store.zeros(shape)
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.pool.nbytes + new_bytes + (old.nbytes if keep else 0))
        m = min(n_old, slots)
        if keep:
            c = min(self.cap, cap)
            new[:, :m, :, :c] = old[:, :m, :, :c]
            for sl in self.slot[:m]:
                sl.truncate(cap)
            self.slot = self.slot[:m] + [Slot() for _ in range(slots - m)]
        else:  # refilled from the pool when next used
            self.slot = [Slot() for _ in range(slots)]
        del old
        self.kv, self.slots, self.cap = new, slots, cap
        self.reshapes += 1
        log.info("GQA KV rows: %d rows x %d positions (%.1f MiB of %.1f MiB for rows; %s)", slots, cap,
                 new_bytes / 2**20, self.row_tokens * self.bytes_per_token / 2**20,
                 "copied" if keep else "refilled from the pool")

    # ---- which slot holds what ---------------------------------------------------------------
    def gather(self, slot: int, r: RunRow, valid: int) -> None:
        """Copy positions [valid, r.start) of the row's sequence from its blocks into the slot."""
        bs = self.block_size
        j0, j1 = valid // bs, -(-r.start // bs)
        g = self.store.block_rows(self.pool, r.block_table[j0:j1])  # [n_kv, H, (j1 - j0) * bs, D]
        self.kv[:, slot, :, valid:r.start, :] = g[:, :, valid - j0 * bs:r.start - j0 * bs, :]
        self.gathered_tokens += r.start - valid

    def fill(self, slot: int, r: RunRow) -> None:
        """Make the slot hold r's sequence up to r.start (keeps what is already valid there)."""
        sl = self.slot[slot]
        mine = sl.key == r.key
        if not mine:
            self.flush(slot)  # the occupant's unwritten positions go to its blocks before they are overwritten
        valid = min(sl.valid if mine else 0, r.start)
        flushed = min(sl.flushed if mine else 0, valid)
        if valid < r.start:
            self.gather(slot, r, valid)
            if flushed == valid:  # [0, valid) was in the pool, and [valid, start) came from it
                flushed = r.start
        sl.hold(r.key, r.block_table, r.start, flushed, self.tick)

    def place_decode(self, rows: list[RunRow]) -> None:
        """Put decode row i in slot i's range [0, B): keep slots already there, move or gather the others."""
        B = len(rows)
        where = {sl.key: s for s, sl in enumerate(self.slot) if sl.key is not None}
        target: list[int | None] = [None] * B
        for i, r in enumerate(rows):
            s = where.get(r.key)
            if s is not None and s < B:
                target[i] = s
        taken = {t for t in target if t is not None}
        free = [s for s in range(B) if s not in taken]
        free.sort(key=lambda s: self.slot[s].used)  # overwrite the least recently used first
        for i, r in enumerate(rows):
            if target[i] is not None:
                continue
            t = free.pop(0)
            s = where.get(r.key)
            if s is not None:  # s >= B: copy the valid prefix within the buffer (cheaper than the pool)
                self.flush(t)
                src = self.slot[s]
                n = min(src.valid, r.start)
                self.kv[:, t, :, :n] = self.kv[:, s, :, :n]
                self.moved_tokens += n
                self.slot[t].hold(r.key, src.table, n, min(src.flushed, n), self.slot[t].used)
                src.clear()
            target[i] = t
        # Reorder so that rows[i] sits in slot i (the batch row of the call).
        order = sorted(range(B), key=lambda i: target[i])
        rows[:] = [rows[i] for i in order]
        for i, r in enumerate(rows):
            self.fill(i, r)

    def slot_for_prefill(self, r: RunRow, reserved: int) -> int:
        for s in range(reserved, self.slots):
            if self.slot[s].key == r.key:
                return s
        choices = [s for s in range(reserved, self.slots) if self.slot[s].used != self.tick or self.slot[s].key is None]
        if not choices:
            raise RunnerError(f"more rows in one step than the runner's {self.slots} KV rows (max_batch_size)")
        return min(choices, key=lambda s: (self.slot[s].key is not None, self.slot[s].used))

    def fresh_slots(self, n: int, reserved: int, others: list[RunRow]) -> int | None:
        """The first slot of ``n`` adjacent slots at or above ``reserved`` (the decode rows' range) that hold none
        of ``others`` (this step's other prefill rows, which keep their slots); None when there is no such run."""
        keep = {s for s in range(reserved, self.slots) if self.slot[s].key in {r.key for r in others}}
        for base in range(reserved, self.slots - n + 1):
            if not keep.intersection(range(base, base + n)):
                return base
        return None

    def start_prompts(self, base: int, rows: Sequence[RunRow]) -> None:
        """Slots [base, base + n) now hold these first prompts, nothing valid yet (their occupants flushed)."""
        for k, r in enumerate(rows):
            self.flush(base + k)
            self.slot[base + k].hold(r.key, r.block_table, 0, 0, self.tick)

    # ---- rows -> pool ------------------------------------------------------------------------
    def decoded(self, rows: Sequence[RunRow]) -> None:
        """Decode rows 0..B-1 each wrote one position. The new K/V stays in the rows until its block is full, then
        the block's positions go to the pool in one copy: writing each position as it came was one strided copy per
        row per step, 7 % of a server step at 32 users (benchmarks/history.md run 10). Prefix caching publishes
        only full blocks, and a slot's unwritten tail is flushed before anything overwrites or drops it."""
        bs = self.block_size
        for i, r in enumerate(rows):
            self.slot[i].valid = r.start + 1
            self.slot[i].table = r.block_table
            if (r.start + 1) % bs == 0:
                self.flush(i)

    def flush(self, slot: int) -> None:
        """Write the slot's valid positions that the pool does not hold yet into its occupant's blocks."""
        sl = self.slot[slot]
        if sl.key is not None and sl.flushed < sl.valid:
            self.write_back(slot, sl.table, sl.flushed, sl.valid - sl.flushed)

    def flush_all(self) -> None:
        for slot in range(self.slots):
            self.flush(slot)

    def release(self, key: Hashable) -> None:
        """The engine freed ``key``'s blocks (finished, cancelled or preempted): its slot's content is dead, and
        its unwritten positions must never be flushed into blocks that may already belong to another sequence."""
        for sl in self.slot:
            if sl.key == key:
                sl.clear()

    def write_back(self, slot: int, block_table: Sequence[int], s: int, n: int) -> None:
        """Copy positions [s, s + n) of the slot into the sequence's blocks; the slot then holds s + n valid, all
        of them in the pool."""
        bs = self.block_size
        pos = s
        while pos < s + n:
            b = block_table[pos // bs]
            o = pos % bs
            m = min(bs - o, s + n - pos)
            self.pool[:, b, :, o:o + m, :] = self.kv[:, slot, :, pos:pos + m, :]
            pos += m
        self.slot[slot].valid = self.slot[slot].flushed = s + n
