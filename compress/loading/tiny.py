"""Tiny seeded models of the architectures users compress, built from a config (no downloads).

Used by the tests and the quick config: a few MB each, 2 layers, hidden 64. The tokenizer is
a small byte-level BPE trained on the embedded corpus, so text round-trips. ``build_tiny(family,
seed)`` covers every family of the support matrix (docs/models.md); each family's config turns on
the feature that makes it different (sliding window, QKV bias, QK-norm, soft-capping, local/global
RoPE bases, fused projections, partial rotary), small enough that a short prompt exercises it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from compress.corpus.splits import embedded_corpus

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = embedded_corpus()[:400]
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama_config(vocab_size: int, **overrides) -> LlamaConfig:
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


# Shared by every family: 2 layers, hidden 64, 4 query heads of 16, 2 KV heads where the family has GQA.
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=512, bos_token_id=0, eos_token_id=2, pad_token_id=0)
# A window shorter than the golden's long prompt, so the sliding-window paths are exercised.
SLIDING_WINDOW = 16


def _family_configs() -> dict:
    from transformers import (Gemma2Config, Gemma3TextConfig, GPTNeoXConfig, MistralConfig, Phi3Config,
                              Qwen2Config, Qwen3Config)

    gqa = dict(num_key_value_heads=2, head_dim=16)
    return {
        "llama": (LlamaConfig, dict(**gqa, rms_norm_eps=1e-5, tie_word_embeddings=True)),
        "mistral": (MistralConfig, dict(**gqa, sliding_window=SLIDING_WINDOW, tie_word_embeddings=False)),
        # Qwen2's q/k/v projections carry biases (hard-wired in the modeling code).
        "qwen2": (Qwen2Config, dict(**gqa, use_sliding_window=False, tie_word_embeddings=True)),
        "qwen3": (Qwen3Config, dict(**gqa, use_sliding_window=False, tie_word_embeddings=True)),
        "gemma2": (Gemma2Config, dict(**gqa, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=16,
                                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                      layer_types=["sliding_attention", "full_attention"])),
        "gemma3": (Gemma3TextConfig, dict(**gqa, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=16,
                                          layer_types=["sliding_attention", "full_attention"],
                                          rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                           "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
        # Phi-3's qkv_proj and gate_up_proj are fused; it is not tied.
        "phi3": (Phi3Config, dict(num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None)),
        # An MHA family with partial rotary (Pythia-style: a quarter of each head rotated), parallel residual,
        # LayerNorm with biases, GELU and a fused, head-interleaved query_key_value. Two heads of 64 (Pythia's
        # head size): ORT's GroupQueryAttention rotates a multiple of 16 dims, 0.25 x 64 is 16.
        "gpt_neox": (GPTNeoXConfig, dict(hidden_size=128, num_attention_heads=2, intermediate_size=256,
                                         rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False)),
    }


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt_neox")
# Part of the cached folder name of a tiny-<family> model source: bump when a family's config changes.
FAMILY_CONFIGS_VERSION = 2


def tiny_config(family: str, vocab_size: int, **overrides):
    """The tiny config of one family (model_type ``family``); overrides replace any field."""
    configs = _family_configs()
    if family not in configs:
        raise ValueError(f"tiny family {family!r}: choose one of {', '.join(FAMILIES)}")
    if family == "llama":
        return tiny_llama_config(vocab_size, **overrides)
    cls, kw = configs[family]
    kw = {**_COMMON, **kw, "vocab_size": vocab_size, **overrides}
    return cls(**kw)


def build_tiny(family: str = "llama", seed: int = 0, **overrides):
    """A seeded random tiny model of ``family`` and the shared tiny tokenizer (same seed -> same weights)."""
    tokenizer = build_tiny_tokenizer()
    config = tiny_config(family, len(tokenizer), **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config) if family == "llama" else AutoModelForCausalLM.from_config(config)
    # Random init gives near-uniform logits; a larger scale makes greedy choices and top-k stable to test.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.eval()
    return model, tokenizer


def build_tiny_llama(seed: int = 0, **overrides) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A seeded random tiny Llama and its tokenizer (same seed -> identical weights)."""
    return build_tiny("llama", seed, **overrides)


def save_tiny(path: str | Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a tiny model of ``family`` as an ordinary HF folder (what a user would pass as a local model)."""
    path = Path(path)
    model, tokenizer = build_tiny(family, seed, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_llama(path: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a tiny Llama as an ordinary HF folder (what a user would pass as a local model)."""
    return save_tiny(path, "llama", seed, **overrides)
