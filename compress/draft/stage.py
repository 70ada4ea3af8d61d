"""The draft stage: build the target's drafter from its own artifact, as a plain function.

target artifact -> the target's conversations with their hidden states (conversations.py) -> the trimmed
vocabulary (the answers' most frequent tokens) and the target's head on it (target.py) -> the head distilled on
them (head.py) -> acceptance on held-out conversations -> draft.onnx (graph.py) with its manifest and the target's
tokenizer. ``serve.speculative: <folder>`` serves it (serve/engine/draft_head.py).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from compress.draft import conversations as conv
from compress.draft.settings import DraftConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class DraftError(ValueError):
    """A drafter that cannot be built as asked; the message names the key."""


@dataclass
class DraftResult:
    path: Path
    accepted_per_check: float  # held-out greedy acceptance: mean drafts that stand per check (of `steps`)
    rate_by_position: list[float]
    vocab_coverage: float  # held-out answer tokens inside the drafter's vocabulary
    answer_tokens: int
    record_seconds: float
    train_seconds: float
    seconds: float
    losses: list[float] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        return {"draft_accepted_per_check": self.accepted_per_check, "draft_vocab_coverage": self.vocab_coverage,
                "draft_answer_tokens": float(self.answer_tokens), "draft_record_seconds": self.record_seconds,
                "draft_train_seconds": self.train_seconds, "draft_seconds": self.seconds}


def build_drafter(target: str | Path, out_dir: str | Path, cfg: DraftConfig, *, cache: str | Path | None = None,
                  progress: bool = True) -> DraftResult:
    """Build the drafter of the artifact ``target`` into ``out_dir``. ``cache``: an .npz of the recorded
    conversations, reused when present (the recording is most of the stage's time)."""
    import torch

    from compress.draft.graph import export_head
    from compress.draft.head import Corpus, HeadNet, chain_acceptance, train

    t0 = time.perf_counter()
    target, out = Path(target), Path(out_dir)
    manifest = json.loads((target / "manifest.json").read_text())
    if manifest.get("attention_layout") != "gqa":
        raise DraftError(f"draft: the target {target} has attention layout {manifest.get('attention_layout')!r}; a "
                         f"draft head reads the hidden state that gqa artifacts output (export.attention_layout: gqa)")
    V = int(manifest["vocab_size"])
    if cfg.vocab > V:
        raise DraftError(f"draft.vocab {cfg.vocab} is larger than the target's vocabulary ({V}); set it at most {V}")
    if cfg.tokens < cfg.batch_size:
        raise DraftError(f"draft.tokens {cfg.tokens} is less than one batch (draft.batch_size {cfg.batch_size})")
    t_rec = time.perf_counter()
    if cache is not None and Path(cache).is_file():
        convs = conv.load(cache)
    else:
        convs = conv.record(target, cfg.prompts, max_tokens=cfg.max_tokens, users=cfg.users, own_share=cfg.own_turns,
                            seed=cfg.seed, progress=progress)
        if cache is not None:
            conv.save(convs, cache)
    record_s = time.perf_counter() - t_rec
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(convs))
    n_held = max(1, int(round(len(convs) * cfg.held_out)))
    held, fit = [convs[i] for i in order[:n_held]], [convs[i] for i in order[n_held:]]
    if not fit:
        raise DraftError(f"draft.prompts {cfg.prompts}: too few conversations to hold {cfg.held_out:.0%} out; raise it")
    counts = np.bincount(np.concatenate([c.ids[c.start:] for c in fit]), minlength=V)
    vocab_ids = np.sort(np.argsort(-counts, kind="stable")[:cfg.vocab]).astype(np.int64)
    to_index = np.full(V, len(vocab_ids), np.int64)
    to_index[vocab_ids] = np.arange(len(vocab_ids))
    train_data, held_data = Corpus.of(fit, to_index), Corpus.of(held, to_index)
    coverage = float(np.mean(held_data.idx < len(vocab_ids)))

    from compress.draft.target import head_matrix

    W = head_matrix(target, manifest, vocab_ids)
    torch.manual_seed(cfg.seed)
    scale = float(np.sqrt(np.mean(train_data.G.astype(np.float32) ** 2)))
    net = HeadNet(W, cfg.width, scale)
    report = train(net, train_data, steps_unrolled=cfg.steps, tokens=cfg.tokens, batch=cfg.batch_size, lr=cfg.lr,
                   t_start=cfg.t_start, t_end=cfg.t_end, feature_weight=cfg.feature_weight, seed=cfg.seed,
                   progress=progress)
    net.eval()
    acc = chain_acceptance(net, held_data, vocab_ids, cfg.steps)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    export_head(net, vocab_ids, V, cfg.steps, tmp / "draft.onnx")
    for name in TOKENIZER_FILES:
        if (target / name).is_file():
            shutil.copy2(target / name, tmp / name)
    seconds = time.perf_counter() - t0
    result = DraftResult(out, acc["accepted_per_check"], acc["rate_by_position"], coverage,
                         int(sum(len(c.hidden) for c in convs)), record_s, report.seconds, seconds, report.losses)
    from compress.artifact import write_manifest

    write_manifest(tmp, {"kind": "draft_head", "draft_steps": cfg.steps, "draft_vocab": len(vocab_ids),
                         "width": cfg.width,
                         "target": {k: manifest.get(k) for k in ("hidden_size", "vocab_size", "config_hash",
                                                                  "source_model", "family")},
                         "settings": cfg.model_dump(),
                         "figures": {k: v for k, v in asdict(result).items() if k not in ("path", "losses")}})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return result
