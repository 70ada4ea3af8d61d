"""A draft head: the served model's own drafter, reading its last hidden state (built by compress/draft/).

A few small layers on top of the target (compress/draft/head.py): from the target's hidden state at the position
that chose the newest token, and that token, the head predicts the next hidden state and its token, then the
next from its own prediction, ``draft_steps`` tokens in one ONNX Runtime call (the unrolled graph, draft.onnx). It
proposes only tokens of its trimmed vocabulary (the target's most frequent answer tokens). There is no draft KV
cache to keep in step: the engine hands each decode row's hidden state over after every step (``observe``, from
the runner's ``hidden`` output, serve/runners/hidden.py), and a proposal is made only when that observation is of
the sequence's current length.

The artifact: draft.onnx, manifest.json (``kind: draft_head``, the target it was built for, its figures) and the
target's tokenizer files, checked against the served model's.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from pathlib import Path

import numpy as np

from serve.artifact import read_manifest
from serve.config import ConfigError, ServeConfig
from serve.engine.draft_model import check_same_tokenizer
from serve.engine.tokenizer import load_tokenizer
from serve.runners.onnx_session import make_session

log = logging.getLogger(__name__)

KIND = "draft_head"


def is_draft_head(artifact_dir: str | Path) -> bool:
    """Whether ``artifact_dir`` holds a draft head (not a draft model, which is an artifact of its own)."""
    import json

    path = Path(artifact_dir) / "manifest.json"
    try:
        return json.loads(path.read_text()).get("kind") == KIND
    except (OSError, ValueError):
        return False


class DraftHead:
    reads_hidden = True  # the engine's runner outputs the hidden state for it

    def __init__(self, artifact_dir: str | Path, config: ServeConfig, target_manifest: dict, target_tokenizer):
        self.artifact_dir = Path(artifact_dir)
        self.manifest = read_manifest(self.artifact_dir, verify=config.verify_artifact)
        where = str(artifact_dir)
        target = self.manifest.get("target") or {}
        for key in ("hidden_size", "vocab_size"):
            if int(target.get(key, -1)) != int(target_manifest[key]):
                raise ConfigError(f"serve.speculative: the draft head at {where!r} was built for a model with "
                                  f"{key} {target.get(key)}, the served model has {target_manifest[key]}; build "
                                  f"the drafter for this model (compress/draft)")
        if target.get("config_hash") and target_manifest.get("config_hash") and \
                target["config_hash"] != target_manifest["config_hash"]:
            log.warning("draft head %s was built for target %s, serving %s: drafts may be poor (greedy text is the "
                        "same either way)", where, target["config_hash"], target_manifest["config_hash"])
        check_same_tokenizer(load_tokenizer(self.artifact_dir), target_tokenizer, where)
        self.steps = int(self.manifest["draft_steps"])
        self.session = make_session(self.artifact_dir / "draft.onnx", config.providers,
                                    threads=config.intra_op_threads, spinning="during_runs")
        self._last: dict[Hashable, tuple[int, np.ndarray]] = {}
        log.info("draft head %s: %d steps, %d-token vocabulary", where, self.steps, int(self.manifest["draft_vocab"]))

    def observe(self, key: Hashable, n_tokens: int, hidden: np.ndarray) -> None:
        """The target's hidden state at the position that chose the sequence's newest token (of ``n_tokens``)."""
        self._last[key] = (n_tokens, hidden)

    def release(self, key: Hashable) -> None:
        self._last.pop(key, None)

    def propose(self, requests: Sequence[tuple[Hashable, Sequence[int], int]]) -> list[list[int]]:
        """For each (key, token ids so far, k): up to k drafted tokens, [] without a current observation."""
        out: list[list[int]] = [[] for _ in requests]
        live = []
        for i, (key, ids, k) in enumerate(requests):
            seen = self._last.get(key)
            if seen is not None and seen[0] == len(ids) and k > 0:
                live.append((i, seen[1], ids[-1], k))
        if not live:
            return out
        hidden = np.stack([h for _, h, _, _ in live]).astype(np.float32, copy=False)
        token = np.array([t for _, _, t, _ in live], np.int64)
        ids = self.session.run(["draft_ids"], {"hidden": hidden, "token": token})[0]
        for (i, _, _, k), row in zip(live, ids):
            out[i] = [int(t) for t in row[:k]]
        return out

    def check_invariants(self) -> None:
        pass
