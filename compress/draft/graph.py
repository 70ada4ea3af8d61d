"""The draft head as an ONNX graph: ``draft_steps`` steps unrolled, its matrices as 8-bit MatMulNBits.

Inputs ``hidden`` [n, H] (the target's hidden state that chose each row's newest token) and ``token`` [n] (that
token's id); output ``draft_ids`` [n, steps] (token ids). One ONNX Runtime call drafts every step for every row;
the weights are stored once and read by each step. 8-bit block-wise weights with int8 activations
(accuracy_level 4), as the served graphs' own 8-bit groups.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from compress.draft.head import EPS, HeadNet

BLOCK = 32


def _nbits(name: str, w: np.ndarray, inits: list) -> dict:
    """MatMulNBits' 8-bit tensors of ``w`` [K, N] (symmetric blocks) appended to ``inits``; the node's attributes."""
    from onnx import numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                 DefaultWeightOnlyQuantizer)

    q = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(block_size=BLOCK, is_symmetric=True, bits=8))
    packed, scales, _ = q.qbits_block_quant(np.ascontiguousarray(w, np.float32))
    inits += [numpy_helper.from_array(packed, f"{name}_Q8"), numpy_helper.from_array(scales, f"{name}_scales")]
    K, N = w.shape
    return {"K": K, "N": N, "bits": 8, "block_size": BLOCK, "accuracy_level": 4}


def export_head(net: HeadNet, vocab_ids: np.ndarray, full_vocab: int, steps: int, path: str | Path) -> Path:
    """Write the unrolled head to ``path``; returns it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    W = net.W.numpy()
    H, V = W.shape
    to_index = np.full(full_vocab, V, np.int64)
    to_index[vocab_ids] = np.arange(V)
    inits = [numpy_helper.from_array(to_index, "to_index"),
             numpy_helper.from_array(vocab_ids.astype(np.int64), "vocab_ids"),
             numpy_helper.from_array(net.E.numpy().astype(np.float16), "table"),
             numpy_helper.from_array(np.ones(H, np.float32), "ones"),
             numpy_helper.from_array(net.norm.detach().numpy().astype(np.float32), "norm"),
             numpy_helper.from_array(net.fc1.bias.detach().numpy(), "fc1_b"),
             numpy_helper.from_array(net.fc2.bias.detach().numpy(), "fc2_b")]
    fc1 = _nbits("fc1", net.fc1.weight.detach().numpy().T, inits)
    fc2 = _nbits("fc2", net.fc2.weight.detach().numpy().T, inits)
    head = _nbits("head", W, inits)
    nodes = [helper.make_node("Gather", ["to_index", "token"], ["idx_0"], axis=0)]

    def n(op, ins, out, **kw):
        nodes.append(helper.make_node(op, ins, [out], name=out, **kw))
        return out

    def nb(x, w, attrs, out):
        nodes.append(helper.make_node("MatMulNBits", [x, f"{w}_Q8", f"{w}_scales"], [out], name=out,
                                      domain="com.microsoft", **attrs))
        return out

    h, idx, outs = "hidden", "idx_0", []
    for i in range(steps):
        e = n("Cast", [n("Gather", ["table", idx], f"e16_{i}", axis=0)], f"e_{i}", to=TensorProto.FLOAT)
        hn = n("SimplifiedLayerNormalization", [h, "ones"], f"hn_{i}", axis=-1, epsilon=EPS)
        en = n("SimplifiedLayerNormalization", [e, "ones"], f"en_{i}", axis=-1, epsilon=EPS)
        u = n("Concat", [hn, en], f"u_{i}", axis=-1)
        a = n("Add", [nb(u, "fc1", fc1, f"a0_{i}"), "fc1_b"], f"a_{i}")
        s = n("Mul", [a, n("Sigmoid", [a], f"sg_{i}")], f"s_{i}")
        d = n("Add", [nb(s, "fc2", fc2, f"d0_{i}"), "fc2_b"], f"d_{i}")
        z = n("Add", [h, d], f"z_{i}")
        h = n("SimplifiedLayerNormalization", [z, "norm"], f"h_{i + 1}", axis=-1, epsilon=EPS)
        idx = n("ArgMax", [nb(h, "head", head, f"logits_{i}")], f"idx_{i + 1}", axis=-1, keepdims=1)
        outs.append(n("Gather", ["vocab_ids", idx], f"id_{i}", axis=0))
        idx = n("Squeeze", [idx, "axis1"], f"idxs_{i + 1}")
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "axis1"))
    n("Concat", outs, "draft_ids", axis=-1)
    outputs = [helper.make_tensor_value_info("draft_ids", TensorProto.INT64, ["n", steps])]
    graph = helper.make_graph(nodes, "draft_head",
                              [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["n", H]),
                               helper.make_tensor_value_info("token", TensorProto.INT64, ["n"])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    path = Path(path)
    onnx.save(model, str(path))
    return path
