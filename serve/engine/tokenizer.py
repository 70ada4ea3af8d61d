"""Tokenizer loading, prompt encoding (BOS as the model expects it) and incremental detokenization for
the server (``tokenizers`` only, no transformers)."""

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


# ---- BOS: the rule compress/loading/special_tokens.py decided and wrote to the manifest ------------------
def bos_id(manifest: dict) -> int | None:
    """The BOS id every sequence starts with: ``bos_token_id`` when the manifest says ``add_bos_token``,
    else None (also for manifests written before the field: no BOS, as before). Mirrors
    compress/loading/special_tokens.py ``from_manifest`` (serve/ does not import compress/)."""
    bos = manifest.get("bos_token_id")
    return int(bos) if manifest.get("add_bos_token") and bos is not None else None


def encode_prompt(tokenizer: Tokenizer, manifest: dict, text: str) -> list[int]:
    """Plain prompt text as the model expects it: BOS (when it takes one) + the text's tokens, encoded
    without the tokenizer's own special tokens (as HF ``add_special_tokens`` and vLLM do)."""
    bos = bos_id(manifest)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return ([bos] if bos is not None else []) + ids


def encode_chat(tokenizer: Tokenizer, manifest: dict, text: str) -> list[int]:
    """Text rendered by the chat template: encoded without special tokens (the template writes them), with a
    BOS put first only when the model takes one and the template did not write it already (never two)."""
    bos = bos_id(manifest)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


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
