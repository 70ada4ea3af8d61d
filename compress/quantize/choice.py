"""``quantize.method: auto``: build each INT8 form, gate each on the selection split, keep the fastest that passes.

The forms, in the order they are tried (``AUTO_FORMS``):

- ``weight_only``: MatMulNBits 8-bit block-wise weights; with ``accuracy_level`` 4 ORT quantizes the
  activations per block of 32 inside the kernel and multiplies in int8 (VNNI where the CPU has it), so it
  is W8A8 at a finer grain than per token, in one kernel per linear;
- ``dynamic`` with per-token activations (+ SmoothQuant as configured): W8A8 written as ONNX ops, five
  small nodes per shared input and MatMulIntegerToFloat + Mul per (packed) product.

Each form runs the accuracy-aware loop of compress/quantize/relax.py (``quantize_with_acceptance``) on the selection
split; the accepted ones are then timed against each other at batch 1 (decode steps interleaved, so load
on a shared machine hits them alike), and the fastest is renamed to ``out_dir``. With
``quantize.auto_concurrency`` N > 1 (the deployment expects N users at once) the choice is the most decode
tokens/s with N requests decoding together on the serving engine instead: weight-only MatMulNBits is the faster
kernel for one row, per-token W8A8's integer product several times faster from 8 rows up (docs/benchmarks.md); forms within
``quantize.auto_speed_tolerance`` of the fastest count as tied, and the lowest selection-split perplexity
among them wins (timing noise on a shared box must not flip the choice to the less accurate form). When
none passes, the last form's rejected artifact is kept, as a single-method run would keep it. The gate's
verdict is still the accept stage's, on the test split no trial has seen.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from compress.config import AcceptConfig, QuantizeConfig
from compress.evaluate.onnx_eval import ReferencePass
from compress.quantize.relax import AcceptanceResult, quantize_with_acceptance

AUTO_FORMS: dict[str, dict] = {
    "weight_only": {"method": "weight_only", "smoothquant_alpha": None},
    "dynamic_token": {"method": "dynamic", "activation_granularity": "token"},
}


@dataclass
class FormChoice:
    chosen: str | None  # None: no form passed the gate
    result: AcceptanceResult  # of the chosen form (or the last one tried when none passed)
    forms: dict[str, dict] = field(default_factory=dict)  # per form: accepted, reasons, decode ms/step, metrics

    def metrics(self) -> dict[str, float]:
        out = {}
        for name, f in self.forms.items():
            out[f"auto_{name}_accepted"] = float(f["accepted"])
            if f.get("decode_ms_per_step") is not None:
                out[f"auto_{name}_decode_ms_per_step"] = f["decode_ms_per_step"]
            for k, v in f.items():
                if k.startswith("tokens_per_s_b"):
                    out[f"auto_{name}_{k}"] = v
        return out


def decode_step_ms(artifacts: dict[str, Path], steps: int = 32, prompt_len: int = 32, rounds: int = 2,
                   threads: int | None = None, prompt: list[int] | None = None) -> dict[str, float]:
    """Median batch-1 decode step (ms) of each artifact, steps interleaved across artifacts."""
    from compress.drivers import load_lm

    lms = {n: load_lm(p, threads=threads, verify=False) for n, p in artifacts.items()}
    prompt = list(prompt or range(3, 3 + prompt_len))
    times: dict[str, list[float]] = {n: [] for n in lms}
    for _ in range(rounds):
        state = {n: lm.prefill(prompt, room=steps + 1, last_only=True) for n, lm in lms.items()}
        for _ in range(steps):
            for n, lm in lms.items():
                logits, past = state[n]
                t = time.perf_counter()
                state[n] = lm.decode([int(np.argmax(logits[-1]))], past)
                times[n].append(time.perf_counter() - t)
    return {n: 1000 * float(np.median(v)) for n, v in times.items()}


def engine_tokens_per_s(artifacts: dict[str, Path], batch: int, steps: int = 16, rounds: int = 2,
                        threads: int | None = None) -> dict[str, float]:
    """Decode tokens/s of each artifact with ``batch`` requests decoding together on the server's own engine
    (serve/engine.py: the runner, sampling and detokenizing a deployment runs), steps interleaved across
    artifacts so load on a shared machine hits them alike. ``batch`` 1 is the single user's rate."""
    from serve.config import ServeConfig
    from serve.engine import Engine
    from serve.onnx_session import CPU
    from serve.sampling import SamplingParams

    cfg = ServeConfig(providers=[CPU], max_batch_size=max(batch, 1), kv_memory_mb=max(256, 16 * batch),
                      intra_op_threads=threads or 0, enable_prefix_caching=False, verify_artifact=False)
    engines = {n: Engine(p, cfg, start=False) for n, p in artifacts.items()}
    spent = {n: 0.0 for n in engines}
    try:
        for n, eng in engines.items():
            handles = [eng.add_request([3 + (7 * i + j) % 200 for j in range(16)],
                                       SamplingParams.greedy(rounds * steps + 8, ignore_eos=True)) for i in range(batch)]
            while any(len(h.output_ids) < 2 for h in handles):  # every prompt in, every row decoding
                eng.step()
        for _ in range(rounds):
            for n, eng in engines.items():
                t = time.perf_counter()
                for _ in range(steps):
                    eng.step()
                spent[n] += time.perf_counter() - t
    finally:
        for eng in engines.values():
            eng.shutdown()
    return {n: batch * rounds * steps / sec for n, sec in spent.items()}


def profile_levels(qcfg: QuantizeConfig) -> list[int]:
    """The concurrency levels ``auto`` measures on the serving engine: 1, auto_concurrency and auto_profile
    (only 1 when neither asks for more)."""
    return sorted({1, qcfg.auto_concurrency, *qcfg.auto_profile})


def profile_figure(forms: dict[str, dict], chosen: str | None):
    """Tokens/s against concurrent users for each form (the ``tokens_per_s_b<N>`` figures), or None when fewer
    than two levels were measured."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    curves = {n: sorted((int(k.removeprefix("tokens_per_s_b")), v) for k, v in f.items()
                        if k.startswith("tokens_per_s_b")) for n, f in forms.items()}
    if max((len(c) for c in curves.values()), default=0) < 2:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for n, pts in curves.items():
        if pts:
            ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o",
                    label=n + (" (kept)" if n == chosen else ""), linewidth=2.5 if n == chosen else 1.5)
    ax.set_xscale("log", base=2)
    levels = sorted({b for pts in curves.values() for b, _ in pts})
    ax.set_xticks(levels, [str(b) for b in levels])
    ax.minorticks_off()
    ax.set_xlabel("requests decoding together")
    ax.set_ylabel("decode tokens/s (serving engine)")
    ax.set_title("quantize.method auto: the INT8 forms by concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def pick_form(ms_per_step: dict[str, float], perplexity: dict[str, float], tolerance: float) -> str:
    """The fastest form, where every form within ``tolerance`` (a share) of the fastest step time ties with it
    and the lowest perplexity among the tied wins (then the faster)."""
    fastest = min(ms_per_step.values())
    tied = [n for n, ms in ms_per_step.items() if ms <= fastest * (1 + tolerance)]
    return min(tied, key=lambda n: (perplexity[n], ms_per_step[n]))


def choose_quant_form(src_artifact: str | Path, out_dir: str | Path, calib_blocks: np.ndarray, eval_blocks: np.ndarray,
                      qcfg: QuantizeConfig, acfg: AcceptConfig, threads: int | None = None,
                      forms: dict[str, dict] | None = None, on_trial=None) -> FormChoice:
    """Every form of ``forms`` (default AUTO_FORMS) through the accuracy-aware loop; the fastest accepted one
    ends up in ``out_dir``. ``qcfg``'s other settings (block size, accuracy level, keep_float, ...) apply to all."""
    out_dir = Path(out_dir)
    forms = forms or AUTO_FORMS
    results: dict[str, AcceptanceResult] = {}
    record: dict[str, dict] = {}
    # One pass of the source over the selection split for every form and trial: its figures are the baseline,
    # its spooled logits the reference of each form's agreement and KL.
    with ReferencePass(src_artifact, eval_blocks, threads=threads) as reference:
        for name, update in forms.items():
            cfg = qcfg.model_copy(update=update)
            res = quantize_with_acceptance(src_artifact, out_dir.with_name(f"{out_dir.name}.{name}"), calib_blocks,
                                           eval_blocks, cfg, acfg, threads=threads, reference=reference,
                                           on_trial=(lambda k, m, name=name: on_trial(name, k, m)) if on_trial else None)
            results[name] = res
            record[name] = {"accepted": res.verdict.accepted, "reasons": list(res.verdict.reasons),
                            "metrics": dict(res.metrics), "trials": len(res.trials)}
    accepted = [n for n, r in results.items() if r.verdict.accepted]
    if len(accepted) > 1:
        speed = decode_step_ms({n: results[n].artifact for n in accepted}, threads=threads,
                               prompt=[int(t) for t in np.asarray(eval_blocks)[0][:32]])
        for n, ms in speed.items():
            record[n]["decode_ms_per_step"] = ms
        ppl = {n: results[n].metrics["perplexity"] for n in accepted}
        levels = profile_levels(qcfg)
        if len(levels) > 1:
            # The deployment's concurrency profile: every form's tokens/s at each level on the serving engine, so
            # the run shows the trade (docs/quantization.md); the choice is the most tokens/s at auto_concurrency.
            by_batch = {b: engine_tokens_per_s({n: results[n].artifact for n in accepted}, b, threads=threads)
                        for b in levels}
            for b, tps in by_batch.items():
                for n, v in tps.items():
                    record[n][f"tokens_per_s_b{b}"] = v
        if qcfg.auto_concurrency > 1:
            at = by_batch[qcfg.auto_concurrency]
            chosen = pick_form({n: 1000.0 / v for n, v in at.items()}, ppl, qcfg.auto_speed_tolerance)
        else:
            chosen = pick_form(speed, ppl, qcfg.auto_speed_tolerance)
    else:
        chosen = accepted[0] if accepted else None
    keep = chosen or list(results)[-1]
    if out_dir.exists():
        shutil.rmtree(out_dir)
    Path(results[keep].artifact).rename(out_dir)
    for n, r in results.items():
        if n != keep and Path(r.artifact).exists():
            shutil.rmtree(r.artifact)
    res = results[keep]
    res.artifact = out_dir
    res.report.out_dir = str(out_dir)
    return FormChoice(chosen, res, record)
