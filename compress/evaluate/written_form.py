"""The selection split's gate for a graph the export wrote from the checkpoint (export.weights auto from 1B weighs
4 bits first): the graph against the checkpoint as stored, the fidelity checks the quantize stage's forms pass
(perplexity ratio, top-1 agreement; the held-out source is the verdict's), and the attempt's row for the forms table
(flows/pipeline.py forms_markdown). Where 4 bits fail, the flow writes 8 bits instead; the verdict stays the accept
stage's, on the test split no attempt has seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compress.artifact import read_manifest
from compress.evaluate.gate import accept, failed_checks, selection_limits
from compress.evaluate.settings import AcceptConfig
from compress.evaluate.verdict import against_baseline, reference_of
from compress.loading.settings import ModelConfig

FORM_OF_WEIGHTS = {"int4": "weight_only_int4", "int8": "weight_only"}


@dataclass(frozen=True)
class WrittenFormGate:
    """One written graph judged on the selection split: its forms-table row and the figures the accept stage may
    reuse (``evaluation``: reference, candidate and baseline figures, as the quantize stage hands them on)."""

    accepted: bool
    attempt: dict
    evaluation: dict


def gate_written_form(accept_cfg: AcceptConfig, model: ModelConfig, artifact: str, weights: str,
                      selection: np.ndarray, *, model_dir: str, splits: str,
                      int4_keep_int8: float | None = None) -> WrittenFormGate:
    """``artifact`` (written from the checkpoint in ``model_dir`` with ``weights``; ``int4_keep_int8``: the 4-bit
    graph's share of groups at 8 bits) against that checkpoint on the ``selection`` blocks, through the accept
    section's limits under the fidelity criteria."""
    ref = reference_of(accept_cfg, model, model_dir, artifact)
    if ref is None:
        raise ValueError(f"{artifact}: not a graph written from the checkpoint (export.weights int8 or int4)")
    base, cand = against_baseline(artifact, artifact, selection, reference=ref)
    limits = selection_limits(accept_cfg, 0.0)  # the accept section's, less the held-out source's check
    verdict = accept(cand, base, limits, criteria="fidelity")  # the same model, rounded: stay the checkpoint
    manifest = read_manifest(artifact, verify=False)
    fp32 = 4.0 * int(manifest.get("num_parameters") or 0)  # the column's "x source"
    ppl_ratio = cand["perplexity"] / base["perplexity"] if base["perplexity"] > 0 else float("inf")
    q = manifest.get("quantization") or {}
    share = int4_keep_int8 if weights == "int4" else None
    attempt = {"form": FORM_OF_WEIGHTS.get(weights, weights), "weights": weights, "kv": "float32",
               "int8_share": share, "int8_groups": len(q.get("int8_groups", [])),
               "kv_label": "as exported", "accepted": verdict.accepted,
               "failed": "" if verdict.accepted else failed_checks(verdict),
               "perplexity_ratio": float(ppl_ratio), "top1_agreement": float(cand.get("top1_agreement", float("nan"))),
               "perplexity": float(cand["perplexity"]),
               "size_ratio": cand["size_bytes"] / fp32 if fp32 else float("nan"), "size_bytes": float(cand["size_bytes"])}
    evaluation = {"reference": artifact, "splits": splits, "candidate": cand, "baseline": base}
    return WrittenFormGate(verdict.accepted, attempt, evaluation)
