"""A draft model for speculative decoding: a smaller model with the served model's tokenizer, decoding greedily on
its own runner and its own small KV pool (``serve.speculative_draft_kv_mb``).

Per request (keyed like the runner's rows: request id + admission epoch) it remembers the tokens whose K/V it holds.
``propose`` first catches each sequence up (the tokens the target added since, one forward per sequence), then
decodes the requested number of tokens, all sequences of the step in one batched call per drafted position.
Before the next proposal only the positions whose token still matches the sequence are kept (``sync``): the
rejected drafts' K/V is dropped and their blocks go back to the pool. A sequence that does not fit the draft's pool
gets no drafts (and its draft state is dropped); the request is served as without speculation.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from serve.artifact import read_manifest, refuse_record
from serve.config import ConfigError, ServeConfig
from serve.engine.tokenizer import load_tokenizer
from serve.kv.budget import KVCacheSpec, kv_layout
from serve.kv.cache import BlockManager
from serve.engine.runner_factory import make_runner
from serve.runners.protocol import RunRow

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _DraftSeq:
    """One request's state in the draft model: the tokens at the positions whose K/V its blocks hold."""

    key: Hashable
    ids: list[int] = field(default_factory=list)


class DraftModel:
    def __init__(self, artifact_dir: str | Path, config: ServeConfig, target_manifest: dict, target_tokenizer):
        self.artifact_dir = Path(artifact_dir)
        if not (self.artifact_dir / "manifest.json").is_file():
            raise ConfigError(f"serve.speculative: {str(artifact_dir)!r} is neither 'off', 'prompt_lookup' nor an "
                              f"artifact folder (no manifest.json there); give the folder of an exported draft model")
        self.manifest = read_manifest(self.artifact_dir, verify=config.verify_artifact)
        refuse_record(self.artifact_dir, self.manifest)
        check_same_tokenizer(load_tokenizer(self.artifact_dir), target_tokenizer, str(artifact_dir))
        target_vocab = int(target_manifest["vocab_size"])
        if int(self.manifest["vocab_size"]) > target_vocab:
            raise ConfigError(f"serve.speculative: the draft model's vocabulary ({self.manifest['vocab_size']}) is "
                              f"larger than the served model's ({target_vocab}); use a draft of the same family")
        cfg = config.model_copy(update={"kv_memory_mb": config.speculative_draft_kv_mb, "num_blocks": None,
                                        "decode_split_rows": 0, "prompt_form": "off"})
        spec = KVCacheSpec.from_manifest(self.manifest)
        num_blocks, row_tokens = kv_layout(cfg, spec, self.manifest.get("attention_layout", "standard"))
        self.block_size = cfg.kv_block_size
        self.bm = BlockManager(num_blocks, self.block_size, enable_prefix_caching=False)
        max_len = int(target_manifest.get("max_positions") or 2048)
        self.runner = make_runner(self.artifact_dir, self.manifest, cfg, num_blocks, row_tokens, max_len)
        runner = self.runner
        self.bm.on_free = lambda s: runner.release(s.key)
        self._seqs: dict[Hashable, _DraftSeq] = {}
        log.info("draft model %s: %d KV blocks of %d tokens, provider %s", self.artifact_dir, num_blocks,
                 self.block_size, self.runner.provider)

    def release(self, key: Hashable) -> None:
        """The request finished or was preempted: its draft K/V goes."""
        s = self._seqs.pop(key, None)
        if s is not None:
            self.bm.free(s)

    def _sync(self, key: Hashable, token_ids: Sequence[int]) -> _DraftSeq:
        """The request's draft state, keeping only the positions whose token still matches ``token_ids``."""
        s = self._seqs.get(key)
        if s is None:
            s = self._seqs[key] = _DraftSeq(key)
            self.bm.start(s)
            return s
        n = 0
        for a, b in zip(s.ids, token_ids):
            if a != b:
                break
            n += 1
        n = min(n, len(token_ids) - 1)  # keep one token to feed: its logits draft the first token
        if n < len(s.ids):
            del s.ids[n:]
            self.bm.shrink(s, n)
        return s

    def propose(self, requests: Sequence[tuple[Hashable, Sequence[int], int]]) -> list[list[int]]:
        """For each (key, token ids so far, k): up to k greedy draft tokens."""
        out: list[list[int]] = [[] for _ in requests]
        live: list[tuple[int, _DraftSeq, int]] = []  # (index, state, k)
        rows: list[RunRow] = []
        for i, (key, token_ids, k) in enumerate(requests):
            s = self._sync(key, token_ids)
            new = list(token_ids[len(s.ids):])
            # the fed tokens plus k - 1 drafted ones get K/V (the last draft is never fed)
            if not self.bm.allocate(s, len(token_ids) + k - 1):
                self.release(key)
                continue
            rows.append(RunRow(key, self.bm.block_table(s), len(s.ids), new))
            s.ids.extend(new)
            live.append((i, s, k))
        while rows:  # one batched forward per drafted position; a sequence leaves once it has its k
            logits = self.runner.execute(rows)
            nxt_rows, nxt_live = [], []
            for (i, s, k), lg in zip(live, logits):
                tok = int(np.argmax(lg))
                out[i].append(tok)
                if len(out[i]) < k:
                    nxt_rows.append(RunRow(s.key, self.bm.block_table(s), len(s.ids), [tok]))
                    s.ids.append(tok)
                    nxt_live.append((i, s, k))
            rows, live = nxt_rows, nxt_live
        return out

    def check_invariants(self) -> None:
        self.bm.check_invariants()
        for s in self._seqs.values():
            assert len(self.bm.block_table(s)) >= self.bm.blocks_for_tokens(len(s.ids)), s.key


def check_same_tokenizer(draft, target, where: str) -> None:
    """Refuse a draft whose tokenizer maps any text to other ids than the served model's: drafts would be noise."""
    dv, tv = draft.get_vocab(), target.get_vocab()
    if dv != tv:
        missing = sorted(set(tv) ^ set(dv))[:3]
        raise ConfigError(f"serve.speculative: the draft model at {where!r} has another tokenizer than the served "
                          f"model ({len(dv)} vs {len(tv)} tokens; differing e.g. {missing}); use a draft model "
                          f"of the same family")
