"""Runner backend for attention layout ``gqa``: in-place KV rows for ``com.microsoft.GroupQueryAttention``.

Implements serve/runners/protocol.ModelRunner, as serve.runners.standard.Runner does, so the engine, scheduler
and block manager do not change.

Storage
  ``pool`` [2 x layers, num_blocks, kv_heads, block_size, head_dim]: the block pool, exactly as
  in the standard runner; it stays the source of truth, so prefix caching, preemption and
  recompute work unchanged. A prompt's K/V is written to it after its call; a decode row's K/V
  when the row fills a block (one copy per block instead of one per token), and a row's unwritten
  tail before anything overwrites or drops the row. A sequence the engine frees (``release``) is
  dropped with its tail: its blocks may already belong to another sequence.
  ``kv`` [2 x layers, slots, kv_heads, cap, head_dim]: one row ("slot") per sequence; ``kv[j, :B]``
  is a contiguous [B, kv_heads, cap, head_dim] tensor bound as layer j's past *and* present, so
  GroupQueryAttention appends the new K/V in place at ``seqlens_k`` and reads the past where it
  lies: no per-step gather into a padded batch and no concat of past and new.
  Both live in host memory on the CPU EP, in GPU memory on the CUDA EP for the CUDA form (serve/kv/device.py:
  the same indexing on numpy arrays or torch tensors, bound to ORT by pointer).
  A slot remembers which sequence (request id + admission epoch) it holds and how many positions
  are valid. A sequence seen for the first time (or whose slot was taken) is filled from its
  blocks: that is also how a prefix-cache hit lands in the row (the cached blocks are copied in).

Calls
  Decode rows (1 new token) run in one call over slots ``0..B-1``: a decode row whose slot is
  not below B moves there (copied from its old slot, else gathered from the pool). Prompts that
  start at position 0 (no prefix hit, first chunk) run together in one call on adjacent slots,
  right-padded (GroupQueryAttention's batch of first prompts). Other prefill chunks run one per
  call, batch 1 on their own slot (GroupQueryAttention with a past takes ``sequence_length > 1``
  only at batch 1). Prefill calls ask for the last positions' logits only (``logits_to_keep``).

Memory bound (docs/serving.md, "One KV budget")
  The rows hold at most ``row_tokens`` positions in all (``slots x cap <= row_tokens``), a share of
  ``serve.kv_memory_mb`` that the engine sets aside from the pool's budget, so pool + rows never
  exceed the budget. The scheduler keeps every step within it (rows x longest row <= row_tokens).
  The shape follows the step: ``cap`` is the longest row rounded up to 256 positions (less when
  that many rows would not fit), ``slots`` as many as fit (at most max_batch_size). A reshape
  copies what the old buffer held when old + new fit in ``row_tokens``, else it drops the old
  buffer first and the rows are refilled from the pool (the source of truth). ``trim`` (called by
  the engine after every step with the longest running sequence) gives the memory back: all of
  it when nothing runs, down to the needed length once that is at most half of ``cap``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from serve.artifact import graph_bytes
from serve.kv.device import kv_store
from serve.runners.onnx_session import artifact_session
from serve.runners.onnx_session import CPU, CUDA
from serve.runners.protocol import RunnerBase, RunnerError, RunRow
from serve.runners.standard import kv_spec

log = logging.getLogger(__name__)

CAP_STEP = 256


def balanced_cut(lens: Sequence[int], head_share: float) -> int:
    """Where to cut ``lens`` (ascending prompt lengths, at least two) into two calls that run at once, so that the
    longer of the two ends first: a call costs its rows x (its padded length + its kept logits positions x
    ``head_share``, the lm_head's multiply-adds per position over the rest of the model's). Cut at n // 2, one
    long prompt padded half the wave to its length and widened that call's logits to its span: 32 chat prompts,
    one of them 8x longer, took 9.6 s against 1.5 s (benchmarks/history.md run 15)."""
    n = len(lens)

    def work(lo: int, hi: int) -> float:
        longest = lens[hi - 1]
        return (hi - lo) * (longest + (longest - lens[lo] + 1) * head_share)

    return min(range(1, n), key=lambda k: (max(work(0, k), work(k, n)), abs(n - 2 * k)))


# The split decode's second session is a second copy of the weights: worth 5-16 % tokens/s for SmolLM2 or a 1B
# (0.2-1.5 GB), not 8.6 GB more for a 7B, whose server would then hold twice its INT8 weights.
SPLIT_MAX_WEIGHT_BYTES = 2 * 2**30


@dataclass(slots=True)
class Slot:
    """One row of the K/V rows buffer: whose sequence it holds and how much of it.

    Invariant: ``flushed <= valid``; positions [0, valid) of the occupant ``key`` are in the row, and [0, flushed)
    are in its blocks of the pool too (decode K/V reaches the pool a block at a time: GqaRunner._flush writes
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


class _PromptCall(NamedTuple):
    """One call of _run_first_prompts: its binding, the rows (indexes into the step's first prompts) on slots from
    ``first_slot`` (relative to the base), their lengths, the logits and the first position kept in them."""

    binding: object
    rows: list[int]
    first_slot: int
    lens: list[int]
    logits: np.ndarray
    first_kept: int
    inputs: tuple  # (ids, seqlens): the binding points at them until the call has run


class GqaRunner(RunnerBase):
    """Owns the ORT session, the block pool and the per-sequence KV rows; ``execute`` runs one step."""

    def __init__(self, artifact_dir: str | Path, manifest: dict, num_blocks: int, block_size: int, *,
                 providers: Sequence[str] = (CUDA, CPU), intra_op_threads: int = 0, ort_spinning: str = "during_runs",
                 max_batch_size: int = 16, max_model_len: int | None = None, row_tokens: int | None = None,
                 decode_split_rows: int = 0, kv_store_setting: str = "auto", uniform_kernels: bool = False):
        layout = manifest.get("attention_layout")
        if layout != "gqa":
            raise RunnerError(f"attention layout {layout!r}: GqaRunner runs 'gqa' artifacts (serve.runners.standard.Runner runs 'standard')")
        self.dtype, self.past_names, self.present_names = kv_spec(manifest)
        super().__init__(artifact_dir, manifest, num_blocks, block_size, providers, intra_op_threads, ort_spinning)
        self.max_len = int(max_model_len or manifest.get("max_positions") or 2048)
        self.uniform_kernels = bool(uniform_kernels)  # serve.uniform_kernels
        # The pool and the rows: host arrays on the CPU EP, GPU tensors for the CUDA form on the CUDA EP
        self.store = kv_store(kv_store_setting, self.provider, self.dtype)
        if self.provider != CPU and self.store.ort_device == "cpu":
            # an fp32-cache graph on the CUDA EP: ORT runs its GroupQueryAttention on the CPU (CUDA's takes fp16)
            log.warning("%s serves this %s-cache graph with its K/V in host memory, copied every call; build "
                        "the CUDA form (quantize.target: cuda) to keep it on the GPU", self.provider, self.dtype.__name__)
        self.has_logits_to_keep = "logits_to_keep" in {i.name for i in self.session.get_inputs()}
        # The lm_head's work per kept position over the rest of a position's (see balanced_cut); 0 when every
        # position's logits are computed anyway, or the manifest does not say.
        head = int(manifest.get("vocab_size") or 0) * int(manifest.get("hidden_size") or 0)
        rest = int(manifest.get("num_parameters") or 0) - head
        self._head_share = head / rest if self.has_logits_to_keep and head and rest > 0 else 0.0
        n_kv = self.n_kv
        self.pool = self.store.zeros((n_kv, num_blocks, self.kv_heads, block_size, self.head_dim))
        self.max_slots = int(max_batch_size)
        # None = the old unbounded behaviour (every slot at the longest length), for direct users of the runner.
        self.row_tokens = int(row_tokens) if row_tokens else self.max_slots * self.max_len
        if self.row_tokens < 1:
            raise RunnerError(f"row_tokens {self.row_tokens}: the KV rows need room for at least one position")
        self.slots = 0
        self.cap = 0
        self.kv = self.store.zeros((n_kv, 0, self.kv_heads, 0, self.head_dim))
        self.slot: list[Slot] = []  # one per row of the buffer
        self.reshapes = 0
        self.peak_kv_bytes = self.kv_bytes()  # most KV bytes (pool + rows) held at once, copies included
        # logits buffers, reused call after call: one for decode calls, whose rows execute returns as views (valid
        # until the next execute; the engine samples them at once), one for prefill calls in the same step
        self._logits = {"decode": np.zeros(0, np.float32), "prefill": np.zeros(0, np.float32)}
        # The decode call's IOBinding and its input arrays, kept while the rows' buffer, the batch size and the
        # logits buffer stay the same: rebinding 2 x layers K/V pointers every token cost ~1 ms on this CPU.
        self._decode_key: tuple | None = None
        self._decode_parts: list[tuple] = []
        self._artifact = (artifact_dir, manifest)
        self._setup_split(intra_op_threads, decode_split_rows, graph_bytes(manifest))
        self._tick = 0
        self.gathered_tokens = 0  # positions copied from the pool into rows (prefix hits, refills)
        self.moved_tokens = 0  # positions copied between rows (a decode row moving below B)
        self.batched_prompts = 0  # prompts that ran in a call with other first prompts (_run_first_prompts)

    def _setup_split(self, intra_op_threads: int, decode_split_rows: int, weights: int) -> None:
        """From ``decode_split_rows`` decode rows on, two halves at once on a session with half the threads (see
        _halves): on the CPU EP with two threads or more, and for graphs small enough to hold twice."""
        threads = intra_op_threads or len(os.sched_getaffinity(0))
        self._half_threads = max(1, threads // 2)
        self.decode_split_rows = int(decode_split_rows) if self.provider == CPU and threads >= 2 else 0
        if self.decode_split_rows and weights > SPLIT_MAX_WEIGHT_BYTES:
            log.info("decode split off: its second session would hold a second copy of the graph's %.2f GiB of "
                     "weights (split only up to %.0f GiB)", weights / 2**30, SPLIT_MAX_WEIGHT_BYTES / 2**30)
            self.decode_split_rows = 0
        self._half_session = None
        self._half_exec: ThreadPoolExecutor | None = None
        self.split_steps = 0  # decode steps run as two halves
        self.split_prompt_calls = 0  # first-prompt batches run as two halves
        if self.decode_split_rows and self.max_slots >= self.decode_split_rows:
            self._halves()  # at start-up, not in the middle of serving (a session load is a pause of its own)

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
                self._reshape(0, 0)
            return
        if not self.cap or -(-longest // CAP_STEP) * CAP_STEP > self.cap // 2:
            return  # the common case, checked cheaply: no shrink
        slots, cap = self._layout(self.slots, min(longest, self.max_len))
        if cap <= self.cap // 2:
            self._reshape(slots, cap)

    # ---- buffers ---------------------------------------------------------------------------
    def _layout(self, rows: int, need: int) -> tuple[int, int]:
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

    def _ensure(self, rows: int, need: int) -> None:
        if need <= self.cap and rows <= self.slots:
            return
        self._reshape(*self._layout(rows, need))

    def _reshape(self, slots: int, cap: int) -> None:
        self._flush_all()  # what a reshape drops or truncates is then in the pool, the source of truth
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

    def _logits_buf(self, shape: tuple[int, ...], use: str = "prefill") -> np.ndarray:
        n = int(np.prod(shape))
        buf = self._logits[use]
        if n > buf.size:
            buf = self._logits[use] = np.zeros(max(n, int(buf.size * 1.5)), np.float32)
        return buf[:n].reshape(shape)

    def _gather(self, slot: int, r: RunRow, valid: int) -> None:
        """Copy positions [valid, r.start) of the row's sequence from its blocks into the slot."""
        bs = self.block_size
        j0, j1 = valid // bs, -(-r.start // bs)
        g = self.store.block_rows(self.pool, r.block_table[j0:j1])  # [n_kv, H, (j1 - j0) * bs, D]
        self.kv[:, slot, :, valid:r.start, :] = g[:, :, valid - j0 * bs:r.start - j0 * bs, :]
        self.gathered_tokens += r.start - valid

    def _fill(self, slot: int, r: RunRow) -> None:
        """Make the slot hold r's sequence up to r.start (keeps what is already valid there)."""
        sl = self.slot[slot]
        mine = sl.key == r.key
        if not mine:
            self._flush(slot)  # the occupant's unwritten positions go to its blocks before they are overwritten
        valid = min(sl.valid if mine else 0, r.start)
        flushed = min(sl.flushed if mine else 0, valid)
        if valid < r.start:
            self._gather(slot, r, valid)
            if flushed == valid:  # [0, valid) was in the pool, and [valid, start) came from it
                flushed = r.start
        sl.hold(r.key, r.block_table, r.start, flushed, self._tick)

    def _place_decode(self, rows: list[RunRow]) -> None:
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
                self._flush(t)
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
            self._fill(i, r)

    def _slot_for_prefill(self, r: RunRow, reserved: int) -> int:
        for s in range(reserved, self.slots):
            if self.slot[s].key == r.key:
                return s
        choices = [s for s in range(reserved, self.slots) if self.slot[s].used != self._tick or self.slot[s].key is None]
        if not choices:
            raise RunnerError(f"more rows in one step than the runner's {self.slots} KV rows (max_batch_size)")
        return min(choices, key=lambda s: (self.slot[s].key is not None, self.slot[s].used))

    # ---- the step --------------------------------------------------------------------------
    def execute(self, rows: Sequence[RunRow]) -> list[np.ndarray | None]:
        """Compute the rows' new tokens, write their K/V to the pool; last-position logits per row."""
        t0 = time.perf_counter()
        self._tick += 1
        if len(rows) > self.max_slots:
            raise RunnerError(f"{len(rows)} rows in one step; this runner has {self.max_slots} KV rows (max_batch_size)")
        for r in rows:
            if len(r.token_ids) < 1:
                raise RunnerError("a scheduled row has no tokens")
        need = max(r.start + len(r.token_ids) for r in rows)
        lone = self._lone_decode(rows, need)
        self._ensure(len(rows), max(need, lone.start + 2) if lone is not None else need)
        out: list[np.ndarray | None] = [None] * len(rows)
        index = {id(r): i for i, r in enumerate(rows)}
        decode = [r for r in rows if len(r.token_ids) == 1 and r is not lone]
        prefill = [r for r in rows if len(r.token_ids) > 1 or r is lone]
        if decode:
            self._place_decode(decode)  # reorders `decode` to slot order
            logits = self._run_decode(decode)
            for k, r in enumerate(decode):
                i = index[id(r)]
                # a view: 32 rows x 49,152 floats copied every step was ~0.8 ms (benchmarks/history.md run 10)
                out[i] = logits[k][None].copy() if r.all_logits else logits[k] if r.want_logits else None
        fresh = [r for r in prefill if r.start == 0 and not r.all_logits]
        rest = [r for r in prefill if r.start > 0 or r.all_logits]
        base = self._fresh_slots(len(fresh), len(decode), rest) if len(fresh) > 1 else None
        if base is not None:
            for r, lg in zip(fresh, self._run_first_prompts(base, fresh)):
                out[index[id(r)]] = lg if r.want_logits else None
            prefill = rest
        for r in prefill:
            slot = self._slot_for_prefill(r, len(decode))
            self._fill(slot, r)
            if r is lone:  # its token twice; the second position's K/V is not kept
                two = RunRow(r.key, r.block_table, r.start, [r.token_ids[0]] * 2, want_logits=True, all_logits=True)
                lg = self._run_prefill(slot, two, write=1)[:1]
            else:
                lg = self._run_prefill(slot, r)
            out[index[id(r)]] = lg.copy() if r.all_logits else lg[-1].copy() if r.want_logits else None
        self.step_seconds += time.perf_counter() - t0
        return out

    def _lone_decode(self, rows: Sequence[RunRow], need: int) -> RunRow | None:
        """serve.uniform_kernels: the step's one decode row, to run as a two-position chunk through the multi-row
        kernels that prompt chunks and drafted checks run (ONNX Runtime's one-row kernels round otherwise on int8
        activations); None without one, or without room for its second position (the context's last position)."""
        if not self.uniform_kernels:
            return None
        decode = [r for r in rows if len(r.token_ids) == 1]
        if len(decode) != 1 or decode[0].start == 0:
            return None
        end = decode[0].start + 2
        return decode[0] if end <= self.max_len and len(rows) * max(need, end) <= self.row_tokens else None

    def _bind(self, kv: np.ndarray, input_ids: np.ndarray, seqlens_k: np.ndarray, logits: np.ndarray,
              keep: int | None, total: int | None = None, session=None):
        """A binding of one call on ``session`` (default: the main one) over the rows ``kv`` [n_kv, n, ...]."""
        binding = (session or self.session).io_binding()
        binding.bind_cpu_input("input_ids", input_ids)
        binding.bind_cpu_input("seqlens_k", seqlens_k)
        binding.bind_cpu_input("total_sequence_length", np.array(total or int(seqlens_k.max()) + 1, np.int32))
        if self.has_logits_to_keep:
            binding.bind_cpu_input("logits_to_keep", np.array([keep or 0], np.int64))
        self._bind_rows(binding, kv, logits)
        return binding

    def _bind_rows(self, binding, kv: np.ndarray, logits: np.ndarray) -> None:
        """Bind the rows ``kv`` [n_kv, n, ...] as every layer's past and present, and ``logits`` as the output."""
        shape = [kv.shape[1], self.kv_heads, self.cap, self.head_dim]
        dev = self.store.ort_device
        for j, (pin, pout) in enumerate(zip(self.past_names, self.present_names)):
            ptr = self.store.ptr(kv[j])
            # One pointer for past and present: GroupQueryAttention writes the new K/V in place.
            binding.bind_input(pin, dev, 0, self.dtype, shape, ptr)
            binding.bind_output(pout, dev, 0, self.dtype, shape, ptr)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)

    def _bind_and_run(self, kv: np.ndarray, input_ids: np.ndarray, seqlens_k: np.ndarray, logits: np.ndarray,
                      keep: int | None, total: int | None = None) -> None:
        binding = self._bind(kv, input_ids, seqlens_k, logits, keep, total)
        t = time.perf_counter()
        self.store.sync()
        self.session.run_with_iobinding(binding)
        self.store.after_run(binding)
        self.run_seconds += time.perf_counter() - t
        self.calls += 1

    def _run(self, calls: list[tuple]) -> None:
        """Run [(session, binding)]: one here, or two at once, the second on the worker thread (onnxruntime releases
        the GIL while it runs, so the halves use both cores)."""
        t = time.perf_counter()
        self.store.sync()
        other = self._half_exec.submit(calls[1][0].run_with_iobinding, calls[1][1]) if len(calls) == 2 else None
        calls[0][0].run_with_iobinding(calls[0][1])
        if other is not None:
            other.result()
        for _, binding in calls:
            self.store.after_run(binding)
        self.run_seconds += time.perf_counter() - t

    def _halves(self):
        """The session for split decode steps: half the intra-op threads, run by two threads at once (this one and
        a worker), each on half the rows. On 2 cores (one thread each) that beat one call on two threads by 5-16 %
        in wall time and 10-25 % in CPU time at 32-64 rows (benchmarks/history.md, run 10): the ~300 small ops of a
        step no longer hand work between threads. It costs a second copy of the weights, so it is made only when
        max_batch_size reaches decode_split_rows."""
        if self._half_session is None:
            self._half_session = artifact_session(*self._artifact, [CPU], self._half_threads,
                                                  spinning="off" if self._half_threads == 1 else "during_runs")
            self._half_exec = ThreadPoolExecutor(1, thread_name_prefix="decode-half")
        return self._half_session

    def _decode_call(self, B: int, logits: np.ndarray) -> list[tuple]:
        """The decode bindings for ``B`` rows: [(session, binding, inputs, lo, hi)], one part, or two halves from
        ``decode_split_rows`` rows on. Made when the rows' buffer, B or the logits buffer changed; the caller
        fills the input arrays in place before each run."""
        split = bool(self.decode_split_rows) and B >= self.decode_split_rows
        key = (self.store.ptr(self.kv), tuple(self.kv.shape), B, logits.ctypes.data, logits.shape, split)
        if key != self._decode_key:
            cuts = [(0, B // 2), (B // 2, B)] if split else [(0, B)]
            session = self._halves() if split else self.session
            parts = []
            for lo, hi in cuts:
                view = self.kv[:, lo:hi]
                assert self.store.contiguous(view[0])
                n = hi - lo
                inputs = {"input_ids": np.zeros((n, 1), np.int64), "seqlens_k": np.zeros(n, np.int32),
                          "total_sequence_length": np.zeros((), np.int32)}
                if self.has_logits_to_keep:
                    inputs["logits_to_keep"] = np.zeros(1, np.int64)  # 0: every position, which is the one
                binding = session.io_binding()
                for name, arr in inputs.items():
                    binding.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
                self._bind_rows(binding, view, logits[lo:hi])
                parts.append((session, binding, inputs, lo, hi))
            self._decode_key, self._decode_parts = key, parts
        return self._decode_parts

    def _run_decode(self, rows: list[RunRow]) -> np.ndarray:
        B = len(rows)
        starts = np.array([r.start for r in rows], dtype=np.int64)
        logits = self._logits_buf((B, 1, self.vocab_size), "decode")
        parts = self._decode_call(B, logits)
        ids = [r.token_ids[0] for r in rows]
        for _, binding, inputs, lo, hi in parts:
            inputs["input_ids"][:, 0] = ids[lo:hi]
            inputs["seqlens_k"][:] = starts[lo:hi]
            inputs["total_sequence_length"][()] = int(starts[lo:hi].max()) + 1
            if self.provider != CPU:
                # ORT copies a host input to the device when it is bound, not when the call runs (the first CUDA
                # run decoded token 0 at position 0 every step): bind this step's values; the K/V stay bound
                for name, arr in inputs.items():
                    binding.bind_cpu_input(name, arr)
        self._run([(session, binding) for session, binding, *_ in parts])
        self.split_steps += int(len(parts) == 2)
        self.calls += 1
        # The new K/V stays in the rows until its block is full, then the block's positions go to the pool in one
        # copy (_flush): writing each position as it came was one strided copy per row per step, 7 % of a server
        # step at 32 users (benchmarks/history.md run 10). Prefix caching publishes only full blocks, and a slot's
        # unwritten tail is flushed before anything overwrites or drops it.
        bs = self.block_size
        for i, r in enumerate(rows):
            self.slot[i].valid = r.start + 1
            self.slot[i].table = r.block_table
            if (r.start + 1) % bs == 0:
                self._flush(i)
        return logits[:, 0, :]

    def _fresh_slots(self, n: int, reserved: int, others: list[RunRow]) -> int | None:
        """The first slot of ``n`` adjacent slots at or above ``reserved`` (the decode rows' range) that hold none
        of ``others`` (this step's other prefill rows, which keep their slots); None when there is no such run."""
        keep = {s for s in range(reserved, self.slots) if self.slot[s].key in {r.key for r in others}}
        for base in range(reserved, self.slots - n + 1):
            if not keep.intersection(range(base, base + n)):
                return base
        return None

    def _run_first_prompts(self, base: int, rows: list[RunRow]) -> list[np.ndarray]:
        """Prompts that start at position 0, together on slots [base, base + n): right-padded to the longest,
        ``seqlens_k`` = each length - 1, total_sequence_length = the padded length, which GroupQueryAttention
        reads as a batch of first prompts (each row attends within its own length). One call instead of one per
        prompt: at 32 users a wave of new requests was 32 batch-1 calls, each paying the step's fixed cost (the
        weights read once per call). The padding's K/V lands beyond each row's length, where the next decode
        write and ``seqlens_k`` keep it from being read; it is not written back to the pool.
        Sorted by length and, where the split session exists, as two calls at once (the shorter prompts and the
        longer, each padded only to its own longest, cut where the two calls' work is even: balanced_cut): 8 %
        faster for 32 chat prompts on 2 cores than one call, less padding.
        Returns each row's last-position logits, in the order of ``rows``."""
        n = len(rows)
        self.batched_prompts += n
        order = sorted(range(n), key=lambda i: len(rows[i].token_ids))
        for k, i in enumerate(order):
            slot, r = base + k, rows[i]
            self._flush(slot)
            self.slot[slot].hold(r.key, r.block_table, 0, 0, self._tick)
        split = self._half_session is not None and n >= 4
        cut = balanced_cut([len(rows[i].token_ids) for i in order], self._head_share) if split else n
        groups = [order[:cut], order[cut:]] if split else [order]
        calls, starts = [], [0, cut] if split else [0]
        for g, k0 in zip(groups, starts):
            lens = [len(rows[i].token_ids) for i in g]
            S = max(lens)
            ids = np.zeros((len(g), S), np.int64)
            for b, i in enumerate(g):
                ids[b, :lens[b]] = rows[i].token_ids
            # the positions from the shortest row's last one on: every row's last position is among them
            keep = S - min(lens) + 1 if self.has_logits_to_keep else None
            shape = (len(g), keep or S, self.vocab_size)
            logits = np.empty(shape, np.float32) if split else self._logits_buf(shape)
            seqlens = np.array([m - 1 for m in lens], np.int32)
            binding = self._bind(self.kv[:, base + k0:base + k0 + len(g)], ids, seqlens, logits, keep, S,
                                 self._half_session if split else None)
            calls.append(_PromptCall(binding, g, k0, lens, logits, S - (keep or S), (ids, seqlens)))
        self._run([(self._half_session if split else self.session, c.binding) for c in calls])
        self.split_prompt_calls += int(split)
        self.calls += len(calls)
        out: list[np.ndarray | None] = [None] * n
        for c in calls:
            for b, i in enumerate(c.rows):
                self._write_back(base + c.first_slot + b, rows[i].block_table, 0, c.lens[b])
                out[i] = c.logits[b, c.lens[b] - 1 - c.first_kept].copy()
        return out

    def _flush(self, slot: int) -> None:
        """Write the slot's valid positions that the pool does not hold yet into its occupant's blocks."""
        sl = self.slot[slot]
        if sl.key is not None and sl.flushed < sl.valid:
            self._write_back(slot, sl.table, sl.flushed, sl.valid - sl.flushed)

    def _flush_all(self) -> None:
        for slot in range(self.slots):
            self._flush(slot)

    def release(self, key: Hashable) -> None:
        """The engine freed ``key``'s blocks (finished, cancelled or preempted): its slot's content is dead, and
        its unwritten positions must never be flushed into blocks that may already belong to another sequence."""
        for sl in self.slot:
            if sl.key == key:
                sl.clear()

    def _write_back(self, slot: int, block_table: Sequence[int], s: int, n: int) -> None:
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

    def _run_prefill(self, slot: int, r: RunRow, write: int | None = None) -> np.ndarray:
        """Run r's tokens on its slot; their K/V (the first ``write`` of them) go to its blocks. [kept, vocab]."""
        n, s = len(r.token_ids), r.start
        ids = np.asarray(r.token_ids, dtype=np.int64).reshape(1, n)
        # the last position's logits only, unless the row asks for all of them (prompt log-probs)
        keep = (n if r.all_logits else 1) if self.has_logits_to_keep else None
        logits = self._logits_buf((1, keep or n, self.vocab_size))
        self._bind_and_run(self.kv[:, slot:slot + 1], ids, np.array([s + n - 1], np.int32), logits, keep)
        self._flush(slot)  # a decode tail before this chunk (not expected: chunks come before decoding)
        self._write_back(slot, r.block_table, s, n if write is None else write)
        return logits[0]  # [kept positions, vocab]
