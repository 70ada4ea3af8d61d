"""Golden for an INT8 graph written from the checkpoint (export.weights int8): tolerances derived from its weights.

The reference is the checkpoint as stored (bf16 for most), so the INT8 graph cannot reproduce its logits to 1e-2 as
the fp32 graph does; what it has to reproduce is bounded by what INT8 rounding does to these very weights. So the
checkpoint is run a second time on the golden sequences with what the graph rounds rounded the same way
(``fake_quantize_``: every linear's weights to 8-bit blocks along the input, the tied embedding too, and, at
MatMulNBits' accuracy_level 4, each linear's input to 8-bit blocks as the kernel does), and its distance to the
reference, times ``golden.int8_margin``, is the tolerance (``int8_thresholds``). What the margin covers: the graph
computes in fp32 where the rounded checkpoint computes in its stored dtype. A wrong graph (a layer's weights
swapped, zeroed or transposed) is off by many times what rounding does (tests/test_golden_int8.py). The greedy
decode is checked against the graph's own prefill (compare_onnx's decode_against "self"), since on near ties
INT8 and the reference pick different tokens without either path being wrong.
"""

from __future__ import annotations

import numpy as np
import torch

from compress.formats.blocks import table_block
from compress.evaluate.golden import GoldenSet


def _round_blocks(x: torch.Tensor, block: int, signed_max: bool = True) -> torch.Tensor:
    """x [..., K] rounded to symmetric 8-bit blocks of ``block`` along K, computed in fp32, back in x's dtype.
    signed_max: ONNX Runtime's block quantizer (MatMulNBits weights): the block's value of largest magnitude maps to
    -128 (scale = that value / -128, codes -128..127); else scale = max |x| / 127, codes -127..127 (the export's tied
    embedding table, and the kernel's input blocks)."""
    k = x.shape[-1]
    pad = (-k) % block
    f = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float()
    b = f.reshape(*f.shape[:-1], -1, block)
    if signed_max:
        scale = torch.gather(b, -1, b.abs().argmax(-1, keepdim=True)) / -128.0
        lo = -128
    else:
        scale = b.abs().amax(-1, keepdim=True) / 127.0
        lo = -127
    scale = torch.where(scale != 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(b / scale), lo, 127) * scale
    return q.reshape(*f.shape)[..., :k].to(x.dtype)


# Rows rounded at a time: the fp32 temporaries of a 152k x 3,584 table whole would be several GiB beside the model.
ROUND_ROWS = 4096


def _round_rows_(w: torch.Tensor, block: int, signed_max: bool = True) -> None:
    """w [N, K] rounded in place by _round_blocks, ROUND_ROWS rows at a time."""
    for i in range(0, w.shape[0], ROUND_ROWS):
        w[i:i + ROUND_ROWS] = _round_blocks(w[i:i + ROUND_ROWS], block, signed_max)


def _round_rows_4bit_(w: torch.Tensor, block: int, symmetric: bool, clip: bool) -> None:
    """w [N, K] (torch's Linear layout) rounded in place to 4-bit blocks along K, ROUND_ROWS rows at a time, on the
    grid of ONNX Runtime's quantizer (compress/formats/nbits.py fake_quant_w4, which takes [K, N])."""
    from compress.formats.nbits import fake_quant_w4

    for i in range(0, w.shape[0], ROUND_ROWS):
        rows = w[i:i + ROUND_ROWS].float().numpy().T
        w[i:i + ROUND_ROWS] = torch.from_numpy(fake_quant_w4(rows, block, symmetric, clip).T.copy()).to(w.dtype)


def fake_quantize_(model, block_size: int, accuracy_level: int, int4=None) -> list:
    """Round ``model``'s linear weights (and a tied embedding) in place as the INT8 graph stores them; at
    accuracy_level 4 also round each linear's input as MatMulNBits does (forward pre-hooks, returned to remove).
    int4: the Int4Plan of a 4-bit graph (compress/export/weights.py): its 4-bit linears rounded to 4 bits instead.
    A few rows of one tensor at a time in fp32: the model stays in its dtype."""
    hooks = []
    names = {id(m): n for n, m in model.named_modules()}
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    block4 = int4.block4(block_size) if int4 is not None else block_size
    table = table_block(emb.shape[1], block_size)  # the tied table's rows in whole blocks (compress/formats/blocks.py)
    if tied:  # one 8-bit table read by the Gather and the lm_head (gqa_graph._embedding_q8's arithmetic)
        _round_rows_(emb.data, table, signed_max=False)
    elif int4 is not None and int4.embedding_bits == 4:  # gqa_graph._embedding_q4
        _round_rows_4bit_(emb.data, block4, int4.symmetric, int4.clip)
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            b = block_size  # the kernel rounds the input in blocks of the node's own block size
            if tied and mod.weight.data_ptr() == emb.data_ptr():
                b = table
            elif int4 is not None and int4.at_4_bits(names.get(id(mod))):
                b = block4
                _round_rows_4bit_(mod.weight.data, b, int4.symmetric, int4.clip)
            else:
                _round_rows_(mod.weight.data, b)
            if accuracy_level == 4:
                hooks.append(mod.register_forward_pre_hook(
                    lambda m, a, b=b: (_round_blocks(a[0], b, signed_max=False), *a[1:])))
    return hooks


@torch.no_grad()
def int8_thresholds(model, golden: GoldenSet, block_size: int, accuracy_level: int, margin: float,
                    floor: float = 1e-2, int4=None) -> tuple[dict, dict]:
    """(compare_onnx's thresholds, the figures they came from) for the INT8 graph of ``model``'s weights against
    ``golden`` (recorded from ``model`` as it is). Rounds ``model`` in place: record golden first, drop it after.

    max_abs_error (and off_threshold): margin x the rounded checkpoint's largest top-k logit distance to the
    reference, at least ``floor`` (batched_max_abs_error: that distance itself, for the left-padded batch against the
    prompts alone); min_top1_agreement: the rounded checkpoint's worst prompt's disagreement, margin
    times, less one position (a near tie the fp32 arithmetic may also flip). int4: the 4-bit graph's Int4Plan."""
    hooks = fake_quantize_(model, block_size, accuracy_level, int4)
    try:
        errors, agreements, positions = [], [], []
        for i in range(len(golden.prompts)):
            seq = golden.sequence(i)
            logits = model(input_ids=torch.tensor([seq])).logits[0].float().numpy()
            idx, ref = golden.topk_indices[i], golden.topk_values[i]
            errors.append(float(np.abs(np.take_along_axis(logits, idx, axis=-1) - ref).max()))
            agreements.append(float((logits.argmax(-1) == idx[:, 0]).mean()))
            positions.append(len(seq))
    finally:
        for h in hooks:
            h.remove()
    tol = max(margin * max(errors), floor)
    top1 = max(0.0, 1.0 - margin * (1.0 - min(agreements)) - 1.0 / min(positions))
    figures = {"golden_int8_expected_max_abs_error": max(errors), "golden_int8_expected_top1_agreement": min(agreements),
               "golden_int8_margin": margin}
    # The left-padded batch against the prompts alone: two paths of the same graph may round apart by less than the
    # rounding moved the logits (ONNX Runtime's 4-bit kernels at block 64 take another path for another number of
    # rows: Qwen2.5-Coder-1.5B 0.26-0.31 apart, where block 32 holds to fp32's 0.01), never by more
    batched = max(max(errors), floor)
    return {"max_abs_error": tol, "off_threshold": tol, "max_off_count": 0, "min_top1_agreement": top1,
            "batched_max_abs_error": batched}, figures
