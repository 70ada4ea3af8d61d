"""The data section (``data:``): the text source and how it is cut into the stages' splits."""

from __future__ import annotations

from pydantic import Field, model_validator

from serve.config import Section, renamed_keys


class DataConfig(Section):
    # "embedded" = CPython's pydoc_data.topics; else a hub dataset name, a local file/folder (txt/json/jsonl/csv/parquet).
    source: str = "embedded"
    # The dataset's configuration (datasets' `name`), e.g. wikitext-2-raw-v1; null = none.
    subset: str | None = None
    # The split of a hub dataset read as the corpus; the stages' own splits are cut from it (compress/corpus/splits.py).
    split: str = "train"
    # The column (or JSON key) holding the text.
    text_field: str = "text"
    # Tokens per text block: every split (train, calib, eval, test, held-out) is cut into blocks of this length.
    block_size: int = Field(128, ge=8, le=8192)
    # Blocks in the train split (distillation's corpus data).
    train_blocks: int = Field(256, ge=1)
    # Blocks in the calib split (pruning's activations, quantization's calibration).
    calib_blocks: int = Field(32, ge=1)
    # Blocks in the selection split (figures named selection_*): distillation's evals and early stopping, the relax
    # loop's trials, the quantize stage's forms and the search's gate.
    selection_blocks: int = Field(32, ge=1)
    # Held out from every stage; only the accept stage's verdict reads it (compress/corpus/splits.py).
    test_blocks: int = Field(32, ge=1)
    # Text of another genre, scored beside the test split (heldout_* figures): "stdlib_code" = the Python source
    # of a few pure-Python stdlib modules; a local file/folder or hub dataset like `source`; "none" = off.
    heldout_source: str = "stdlib_code"
    # Blocks scored from heldout_source.
    heldout_blocks: int = Field(32, ge=1)
    # Seed of the shuffle that cuts the corpus into splits.
    seed: int = 0

    @model_validator(mode="after")
    def _heldout_is_another_text(self) -> "DataConfig":
        if self.source in ("stdlib_code", "none"):
            raise ValueError(f"data.source {self.source!r} names a held-out source; use it as data.heldout_source "
                             f"and set data.source to embedded, a file or folder, or a hub dataset")
        if self.heldout_source == self.source:
            raise ValueError(
                f"data.heldout_source {self.heldout_source!r} is data.source itself, so it holds nothing out; name "
                f"another text (default stdlib_code) or set data.heldout_source to none")
        return self

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        return renamed_keys(data, "data")
