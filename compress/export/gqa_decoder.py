"""The gqa graph's decoder, block by block: embedding, each layer's attention block (norm, q/k/v, the layout's attention
op, o_proj, residual) and MLP block (norm, gate/up, gated activation, down_proj, residual), the final norm and lm_head.

What differs per family comes from compress/export/gqa_families.py; GPT-NeoX has its own decoder
(compress/export/gqa_neox.py). The attention op itself is the caller's (compress/export/gqa.py writes
GroupQueryAttention), so the blocks do not know the cache layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compress.export import gqa_families as fams
from compress.export.gqa_families import GqaBuildError
from compress.export.gqa_graph import MS_DOMAIN, _Graph, _np
from compress.formats.blocks import table_block
from compress.loading.models import model_info


def _packed_qkv(g: _Graph, x: str, lins, module: str, role: str = "qkv_proj") -> str:
    """q/k/v (or gate/up) as one MatMul(x, [Wq^T | Wk^T | Wv^T]), named and tagged as graph_fusion.pack_siblings
    names it. Block quantization runs along K, so the 8-bit form of the packed weight is the packed 8-bit forms."""
    path = "/" + f"{module}.{role}".replace(".", "/")
    return g.matmul(x, np.concatenate([_np(lin.weight).T for lin in lins], axis=1), f"{module}.{role}.weight_t",
                    path, f"{module}.{role}")


def _linear(g: _Graph, x: str, lin, module: str) -> str:
    """MatMul(x, W^T) [+ bias], named like the exported graph."""
    path = "/" + module.replace(".", "/")
    y = g.matmul(x, _np(lin.weight).T, f"{module}.weight_t", path, module)
    if getattr(lin, "bias", None) is not None:
        b = g.init(f"{module}.bias", _np(lin.bias))
        (y,) = g.node("Add", [y, b], [f"{path}/Add_output_0"], f"{path}/Add")
    return y


def _rmsnorm(g: _Graph, x: str, norm, module: str, eps: float, offset: float = 0.0) -> str:
    w = g.init(f"{module}.weight", _np(norm.weight) + offset)  # offset 1: Gemma's (1 + w)
    path = "/" + module.replace(".", "/")
    (y,) = g.node("SimplifiedLayerNormalization", [x, w], [f"{path}/output_0"], f"{path}/SimplifiedLayerNormalization",
                  axis=-1, epsilon=float(eps), stash_type=1)
    return y


@dataclass(frozen=True)
class _Layers:
    """What every decoder layer of one model is written with: its family's rules, head counts, norm settings."""

    fam: object
    H: int
    KV: int
    D: int
    eps: float
    off: float
    act: str


def _attention_block(g: _Graph, lay: _Layers, layer, i: int, x: str, attention) -> str:
    """Input norm, q/k/v (packed when GQA can split them), the layout's attention, o_proj and the residual."""
    pre, fam, eps, off = f"model.layers.{i}", lay.fam, lay.eps, lay.off
    a = layer.self_attn
    h = _rmsnorm(g, x, layer.input_layernorm, f"{pre}.input_layernorm", eps, off)
    qp, kp, vp = fams.attn_linears(fam, layer, lay.H, lay.KV, lay.D)
    if g.pack_qkv and not fam.qk_norm and all(getattr(p, "bias", None) is None for p in (qp, kp, vp)):
        # GQA splits a packed QKV itself: key and value inputs left empty
        attn = attention(g, i, _packed_qkv(g, h, (qp, kp, vp), f"{pre}.self_attn"), "", "")
    else:
        q = _linear(g, h, qp, f"{pre}.self_attn.q_proj")
        k = _linear(g, h, kp, f"{pre}.self_attn.k_proj")
        v = _linear(g, h, vp, f"{pre}.self_attn.v_proj")
        if fam.qk_norm:  # per head, before the rotary GQA applies
            q = _head_norm(g, q, a.q_norm, f"{pre}.self_attn.q_norm", eps, off, lay.D)
            k = _head_norm(g, k, a.k_norm, f"{pre}.self_attn.k_norm", eps, off, lay.D)
        attn = attention(g, i, q, k, v)
    o = _linear(g, attn, a.o_proj, f"{pre}.self_attn.o_proj")
    if fam.sandwich_norms:
        o = _rmsnorm(g, o, layer.post_attention_layernorm, f"{pre}.post_attention_layernorm", eps, off)
    (x,) = g.node("Add", [x, o], [f"/model/layers/{i}/attn_residual_output_0"], f"/model/layers/{i}/attn_residual")
    return x


def _mlp_block(g: _Graph, lay: _Layers, layer, i: int, x: str) -> str:
    """The MLP's norm, gate/up (packed in the INT8 graph), the gated activation, down_proj and the residual."""
    pre, fam, eps, off = f"model.layers.{i}", lay.fam, lay.eps, lay.off
    if fam.sandwich_norms:
        h = _rmsnorm(g, x, layer.pre_feedforward_layernorm, f"{pre}.pre_feedforward_layernorm", eps, off)
    else:
        h = _rmsnorm(g, x, layer.post_attention_layernorm, f"{pre}.post_attention_layernorm", eps, off)
    gp, upp = fams.mlp_linears(fam, layer)
    if g.int8 is not None and g.pack_qkv and all(getattr(p, "bias", None) is None for p in (gp, upp)):
        # as the quantize stage packs them after quantization (graph_fusion.pack_siblings), written packed
        gu_out = _packed_qkv(g, h, (gp, upp), f"{pre}.mlp", "gate_up_proj")
        n = int(gp.weight.shape[0])
        mp = f"/model/layers/{i}/mlp"
        g.init(f"{mp}/gate_up_split", np.array([n, n], np.int64))
        gate, up = g.node("Split", [gu_out, f"{mp}/gate_up_split"], [f"{mp}/gate_output_0", f"{mp}/up_output_0"],
                          f"{mp}/gate_up_Split", axis=-1)
    else:
        gate = _linear(g, h, gp, f"{pre}.mlp.gate_proj")
        up = _linear(g, h, upp, f"{pre}.mlp.up_proj")
    gu = _gated(g, gate, up, lay.act, f"/model/layers/{i}/mlp")
    down = _linear(g, gu, layer.mlp.down_proj, f"{pre}.mlp.down_proj")
    if fam.sandwich_norms:
        down = _rmsnorm(g, down, layer.post_feedforward_layernorm, f"{pre}.post_feedforward_layernorm", eps, off)
    (x,) = g.node("Add", [x, down], [f"/model/layers/{i}/mlp_residual_output_0"], f"/model/layers/{i}/mlp_residual")
    return x


def _lm_head(g: _Graph, model, h: str, emb: str, tied: bool, logits_name: str) -> str:
    """The logits from the final hidden state: the tied table (8-bit in the INT8 graph) or the lm_head's own
    weight, soft-capped where the family does (Gemma 2)."""
    c, head = model.config, model.lm_head
    if getattr(head, "bias", None) is not None:
        raise GqaBuildError("lm_head with a bias is not supported")
    cap = float(getattr(c, "final_logit_softcapping", None) or 0.0)
    out = "/lm_head/MatMul_output_0" if cap else logits_name
    if g.int8 is not None and tied:  # the 8-bit table the Gather reads, as MatMulNBits' blocks
        V, K = head.weight.shape
        kw = {"accuracy_level": g.int8[1]} if g.int8[1] else {}
        (logits,) = g.node("MatMulNBits", [h, "model.embed_tokens.weight_q8", "model.embed_tokens.weight_q8_scales"],
                           [out], "/lm_head/MatMul_q8", module="lm_head", domain=MS_DOMAIN, K=K, N=V, bits=8,
                           block_size=table_block(K, g.int8[0]), **kw)
    elif tied:
        # Tied: keep one table (quantize_tied_embedding recognises this exact pattern).
        (wt,) = g.node("Transpose", [emb], ["/lm_head/Transpose_output_0"], "/lm_head/Transpose", perm=[1, 0])
        (logits,) = g.node("MatMul", [h, wt], [out], "/lm_head/MatMul", module="lm_head")
    else:
        logits = g.matmul(h, _np(head.weight).T, "lm_head.weight_t", "/lm_head", "lm_head", out)
    if cap:  # Gemma 2: cap * tanh(logits / cap)
        logits = _softcap(g, logits, cap, logits_name)
    return logits


def _decoder(model, g: _Graph, attention, select_positions, logits_name: str = "logits") -> tuple[str, str]:
    """Embedding, layers and final norm + lm_head; ``attention(g, i, q, k, v) -> output`` is the layout's part.

    ``select_positions(g, x) -> x`` picks the positions whose logits are computed (before the final norm).
    Returns (logits tensor name, embedding initializer name).
    """
    c = model.config
    if c.model_type == "gpt_neox":
        from compress.export.gqa_neox import neox_decoder

        return neox_decoder(model, g, attention, select_positions, logits_name, _linear)
    fam = fams.family_of(model)
    info = model_info(model)
    lay = _Layers(fam, info["num_heads"], info["num_kv_heads"], info["head_dim"],
                  float(getattr(c, "rms_norm_eps", 1e-6)), fam.norm_offset, fams.activation(c))
    tied = _tied(model)
    x, emb = g.embedding(_np(model.model.embed_tokens.weight), tied)
    if fam.embed_scale:
        x = _embed_scale(g, x, c.hidden_size)
    for i, layer in enumerate(model.model.layers):
        x = _attention_block(g, lay, layer, i, x, attention)
        x = _mlp_block(g, lay, layer, i, x)
    x = select_positions(g, x)
    h = _rmsnorm(g, x, model.model.norm, "model.norm", lay.eps, lay.off)
    return _lm_head(g, model, h, emb, tied, logits_name), emb


def _embed_scale(g: _Graph, x: str, hidden: int) -> str:
    """Gemma scales embeddings by sqrt(hidden) (a Mul, not folded: a tied lm_head reads the same table).
    HF rounds the factor to the weights' dtype first; fp32 here."""
    s = g.init("/model/embed_scale", np.array(np.float32(hidden ** 0.5)))
    (x,) = g.node("Mul", [x, s], ["/model/embed_tokens/Mul_output_0"], "/model/embed_tokens/Mul")
    return x


def _head_norm(g: _Graph, x: str, norm, module: str, eps: float, offset: float, head_dim: int) -> str:
    """QK-norm: RMSNorm over each head of a [b, s, heads*head_dim] projection."""
    path = "/" + module.replace(".", "/")
    heads = g.init(f"{path}/heads_shape", np.array([0, 0, -1, head_dim], np.int64))
    flat = g.init(f"{path}/flat_shape", np.array([0, 0, -1], np.int64))
    (y,) = g.node("Reshape", [x, heads], [f"{path}/Reshape_output_0"], f"{path}/Reshape")
    y = _rmsnorm(g, y, norm, module, eps, offset)
    (y,) = g.node("Reshape", [y, flat], [f"{path}/Reshape_1_output_0"], f"{path}/Reshape_1")
    return y


def _gated(g: _Graph, gate: str, up: str, act: str, mp: str) -> str:
    """act(gate) * up: SiLU (Llama, Qwen, Mistral, Phi-3) or tanh-approximated GELU (Gemma)."""
    if act == "gelu_tanh":
        (a,) = g.node("FastGelu", [gate], [f"{mp}/act_fn/FastGelu_output_0"], f"{mp}/act_fn/FastGelu", domain=MS_DOMAIN)
    else:
        (sg,) = g.node("Sigmoid", [gate], [f"{mp}/act_fn/Sigmoid_output_0"], f"{mp}/act_fn/Sigmoid")
        (a,) = g.node("Mul", [gate, sg], [f"{mp}/act_fn/Mul_output_0"], f"{mp}/act_fn/Mul")
    (gu,) = g.node("Mul", [a, up], [f"{mp}/Mul_output_0"], f"{mp}/Mul")
    return gu


def _softcap(g: _Graph, x: str, cap: float, out: str) -> str:
    c = g.init("/lm_head/softcap", np.array(np.float32(cap)))
    (y,) = g.node("Div", [x, c], ["/lm_head/softcap/Div_output_0"], "/lm_head/softcap/Div")
    (y,) = g.node("Tanh", [y], ["/lm_head/softcap/Tanh_output_0"], "/lm_head/softcap/Tanh")
    (y,) = g.node("Mul", [y, c], [out], "/lm_head/softcap/Mul")
    return y


def _tied(model) -> bool:
    return model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
