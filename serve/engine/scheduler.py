"""Iteration-level scheduler: which sequences run in the next forward step, and how many tokens each.

Policy, per step (a token budget ``max_num_batched_tokens`` and at most ``max_batch_size`` sequences):

1. **Decodes first.** Every running sequence whose prompt is fully computed gets one token,
   oldest request first.
2. **Then running prefills** (a prompt started in an earlier step) continue with a chunk of
   what budget is left (chunked prefill): a long prompt advances a chunk per step and
   never stalls the running decodes. The step's first prompt row (the oldest) takes what the
   budget allows; the prompts after it join only whole, within what is left of ``prefill_chunk``,
   the size past which a larger prompt call costs about as much per token
   (serve/engine/prefill_chunk.py). So prompts that arrive together finish one after another,
   first come first served, instead of all at the end of one call; a lone prompt is not cut
   smaller than the budget, and no short prompt is cut in two (its rest would be a call of its own).
3. **Then admissions** from the waiting queue, while budget, batch slots and blocks last.
   A new sequence first reuses cached prefix blocks, then computes a chunk of the rest.
   Order: requests that waited longer than ``max_wait_s`` first (oldest first), then the
   rest by ``policy`` (``fcfs``: arrival; ``shortest_first``: fewest tokens to compute).
   A request that does not fit may be passed by smaller ones, except an aged one:
   once a request has waited ``max_wait_s``, nothing is admitted ahead of it (P99 guard).
   No admission happens in a step that had to preempt, and admission keeps a small
   watermark of free blocks so new sequences do not immediately force preemptions.
4. **Coalescing** (``admit_quiet_s`` > 0, set by the engine's own loop): when requests come
   in bursts (the newest within ``admit_quiet_s`` of the one before it, or most of the last
   eight so), new ones wait until the newest is ``admit_quiet_s`` old, at most
   ``admit_max_delay_s`` after the oldest waiting one, unless the waiting prompts already fill
   the free rows, the step's token budget or half the waiting queue. A burst then becomes one batched
   prompt call (``admit_hold_until`` says until when; the decodes keep running meanwhile).

Preemption: when a running sequence needs a block and none is free, the youngest running
sequence (latest arrival; possibly the one asking) is preempted: its blocks are released
and it goes back to the waiting queue to be recomputed later. Its full blocks stay in the
prefix cache (evictable), so the recompute is often mostly cache hits. Preempting the
youngest means the oldest always progresses: no livelock.

Row budget (``max_row_tokens``, layout ``gqa``): the runner's in-place KV rows are one
[rows x longest row] buffer with a fixed share of the KV budget, so a step's rows times its
longest row (in positions, prefill chunk ends included) must stay within ``max_row_tokens``.
A row that would break that is left for a later step, and then nothing new is admitted in
that step (so a long sequence is not starved by newcomers); the oldest running sequence
always fits alone, so progress is kept.

Admission control (raised by ``add``): ``QueueFullError`` when the waiting queue is full
(the HTTP layer answers 429), ``RequestTooLargeError`` when prompt + max_tokens can never
fit the model's context, the whole KV pool or the KV rows (HTTP 400).
"""

from __future__ import annotations

import collections
import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from serve.engine.sampling import SamplingParams
from serve.kv.cache import BlockManager


class AdmissionError(Exception):
    """A request the engine refuses; ``http_status`` says how the API should answer."""

    http_status = 400


class QueueFullError(AdmissionError):
    """The waiting queue is full: try again later (HTTP 429)."""

    http_status = 429

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTooLargeError(AdmissionError):
    """prompt + max_tokens can never be served by this engine (HTTP 400)."""

    http_status = 400


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_epochs = itertools.count(1)


@dataclass(eq=False)
class SequenceState:
    """One request's token state as the scheduler sees it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    token_ids: list[int] = field(default_factory=list)  # prompt + generated so far
    num_computed: int = 0  # positions whose K/V is in the cache
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at the latest admission
    # Changes on every admission; the runner keys its cached batch rows by it, so a
    # recomputed sequence never reuses K/V rows from before its preemption.
    epoch: int = 0
    finish_reason: str | None = None

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed > 1


@dataclass
class ScheduledSeq:
    seq: SequenceState
    start: int  # first position computed this step (= tokens already in the cache)
    num_tokens: int
    # drafted tokens checked in the same forward after the decode token (serve/engine/speculative.py); their
    # positions follow num_tokens, and only those the target accepts stay computed (commit_drafted)
    drafts: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.start + self.num_tokens] + self.drafts

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens: its last logits pick the next token."""
        return self.start + self.num_tokens == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[SequenceState] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_batched_tokens: int = 512, max_batch_size: int = 16,
                 max_waiting: int = 64, max_wait_s: float = 2.0, max_model_len: int = 2048,
                 policy: str = "fcfs", watermark: float = 0.01, clock: Callable[[], float] = time.monotonic,
                 max_row_tokens: int | None = None, admit_quiet_s: float = 0.0, admit_max_delay_s: float = 0.0,
                 prefill_chunk: int | None = None):
        if policy not in ("fcfs", "shortest_first"):
            raise ValueError(f"scheduling policy {policy!r}: allowed are 'fcfs', 'shortest_first'")
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk  # prompt tokens a step at most (None: the token budget alone)
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self.max_model_len = max_model_len
        self.policy = policy
        self.max_row_tokens = max_row_tokens
        self.admit_quiet_s = admit_quiet_s
        self.admit_max_delay_s = admit_max_delay_s
        # the gaps between the last arrivals (requests added, not requeued ones): is a burst on?
        self._last_arrival, self._gaps = float("-inf"), collections.deque(maxlen=8)
        self.watermark_blocks = int(block_manager.num_blocks * watermark)
        self.clock = clock
        self.waiting: list[SequenceState] = []
        self.running: list[SequenceState] = []  # kept sorted by arrival (oldest first)
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------------------------
    def check_admissible(self, prompt_len: int, max_tokens: int) -> None:
        """Raise RequestTooLargeError if a request of this size can never run."""
        if prompt_len < 1:
            raise RequestTooLargeError("the prompt is empty: at least one token is needed")
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            raise RequestTooLargeError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds the model's "
                f"context of {self.max_model_len} tokens; shorten the prompt or lower max_tokens")
        need = self.bm.blocks_for_tokens(total)
        if need > self.bm.num_blocks:
            cap = self.bm.num_blocks * self.bm.block_size
            raise RequestTooLargeError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} tokens can never fit the "
                f"KV cache of {cap} tokens ({self.bm.num_blocks} blocks of {self.bm.block_size}); "
                f"lower max_tokens or raise serve.kv_memory_mb")
        if self.max_row_tokens is not None and total > self.max_row_tokens:
            raise RequestTooLargeError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} tokens can never fit the "
                f"KV rows of {self.max_row_tokens} positions; lower max_tokens or raise serve.kv_memory_mb")

    def queue_full_error(self) -> QueueFullError:
        return QueueFullError(f"the waiting queue is full ({self.max_waiting} requests); retry later",
                              retry_after_s=max(1.0, self.max_wait_s))

    def add(self, seq: SequenceState) -> None:
        self.check_admissible(seq.prompt_len, seq.params.max_tokens)
        if len(self.waiting) >= self.max_waiting:
            raise self.queue_full_error()
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self._gaps.append(seq.arrival - self._last_arrival)
        self._last_arrival = seq.arrival

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        rows: dict[int, ScheduledSeq] = {}  # id(seq) -> row, insertion ordered
        budget = self.max_num_batched_tokens
        preempted_any = False
        longest = 0  # the step's longest row end, for the row budget
        row_blocked = False  # a running sequence was left out for the row budget: admit nobody past it

        def fits(end: int) -> bool:
            """Whether one more row ending at position ``end`` keeps rows x longest within max_row_tokens."""
            return self.max_row_tokens is None or (len(rows) + 1) * max(longest, end) <= self.max_row_tokens

        def grow(seq: SequenceState, n: int) -> bool:
            """Make room for n more tokens of a running seq; preempt youngest-first. False if seq itself went."""
            nonlocal budget, preempted_any
            while not self.bm.allocate(seq, seq.num_computed + n):
                victim = self.running[-1]
                row = rows.pop(id(victim), None)
                if row is not None:
                    budget += row.num_tokens
                self._preempt(victim)
                out.preempted.append(victim)
                preempted_any = True
                if victim is seq:
                    return False
            return True

        # 1. decodes, oldest first; 2. running prefills continue
        room = None  # prompt tokens the step's later prompt rows may still take (None: no prompt row yet)
        for decoding in (True, False):
            for seq in list(self.running):
                if budget <= 0 or len(rows) >= self.max_batch_size:
                    break
                left = seq.num_uncomputed
                if seq.status is not SeqStatus.RUNNING or left < 1 or (left == 1) != decoding or id(seq) in rows:
                    continue
                n = 1 if decoding else self._prompt_share(left, budget, room)
                if n < 1:
                    break
                if not fits(seq.num_computed + n):
                    row_blocked = True
                    continue
                if grow(seq, n):
                    rows[id(seq)] = ScheduledSeq(seq, seq.num_computed, n)
                    budget -= n
                    longest = max(longest, seq.num_computed + n)
                    room = room if decoding else self._room_after(n, room)
        # 3. admissions
        if not preempted_any and not row_blocked:
            budget = self._admit(rows, budget, longest, room)

        out.scheduled = list(rows.values())
        out.num_tokens = sum(r.num_tokens for r in out.scheduled)
        return out

    def _bursty(self) -> bool:
        """Requests come in bursts: the newest came within admit_quiet_s of the one before, or most recent ones did
        (then the first request of the next burst waits for the rest too). A user alone is never held."""
        gaps = self._gaps
        return bool(gaps) and (gaps[-1] < self.admit_quiet_s or sorted(gaps)[len(gaps) // 2] < self.admit_quiet_s)

    def admit_hold_until(self, now: float | None = None) -> float | None:
        """The clock time until which waiting requests are held back to coalesce a burst; None: admit now."""
        if self.admit_quiet_s <= 0 or not self.waiting or not self._bursty():
            return None
        now = self.clock() if now is None else now
        if len(self.waiting) >= min(self.max_batch_size - len(self.running), self.max_waiting // 2):
            return None  # the burst fills the rows (waiting longer gains nothing) or half the queue (429s come next)
        if sum(s.num_uncomputed for s in self.waiting) >= min(self.max_num_batched_tokens, self.prefill_chunk or 1 << 30):
            return None
        until = min(max(s.arrival for s in self.waiting) + self.admit_quiet_s,
                    min(s.arrival for s in self.waiting) + self.admit_max_delay_s)
        return until if until > now else None

    def _waiting_order(self, now: float) -> list[SequenceState]:
        aged = [s for s in self.waiting if now - s.arrival >= self.max_wait_s]
        rest = [s for s in self.waiting if now - s.arrival < self.max_wait_s]
        aged.sort(key=lambda s: s.arrival)
        if self.policy == "shortest_first":
            rest.sort(key=lambda s: (s.num_uncomputed, s.arrival))
        else:
            rest.sort(key=lambda s: s.arrival)
        return [*aged, *rest]

    def _prompt_share(self, want: int, budget: int, room: int | None) -> int:
        """Prompt tokens a row gets this step: the step's first prompt row what the budget allows; a row after it
        all it wants if that fits what is left of the prefill chunk, else none (prompts that arrive together finish
        one after another, and a prompt is never cut to fill a chunk: its rest would cost a call of its own)."""
        if room is None:
            return min(want, budget)
        return want if want <= min(budget, room) else 0

    def _room_after(self, n: int, room: int | None) -> int | None:
        """The prompt room left once a prompt row took ``n`` tokens (None: no chunk, the budget alone bounds)."""
        if not self.prefill_chunk:
            return None
        return (max(self.prefill_chunk, n) if room is None else room) - n

    def _admit(self, rows: dict[int, ScheduledSeq], budget: int, longest: int = 0, room: int | None = None) -> int:
        now = self.clock()
        if self.admit_hold_until(now) is not None:
            return budget
        bs = self.bm.block_size
        for seq in self._waiting_order(now):
            if budget <= 0 or len(rows) >= self.max_batch_size:
                break
            aged = now - seq.arrival >= self.max_wait_s
            # Keep at least one token to compute: its logits give the next token.
            # A request for prompt log-probs needs every prompt position's logits: no prefix-cache hit (vLLM).
            matched = ([] if seq.params.prompt_logprobs is not None
                       else self.bm.match_prefix(seq.token_ids, max_tokens=len(seq.token_ids) - 1))
            cached = len(matched) * bs
            n = self._prompt_share(len(seq.token_ids) - cached, budget, room)
            if n < 1:
                break
            reserve = self.watermark_blocks if self.running else 0
            row_ok = self.max_row_tokens is None or (len(rows) + 1) * max(longest, cached + n) <= self.max_row_tokens
            if not row_ok or not self.bm.can_start(matched, cached + n, reserve=reserve):
                if aged:
                    break  # nothing passes an aged request
                continue
            self.bm.start(seq, matched, num_prompt_tokens=len(seq.token_ids))
            ok = self.bm.allocate(seq, cached + n)
            assert ok, "can_start promised room"
            seq.num_computed = cached
            seq.num_cached_prompt_tokens = cached
            seq.status = SeqStatus.RUNNING
            seq.epoch = next(_epochs)
            self.waiting.remove(seq)
            self._insert_running(seq)
            rows[id(seq)] = ScheduledSeq(seq, cached, n)
            budget -= n
            room = self._room_after(n, room)
            longest = max(longest, cached + n)
        return budget

    def _insert_running(self, seq: SequenceState) -> None:
        i = len(self.running)
        while i > 0 and self.running[i - 1].arrival > seq.arrival:
            i -= 1
        self.running.insert(i, seq)

    def _preempt(self, seq: SequenceState) -> None:
        self.bm.free(seq)
        self.running.remove(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)

    def add_drafts(self, out: SchedulerOutput, row: ScheduledSeq, drafts: list[int]) -> bool:
        """Give a scheduled decode row ``drafts`` to check in the same forward, if its blocks can grow without
        preempting anyone and the step's rows stay within the row budget; False (row unchanged) otherwise."""
        seq = row.seq
        if not drafts or row.num_tokens != 1 or not row.samples:
            return False
        end = row.start + 1 + len(drafts)
        if self.max_row_tokens is not None:
            longest = max(max(r.start + len(r.token_ids) for r in out.scheduled), end)
            if len(out.scheduled) * longest > self.max_row_tokens:
                return False
        if not self.bm.allocate(seq, end):
            return False
        row.drafts = list(drafts)
        out.num_tokens += len(drafts)
        return True

    # ---- after the step --------------------------------------------------------------------
    def commit_drafted(self, row: ScheduledSeq, accepted: int) -> None:
        """A drafted row was checked and ``accepted`` drafts (already appended to the sequence with the token after
        them) stand: their K/V stays, the rejected positions are dropped, and the blocks beyond the sequence's
        tokens go back to the pool."""
        seq = row.seq
        seq.num_computed = row.start + row.num_tokens + accepted
        self.bm.commit(seq, seq.token_ids, seq.num_computed)
        self.bm.shrink(seq, len(seq.token_ids))

    def commit(self, row: ScheduledSeq) -> None:
        """The runner wrote K/V for the row's tokens: advance and publish newly full blocks."""
        seq = row.seq
        seq.num_computed = row.start + row.num_tokens
        self.bm.commit(seq, seq.token_ids, seq.num_computed)

    def finish(self, seq: SequenceState, reason: str) -> None:
        """Finished or cancelled: blocks go back at once."""
        if seq.status is SeqStatus.RUNNING:
            self.bm.free(seq)
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
