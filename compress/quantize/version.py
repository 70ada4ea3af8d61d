"""The quantize stage's cache-key version, apart from the quantizer so that a flow can key its stages without
importing onnx or onnxruntime."""

# Bump when the graph a config produces changes.
# 2: per-token W8A8 without the Shape/Reshape/Slice/Concat around each linear, and its tied lm_head in int8.
# 3: one QuantizeLinear per shared input, one MatMulIntegerToFloat per packed group. 4: one per linear, no Split.
# 5: a per-tensor int8 K/V cache evens out K's channels first (kv_equalize.py).
# 6: the per-token form's tied lm_head is smoothed too (smoothquant.py smooth_tied_lm_head).
# 7: weight_only takes weight_bits 4 (AWQ, mixed precision), and method auto weighs that form too.
# 8: 4-bit blocks written by compress/formats/nbits.py, whose ranges may shrink (quantize.weight_clip mse).
QUANT_FORMAT = 8
