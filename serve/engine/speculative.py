"""Speculative decoding: where drafts come from, how a request's draft length adapts, and the exact acceptance rule.

A decode row that carries k drafted tokens runs as one forward of k + 1 positions (the last sampled token and the
drafts) through the same runner; the target's logits at those positions decide how many drafts stand. Checking
k tokens reads the weights once, as one decode step does, so every accepted draft is a token for nearly nothing
while a step is bound by reading the weights (one user, a few users on a CPU).

Acceptance (``accept_drafts``). Drafts here are proposals with all their mass on one token (prompt lookup, or a
draft model decoding greedily), so the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023) reads:
draft d at position i stands with probability p_i(d), p_i being the target's distribution after every sampling
parameter (penalties see the drafts accepted before it); the first rejected one is replaced by a draw from p_i
without d, renormalised; when all k stand, one more token is drawn from p_k. The tokens produced are distributed
exactly as sampling one token at a time from the target. Greedy requests keep a draft iff it is the argmax, so
their text is token for token what decoding without speculation gives.

Draft sources: ``prompt_lookup`` finds the longest recent n-gram of the sequence earlier in it (prompt or output)
and proposes what followed it there (no second model; it pays where the answer copies the prompt: code edits,
quoting, extraction). serve/engine/draft_model.py runs a smaller model with the same tokenizer.

Adaptive length (``DraftLength``): per request, k grows by 2 after a fully accepted draft and shrinks by 1 after a
rejection (Hugging Face's assisted-generation heuristic); a request whose drafts keep failing (accepted share
under ``MIN_RATE`` over its recent checks) stops drafting for a number of steps that doubles each time. The engine
drafts only while a step has at most ``serve.speculative_max_rows`` rows: beyond, decoding is no longer bound by
the weight read (and the gqa runner checks each draft row in a call of its own), so speculation would cost
throughput (docs/serving.md, "Speculative decoding").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from serve.engine.sampling import SamplingParams, draw, process_logits, token_distribution

MIN_RATE = 0.3  # below this accepted share (moving average), a request pauses drafting
MAX_PAUSE = 64  # steps; a pause doubles from 4 up to this


def prompt_lookup(token_ids: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last n tokens (the longest
    n from ``max_ngram`` down to ``min_ngram`` that occurs), or [] when none occurs."""
    n_tok = len(token_ids)
    if k <= 0 or n_tok < 2:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        tail = arr[n_tok - n:]
        # windows ending before the tail itself: starts 0 .. n_tok - n - 1
        windows = np.lib.stride_tricks.sliding_window_view(arr[:n_tok - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence: closest to what is being written now
            return [int(t) for t in arr[start:start + k]]
    return []


def accept_drafts(logits: np.ndarray, drafts: Sequence[int], params: SamplingParams, rng: np.random.Generator | None,
                  token_ids: Sequence[int], prompt_len: int, stop_ids: Sequence[int] = ()) -> list[int]:
    """The tokens a verification produces: the drafts that stand, then one token from the target (1 to k + 1).

    ``logits`` [k + 1, vocab]: the target's raw logits after the last known token and after each draft;
    ``token_ids`` the sequence before the drafts (prompt + output). Each check uses one uniform draw from ``rng``,
    and so does the final token (sampled requests)."""
    ctx = list(token_ids)
    out: list[int] = []
    for i, d in enumerate(drafts):
        lg = process_logits(logits[i], params, ctx, prompt_len, stop_ids)
        if params.is_greedy:
            best = int(np.argmax(lg))
            if best != d:
                return [*out, best]
        else:
            cand, p = token_distribution(lg, params)
            hit = np.flatnonzero(cand == d)
            pd = float(p[hit[0]]) if hit.size else 0.0
            u = (rng or np.random.default_rng()).random()
            if u >= pd:  # rejected: draw from p without d (the residual max(p - q, 0) of a one-hot q)
                if hit.size:
                    p = p.copy()
                    p[hit[0]] = 0.0
                    p /= p.sum()
                return [*out, draw(cand, p, rng)]
        out.append(int(d))
        ctx.append(int(d))
    lg = process_logits(logits[len(drafts)], params, ctx, prompt_len, stop_ids)
    final = int(np.argmax(lg)) if params.is_greedy else draw(*token_distribution(lg, params), rng)
    return [*out, final]


def best_length(first: float, costs: Sequence[float], k_max: int) -> int:
    """The draft length with the most tokens per second: ``costs[n]`` is a check of n positions over a plain decode
    step (costs[1] = 1), ``first`` the chance a draft stands (taken as the same at every position). A check of k
    drafts yields 1 + first + ... + first^k tokens on average. On 2 cores a 4-bit 1.5B checks 2 positions for
    1.03x a decode step but 5 for 1.77x, so a drafter right one time in three pays at k = 1 and loses at k = 4."""
    best, best_rate = 1, 0.0
    for k in range(1, min(k_max, len(costs) - 2) + 1):
        rate = draft_rate(first, costs, k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def draft_rate(first: float, costs: Sequence[float], k: int) -> float:
    """Tokens per decode step's time when every check carries ``k`` drafts that each stand with chance ``first``."""
    return sum(first ** i for i in range(k + 1)) / costs[k + 1]


class DraftLength:
    """One request's draft length: grows while drafts stand, shrinks when they fail, pauses when they keep failing;
    with measured check costs (``costs``, serve/engine/drafter.py) never beyond the length that pays best."""

    __slots__ = ("k", "k_max", "rate", "pause", "next_pause", "first", "costs")

    def __init__(self, k_max: int, costs: Sequence[float] | None = None):
        self.k_max = k_max
        self.k = k_max
        self.rate = 1.0  # moving average of the accepted share
        self.pause = 0  # steps left without drafting
        self.next_pause = 4
        self.first = 0.5  # moving average of "the first draft stood"
        self.costs = costs

    def want(self) -> int:
        """How many tokens to draft now (0 while paused). Call once per decode step of the request."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        if self.costs is not None:
            return min(self.k, best_length(self.first, self.costs, self.k_max))
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.first = 0.8 * self.first + 0.2 * float(accepted > 0)
        self.rate = 0.7 * self.rate + 0.3 * accepted / proposed
        self.k = min(self.k + 2, self.k_max) if accepted == proposed else max(1, self.k - 1)
        # with measured costs, drafting stops only where even one draft costs more than it brings
        losing = (1 + self.first) < self.costs[2] if self.costs is not None and len(self.costs) > 2 else \
            self.rate < MIN_RATE
        if losing:
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, MAX_PAUSE)
            self.rate, self.k = MIN_RATE, 1  # after the pause: probe with one token
        elif accepted == proposed:
            self.next_pause = 4
