"""Prometheus metrics for the server, with vLLM's metric names where vLLM has one.

Engine counters live in each Engine and restart at zero with every new engine, but a
Prometheus counter must never go down across a live swap. So counters are read at
scrape time as (totals folded in from retired engines) + (live engines now); an engine
is folded in by the model manager's ``on_retire`` hook just before it shuts down.
TTFT and inter-token latency samples, and finished requests' phase times and token counts,
are drained from the engines into histograms at scrape time (and at retirement), so none is
lost or counted twice.

Own names (no vLLM equivalent) use the ``compressor:`` prefix.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serve.api.result_cache import ResultCache
from serve.registry.source import LoadedModel, ModelManager

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket edges, so dashboards built for vLLM read these unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
REQUEST_TIME_BUCKETS = E2E_BUCKETS  # vLLM's request_latency_buckets: queue, prefill, decode, inference time
# vLLM's build_1_2_5_buckets(max_model_len); fixed here (1 .. 1e6) since the served model can change live.
TOKEN_COUNT_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)

# Engine counters summed across engines: (metric name, EngineStats field, help)
_ENGINE_COUNTERS = (
    ("vllm:prefix_cache_queries", "prefix_queries", "Prompt tokens looked up in the prefix cache."),
    ("vllm:prefix_cache_hits", "prefix_hits", "Prompt tokens found in the prefix cache."),
    ("vllm:num_preemptions", "preemptions", "Sequences preempted (their KV freed, recomputed later)."),
    ("vllm:prompt_tokens", "prompt_tokens", "Prompt tokens of finished requests."),
    ("vllm:generation_tokens", "generated_tokens", "Generated tokens."),
    ("compressor:engine_steps", "steps", "Engine forward steps."),
    # speculative decoding (serve.speculative), vLLM v1's names: acceptance rate = accepted / draft tokens
    ("vllm:spec_decode_num_drafts", "spec_drafts", "Decode rows checked with drafted tokens."),
    ("vllm:spec_decode_num_draft_tokens", "spec_draft_tokens", "Drafted tokens checked."),
    ("vllm:spec_decode_num_accepted_tokens", "spec_accepted_tokens", "Drafted tokens accepted."),
)


# The serving model's GPU memory (serve/kv/device.TorchKv.memory): the KV budget (serve.kv_memory_mb) is GPU bytes
# there, and these say how the device's memory stands around it.
GPU_GAUGES = {
    "gpu_total_bytes": "The GPU's memory.",
    "gpu_used_bytes": "GPU memory in use by every process (weights, ORT's arena, the K/V, CUDA contexts).",
    "gpu_kv_allocated_bytes": "GPU memory held for the K/V block pool and rows.",
}

class ServerMetrics:
    def __init__(self, manager: ModelManager, cache: ResultCache):
        self.manager = manager
        self.cache = cache
        self.registry = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (engine arrival to first token).",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive generated tokens.",
                             ["model_name"], buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Request latency as the HTTP layer sees it (result-cache hits included).",
                             ["model_name"], buckets=E2E_BUCKETS, registry=self.registry)
        # Per finished request (one that produced a token), as vLLM v1: observed once when it finishes.
        self.req_hists = tuple(
            Histogram(metric, doc, ["model_name"], buckets=buckets, registry=self.registry)
            for metric, doc, buckets in (
                ("vllm:request_queue_time_seconds", "Time waiting before first scheduled (arrival -> first "
                 "scheduled).", REQUEST_TIME_BUCKETS),
                ("vllm:request_prefill_time_seconds", "Prefill phase (first scheduled -> first token).",
                 REQUEST_TIME_BUCKETS),
                ("vllm:request_decode_time_seconds", "Decode phase (first token -> last token).",
                 REQUEST_TIME_BUCKETS),
                ("vllm:request_inference_time_seconds", "Running phase (first scheduled -> last token).",
                 REQUEST_TIME_BUCKETS),
                ("vllm:request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_COUNT_BUCKETS),
                ("vllm:request_generation_tokens", "Generated tokens per finished request.",
                 TOKEN_COUNT_BUCKETS)))
        self.requests = Counter("compressor:http_requests", "HTTP requests by endpoint and status.",
                                ["endpoint", "status"], registry=self.registry)
        self._lock = threading.Lock()
        self._retired: dict[str, float] = defaultdict(float)
        self._retired_finish: dict[str, float] = defaultdict(float)
        self.registry.register(_ScrapeTimeCollector(self))
        manager.on_retire.append(self._fold)

    def _drain_latencies(self, lm: LoadedModel) -> None:
        ttft, itl = lm.engine.pop_latency_samples()
        t, i = self.ttft.labels(lm.name), self.itl.labels(lm.name)
        for x in ttft:
            t.observe(x)
        for x in itl:
            i.observe(x)
        samples = lm.engine.pop_request_samples()
        if samples:
            hq, hp, hd, hi, hpt, hgt = (h.labels(lm.name) for h in self.req_hists)
            for r in samples:
                hq.observe(r.queue_s)
                hp.observe(r.prefill_s)
                hd.observe(r.decode_s)
                hi.observe(r.inference_s)
                hpt.observe(r.prompt_tokens)
                hgt.observe(r.generation_tokens)

    def _fold(self, lm: LoadedModel) -> None:
        """An engine is about to shut down: keep its counters and latency samples."""
        self._drain_latencies(lm)
        st = lm.engine.stats()
        with self._lock:
            for _, attr, _ in _ENGINE_COUNTERS:
                self._retired[attr] += getattr(st, attr)
            for reason, n in st.finish_reasons.items():
                self._retired_finish[reason] += n

    def render(self) -> bytes:
        for lm in self.manager.live_models():
            self._drain_latencies(lm)
        return generate_latest(self.registry)


@dataclass
class _Scrape:
    """What one scrape reads: the live engines' stats, the serving model and its name."""

    stats: list  # (LoadedModel, EngineStats) of every live engine
    live: list
    cur: LoadedModel | None
    name: str

    @property
    def cur_stats(self):
        return next((s for lm, s in self.stats if lm is self.cur), None)

    def gauge(self, metric: str, doc: str, value, labels: dict | None = None) -> GaugeMetricFamily:
        labels = {"model_name": self.name} if labels is None else labels
        g = GaugeMetricFamily(metric, doc, labels=list(labels))
        g.add_metric(list(labels.values()), value)
        return g

    @staticmethod
    def counter(metric: str, doc: str, value) -> CounterMetricFamily:
        """A counter of the whole server (no labels)."""
        c = CounterMetricFamily(metric, doc)
        c.add_metric([], value)
        return c


class _ScrapeTimeCollector:
    """Reads engine, cache and manager state at scrape time."""

    def __init__(self, m: ServerMetrics):
        self.m = m

    def collect(self):
        mgr = self.m.manager
        live = [lm for lm in mgr.live_models() if not lm.closed]
        stats = []
        for lm in live:
            try:
                stats.append((lm, lm.engine.stats(wait=False)))  # a scrape never waits for a step
            except Exception:  # noqa: BLE001 - an engine shutting down mid-scrape is skipped
                continue
        cur = mgr.current
        sc = _Scrape(stats, live, cur, cur.name if cur else mgr.source.served_name)
        yield from self._engine_gauges(sc)
        yield from self._counters(sc)
        yield from self._cache_and_models(sc)

    @staticmethod
    def _engine_gauges(sc: _Scrape):
        stats, cur, st, gauge = sc.stats, sc.cur, sc.cur_stats, sc.gauge
        yield gauge("vllm:num_requests_running", "Requests running on the engine(s) now.",
                    sum(s.num_running for _, s in stats))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                    sum(s.num_waiting for _, s in stats))
        # vLLM's "perc" is a fraction: 1 means the whole KV pool is in use (evictable cached blocks count as free).
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of the serving model's KV blocks in use.",
                    st.kv_usage_pct / 100.0 if st else 0.0)
        yield gauge("compressor:kv_cache_usage_peak_perc",
                    "Highest fraction of the serving model's KV blocks in use at once since it was loaded.",
                    st.kv_usage_peak_pct / 100.0 if st else 0.0)
        yield gauge("compressor:kv_blocks_used", "KV blocks held by requests (all live engines).",
                    sum(s.kv_blocks_used for _, s in stats))
        yield gauge("compressor:kv_blocks_total", "KV blocks in the serving model's pool.",
                    st.kv_blocks_total if st else 0)
        yield gauge("compressor:kv_bytes", "Bytes held for K/V now: block pool plus in-place rows or past buffers "
                    "(all live engines).", sum(lm.engine.kv_bytes() for lm, _ in stats))
        yield gauge("compressor:kv_budget_bytes", "The serving model's KV budget (serve.kv_memory_mb as laid out).",
                    cur.engine.kv_budget_bytes() if st else 0)
        device = cur.engine.device_memory() if st else {}
        for key, doc in GPU_GAUGES.items():
            if key in device:  # the CUDA EP with the K/V on the GPU only
                yield gauge(f"compressor:{key}", doc, device[key])
        yield gauge("compressor:batch_fill_ratio", "Mean sequences per step / max_batch_size (serving model).",
                    st.batch_fill_ratio if st else 0.0)
        yield gauge("compressor:token_fill_ratio", "Mean tokens per step / max_num_batched_tokens (serving model).",
                    st.token_fill_ratio if st else 0.0)
        yield gauge("compressor:spec_decode_acceptance_rate", "Drafted tokens accepted / checked (serving model).",
                    st.spec_acceptance_rate if st else 0.0)
        yield gauge("compressor:spec_decode_tokens_per_check", "Tokens a drafted row produced per forward: accepted "
                    "drafts + the model's own token (serving model).",
                    st.spec_tokens_per_check if st else 0.0)

    def _counters(self, sc: _Scrape):
        """Engine counters: retired engines' totals plus the live ones'."""
        m = self.m
        with m._lock:
            retired = dict(m._retired)
            retired_finish = dict(m._retired_finish)
        for metric, attr, doc in _ENGINE_COUNTERS:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([sc.name], retired.get(attr, 0) + sum(getattr(s, attr) for _, s in sc.stats))
            yield c
        finish = defaultdict(float, retired_finish)
        for _, s in sc.stats:
            for reason, n in s.finish_reasons.items():
                finish[reason] += n
        c = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason.",
                                labels=["model_name", "finished_reason"])
        for reason in sorted(finish):
            c.add_metric([sc.name, reason], finish[reason])
        yield c

    def _cache_and_models(self, sc: _Scrape):
        """The result cache, the model served and the swaps."""
        cache, mgr, cur = self.m.cache, self.m.manager, sc.cur
        yield sc.counter("compressor:result_cache_hits", "Requests answered from the result cache.", cache.hits)
        yield sc.counter("compressor:result_cache_misses", "Deterministic requests not found in the result cache.",
                         cache.misses)
        yield sc.gauge("compressor:result_cache_entries", "Entries in the result cache.", len(cache), {})
        version = cur.version if cur else None
        yield sc.gauge("compressor:served_model_version",
                       "Registry version being served (0 for a local folder or none loaded).",
                       int(version) if version and version.isdigit() else 0)
        info = GaugeMetricFamily("compressor:served_model_info", "The model being served (value 1).",
                                 labels=["model_name", "version", "alias", "uri"])
        if cur is not None:
            info.add_metric([cur.name, str(cur.version or ""), str(cur.alias or ""), cur.uri], 1)
        yield info
        yield sc.gauge("compressor:models_draining", "Old models still finishing in-flight requests after a swap.",
                       len(sc.live) - (1 if cur in sc.live else 0), {})
        yield sc.counter("compressor:model_swaps", "Live model swaps.", mgr.num_swaps)
        yield sc.counter("compressor:model_load_failures", "Model versions that failed to load.", mgr.num_load_failures)
