"""One forward step of a scheduled batch on an ONNX Runtime session, over the paged KV pool.

Attention layout ``standard`` (any exported graph: ``past_key_values.N.key/value`` in,
``present.N.key/value`` out). The graph wants one dense past tensor per layer, so each
call *gathers* every row's blocks into right-padded past tensors, runs, and *scatters*
the new K/V back into the blocks.

Storage
  ``pool``: one array ``[2 x layers, num_blocks, kv_heads, block_size, head_dim]``;
  ``pool[2l]`` is layer l's K and ``pool[2l+1]`` its V, each ``[num_blocks, kv_heads, block_size, head_dim]``.

Batching
  Rows of one call must have the same number of new tokens (the graph has one ``seq``
  axis). Decode rows (1 token) all go in one call; prefill chunks are grouped by length
  and equal-length chunks share a call (usually each chunk runs alone). Padding prefill
  chunks to one length would waste compute on pad tokens and, worse, make every decode
  row in a mixed batch pay for the longest chunk, so we do not.

Past tensors (per call group, reused across steps)
  One buffer ``[2 x layers, B_cap, kv_heads, P, head_dim]``; the call passes
  ``buf[j, :B]``, a contiguous view, as layer j's past. ``P`` is the longest row's past
  rounded up to a whole block. Row r holds its sequence's positions ``[0, len_r)`` then
  stale padding up to ``P``; ``attention_mask`` is 1 for ``[0, len_r)`` and for the new
  tokens (which the graph appends after slot ``P``), 0 for the padding, and
  ``position_ids`` are the true positions ``len_r + i``, so RoPE and the causal mask see
  the same thing as an unpadded batch-1 run.
  Rows remember which sequence (and admission epoch) they hold and how much of it is
  valid: a sequence that keeps its row from one step to the next only needs the new
  token written (which the scatter does), not a fresh gather. A full re-gather happens
  when the buffer's shape changes (every ``block_size`` steps of the longest row, or
  when the batch grows), so the gather cost is amortised over a block.
  The buffer memory is a flat array that only grows; views of it are re-shaped in
  place, so steady state allocates nothing (fresh arrays per step cost ~50x the page
  faults on this project's CPU, docs/facts.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence
from pathlib import Path

import numpy as np

from serve.kv.budget import served_kv_dtype
from serve.kv.memory import kv_zeros
from serve.runners.onnx_session import CPU, CUDA, kv_io_names
# The runner interface and the row type stay importable from here (runners, engine, tests).
from serve.runners.protocol import RunnerBase, RunnerError, RunRow

log = logging.getLogger(__name__)


def kv_spec(manifest: dict) -> tuple[type, list[str], list[str]]:
    """The KV pool's numpy dtype (the manifest's kv_dtype, serve.kv.cache's table) and the past/present names."""
    try:
        return getattr(np, served_kv_dtype(manifest)), *kv_io_names(manifest)
    except ValueError as e:
        raise RunnerError(str(e)) from None


class _PastBuffer:
    """Reusable right-padded past tensors for one call group, with per-row content tracking.

    ``limit``: a shared one-element list, the most positions (slots x P) this buffer and its ``peer`` may
    hold together; None = unbounded."""

    def __init__(self, n_kv: int, heads: int, head_dim: int, block_size: int, dtype, limit: int | None = None):
        self.n_kv, self.heads, self.head_dim, self.bs, self.dtype = n_kv, heads, head_dim, block_size, dtype
        self.limit = limit
        self.peer: _PastBuffer | None = None  # the other group's buffer, sharing ``limit``
        self.flat = np.zeros(0, dtype=dtype)
        self.view: np.ndarray | None = None
        self.shape_key: tuple[int, int] = (0, -1)  # (B_cap, P)
        self.rows: list[tuple[Hashable, int]] = []  # per row: (key, valid positions)
        self.gathered_tokens = 0  # counter: positions copied from the pool (cost indicator)
        self.reshapes = 0
        self.cut_short = 0  # calls whose past was not rounded up to a whole block, to stay within ``limit``

    def release(self) -> None:
        """Give the buffer's memory back (nothing runs); the next ``prepare`` allocates afresh."""
        self.flat = np.zeros(0, dtype=self.dtype)
        self.view = None
        self.shape_key = (0, -1)
        self.rows = []

    def _reshape(self, b_cap: int, P: int) -> None:
        """The buffers as [n_kv, b_cap, heads, P, head_dim]: grown (by a quarter at least, within the limit, a peer
        released first when both would not fit), every slot's rows forgotten."""
        limit, per_pos = self.limit, self.n_kv * self.heads * self.head_dim
        need = per_pos * b_cap * P
        if need > self.flat.size:
            size = max(need, int(self.flat.size * 1.25))
            if limit is not None:
                size = min(size, limit * per_pos)
                peer = self.peer
                if peer is not None and peer.flat.size and size + peer.flat.size > limit * per_pos:
                    peer.release()  # its rows are in the pool too: the next call re-gathers them
                self.flat = np.zeros(0, dtype=self.dtype)  # the old buffer goes before the new one comes
            self.flat = kv_zeros((size,), self.dtype)
        self.view = self.flat[:need].reshape(self.n_kv, b_cap, self.heads, P, self.head_dim)
        self.shape_key = (b_cap, P)
        self.rows = [(None, 0)] * b_cap
        self.reshapes += 1

    def _slots(self, rows: Sequence[RunRow]) -> list[int]:
        """A slot in [0, len(rows)) per row: a sequence keeps the slot it had if that slot is in range; the others
        take the remaining slots in order."""
        B = len(rows)
        prev = {key: slot for slot, (key, _) in enumerate(self.rows) if key is not None and slot < B}
        slots: list[int | None] = [prev.get(r.key) for r in rows]
        taken = {s for s in slots if s is not None}
        free = iter(s for s in range(B) if s not in taken)
        return [s if s is not None else next(free) for s in slots]

    def prepare(self, rows: Sequence[RunRow], pool: np.ndarray) -> tuple[list[int], int]:
        """Place rows into buffer slots and make their pasts valid. Returns (slot per row, P)."""
        bs = self.bs
        max_past = max(r.start for r in rows)
        P = -(-max_past // bs) * bs
        B = len(rows)
        limit = self.limit
        if limit is not None and B * P > limit:
            P = max_past  # unrounded: the scheduler keeps rows x longest row end within the limit
            self.cut_short += 1
            if B * P > limit:
                raise RunnerError(f"{B} rows x {P} past positions exceed the past buffers' {limit} positions "
                                  f"(the scheduler should have kept the step within them)")
        b_cap = max(B, self.shape_key[0])
        if limit is not None and b_cap * P > limit:
            b_cap = B  # fewer spare slots rather than more memory
        if (b_cap, P) != self.shape_key:
            self._reshape(b_cap, P)
        slots = self._slots(rows)
        view = self.view
        for i, r in enumerate(rows):
            slot = slots[i]
            key, valid = self.rows[slot]
            if key != r.key:
                valid = 0
            valid = min(valid, r.start)
            if valid < r.start:
                j0, j1 = valid // bs, -(-r.start // bs)
                j_full = min(j1, P // bs)  # P is a whole number of blocks unless the row budget cut it short
                if j_full > j0:
                    blocks = np.asarray(r.block_table[j0:j_full], dtype=np.intp)
                    g = pool[:, blocks]  # [n_kv, nb, H, bs, D]
                    dst = view[:, slot, :, j0 * bs:j_full * bs, :].reshape(self.n_kv, self.heads, j_full - j0, bs,
                                                                           self.head_dim)
                    assert np.may_share_memory(dst, view), "splitting one axis must give a view"
                    np.copyto(dst, g.transpose(0, 2, 1, 3, 4))
                if j_full < j1:  # the part of the last block that fits before P
                    lo = max(j_full * bs, j0 * bs)
                    blk = r.block_table[j_full]
                    view[:, slot, :, lo:P, :] = pool[:, blk, :, lo - j_full * bs:P - j_full * bs, :]
                self.gathered_tokens += r.start - valid
            self.rows[slot] = (r.key, r.start)
        return slots, P  # type: ignore[return-value]


class Runner(RunnerBase):
    """Owns the ORT session and the KV pool; ``execute`` runs one scheduled step."""

    def __init__(self, artifact_dir: str | Path, manifest: dict, num_blocks: int, block_size: int, *,
                 providers: Sequence[str] = (CUDA, CPU), intra_op_threads: int = 0,
                 ort_spinning: str = "during_runs", row_tokens: int | None = None):
        layout = manifest.get("attention_layout", "standard")
        if layout != "standard":
            raise RunnerError(f"attention layout {layout!r} is not supported by this runner (only 'standard')")
        self.dtype, self.past_names, self.present_names = kv_spec(manifest)
        super().__init__(artifact_dir, manifest, num_blocks, block_size, providers, intra_op_threads, ort_spinning)
        self.output_names = ["logits", *self.present_names]
        n_kv = self.n_kv
        self.pool = kv_zeros((n_kv, num_blocks, self.kv_heads, block_size, self.head_dim), self.dtype)
        # row_tokens: the positions the two past buffers may hold together (None: unbounded, as before). ORT's
        # present outputs are as large again during a call, which is why the engine gives each half of the share.
        self.row_tokens = row_tokens
        self._decode_buf = _PastBuffer(n_kv, self.kv_heads, self.head_dim, block_size, self.dtype, row_tokens)
        self._prefill_buf = _PastBuffer(n_kv, self.kv_heads, self.head_dim, block_size, self.dtype, row_tokens)
        self._decode_buf.peer, self._prefill_buf.peer = self._prefill_buf, self._decode_buf

    def kv_bytes(self) -> int:
        """Bytes held for K/V now: the pool plus the per-step past buffers."""
        return int(self.pool.nbytes + self._decode_buf.flat.nbytes + self._prefill_buf.flat.nbytes)

    def kv_budget_bytes(self) -> int:
        """The most ``kv_bytes`` reaches: the pool plus the past buffers' positions (docs/serving.md, "One KV
        budget"); the pool alone when the buffers are unbounded (a runner built without ``row_tokens``)."""
        rows = self.row_tokens * self.bytes_per_token if self.row_tokens is not None else 0
        return int(self.pool.nbytes + rows)

    def trim(self, longest: int) -> None:
        """Give the past buffers' memory back once nothing runs."""
        if longest <= 0:
            for buf in (self._decode_buf, self._prefill_buf):
                if buf.flat.size:
                    buf.release()

    @property
    def gathered_tokens(self) -> int:
        return self._decode_buf.gathered_tokens + self._prefill_buf.gathered_tokens

    def execute(self, rows: Sequence[RunRow]) -> list[np.ndarray | None]:
        """Compute the rows' new tokens, write their K/V to the pool; last-position logits per row ([n, vocab]
        for a row with ``all_logits``)."""
        t0 = time.perf_counter()
        out: list[np.ndarray | None] = [None] * len(rows)
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            if len(r.token_ids) < 1:
                raise RunnerError("a scheduled row has no tokens")
            groups.setdefault(len(r.token_ids), []).append(i)
        for n, idx in sorted(groups.items()):
            buf = self._decode_buf if n == 1 else self._prefill_buf
            logits = self._run_group([rows[i] for i in idx], n, buf)
            for k, i in enumerate(idx):
                r = rows[i]
                out[i] = logits[k] if r.all_logits else logits[k][-1] if r.want_logits else None
        self.step_seconds += time.perf_counter() - t0
        return out

    def _run_group(self, rows: list[RunRow], n: int, buf: _PastBuffer) -> list[np.ndarray]:
        bs = self.block_size
        slots, P = buf.prepare(rows, self.pool)
        B = len(rows)
        order = sorted(range(B), key=lambda i: slots[i])  # rows by slot, so slot k is batch row k
        starts = np.array([rows[i].start for i in order], dtype=np.int64)
        input_ids = np.array([list(rows[i].token_ids) for i in order], dtype=np.int64).reshape(B, n)
        position_ids = starts[:, None] + np.arange(n, dtype=np.int64)[None, :]
        mask = np.zeros((B, P + n), dtype=np.int64)
        mask[:, :P] = np.arange(P)[None, :] < starts[:, None]
        mask[:, P:] = 1
        feeds = {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids}
        view = buf.view
        for j, name in enumerate(self.past_names):
            feeds[name] = view[j, :B]
        t = time.perf_counter()
        outputs = self.session.run(self.output_names, feeds)
        self.run_seconds += time.perf_counter() - t
        self.calls += 1
        logits, presents = outputs[0], outputs[1:]
        # Scatter the new K/V ([B, H, n, D] at slots P..P+n of each present) into the pool and the buffer rows.
        new = np.stack([p[:, :, P:P + n, :] for p in presents])  # [n_kv, B, H, n, D]
        if n == 1:
            tables = [rows[i].block_table for i in order]
            blk = np.array([tables[k][starts[k] // bs] for k in range(B)], dtype=np.intp)
            off = (starts % bs).astype(np.intp)
            vals = new[:, :, :, 0, :].transpose(1, 0, 2, 3)  # [B, n_kv, H, D]
            self.pool[:, blk, :, off, :] = vals
            inside = starts < P
            if inside.any():
                k = np.nonzero(inside)[0]
                view[:, k, :, starts[k], :] = vals[k]
        else:
            for k in range(B):
                r = rows[order[k]]
                s = int(starts[k])
                pos = s
                while pos < s + n:
                    b = r.block_table[pos // bs]
                    o = pos % bs
                    m = min(bs - o, s + n - pos)
                    self.pool[:, b, :, o:o + m, :] = new[:, k, :, pos - s:pos - s + m, :]
                    pos += m
                m = min(P, s + n) - s
                if m > 0:
                    view[:, k, :, s:s + m, :] = new[:, k, :, :m, :]
        for k in range(B):
            key, _ = buf.rows[k]
            buf.rows[k] = (key, min(int(starts[k]) + n, P))
        result: list[np.ndarray] = [None] * B  # type: ignore[list-item]
        for k in range(B):
            result[order[k]] = logits[k]  # [n, vocab]; execute keeps the last row unless all_logits
        return result
