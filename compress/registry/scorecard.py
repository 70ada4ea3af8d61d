"""A version's scorecard: the few figures that decide between versions, under names that sort together.

MLflow's model-version compare page lists a version's source-run params and metrics alphabetically (a hundred of
each); these names start with ``_card.`` and a digit, so they sort first in a fixed order, and they are logged for
the baseline as well as the candidates (a ratio to the baseline is 1 for the baseline itself), so no row shows "-".

The verdict and the form are params (words); the figures are metrics. A number that was not measured (no chat
set, no serving benchmark) is left out rather than written as zero.
"""

from __future__ import annotations

PREFIX = "_card."
VERDICT = f"{PREFIX}0_verdict"
FORM = f"{PREFIX}0_form"
USERS = f"{PREFIX}0_benchmark_users"
# (metric, where it comes from in a version's figures (first found), what it says)
FIGURES = (
    (f"{PREFIX}1_accepted", ("accepted",), "1 when the gate accepted it (the baseline, the reference: 1)"),
    (f"{PREFIX}2_size_ratio", ("size_ratio",), "bytes of the graph against the baseline's"),
    (f"{PREFIX}3_chat_ratio", ("gate_chat_perplexity_ratio", "chat_perplexity_ratio"),
     "perplexity ratio on the chat set, the model's own answers"),
    (f"{PREFIX}4_top1_agreement", ("gate_top1_agreement", "top1_agreement"), "next token equal to the baseline's"),
    (f"{PREFIX}5_heldout_ratio", ("gate_heldout_perplexity_ratio", "heldout_perplexity_ratio"),
     "perplexity ratio on the held-out source no choice was tuned on"),
    (f"{PREFIX}6_tokens_per_s_1_user", ("decode_tokens_per_s",), "decode tokens/s, one sequence"),
    (f"{PREFIX}7_tokens_per_s_n_users", ("bench_output_tokens_per_s",),
     "server output tokens/s at the benchmark's users (param _card.0_benchmark_users)"),
    (f"{PREFIX}8_ttft_p50_s", ("bench_ttft_p50_s",), "server time to first token, median"),
)


def form_of(quantization: dict | None, pruned: bool = False) -> str:
    """A short name of what the weights are: 'weight-only int4, K/V int8', 'dynamic int8', 'fp32'."""
    base = "pruned, distilled " if pruned else ""
    if not quantization:
        return base + "fp32"
    method = str(quantization.get("method", "")).replace("_", "-")
    kv = str(quantization.get("kv_cache") or "").split(" ")[0]
    return f"{base}{method} int{quantization.get('weight_bits', 8)}" + (f", K/V {kv}" if kv.startswith("int") else "")


def scorecard(figures: dict, *, accepted: bool | None, baseline: bool, size_ratio: float | None) -> dict[str, float]:
    """The scorecard metrics of one version from its figures (its source run's metric names). ``baseline``: the
    reference, whose ratios to itself are 1."""
    src = dict(figures)
    if baseline:
        src.update({"accepted": 1.0, "size_ratio": 1.0, "top1_agreement": 1.0})
        # a ratio to itself where the figure behind it was measured
        src.update({f"{p}perplexity_ratio": 1.0 for p in ("chat_", "heldout_") if f"{p}perplexity" in src})
    else:
        if accepted is not None:
            src["accepted"] = float(accepted)
        if size_ratio is not None:
            src["size_ratio"] = size_ratio
    out = {}
    for name, keys, _ in FIGURES:
        v = next((src[k] for k in keys if isinstance(src.get(k), (int, float))), None)
        if v is not None:
            out[name] = float(v)
    return out


def card_params(verdict: str, form: str, users: int | None) -> dict[str, str]:
    params = {VERDICT: verdict, FORM: form}
    if users is not None:
        params[USERS] = str(users)
    return params
