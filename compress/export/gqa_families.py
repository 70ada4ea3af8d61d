"""What differs between the decoder families the gqa builder writes (compress/export/gqa.py).

The builder writes one Llama-shaped decoder; a ``Family`` says how a model_type departs from it:
where the q/k/v and gate/up weights are (Phi-3 fuses them: we slice the fused rows, so the graph keeps
the q_proj/k_proj/... names quantization selects by), Gemma's ``(1 + w)`` RMSNorm and scaled
embeddings, Gemma 2/3's extra norms around attention and MLP, QK-norm (Qwen3, Gemma 3), the MLP
activation, and per layer the attention's local window, soft-cap, scale and RoPE table (Gemma 3's
sliding layers have their own RoPE base). Everything GroupQueryAttention cannot express is refused
with ``GqaBuildError`` naming the field, so ``export.exporter: auto`` falls back to the standard export.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


class GqaBuildError(ValueError):
    """A model this builder cannot express as a GroupQueryAttention graph, phrased for the user."""


@dataclass(frozen=True)
class Family:
    name: str
    norm_offset: float = 0.0  # Gemma's RMSNorm multiplies by (1 + w)
    embed_scale: bool = False  # Gemma multiplies embeddings by sqrt(hidden_size)
    sandwich_norms: bool = False  # Gemma 2/3: post_attention/post_feedforward norms on the block outputs
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k before RoPE
    fused_qkv: bool = False  # Phi-3 qkv_proj
    fused_gate_up: bool = False  # Phi-3 gate_up_proj


FAMILIES = {
    "llama": Family("llama"),
    "mistral": Family("mistral"),
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3", qk_norm=True),
    "gemma2": Family("gemma2", norm_offset=1.0, embed_scale=True, sandwich_norms=True),
    "gemma3_text": Family("gemma3_text", norm_offset=1.0, embed_scale=True, sandwich_norms=True, qk_norm=True),
    "phi3": Family("phi3", fused_qkv=True, fused_gate_up=True),
    # Written by its own decoder (compress/export/gqa_neox.py): LayerNorm, parallel residual, partial rotary.
    "gpt_neox": Family("gpt_neox"),
}
# Why the others are refused (the standard export serves them).
REFUSED = {
    "gpt2": "learned absolute positions with a Conv1D fused c_attn and LayerNorm with biases",
    "opt": "learned absolute positions (offset 2) and LayerNorm with biases",
    "gemma": "Gemma 1 is not built (Gemma 2/3 are)",
}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclass
class Lin:
    """A Linear-like view (weight [out, in], bias [out] or None): a slice of a fused projection."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None


def family_of(model) -> Family:
    mt = model.config.model_type
    if mt in FAMILIES:
        return FAMILIES[mt]
    why = REFUSED.get(mt, "not one of the families it knows")
    raise GqaBuildError(f"model_type {mt!r}: the GQA builder supports {', '.join(FAMILIES)}; {mt} has {why}. "
                        "Use the standard export (export.exporter: dynamo) for it")


def activation(config) -> str:
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise GqaBuildError(f"hidden_act {act!r}: the GQA builder writes {', '.join(ACTIVATIONS)} MLPs")
    return ACTIVATIONS[act]


def attn_linears(fam: Family, layer, num_heads: int, num_kv: int, head_dim: int):
    """(q, k, v) Linear or Lin views; Phi-3's fused rows are q, then k, then v."""
    a = layer.self_attn
    if not fam.fused_qkv:
        return a.q_proj, a.k_proj, a.v_proj
    w, b = a.qkv_proj.weight, a.qkv_proj.bias
    cuts = [0, num_heads * head_dim, (num_heads + num_kv) * head_dim, (num_heads + 2 * num_kv) * head_dim]
    return tuple(Lin(w[s:e], None if b is None else b[s:e]) for s, e in zip(cuts, cuts[1:]))


def mlp_linears(fam: Family, layer):
    """(gate, up): Phi-3's gate_up_proj rows are gate then up (``chunk(2)`` in its MLP)."""
    m = layer.mlp
    if not fam.fused_gate_up:
        return m.gate_proj, m.up_proj
    w, b = m.gate_up_proj.weight, m.gate_up_proj.bias
    n = w.shape[0] // 2
    return Lin(w[:n], None if b is None else b[:n]), Lin(w[n:], None if b is None else b[n:])


def layer_types(config) -> list[str]:
    """Per layer 'sliding_attention' or 'full_attention' (Mistral's window applies to every layer): the one
    sliding-window rule, for the gqa graph's window per layer and the standard export's position masks."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    w = getattr(config, "sliding_window", None)
    use = getattr(config, "use_sliding_window", True)
    return ["sliding_attention" if w and use else "full_attention"] * n


def layer_window(config, layer_type: str) -> int:
    """GQA local_window_size: -1 (full) or HF's sliding_window (both count the token itself; golden-checked)."""
    w = getattr(config, "sliding_window", None)
    if layer_type != "sliding_attention" or not w or w >= getattr(config, "max_position_embeddings", 0):
        return -1
    return int(w)


def softcap(config) -> float:
    """GQA softcap (0 = off): Gemma 2's attn_logit_softcapping, applied after the scale as HF does."""
    return float(getattr(config, "attn_logit_softcapping", None) or 0.0)


def rope_layer_type(model, layer_type: str) -> str | None:
    """The key the rotary module takes for this layer (Gemma 3: one RoPE base per layer type), else None."""
    rot = model.base_model.rotary_emb
    if "layer_type" in inspect.signature(rot.forward).parameters:
        return layer_type
    return None
