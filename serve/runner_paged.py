"""Runner backend for attention layout ``paged``: ``com.microsoft.PagedAttention`` over the block pool (CUDA only).

UNVERIFIED: written and checked only as far as a machine without a GPU allows (the graph loads
and resolves in onnxruntime; the CPU EP rejects it; this runner refuses to start without CUDA).
See docs/gqa.md for what is and is not checked.

Implements serve/runner_protocol.ModelRunner. The pool *is* the op's KV cache: per layer one K and one V
OrtValue on the GPU, [num_blocks, block_size, kv_heads, head_dim] fp16, bound as the op's cache
input and as its aliasing output, so the op writes the new K/V into the blocks in place and reads
the past straight from the engine's block tables. Nothing is gathered or copied per step, and
prefix-cache hits need no copy at all (the block table already points at the cached blocks).
One call per step: decode rows and prefill chunks are packed together (no padding) with
``cumulative_sequence_length``; ``logits_indices`` asks for each row's last token only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from serve.runner import CPU, CUDA, RunnerBase, RunnerError, RunRow, artifact_session

log = logging.getLogger(__name__)


class PagedRunner(RunnerBase):
    def __init__(self, artifact_dir: str | Path, manifest: dict, num_blocks: int, block_size: int,
                 providers: Sequence[str] = (CUDA, CPU), intra_op_threads: int = 0, ort_spinning: str = "during_runs",
                 **_):
        import onnxruntime as ort

        if manifest.get("attention_layout") != "paged":
            raise RunnerError("PagedRunner runs attention layout 'paged' artifacts")
        graph_bs = int(manifest.get("block_size", 0))
        if graph_bs != block_size:
            raise RunnerError(f"serve.block_size {block_size} differs from the paged graph's block size {graph_bs}; "
                              f"set serve.block_size: {graph_bs}")
        if CUDA not in providers:
            raise RunnerError("attention layout 'paged' (PagedAttention) runs only on CUDAExecutionProvider; "
                              "add it to serve.providers or serve the 'gqa' artifact on CPU")
        try:
            self.session = artifact_session(artifact_dir, manifest, providers, intra_op_threads,
                                            spinning=ort_spinning)
        except Exception as e:  # noqa: BLE001 - without CUDA the session falls back to CPU, which cannot load it
            raise RunnerError(f"attention layout 'paged' (PagedAttention, CUDA only) could not be loaded on "
                              f"{list(providers)}: no usable CUDA EP here? ({type(e).__name__}: {str(e)[:200]})") from e
        self.provider = self.session.get_providers()[0]
        if self.provider != CUDA:
            raise RunnerError(f"attention layout 'paged' needs a working CUDA EP; the session got {self.provider}")
        super().__init__(artifact_dir, manifest, num_blocks, block_size, providers, intra_op_threads, ort_spinning,
                         open_session=False)  # opened above, where a CPU-only machine gets its own error
        io = manifest["io"]
        self.cache_names = [n for n in io["inputs"] if "_cache." in n]
        shape = [num_blocks, block_size, self.kv_heads, self.head_dim]
        self.pool = [ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float16, "cuda", 0) for _ in self.cache_names]
        self._pool_bytes = len(self.pool) * int(np.prod(shape)) * 2
        self.gathered_tokens = 0  # always 0: the op reads the blocks where they are

    def kv_bytes(self) -> int:
        """The block pool on the GPU: the op attends over it, no dense copies."""
        return self._pool_bytes

    def kv_budget_bytes(self) -> int:
        return self._pool_bytes

    def trim(self, longest: int) -> None:
        """Nothing to give back: the pool is all the K/V there is."""

    def execute(self, rows: Sequence[RunRow]) -> list[np.ndarray | None]:
        t0 = time.perf_counter()
        bs = self.block_size
        lens = [len(r.token_ids) for r in rows]
        if min(lens) < 1:
            raise RunnerError("a scheduled row has no tokens")
        ids = np.concatenate([np.asarray(r.token_ids, np.int64) for r in rows])
        cu = np.zeros(len(rows) + 1, np.int32)
        cu[1:] = np.cumsum(lens)
        past = np.array([r.start for r in rows], np.int32)
        nblk = [-(-(r.start + n) // bs) for r, n in zip(rows, lens)]
        table = np.zeros((len(rows), max(nblk)), np.int32)
        for i, (r, k) in enumerate(zip(rows, nblk)):
            table[i, :k] = r.block_table[:k]
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("cumulative_sequence_length", cu)
        binding.bind_cpu_input("past_seqlens", past)
        binding.bind_cpu_input("block_table", table)
        binding.bind_cpu_input("logits_indices", (cu[1:] - 1).astype(np.int64))
        for name, ov in zip(self.cache_names, self.pool):
            binding.bind_ortvalue_input(name, ov)
            binding.bind_ortvalue_output(f"{name}_out", ov)  # the op's outputs alias its cache inputs
        binding.bind_output("logits", "cpu")
        t = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.run_seconds += time.perf_counter() - t
        self.calls += 1
        logits = binding.get_outputs()[0].numpy()
        if any(r.all_logits for r in rows):
            raise RunnerError("prompt log-probs (all_logits) are not implemented for the paged layout")
        out = [logits[i] if r.want_logits else None for i, r in enumerate(rows)]
        self.step_seconds += time.perf_counter() - t0
        return out
