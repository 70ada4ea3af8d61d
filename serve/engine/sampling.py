"""Sampling parameters and the per-token sampler (numpy only).

Order of operations on one row of logits, as vLLM (v1) does it:
min_tokens (stop ids masked) → logit_bias → penalties (repetition over prompt + output, then
frequency and presence over the output) → (greedy: argmax) → temperature → min_p → top-k → top-p → draw.
Log-probs (``logprobs``) are the log-softmax of the raw model logits, before any of this (vLLM's
default ``raw_logprobs``): ``token_logprobs``.

Cost: a sampled row with no top-p or min-p sorts only its most likely tokens when the draw lands among them
(``draw_from_head``, the full sort's token), 1.1 against 6.9 ms a token on a 49k vocabulary.

Reproducibility: a request with a ``seed`` gets its own ``numpy.random.Generator``;
each generated token consumes exactly one uniform draw from it (a constrained row without top-k/top-p/min-p: two
where its grammar refuses the first, serve/engine/grammar.py ``choose``), and candidates are
ordered by (probability desc, token id asc) before the draw, so the same seed and
the same logits give the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class SamplingError(ValueError):
    """Invalid sampling parameters, phrased for the API user (HTTP 400); ``field`` is the request field at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


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
    min_tokens: int = 0  # stop ids and stop strings are ignored until this many tokens were generated
    min_p: float = 0.0  # 0 = off; keep tokens whose probability is >= min_p * the top token's
    presence_penalty: float = 0.0  # OpenAI/vLLM: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None = off; k = the chosen token's log-prob and the top k (0..20)
    # None = off; k = every prompt token's log-prob (from the raw logits of the position before it) and the top
    # k there (0..20). Such a request takes nothing from the prefix cache (vLLM): every position is computed.
    prompt_logprobs: int | None = None
    # None = free text; else a serve/engine/grammar.py GrammarSpec that every token must keep the output within
    # (typed loosely: grammar.py imports this module for SamplingError)
    structured: object | None = None

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
            raise SamplingError("max_tokens", f"max_tokens must be an integer >= 1 (got {self.max_tokens!r})")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise SamplingError("temperature", f"temperature must be in [0, 100] (got {self.temperature!r})")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError("top_k", f"top_k must be an integer >= 0, 0 meaning off (got {self.top_k!r})")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise SamplingError("top_p", f"top_p must be in (0, 1] (got {self.top_p!r})")
        if not (0.0 < float(self.repetition_penalty) <= 10.0):
            raise SamplingError("repetition_penalty",
                                f"repetition_penalty must be in (0, 10] (got {self.repetition_penalty!r})")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise SamplingError("seed", f"seed must be a non-negative integer (got {self.seed!r})")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise SamplingError("stop", "stop strings must be non-empty strings")
        if len(self.stop) > 16:
            raise SamplingError("stop", f"at most 16 stop strings (got {len(self.stop)})")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingError("stop_token_ids", "stop_token_ids must be non-negative integers")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingError("min_tokens", f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}] "
                                f"(got {self.min_tokens!r})")
        if not (0.0 <= float(self.min_p) <= 1.0):
            raise SamplingError("min_p", f"min_p must be in [0, 1] (got {self.min_p!r})")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= float(getattr(self, name)) <= 2.0):
                raise SamplingError(name, f"{name} must be in [-2, 2] (got {getattr(self, name)!r})")
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if any(t < 0 or not -100.0 <= v <= 100.0 for t, v in self.logit_bias.items()):
            raise SamplingError("logit_bias", "logit_bias maps token ids (>= 0) to biases in [-100, 100]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise SamplingError("logprobs", f"logprobs must be an integer in [0, 20] (got {self.logprobs!r})")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise SamplingError("prompt_logprobs",
                                f"prompt_logprobs must be an integer in [0, 20] (got {self.prompt_logprobs!r})")
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


def apply_frequency_presence_penalties(logits: np.ndarray, output_ids: Sequence[int], frequency: float,
                                       presence: float) -> np.ndarray:
    """OpenAI/vLLM rule over the *generated* tokens only: logit -= frequency * count + presence * (count > 0)."""
    if (frequency == 0.0 and presence == 0.0) or len(output_ids) == 0:
        return logits
    ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
    keep = (ids >= 0) & (ids < logits.shape[-1])
    ids, counts = ids[keep], counts[keep]
    logits = logits.copy()
    logits[ids] -= (frequency * counts + presence).astype(logits.dtype)
    return logits


def process_logits(logits: np.ndarray, params: SamplingParams, token_ids: Sequence[int] = (),
                   prompt_len: int | None = None, stop_ids: Sequence[int] = ()) -> np.ndarray:
    """The logits the draw sees, before temperature: min_tokens (``stop_ids`` masked while fewer than
    ``min_tokens`` tokens were generated), logit_bias, then the penalties. ``token_ids`` is prompt + output;
    ``prompt_len`` splits them (None: all of ``token_ids`` counts as output)."""
    logits = np.asarray(logits, dtype=np.float32)
    start = 0 if prompt_len is None else prompt_len
    output_ids = token_ids[start:]
    if params.min_tokens and len(output_ids) < params.min_tokens and len(stop_ids):
        ids = np.asarray([t for t in stop_ids if 0 <= t < logits.shape[-1]], dtype=np.int64)
        logits = logits.copy()
        logits[ids] = -np.inf
    if params.logit_bias:
        ids = np.asarray([t for t in params.logit_bias if t < logits.shape[-1]], dtype=np.int64)
        logits = logits.copy()
        logits[ids] += np.asarray([params.logit_bias[int(t)] for t in ids], dtype=np.float32)
    if params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, token_ids, params.repetition_penalty)
    return apply_frequency_presence_penalties(logits, output_ids, params.frequency_penalty,
                                              params.presence_penalty)


def token_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """(log-prob of ``token``, the ``k`` most likely (id, log-prob), best first, ties by id) from the
    log-softmax of the raw ``logits`` row (float64)."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    top: list[tuple[int, float]] = []
    if k > 0:
        k = min(k, lp.shape[0])
        cand = np.argpartition(-lp, k - 1)[:k]
        cand = cand[np.lexsort((cand, -lp[cand]))]
        top = [(int(t), float(lp[t])) for t in cand]
    return float(lp[token]), top


def token_distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(candidate ids, their probabilities) the draw picks from, for already processed ``logits`` of a sampled
    (not greedy) request: temperature → min_p → top-k → top-p; candidates ordered by (probability desc, id asc)."""
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
    finite = np.isfinite(cx)
    if params.min_p > 0.0:  # relative to the top token, which every candidate set keeps
        finite &= cx - cx[0] >= np.log(params.min_p)
    if not finite.all() and finite.any():
        cand, cx = cand[finite], cx[finite]
    p = np.exp(cx - cx[0])
    p /= p.sum()
    if params.top_p < 1.0:
        cum = np.cumsum(p)
        # smallest set whose mass reaches top_p (1e-6 slack so float rounding of an exact boundary counts)
        keep = int(np.searchsorted(cum, params.top_p - 1e-6, side="left")) + 1
        cand, p = cand[:keep], p[:keep]
        p = p / p.sum()
    return cand, p


def draw(cand: np.ndarray, p: np.ndarray, rng: np.random.Generator | None) -> int:
    """One token from (candidates, probabilities): exactly one uniform draw from ``rng``."""
    if rng is None:
        rng = np.random.default_rng()
    u = rng.random()
    idx = int(np.searchsorted(np.cumsum(p), u, side="right"))
    return int(cand[min(idx, len(cand) - 1)])


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None,
                 token_ids: Sequence[int] = (), prompt_len: int | None = None, stop_ids: Sequence[int] = ()) -> int:
    """Pick the next token from one row of logits ``[vocab]`` (see ``process_logits`` for the arguments)."""
    logits = process_logits(logits, params, token_ids, prompt_len, stop_ids)
    if params.is_greedy:
        return int(np.argmax(logits))
    if params.top_p >= 1.0 and params.min_p == 0.0:
        tok = draw_from_head(logits, params, rng)
        if tok is not None:
            return tok
    return draw(*token_distribution(logits, params), rng)


HEAD = 256  # candidates sorted when a draw lands among the most likely ones


def draw_from_head(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int | None:
    """``draw(*token_distribution(...))`` without sorting the whole vocabulary (5 of its 7 ms a token on a 49k
    vocabulary): for temperature and top-k alone, the order (probability desc, id asc) matters only up to where the
    one uniform draw lands, which is nearly always among the HEAD most likely tokens. Those strictly above the
    HEAD-th's logit are sorted alone; a draw past them makes the caller sort everything, with the same draw
    (``rng`` is rewound). The token is the full sort's but for float rounding of the normaliser's sum."""
    n = logits.shape[0]
    if n <= HEAD or 0 < params.top_k <= HEAD:
        return None  # the full path sorts at most HEAD candidates anyway
    x = logits.astype(np.float64) / float(params.temperature)
    if 0 < params.top_k < n:
        keep = np.zeros(n, dtype=bool)
        keep[np.argpartition(-x, params.top_k - 1)[:params.top_k]] = True
        x[~keep] = -np.inf
    head = np.argpartition(-x, HEAD - 1)[:HEAD]
    edge = x[head].min()
    if not np.isfinite(edge):
        return None  # fewer than HEAD candidates (top-k, a grammar's mask): the full path is short anyway
    top = x.max()
    w = np.exp(x - top)
    total = w.sum()
    strict = head[x[head] > edge]
    strict = strict[np.lexsort((strict, -x[strict]))]
    cum = np.cumsum(w[strict]) / total
    rng = rng or np.random.default_rng()
    state = rng.bit_generator.state
    u = rng.random()
    if cum.size and u < cum[-1]:
        return int(strict[int(np.searchsorted(cum, u, side="right"))])
    rng.bit_generator.state = state  # the full sort draws the same u
    return None


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index of the earliest stop string in ``text`` that ends at or after ``start``, or -1.

    ``start`` lets the caller search only where new text could complete a match.
    """
    return find_stop_span(text, stops, start)[0]


def find_stop_span(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, int]:
    """(index, length) of the earliest stop string as ``find_stop`` finds it (the longest at that index),
    or (-1, 0)."""
    best, length = -1, 0
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1 and (best == -1 or i < best or i == best and len(s) > length):
            best, length = i, len(s)
    return best, length
