"""Models of the published shapes users compress (Llama 3.2 1B/3B, Qwen2.5 1.5B, ...) with random seeded weights.

``model.source: shape:<name>[:seed]`` builds the model from the published config (layers, widths, heads,
vocabulary, RoPE, tying) with seeded random weights and saves it once, in bf16, under the model cache, so
every stage can be run and measured at real size offline, without downloading a checkpoint. The text is
garbage (random weights); golden still checks the ONNX graph against torch on the same weights. The
tokenizer is compress/loading/tiny.py's small byte-level BPE: its ids are a corner of the real vocabulary, whose
full width the embedding and lm_head keep (the memory and the time of the lm_head are the real ones).

Weights are drawn tensor by tensor from one seeded generator in bf16, like the published checkpoints'
dtype, on a model first built on the meta device: a 3B model never exists in fp32 here.
``scaled_shape(name, **overrides)`` gives the same config with smaller widths, for fast tests.

``SHAPES`` also lists 7B/8B configs that are not built here (16 GB of bf16) but feed the memory estimates
of compress/sizing/memory.py and docs/models.md.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Llama 3's RoPE: theta 500000 with the "llama3" frequency scaling of the 3.1/3.2 configs.
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# The published config.json fields that set the shape (tokenizer ids are the tiny tokenizer's, see module doc).
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=131072,
                         rope_parameters=_LLAMA3_ROPE),
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=131072,
                         rope_parameters=_LLAMA3_ROPE),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, head_dim=128, vocab_size=151936,
                         tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=32768,
                         use_sliding_window=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Estimates only (compress/sizing/memory.py); building them needs 15-16 GB of bf16.
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=131072,
                         rope_parameters=_LLAMA3_ROPE),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, head_dim=128, vocab_size=152064,
                       tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=32768,
                       use_sliding_window=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}
BUILT = ("llama-3.2-1b", "llama-3.2-3b", "qwen2.5-1.5b")
# Part of the cached folder name: bump when a shape's config or the weight recipe changes.
SHAPES_VERSION = 1
# HF's initializer_range: the std of every random matrix (norm weights are ones, as at initialisation).
INIT_STD = 0.02


class ShapeError(ValueError):
    """An unknown shape name or a malformed ``shape:`` source, phrased for the user."""


def shape_config(name: str, vocab_size: int | None = None, **overrides):
    """The transformers config of shape ``name`` (overrides replace any field, e.g. smaller widths for tests)."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ShapeError(f"shape {name!r}: choose one of {', '.join(SHAPES)}")
    kw = {**SHAPES[name], **overrides}
    if vocab_size is not None:
        kw["vocab_size"] = vocab_size
    model_type = kw.pop("model_type")
    # ids of compress/loading/tiny.py's tokenizer: <|endoftext|> = 0 (BOS, pad), <|im_end|> = 2 (EOS)
    kw.update(bos_token_id=0, eos_token_id=2, pad_token_id=0)
    return AutoConfig.for_model(model_type, **kw)


def scaled_shape(name: str, **overrides):
    """Shape ``name``'s config with every width divided down to a few MB (same family, tying, RoPE and GQA ratio)."""
    c = SHAPES[name]
    small = dict(hidden_size=64, intermediate_size=c["intermediate_size"] * 64 // c["hidden_size"] // 8 * 8,
                 num_hidden_layers=2, head_dim=16, num_attention_heads=4,
                 num_key_value_heads=max(1, 4 * c["num_key_value_heads"] // c["num_attention_heads"]),
                 vocab_size=512, max_position_embeddings=16384)
    return shape_config(name, **{**small, **overrides})


@torch.no_grad()
def build_shape(name: str, seed: int = 0, config=None):
    """(model in bf16 with seeded random weights, the tiny tokenizer). ``config``: a scaled_shape for tests."""
    from transformers import AutoModelForCausalLM

    from compress.loading.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    config = config or shape_config(name)
    config.dtype = "bfloat16"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()
    gen = torch.Generator().manual_seed(seed)
    # Parameters in name order (one draw sequence per seed); a tied lm_head is the embedding's tensor, drawn once.
    for pname, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(INIT_STD).to(p.dtype))
        elif pname.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(INIT_STD).to(p.dtype))
        else:  # norm weights
            p.fill_(1.0)
    # Non-persistent buffers (the rotary inv_freq) were left uninitialised by to_empty: take a fresh rotary
    # module's (fp32, computed from the config as at a normal load).
    for mod in model.modules():
        if type(mod).__name__.endswith("RotaryEmbedding"):
            fresh = type(mod)(config=mod.config)
            for k, b in fresh._buffers.items():
                mod._buffers[k] = b
            mod.attention_scaling = fresh.attention_scaling
    model.eval()
    return model, tokenizer


def parse_source(source: str) -> tuple[str, int]:
    """'shape:<name>[:seed]' -> (name, seed)."""
    _, _, rest = source.partition(":")
    name, _, seed = rest.partition(":")
    if name not in SHAPES or (seed and not seed.isdigit()):
        raise ShapeError(f"model.source {source!r}: write 'shape:<name>' or 'shape:<name>:<integer seed>' with a name "
                         f"of {', '.join(BUILT)} (and, with 16 GB to spare, {', '.join(n for n in SHAPES if n not in BUILT)})")
    return name, int(seed or 0)


def shape_folder(source: str, cache_root: str | Path) -> Path:
    """The saved HF folder of model.source 'shape:<name>[:seed]', built once (bf16 safetensors + tokenizer)."""
    name, seed = parse_source(source)
    out = Path(cache_root) / f"shape-{name}-v{SHAPES_VERSION}-seed{seed}"
    if (out / "config.json").is_file():
        return out
    log.info("building %s with seed %d (random weights, bf16) under %s, once", name, seed, out)
    model, tok = build_shape(name, seed)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    del model
    tmp.rename(out)
    return out
