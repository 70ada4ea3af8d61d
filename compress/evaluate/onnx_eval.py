"""Accuracy and speed of any exported decoder artifact on ONNX Runtime (CPU EP, numpy only).

perplexity and top-1 agreement come from batched prefill over the eval blocks
(past = 0), the same positions torch_eval.perplexity scores; latency is batch-1
greedy decode through the artifact layout's driver (compress/drivers/): the KV cache fed
back (``standard``) or kept in place (``gqa``), the way the server runs it.

Scored positions, the same for every model: in each eval block of s tokens, the logits at positions
0..s-2 predict the tokens at 1..s-1, so n blocks give n * (s - 1) scored tokens (``eval_tokens``). Block
position 0 is never a target; for a model that takes BOS it holds the BOS (compress/data.py), so BOS is
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
from collections.abc import Sequence
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


# Reference + candidate graphs above this are evaluated one after the other (evaluate_onnx).
SEQUENTIAL_BYTES = 3 * 2**30
# One batch's logits at most this large: [batch, block, vocab] fp32 is held by the caller and once more inside
# ORT's arena, so at a 128k vocabulary a batch of 4 x 128 was ~0.5 GB at the accept stage's peak (docs/models.md).
LOGITS_BATCH_BYTES = 128 * 2**20


def logits_batch(batch_size: int, block: int, vocab: int) -> int:
    """``batch_size``, lowered so that one batch's fp32 logits stay within LOGITS_BATCH_BYTES (at least 1)."""
    return max(1, min(int(batch_size), LOGITS_BATCH_BYTES // max(1, block * vocab * 4)))


def _onnx_bytes(folder: str | Path) -> int:
    folder = Path(folder)
    name = read_manifest(folder, verify=False).get("onnx_file", "model.onnx")
    return sum(p.stat().st_size for p in folder.glob(name + "*"))


def _spooled(reference: str | Path, blocks: np.ndarray, batch_size: int, threads: int | None, folder: Path):
    """The reference's prefill logits batch by batch, computed all first (then its session is freed) and read
    back from ``folder`` one batch at a time."""
    _, _, lm = _load(reference, threads)
    n = 0
    for i, x in enumerate(lm.prefill_batches(blocks, batch_size)):
        np.save(folder / f"{i}.npy", x)
        n = i + 1
    del lm
    gc.collect()

    def read():
        for i in range(n):
            yield np.load(folder / f"{i}.npy")
    return read()


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


def evaluate_onnx(
    artifact_dir: str | Path,
    eval_blocks: np.ndarray,
    reference_artifact: str | Path | None = None,
    golden: Sequence | None = None,
    batch_size: int = 4,
    decode_steps: int = 32,
    decode_prompt_len: int = 32,
    latency: bool = True,
    threads: int | None = None,
    reference_top1: np.ndarray | None = None,
) -> dict[str, float]:
    """Perplexity, top-1 agreement and KL vs a reference artifact, golden greedy-prefix match, size, decode latency.

    golden: [(prompt_ids, expected greedy ids)] or [{"prompt_ids", "greedy_ids"}]; the score is the mean
    fraction of the expected continuation reproduced before the first mismatch.
    reference_top1: the reference's argmax [n, block] over the same eval_blocks (from `prefill_logits(...).argmax(-1)`),
    to measure agreement without running the reference again (then no KL); its last column is not compared.
    Agreement and KL cover the positions perplexity scores (module docstring), `eval_tokens` of them.
    """
    eval_blocks = np.asarray(eval_blocks, dtype=np.int64)
    if eval_blocks.ndim != 2 or len(eval_blocks) == 0 or eval_blocks.shape[1] < 2:
        raise EvaluateError(f"eval_blocks must be a non-empty [n, block_size >= 2] array, got shape {eval_blocks.shape}")
    ref_iter, spool = None, None
    man0 = read_manifest(artifact_dir, verify=False)
    batch_size = logits_batch(batch_size, eval_blocks.shape[1], int(man0["vocab_size"]))
    if reference_artifact is not None:
        rman = read_manifest(reference_artifact, verify=False)
        if int(rman["vocab_size"]) != int(man0["vocab_size"]):
            raise EvaluateError(f"reference {reference_artifact} has vocab {rman['vocab_size']}, candidate {man0['vocab_size']}: not comparable")
        if _onnx_bytes(reference_artifact) + _onnx_bytes(artifact_dir) > SEQUENTIAL_BYTES:
            # Two large sessions side by side (a 3B model's fp32 baseline is 12 GB on its own): run the reference
            # first, its logits to disk batch by batch, and only then load the candidate. Same numbers.
            spool = tempfile.TemporaryDirectory(prefix="eval_ref_")
            ref_iter = _spooled(reference_artifact, eval_blocks, batch_size, threads, Path(spool.name))
        else:
            _, _, ref_lm = _load(reference_artifact, threads)
            ref_iter = ref_lm.prefill_batches(eval_blocks, batch_size)
    t0 = time.perf_counter()
    path, man, lm = _load(artifact_dir, threads)
    load_s = time.perf_counter() - t0
    nll, count, agree, kl = 0.0, 0, 0, 0.0
    t0 = time.perf_counter()
    if reference_top1 is not None and np.shape(reference_top1) != eval_blocks.shape:
        raise EvaluateError(f"reference_top1 has shape {np.shape(reference_top1)}, eval_blocks {eval_blocks.shape}")
    for i, logits in enumerate(lm.prefill_batches(eval_blocks, batch_size)):
        ids = eval_blocks[i * batch_size : i * batch_size + len(logits)]
        s, am = _nll_and_argmax(logits, ids)
        nll += s
        count += ids[:, 1:].size
        if reference_top1 is not None and ref_iter is None:
            agree += int((np.asarray(reference_top1)[i * batch_size : i * batch_size + len(logits), :-1] == am).sum())
        if ref_iter is not None:
            ref = next(ref_iter)[:, :-1]  # the scored positions only, as for perplexity
            agree += int((ref.argmax(-1) == am).sum())
            kl += _kl_sum(ref, logits[:, :-1])
            del ref
    prefill_s = time.perf_counter() - t0
    if spool is not None:
        spool.cleanup()
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
        scores = []
        for prompt, expected in _golden_pairs(golden):
            got = lm.greedy(prompt, len(expected))
            lcp = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            scores.append(lcp / max(len(expected), 1))
        out["golden_prefix_match"] = float(np.mean(scores))
    if latency and decode_steps > 1:
        prompt = eval_blocks[0][: max(1, min(decode_prompt_len, eval_blocks.shape[1]))].tolist()
        times: list[float] = []
        lm.greedy(prompt, decode_steps + 1, step_seconds=times)
        times = times[2:] if len(times) > 4 else times  # first steps pay allocation
        ms = 1000.0 * float(np.median(times))
        out["decode_ms_per_token"] = ms
        out["decode_tokens_per_s"] = 1000.0 / ms if ms > 0 else float("inf")
    return out
