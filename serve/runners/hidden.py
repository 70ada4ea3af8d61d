"""The decoder graph's last hidden state as a second output, for a drafter that reads it (serve/engine/draft_head.py).

The served graph ends ``final norm -> lm_head -> logits``; the final norm's output, for the positions whose logits are
kept, is what the lm_head reads. Exposing it costs nothing at run time (the tensor is computed anyway; an Identity
names it ``hidden``) and needs no new export: the graph is read without its weights and handed to ONNX Runtime
through a small file beside them (serve/runners/onnx_external.py), the artifact's files untouched.
"""

from __future__ import annotations

from pathlib import Path

HIDDEN = "hidden"
_NORMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization",
          "RMSNormalization", "SkipLayerNormalization")


def hidden_tensor(graph) -> str:
    """The final norm's output: the last normalization node of the graph (the nodes are in topological order)."""
    for node in reversed(graph.node):
        if node.op_type in _NORMS:
            return node.output[0]
    raise ValueError("the graph has no normalization node before its lm_head: no hidden state to expose")


def with_hidden_output(onnx_path: str | Path):
    """The graph at ``onnx_path`` (weights left on disk) with a second output ``hidden`` [batch, kept, hidden]."""
    from onnx import TensorProto, helper

    from serve.runners.onnx_external import load_lazy

    model = load_lazy(onnx_path)
    g = model.graph
    if HIDDEN not in {o.name for o in g.output}:
        g.node.append(helper.make_node("Identity", [hidden_tensor(g)], [HIDDEN], name="/model/hidden_output"))
        g.output.append(helper.make_tensor_value_info(HIDDEN, TensorProto.FLOAT, ["batch", "kept", "hidden"]))
    return model
