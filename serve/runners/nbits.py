"""The float weights a ``MatMulNBits`` node holds, unpacked from its initializers: for the quantize stage's checks
(compress/quantize/int4.py) and the server's prompt form (serve/runners/prompt_form.py)."""

from __future__ import annotations

import numpy as np

from serve.runners.onnx_external import tensor_array


def unpack_nbits(node, inits: dict) -> np.ndarray:
    """The float weight [K, N] of a MatMulNBits node (4 or 8 bits, with or without zero points)."""
    from onnx import helper

    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    K, N, bits, block = a["K"], a["N"], a["bits"], a["block_size"]
    kb = (K + block - 1) // block
    raw = tensor_array(inits[node.input[1]]).astype(np.uint8).reshape(N, kb, -1)
    scales = tensor_array(inits[node.input[2]]).astype(np.float32).reshape(N, kb)
    zp_raw = tensor_array(inits[node.input[3]]).astype(np.uint8) if len(node.input) > 3 and node.input[3] else None
    if bits == 4:
        q = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(N, kb, block).astype(np.float32)
        zp = (np.full((N, kb), 8.0, np.float32) if zp_raw is None else
              np.stack([zp_raw.reshape(N, -1) & 0x0F, zp_raw.reshape(N, -1) >> 4], axis=-1).reshape(N, -1)[:, :kb])
    else:
        q = raw.astype(np.float32)
        zp = np.full((N, kb), 128.0, np.float32) if zp_raw is None else zp_raw.reshape(N, kb).astype(np.float32)
    w = ((q - np.asarray(zp, np.float32)[..., None]) * scales[..., None]).reshape(N, kb * block)[:, :K]
    return np.ascontiguousarray(w.T)
