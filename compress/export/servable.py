"""What makes an exported graph a servable folder, whichever exporter wrote it: the tokenizer, the generation
config and the manifest fields the server reads (special tokens, chat template, graph file), written once here for
the standard exporter (standard.py) and the gqa builder (gqa.py)."""

from __future__ import annotations

import json
from pathlib import Path

from compress.loading.special_tokens import eos_ids_of, special_tokens

MODEL_FILE = "model.onnx"


def write_tokenizer_files(out_dir: str | Path, model, tokenizer) -> None:
    """The tokenizer and generation_config.json (from the model's, else the ids that end generation)."""
    out_dir = Path(out_dir)
    tokenizer.save_pretrained(out_dir)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(out_dir)
    else:
        (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids_of(model, tokenizer)}))


def serving_fields(model, tokenizer) -> dict:
    """The manifest fields the server needs beyond the shapes: add_bos_token, eos_token_ids,
    chat_template_adds_bos, pad/bos ids, the chat template and the graph's file name."""
    return {
        **special_tokens(tokenizer, model).manifest_fields(),
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "onnx_file": MODEL_FILE,
    }
