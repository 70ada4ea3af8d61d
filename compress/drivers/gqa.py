"""The language-model driver for layout ``gqa`` (compress/drivers/): a GroupQueryAttention decoder graph.

Same interface as compress.drivers.standard.OnnxLM (compress.drivers.LanguageModelDriver), so golden
validation and evaluation can run either layout. The KV cache is one preallocated buffer per
layer [batch, kv_heads, max_len, head_dim] bound through IOBinding as both past and present:
ORT writes the new K/V in place at seqlens_k and nothing is copied between steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import onnxruntime as ort

from compress.drivers.base import CONTINUATION_LOGITS_BYTES, LanguageModelDriver, Past, _batches


class GqaCache:
    """Per-layer K and V buffers [batch, kv_heads, max_len, head_dim] (zeros; contents beyond each row's length are stale)."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype=np.float32):
        self.arrays = [np.zeros((batch, kv_heads, max_len, head_dim), dtype) for _ in range(2 * num_layers)]
        self.max_len = max_len

    @property
    def batch(self) -> int:
        return self.arrays[0].shape[0]


def bind_step(binding: ort.IOBinding, past_names: list[str], present_names: list[str], kv: list[np.ndarray], *,
              input_ids: np.ndarray, seqlens_k: np.ndarray, total: int, logits: np.ndarray, keep: int = 0) -> None:
    """Bind one call: inputs, the K/V buffers as both past and present (in place), logits into ``logits``.

    keep: logits_to_keep (0 = every position, k = the last k; ``logits`` must have that many positions).
    """
    binding.clear_binding_inputs()
    binding.clear_binding_outputs()
    binding.bind_cpu_input("input_ids", input_ids)
    binding.bind_cpu_input("seqlens_k", seqlens_k)
    binding.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
    binding.bind_cpu_input("logits_to_keep", np.array([keep], np.int64))
    for name_in, name_out, buf in zip(past_names, present_names, kv):
        # Same pointer for past and present is what makes GQA share the buffer (and skip the copy).
        binding.bind_input(name_in, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
        binding.bind_output(name_out, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
    binding.bind_output("logits", "cpu", 0, logits.dtype, list(logits.shape), logits.ctypes.data)


class GqaLM(LanguageModelDriver):
    layout = "gqa"

    def new_cache(self, batch: int, max_len: int) -> GqaCache:
        return GqaCache(self.num_layers, batch, self.kv_heads, max_len, self.head_dim, self.kv_dtype)

    def forward(self, input_ids: np.ndarray, seqlens_k: np.ndarray, cache: GqaCache, keep: int = 0) -> np.ndarray:
        """Run new tokens [batch, seq]; row b's cache ends at seqlens_k[b] (inclusive) afterwards.

        Returns logits [batch, seq, vocab], or only the last ``keep`` positions when keep > 0.
        """
        input_ids = np.ascontiguousarray(input_ids, np.int64)
        seqlens_k = np.ascontiguousarray(seqlens_k, np.int32)
        total = int(seqlens_k.max()) + 1
        if total > cache.max_len:
            raise ValueError(f"sequence length {total} exceeds the cache's max_len {cache.max_len}")
        b, s = input_ids.shape
        logits = np.empty((b, min(keep, s) if keep > 0 else s, self.vocab), np.float32)
        binding = self.session.io_binding()
        bind_step(binding, self.past_names, self.present_names, cache.arrays, input_ids=input_ids, seqlens_k=seqlens_k,
                  total=total, logits=logits, keep=min(keep, s))
        self.session.run_with_iobinding(binding)
        return logits

    def prefill(self, ids: Sequence[int], room: int = 0, last_only: bool = False) -> tuple[np.ndarray, Past]:
        ids = np.asarray(ids, np.int64)[None]
        n = ids.shape[1]
        cache = self.new_cache(1, n + room)
        return self.forward(ids, np.array([n - 1]), cache, keep=1 if last_only else 0)[0], Past(cache, n)

    def decode(self, ids: Sequence[int], past: Past) -> tuple[np.ndarray, Past]:
        ids = np.asarray(ids, np.int64)[None]
        n = past.length + ids.shape[1]
        return self.forward(ids, np.array([n - 1]), past.kv)[0], Past(past.kv, n)

    def prefill_batch(self, blocks: np.ndarray) -> np.ndarray:
        b, s = blocks.shape
        return self.forward(blocks, np.full(b, s - 1), self.new_cache(b, s))

    def logits_left_padded(self, seqs: list[list[int]], pad_id: int = 0) -> list[np.ndarray]:
        """One batch of several prompts (the golden batched check); returns each row's logits at its real positions.

        GQA takes ragged rows through seqlens_k, so the batch is right-padded: no position shift, no mask.
        """
        n = max(len(s) for s in seqs)
        ids = np.full((len(seqs), n), pad_id, np.int64)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = s
        cache = self.new_cache(len(seqs), n)
        logits = self.forward(ids, np.array([len(s) - 1 for s in seqs]), cache)
        return [logits[i, :len(s)] for i, s in enumerate(seqs)]

    def continuation_logits(self, prompts: Sequence[Sequence[int]], conts: Sequence[Sequence[int]],
                            max_logits_bytes: int = CONTINUATION_LOGITS_BYTES) -> Iterator[tuple[int, np.ndarray]]:
        """As the base class's, keeping fewer positions: rows sorted by prompt length go together as one batch of
        first prompts (right-padded, each row's length in seqlens_k), and the call keeps the logits from the
        shortest prompt's last position on (logits_to_keep), which covers every row's continuation. For 48
        chat prompts of 20-90 tokens with 48-token answers that is ~60 positions a row instead of ~140."""
        order = sorted((i for i, c in enumerate(conts) if len(c)), key=lambda i: (len(prompts[i]), len(conts[i])))

        def widths(rows: list[int]) -> tuple[int, int]:
            longest = max(len(prompts[i]) + len(conts[i]) for i in rows)
            return longest - min(len(prompts[i]) for i in rows) + 1, longest

        for batch in _batches(order, widths, self.vocab, max_logits_bytes):
            keep, longest = widths(batch)
            seqs = [list(prompts[i]) + list(conts[i]) for i in batch]
            ids = np.zeros((len(batch), longest), np.int64)
            for b, s in enumerate(seqs):
                ids[b, :len(s)] = s
            logits = self.forward(ids, np.array([len(s) - 1 for s in seqs]), self.new_cache(len(batch), longest), keep)
            first = longest - keep  # the position of logits[:, 0]
            for b, i in enumerate(batch):
                p = len(prompts[i]) - 1 - first
                yield i, logits[b, p:p + len(conts[i])]
