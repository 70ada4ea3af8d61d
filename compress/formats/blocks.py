"""Block sizes for 8-bit tables: an embedding table read by GatherBlockQuantized (and, tied, by the lm_head's
MatMulNBits) must split each row into whole blocks, where a linear's MatMulNBits pads K up to its block. Shared by
the quantize stage (compress/quantize/graph.py), the export from the checkpoint (compress/export/gqa.py) and golden's
rounded reference (compress/evaluate/golden_int8.py), so all three round the table alike.
"""

from __future__ import annotations


def table_block(hidden: int, block: int) -> int:
    """The largest power of two of at least 16, at most ``block``, that divides ``hidden``; ``block`` when it does
    (quantize.weight_block_size 128 on SmolLM2's 576-wide table: 64). 0 when none does (the table stays float)."""
    b = block
    while b >= 16:
        if hidden % b == 0:
            return b
        b //= 2
    return 0
