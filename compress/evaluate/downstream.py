"""A downstream score for the gate: multiple-choice log-likelihood accuracy on held-out text.

Each item is one held-out token block: the first half is the context, and the choices are four
spans of ``span`` tokens from the rest of the same block: the one that really follows the
context and the three after it. All four are on the block's topic, in its style, from its
document, so telling them apart takes the local coherence a language model is for, not
topic matching (distractors from other documents are rejected by any model, a ceiling). A choice
is scored by the sum of its tokens' log-probabilities given the context, as lm-eval's ``acc`` does;
the answer's position among the choices is drawn from a seeded generator.

Items come only from the blocks handed in: the accept stage gives the test split and the
held-out source (neither seen by any stage before it), so the score is of text the compression
never trained or selected on. The model runs as the exported ONNX artifact (compress/drivers/).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHOICES = 4


@dataclass(frozen=True)
class Items:
    """n items of CHOICES sequences each, all the same length: context then one choice."""

    sequences: np.ndarray  # [n, CHOICES, context + span] int64
    context: int
    labels: np.ndarray  # [n] index of the true continuation

    def __len__(self) -> int:
        return len(self.labels)


def continuation_items(blocks: np.ndarray, n: int | None = None, span: int | None = None, seed: int = 0) -> Items:
    """Items from token blocks [m, s]: context = the first s // 2 tokens, choices = the next CHOICES spans.

    span defaults to (s - s // 2) // CHOICES tokens (16 for 128-token blocks); n = how many blocks (all).
    """
    blocks = np.asarray(blocks, dtype=np.int64)
    if blocks.ndim != 2:
        raise ValueError(f"continuation_items: blocks must be [n, block_size], got shape {blocks.shape}")
    s = blocks.shape[1]
    ctx = s // 2
    span = span or (s - ctx) // CHOICES
    if span < 1 or ctx + CHOICES * span > s:
        raise ValueError(f"continuation_items: blocks of {s} tokens cannot hold a {ctx}-token context and "
                         f"{CHOICES} spans of {span}; use blocks of at least {2 * CHOICES} tokens (data.block_size)")
    blocks = blocks[: n if n is not None else len(blocks)]
    rng = np.random.default_rng(seed)
    seqs = np.empty((len(blocks), CHOICES, ctx + span), dtype=np.int64)
    labels = np.empty(len(blocks), dtype=np.int64)
    for i, b in enumerate(blocks):
        spans = [b[ctx + k * span: ctx + (k + 1) * span] for k in range(CHOICES)]  # spans[0] follows the context
        order = rng.permutation(CHOICES)
        for pos, k in enumerate(order):
            seqs[i, pos, :ctx] = b[:ctx]
            seqs[i, pos, ctx:] = spans[k]
        labels[i] = int(np.flatnonzero(order == 0)[0])
    return Items(seqs, ctx, labels)


def choice_loglik(logits: np.ndarray, seqs: np.ndarray, context: int) -> np.ndarray:
    """Sum of log p(choice tokens | context) per sequence; logits [r, L, V] of seqs [r, L]."""
    lg = logits[:, context - 1:-1].astype(np.float64)  # the positions that predict the choice tokens
    m = lg.max(-1, keepdims=True)
    lse = np.log(np.exp(lg - m).sum(-1)) + m[..., 0]
    tgt = np.take_along_axis(lg, seqs[:, context:, None], axis=-1)[..., 0]
    return (tgt - lse).sum(-1)


def mc_accuracy(artifact_dir: str | Path, items: Items, batch_size: int = 8, threads: int | None = None) -> float:
    """Share of items whose true continuation the artifact scores highest (ties count as wrong)."""
    from compress.drivers import load_lm

    if len(items) == 0:
        raise ValueError("mc_accuracy: no items")
    lm = load_lm(artifact_dir, threads, verify=False)
    flat = items.sequences.reshape(-1, items.sequences.shape[-1])
    ll = np.concatenate([choice_loglik(lg, flat[i * batch_size: i * batch_size + len(lg)], items.context)
                         for i, lg in enumerate(lm.prefill_batches(flat, batch_size))]).reshape(len(items), CHOICES)
    best = ll.max(-1, keepdims=True)
    right = (ll[np.arange(len(items)), items.labels] == best[:, 0]) & ((ll == best).sum(-1) == 1)
    return float(right.mean())


def downstream_scores(artifact_dir: str | Path, test: np.ndarray, heldout: np.ndarray | None, n: int,
                      seed: int = 0, threads: int | None = None) -> dict[str, float]:
    """downstream_accuracy over the items of both sources (n blocks of each), and per source."""
    out: dict[str, float] = {}
    right, total = 0.0, 0
    for name, blocks in (("test", test), ("heldout", heldout)):
        if blocks is None or len(blocks) == 0:
            continue
        items = continuation_items(blocks, n=n, seed=seed)
        acc = mc_accuracy(artifact_dir, items, threads=threads)
        out[f"downstream_{name}_accuracy"] = acc
        right += acc * len(items)
        total += len(items)
    out["downstream_accuracy"] = right / max(total, 1)
    out["downstream_items"] = float(total)
    return out
