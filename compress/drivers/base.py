"""One interface over an exported decoder graph, one driver per attention layout (offline, numpy, batch-1 decode).

``LanguageModelDriver`` is what golden validation (compress/evaluate/golden.py), evaluation (compress/evaluate/onnx_eval.py:
perplexity, agreement, golden prefix, decode latency), quantization sensitivity and the benchmarks run:

* ``prefill(ids, room, last_only) -> (logits, past)`` and ``decode(ids, past) -> (logits, past)``: one
  sequence through the KV cache; ``past`` is a ``Past`` the driver owns (``room`` = tokens that will follow);
* ``prefill_batch(blocks)``: logits ``[n, s, vocab]`` of equal-length rows with no past (perplexity);
* ``logits_left_padded(seqs)``: one batch of ragged prompts (the golden batched check);
* ``logits(ids)``, ``prefill_batches(blocks)`` and ``greedy(...)`` are written once, here, on top.

The drivers: ``compress.drivers.standard.OnnxLM`` (layout ``standard``: past in, present out) and
``compress.drivers.gqa.GqaLM`` (layout ``gqa``: one in-place buffer per layer). ``load_lm(folder)`` picks the one
the manifest's ``attention_layout`` names; ``lm_for_model(model, manifest)`` runs an in-memory graph.
Sessions come from serve.runners.onnx_session.make_session (CPU EP, errors-only log), as the server's do.
The server's batched runners (serve/runners/standard*.py) manage their own KV and do not use these.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from compress.artifact import read_manifest
from serve.kv.cache import served_kv_dtype
from serve.runners.onnx_session import CPU, artifact_session, kv_io_names, make_session


def greedy_token(logits: np.ndarray, suppress_ids: list[int] | None = None) -> int:
    """argmax of one position's logits, never one of suppress_ids."""
    if suppress_ids:
        logits = logits.copy()
        logits[suppress_ids] = -np.inf
    return int(np.argmax(logits))


# One batch of continuation_logits at most this large; the tokens of one call at most MAX_BATCH_TOKENS.
CONTINUATION_LOGITS_BYTES = 128 * 2**20
MAX_BATCH_TOKENS = 2048


def _batches(order: list[int], widths, vocab: int, max_logits_bytes: int) -> Iterator[list[int]]:
    """``order`` cut into runs (at least one row each) whose padded logits [rows, logit positions, vocab] fp32
    stay within ``max_logits_bytes`` and whose padded tokens within MAX_BATCH_TOKENS; ``widths(rows)`` gives a
    run's (logit positions, padded tokens) per row."""
    batch: list[int] = []
    for i in order:
        logit_positions, tokens = widths(batch + [i])
        rows = len(batch) + 1
        if batch and (rows * logit_positions * vocab * 4 > max_logits_bytes or rows * tokens > MAX_BATCH_TOKENS):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


@dataclass
class Past:
    """One sequence's KV state as a driver keeps it: ``kv`` is layout-specific, ``length`` the tokens it holds."""

    kv: Any
    length: int


class LanguageModelDriver:
    layout: ClassVar[str] = ""

    def __init__(self, artifact_dir: str | Path, threads: int | None = None, verify: bool = True):
        self.folder = Path(artifact_dir)
        manifest = read_manifest(self.folder, verify=verify)
        self._check_layout(manifest, self.folder)
        self._setup(manifest, artifact_session(self.folder, manifest, (CPU,), threads, log_severity=3))

    @classmethod
    def from_model(cls, model, manifest: dict, threads: int | None = None) -> LanguageModelDriver:
        """A driver over an in-memory graph (an onnx.ModelProto, or bytes) with the artifact's manifest."""
        cls._check_layout(manifest, "model")
        self = cls.__new__(cls)
        self.folder = None
        self._setup(manifest, make_session(model, (CPU,), threads, log_severity=3))
        return self

    @classmethod
    def from_session(cls, session, manifest: dict, folder: str | Path | None = None) -> LanguageModelDriver:
        """A driver over a session that is already loaded (e.g. the serving engine's runner's): no second copy of
        the weights."""
        cls._check_layout(manifest, folder or "session")
        self = cls.__new__(cls)
        self.folder = Path(folder) if folder else None
        self._setup(manifest, session)
        return self

    @classmethod
    def _check_layout(cls, manifest: dict, where) -> None:
        layout = manifest.get("attention_layout", "standard")
        if layout != cls.layout:
            raise ValueError(f"{where}: attention_layout is {layout!r}; {cls.__name__} drives {cls.layout!r} "
                             "artifacts (compress.drivers.load_lm picks the driver)")

    def _setup(self, manifest: dict, session) -> None:
        self.manifest = manifest
        self.session = session
        self.num_layers = int(manifest["num_layers"])
        self.kv_heads = int(manifest["num_kv_heads"])
        self.head_dim = int(manifest["head_dim"])
        self.vocab = int(manifest["vocab_size"])
        self.kv_dtype = getattr(np, served_kv_dtype(manifest))
        self.past_names, self.present_names = kv_io_names(manifest)

    # -- per layout -------------------------------------------------------------------------------------------
    def prefill(self, ids: Sequence[int], room: int = 0, last_only: bool = False) -> tuple[np.ndarray, Past]:
        """Logits [len(ids), vocab] (or [1, vocab] if last_only) of one sequence, and its past with room for
        ``room`` more tokens."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int], past: Past) -> tuple[np.ndarray, Past]:
        """Append ``ids`` to ``past``: their logits [len(ids), vocab] and the longer past."""
        raise NotImplementedError

    def prefill_batch(self, blocks: np.ndarray) -> np.ndarray:
        """Logits [n, s, vocab] of n rows of s tokens each, no past."""
        raise NotImplementedError

    def logits_left_padded(self, seqs: list[list[int]], pad_id: int = 0) -> list[np.ndarray]:
        """One batch of ragged prompts; each row's logits at its real positions."""
        raise NotImplementedError

    # -- written once ------------------------------------------------------------------------------------------
    def logits(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Prefill logits [seq, vocab] for one unpadded sequence."""
        return self.prefill(ids)[0]

    def prefill_batches(self, blocks: np.ndarray, batch_size: int = 4) -> Iterator[np.ndarray]:
        """prefill_batch over ``blocks`` [n, s] in batches of ``batch_size`` rows."""
        blocks = np.asarray(blocks, np.int64)
        for i in range(0, len(blocks), batch_size):
            yield self.prefill_batch(blocks[i:i + batch_size])

    def continuation_logits(self, prompts: Sequence[Sequence[int]], conts: Sequence[Sequence[int]],
                            max_logits_bytes: int = CONTINUATION_LOGITS_BYTES) -> Iterator[tuple[int, np.ndarray]]:
        """For each pair with a non-empty continuation, ``(index, logits [len(cont), vocab])``: the logits at the
        positions that predict the continuation's tokens (the prompt's last position on), in any order.

        Rows of similar length go together, right-padded, in batches whose logits stay within
        ``max_logits_bytes``; here every position's logits are computed (the layout's padded batch), GqaLM
        computes only the continuation's."""
        order = sorted((i for i, c in enumerate(conts) if len(c)), key=lambda i: len(prompts[i]) + len(conts[i]))

        def widths(rows: list[int]) -> tuple[int, int]:
            longest = max(len(prompts[i]) + len(conts[i]) for i in rows)
            return longest, longest

        for batch in _batches(order, widths, self.vocab, max_logits_bytes):
            seqs = [list(prompts[i]) + list(conts[i]) for i in batch]
            for i, lg in zip(batch, self.logits_left_padded(seqs)):
                p = len(prompts[i])
                yield i, lg[p - 1:p - 1 + len(conts[i])]

    def greedy(self, prompt: Sequence[int], new_tokens: int, eos_ids: Sequence[int] | None = None,
               suppress_ids: list[int] | None = None, step_seconds: list[float] | None = None) -> list[int]:
        """Greedy continuation through the KV cache: prefill once, then one token per step.

        suppress_ids are never picked (as generate() holds EOS off until min_new_tokens); each decode
        step's seconds are appended to ``step_seconds`` when given (no step runs after the last token).
        """
        logits, past = self.prefill(prompt, room=new_tokens, last_only=True)
        out: list[int] = []
        for _ in range(new_tokens):
            tok = greedy_token(logits[-1], suppress_ids)
            out.append(tok)
            if (eos_ids and tok in eos_ids) or len(out) == new_tokens:
                break
            t0 = time.perf_counter()
            logits, past = self.decode([tok], past)
            if step_seconds is not None:
                step_seconds.append(time.perf_counter() - t0)
        return out
