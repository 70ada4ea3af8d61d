"""Text sources -> deterministic train / calib / eval token blocks.

Sources: the embedded corpus (CPython's ``pydoc_data.topics``, present on every
CPython), local text/json/jsonl/csv/parquet files or folders, and hub datasets
when online. The token stream is cut into fixed-length blocks; a seeded
permutation assigns each block to exactly one split, so splits never overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

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
                 total_tokens=self.total_tokens)

    @classmethod
    def load(cls, path: str | Path) -> "DataSplits":
        with np.load(path, allow_pickle=False) as z:
            return cls(z["train"], z["calib"], z["eval"], str(z["source"]), int(z["total_tokens"]))


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


def tokenize_blocks(texts: list[str], tokenizer, block_size: int, eos_id: int | None) -> np.ndarray:
    """Concatenate documents (separated by EOS) and cut into full blocks; the ragged tail is dropped."""
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if eos_id is not None:
            ids.append(eos_id)
    n = len(ids) // block_size
    return np.asarray(ids[: n * block_size], dtype=np.int64).reshape(n, block_size)


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
    texts = load_texts(source, text_field, subset, split)
    blocks = tokenize_blocks(texts, tokenizer, block_size, tokenizer.eos_token_id)
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
    return DataSplits(train=blocks[tr], calib=blocks[ca], eval=blocks[ev], source=source, total_tokens=int(blocks.size))


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
