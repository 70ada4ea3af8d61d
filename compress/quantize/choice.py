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
kernel for one row, per-token W8A8's integer product several times faster from 8 rows up (benchmarks/history.md); forms within
``quantize.auto_speed_tolerance`` of the fastest count as tied, and the lowest selection-split perplexity
among them wins (timing noise on a shared box must not flip the choice to the less accurate form). The gate's
verdict is still the accept stage's, on the test split no trial has seen. With ``quantize.auto_objective: size`` the
smallest graph that passed is kept instead, and nothing is timed (``smallest_form``).

The K/V cache is part of the choice with ``quantize.kv_cache: auto`` (issue 46: an int8 cache chosen on SmolLM2
rejected a Gemma 3 that passes with a float one). Each weight form is written with each cache form of
``kv_forms`` in the order of their speed at ``auto_concurrency`` users (from ``KV_INT8_FROM_USERS``: int8 per
tensor, int8 per channel, float32, since batched decode is bound by attention over the cache; below it float32
first, as an int8 cache buys one user little speed for its accuracy), from one calibrated Quantizer, and the first
that passes is that weight form's candidate. The faster cache forms get one trial each (keeping more linears in
float does not repair a cache); the last gets the accuracy-aware loop. Every attempt's figures are kept
(``FormChoice.forms[name]["kv_attempts"]``) and ``FormChoice.hints`` says what the cache cost where it was measured
(a failed cache form against the one that passed, or float32).

When no form passes, ``chosen`` is None and the most accurate attempt (lowest selection-split perplexity) is kept
in ``out_dir``: the pipeline then ends the run Rejected with every form's failed checks instead of judging a form
already known to fail on the test split (flows/pipeline.py ``quantize_rejection``).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from compress.config import AcceptConfig, QuantizeConfig
from compress.evaluate.gate import failed_checks
from compress.evaluate.onnx_eval import ReferencePass
from compress.quantize.relax import AcceptanceResult, quantize_with_acceptance

AUTO_FORMS: dict[str, dict] = {
    "weight_only": {"method": "weight_only", "smoothquant_alpha": None, "weight_bits": 8},
    "dynamic_token": {"method": "dynamic", "activation_granularity": "token"},
    # 4-bit MatMulNBits, AWQ-scaled, the groups 4 bits hurt most at 8 (compress/quantize/int4.py)
    "weight_only_int4": {"method": "weight_only", "smoothquant_alpha": None, "weight_bits": 4},
}


KV_FORMS: dict[str, dict] = {
    "int8_tensor": {"kv_cache": "int8", "kv_cache_scales": "tensor"},
    "int8_channel": {"kv_cache": "int8", "kv_cache_scales": "channel"},
    "float32": {"kv_cache": "float32"},
}
# From this many users on, an int8 cache is the faster (attention over it ~2x faster, benchmarks/history.md run 10).
KV_INT8_FROM_USERS = 8


def kv_forms(qcfg: QuantizeConfig, manifest: dict) -> dict[str, dict]:
    """The cache forms to try, fastest first for the declared concurrency; one (the configured) unless kv_cache is
    auto. An int8 cache needs the gqa layout with a float32 cache: other artifacts keep theirs."""
    if qcfg.kv_cache != "auto":
        name = "float32" if qcfg.kv_cache == "float32" else f"int8_{qcfg.kv_cache_scales}"
        return {name: {}}
    if manifest.get("attention_layout") != "gqa" or manifest.get("kv_dtype", "float32") != "float32":
        return {"float32": KV_FORMS["float32"]}
    order = (["int8_tensor", "int8_channel", "float32"] if qcfg.auto_concurrency >= KV_INT8_FROM_USERS
             else ["float32", "int8_tensor", "int8_channel"])
    return {n: KV_FORMS[n] for n in order}


def kv_label(name: str) -> str:
    return {"int8_tensor": "int8 K/V per tensor", "int8_channel": "int8 K/V per channel",
            "float32": "float32 K/V"}.get(name, name)


@dataclass
class FormChoice:
    chosen: str | None  # None: no form passed the gate
    result: AcceptanceResult  # of the chosen form (or the most accurate attempt when none passed)
    # per weight form: accepted, reasons, decode ms/step, metrics, kv (its cache form), kv_attempts
    forms: dict[str, dict] = field(default_factory=dict)
    kv_chosen: str | None = None  # the kept candidate's cache form (KV_FORMS' names)
    kv_auto: bool = False

    def hints(self) -> list[str]:
        """What the cache cost where it was measured: each failed attempt against its weight form's passing one (or
        the float32 one when none passed), e.g. 'dynamic_token: int8 K/V per tensor: top-1 agreement 0.881,
        perplexity ratio 1.056; with int8 K/V per channel 0.937, 1.026'."""
        out = []
        for name, f in self.forms.items():
            att = f.get("kv_attempts", [])
            ref = next((a for a in att if a["accepted"]), None) or next((a for a in att if a["kv"] == "float32"), None)
            for a in att:
                if ref is None or a is ref or a["accepted"]:
                    continue
                out.append(f"{name}: {kv_label(a['kv'])}: top-1 agreement {a['top1_agreement']:.3f}, perplexity ratio "
                           f"{a['perplexity_ratio']:.3f}; with {kv_label(ref['kv'])} {ref['top1_agreement']:.3f}, "
                           f"{ref['perplexity_ratio']:.3f}" + ("" if ref["accepted"] else " (also rejected)"))
        return out

    def metrics(self) -> dict[str, float]:
        out = {}
        for name, f in self.forms.items():
            out[f"auto_{name}_accepted"] = float(f["accepted"])
            if f.get("kv_attempts"):
                out[f"auto_{name}_size_ratio"] = f["kv_attempts"][-1]["size_ratio"]
            if self.kv_auto:
                for a in f.get("kv_attempts", []):
                    out[f"auto_{name}_kv_{a['kv']}_accepted"] = float(a["accepted"])
                    out[f"auto_{name}_kv_{a['kv']}_top1_agreement"] = a["top1_agreement"]
                    out[f"auto_{name}_kv_{a['kv']}_perplexity_ratio"] = a["perplexity_ratio"]
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
    (serve/engine/engine.py: the runner, sampling and detokenizing a deployment runs), steps interleaved across
    artifacts so load on a shared machine hits them alike. ``batch`` 1 is the single user's rate."""
    from serve.config import ServeConfig
    from serve.engine.engine import Engine
    from serve.engine.sampling import SamplingParams
    from serve.runners.onnx_session import CPU

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
    ax.set_title("quantize.method auto: the forms by concurrency")
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


def weight_forms(qcfg: QuantizeConfig) -> dict[str, dict]:
    """AUTO_FORMS for method auto, else the configured method alone (its cache form may still be auto)."""
    if qcfg.method == "auto":
        return {n: AUTO_FORMS[n] for n in qcfg.auto_forms}
    name = ("dynamic_token" if qcfg.method == "dynamic" and qcfg.activation_granularity == "token" else
            "weight_only_int4" if qcfg.method == "weight_only" and qcfg.weight_bits == 4 else qcfg.method)
    return {name: {}}


def _attempt_record(kv: str, res: AcceptanceResult) -> dict:
    m = res.metrics
    base = res.baseline.get("perplexity") or float("nan")
    return {"kv": kv, "kv_label": kv_label(kv), "accepted": res.verdict.accepted,
            "failed": "" if res.verdict.accepted else failed_checks(res.verdict),
            "top1_agreement": float(m.get("top1_agreement", float("nan"))),
            "perplexity_ratio": float(m["perplexity"] / base), "perplexity": float(m["perplexity"]),
            "size_ratio": float(res.report.size_ratio), "trials": len(res.trials)}


def _judge_weight_form(src: Path, out_dir: Path, calib_blocks, selection_blocks, cfg: QuantizeConfig, acfg: AcceptConfig,
                       *, kvs: dict[str, dict], threads, reference, on_trial) -> tuple[str, AcceptanceResult, list[dict]]:
    """One weight form with each cache form in turn (kvs' order) until one passes: (its cache form, its result,
    every attempt). The faster cache forms get one trial, the last the whole loop; only the returned one's
    artifact is left on disk."""
    from compress.quantize.quantizer import Quantizer

    first = next(iter(kvs.values()))
    q = Quantizer(src, calib_blocks, cfg.model_copy(update=first), threads=threads)
    attempts: list[dict] = []
    best: tuple[str, AcceptanceResult] | None = None
    names = list(kvs)
    for k, kv in enumerate(names):
        if kvs[kv]:  # {} = the configured cache, which q.cfg has
            q.use_kv_cache(kvs[kv]["kv_cache"], kvs[kv].get("kv_cache_scales", "channel"))
        loop = acfg if k == len(names) - 1 else acfg.model_copy(update={"relax_trials": 0})
        res = quantize_with_acceptance(src, out_dir.with_name(f"{out_dir.name}.kv_{kv}"), calib_blocks, selection_blocks,
                                       q.cfg, loop, threads=threads, reference=reference, quantizer=q,
                                       on_trial=(lambda i, m, kv=kv: on_trial(kv, i, m)) if on_trial else None)
        attempts.append(_attempt_record(kv, res))
        if best is None or res.verdict.accepted or (not best[1].verdict.accepted and
                                                   res.metrics["perplexity"] < best[1].metrics["perplexity"]):
            if best is not None:
                shutil.rmtree(best[1].artifact, ignore_errors=True)
            best = (kv, res)
        else:
            shutil.rmtree(res.artifact, ignore_errors=True)
        if res.verdict.accepted:
            break
    return best[0], best[1], attempts


# Above this many bytes of graph weights in all, fastest_form times the forms one after another instead of
# interleaved in one process: two 7B graphs (5.3 GiB at 4 bits, 8 GiB at 8) held at once would pass the memory the
# large path promises (1.5x the bf16 weights), and steps interleaved across big graphs ran 1.6x slower on a VM
# that reclaims idle memory (benchmarks/history.md run 18), so nothing is lost in fairness.
INTERLEAVED_TIMING_MAX_BYTES = 4 << 30


def _graph_bytes(artifact: Path) -> int:
    return sum(f.stat().st_size for f in Path(artifact).glob("model.onnx*"))


def fastest_form(artifacts: dict[str, Path], perplexity: dict[str, float], record: dict[str, dict],
                 qcfg: QuantizeConfig, prompt: list[int], threads: int | None = None) -> str:
    """The fastest of ``artifacts`` (forms that passed the gate; pick_form: forms within auto_speed_tolerance of it
    tie, the lowest selection-split ``perplexity`` wins): by tokens/s at quantize.auto_concurrency rows on the
    serving engine, or by the batch-1 decode step when that is 1. Each form's speeds go into its ``record``. Graphs
    over INTERLEAVED_TIMING_MAX_BYTES together are timed one at a time (one in memory)."""
    apart = sum(_graph_bytes(p) for p in artifacts.values()) > INTERLEAVED_TIMING_MAX_BYTES
    groups = [{n: p} for n, p in artifacts.items()] if apart else [artifacts]
    speed = {n: v for g in groups for n, v in decode_step_ms(g, threads=threads, prompt=prompt).items()}
    for n, ms in speed.items():
        record[n]["decode_ms_per_step"] = ms
    levels = profile_levels(qcfg)
    if len(levels) > 1:
        # The deployment's concurrency profile: every form's tokens/s at each level on the serving engine, so
        # the run shows the trade (docs/quantization.md); the choice is the most tokens/s at auto_concurrency.
        by_batch = {b: {n: v for g in groups for n, v in engine_tokens_per_s(g, b, threads=threads).items()}
                    for b in levels}
        for b, tps in by_batch.items():
            for n, v in tps.items():
                record[n][f"tokens_per_s_b{b}"] = v
    if qcfg.auto_concurrency > 1:
        at = by_batch[qcfg.auto_concurrency]
        return pick_form({n: 1000.0 / v for n, v in at.items()}, perplexity, qcfg.auto_speed_tolerance)
    return pick_form(speed, perplexity, qcfg.auto_speed_tolerance)


def smallest_form(artifacts: dict[str, Path], perplexity: dict[str, float], record: dict[str, dict]) -> str:
    """quantize.auto_objective size: the form of ``artifacts`` with the fewest graph bytes (equal bytes: the lower
    selection-split ``perplexity``); each form's bytes go into its ``record``."""
    size = {n: _graph_bytes(p) for n, p in artifacts.items()}
    for n, b in size.items():
        record[n]["graph_bytes"] = b
    return min(size, key=lambda n: (size[n], perplexity[n]))


def choose_quant_form(src_artifact: str | Path, out_dir: str | Path, calib_blocks: np.ndarray, selection_blocks: np.ndarray,
                      qcfg: QuantizeConfig, acfg: AcceptConfig, *, threads: int | None = None,
                      forms: dict[str, dict] | None = None, on_trial=None) -> FormChoice:
    """Every weight form of ``forms`` (default: weight_forms(qcfg)) with its cache forms (kv_forms) through the
    accuracy-aware loop; the fastest accepted candidate ends up in ``out_dir``. ``qcfg``'s other settings (block
    size, accuracy level, keep_float, ...) apply to all. on_trial(form, trial, record): form is the weight form's
    name, with ``.kv_<cache form>`` when the cache is chosen too."""
    from compress.artifact import read_manifest

    src = Path(src_artifact)
    out_dir = Path(out_dir)
    forms = forms or weight_forms(qcfg)
    kvs = kv_forms(qcfg, read_manifest(src, verify=False))
    kv_auto = qcfg.kv_cache == "auto"
    results: dict[str, AcceptanceResult] = {}
    record: dict[str, dict] = {}
    # One pass of the source over the selection split for every form and trial: its figures are the baseline,
    # its spooled logits the reference of each form's agreement and KL.
    with ReferencePass(src, selection_blocks, threads=threads) as reference:
        for name, update in forms.items():
            cfg = qcfg.model_copy(update=update)
            tag = (lambda kv, i, m, name=name: on_trial(f"{name}.kv_{kv}" if kv_auto else name, i, m)) if on_trial else None
            kv, res, attempts = _judge_weight_form(src, out_dir.with_name(f"{out_dir.name}.{name}"), calib_blocks,
                                                   selection_blocks, cfg, acfg, kvs=kvs, threads=threads,
                                                   reference=reference, on_trial=tag)
            results[name] = res
            record[name] = {"accepted": res.verdict.accepted, "reasons": list(res.verdict.reasons),
                            "metrics": dict(res.metrics), "trials": len(res.trials), "kv": kv,
                            "kv_attempts": attempts}
    accepted = [n for n, r in results.items() if r.verdict.accepted]
    passed = {n: results[n].artifact for n in accepted}
    ppl = {n: results[n].metrics["perplexity"] for n in accepted}
    if len(accepted) < 2:
        chosen = accepted[0] if accepted else None
    elif qcfg.auto_objective == "size":
        chosen = smallest_form(passed, ppl, record)
    else:
        chosen = fastest_form(passed, ppl, record, qcfg, [int(t) for t in np.asarray(selection_blocks)[0][:32]], threads)
    # none passed: the most accurate attempt is kept, to be registered as the rejected candidate
    keep = chosen or min(results, key=lambda n: results[n].metrics["perplexity"])
    if out_dir.exists():
        shutil.rmtree(out_dir)
    Path(results[keep].artifact).rename(out_dir)
    for n, r in results.items():
        if n != keep and Path(r.artifact).exists():
            shutil.rmtree(r.artifact)
    res = results[keep]
    res.artifact = out_dir
    res.report.out_dir = str(out_dir)
    return FormChoice(chosen, res, record, record[keep]["kv"] if chosen else None, kv_auto)
