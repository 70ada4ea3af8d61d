"""What the drafter borrows from the target's graph: its output head, read back as a matrix.

The draft head ends as the target does, on the target's own lm_head (frozen), restricted to the trimmed
vocabulary. Rather than decode each quantized form (MatMulNBits at 4 or 8 bits, a dynamic int8 lm_head behind a
smoothed norm, a plain float MatMul), the part of the graph between the final norm's output and ``logits`` is run
on the rows of the identity: row i of the result is what the graph's head makes of unit i, the rounded weights
the target really uses (one-hot rows are exact on every int8 activation grid).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _head_graph(onnx_path: Path):
    """The nodes from the final norm's output to ``logits``, as a model of their own (input ``hidden``)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from serve.runners.hidden import hidden_tensor
    from serve.runners.onnx_external import load_lazy, tensor_array

    model = load_lazy(onnx_path)
    g = model.graph
    start = hidden_tensor(g)
    producer = {o: n for n in g.node for o in n.output}
    inits = {i.name: i for i in g.initializer}
    nodes, todo, seen = [], ["logits"], set()
    while todo:
        name = todo.pop()
        if name in seen or name == start or name in inits or not name:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is None:
            raise ValueError(f"the head's input {name!r} comes from neither the final norm nor a weight")
        if node not in nodes:
            nodes.append(node)
        todo.extend(node.input)
    order = {id(n): i for i, n in enumerate(g.node)}
    nodes.sort(key=lambda n: order[id(n)])
    used = {i for n in nodes for i in n.input}
    weights = [numpy_helper.from_array(tensor_array(inits[i]), i) for i in sorted(used & set(inits))]
    sub = helper.make_graph(nodes, "head", [helper.make_tensor_value_info(start, TensorProto.FLOAT, [1, "n", "h"])],
                            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "n", "v"])], weights)
    out = helper.make_model(sub, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    return out, start


def head_matrix(artifact: str | Path, manifest: dict, columns: np.ndarray, chunk: int = 128) -> np.ndarray:
    """The target's output head restricted to ``columns`` (token ids): [hidden, len(columns)], float32, such that
    ``hidden_state @ matrix`` are those tokens' logits."""
    from serve.runners.onnx_session import make_session

    model, start = _head_graph(Path(artifact) / manifest.get("onnx_file", "model.onnx"))
    session = make_session(model, threads=0, optimize=True, log_severity=3)
    H = int(manifest["hidden_size"])
    out = np.empty((H, len(columns)), np.float32)
    eye = np.eye(H, dtype=np.float32)
    for lo in range(0, H, chunk):
        rows = eye[lo:lo + chunk][None]
        logits = session.run(["logits"], {start: rows})[0][0]
        out[lo:lo + chunk] = logits[:, columns]
    return out
