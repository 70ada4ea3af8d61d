"""The GPT-NeoX (Pythia) decoder for the gqa graph: MHA written as GroupQueryAttention with kv_num_heads = heads.

What differs from the Llama-shaped decoder in compress/export/gqa.py: LayerNorm with biases
(``LayerNormalization``), a fused ``query_key_value`` whose rows are per head ``[q | k | v]`` (sliced into
q_proj/k_proj/v_proj MatMuls so quantization selects them by name), partial rotary (GQA rotates the first
``2 * cos_cache.shape[1]`` dims of each head; ORT wants that half to be a multiple of 8), a plain GELU MLP
(``dense_h_to_4h`` -> up_proj, ``dense_4h_to_h`` -> down_proj) and the parallel residual
``x + attn(ln1(x)) + mlp(ln2(x))``. Names follow the other families' (``model.layers.N.self_attn.q_proj``).
"""

from __future__ import annotations

import numpy as np

from compress.export.gqa_families import GqaBuildError, Lin


def check_neox(model) -> None:
    """What GroupQueryAttention cannot take from a GPT-NeoX config."""
    c = model.config
    if getattr(c, "hidden_act", "gelu") not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise GqaBuildError(f"hidden_act {c.hidden_act!r}: the GPT-NeoX graph writes GELU MLPs")
    head = c.hidden_size // c.num_attention_heads
    prf = (getattr(c, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    half = int(head * prf) // 2
    if half % 8 or half == 0:
        raise GqaBuildError(f"partial rotary over {2 * half} of {head} head dims: ORT's GroupQueryAttention needs "
                            "the rotated half to be a multiple of 8 (Pythia's 0.25 x 64 = 16 is)")


def _layernorm(g, x: str, norm, module: str) -> str:
    w = g.init(f"{module}.weight", norm.weight.detach().float().numpy())
    b = g.init(f"{module}.bias", norm.bias.detach().float().numpy())
    path = "/" + module.replace(".", "/")
    (y,) = g.node("LayerNormalization", [x, w, b], [f"{path}/output_0"], f"{path}/LayerNormalization",
                  axis=-1, epsilon=float(norm.eps))
    return y


def neox_decoder(model, g, attention, select_positions, logits_name: str, linear) -> tuple[str, str]:
    """Embedding, layers, final norm and embed_out, like compress.export.gqa_decoder._decoder; ``linear`` is its _linear."""
    c = model.config
    base = model.gpt_neox
    H, D = c.num_attention_heads, c.hidden_size // c.num_attention_heads
    x, emb = g.embedding(base.embed_in.weight.detach().float().numpy(), tied=False)
    for i, layer in enumerate(base.layers):
        pre, path = f"model.layers.{i}", f"/model/layers/{i}"
        a = layer.attention
        w = a.query_key_value.weight.reshape(H, 3, D, -1)
        b = a.query_key_value.bias.reshape(H, 3, D) if a.query_key_value.bias is not None else None
        h = _layernorm(g, x, layer.input_layernorm, f"{pre}.input_layernorm")
        q, k, v = (linear(g, h, Lin(w[:, j].reshape(H * D, -1), None if b is None else b[:, j].reshape(H * D)),
                          f"{pre}.self_attn.{n}") for j, n in enumerate(("q_proj", "k_proj", "v_proj")))
        attn = linear(g, attention(g, i, q, k, v), a.dense, f"{pre}.self_attn.o_proj")
        if c.use_parallel_residual:
            h = _layernorm(g, x, layer.post_attention_layernorm, f"{pre}.post_attention_layernorm")
        else:
            (x,) = g.node("Add", [x, attn], [f"{path}/attn_residual_output_0"], f"{path}/attn_residual")
            h = _layernorm(g, x, layer.post_attention_layernorm, f"{pre}.post_attention_layernorm")
        up = linear(g, h, layer.mlp.dense_h_to_4h, f"{pre}.mlp.up_proj")
        op = "Gelu" if c.hidden_act == "gelu" else "FastGelu"  # exact erf GELU, or the tanh approximation
        (act,) = g.node(op, [up], [f"{path}/mlp/act/{op}_output_0"], f"{path}/mlp/act/{op}", domain="com.microsoft")
        down = linear(g, act, layer.mlp.dense_4h_to_h, f"{pre}.mlp.down_proj")
        if c.use_parallel_residual:
            (y,) = g.node("Add", [attn, down], [f"{path}/branches_output_0"], f"{path}/branches")
            (x,) = g.node("Add", [x, y], [f"{path}/mlp_residual_output_0"], f"{path}/mlp_residual")
        else:
            (x,) = g.node("Add", [x, down], [f"{path}/mlp_residual_output_0"], f"{path}/mlp_residual")
    x = select_positions(g, x)
    h = _layernorm(g, x, base.final_layer_norm, "model.norm")
    head = model.get_output_embeddings()  # embed_out in the checkpoint
    if getattr(head, "bias", None) is not None:
        raise GqaBuildError("an output head with a bias is not supported")
    logits = g.matmul(h, np.ascontiguousarray(head.weight.detach().float().numpy().T), "lm_head.weight_t", "/lm_head",
                      "lm_head", logits_name)
    return logits, emb
