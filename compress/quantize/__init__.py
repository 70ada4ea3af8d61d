"""The quantize stage: INT8 of an exported decoder artifact (static W8A8, dynamic, weight-only, mixed precision).

Entry points (lazy: importing this package imports neither onnx nor onnxruntime):

* ``quantize_artifact(src, out_dir, calib_blocks, cfg) -> QuantReport`` and ``Quantizer`` (quantizer.py: load and
  calibrate once, write as many variants as asked);
* ``quantize_with_acceptance(...) -> AcceptanceResult`` (relax.py: the accuracy-aware loop, gated by
  compress.evaluate's ``accept`` on the selection split, relaxing the most sensitive groups to float);
* ``choose_quant_form`` / ``decode_step_ms`` (choice.py: ``quantize.method: auto``, each form gated, the fastest kept).

Beside them: calibration.py + smoothquant.py + prepare.py (calibrate on the calib split and smooth, once),
sensitivity.py (which groups stay float) and graph.py (the ONNX rewrites). docs/quantization.md.
"""

from compress._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "version": ["QUANT_FORMAT"],
    "quantizer": ["QuantReport", "Quantizer", "quantize_artifact"],
    "relax": ["AcceptanceResult", "quantize_with_acceptance"],
    "choice": ["FormChoice", "choose_quant_form", "decode_step_ms"],
})
