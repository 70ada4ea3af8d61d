"""A minimal numpy driver for an exported decoder graph (layout ``standard``).

Used offline by golden validation and evaluation; the server has its own
batched runner in serve/runner.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from compress.artifact import read_manifest


def greedy_token(logits: np.ndarray, suppress_ids: list[int] | None = None) -> int:
    """argmax of one position's logits, never one of suppress_ids."""
    if suppress_ids:
        logits = logits.copy()
        logits[suppress_ids] = -np.inf
    return int(np.argmax(logits))


def make_session(onnx_path: str | Path, threads: int | None = None, optimize: bool = True) -> ort.InferenceSession:
    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])


class OnnxLM:
    def __init__(self, artifact_dir: str | Path, threads: int | None = None, verify: bool = True):
        self.folder = Path(artifact_dir)
        self.manifest = read_manifest(self.folder, verify=verify)
        self.session = make_session(self.folder / self.manifest.get("onnx_file", "model.onnx"), threads)
        self.num_layers = self.manifest["num_layers"]
        self.kv_heads = self.manifest["num_kv_heads"]
        self.head_dim = self.manifest["head_dim"]
        self.past_names = self.manifest["io"]["inputs"][3:]
        self.present_names = self.manifest["io"]["outputs"][1:]

    def empty_past(self, batch: int) -> list[np.ndarray]:
        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), np.float32) for _ in self.past_names]

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                past: list[np.ndarray] | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
        input_ids = np.asarray(input_ids, np.int64)
        past = past if past is not None else self.empty_past(input_ids.shape[0])
        feeds = {"input_ids": input_ids, "attention_mask": np.asarray(attention_mask, np.int64),
                 "position_ids": np.asarray(position_ids, np.int64)}
        feeds.update(zip(self.past_names, past))
        out = self.session.run(None, feeds)
        return out[0], out[1:]

    def logits(self, ids: list[int] | np.ndarray) -> np.ndarray:
        """Prefill logits [seq, vocab] for one unpadded sequence."""
        ids = np.asarray(ids, np.int64)[None]
        n = ids.shape[1]
        logits, _ = self.forward(ids, np.ones((1, n), np.int64), np.arange(n)[None])
        return logits[0]

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

    def greedy(self, prompt: list[int], new_tokens: int, eos_ids: list[int] | None = None,
               suppress_ids: list[int] | None = None) -> list[int]:
        """Greedy continuation through the KV cache path (prefill once, then one token per step).

        suppress_ids are never picked (as generate() holds EOS off until min_new_tokens).
        """
        ids = np.asarray(prompt, np.int64)[None]
        n = ids.shape[1]
        logits, past = self.forward(ids, np.ones((1, n), np.int64), np.arange(n)[None])
        out: list[int] = []
        for _ in range(new_tokens):
            tok = greedy_token(logits[0, -1], suppress_ids)
            out.append(tok)
            if eos_ids and tok in eos_ids:
                break
            n += 1
            logits, past = self.forward(np.array([[tok]]), np.ones((1, n), np.int64), np.array([[n - 1]]), past)
        return out
