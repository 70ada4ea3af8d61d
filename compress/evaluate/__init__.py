"""Judging a model: golden validation of an export, accuracy and speed of an artifact, and the acceptance gate.

Entry points (lazy: importing this package imports neither torch nor onnxruntime):

* ``record_golden`` / ``compare_from_config`` / ``GoldenSet`` (golden.py): the torch model's outputs on fixed
  prompts, and any ONNX artifact checked against them (the golden stage);
* ``evaluate_onnx`` (onnx_eval.py): perplexity, top-1 agreement, golden prefix, size, decode latency of an artifact;
* ``downstream_scores`` (downstream.py): multiple-choice continuation accuracy, the quality gate's downstream score;
* ``accept`` / ``resolve_criteria`` / ``chat_limit`` / ``genre_table`` / ``versus_champion`` (gate.py): the gate;
* chat.py (used as a module, ``from compress.evaluate import chat``): the chat set (chatsets/use.jsonl, package data)
  rendered in the model's own template, the teacher's answers as targets;
* ``perplexity`` / ``kl_and_agreement`` (torch_eval.py): the torch-side figures pruning and distillation report.
"""

from compress._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "golden": ["GoldenMismatch", "GoldenReport", "GoldenSet", "compare_from_config", "compare_onnx", "record_golden"],
    "onnx_eval": ["EvaluateError", "evaluate_onnx"],
    "downstream": ["downstream_scores"],
    "gate": ["Verdict", "accept", "chat_limit", "genre_table", "resolve_criteria", "versus_champion"],
    "torch_eval": ["kl_and_agreement", "perplexity"],
})
