"""GGUF sources of several families: a tiny model written as a GGUF file here (gguf package, no downloads),
loaded through model.source like a user's file (dequantized once, cached as safetensors), equal to the
original in torch, with llama.cpp's end-of-turn id among the EOS ids.

The writer below is a minimal HF -> GGUF conversion (what llama.cpp's convert_hf_to_gguf.py does for these
families: its tensor names, Llama's q/k row permutation, Gemma's norm + 1, a byte-level BPE vocabulary).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from compress.loading.models import gguf_end_of_turn_ids, load_teacher  # noqa: E402
from compress.loading.special_tokens import eos_ids_of  # noqa: E402
from compress.loading.tiny import build_tiny  # noqa: E402

# family -> GGUF architecture name (transformers reads these from GGUF; gpt_neox it does not)
# GGUF has no per-layer attention types: transformers (like llama.cpp) takes Gemma 3's fixed pattern of five
# sliding layers then a global one, so the 2-layer tiny Gemma 3 written here has two sliding layers.
OVERRIDES = {"gemma3": dict(layer_types=["sliding_attention", "sliding_attention"])}
ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3"}
EOT = "<|endoftext|>"  # the tiny vocabulary's id 0 stands in for an end-of-turn token


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for Llama-arch GGUFs (transformers undoes it on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, tokenizer, path: Path, eot_id: int) -> Path:
    c = model.config
    arch = ARCH[c.model_type.removesuffix("_text")]
    L = c.num_hidden_layers
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(L)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    rope = c.rope_parameters
    w.add_rope_freq_base(float(rope.get("rope_theta") or rope["full_attention"]["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(c.vocab_size)
    if arch == "gemma3":
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_sliding_window(c.sliding_window)
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    # byte-level BPE vocabulary, as llama.cpp writes a GPT-2-style tokenizer
    tj = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tj["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tj["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_eot_token_id(eot_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tokenizer.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], L)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for hf_name, t in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        a = t.detach().float().numpy().copy()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            a = _permute(a, c.num_attention_heads)
        if arch == "llama" and hf_name.endswith("k_proj.weight"):
            a = _permute(a, c.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            a = a + 1  # llama.cpp stores Gemma's (1 + w)
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("family", list(ARCH))
def test_gguf_source_loads_equal_with_end_of_turn_eos(family, tmp_path):
    model, tok = build_tiny(family, seed=0, **OVERRIDES.get(family, {}))
    eot = tok.convert_tokens_to_ids(EOT)
    path = write_gguf(model, tok, tmp_path / f"tiny-{family}.gguf", eot)
    assert gguf_end_of_turn_ids(path) == [eot]
    loaded, ltok = load_teacher(str(path), cache_dir=tmp_path / "cache")
    assert loaded.config.model_type == model.config.model_type.removesuffix("_text") or \
        loaded.config.model_type == model.config.model_type
    ids = torch.tensor([tok("The cat sat on the mat and then it went to the store", add_special_tokens=False)["input_ids"]])
    if not family.startswith("gemma"):  # transformers builds Gemma's tokenizer as sentencepiece; ours is byte-level BPE
        assert ltok("The cat sat on", add_special_tokens=False)["input_ids"] == ids[0, :len(
            tok("The cat sat on", add_special_tokens=False)["input_ids"])].tolist()
    with torch.no_grad():
        diff = float((loaded(ids).logits - model(ids).logits).abs().max())
    print(f"{family}: GGUF round trip max |logit diff| {diff:.2e}")
    assert diff < 1e-4
    eos = eos_ids_of(loaded, ltok)
    assert tok.eos_token_id in eos and eot in eos
    # the converted folder is reused on the next load (dequantized once)
    again, _ = load_teacher(str(path), cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").iterdir())) == 1
