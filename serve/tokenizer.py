"""Tokenizer loading and incremental detokenization for the server (``tokenizers`` only, no transformers)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(artifact_dir: str | Path) -> Tokenizer:
    path = Path(artifact_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the artifact has no {TOKENIZER_FILE}; re-export it with the pipeline")
    return Tokenizer.from_file(str(path))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token breaks multi-byte characters and word-boundary spaces, so
    each step decodes a small window (the last few already-read tokens plus the new
    ones) and emits what it adds to the window's previous text. A delta that would end
    in an incomplete UTF-8 sequence (U+FFFD) is held back until the next token
    completes it. Cost per token is O(window), not O(length).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix_offset = max(0, len(self.ids) - 5)
        self.read_offset = len(self.ids)
        self.text = ""  # all output text so far

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            # keep the window short
            if self.prefix_offset > 64:
                cut = self.prefix_offset
                self.ids = self.ids[cut:]
                self.prefix_offset -= cut
                self.read_offset -= cut
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: emit whatever was held back (an incomplete character decodes as U+FFFD)."""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
