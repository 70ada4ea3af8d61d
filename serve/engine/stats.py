"""The engine's counters and latency samples, and the ``EngineStats`` snapshot built from them.

One job: keep the numbers /metrics reports about the engine. ``EngineCounters`` is updated
by the step loop (with the engine lock held); ``snapshot`` adds the scheduler's and the block
pool's live figures and returns an ``EngineStats`` (serve/api/metrics.py turns that into Prometheus
gauges, counters and histograms).

Invariants: every counter only grows; ``sum(finished.values()) <= added`` (a request finishes
once, and only after it was added); the latency windows hold at most ``latency_window`` samples,
the since-last-pop buffers (latencies, finished-request samples) at most ``PENDING_SAMPLES``.
``check_invariants`` verifies them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from serve.engine.scheduler import Scheduler
from serve.kv.cache import BlockManager

PENDING_SAMPLES = 65536  # latency samples kept for pop_latency_samples(); bounded in case nobody pops


@dataclass(frozen=True)
class FinishedRequestSample:
    """One finished request's phases (vLLM v1's per-request stats), observed once into /metrics histograms."""

    queue_s: float  # arrival -> first scheduled
    prefill_s: float  # first scheduled -> first token
    decode_s: float  # first token -> last token
    inference_s: float  # first scheduled -> last token
    prompt_tokens: int
    generation_tokens: int


@dataclass
class EngineStats:
    """A snapshot for /metrics (serve/api/metrics.py turns these into Prometheus gauges, counters, histograms)."""

    provider: str
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_usage_pct: float
    kv_usage_peak_pct: float  # highest kv_usage_pct since the engine started
    block_size: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache (counter)
    prefix_hits: int  # of those, tokens found cached (counter)
    preemptions: int  # counter
    steps: int  # counter
    batch_fill_ratio: float  # mean over steps of sequences per step / max_batch_size
    token_fill_ratio: float  # mean over steps of tokens per step / max_num_batched_tokens
    requests_added: int
    requests_finished: int  # any reason
    finish_reasons: dict[str, int]
    requests_rejected: int
    prompt_tokens: int  # counter: prompt tokens of finished requests
    generated_tokens: int  # counter
    computed_tokens: int  # counter: tokens run through the model (prefill chunks + decodes)
    spec_drafts: int = 0  # counter: decode rows checked with drafts (serve.speculative)
    spec_draft_tokens: int = 0  # counter: drafted tokens checked
    spec_accepted_tokens: int = 0  # counter: drafted tokens accepted
    ttft_s: list[float] = field(default_factory=list, repr=False)  # recent samples (window)
    itl_s: list[float] = field(default_factory=list, repr=False)  # recent samples (window)

    @property
    def spec_acceptance_rate(self) -> float:
        """Drafted tokens accepted / checked (0 before any draft)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_tokens_per_check(self) -> float:
        """Tokens a drafted row produced per forward: accepted drafts + the model's own token (0 before any)."""
        return (self.spec_accepted_tokens + self.spec_drafts) / self.spec_drafts if self.spec_drafts else 0.0


class EngineCounters:
    """Running totals and latency samples; the engine updates them with its lock held."""

    __slots__ = ("ttft", "itl", "new_ttft", "new_itl", "steps", "rows_sum", "tokens_sum", "added", "rejected",
                 "finished", "prompt_tokens", "generated", "new_requests")

    def __init__(self, latency_window: int):
        self.ttft: deque[float] = deque(maxlen=latency_window)
        self.itl: deque[float] = deque(maxlen=latency_window)
        # since the last pop_latency_samples()
        self.new_ttft: deque[float] = deque(maxlen=PENDING_SAMPLES)
        self.new_itl: deque[float] = deque(maxlen=PENDING_SAMPLES)
        self.new_requests: deque[FinishedRequestSample] = deque(maxlen=PENDING_SAMPLES)
        self.steps = 0
        self.rows_sum = 0  # sequences over all steps
        self.tokens_sum = 0  # tokens over all steps
        self.added = 0
        self.rejected = 0
        self.finished: dict[str, int] = {}  # finish reason -> requests
        self.prompt_tokens = 0
        self.generated = 0

    def record_ttft(self, s: float) -> None:
        self.ttft.append(s)
        self.new_ttft.append(s)

    def record_itl(self, s: float) -> None:
        self.itl.append(s)
        self.new_itl.append(s)

    def record_step(self, num_rows: int, num_tokens: int) -> None:
        self.steps += 1
        self.rows_sum += num_rows
        self.tokens_sum += num_tokens

    def record_finish(self, reason: str, prompt_len: int) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.prompt_tokens += prompt_len

    def record_request(self, sample: FinishedRequestSample) -> None:
        self.new_requests.append(sample)

    # The pops need no lock: deque.append and popleft are atomic, so a sample recorded meanwhile is either
    # returned now or left for the next pop, never lost (the /metrics scrape must not wait for a step).
    def pop_latency_samples(self) -> tuple[list[float], list[float]]:
        return _drain(self.new_ttft), _drain(self.new_itl)

    def pop_request_samples(self) -> list[FinishedRequestSample]:
        return _drain(self.new_requests)

    def snapshot(self, provider: str, scheduler: Scheduler, bm: BlockManager) -> EngineStats:
        steps = max(self.steps, 1)
        return EngineStats(
            provider=provider,
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used,
            kv_blocks_free=bm.num_free,
            kv_blocks_cached=bm.num_cached,
            kv_usage_pct=100.0 * bm.usage,
            kv_usage_peak_pct=100.0 * bm.peak_usage,
            block_size=bm.block_size,
            prefix_queries=bm.prefix_queries,
            prefix_hits=bm.prefix_hits,
            preemptions=scheduler.num_preemptions,
            steps=self.steps,
            batch_fill_ratio=self.rows_sum / (steps * scheduler.max_batch_size),
            token_fill_ratio=self.tokens_sum / (steps * scheduler.max_num_batched_tokens),
            requests_added=self.added,
            requests_finished=sum(self.finished.values()),
            finish_reasons=dict(self.finished),
            requests_rejected=self.rejected,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated,
            computed_tokens=self.tokens_sum,
            ttft_s=list(self.ttft),
            itl_s=list(self.itl),
        )

    def check_invariants(self) -> None:
        assert min(self.steps, self.rows_sum, self.tokens_sum, self.added, self.rejected, self.prompt_tokens,
                   self.generated) >= 0
        assert sum(self.finished.values()) <= self.added, (self.finished, self.added)
        assert len(self.ttft) <= self.ttft.maxlen and len(self.new_ttft) <= PENDING_SAMPLES
        assert len(self.new_requests) <= PENDING_SAMPLES


def _drain(d: deque) -> list:
    out = []
    try:
        while True:
            out.append(d.popleft())
    except IndexError:
        return out
