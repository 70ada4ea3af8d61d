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

The graph writer (initializers, quantized weights) is compress/export/gqa_graph.py and the decoder's blocks
compress/export/gqa_decoder.py; this module checks the model, adds the attention op and the graph's inputs and
outputs, and writes the artifact. For CUDA the quantize stage turns the graph
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
from onnx import TensorProto, helper

from compress.export import gqa_families as fams
from compress.artifact import write_manifest
from compress.export.gqa_decoder import _decoder, _tied
from compress.export.gqa_families import GqaBuildError
from compress.export.gqa_graph import MS_DOMAIN, OPSET, _Graph, _model
from compress.export.graph_fusion import fuse_decoder
from compress.export.kv_fp16 import kv_to_fp16
from compress.export.servable import MODEL_FILE, serving_fields, write_tokenizer_files
from compress.export.weights import FROM_CHECKPOINT, Int4Plan
from compress.loading.models import model_info
from serve.runners.onnx_external import save_external

log = logging.getLogger(__name__)

# Above this many bytes of fp32 weights the graph is built straight into external data (protobuf's limit is 2 GB).
STREAM_BYTES = 1_500_000_000
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
