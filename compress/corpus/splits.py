"""Text sources -> deterministic train / calib / selection / test token blocks, plus a held-out source.

Sources: the embedded corpus (CPython's ``pydoc_data.topics``, present on every
CPython), local text/json/jsonl/csv/parquet files or folders, and hub datasets
when online. The token stream is cut into fixed-length blocks and each block goes to exactly one split,
so splits never overlap (a block the text repeats is kept once):

- ``train`` (distillation), ``calib`` (calibration: pruning, quantization), ``selection`` (the
  split for choosing: distillation's evals and early stopping, the relax loop's trials, prune's before/after figures);
- ``test``: held out from every stage; only the accept stage's verdict reads it.

Stable under size changes: a seeded permutation of the blocks is dealt into four lanes (position p of the
permutation goes to lane p % 4); test, selection and calib each take the first N blocks of their own lane, and
train takes the first train_blocks of what is left, in permutation order. Raising one held-out split's
count therefore never moves a block into or out of another held-out split (only train gives the blocks up),
and each of test / selection / calib can hold at most a quarter of the corpus.

The held-out source (``data.heldout_source``): text of another genre than the corpus, cut into blocks by
the same rule and scored beside the test split by the verdict. Default ``stdlib_code``: the Python source
of a fixed list of pure-Python standard-library modules (docs/quantization.md, "The held-out verdict").

The test split and the held-out source are written to their own file (``save_heldout``), apart from the
train / calib / selection file every stage opens (``save``), so no stage before the verdict can read them.

A model that takes BOS (compress/loading/special_tokens.py decides) gets it at the start of every block:
BOS + block_size - 1 tokens of the stream; a model without BOS gets block_size tokens of the stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Part of the load stage's cache key: bump when the blocks cut from the same text and tokenizer change
# (2: blocks start with BOS for models that take one; 3: repeated blocks dropped, four lanes with a test split,
# the held-out source).
DATA_FORMAT = 4

LANES = ("test", "selection", "calib")  # lane i of the permutation; lane 3 and the unused rest feed train

# The default held-out source: pure-Python stdlib modules whose source ships with every CPython
# (code, a genre the documentation corpus is not); read in this order.
STDLIB_CODE_MODULES = ("bisect", "calendar", "colorsys", "difflib", "fractions", "graphlib", "heapq", "shlex",
                       "statistics", "textwrap")

_EXT_TO_BUILDER = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


class DataError(ValueError):
    """A data source that cannot be read, phrased for the user."""


@dataclass
class DataSplits:
    train: np.ndarray  # [n, block_size] int64
    calib: np.ndarray
    selection: np.ndarray  # distillation's evals and early stopping, the relax loop's trials, the search's gate
    source: str
    total_tokens: int
    bos_token_id: int | None = None  # the BOS every block starts with; None: the model takes no BOS
    # Held out (written by save_heldout only; None after `load`): the verdict's test split and the blocks of
    # the held-out source (None when data.heldout_source is none).
    test: np.ndarray | None = None
    heldout: np.ndarray | None = None
    heldout_source: str = "none"

    def summary(self) -> dict:
        return {
            "data_source": self.source,
            "data_total_tokens": self.total_tokens,
            "data_train_blocks": len(self.train),
            "data_calib_blocks": len(self.calib),
            "data_selection_blocks": len(self.selection),
            "data_test_blocks": 0 if self.test is None else len(self.test),
            "data_heldout_source": self.heldout_source,
            "data_heldout_blocks": 0 if self.heldout is None else len(self.heldout),
            "data_block_size": int(self.train.shape[1]) if len(self.train) else 0,
        }

    def save(self, path: str | Path) -> None:
        """Write train / calib / selection as one .npz (arrays and strings only, read back without pickle).
        Not the test split nor the held-out source: those go to `save_heldout`'s file."""
        np.savez(path, train=self.train, calib=self.calib, selection=self.selection, source=self.source,
                 total_tokens=self.total_tokens, bos_token_id=-1 if self.bos_token_id is None else self.bos_token_id)

    @classmethod
    def load(cls, path: str | Path) -> "DataSplits":
        with np.load(path, allow_pickle=False) as z:
            bos = int(z["bos_token_id"]) if "bos_token_id" in z.files else -1  # older files: no BOS
            selection = z["selection" if "selection" in z.files else "eval"]  # older files: "eval"
            return cls(z["train"], z["calib"], selection, str(z["source"]), int(z["total_tokens"]),
                       None if bos < 0 else bos)

    def save_heldout(self, path: str | Path) -> None:
        """Write the test split and the held-out source's blocks (empty when none) to their own .npz."""
        if self.test is None:
            raise DataError("these splits carry no test split (read back by DataSplits.load?); nothing to save")
        heldout = self.heldout if self.heldout is not None else np.zeros((0, self.test.shape[1]), dtype=np.int64)
        np.savez(path, test=self.test, heldout=heldout, heldout_source=self.heldout_source)


@dataclass
class HeldOut:
    """What only the verdict reads: the test split and the held-out source's blocks (None when switched off)."""

    test: np.ndarray
    heldout: np.ndarray | None
    heldout_source: str


def load_heldout(path: str | Path) -> HeldOut:
    """Read `DataSplits.save_heldout`'s file. Only the accept stage calls this (tests check it)."""
    with np.load(path, allow_pickle=False) as z:
        heldout = z["heldout"]
        return HeldOut(z["test"], heldout if len(heldout) else None, str(z["heldout_source"]))


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


def stdlib_code() -> list[str]:
    """The Python source of STDLIB_CODE_MODULES, one entry per module, in that order."""
    import importlib.util

    texts = []
    for name in STDLIB_CODE_MODULES:
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin) if spec is not None and spec.origin else None
        if origin is None or origin.suffix != ".py" or not origin.is_file():
            raise DataError(
                f"data.heldout_source 'stdlib_code': this Python has no source file for the stdlib module {name!r} "
                f"(a .pyc-only install?); point data.heldout_source at a local file or folder, or set it to none")
        texts.append(origin.read_text(encoding="utf-8"))
    return texts


def load_texts(source: str, text_field: str = "text", subset: str | None = None, split: str = "train") -> list[str]:
    if source == "embedded":
        return embedded_corpus()
    if source == "stdlib_code":
        return stdlib_code()
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
    selection_blocks: int = 32,
    test_blocks: int = 32,
    *, seed: int = 0,
    text_field: str = "text",
    subset: str | None = None,
    split: str = "train",
    heldout_source: str = "stdlib_code",
    heldout_blocks: int = 32,
) -> DataSplits:
    """Cut `source` into the four disjoint splits (module docstring: lanes) and `heldout_source` into
    heldout_blocks blocks ("none": no held-out source)."""
    from compress.loading.special_tokens import bos_id_of

    texts = load_texts(source, text_field, subset, split)
    bos = bos_id_of(tokenizer)
    blocks = tokenize_blocks(texts, tokenizer, block_size, tokenizer.eos_token_id, bos)
    # A block that occurs twice in the text is kept once, so the same tokens cannot be in train and in test.
    blocks = blocks[np.sort(np.unique(blocks, axis=0, return_index=True)[1])] if len(blocks) else blocks
    if len(blocks) < len(LANES) + 1:
        raise DataError(f"data.source {source!r} yields only {len(blocks)} blocks of {block_size} tokens; use more text or a smaller data.block_size")
    order = np.random.default_rng(seed).permutation(len(blocks))
    want = {"test": test_blocks, "selection": selection_blocks, "calib": calib_blocks}
    picked: dict[str, np.ndarray] = {}
    for lane, name in enumerate(LANES):
        pool = order[lane :: len(LANES) + 1]
        if want[name] > len(pool):
            raise DataError(
                f"data.{name}_blocks {want[name]}: data.source {source!r} yields {len(blocks)} blocks of {block_size} "
                f"tokens and a held-out split takes at most every {len(LANES) + 1}th of them ({len(pool)}); lower "
                f"data.{name}_blocks (or data.calib_blocks / data.selection_blocks / data.test_blocks), use more text or a "
                f"smaller data.block_size")
        picked[name] = pool[: want[name]]
    taken = np.zeros(len(blocks), dtype=bool)
    for idx in picked.values():
        taken[idx] = True
    rest = order[~taken[order]]
    # Train gets what is left (at least one block, checked above), the first train_blocks of it.
    tr = rest[:train_blocks]
    heldout = None
    if heldout_source != "none":
        hb = tokenize_blocks(load_texts(heldout_source, text_field, subset, split), tokenizer, block_size,
                             tokenizer.eos_token_id, bos)
        if len(hb) < heldout_blocks:
            raise DataError(
                f"data.heldout_blocks {heldout_blocks}: data.heldout_source {heldout_source!r} yields only {len(hb)} "
                f"blocks of {block_size} tokens; lower data.heldout_blocks, name a longer text or set it to none")
        heldout = hb[np.sort(np.random.default_rng(seed).permutation(len(hb))[:heldout_blocks])]
    return DataSplits(train=blocks[tr], calib=blocks[picked["calib"]], selection=blocks[picked["selection"]], source=source,
                      total_tokens=int(blocks.size), bos_token_id=bos, test=blocks[picked["test"]], heldout=heldout,
                      heldout_source=heldout_source)


def splits_from_config(tokenizer, cfg) -> DataSplits:
    """cfg: a DataConfig."""
    return make_splits(
        tokenizer,
        source=cfg.source,
        block_size=cfg.block_size,
        train_blocks=cfg.train_blocks,
        calib_blocks=cfg.calib_blocks,
        selection_blocks=cfg.selection_blocks,
        test_blocks=cfg.test_blocks,
        seed=cfg.seed,
        text_field=cfg.text_field,
        subset=cfg.subset,
        split=cfg.split,
        heldout_source=cfg.heldout_source,
        heldout_blocks=cfg.heldout_blocks,
    )
