"""torch causal LM -> ONNX decoder with KV-cache I/O, plus the artifact folder around it.

Graph contract (attention layout ``standard``):
  inputs  input_ids [batch, seq] int64, attention_mask [batch, past+seq] int64,
          position_ids [batch, seq] int64, past_key_values.N.key/value [batch, kv_heads, past, head_dim]
  outputs logits [batch, seq, vocab], present.N.key/value [batch, kv_heads, past+seq, head_dim]
Why dynamo is the standard-layout exporter (and the fallback of export.exporter auto): docs/export.md.
"""

from __future__ import annotations

import ast
import logging
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from compress.artifact import io_names, write_manifest
from compress.loading.models import model_info
from compress.export.gqa_families import layer_types
from compress.export.servable import MODEL_FILE, serving_fields, write_tokenizer_files

log = logging.getLogger(__name__)


class ExportError(RuntimeError):
    pass


class _DecoderWithPast(nn.Module):
    """Flat tensors in and out, so the ONNX graph has one named input per K and V."""

    def __init__(self, model: nn.Module, num_layers: int):
        super().__init__()
        self.model = model
        self.num_layers = num_layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers.cache_utils import DynamicCache

        mask = _position_masks(self.model.config, attention_mask, position_ids)

        # No config: with one, sliding-window layers (Mistral, Gemma 2/3) keep only their last window of K/V,
        # while this graph's contract is present = past + seq on every layer (the mask applies the window).
        cache = DynamicCache()
        for i in range(self.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask if mask is None else mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        flat = []
        for layer in out.past_key_values.layers:
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)


def _position_masks(config, attention_mask, position_ids):
    """Sliding-window models: 4D additive masks that apply the window by token *positions*, or None.

    HF's own sliding mask compares slot indices, which equal positions only without padding. The standard
    runner (serve/runners/standard.py) keeps each row's past at slots [0, len) followed by stale padding and appends
    the new tokens after it, so a slot-based window would cover padding and drop real tokens. Here a key's
    position is the count of valid slots before it (cumsum(attention_mask) - 1), a query's is position_ids:
    right (stale) padding, left padding and no padding all give the unpadded batch-1 result.
    Returns {layer type: mask} for models that take a mapping (Qwen2/3, Gemma 2/3), the sliding mask for
    those that apply one window to every layer (Mistral, Phi-3), None for models without a window.
    """
    window = getattr(config, "sliding_window", None)
    if not window or "sliding_attention" not in layer_types(config):  # the gqa graph's rule, one place
        return None
    kpos = torch.cumsum(attention_mask, dim=-1) - 1  # [b, total]
    q = position_ids[:, None, :, None]  # [b, 1, seq, 1]
    k = kpos[:, None, None, :]  # [b, 1, 1, total]
    valid = (attention_mask[:, None, None, :] > 0) & (k <= q)
    neg = torch.finfo(torch.float32).min
    full = torch.where(valid, 0.0, neg).to(torch.float32)
    sliding = torch.where(valid & (k > q - int(window)), 0.0, neg).to(torch.float32)
    if config.model_type in ("qwen2", "qwen3", "gemma2", "gemma3_text"):
        return {"full_attention": full, "sliding_attention": sliding}
    return sliding


@dataclass
class ExportResult:
    folder: Path
    onnx_path: Path
    seconds: float
    onnx_bytes: int
    exporter: str


def _sample_inputs(info: dict, batch: int = 2, seq: int = 3, past: int = 5):
    ids = torch.randint(0, info["vocab_size"], (batch, seq), dtype=torch.int64)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    pos = torch.arange(past, past + seq, dtype=torch.int64).unsqueeze(0).expand(batch, -1).contiguous()
    kv = [torch.randn(batch, info["num_kv_heads"], past, info["head_dim"]) for _ in range(2 * info["num_layers"])]
    return ids, mask, pos, kv


def _export_dynamo(wrapper, args, names, path: Path, opset: int, external: bool):
    from torch.export import Dim

    batch, seq, past = Dim("batch", min=1, max=1024), Dim("seq", min=1, max=65536), Dim("past", min=0, max=65536)
    total = Dim("total", min=1, max=131072)
    kv_shape = {0: batch, 2: past}
    n_kv = len(args) - 3
    dynamic_shapes = {
        "input_ids": {0: batch, 1: seq},
        "attention_mask": {0: batch, 1: total},
        "position_ids": {0: batch, 1: seq},
        "past": tuple(kv_shape for _ in range(n_kv)),
    }
    prog = torch.onnx.export(
        wrapper,
        tuple(args),
        dynamic_shapes=dynamic_shapes,
        input_names=names["inputs"],
        output_names=names["outputs"],
        opset_version=opset,
        dynamo=True,
        external_data=external,
        optimize=True,
        verbose=False,
    )
    prog.save(str(path), external_data=external)


def _export_torchscript(wrapper, args, names, path: Path, opset: int):
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"}, "position_ids": {0: "batch", 1: "seq"},
            "logits": {0: "batch", 1: "seq"}}
    for n in names["inputs"][3:]:
        axes[n] = {0: "batch", 2: "past"}
    for n in names["outputs"][1:]:
        axes[n] = {0: "batch", 2: "total"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapper, tuple(args), str(path), input_names=names["inputs"], output_names=names["outputs"],
                          dynamic_axes=axes, opset_version=opset, dynamo=False)


def export_onnx(model: nn.Module, out_dir: str | Path, exporter: str = "dynamo", opset: int = 18,
                external_data_threshold_mb: int = 1800) -> ExportResult:
    """Export the decoder graph only (model.onnx [+ model.onnx.data]) into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = model_info(model)
    names = io_names(info["num_layers"])
    model = model.float().eval()
    wrapper = _DecoderWithPast(model, info["num_layers"]).eval()
    ids, mask, pos, kv = _sample_inputs(info)
    path = out_dir / MODEL_FILE
    params_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    external = params_mb > external_data_threshold_mb
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            if exporter == "dynamo":
                _export_dynamo(wrapper, [ids, mask, pos, *kv], names, path, opset, external)
            elif exporter == "torchscript":
                _export_torchscript(wrapper, [ids, mask, pos, *kv], names, path, opset)
            else:
                raise ExportError(f"export.exporter {exporter!r}: allowed values are 'dynamo', 'torchscript'")
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"{exporter} export of {info['architecture']} failed: {type(e).__name__}: {e}") from e
    if exporter == "dynamo":
        name_linear_nodes(path)
    seconds = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in out_dir.glob("model.onnx*"))
    return ExportResult(out_dir, path, seconds, size, exporter)


def _module_path(node) -> str | None:
    """The torch module a node came from (dynamo records it in the name_scopes metadata)."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            scopes = ast.literal_eval(prop.value)
            if len(scopes) >= 2:
                path = scopes[-2]
                return path[len("model."):] if path.startswith("model.") else path
    return None


def name_linear_nodes(onnx_path: Path) -> int:
    """Give every Linear's MatMul and weight its module name (dynamo's optimizer leaves val_N / node_linear_N).

    Pruning checks, quantization exclusions ("down_proj") and sensitivity scans select by these names.
    Weights are stored transposed ([in, out]) for MatMul, hence the ``.weight_t`` suffix.
    """
    import onnx

    model = onnx.load(str(onnx_path))
    inits = {i.name: i for i in model.graph.initializer}
    users: dict[str, int] = {}
    for n in model.graph.node:
        for i in n.input:
            users[i] = users.get(i, 0) + 1
    renamed = {}
    for n in model.graph.node:
        if n.op_type not in ("MatMul", "Gemm"):
            continue
        path = _module_path(n)
        if not path or not path.split(".")[-1].endswith(("proj", "lm_head", "fc1", "fc2", "dense")):
            continue
        n.name = f"/{path.replace('.', '/')}/{n.op_type}"
        w = n.input[1]
        if w in inits and users.get(w) == 1 and w not in renamed:
            renamed[w] = f"{path}.weight_t"
    for old, new in renamed.items():
        inits[old].name = new
    for n in model.graph.node:
        for k, i in enumerate(n.input):
            if i in renamed:
                n.input[k] = renamed[i]
    external = any(i.data_location == onnx.TensorProto.EXTERNAL for i in model.graph.initializer) or \
        model.ByteSize() > 1800 * 2**20
    if external:
        onnx.save(model, str(onnx_path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=onnx_path.name + ".data")
    else:
        onnx.save(model, str(onnx_path))
    return len(renamed)


def build_artifact(model: nn.Module, tokenizer, out_dir: str | Path, exporter: str = "dynamo", opset: int = 18,
                   external_data_threshold_mb: int = 1800, extra: dict | None = None) -> tuple[ExportResult, dict]:
    """Export + tokenizer + generation_config + manifest.json: a folder the server can run on its own."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    result = export_onnx(model, out_dir, exporter, opset, external_data_threshold_mb)
    write_tokenizer_files(out_dir, model, tokenizer)
    info = model_info(model)
    fields = {
        **info,
        "kv_dtype": "float32",
        "attention_layout": "standard",
        "io": io_names(info["num_layers"]),
        **serving_fields(model, tokenizer),
        "exporter": exporter,
        "opset": opset,
        "export_seconds": round(result.seconds, 2),
        **(extra or {}),
    }
    manifest = write_manifest(out_dir, fields)
    return result, manifest
