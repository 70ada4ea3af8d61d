"""The judging sections: ``golden:`` (graph against checkpoint), ``accept:`` (the quality gate) and ``benchmark:`` (the server's load test)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from serve.config import Section, renamed_keys


class GoldenConfig(Section):
    # Prompts run through both the exported graph and the PyTorch model; their logits and greedy continuations are
    # compared.
    prompts: list[str] = Field(
        default_factory=lambda: [
            "The capital of France is",
            "def fibonacci(n):",
            "In a hole in the ground there lived",
            "Continuous batching improves throughput because",
        ],
        min_length=1,
    )
    # The PyTorch model's top-k logits per position that are compared.
    top_k: int = Field(8, ge=1, le=100)
    # Greedy tokens each prompt continues for, in both, compared token by token.
    new_tokens: int = Field(16, ge=1, le=512)
    # Largest |ONNX - PyTorch| allowed over the compared logits.
    max_abs_error: float = Field(1e-2, gt=0)
    # A compared logit differing by more than this counts as off.
    off_threshold: float = Field(1e-2, gt=0)
    # How many off logits are allowed over all prompts.
    max_off_count: int = Field(0, ge=0)
    # Share of positions whose argmax must agree.
    min_top1_agreement: float = Field(1.0, ge=0, le=1)
    # Share of each greedy continuation that must match before the first differing token.
    min_prefix_match: float = Field(1.0, ge=0, le=1)
    # Also run the prompts as one left-padded batch and compare it with the prompts alone (padding and mask bugs).
    check_batched: bool = True
    # An INT8 graph written from the checkpoint (export.weights int8) is judged against the checkpoint as stored with
    # tolerances derived from its weights: this many times the distance of the checkpoint with the graph's rounding
    # applied (compress/evaluate/golden_int8.py); the fp32 tolerances above stay for the left-padded batch.
    int8_margin: float = Field(2.0, ge=1)


class AcceptConfig(Section):
    # Run the accept stage: the candidate judged on the test split, the held-out source and the chat set; only an
    # accepted one is registered as a candidate.
    enabled: bool = False
    # What the gate checks (docs/quantization.md#criteria-that-fit-each-compression). fidelity: the candidate
    # must stay the baseline (perplexity ratio, top-1 agreement, max_kl) - a quantized model. quality: it must
    # be as good a language model on held-out text (perplexity ratio, max_heldout_perplexity_ratio,
    # max_downstream_drop) - a pruned or distilled student, a different model whose argmax need not follow
    # the teacher's. auto: quality when prune or distill ran, else fidelity. The relax loop always gates fidelity.
    criteria: Literal["auto", "fidelity", "quality"] = "auto"
    # Candidate perplexity over the baseline's on the test split, at most this (INC tolerable_loss style).
    max_perplexity_ratio: float = Field(1.10, ge=1.0)
    # Absolute perplexity rise allowed on the test split (NNCF max_drop style); null = not checked.
    max_perplexity_delta: float | None = Field(None, ge=0)
    # fidelity: share of scored tokens whose argmax is the baseline's.
    min_top1_agreement: float = Field(0.90, ge=0, le=1)
    # fidelity: mean KL(baseline || candidate) per scored token, nats; null = not checked.
    max_kl: float | None = Field(None, gt=0)
    # Perplexity ratio on data.heldout_source (another genre), under both criteria; null = logged, not checked.
    max_heldout_perplexity_ratio: float | None = Field(None, ge=1.0)
    # quality: multiple-choice continuation accuracy (compress/evaluate/downstream.py) may fall at most this much below
    # the baseline's (absolute, 0.05 = 5 points); items from downstream_items blocks of the test split and as
    # many of the held-out source. null = not measured.
    max_downstream_drop: float | None = Field(0.05, ge=0, le=1)
    # Blocks of the test split made into multiple-choice items (and as many from the held-out source).
    downstream_items: int = Field(32, ge=1)
    # Evaluation in the form of use (compress/evaluate/chat.py), for a model with a chat template: held-out chat
    # prompts rendered with its template, the teacher's greedy answers as targets (cached per teacher), and the
    # candidate's own answers judged by the teacher. "builtin" = compress/evaluate/chatsets/use.jsonl (48 prompts read by no
    # other stage); a local .jsonl of {"messages": [...]} conversations adds to it (or replaces it, listed alone);
    # [] = off. A model without a chat template is not scored on chat (said in the verdict).
    chat_sets: list[str] = Field(default_factory=lambda: ["builtin"])
    # Tokens per greedy answer on the chat set.
    chat_max_new_tokens: int = Field(48, ge=1, le=2048)
    # The structured genre (compress/evaluate/structured.py), for a model with a chat template: JSON into a schema and
    # one tool call among several, answered free and constrained by candidate and baseline. "structured" =
    # compress/evaluate/chatsets/structured.jsonl (10 tasks no other stage reads); a local .jsonl of tasks adds to
    # it; [] = off (configs/default.yaml turns it on).
    structured_sets: list[str] = Field(default_factory=list)
    # Tokens per answer on the structured tasks.
    structured_max_new_tokens: int = Field(128, ge=8, le=2048)
    # The share of free answers that parse and validate (JSON into the task's schema, a call of an offered tool with
    # valid arguments) may fall at most this much below the baseline's (absolute); null = logged only.
    max_structured_valid_drop: float | None = Field(0.2, ge=0, le=1)
    # The share of the constrained answers' fields equal to the baseline's (the same tool with the same arguments, the
    # same value under each key; another tool scores 0); "auto" = the criteria's (gate.py CHAT_LIMITS: fidelity 0.5,
    # quality logged only), null = logged only.
    min_structured_agreement: float | Literal["auto"] | None = "auto"
    # Limits on the chat set; "auto" = the criteria's (compress/evaluate/gate.py CHAT_LIMITS: fidelity, a quantized model,
    # stays within 1.05x / agreement 0.85 / judged 1.10x; quality, a student, within 1.10x / - / 1.25x), null = logged only.
    max_chat_perplexity_ratio: float | Literal["auto"] | None = "auto"
    # Top-1 agreement with the teacher on the teacher's chat answers; auto and null as above.
    min_chat_top1_agreement: float | Literal["auto"] | None = "auto"
    # The teacher's perplexity of the candidate's own greedy answers over its perplexity of its own answers.
    max_chat_judged_ratio: float | Literal["auto"] | None = "auto"
    # Share of answers that agree with the teacher's for at least chat_divergence_tokens tokens; null = logged only.
    min_chat_late_divergence_share: float | None = Field(None, ge=0, le=1)
    # Tokens an answer must follow the teacher's to count for min_chat_late_divergence_share.
    chat_divergence_tokens: int = Field(16, ge=1)
    # Wall-clock budget of the accept stage in minutes; past it the stage stops (between parts, or at the next
    # engine step while answers are generated) with a message naming what it was doing. null = no budget.
    max_minutes: float | None = Field(None, gt=0)
    # What the candidate is judged against (compress/evaluate/checkpoint_ref.py): artifact = the exported fp32 graph;
    # checkpoint = the source checkpoint in torch in its stored dtype (bf16: half the memory, AMX's bf16 GEMMs);
    # auto = checkpoint from 1B parameters stored in 16 bits (unless min_decode_speed_ratio needs the graph's speed).
    reference: Literal["auto", "artifact", "checkpoint"] = "auto"
    # candidate tokens/s over baseline tokens/s at batch-1 decode; null = no floor (formerly min_throughput_ratio).
    min_decode_speed_ratio: float | None = Field(None, gt=0)
    # Candidate bytes over the baseline's at most this; null = not checked.
    max_size_ratio: float | None = Field(None, gt=0)

    # Accuracy-aware loop (the quantize stage): on rejection, retries with relax_groups_per_trial more groups in
    # float, at most this many times; 0 = none. Its gate is this section's limits on the selection split.
    relax_trials: int = Field(2, ge=0)
    # Groups moved to float per retry, most sensitive first.
    relax_groups_per_trial: int = Field(4, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        return renamed_keys(data, "accept")

    @field_validator("chat_sets")
    @classmethod
    def _chat_sets_exist(cls, v: list[str]) -> list[str]:
        return check_chat_sets(v)

    @field_validator("structured_sets")
    @classmethod
    def _structured_sets_exist(cls, v: list[str]) -> list[str]:
        for s in v:
            if s not in ("structured", "structured_second") and not Path(s).is_file():
                raise ValueError(f"{s!r} is neither a named set (structured, structured_second) nor a .jsonl file")
        return v

    @field_validator("max_chat_perplexity_ratio", "max_chat_judged_ratio")
    @classmethod
    def _ratio_at_least_one(cls, v):
        if isinstance(v, float) and v < 1.0:
            raise ValueError(f"{v} < 1.0: a ratio limit below 1 would reject the teacher itself; use a value >= 1.0, "
                             f"'auto' or null")
        return v


class BenchmarkConfig(Section):
    """Serving benchmark of the candidate and the fp32 baseline, in the same run (loadtest/serve_bench.py)."""

    # Run the serving benchmark stage.
    enabled: bool = False
    # Requests sent to each server.
    requests: int = Field(16, ge=1)
    # Clients sending at once.
    concurrency: int = Field(4, ge=1)
    # Seed of the workload (prompts and lengths).
    seed: int = 0
    # Prompt length range in words, [shortest, longest].
    prompt_words: tuple[int, int] = (16, 96)
    # max_tokens range per request, [smallest, largest].
    max_tokens: tuple[int, int] = (8, 32)
    # Promotion also needs candidate/baseline server output tokens/s >= this (None = no speed floor; formerly
    # min_throughput_ratio).
    min_server_throughput_ratio: float | None = Field(None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        return renamed_keys(data, "benchmark")
    # ServeConfig fields for the benchmarked servers, e.g. {max_batch_size: 8}.
    serve_overrides: dict = Field(default_factory=dict)
    # A folder written by onnxruntime-genai's model builder from the same HF model (benchmarks/history.md, run 6,
    # says how): the stage then also times the candidate and genai at batch 1 on the same prompts and logs both
    # and the ratios. Skipped, with the reason logged, when onnxruntime-genai is not installed (.cache/genai-venv).
    genai_model: str | None = None


def check_chat_sets(v: list[str]) -> list[str]:
    """Chat set entries: the package's named sets (builtin = the gate's, selection = the search's) or local .jsonl
    files."""
    for entry in v:
        if entry not in CHAT_SET_NAMES and not (Path(entry).is_file() and entry.endswith(".jsonl")):
            raise ValueError(f"{entry!r} is not a local .jsonl file; list 'builtin', 'selection' and/or .jsonl files "
                             f"of {{\"messages\": [...]}} conversations, or [] to switch chat evaluation off")
    return v


CHAT_SET_NAMES = ("builtin", "selection")  # compress/evaluate/chat.py::NAMED_SETS
