"""What the engine asks of a runner, and the set-up every runner shares.

``ModelRunner`` is the interface serve/engine/engine.py calls, in full and without probing: one step (``execute``),
the KV memory it holds and may hold (``kv_bytes``, ``kv_budget_bytes``), giving memory back (``trim``), and
the facts the engine reports (``provider``, ``vocab_size``, timing counters). The two runners
(serve/runners/standard.py ``standard``, serve/runners/gqa.py ``gqa``) implement all of it; tests/test_engine.py checks each against this protocol.

``RunnerBase`` unpacks the manifest (layers, KV heads, head dim, vocabulary) and opens the ONNX Runtime
session once, for every runner.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from serve.kv.budget import KVCacheSpec
from serve.runners.onnx_session import CPU, artifact_session


class RunnerError(RuntimeError):
    pass


log = logging.getLogger(__name__)


@dataclass
class RunRow:
    """One sequence's share of a step."""

    key: Hashable  # identifies the sequence's K/V content (request id + admission epoch)
    block_table: Sequence[int]
    start: int  # tokens already in the cache = first new position
    token_ids: Sequence[int]  # the new tokens, positions start .. start+n-1
    want_logits: bool = True
    # every new position's logits ([n, vocab]) instead of the last one's (prompt log-probs); only rows that ask pay
    all_logits: bool = False


@runtime_checkable
class ModelRunner(Protocol):
    """A model on one ONNX Runtime session over the engine's block pool."""

    provider: str  # the execution provider the session really got
    vocab_size: int
    num_blocks: int
    block_size: int
    calls: int  # session runs so far
    run_seconds: float  # inside session.run
    step_seconds: float  # whole execute calls
    gathered_tokens: int  # positions copied from the pool into dense K/V (0 where the op reads the pool)

    def execute(self, rows: Sequence[RunRow]) -> list[np.ndarray | None]:
        """Compute the rows' new tokens and store their K/V; per row the last position's logits ([vocab]),
        every new position's ([n, vocab]) for ``all_logits``, None where ``want_logits`` is False. The arrays may be
        views of the runner's buffers, valid until the next ``execute``: use them before calling it again."""

    def kv_bytes(self) -> int:
        """Bytes held for K/V now (pool and whatever dense copies the layout keeps)."""

    def kv_budget_bytes(self) -> int:
        """The most ``kv_bytes`` reaches by design."""

    def trim(self, longest: int) -> None:
        """Give back K/V memory beyond what the running sequences need; ``longest`` is the longest running
        sequence's length (0: nothing runs). Called between steps."""

    def release(self, key: Hashable) -> None:
        """The engine is freeing the blocks of the sequence ``key`` (finished, cancelled or preempted): whatever
        the runner still holds for it is dead and must not be written into those blocks."""


class RunnerBase:
    """The manifest's dimensions, the session and the counters, as every runner sets them up."""

    def __init__(self, artifact_dir: str | Path, manifest: dict, num_blocks: int, block_size: int,
                 providers: Sequence[str], intra_op_threads: int, ort_spinning: str, *, open_session: bool = True,
                 hidden: bool = False):
        self.num_layers = int(manifest["num_layers"])
        self.kv_heads = int(manifest["num_kv_heads"])
        self.head_dim = int(manifest["head_dim"])
        self.vocab_size = int(manifest["vocab_size"])
        self.n_kv = 2 * self.num_layers  # one K and one V tensor per layer
        self.bytes_per_token = KVCacheSpec.from_manifest(manifest).bytes_per_token
        self.num_blocks = num_blocks
        self.block_size = block_size
        if manifest.get("kv_dtype") == "int8" and list(providers) != [CPU]:
            # ORT's CUDA GroupQueryAttention reads an int8 cache only with fp16/bf16 queries; these graphs are fp32
            log.info("int8 K/V cache (quantize.kv_cache): the CPU execution provider serves it")
            providers = [CPU]
        if open_session:
            self.session = artifact_session(artifact_dir, manifest, providers, intra_op_threads, spinning=ort_spinning,
                                            hidden=hidden)
            self.provider = self.session.get_providers()[0]
        self.calls = 0
        self.run_seconds = 0.0
        self.step_seconds = 0.0

    def release(self, key: Hashable) -> None:
        """Nothing to drop: these runners write every new K/V into the blocks in the step that made it."""
