"""Build an ONNX decoder with ``com.microsoft.GroupQueryAttention`` straight from HF Llama-family weights.

No exporter emits GroupQueryAttention, so, like onnxruntime-genai's model builder, we write the
graph node by node from the torch weights (seconds instead of minutes of dynamo tracing).

Graph contract (attention layout ``gqa``):
  inputs  input_ids [batch, seq] int64
          seqlens_k [batch] int32           per row: tokens in the cache after this call, minus 1
          total_sequence_length [] int32    max over rows of seqlens_k + 1
          past_key_values.N.key/value [batch, kv_heads, max_len, head_dim] float32 (BNSH)
          logits_to_keep [1] int64 (0 = logits at every position; k > 0 = the last k positions only)
  outputs logits [batch, seq or k, vocab]
          present.N.key/value [batch, kv_heads, max_len, head_dim]
Feed the same preallocated buffer as past and bind it as present (IOBinding): GQA then writes the
new K/V in place at position ``seqlens_k - seq + 1`` and never copies the past. Rotary is applied
inside the op from cos/sin caches computed by the model's own rotary module (so rope_theta and the
static rope scalings match HF exactly). Positions come from seqlens_k: row b's new tokens are at
``seqlens_k[b] + 1 - seq .. seqlens_k[b]``; rows of a multi-token call with a past must be batch 1
(an ORT restriction), and a batch of first prompts is right-padded with per-row seqlens_k.

Names follow the exported graph's so quantization selects the same nodes: MatMul nodes are
``/model/layers/N/self_attn/q_proj/MatMul`` with weights ``model.layers.N.self_attn.q_proj.weight_t``
([in, out]), and each carries the ``pkg.torch.onnx.name_scopes`` metadata compress.quantize.calibration reads.
A tied lm_head is ``MatMul(x, Transpose(embedding))`` so the table is stored once.

One job, one module although over 400 lines: writing our own attention-op decoder graph from torch weights
(the decoder, norm, linear and rotary helpers and the artifact writer). For CUDA the quantize stage turns the graph
into fp16 (compress/quantize/cuda_fp16.py): ONNX Runtime's CUDA GroupQueryAttention reads and appends the K/V rows
in GPU memory, which is what a PagedAttention layout would have been for (docs/serving.md#cuda).
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from compress.export import gqa_families as fams
from compress.formats.blocks import table_block
from compress.artifact import write_manifest
from compress.export.gqa_families import GqaBuildError
from compress.export.graph_fusion import fuse_decoder
from compress.export.kv_fp16 import kv_to_fp16
from compress.export.servable import MODEL_FILE, serving_fields, write_tokenizer_files
from compress.export.weights import FROM_CHECKPOINT, Int4Plan
from compress.formats.nbits import pack_w4
from compress.loading.models import model_info
from serve.runners.onnx_external import ALIGN, BASE_KEY, save_external

log = logging.getLogger(__name__)

# Above this many bytes of fp32 weights the graph is built straight into external data (protobuf's limit is 2 GB).
STREAM_BYTES = 1_500_000_000
OPSET = 17
MS_DOMAIN = "com.microsoft"
SUPPORTED_FAMILIES = tuple(fams.FAMILIES)  # what differs per family: compress/export/gqa_families.py
# Rope types whose frequencies do not depend on the sequence length, so one cos/sin table is exact.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def gqa_io_names(num_layers: int) -> dict[str, list[str]]:
    past = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return {"inputs": ["input_ids", "seqlens_k", "total_sequence_length", *past, "logits_to_keep"],
            "outputs": ["logits", *present]}


def _rope_type(config) -> str:
    """The rope type; with one parameter set per layer type (Gemma 3), the first that is not static, if any."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    sets = [v for v in params.values() if isinstance(v, dict)] or [params]
    types = [str(p.get("rope_type") or p.get("type") or "default") for p in sets]
    return next((t for t in types if t not in STATIC_ROPE_TYPES), types[0])


def check_supported(model) -> None:
    """Refuse architectures and options the graph would silently get wrong."""
    c = model.config
    fams.family_of(model)  # refuses other model_types, naming what they have that the builder does not write
    rope = _rope_type(c)
    if rope not in STATIC_ROPE_TYPES:
        raise GqaBuildError(f"rope type {rope!r} (config.rope_scaling / rope_parameters): the GQA builder supports "
                            f"{', '.join(STATIC_ROPE_TYPES)}; dynamic or length-dependent scalings need the standard export")
    if c.model_type == "gpt_neox":  # its own decoder and checks
        from compress.export.gqa_neox import check_neox

        return check_neox(model)
    prf = getattr(c, "partial_rotary_factor", None) or (getattr(c, "rope_parameters", None) or {}).get(
        "partial_rotary_factor") or 1.0
    head_dim = model_info(model)["head_dim"]
    if prf != 1.0 and (int(head_dim * prf) // 2) % 8:
        # GQA rotates the first 2 * cos_cache.shape[1] dims of a head; ORT wants that half a multiple of 8.
        raise GqaBuildError(f"partial_rotary_factor {prf} rotates {int(head_dim * prf)} of {head_dim} head dims: "
                            "ORT's GroupQueryAttention needs the rotated half to be a multiple of 8")
    fams.activation(c)  # SiLU or tanh-GELU gated MLPs
    if getattr(c, "mlp_bias", False):
        raise GqaBuildError("mlp_bias=True is not supported")
    layer0 = model.model.layers[0]
    if getattr(layer0.self_attn.o_proj, "bias", None) is not None:
        raise GqaBuildError("o_proj with a bias is not supported")
    if getattr(c, "use_bidirectional_attention", False):
        raise GqaBuildError("use_bidirectional_attention=True: GroupQueryAttention is causal")


@torch.no_grad()
def choose_exporter(model, requested: str) -> tuple[str, str]:
    """export.exporter 'auto': the gqa graph where the model allows it, the dynamo export otherwise.

    Returns (exporter, why) so the choice can be logged; other values come back unchanged.
    """
    if requested != "auto":
        return requested, f"export.exporter is {requested!r}"
    try:
        check_supported(model)
    except GqaBuildError as e:
        return "dynamo", f"auto: the gqa builder does not take this model ({e}); using the dynamo export"
    return "gqa", f"auto: {model.config.model_type} fits the gqa builder (in-place KV, GroupQueryAttention)"


def rope_tables(model, max_positions: int, head_dim: int, layer_type: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_positions, head_dim/2] from the model's own rotary module (includes attention_scaling);
    layer_type for rotary modules with one table per layer type (Gemma 3)."""
    rot = model.base_model.rotary_emb
    pos = torch.arange(max_positions, dtype=torch.int64)[None]
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rot(x, pos) if layer_type is None else rot(x, pos, layer_type)
    half = cos.shape[-1] // 2  # head_dim // 2, or fewer with partial rotary (GQA rotates 2 * half dims)
    # HF builds cat(freqs, freqs): the first half is the table GQA wants (non-interleaved rotation).
    return cos[0, :, :half].float().numpy().copy(), sin[0, :, :half].float().numpy().copy()


class _Graph:
    """Nodes and initializers of the graph being written.

    data_path: write every initializer of 1 KiB or more straight into this external-data file as it is made
    (the proto keeps only its offset), so building a large model holds one weight at a time in fp32, never
    the whole graph. pack_qkv: write each layer's q/k/v as one packed MatMul (what graph_fusion.pack_siblings
    would make of them afterwards, without first writing the three apart).
    """

    def __init__(self, float_dtype=np.float32, data_path: Path | None = None, pack_qkv: bool = False,
                 int8: tuple[int, int] | None = None, int4: Int4Plan | None = None):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.float_dtype = float_dtype  # weights and activations
        self.data_path = data_path
        self.pack_qkv = pack_qkv
        self._data = open(data_path, "wb") if data_path is not None else None
        # (block_size, accuracy_level): every linear written as 8-bit MatMulNBits straight from the checkpoint's
        # tensor, the arithmetic of the quantize stage's weight_only form (ORT's block quantizer), no fp32 graph
        self.int8 = int8
        # int4 (with int8's block size and accuracy level): the linears written as 4-bit MatMulNBits (compress/formats/nbits.py),
        # but for the plan's groups and lm_head kept at 8 bits (compress/export/weights.py int4_plan)
        self.int4 = int4
        self._q8 = None
        if int8 is not None:
            from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                         DefaultWeightOnlyQuantizer)

            self._q8 = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
                block_size=int8[0], is_symmetric=True, accuracy_level=int8[1], bits=8))

    def embedding(self, E: np.ndarray, tied: bool) -> tuple[str, str | None]:
        """The token Gather over the table ``E`` [V, h]: (its output, the fp32 table's name, None when written in
        8 bits, _embedding_q8)."""
        if self._q8 is not None and self.int4 is not None and self.int4.embedding_bits == 4 and not tied:
            return _embedding_q4(self, E), None
        if self._q8 is not None:
            return _embedding_q8(self, E, tied), None
        emb = self.init("model.embed_tokens.weight", E)
        (x,) = self.node("Gather", [emb, "input_ids"], ["/model/embed_tokens/Gather_output_0"],
                         "/model/embed_tokens/Gather", module="model.embed_tokens")
        return x, emb

    def matmul(self, x: str, wt: np.ndarray, w_name: str, path: str, module: str | None,
               out: str | None = None) -> str:
        """x @ wt ([K, N]): a MatMul on the fp32 weight, or with ``int8`` a MatMulNBits on its 8-bit blocks."""
        out = out or f"{path}/MatMul_output_0"
        if self._q8 is None:
            w = self.init(w_name, wt)
            (y,) = self.node("MatMul", [x, w], [out], f"{path}/MatMul", module=module)
            return y
        K, N = wt.shape
        bits = 4 if self.int4 is not None and self.int4.at_4_bits(module) else 8
        block = self.int4.block4(self.int8[0]) if bits == 4 else self.int8[0]
        packed, scales, zero_points = (
            pack_w4(wt, block, self.int4.symmetric, self.int4.clip) if bits == 4 else
            self._q8.qbits_block_quant(np.ascontiguousarray(wt, np.float32)))
        inputs = [x, self.init(f"{w_name}_Q{bits}", packed), self.init(f"{w_name}_scales", scales)]
        if bits == 4 and not self.int4.symmetric:
            inputs.append(self.init(f"{w_name}_zero_points", zero_points))
        kw = {"accuracy_level": self.int8[1]} if self.int8[1] else {}
        (y,) = self.node("MatMulNBits", inputs, [out], f"{path}/MatMul_Q{bits}", module=module,
                         domain=MS_DOMAIN, K=K, N=N, bits=bits, block_size=block, **kw)
        return y

    def init(self, name: str, arr: np.ndarray) -> str:
        if arr.dtype.kind == "f":
            arr = arr.astype(self.float_dtype, copy=False)
        arr = np.ascontiguousarray(arr)
        if self._data is None or arr.nbytes < 1024:
            self.inits.append(numpy_helper.from_array(arr, name))
            return name
        t = onnx.TensorProto()
        t.name = name
        t.dims.extend(arr.shape)
        t.data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
        pos = self._data.seek(0, 2)
        pad = (-pos) % ALIGN
        self._data.write(b"\0" * pad)
        self._data.write(arr.tobytes())
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.data_path.name), ("offset", str(pos + pad)), ("length", str(arr.nbytes)),
                     (BASE_KEY, str(self.data_path.resolve().parent))):
            e = t.external_data.add()
            e.key, e.value = k, v
        self.inits.append(t)
        return name

    def close(self) -> None:
        if self._data is not None:
            self._data.close()
            self._data = None

    def node(self, op: str, inputs: list[str], outputs: list[str], name: str, module: str | None = None,
             domain: str = "", **attrs) -> list[str]:
        n = helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs)
        if module:
            # The scope list the dynamo exporter records; compress.quantize.calibration reads parts[-2] minus one "model.".
            e = n.metadata_props.add()
            e.key = "pkg.torch.onnx.name_scopes"
            e.value = repr(["", f"model.{module}", op.lower()])
        self.nodes.append(n)
        return outputs


def _np(t: torch.Tensor) -> np.ndarray:
    # One tensor at a time to fp32: the model itself may stay in bf16 (a large model is loaded as stored).
    return t.detach().to(torch.float32).cpu().numpy()


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


def _embedding_q8(g: _Graph, E: np.ndarray, tied: bool) -> str:
    """The table as 8-bit blocks along the hidden axis, read by the token Gather (GatherBlockQuantized) and, tied, by
    the lm_head (MatMulNBits): compress.quantize.graph.quantize_tied_embedding's arithmetic, written once."""
    V, K = E.shape
    b = table_block(K, g.int8[0])
    if not b:
        raise GqaBuildError(f"the embedding table's width {K} splits into no power-of-two block of at least 16: set "
                            f"export.weights to float32")
    Eb = E.reshape(V, K // b, b)
    scale = (np.abs(Eb).max(-1) / 127.0).astype(np.float32)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = (np.clip(np.round(Eb / scale[..., None]), -127, 127) + 128).astype(np.uint8)
    del Eb
    qn = "model.embed_tokens.weight_q8"
    g.init(qn, q)
    g.init(f"{qn}_gather_scales", scale.reshape(V, K // b, 1))
    g.init(f"{qn}_gather_zero_points", np.full((V, K // b, 1), 128, np.uint8))
    if tied:
        g.init(f"{qn}_scales", scale.reshape(-1))
    g.init(f"{qn}_shape", np.array([0, 0, K], np.int64))
    out = "/model/embed_tokens/Gather_output_0"
    (blocks,) = g.node("GatherBlockQuantized", [qn, "input_ids", f"{qn}_gather_scales", f"{qn}_gather_zero_points"],
                       [f"{out}_blocks"], "/model/embed_tokens/Gather_q8", domain=MS_DOMAIN, gather_axis=0,
                       quantize_axis=2, block_size=b, bits=8)
    (x,) = g.node("Reshape", [blocks, f"{qn}_shape"], [out], "/model/embed_tokens/Gather_q8_reshape")
    return x


def _embedding_q4(g: _Graph, E: np.ndarray) -> str:
    """An untied table as 4-bit blocks along the hidden axis (compress/formats/nbits.py's grid, the plan's rounding), read by
    the token Gather (GatherBlockQuantized, two codes a byte)."""
    V, K = E.shape
    b = g.int4.block4(g.int8[0])
    packed, scales, zps = pack_w4(E.T, b, g.int4.symmetric, g.int4.clip)  # E.T: blocks along the hidden axis
    if zps is None:  # symmetric: the kernel's implied zero point, written out for the Gather
        zps = np.full((V, (scales.shape[1] + 1) // 2), 0x88, np.uint8)
    qn = "model.embed_tokens.weight_q4"
    g.init(qn, packed.reshape(V, -1))
    g.init(f"{qn}_scales", scales)
    g.init(f"{qn}_zero_points", zps)
    out = "/model/embed_tokens/Gather_output_0"
    (x,) = g.node("GatherBlockQuantized", [qn, "input_ids", f"{qn}_scales", f"{qn}_zero_points"], [out],
                  "/model/embed_tokens/Gather_q4", domain=MS_DOMAIN, gather_axis=0, quantize_axis=1, block_size=b,
                  bits=4)
    return x


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


def _model(g: _Graph, inputs, outputs, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
                          producer_name="compress.export.gqa")
    m.ir_version = 8
    return m


def _layer_attention(model, g: _Graph, max_positions: int, head_dim: int) -> list[tuple[str, str, dict]]:
    """Per layer (cos_cache, sin_cache, GQA attributes): window, soft-cap and scale by layer type; one
    cos/sin table per distinct RoPE (Gemma 3's sliding layers use another base)."""
    c = model.config
    out, tables = [], {}
    for i, layer_type in enumerate(fams.layer_types(c)):
        rope_key = fams.rope_layer_type(model, layer_type)
        if rope_key not in tables:
            cos, sin = rope_tables(model, max_positions, head_dim, rope_key)
            sfx = "" if rope_key is None else f"_{rope_key}"
            tables[rope_key] = (g.init(f"cos_cache{sfx}", cos), g.init(f"sin_cache{sfx}", sin))
        layer = model.base_model.layers[i]
        attn = getattr(layer, "self_attn", None) or layer.attention  # GPT-NeoX: .attention
        kw = dict(scale=float(getattr(attn, "scaling", head_dim ** -0.5)),
                  local_window_size=fams.layer_window(c, layer_type))
        if fams.softcap(c):
            kw["softcap"] = fams.softcap(c)
        out.append((*tables[rope_key], kw))
    return out


def _last_positions(g: _Graph, x: str) -> str:
    """x's last logits_to_keep positions (0 = every position): the runner asks for 1 on a prefill chunk, which skips
    the lm_head over the other positions ([n, vocab] per chunk; ~20% of a SmolLM2 prefill)."""
    (start,) = g.node("Neg", ["logits_to_keep"], ["/model/logits_start"], "/model/logits_start")
    g.init("/model/slice_end", np.array([np.iinfo(np.int64).max], np.int64))
    g.init("/model/slice_axis", np.array([1], np.int64))
    (x,) = g.node("Slice", [x, start, "/model/slice_end", "/model/slice_axis"], ["/model/last_positions"],
                  "/model/last_positions")
    return x


def _gqa_io(names: dict, kv_heads: int, head_dim: int, vocab: int) -> tuple[list, list]:
    """The gqa layout's graph inputs (ids, seqlens_k, total_sequence_length, the past K/V buffers, logits_to_keep)
    and outputs (logits, present K/V)."""
    f32, i64, i32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    inputs = [helper.make_tensor_value_info("input_ids", i64, ["batch", "seq"]),
              helper.make_tensor_value_info("seqlens_k", i32, ["batch"]),
              helper.make_tensor_value_info("total_sequence_length", i32, [])]
    inputs += [helper.make_tensor_value_info(n, f32, ["batch", kv_heads, "max_len", head_dim])
               for n in names["inputs"] if n.startswith("past_key_values.")]
    # A required input: ORT's IOBinding cannot bind an overridable initializer ("not in the def list").
    inputs.append(helper.make_tensor_value_info("logits_to_keep", i64, [1]))
    outputs = [helper.make_tensor_value_info("logits", f32, ["batch", "seq", vocab])]
    outputs += [helper.make_tensor_value_info(n, f32, ["batch", kv_heads, "present_len", head_dim])
                for n in names["outputs"][1:]]
    return inputs, outputs


def build_gqa_model(model, max_positions: int | None = None, fuse: bool = True,
                    data_path: Path | None = None, int8: tuple[int, int] | None = None,
                    int4: Int4Plan | None = None) -> onnx.ModelProto:
    """The decoder as an ONNX model with fp32 weights (the torch model may be bf16: converted tensor by tensor).

    fuse: residual Add + RMSNorm as SkipSimplifiedLayerNormalization and q/k/v as one packed MatMul into
    GroupQueryAttention (compress/export/graph_fusion.py; the same logits, fewer and larger kernels per step).
    data_path: weights go straight into this external-data file as they are made; the returned proto holds
    only their offsets (save it with serve.runners.onnx_external.save_external, into the same folder).
    int8: (block_size, accuracy_level): the weight-only INT8 graph written straight from the checkpoint's tensors,
    one at a time (every linear as MatMulNBits, gate/up packed, a tied table as 8-bit blocks for the Gather and the
    lm_head): what the quantize stage's weight_only form makes of the fp32 graph, with no fp32 graph in between.
    int4 (with int8): the linears in 4 bits but for the plan's 8-bit groups and the lm_head (export.weights int4).
    """
    check_supported(model)
    model.eval()
    info = model_info(model)
    L, H, KV, D = info["num_layers"], info["num_heads"], info["num_kv_heads"], info["head_dim"]
    vocab = info["vocab_size"]
    max_positions = int(max_positions or info["max_positions"])
    g = _Graph(data_path=data_path, pack_qkv=fuse, int8=int8, int4=int4)
    names = gqa_io_names(L)
    attrs = _layer_attention(model, g, max_positions, D)

    def attention(g: _Graph, i: int, q: str, k: str, v: str) -> str:
        path = f"/model/layers/{i}/self_attn"
        cos, sin, kw = attrs[i]
        out, _, _ = g.node(
            "GroupQueryAttention",
            [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", "seqlens_k", "total_sequence_length",
             cos, sin],
            [f"{path}/GroupQueryAttention_output_0", f"present.{i}.key", f"present.{i}.value"],
            f"{path}/GroupQueryAttention", domain=MS_DOMAIN,
            num_heads=H, kv_num_heads=KV, do_rotary=1, rotary_interleaved=0, **kw)
        return out

    try:
        _decoder(model, g, attention, _last_positions)
    finally:
        g.close()
    m = _model(g, *_gqa_io(names, KV, D, vocab), "gqa_decoder")
    if fuse:
        fuse_decoder(m, qkv_only=True)
    return m


@dataclass
class GqaBuildResult:
    folder: Path
    onnx_path: Path
    seconds: float
    onnx_bytes: int
    num_nodes: int


def save_model(m: onnx.ModelProto, path: Path, external_data_threshold_mb: int = 1800) -> None:
    """One file, or ``path.data`` beside it when the weights are large or already written there (streamed)."""
    save_external(m, path, inline_limit=external_data_threshold_mb * 2**20)


def _tied(model) -> bool:
    return model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def _fp32_bytes(model) -> int:
    return 4 * sum(p.numel() for p in model.parameters())


def build_gqa_artifact(model, tokenizer, out_dir: str | Path, *, max_positions: int | None = None,
                       extra: dict | None = None, kv_dtype: str = "float32",
                       int8: tuple[int, int] | None = None, int4: Int4Plan | None = None,
                       external_data_threshold_mb: int = 1800) -> tuple[GqaBuildResult, dict]:
    """Graph + tokenizer + generation_config + manifest.json: a servable folder (attention layout ``gqa``).

    kv_dtype: the gqa layout's cache type, float32 or float16 (compress/export/kv_fp16.py).
    int8: (block_size, accuracy_level): weight-only INT8 written straight from the checkpoint (build_gqa_model).
    int4: with int8, the 4-bit form instead (export.weights int4; compress/export/weights.py int4_plan).
    """
    if kv_dtype not in ("float32", "float16"):
        raise GqaBuildError(f"export.kv_dtype {kv_dtype!r}: the gqa layout keeps float32 or float16 caches")
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    t0 = time.perf_counter()
    # A model whose fp32 weights pass protobuf's limit is written straight into model.onnx.data, tensor by tensor.
    stream = _fp32_bytes(model) > STREAM_BYTES
    with torch.no_grad():
        m = build_gqa_model(model, max_positions, data_path=out_dir / (MODEL_FILE + ".data") if stream else None,
                            int8=int8, int4=int4)
    if kv_dtype == "float16":
        kv_to_fp16(m)
    path = out_dir / MODEL_FILE
    save_model(m, path, external_data_threshold_mb)
    seconds = time.perf_counter() - t0
    write_tokenizer_files(out_dir, model, tokenizer)
    info = model_info(model)
    if max_positions:
        info["max_positions"] = int(max_positions)
    fields = {
        **info,
        "kv_dtype": kv_dtype,
        "attention_layout": "gqa",
        "io": gqa_io_names(info["num_layers"]),
        **serving_fields(model, tokenizer),
        "exporter": "gqa_builder",
        "opset": OPSET,
        "export_seconds": round(seconds, 2),
        **({"quantization": {"method": "weight_only", "written_from": FROM_CHECKPOINT, "block_size": int8[0],
                             "accuracy_level": int8[1],
                             "weights": f"int8 block-wise (block {int8[0]}, MatMulNBits accuracy_level {int8[1]})",
                             "embedding": ("int8 block-wise, shared by Gather and lm_head" if _tied(model) else
                                           f"int{int4.embedding_bits if int4 else 8} block-wise (GatherBlockQuantized)"),
                             **(int4.manifest(int8[0], int8[1]) if int4 else {"weight_bits": 8})}}
           if int8 else {}),
        **(extra or {}),
    }
    manifest = write_manifest(out_dir, fields)
    size = sum(p.stat().st_size for p in out_dir.glob("model.onnx*"))
    log.info("gqa graph: %d nodes, %.1f MiB, built in %.1f s", len(m.graph.node), size / 2**20, seconds)
    return GqaBuildResult(out_dir, path, seconds, size, len(m.graph.node)), manifest
