"""Accuracy and speed of any exported decoder artifact on ONNX Runtime (CPU EP, numpy only).

perplexity and top-1 agreement come from batched prefill over the eval blocks
(past = 0), the same positions torch_eval.perplexity scores; latency is batch-1
greedy decode with the KV cache fed back, the way the server runs it.

Scored positions, the same for every model: in each eval block of s tokens, the logits at positions
0..s-2 predict the tokens at 1..s-1, so n blocks give n * (s - 1) scored tokens (``eval_tokens``). Block
position 0 is never a target; for a model that takes BOS it holds the BOS (compress/data.py), so BOS is
never scored and every scored token is text (the first text token is predicted from BOS); for a model
without BOS it is the first text token, which has no context to predict it from.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx

from compress.artifact import read_manifest
from compress.calibration import prefill_feed


class EvaluateError(ValueError):
    pass


def make_session(model: str | Path | onnx.ModelProto, threads: int | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    so.log_severity_level = 3
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def _logits_batches(sess, blocks: np.ndarray, num_kv_heads: int, head_dim: int, batch_size: int = 4) -> Iterator[np.ndarray]:
    names = [i.name for i in sess.get_inputs()]
    for i in range(0, len(blocks), batch_size):
        x = np.asarray(blocks[i : i + batch_size], dtype=np.int64)
        yield sess.run(["logits"], prefill_feed(x, names, num_kv_heads, head_dim))[0]


def _nll_and_argmax(logits: np.ndarray, ids: np.ndarray) -> tuple[float, np.ndarray]:
    """Sum of next-token NLL of the targets at positions 1..s-1 (position 0, BOS or not, is never scored),
    and argmax at every position."""
    lg = logits[:, :-1].astype(np.float64)
    m = lg.max(-1, keepdims=True)
    lse = np.log(np.exp(lg - m).sum(-1)) + m[..., 0]
    tgt = np.take_along_axis(lg, ids[:, 1:, None], axis=-1)[..., 0]
    return float((lse - tgt).sum()), logits.argmax(-1)


def _artifact(folder: str | Path) -> tuple[Path, dict]:
    folder = Path(folder)
    manifest = read_manifest(folder, verify=False)
    path = folder / manifest.get("onnx_file", "model.onnx")
    if not path.is_file():
        raise EvaluateError(f"{folder}: {path.name} named by the manifest is missing")
    return path, manifest


def greedy(sess, prompt: Sequence[int], steps: int, num_kv_heads: int, head_dim: int, num_layers: int) -> tuple[list[int], list[float]]:
    """Batch-1 greedy decode with the KV cache; returns the new tokens and each decode step's seconds."""
    names = [i.name for i in sess.get_inputs()]
    ids = np.asarray([list(prompt)], dtype=np.int64)
    feed = prefill_feed(ids, names, num_kv_heads, head_dim)
    outs = [o.name for o in sess.get_outputs()]
    res = sess.run(outs, feed)
    past_len = ids.shape[1]
    tokens, times = [], []
    for step in range(steps):
        tok = int(res[0][0, -1].argmax())
        tokens.append(tok)
        if step == steps - 1:
            break
        feed = {"input_ids": np.array([[tok]], np.int64),
                "attention_mask": np.ones((1, past_len + 1), np.int64),
                "position_ids": np.array([[past_len]], np.int64),
                # layout 'gqa': past grows by concatenation here (no shared buffer), seqlens_k = total - 1
                "seqlens_k": np.array([past_len], np.int32), "total_sequence_length": np.array(past_len + 1, np.int32),
                "logits_to_keep": np.zeros(1, np.int64)}
        for i in range(num_layers):
            feed[f"past_key_values.{i}.key"] = res[1 + 2 * i]
            feed[f"past_key_values.{i}.value"] = res[2 + 2 * i]
        feed = {k: v for k, v in feed.items() if k in names}
        t0 = time.perf_counter()
        res = sess.run(outs, feed)
        times.append(time.perf_counter() - t0)
        past_len += 1
    return tokens, times


def prefill_logits(artifact_dir: str | Path, blocks: np.ndarray, batch_size: int = 4, threads: int | None = None) -> np.ndarray:
    """Logits [n, block, vocab] of an artifact over token blocks (past = 0)."""
    path, man = _artifact(artifact_dir)
    sess = make_session(path, threads)
    return np.concatenate(list(_logits_batches(sess, np.asarray(blocks, np.int64), int(man["num_kv_heads"]), int(man["head_dim"]), batch_size)))


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
    to measure agreement without running the reference again (then no KL).
    """
    eval_blocks = np.asarray(eval_blocks, dtype=np.int64)
    if eval_blocks.ndim != 2 or len(eval_blocks) == 0 or eval_blocks.shape[1] < 2:
        raise EvaluateError(f"eval_blocks must be a non-empty [n, block_size >= 2] array, got shape {eval_blocks.shape}")
    path, man = _artifact(artifact_dir)
    kv, hd, layers = int(man["num_kv_heads"]), int(man["head_dim"]), int(man["num_layers"])
    t0 = time.perf_counter()
    sess = make_session(path, threads)
    load_s = time.perf_counter() - t0
    ref_iter = None
    if reference_artifact is not None:
        rpath, rman = _artifact(reference_artifact)
        if int(rman["vocab_size"]) != int(man["vocab_size"]):
            raise EvaluateError(f"reference {reference_artifact} has vocab {rman['vocab_size']}, candidate {man['vocab_size']}: not comparable")
        ref_sess = make_session(rpath, threads)
        ref_iter = _logits_batches(ref_sess, eval_blocks, int(rman["num_kv_heads"]), int(rman["head_dim"]), batch_size)
    nll, count, agree, kl = 0.0, 0, 0, 0.0
    t0 = time.perf_counter()
    if reference_top1 is not None and np.shape(reference_top1) != eval_blocks.shape:
        raise EvaluateError(f"reference_top1 has shape {np.shape(reference_top1)}, eval_blocks {eval_blocks.shape}")
    for i, logits in enumerate(_logits_batches(sess, eval_blocks, kv, hd, batch_size)):
        ids = eval_blocks[i * batch_size : i * batch_size + len(logits)]
        s, am = _nll_and_argmax(logits, ids)
        nll += s
        count += ids[:, 1:].size
        if reference_top1 is not None and ref_iter is None:
            agree += int((np.asarray(reference_top1)[i * batch_size : i * batch_size + len(logits)] == am).sum())
        if ref_iter is not None:
            ref = next(ref_iter)
            agree += int((ref.argmax(-1) == am).sum())
            lp = logits - logits.max(-1, keepdims=True)
            lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
            lr = ref - ref.max(-1, keepdims=True)
            lr = lr - np.log(np.exp(lr).sum(-1, keepdims=True))
            kl += float((np.exp(lr) * (lr - lp)).sum())
    prefill_s = time.perf_counter() - t0
    out: dict[str, float] = {
        "perplexity": math.exp(nll / max(count, 1)),
        "nll": nll / max(count, 1),
        "eval_tokens": float(count),
        "size_bytes": float(sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))),
        "load_seconds": load_s,
        "prefill_tokens_per_s": eval_blocks.size / max(prefill_s, 1e-9),
    }
    if ref_iter is not None or reference_top1 is not None:
        out["top1_agreement"] = agree / eval_blocks.size
    if ref_iter is not None:
        out["kl_to_reference"] = kl / eval_blocks.size
    if golden:
        scores = []
        for prompt, expected in _golden_pairs(golden):
            got, _ = greedy(sess, prompt, len(expected), kv, hd, layers)
            lcp = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            scores.append(lcp / max(len(expected), 1))
        out["golden_prefix_match"] = float(np.mean(scores))
    if latency and decode_steps > 1:
        prompt = eval_blocks[0][: max(1, min(decode_prompt_len, eval_blocks.shape[1]))].tolist()
        _, times = greedy(sess, prompt, decode_steps + 1, kv, hd, layers)
        times = times[2:] if len(times) > 4 else times  # first steps pay allocation
        ms = 1000.0 * float(np.median(times))
        out["decode_ms_per_token"] = ms
        out["decode_tokens_per_s"] = 1000.0 / ms if ms > 0 else float("inf")
    return out
