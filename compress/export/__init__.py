"""The export stage: a torch causal LM -> an ONNX decoder artifact folder (model, tokenizer, manifest).

Entry points (lazy: importing this package imports no torch):

* ``build_artifact`` / ``export_onnx`` (standard.py): the torch exporters (dynamo, torchscript), layout
  ``standard`` (past K/V in, present out); ``EXPORT_FORMAT`` is the export stage's cache-key version;
* ``build_gqa_artifact`` / ``build_gqa_model`` / ``choose_exporter`` (gqa.py): the graph written from the weights
  around GroupQueryAttention (layout ``gqa``), and which exporter ``export.exporter: auto`` picks.

Beside them: gqa_families.py / gqa_neox.py (what differs per family in the gqa graph), graph_fusion.py (the
fusions, also run after quantization), kv_fp16.py (``export.kv_dtype: float16``) and weights.py (``export.weights``:
the fp32 graph, or the INT8 one written from the checkpoint).
"""

from compress._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "version": ["EXPORT_FORMAT"],
    "standard": ["ExportError", "ExportResult", "build_artifact", "export_onnx"],
    "gqa": ["GqaBuildResult", "build_gqa_artifact", "build_gqa_model", "choose_exporter"],
    "weights": ["FROM_CHECKPOINT_WEIGHTS", "fallback_weights", "fp32_needed_by", "int4_keep_ladder", "int4_wanted_by",
                "resolve_weights", "written_int8"],
})
