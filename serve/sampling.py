"""Sampling parameters and the per-token sampler (numpy only).

Order of operations on one row of logits, as in Hugging Face ``generate``:
repetition penalty → (greedy: argmax) → temperature → top-k → top-p → draw.

Reproducibility: a request with a ``seed`` gets its own ``numpy.random.Generator``;
each generated token consumes exactly one uniform draw from it, and candidates are
ordered by (probability desc, token id asc) before the draw, so the same seed and
the same logits give the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class SamplingError(ValueError):
    """Invalid sampling parameters, phrased for the API user (HTTP 400)."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages tokens already in prompt or output
    stop: list[str] = field(default_factory=list)  # stop strings; the text returned ends before them
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the model's eos ids
    ignore_eos: bool = False

    @classmethod
    def greedy(cls, max_tokens: int = 16, **kw) -> SamplingParams:
        return cls(max_tokens=max_tokens, temperature=0.0, **kw)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> SamplingParams:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be an integer >= 1 (got {self.max_tokens!r})")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise SamplingError(f"temperature must be in [0, 100] (got {self.temperature!r})")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0, 0 meaning off (got {self.top_k!r})")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if not (0.0 < float(self.repetition_penalty) <= 10.0):
            raise SamplingError(f"repetition_penalty must be in (0, 10] (got {self.repetition_penalty!r})")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise SamplingError(f"seed must be a non-negative integer (got {self.seed!r})")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise SamplingError("stop strings must be non-empty strings")
        if len(self.stop) > 16:
            raise SamplingError(f"at most 16 stop strings (got {len(self.stop)})")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingError("stop_token_ids must be non-negative integers")
        return self

    def make_generator(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def apply_repetition_penalty(logits: np.ndarray, token_ids: Sequence[int], penalty: float) -> np.ndarray:
    """HF/CTRL rule: for every token seen, logit / p if positive, logit * p if negative."""
    if penalty == 1.0 or len(token_ids) == 0:
        return logits
    ids = np.unique(np.asarray(token_ids, dtype=np.int64))
    ids = ids[(ids >= 0) & (ids < logits.shape[-1])]
    sel = logits[ids]
    logits = logits.copy()
    logits[ids] = np.where(sel > 0, sel / penalty, sel * penalty)
    return logits


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None,
                 token_ids: Sequence[int] = ()) -> int:
    """Pick the next token from one row of logits ``[vocab]``."""
    logits = np.asarray(logits, dtype=np.float32)
    if params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, token_ids, params.repetition_penalty)
    if params.is_greedy:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / float(params.temperature)
    vocab = x.shape[0]
    if 0 < params.top_k < vocab:
        cand = np.argpartition(-x, params.top_k - 1)[: params.top_k]
    else:
        cand = np.arange(vocab)
    cx = x[cand]
    # Deterministic order: probability descending, then token id ascending.
    order = np.lexsort((cand, -cx))
    cand, cx = cand[order], cx[order]
    p = np.exp(cx - cx[0])
    p /= p.sum()
    if params.top_p < 1.0:
        cum = np.cumsum(p)
        # smallest set whose mass reaches top_p (1e-6 slack so float rounding of an exact boundary counts)
        keep = int(np.searchsorted(cum, params.top_p - 1e-6, side="left")) + 1
        cand, p = cand[:keep], p[:keep]
        p = p / p.sum()
    if rng is None:
        rng = np.random.default_rng()
    u = rng.random()
    idx = int(np.searchsorted(np.cumsum(p), u, side="right"))
    return int(cand[min(idx, len(cand) - 1)])


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index of the earliest stop string in ``text`` that ends at or after ``start``, or -1.

    ``start`` lets the caller search only where new text could complete a match.
    """
    best = -1
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1 and (best == -1 or i < best):
            best = i
    return best
