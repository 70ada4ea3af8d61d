"""The quantize section (``quantize:``): which forms, how they are calibrated and chosen."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from serve.config import Section, renamed_keys


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
