"""Every `auto` of a run's config made concrete in one step, after the load stage has read the model.

`resolve_config` returns the config the rest of the run uses, with each `auto` that has one value for the whole run
replaced by it (the export's exporter and weights, the gate's criteria, chat limits and reference), and one row per
`auto` setting saying what it became and why. The settings a stage decides by measuring (the quantize stage's forms
and SmoothQuant alphas) or where it runs (distillation's device, autocast and compile) keep `auto` in the config;
their rows say what decides them and what this machine gives. The flow logs the rows once: `resolved_config.json`
in the MLflow run and a section of summary.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pydantic import ValidationError

from compress.config import ConfigError, PipelineConfig
from compress.evaluate.checkpoint_ref import resolve as reference_is_checkpoint
from compress.evaluate.gate import CHAT_LIMITS, chat_limit, resolve_criteria
from compress.export.weights import FROM_CHECKPOINT_WEIGHTS, fp32_needed_by, int4_wanted_by, resolve_weights


@dataclass(frozen=True)
class Setting:
    """One `auto` setting: its key, what it became (the config's new value, or what decides it) and why."""

    key: str
    value: Any
    why: str
    fixed: bool  # the value is the run's (in the resolved config); else decided later, by measuring or where it runs


@dataclass(frozen=True)
class ResolvedConfig:
    cfg: PipelineConfig
    settings: tuple[Setting, ...]

    def to_json(self) -> list[dict]:
        return [asdict(s) for s in self.settings]

    def markdown(self) -> str:
        lines = ["## Resolved config (every `auto`)", "", "| setting | value | why |", "|---|---|---|"]
        lines += [f"| `{s.key}` | {s.value if s.fixed else '(' + str(s.value) + ')'} | {s.why} |" for s in self.settings]
        return "\n".join(lines)


def _export(cfg: PipelineConfig, params: int, exporter_auto: tuple[str, str]) -> list[Setting]:
    rows = []
    if cfg.export.exporter == "auto":
        rows.append(Setting("export.exporter", exporter_auto[0], exporter_auto[1], True))
    if cfg.export.weights == "auto":
        exp = cfg.export.exporter if cfg.export.exporter != "auto" else exporter_auto[0]
        probe = cfg.model_copy(update={"export": cfg.export.model_copy(update={"exporter": exp})})
        weights, why = resolve_weights("auto", params, fp32_needed_by(probe), int4_wanted_by(probe))
        rows.append(Setting("export.weights", weights, why, True))
    return rows


def _accept(cfg: PipelineConfig, model_dir: str, weights: str) -> list[Setting]:
    a, rows = cfg.accept, []
    criteria = resolve_criteria(a, cfg.prune.enabled or cfg.distill.enabled)
    if a.criteria == "auto":
        rows.append(Setting("accept.criteria", criteria, "quality: pruning or distillation made another model"
                            if criteria == "quality" else "fidelity: the candidate is the same model, quantized", True))
    for name in CHAT_LIMITS[criteria]:
        if getattr(a, name) == "auto":
            rows.append(Setting(f"accept.{name}", chat_limit(a, name, criteria),
                                f"the {criteria} criteria's limit (compress/evaluate/gate.py CHAT_LIMITS)", True))
    if a.reference == "auto":
        if weights in FROM_CHECKPOINT_WEIGHTS:
            ref, why = "checkpoint", f"the export writes {weights} from the checkpoint: no fp32 graph to judge against"
        elif reference_is_checkpoint("auto", model_dir, a.min_decode_speed_ratio is not None):
            ref, why = "checkpoint", "1B parameters or more stored in 16 bits, and no decode-speed floor"
        else:
            ref, why = "artifact", ("accept.min_decode_speed_ratio times the fp32 graph" if a.min_decode_speed_ratio
                                    is not None else "under 1B parameters, or not stored in 16 bits: the fp32 graph")
        rows.append(Setting("accept.reference", ref, why, True))
    return rows


def _measured(cfg: PipelineConfig) -> list[Setting]:
    """The settings that stay `auto`: what decides them, and what this machine gives where that is known now."""
    q, d, rows = cfg.quantize, cfg.distill, []
    if q.enabled and q.method == "auto":
        rows.append(Setting("quantize.method", f"one of {q.auto_forms}", "the fastest form that passes the gate on "
                            "the selection split (the quantize stage)", False))
    if q.enabled and q.kv_cache == "auto":
        rows.append(Setting("quantize.kv_cache", "float32 or int8", "per weight form, int8 where it passes the gate "
                            "(the quantize stage)", False))
    if q.enabled and q.smoothquant_alpha == "auto":
        rows.append(Setting("quantize.smoothquant_alpha", "per tensor", "the alpha of the grid whose W8A8 output "
                            "error is least (weight-only forms smooth only with a number)", False))
    if q.enabled and q.weight_clip == "auto":
        rows.append(Setting("quantize.weight_clip", "mse, or none with AWQ", "4-bit ranges searched where no "
                            "activation-aware scaling ran", False))
    if d.enabled:
        rows += _distill(d)
    if cfg.registry.baseline_weights == "auto":
        from compress.registry.store import DIGEST_ABOVE_BYTES

        rows.append(Setting("registry.baseline_weights", "copy or digest", f"digest above {DIGEST_ABOVE_BYTES / 2**30:g} "
                            "GiB of graph weights, known after the export", False))
    return rows


def _distill(d) -> list[Setting]:
    from compress.distill.report import DistillError
    from compress.distill.train import COMPILE_MIN_TOKENS, amp_dtype_for, resolve_device

    rows = []
    try:
        device = resolve_device(d.device)
    except DistillError as e:  # no GPU here for distill.device cuda: the distill stage says it where it trains
        return [Setting("distill.device", d.device, str(e), False)]
    here = f"on this machine: {device.type}"
    if d.device == "auto":
        rows.append(Setting("distill.device", device.type, f"cuda where torch sees a GPU ({here})", False))
    if d.amp == "auto":
        amp = amp_dtype_for(d, device)
        rows.append(Setting("distill.amp", str(amp).replace("torch.", "") if amp else "off",
                            f"bf16 where the device computes it natively (compress/sizing/cpu.py flags; {here})", False))
    if d.compile == "auto":
        rows.append(Setting("distill.compile", "on the CPU from " + f"{COMPILE_MIN_TOKENS:,} training tokens",
                            "pays back its one-off compile there (compress/distill/train.py)", False))
    return rows


def resolve_config(cfg: PipelineConfig, *, params: int, model_dir: str,
                   exporter_auto: tuple[str, str]) -> ResolvedConfig:
    """``params``: the checkpoint's parameter count; ``exporter_auto``: (exporter, why) that export.exporter auto gives
    for this model (compress.export.choose_exporter, read by the load stage)."""
    rows = _export(cfg, params, exporter_auto)
    fixed = {s.key: s.value for s in rows}
    weights = fixed.get("export.weights", cfg.export.weights)
    rows += _accept(cfg, model_dir, weights)
    fixed = {s.key: s.value for s in rows}
    dump = cfg.model_dump(mode="json")
    for key, value in fixed.items():
        section, name = key.split(".")
        dump[section][name] = value
    try:
        resolved = PipelineConfig.model_validate(dump)
    except ValidationError as e:
        made = ", ".join(f"{k} auto -> {v}" for k, v in fixed.items())
        why = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
        raise ConfigError(f"the config's auto settings resolve to values that conflict ({made}): {why}; set the "
                          f"conflicting setting explicitly") from None
    return ResolvedConfig(resolved, tuple(rows + _measured(cfg)))
