"""Exact-match LRU cache of finished responses for deterministic requests.

A request is deterministic when its output depends only on (model, prompt, sampling
parameters): greedy decoding (temperature 0 or top_k 1) or a fixed ``seed`` (the sampler
draws from a per-request generator, so batching does not change the tokens). The key
holds the served model's identity, the prompt token ids and *every* SamplingParams field,
so a new field added to SamplingParams is part of the key without touching this module.
The server also empties the cache on every model swap; the model key in the entry makes
a stale hit impossible even between the swap and the clear.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields

from serve.engine.sampling import SamplingParams

# Only complete answers are worth replaying; a cancelled or failed one is not the model's answer.
CACHEABLE_FINISH_REASONS = frozenset({"stop", "length"})


@dataclass(frozen=True)
class CachedResult:
    text: str
    output_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


def is_deterministic(params: SamplingParams) -> bool:
    return params.is_greedy or params.seed is not None


def _freeze(value) -> Hashable:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, float) and value.is_integer():
        return int(value)  # temperature 0 and 0.0 are the same request
    return value


def cache_key(model_key: str, prompt_ids: Sequence[int], params: SamplingParams) -> tuple | None:
    """The key for a request, or None when the request is not deterministic (never cached)."""
    if not is_deterministic(params):
        return None
    sampling = tuple((f.name, _freeze(getattr(params, f.name))) for f in fields(params))
    return (model_key, tuple(int(t) for t in prompt_ids), sampling)


class ResultCache:
    """Thread-safe LRU (the swap thread clears it while the event loop reads it)."""

    def __init__(self, max_entries: int):
        if max_entries < 0:
            raise ValueError(f"serve.result_cache_size must be >= 0 (got {max_entries}); 0 turns the cache off")
        self.max_entries = max_entries
        self._data: OrderedDict[tuple, CachedResult] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.clears = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: tuple | None) -> CachedResult | None:
        if key is None or not self.enabled:
            return None
        with self._lock:
            hit = self._data.get(key)
            if hit is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return hit

    def put(self, key: tuple | None, result: CachedResult) -> bool:
        """Store a finished result; returns whether it was stored."""
        if key is None or not self.enabled or result.finish_reason not in CACHEABLE_FINISH_REASONS:
            return False
        with self._lock:
            self._data[key] = result
            self._data.move_to_end(key)
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)
                self.evictions += 1
        return True

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.clears += 1
