"""The language-model driver for layout ``standard`` (compress/drivers/): past K/V in, present K/V out.

Used offline by golden validation and evaluation; the server has its own batched runner in serve/runners/standard.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from compress.drivers.base import LanguageModelDriver, Past


class OnnxLM(LanguageModelDriver):
    layout = "standard"

    def empty_past(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), self.kv_dtype) for _ in self.past_names]

    def _feeds(self, input_ids, attention_mask, position_ids, past: list[np.ndarray] | None) -> dict[str, np.ndarray]:
        input_ids = np.asarray(input_ids, np.int64)
        past = past if past is not None else self.empty_past(input_ids.shape[0])
        feeds = {"input_ids": input_ids, "attention_mask": np.asarray(attention_mask, np.int64),
                 "position_ids": np.asarray(position_ids, np.int64)}
        feeds.update(zip(self.past_names, past))
        return feeds

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                past: list[np.ndarray] | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
        """One raw call: logits [batch, seq, vocab] and the presents (past + the new tokens)."""
        out = self.session.run(None, self._feeds(input_ids, attention_mask, position_ids, past))
        return out[0], out[1:]

    def prefill(self, ids: Sequence[int], room: int = 0, last_only: bool = False) -> tuple[np.ndarray, Past]:
        ids = np.asarray(ids, np.int64)[None]
        n = ids.shape[1]
        logits, kv = self.forward(ids, np.ones((1, n), np.int64), np.arange(n)[None])
        return (logits[0, -1:] if last_only else logits[0]), Past(kv, n)

    def decode(self, ids: Sequence[int], past: Past) -> tuple[np.ndarray, Past]:
        ids = np.asarray(ids, np.int64)[None]
        n, s = past.length, ids.shape[1]
        logits, kv = self.forward(ids, np.ones((1, n + s), np.int64), np.arange(n, n + s)[None], past.kv)
        return logits[0], Past(kv, n + s)

    def prefill_batch(self, blocks: np.ndarray) -> np.ndarray:
        b, s = blocks.shape
        pos = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s))
        return self.session.run(["logits"], self._feeds(blocks, np.ones((b, s), np.int64), pos, None))[0]

    def logits_left_padded(self, seqs: list[list[int]], pad_id: int = 0) -> list[np.ndarray]:
        """One left-padded batch; returns each row's logits at its real positions."""
        n = max(len(s) for s in seqs)
        ids = np.full((len(seqs), n), pad_id, np.int64)
        mask = np.zeros((len(seqs), n), np.int64)
        for i, s in enumerate(seqs):
            ids[i, n - len(s):] = s
            mask[i, n - len(s):] = 1
        pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        logits, _ = self.forward(ids, mask, pos)
        return [logits[i, n - len(s):] for i, s in enumerate(seqs)]
