"""The gqa builder's graph writer: nodes and initializers of the decoder graph being written, one weight at a time.

A linear becomes a MatMul on its fp32 weight, or, written straight from the checkpoint, a MatMulNBits on its 8- or 4-bit
blocks; the embedding table likewise (GatherBlockQuantized). Large weights can go straight into an external-data file
as they are made (compress/export/gqa.py's ``data_path``), so the whole fp32 graph is never held at once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from compress.export.gqa_families import GqaBuildError
from compress.export.weights import Int4Plan
from compress.formats.blocks import table_block
from compress.formats.nbits import pack_w4
from serve.runners.onnx_external import ALIGN, BASE_KEY

OPSET = 17
MS_DOMAIN = "com.microsoft"


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


def _model(g: _Graph, inputs, outputs, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
                          producer_name="compress.export.gqa")
    m.ir_version = 8
    return m
