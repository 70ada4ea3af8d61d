"""Runner backend for attention layout ``gqa``: in-place KV rows for ``com.microsoft.GroupQueryAttention``.

Implements serve/runners/protocol.ModelRunner, as serve.runners.standard.Runner does, so the engine, scheduler
and block manager do not change. Its parts: the K/V rows and their pool (serve/runners/gqa_rows.py: which slot holds
which sequence, pool/row copies, the rows' shape within their budget), the optional split of a step into two
halves (serve/runners/gqa_split.py), and here the calls: their IOBindings and the step.

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
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from serve.artifact import graph_bytes
from serve.kv.device import kv_store
from serve.runners.gqa_rows import KvRows
from serve.runners.gqa_split import SplitDecode, balanced_cut
from serve.runners.prompt_form import MIN_ROWS as PROMPT_FORM_MIN_ROWS
from serve.runners.onnx_session import CPU, CUDA, artifact_session
from serve.runners.protocol import RunnerBase, RunnerError, RunRow
from serve.runners.standard import kv_spec

log = logging.getLogger(__name__)


def _part(part: str, name: str) -> property:
    """A read-only figure of one of the runner's parts (its rows, its split)."""
    return property(lambda self: getattr(getattr(self, part), name))


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
    hidden: np.ndarray | None  # the kept positions' hidden states (hidden_states), else None


class GqaRunner(RunnerBase):
    """Owns the ORT session, the block pool and the per-sequence KV rows; ``execute`` runs one step."""

    def __init__(self, artifact_dir: str | Path, manifest: dict, num_blocks: int, block_size: int, *,
                 providers: Sequence[str] = (CUDA, CPU), intra_op_threads: int = 0, ort_spinning: str = "during_runs",
                 max_batch_size: int = 16, max_model_len: int | None = None, row_tokens: int | None = None,
                 decode_split_rows: int = 0, kv_store_setting: str = "auto", uniform_kernels: bool = False,
                 hidden_states: bool = False, prompt_graph: str | Path | None = None):
        layout = manifest.get("attention_layout")
        if layout != "gqa":
            raise RunnerError(f"attention layout {layout!r}: GqaRunner runs 'gqa' artifacts (serve.runners.standard.Runner runs 'standard')")
        self.dtype, self.past_names, self.present_names = kv_spec(manifest)
        super().__init__(artifact_dir, manifest, num_blocks, block_size, providers, intra_op_threads, ort_spinning,
                         hidden=hidden_states)
        # hidden_states: the graph's last hidden state comes back beside the logits (``last_hidden``), for a drafter
        # that reads it (serve/runners/hidden.py, serve/engine/draft_head.py)
        self.hidden_size = int(manifest["hidden_size"]) if hidden_states else 0
        self.last_hidden: list[np.ndarray | None] = []
        self.max_len = int(max_model_len or manifest.get("max_positions") or 2048)
        self.uniform_kernels = bool(uniform_kernels)  # serve.uniform_kernels
        # The pool and the rows: host arrays on the CPU EP, GPU tensors for the CUDA form on the CUDA EP
        self.store = kv_store(kv_store_setting, self.provider, self.dtype)
        if self.provider != CPU and self.store.ort_device == "cpu":
            # an fp32-cache graph on the CUDA EP: ORT runs its GroupQueryAttention on the CPU (CUDA's takes fp16)
            log.warning("%s serves this %s-cache graph with its K/V in host memory, copied every call; build "
                        "the CUDA form (quantize.target: cuda) to keep it on the GPU", self.provider, self.dtype.__name__)
        self.has_logits_to_keep = "logits_to_keep" in {i.name for i in self.session.get_inputs()}
        # serve.prompt_form: prompt calls of MIN_ROWS+ rows on the prompt-time form (serve/runners/prompt_form.py),
        # the same inputs and outputs, bound to the same K/V rows
        if prompt_graph is not None and self.provider != CPU:
            log.warning("serve.prompt_form: the prompt form is for the CPU execution provider (its W8A8 kernels); "
                        "%s runs prompts on the served form", self.provider)
            prompt_graph = None
        self.prompt_session = None if prompt_graph is None else artifact_session(
            Path(prompt_graph).parent, {"onnx_file": Path(prompt_graph).name}, [CPU], intra_op_threads,
            spinning=ort_spinning, hidden=hidden_states)
        self.prompt_form_calls = 0
        # The lm_head's work per kept position over the rest of a position's (see balanced_cut); 0 when every
        # position's logits are computed anyway, or the manifest does not say.
        head = int(manifest.get("vocab_size") or 0) * int(manifest.get("hidden_size") or 0)
        rest = int(manifest.get("num_parameters") or 0) - head
        self._head_share = head / rest if self.has_logits_to_keep and head and rest > 0 else 0.0
        self.max_slots = int(max_batch_size)
        # None = the old unbounded behaviour (every slot at the longest length), for direct users of the runner.
        row_tokens = int(row_tokens) if row_tokens else self.max_slots * self.max_len
        if row_tokens < 1:
            raise RunnerError(f"row_tokens {row_tokens}: the KV rows need room for at least one position")
        self.rows = KvRows(self.store, self.dtype, n_kv=self.n_kv, kv_heads=self.kv_heads, head_dim=self.head_dim,
                           num_blocks=num_blocks, block_size=block_size, max_slots=self.max_slots,
                           max_len=self.max_len, row_tokens=row_tokens, bytes_per_token=self.bytes_per_token)
        self.pool = self.rows.pool
        # logits buffers, reused call after call: one for decode calls, whose rows execute returns as views (valid
        # until the next execute; the engine samples them at once), one for prefill calls in the same step
        self._logits = {"decode": np.zeros(0, np.float32), "prefill": np.zeros(0, np.float32)}
        self._hidden = {"decode": np.zeros(0, np.float32), "prefill": np.zeros(0, np.float32)}
        # The decode call's IOBinding and its input arrays, kept while the rows' buffer, the batch size and the
        # logits buffer stay the same: rebinding 2 x layers K/V pointers every token cost ~1 ms on this CPU.
        self._decode_key: tuple | None = None
        self._decode_parts: list[tuple] = []
        self._decode_hidden: np.ndarray | None = None
        self.split = SplitDecode((artifact_dir, manifest), self.provider, intra_op_threads=intra_op_threads,
                                 rows_from=decode_split_rows, weights=graph_bytes(manifest), max_slots=self.max_slots,
                                 hidden=bool(hidden_states))
        self.batched_prompts = 0  # prompts that ran in a call with other first prompts (_run_first_prompts)

    # ---- what the rest of the server reads (the engine's stats, /metrics, tests) -------------------
    row_tokens = _part("rows", "row_tokens")
    gathered_tokens = _part("rows", "gathered_tokens")  # positions copied from the pool into rows
    moved_tokens = _part("rows", "moved_tokens")  # positions copied between rows
    decode_split_rows = _part("split", "rows_from")
    split_steps = _part("split", "steps")  # decode steps run as two halves
    split_prompt_calls = _part("split", "prompt_calls")  # first-prompt batches run as two halves

    def kv_bytes(self) -> int:
        """Bytes held for K/V now: the block pool plus the rows."""
        return self.rows.kv_bytes()

    def kv_budget_bytes(self) -> int:
        """The most ``kv_bytes`` can reach: the pool plus the rows' share."""
        return self.rows.kv_budget_bytes()

    def trim(self, longest: int) -> None:
        self.rows.trim(longest)

    def release(self, key: Hashable) -> None:
        self.rows.release(key)

    def _logits_buf(self, shape: tuple[int, ...], use: str = "prefill") -> np.ndarray:
        n = int(np.prod(shape))
        buf = self._logits[use]
        if n > buf.size:
            buf = self._logits[use] = np.zeros(max(n, int(buf.size * 1.5)), np.float32)
        return buf[:n].reshape(shape)

    def _hidden_buf(self, lead: tuple[int, ...], use: str = "prefill") -> np.ndarray | None:
        """The hidden-state output's buffer [*lead, hidden] beside a logits buffer; None without hidden_states."""
        if not self.hidden_size:
            return None
        n = int(np.prod(lead)) * self.hidden_size
        buf = self._hidden[use]
        if n > buf.size:
            buf = self._hidden[use] = np.zeros(max(n, int(buf.size * 1.5)), np.float32)
        return buf[:n].reshape(*lead, self.hidden_size)

    # ---- the step --------------------------------------------------------------------------
    def execute(self, rows: Sequence[RunRow]) -> list[np.ndarray | None]:
        """Compute the rows' new tokens, write their K/V to the pool; last-position logits per row."""
        t0 = time.perf_counter()
        self.rows.tick += 1
        if len(rows) > self.max_slots:
            raise RunnerError(f"{len(rows)} rows in one step; this runner has {self.max_slots} KV rows (max_batch_size)")
        for r in rows:
            if len(r.token_ids) < 1:
                raise RunnerError("a scheduled row has no tokens")
        need = max(r.start + len(r.token_ids) for r in rows)
        lone = self._lone_decode(rows, need)
        self.rows.ensure(len(rows), max(need, lone.start + 2) if lone is not None else need)
        out: list[np.ndarray | None] = [None] * len(rows)
        hid: list[np.ndarray | None] = [None] * len(rows)  # the same positions' hidden states (hidden_states)
        index = {id(r): i for i, r in enumerate(rows)}
        decode = [r for r in rows if len(r.token_ids) == 1 and r is not lone]
        prefill = [r for r in rows if len(r.token_ids) > 1 or r is lone]
        if decode:
            self.rows.place_decode(decode)  # reorders `decode` to slot order
            logits = self._run_decode(decode)
            for k, r in enumerate(decode):
                i = index[id(r)]
                # a view: 32 rows x 49,152 floats copied every step was ~0.8 ms (benchmarks/history.md run 10)
                out[i] = logits[k][None].copy() if r.all_logits else logits[k] if r.want_logits else None
                if self.hidden_size:
                    hid[i] = self._decode_hidden[k].copy() if r.all_logits else self._decode_hidden[k, 0].copy()
        fresh = [r for r in prefill if r.start == 0 and not r.all_logits]
        rest = [r for r in prefill if r.start > 0 or r.all_logits]
        base = self.rows.fresh_slots(len(fresh), len(decode), rest) if len(fresh) > 1 else None
        if base is not None:
            for r, (lg, hd) in zip(fresh, self._run_first_prompts(base, fresh)):
                out[index[id(r)]] = lg if r.want_logits else None
                hid[index[id(r)]] = hd
            prefill = rest
        for r in prefill:
            slot = self.rows.slot_for_prefill(r, len(decode))
            self.rows.fill(slot, r)
            if r is lone:  # its token twice; the second position's K/V is not kept
                two = RunRow(r.key, r.block_table, r.start, [r.token_ids[0]] * 2, want_logits=True, all_logits=True)
                lg, hd = self._run_prefill(slot, two, write=1)
                lg, hd = lg[:1], None if hd is None else hd[:1]
            else:
                lg, hd = self._run_prefill(slot, r)
            out[index[id(r)]] = lg.copy() if r.all_logits else lg[-1].copy() if r.want_logits else None
            if hd is not None:
                hid[index[id(r)]] = hd.copy() if r.all_logits else hd[-1].copy()
        self.last_hidden = hid
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
        return decode[0] if end <= self.max_len and len(rows) * max(need, end) <= self.rows.row_tokens else None

    def _bind(self, kv: np.ndarray, input_ids: np.ndarray, seqlens_k: np.ndarray, logits: np.ndarray,
              keep: int | None, total: int | None = None, session=None, hidden: np.ndarray | None = None):
        """A binding of one call on ``session`` (default: the main one) over the rows ``kv`` [n_kv, n, ...]."""
        binding = (session or self.session).io_binding()
        binding.bind_cpu_input("input_ids", input_ids)
        binding.bind_cpu_input("seqlens_k", seqlens_k)
        binding.bind_cpu_input("total_sequence_length", np.array(total or int(seqlens_k.max()) + 1, np.int32))
        if self.has_logits_to_keep:
            binding.bind_cpu_input("logits_to_keep", np.array([keep or 0], np.int64))
        self._bind_rows(binding, kv, logits, hidden)
        return binding

    def _bind_rows(self, binding, kv: np.ndarray, logits: np.ndarray, hidden: np.ndarray | None = None) -> None:
        """Bind the rows ``kv`` [n_kv, n, ...] as every layer's past and present, ``logits`` (and ``hidden``) as the
        outputs."""
        shape = [kv.shape[1], self.kv_heads, self.rows.cap, self.head_dim]
        dev = self.store.ort_device
        for j, (pin, pout) in enumerate(zip(self.past_names, self.present_names)):
            ptr = self.store.ptr(kv[j])
            # One pointer for past and present: GroupQueryAttention writes the new K/V in place.
            binding.bind_input(pin, dev, 0, self.dtype, shape, ptr)
            binding.bind_output(pout, dev, 0, self.dtype, shape, ptr)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        if hidden is not None:
            binding.bind_output("hidden", "cpu", 0, np.float32, list(hidden.shape), hidden.ctypes.data)

    def _run(self, calls: list[tuple]) -> None:
        """Run [(session, binding)]: one here, or two at once, the second on the split's worker thread."""
        t = time.perf_counter()
        self.store.sync()
        other = self.split.submit(*calls[1]) if len(calls) == 2 else None
        calls[0][0].run_with_iobinding(calls[0][1])
        if other is not None:
            other.result()
        for _, binding in calls:
            self.store.after_run(binding)
        self.run_seconds += time.perf_counter() - t

    def _decode_call(self, B: int, logits: np.ndarray, hidden: np.ndarray | None) -> list[tuple]:
        """The decode bindings for ``B`` rows: [(session, binding, inputs, lo, hi)], one part, or two halves from
        ``decode_split_rows`` rows on. Made when the rows' buffer, B or the logits buffer changed; the caller
        fills the input arrays in place before each run."""
        split = self.split.decodes(B)
        kv = self.rows.kv
        key = (self.store.ptr(kv), tuple(kv.shape), B, logits.ctypes.data, logits.shape, split,
               None if hidden is None else hidden.ctypes.data)
        if key != self._decode_key:
            cuts = [(0, B // 2), (B // 2, B)] if split else [(0, B)]
            session = self.split.open() if split else self.session
            parts = []
            for lo, hi in cuts:
                view = kv[:, lo:hi]
                assert self.store.contiguous(view[0])
                n = hi - lo
                inputs = {"input_ids": np.zeros((n, 1), np.int64), "seqlens_k": np.zeros(n, np.int32),
                          "total_sequence_length": np.zeros((), np.int32)}
                if self.has_logits_to_keep:
                    inputs["logits_to_keep"] = np.zeros(1, np.int64)  # 0: every position, which is the one
                binding = session.io_binding()
                for name, arr in inputs.items():
                    binding.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
                self._bind_rows(binding, view, logits[lo:hi], None if hidden is None else hidden[lo:hi])
                parts.append((session, binding, inputs, lo, hi))
            self._decode_key, self._decode_parts = key, parts
        return self._decode_parts

    def _run_decode(self, rows: list[RunRow]) -> np.ndarray:
        B = len(rows)
        starts = np.array([r.start for r in rows], dtype=np.int64)
        logits = self._logits_buf((B, 1, self.vocab_size), "decode")
        self._decode_hidden = self._hidden_buf((B, 1), "decode")
        parts = self._decode_call(B, logits, self._decode_hidden)
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
        self.split.steps += int(len(parts) == 2)
        self.calls += 1
        self.rows.decoded(rows)
        return logits[:, 0, :]

    def _on_prompt_form(self, rows: int):
        """The prompt form's session for a prompt call of ``rows`` rows where it pays, else None."""
        if self.prompt_session is None or rows < PROMPT_FORM_MIN_ROWS:
            return None
        self.prompt_form_calls += 1
        return self.prompt_session

    def _run_first_prompts(self, base: int, rows: list[RunRow]) -> list[tuple]:
        """Prompts that start at position 0, together on slots [base, base + n): right-padded to the longest,
        ``seqlens_k`` = each length - 1, total_sequence_length = the padded length, which GroupQueryAttention
        reads as a batch of first prompts (each row attends within its own length). One call instead of one per
        prompt: at 32 users a wave of new requests was 32 batch-1 calls, each paying the step's fixed cost (the
        weights read once per call). The padding's K/V lands beyond each row's length, where the next decode
        write and ``seqlens_k`` keep it from being read; it is not written back to the pool.
        Sorted by length and, where the split session exists, as two calls at once (the shorter prompts and the
        longer, each padded only to its own longest, cut where the two calls' work is even: balanced_cut): 8 %
        faster for 32 chat prompts on 2 cores than one call, less padding.
        Returns each row's last-position (logits, hidden state or None), in the order of ``rows``."""
        n = len(rows)
        self.batched_prompts += n
        order = sorted(range(n), key=lambda i: len(rows[i].token_ids))
        self.rows.start_prompts(base, [rows[i] for i in order])
        on_form = self._on_prompt_form(n * max(len(r.token_ids) for r in rows))
        split = self.split.prompts(n) and on_form is None
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
            hidden = (np.empty((*shape[:2], self.hidden_size), np.float32) if split and self.hidden_size
                      else self._hidden_buf(shape[:2]))
            seqlens = np.array([m - 1 for m in lens], np.int32)
            binding = self._bind(self.rows.kv[:, base + k0:base + k0 + len(g)], ids, seqlens, logits, keep, S,
                                 self.split.session if split else on_form, hidden)
            calls.append(_PromptCall(binding, g, k0, lens, logits, S - (keep or S), (ids, seqlens), hidden))
        self._run([(self.split.session if split else on_form or self.session, c.binding) for c in calls])
        self.split.prompt_calls += int(split)
        self.calls += len(calls)
        out: list = [None] * n
        for c in calls:
            for b, i in enumerate(c.rows):
                self.rows.write_back(base + c.first_slot + b, rows[i].block_table, 0, c.lens[b])
                last = c.lens[b] - 1 - c.first_kept
                out[i] = (c.logits[b, last].copy(), None if c.hidden is None else c.hidden[b, last].copy())
        return out

    def _run_prefill(self, slot: int, r: RunRow, write: int | None = None) -> tuple:
        """Run r's tokens on its slot; their K/V (the first ``write`` of them) go to its blocks. The kept positions'
        logits [kept, vocab] and hidden states [kept, hidden] (None without hidden_states)."""
        n, s = len(r.token_ids), r.start
        ids = np.asarray(r.token_ids, dtype=np.int64).reshape(1, n)
        # the last position's logits only, unless the row asks for all of them (prompt log-probs)
        keep = (n if r.all_logits else 1) if self.has_logits_to_keep else None
        logits = self._logits_buf((1, keep or n, self.vocab_size))
        hidden = self._hidden_buf((1, keep or n))
        session = self._on_prompt_form(n) or self.session
        self._run([(session, self._bind(self.rows.kv[:, slot:slot + 1], ids, np.array([s + n - 1], np.int32),
                                        logits, keep, session=session, hidden=hidden))])
        self.calls += 1
        self.rows.flush(slot)  # a decode tail before this chunk (not expected: chunks come before decoding)
        self.rows.write_back(slot, r.block_table, s, n if write is None else write)
        return logits[0], None if hidden is None else hidden[0]  # [kept positions, vocab], [kept, hidden]
