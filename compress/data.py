"""Text sources -> deterministic train / calib / eval token blocks.

Sources: the embedded corpus (CPython's ``pydoc_data.topics``, present on every
CPython), local text/json/jsonl/csv/parquet files or folders, and hub datasets
when online. The token stream is cut into fixed-length blocks; a seeded
permutation assigns each block to exactly one split, so splits never overlap.

A model that takes BOS (compress/special_tokens.py decides) gets it at the start of every block:
BOS + block_size - 1 tokens of the stream; a model without BOS gets block_size tokens of the stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Part of the load stage's cache key: bump when the blocks cut from the same text and tokenizer change
# (2: blocks start with BOS for models that take one).
DATA_FORMAT = 2

_EXT_TO_BUILDER = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


class DataError(ValueError):
    """A data source that cannot be read, phrased for the user."""


@dataclass
class DataSplits:
    train: np.ndarray  # [n, block_size] int64
    calib: np.ndarray
    eval: np.ndarray
    source: str
    total_tokens: int
    bos_token_id: int | None = None  # the BOS every block starts with; None: the model takes no BOS

    def summary(self) -> dict:
        return {
            "data_source": self.source,
            "data_total_tokens": self.total_tokens,
            "data_train_blocks": len(self.train),
            "data_calib_blocks": len(self.calib),
            "data_eval_blocks": len(self.eval),
            "data_block_size": int(self.train.shape[1]) if len(self.train) else 0,
        }

    def save(self, path: str | Path) -> None:
        """Write the splits as one .npz (arrays and strings only, read back without pickle)."""
        np.savez(path, train=self.train, calib=self.calib, eval=self.eval, source=self.source,
                 total_tokens=self.total_tokens, bos_token_id=-1 if self.bos_token_id is None else self.bos_token_id)

    @classmethod
    def load(cls, path: str | Path) -> "DataSplits":
        with np.load(path, allow_pickle=False) as z:
            bos = int(z["bos_token_id"]) if "bos_token_id" in z.files else -1  # older files: no BOS
            return cls(z["train"], z["calib"], z["eval"], str(z["source"]), int(z["total_tokens"]),
                       None if bos < 0 else bos)


def embedded_corpus() -> list[str]:
    """English documentation text shipped with every CPython, one entry per topic, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _load_local(path: Path, text_field: str) -> list[str]:
    files = sorted(p for p in path.rglob("*") if p.suffix in _EXT_TO_BUILDER) if path.is_dir() else [path]
    if not files:
        raise DataError(f"data.source {str(path)!r}: no .txt/.json/.jsonl/.csv/.parquet files found")
    kinds = {_EXT_TO_BUILDER.get(f.suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise DataError(
            f"data.source {str(path)!r}: files must all be one of {sorted(_EXT_TO_BUILDER)} (found {sorted({f.suffix for f in files})})"
        )
    builder = kinds.pop()
    if builder == "text":
        # Plain text: one document per file keeps paragraphs together.
        return [f.read_text(encoding="utf-8", errors="replace") for f in files]
    from datasets import load_dataset

    ds = load_dataset(builder, data_files=[str(f) for f in files], split="train")
    return _column(ds, text_field, str(path))


def _column(ds, text_field: str, origin: str) -> list[str]:
    if text_field not in ds.column_names:
        raise DataError(
            f"data.text_field {text_field!r} is not a column of {origin!r}; columns are {ds.column_names}. "
            f"Set data.text_field to one of them."
        )
    return [t for t in ds[text_field] if isinstance(t, str) and t.strip()]


def _load_hub(name: str, subset: str | None, split: str, text_field: str) -> list[str]:
    from datasets import load_dataset

    try:
        ds = load_dataset(name, subset, split=split)
    except Exception as e:  # datasets raises many types for "not reachable / not cached"
        raise DataError(
            f"data.source {name!r}: could not load it from the hub or the local cache ({type(e).__name__}: {e}). "
            f"Offline, point data.source at a local file or folder (txt/json/jsonl/csv/parquet) or use 'embedded'."
        ) from None
    return _column(ds, text_field, name)


def load_texts(source: str, text_field: str = "text", subset: str | None = None, split: str = "train") -> list[str]:
    if source == "embedded":
        return embedded_corpus()
    path = Path(source).expanduser()
    if path.exists():
        return _load_local(path, text_field)
    if source.startswith((".", "/", "~")) or Path(source).suffix in _EXT_TO_BUILDER:
        raise DataError(f"data.source {source!r}: no such file or folder")
    return _load_hub(source, subset, split, text_field)


def tokenize_blocks(texts: list[str], tokenizer, block_size: int, eos_id: int | None,
                    bos_id: int | None = None) -> np.ndarray:
    """Concatenate documents (separated by EOS) and cut into full blocks; the ragged tail is dropped.

    bos_id: every block is [bos_id] + the next block_size - 1 tokens of the stream (a model that takes BOS
    sees one at the start of every sequence, as in its training); None: block_size tokens of the stream.
    """
    if bos_id is not None and block_size < 2:
        raise DataError(f"data.block_size {block_size}: a model that takes BOS needs blocks of at least 2 tokens")
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if eos_id is not None:
            ids.append(eos_id)
    step = block_size if bos_id is None else block_size - 1
    n = len(ids) // step
    body = np.asarray(ids[: n * step], dtype=np.int64).reshape(n, step)
    if bos_id is None:
        return body
    return np.concatenate([np.full((n, 1), bos_id, dtype=np.int64), body], axis=1)


def make_splits(
    tokenizer,
    source: str = "embedded",
    block_size: int = 128,
    train_blocks: int = 256,
    calib_blocks: int = 32,
    eval_blocks: int = 32,
    seed: int = 0,
    text_field: str = "text",
    subset: str | None = None,
    split: str = "train",
) -> DataSplits:
    from compress.special_tokens import bos_id_of

    texts = load_texts(source, text_field, subset, split)
    bos = bos_id_of(tokenizer)
    blocks = tokenize_blocks(texts, tokenizer, block_size, tokenizer.eos_token_id, bos)
    need = train_blocks + calib_blocks + eval_blocks
    if len(blocks) < 3:
        raise DataError(f"data.source {source!r} yields only {len(blocks)} blocks of {block_size} tokens; use more text or a smaller data.block_size")
    if len(blocks) < need:
        # Shrink train first: calib and eval are small and matter for correctness of the gate.
        train_blocks = max(1, len(blocks) - calib_blocks - eval_blocks)
        if train_blocks + calib_blocks + eval_blocks > len(blocks):
            raise DataError(
                f"data.source {source!r} yields {len(blocks)} blocks of {block_size} tokens, fewer than "
                f"calib_blocks + eval_blocks + 1 = {calib_blocks + eval_blocks + 1}; lower data.calib_blocks / data.eval_blocks"
            )
    order = np.random.default_rng(seed).permutation(len(blocks))
    ev = order[:eval_blocks]
    ca = order[eval_blocks : eval_blocks + calib_blocks]
    tr = order[eval_blocks + calib_blocks : eval_blocks + calib_blocks + train_blocks]
    return DataSplits(train=blocks[tr], calib=blocks[ca], eval=blocks[ev], source=source, total_tokens=int(blocks.size),
                      bos_token_id=bos)


def splits_from_config(tokenizer, cfg) -> DataSplits:
    """cfg: a DataConfig."""
    return make_splits(
        tokenizer,
        source=cfg.source,
        block_size=cfg.block_size,
        train_blocks=cfg.train_blocks,
        calib_blocks=cfg.calib_blocks,
        eval_blocks=cfg.eval_blocks,
        seed=cfg.seed,
        text_field=cfg.text_field,
        subset=cfg.subset,
        split=cfg.split,
    )
