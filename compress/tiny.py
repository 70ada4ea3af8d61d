"""Tiny Llama-architecture models built from a config with a fixed seed.

Used by the tests and the quick config: a few MB, no downloads. The tokenizer is
a small byte-level BPE trained on the embedded corpus, so text round-trips.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from compress.data import embedded_corpus

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


def build_tiny_llama(seed: int = 0, **overrides) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A seeded random tiny Llama and its tokenizer (same seed -> identical weights)."""
    tokenizer = build_tiny_tokenizer()
    config = tiny_llama_config(len(tokenizer), **overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Random init gives near-uniform logits; a larger scale makes greedy choices and top-k stable to test.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.eval()
    return model, tokenizer


def save_tiny_llama(path: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a tiny model as an ordinary HF folder (what a user would pass as a local model)."""
    path = Path(path)
    model, tokenizer = build_tiny_llama(seed, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
