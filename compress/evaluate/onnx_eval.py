"""Accuracy and speed of any exported decoder artifact on ONNX Runtime (CPU EP, numpy only).

perplexity and top-1 agreement come from batched prefill over the eval blocks
(past = 0), the same positions torch_eval.perplexity scores; latency is batch-1
greedy decode through the artifact layout's driver (compress/drivers/): the KV cache fed
back (``standard``) or kept in place (``gqa``), the way the server runs it.

Scored positions, the same for every model: in each eval block of s tokens, the logits at positions
0..s-2 predict the tokens at 1..s-1, so n blocks give n * (s - 1) scored tokens (``eval_tokens``). Block
position 0 is never a target; for a model that takes BOS it holds the BOS (compress/corpus/splits.py), so BOS is
never scored and every scored token is text (the first text token is predicted from BOS); for a model
without BOS it is the first text token, which has no context to predict it from.

Top-1 agreement and KL to the reference are taken over exactly these positions too (the logits at
0..s-2 of each block, ``eval_tokens`` of them): the logits at the last position s-1 predict a token outside
the block, which perplexity does not score, so neither does agreement (before DATA_FORMAT 3 agreement and
KL also counted that position, over n * s positions).
"""

from __future__ import annotations

import gc
import math
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from compress.artifact import read_manifest
from compress.drivers import LanguageModelDriver, load_lm


class EvaluateError(ValueError):
    pass


def _nll_and_argmax(logits: np.ndarray, ids: np.ndarray) -> tuple[float, np.ndarray]:
    """Sum of next-token NLL of the targets at positions 1..s-1 (position 0, BOS or not, is never scored),
    and the argmax [n, s-1] at the positions that predict them (0..s-2): the scored positions.

    One row at a time: the float64 temporaries of a whole batch are [n, s, vocab] x 8 bytes, half a GB per
    array at batch 4 x 128 tokens x a 128k vocabulary."""
    nll = 0.0
    for row, row_ids in zip(logits, ids):
        lg = row[:-1].astype(np.float64)
        m = lg.max(-1, keepdims=True)
        lse = np.log(np.exp(lg - m).sum(-1)) + m[..., 0]
        tgt = np.take_along_axis(lg, row_ids[1:, None], axis=-1)[..., 0]
        nll += float((lse - tgt).sum())
    return nll, logits[:, :-1].argmax(-1)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl_sum(ref: np.ndarray, logits: np.ndarray) -> float:
    """Sum over positions of KL(ref || logits), row by row (the temporaries are one row's [s, vocab])."""
    total = 0.0
    for r, c in zip(ref, logits):
        lr, lp = _log_softmax(r), _log_softmax(c)
        total += float((np.exp(lr) * (lr - lp)).sum())
    return total


# One batch's logits at most this large: [batch, block, vocab] fp32 is held by the caller and once more inside
# ORT's arena, so at a 128k vocabulary a batch of 4 x 128 was ~0.5 GB at the accept stage's peak (docs/models.md).
LOGITS_BATCH_BYTES = 128 * 2**20


def logits_batch(batch_size: int, block: int, vocab: int) -> int:
    """``batch_size``, lowered so that one batch's fp32 logits stay within LOGITS_BATCH_BYTES (at least 1)."""
    return max(1, min(int(batch_size), LOGITS_BATCH_BYTES // max(1, block * vocab * 4)))


def _load(folder: str | Path, threads: int | None) -> tuple[Path, dict, LanguageModelDriver]:
    folder = Path(folder)
    manifest = read_manifest(folder, verify=False)
    path = folder / manifest.get("onnx_file", "model.onnx")
    if not path.is_file():
        raise EvaluateError(f"{folder}: {path.name} named by the manifest is missing")
    return path, manifest, load_lm(folder, threads, verify=False)


def prefill_logits(artifact_dir: str | Path, blocks: np.ndarray, batch_size: int = 4, threads: int | None = None) -> np.ndarray:
    """Logits [n, block, vocab] of an artifact over token blocks (past = 0).

    All of them at once: 32 blocks of 128 tokens over a 128k vocabulary are 2.1 GB. For the argmax alone use
    prefill_top1, which keeps one batch's logits at a time."""
    _, _, lm = _load(artifact_dir, threads)
    return np.concatenate(list(lm.prefill_batches(blocks, batch_size)))


def prefill_top1(artifact_dir: str | Path, blocks: np.ndarray, batch_size: int = 4, threads: int | None = None) -> np.ndarray:
    """argmax [n, block] of an artifact's logits over token blocks (past = 0), one batch's logits in memory at a
    time: what evaluate_onnx takes as reference_top1."""
    _, _, lm = _load(artifact_dir, threads)
    return np.concatenate([x.argmax(-1) for x in lm.prefill_batches(blocks, batch_size)])


def _golden_pairs(golden) -> list[tuple[list[int], list[int]]]:
    pairs = []
    for g in golden:
        if isinstance(g, dict):
            pairs.append((list(g["prompt_ids"]), list(g["greedy_ids"])))
        else:
            pairs.append((list(g[0]), list(g[1])))
    return pairs


class ReferencePass:
    """One pass of a reference artifact over eval blocks, shared by every candidate judged against it.

    ``figures`` are the reference's own (evaluate_onnx without a reference: perplexity, size, decode latency when
    ``latency``); its logits at the scored positions are spooled to a temporary folder batch by batch while they
    are computed, and each candidate's ``evaluate_onnx(..., reference=this)`` reads them back one batch at a time.
    So the reference runs once however many candidates (the quantize stage's forms and trials) or figures (the
    accept stage's baseline and agreement) need it, and its session is gone before a candidate's is made. The
    folder holds n x (block - 1) x vocab fp32: 0.8 GB for 32 blocks of 128 over SmolLM2's 49k vocabulary.
    ``close()`` (or the context manager) removes it. ``lm``: what computes the reference's logits instead of the
    artifact's graph (the checkpoint in torch, compress/evaluate/checkpoint_ref.py); the artifact then only names
    the vocabulary and the size."""

    def __init__(self, artifact_dir: str | Path, eval_blocks: np.ndarray, batch_size: int = 4,
                 threads: int | None = None, *, latency: bool = True, golden: Sequence | None = None,
                 spool_dir: str | Path | None = None, lm=None):
        self.artifact_dir = Path(artifact_dir)
        self._tmp = tempfile.TemporaryDirectory(prefix="eval_ref_", dir=spool_dir)
        self.folder = Path(self._tmp.name)
        self.blocks = np.asarray(eval_blocks, np.int64)
        self.vocab = int(read_manifest(artifact_dir, verify=False)["vocab_size"])
        self.batch_size = logits_batch(batch_size, self.blocks.shape[-1], self.vocab)
        self.count = 0
        self.figures = evaluate_onnx(artifact_dir, self.blocks, batch_size=self.batch_size, threads=threads,
                                     latency=latency, golden=golden, lm=lm, _spool=self)
        gc.collect()  # its session's arena, before a candidate's

    def _save(self, i: int, logits: np.ndarray) -> None:
        np.save(self.folder / f"{i}.npy", logits[:, :-1])  # the scored positions only
        self.count = i + 1

    def batches(self) -> Iterator[np.ndarray]:
        for i in range(self.count):
            yield np.load(self.folder / f"{i}.npy")

    def check(self, eval_blocks: np.ndarray, vocab: int, who) -> None:
        if np.shape(eval_blocks) != self.blocks.shape or not np.array_equal(eval_blocks, self.blocks):
            raise EvaluateError(f"{who}: the reference pass of {self.artifact_dir} was over other eval blocks")
        if vocab != self.vocab:
            raise EvaluateError(f"reference {self.artifact_dir} has vocab {self.vocab}, candidate {vocab}: not comparable")

    def close(self) -> None:
        self._tmp.cleanup()

    def __enter__(self) -> ReferencePass:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def evaluate_onnx(artifact_dir: str | Path, eval_blocks: np.ndarray, reference_artifact: str | Path | None = None, *,
                  golden: Sequence | None = None, batch_size: int = 4, decode_steps: int = 32,
                  decode_prompt_len: int = 32, latency: bool = True, threads: int | None = None,
                  reference_top1: np.ndarray | None = None, reference: ReferencePass | None = None, lm=None,
                  _spool: ReferencePass | None = None) -> dict[str, float]:
    """Perplexity, top-1 agreement and KL vs a reference artifact, golden greedy-prefix match, size, decode latency.

    golden: [(prompt_ids, expected greedy ids)] or [{"prompt_ids", "greedy_ids"}]; the score is the mean
    fraction of the expected continuation reproduced before the first mismatch.
    reference_top1: the reference's argmax [n, block] over the same eval_blocks (from `prefill_logits(...).argmax(-1)`),
    to measure agreement without running the reference again (then no KL); its last column is not compared.
    Agreement and KL cover the positions perplexity scores (module docstring), `eval_tokens` of them.
    reference: a ReferencePass over the same eval_blocks, read instead of running its artifact again;
    reference_artifact makes one for this call (the reference runs first, then the candidate).
    lm: a loaded model that computes the logits in place of the artifact's graph (prefill_batches; no golden or
    latency then: those are the graph's).
    """
    eval_blocks = np.asarray(eval_blocks, dtype=np.int64)
    if eval_blocks.ndim != 2 or len(eval_blocks) == 0 or eval_blocks.shape[1] < 2:
        raise EvaluateError(f"eval_blocks must be a non-empty [n, block_size >= 2] array, got shape {eval_blocks.shape}")
    man0 = read_manifest(artifact_dir, verify=False)
    own_ref = reference is None and reference_artifact is not None
    if own_ref:
        reference = ReferencePass(reference_artifact, eval_blocks, batch_size, threads, latency=False)
    batch_size = _batch_for(reference, eval_blocks, batch_size, int(man0["vocab_size"]), artifact_dir)
    ref_iter = reference.batches() if reference is not None else None
    t0 = time.perf_counter()
    if lm is not None and (golden or latency):
        raise EvaluateError("evaluate_onnx with a loaded lm measures no golden match or latency; pass neither")
    path, _, lm = _load(artifact_dir, threads) if lm is None else \
        (Path(artifact_dir) / man0.get("onnx_file", "model.onnx"), None, lm)
    load_s = time.perf_counter() - t0
    if reference_top1 is not None and np.shape(reference_top1) != eval_blocks.shape:
        raise EvaluateError(f"reference_top1 has shape {np.shape(reference_top1)}, eval_blocks {eval_blocks.shape}")
    t0 = time.perf_counter()
    nll, count, agree, kl = _score_blocks(lm, eval_blocks, batch_size, ref_iter, reference_top1, _spool)
    prefill_s = time.perf_counter() - t0
    if own_ref:
        reference.close()
    out: dict[str, float] = {
        "perplexity": math.exp(nll / max(count, 1)),
        "nll": nll / max(count, 1),
        "eval_tokens": float(count),
        "size_bytes": float(sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))),
        "load_seconds": load_s,
        "prefill_tokens_per_s": eval_blocks.size / max(prefill_s, 1e-9),
    }
    if ref_iter is not None or reference_top1 is not None:
        out["top1_agreement"] = agree / max(count, 1)  # over the eval_tokens positions perplexity scores
    if ref_iter is not None:
        out["kl_to_reference"] = kl / max(count, 1)
    if golden:
        out["golden_prefix_match"] = _golden_match(lm, golden)
    if latency and decode_steps > 1:
        ms = _decode_ms(lm, eval_blocks[0][: max(1, min(decode_prompt_len, eval_blocks.shape[1]))].tolist(),
                        decode_steps)
        out["decode_ms_per_token"] = ms
        out["decode_tokens_per_s"] = 1000.0 / ms if ms > 0 else float("inf")
    return out


def _decode_ms(lm, prompt: list[int], steps: int) -> float:
    """Median ms per greedy decode step after ``prompt`` (the first steps, which pay allocation, left out)."""
    times: list[float] = []
    lm.greedy(prompt, steps + 1, step_seconds=times)
    times = times[2:] if len(times) > 4 else times
    return 1000.0 * float(np.median(times))


def _batch_for(reference: ReferencePass | None, eval_blocks: np.ndarray, batch_size: int, vocab: int,
               artifact_dir) -> int:
    """The reference's batch size, its spooled batches lining up with this run's (after checking that it covers
    these blocks and vocabulary), or one whose logits fit memory."""
    if reference is None:
        return logits_batch(batch_size, eval_blocks.shape[1], vocab)
    reference.check(eval_blocks, vocab, artifact_dir)
    return reference.batch_size


def _score_blocks(lm, eval_blocks: np.ndarray, batch_size: int, ref_iter, reference_top1,
                  spool: ReferencePass | None) -> tuple[float, int, int, float]:
    """Summed NLL, scored positions, top-1 agreements and summed KL over ``eval_blocks``, batch by batch against
    the reference's spooled batches (or its argmax ``reference_top1``); each batch's logits spooled when asked."""
    nll, count, agree, kl = 0.0, 0, 0, 0.0
    for i, logits in enumerate(lm.prefill_batches(eval_blocks, batch_size)):
        ids = eval_blocks[i * batch_size : i * batch_size + len(logits)]
        s, am = _nll_and_argmax(logits, ids)
        nll += s
        count += ids[:, 1:].size
        if reference_top1 is not None and ref_iter is None:
            agree += int((np.asarray(reference_top1)[i * batch_size : i * batch_size + len(logits), :-1] == am).sum())
        if ref_iter is not None:
            ref = next(ref_iter)  # the scored positions only, as for perplexity
            agree += int((ref.argmax(-1) == am).sum())
            kl += _kl_sum(ref, logits[:, :-1])
            del ref
        if spool is not None:
            spool._save(i, logits)
        del logits  # not alive beside the next batch's while the generator computes it
    return nll, count, agree, kl


def _golden_match(lm, golden) -> float:
    """The mean share of each expected greedy continuation reproduced before the first mismatch."""
    scores = []
    for prompt, expected in _golden_pairs(golden):
        got = lm.greedy(prompt, len(expected))
        lcp = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        scores.append(lcp / max(len(expected), 1))
    return float(np.mean(scores))
