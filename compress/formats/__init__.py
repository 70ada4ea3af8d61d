"""Weight formats every stage reads and writes: 4-bit blocks in MatMulNBits' layout, 8-bit tables' block sizes."""
