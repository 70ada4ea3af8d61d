"""Golden outputs: record a torch model's behaviour on fixed prompts, check any ONNX model against it.

Recorded per prompt: the greedy continuation of N tokens and, at every position
of prompt + continuation, the top-k logits (values and token ids). Stored as
golden.json + golden.npz (no pickle). The check runs the ONNX graph through both
paths the server uses: one prefill over the whole sequence (logits), and
prefill + one-token decode steps through the KV cache (greedy continuation);
plus a left-padded batch that must match each prompt run alone.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from compress.drivers import LanguageModelDriver, load_lm


class GoldenMismatch(AssertionError):
    """An ONNX model that does not reproduce the golden outputs."""


@dataclass
class GoldenSet:
    prompts: list[str]
    prompt_ids: list[list[int]]
    continuations: list[list[int]]
    topk_values: list[np.ndarray]  # per prompt [positions, k] float32
    topk_indices: list[np.ndarray]  # per prompt [positions, k] int64
    # Token ids the reference decode could not pick (EOS, held off by min_new_tokens so that every model is
    # compared on the same number of tokens); the ONNX greedy decode must hold them off too.
    suppressed_ids: list[int] = field(default_factory=list)

    def sequence(self, i: int) -> list[int]:
        """The tokens whose logits were recorded: prompt + continuation minus the last generated token."""
        return self.prompt_ids[i] + self.continuations[i][:-1]

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"prompts": self.prompts, "prompt_ids": self.prompt_ids, "continuations": self.continuations,
                "suppressed_ids": self.suppressed_ids}
        (folder / "golden.json").write_text(json.dumps(meta, indent=1))
        arrays = {}
        for i, (v, ix) in enumerate(zip(self.topk_values, self.topk_indices)):
            arrays[f"values_{i}"] = v
            arrays[f"indices_{i}"] = ix
        np.savez_compressed(folder / "golden.npz", **arrays)
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> "GoldenSet":
        folder = Path(folder)
        meta = json.loads((folder / "golden.json").read_text())
        with np.load(folder / "golden.npz", allow_pickle=False) as z:
            n = len(meta["prompts"])
            values = [z[f"values_{i}"] for i in range(n)]
            indices = [z[f"indices_{i}"] for i in range(n)]
        return cls(meta["prompts"], meta["prompt_ids"], meta["continuations"], values, indices,
                   meta.get("suppressed_ids", []))


@torch.no_grad()
def record_golden(model, tokenizer, prompts: list[str], top_k: int = 8, new_tokens: int = 16) -> GoldenSet:
    """prompt_ids are the prompts as the model expects them (BOS first when it takes one, see
    compress/loading/special_tokens.py); the ONNX check replays exactly these ids."""
    from compress.loading.special_tokens import special_tokens

    model.eval()
    st = special_tokens(tokenizer, model)
    prompt_ids, conts, values, indices = [], [], [], []
    for p in prompts:
        ids = st.encode(tokenizer, p)
        if len(ids) == len(st.prefix()):
            raise ValueError(f"golden.prompts: prompt {p!r} tokenizes to nothing; use a non-empty prompt")
        # HF's own cached greedy decode: a reference independent of the exported graph under test.
        # min_new_tokens keeps EOS from ending it early, so every model is compared on N tokens.
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or 0)
        cont = [int(t) for t in out[0, len(ids):]]
        full = model(input_ids=torch.tensor([ids + cont[:-1]])).logits[0].float()
        v, ix = full.topk(top_k, dim=-1)
        prompt_ids.append(list(ids))
        conts.append(cont)
        values.append(v.numpy().astype(np.float32))
        indices.append(ix.numpy().astype(np.int64))
    return GoldenSet(list(prompts), prompt_ids, conts, values, indices, _eos_ids(model, tokenizer))


def _eos_ids(model, tokenizer) -> list[int]:
    """The ids generate()'s min_new_tokens masks: the generation config's EOS (an int or a list)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    return sorted({int(i) for i in ids if i is not None})


@dataclass
class PromptResult:
    prompt: str
    max_abs_error: float
    off_count: int
    positions: int
    top1_agreement: float
    greedy_prefix: int
    greedy_len: int
    first_bad_position: int | None  # first position whose logits are off or whose argmax differs
    batched_max_abs_error: float | None = None

    @property
    def prefix_match(self) -> float:
        return self.greedy_prefix / max(self.greedy_len, 1)


@dataclass
class GoldenReport:
    rows: list[PromptResult]
    thresholds: dict
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def metrics(self, prefix: str = "golden_") -> dict[str, float]:
        rows = self.rows
        out = {
            "max_abs_error": max(r.max_abs_error for r in rows),
            "off_count": float(sum(r.off_count for r in rows)),
            "top1_agreement": float(np.mean([r.top1_agreement for r in rows])),
            "prefix_match": float(np.mean([r.prefix_match for r in rows])),
            "passed": float(self.passed),
        }
        batched = [r.batched_max_abs_error for r in rows if r.batched_max_abs_error is not None]
        if batched:
            out["batched_max_abs_error"] = max(batched)
        return {prefix + k: v for k, v in out.items()}

    def table(self) -> dict[str, list]:
        """Column-oriented, as mlflow.log_table takes it."""
        cols: dict[str, list] = {}
        for r in self.rows:
            d = asdict(r)
            d["prefix_match"] = r.prefix_match
            for k, v in d.items():
                cols.setdefault(k, []).append(v)
        return cols

    def raise_if_failed(self) -> None:
        if self.failures:
            raise GoldenMismatch("golden validation failed:\n  " + "\n  ".join(self.failures))


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _prompt_failures(name: str, r: PromptResult, t: dict, *, worst: int, against: Callable[[], str],
                     prompt_len: int) -> list[str]:
    """One prompt's failed thresholds (``t``: compare_onnx's), each a line naming the prompt and the position;
    against() names what its greedy continuation was held to."""
    out = []
    if r.max_abs_error > t["max_abs_error"]:
        out.append(f"{name}: max abs logit error {r.max_abs_error:.3g} > {t['max_abs_error']:g}, "
                   f"first diverging position {r.first_bad_position} (worst {worst}) of {r.positions}")
    if r.off_count > t["max_off_count"]:
        out.append(f"{name}: {r.off_count} top-k logits off by > {t['off_threshold']:g} "
                   f"(allowed {t['max_off_count']})")
    if r.top1_agreement < t["min_top1_agreement"]:
        out.append(f"{name}: top-1 agreement {r.top1_agreement:.3f} < {t['min_top1_agreement']}, "
                   f"first diverging position {r.first_bad_position}")
    if r.prefix_match < t["min_prefix_match"]:
        out.append(f"{name}: greedy continuation diverges from {against()} at generated token {r.greedy_prefix} "
                   f"(position {prompt_len + r.greedy_prefix}); matched {r.greedy_prefix}/{r.greedy_len}")
    return out


def compare_onnx(lm: LanguageModelDriver | str | Path, golden: GoldenSet, max_abs_error: float = 1e-2, *, off_threshold: float = 1e-2,
                 max_off_count: int = 0, min_top1_agreement: float = 1.0, min_prefix_match: float = 1.0,
                 check_batched: bool = True, pad_id: int = 0, decode_against: str = "golden",
                 batched_max_abs_error: float | None = None, decode_tolerance: float | None = None) -> GoldenReport:
    """Check an ONNX artifact against golden outputs; report.failures names prompt and position.

    decode_against "golden": the greedy continuation must be the reference's; "self": it must be the graph's own
    prefill argmax at every generated position (the KV-cache decode path against the prefill path, for a graph that
    is not expected to make the reference's choices on near ties: an INT8 one, compress/evaluate/golden_int8.py).
    batched_max_abs_error: how far a left-padded batch may be from the prompts run alone (default max_abs_error).
    decode_tolerance (decode_against "self"): how far below the prefill's argmax a decoded token may be (default
    the batched tolerance).

    Given a folder, the greedy continuations come from the serving engine, every prompt at once
    (compress/evaluate/generate.py), before the driver that checks the logits is loaded: golden then checks the
    path the server decodes on, one model in memory at a time. Given a driver, they come from its batch-1 loop."""
    conts = None
    if isinstance(lm, (str, Path)):
        from compress.evaluate.generate import greedy_answers

        # golden's continuations all have the same length (EOS held off while they were recorded)
        n = max((len(c) for c in golden.continuations), default=0)
        conts = greedy_answers(lm, golden.prompt_ids, n, suppress_ids=golden.suppressed_ids, progress=False,
                               desc="golden continuations", stop_at_eos=False).answers if n else None
        lm = load_lm(lm)  # OnnxLM or GqaLM, from the manifest's attention_layout
    thresholds = dict(max_abs_error=max_abs_error, off_threshold=off_threshold, max_off_count=max_off_count,
                      min_top1_agreement=min_top1_agreement, min_prefix_match=min_prefix_match)
    path_tolerance = max_abs_error if batched_max_abs_error is None else batched_max_abs_error
    decode_tolerance = path_tolerance if decode_tolerance is None else decode_tolerance
    rows: list[PromptResult] = []
    failures: list[str] = []
    single_logits = []
    for i, prompt in enumerate(golden.prompts):
        seq = golden.sequence(i)
        logits = lm.logits(seq)
        single_logits.append(logits)
        idx, ref = golden.topk_indices[i], golden.topk_values[i]
        got = np.take_along_axis(logits, idx, axis=-1)
        err = np.abs(got - ref)
        per_pos = err.max(axis=-1)
        top1_ok = logits.argmax(-1) == idx[:, 0]
        bad = np.nonzero((per_pos > max_abs_error) | ~top1_ok)[0]
        want = len(golden.continuations[i])
        cont = (conts[i][:want] if conts is not None else
                lm.greedy(golden.prompt_ids[i], want, suppress_ids=golden.suppressed_ids))
        gap = None
        if decode_against == "self":
            lcp, gap = _own_argmax_prefix(lm, golden.prompt_ids[i], cont, golden.suppressed_ids, decode_tolerance)
        else:
            lcp = _lcp(cont, golden.continuations[i])
        r = PromptResult(prompt, float(err.max()), int((err > off_threshold).sum()), int(len(seq)),
                         float(top1_ok.mean()), lcp, len(golden.continuations[i]), int(bad[0]) if len(bad) else None)
        rows.append(r)
        against = (lambda gap=gap: f"the graph's own prefill argmax (its token {gap:.3g} below it, more than "
                   f"{decode_tolerance:g})") if decode_against == "self" else (lambda: "the reference's")
        failures += _prompt_failures(f"prompt {i} {prompt[:40]!r}", r, thresholds, worst=int(per_pos.argmax()),
                                     against=against, prompt_len=len(golden.prompt_ids[i]))
    if check_batched and len(golden.prompts) > 1:
        failures += _batched_failures(lm, golden, rows, single_logits, pad_id, path_tolerance)
    return GoldenReport(rows, thresholds, failures)


def _batched_failures(lm, golden: GoldenSet, rows: list[PromptResult], single_logits: list[np.ndarray], pad_id: int,
                      tolerance: float) -> list[str]:
    """Every prompt run again in one left-padded batch: its logits against its single run's (recorded in its row),
    a failure line for each further off than ``tolerance``."""
    failures = []
    seqs = [golden.sequence(i) for i in range(len(golden.prompts))]
    for i, batched in enumerate(lm.logits_left_padded(seqs, pad_id)):
        d = float(np.abs(batched - single_logits[i]).max())
        rows[i].batched_max_abs_error = d
        if d > tolerance:
            pos = int(np.abs(batched - single_logits[i]).max(-1).argmax())
            failures.append(f"prompt {i} {golden.prompts[i][:40]!r}: left-padded batch differs from the "
                            f"single run by {d:.3g} at position {pos}")
    return failures


def _own_argmax_prefix(lm, prompt_ids: list[int], cont: list[int], suppressed: list[int],
                       tolerance: float) -> tuple[int, float | None]:
    """(how many of ``cont``'s leading tokens are the graph's own prefill argmax, a token within ``tolerance`` of the
    argmax counting as it; the first other token's distance below the argmax, or None) with the suppressed ids held
    off, as the decode held them off."""
    logits = lm.logits(list(prompt_ids) + list(cont[:-1]))[len(prompt_ids) - 1:]
    if suppressed:
        logits = logits.copy()
        logits[:, suppressed] = -np.inf
    n = 0
    for row, tok in zip(logits, cont):
        if row.max() - row[tok] > tolerance:
            return n, float(row.max() - row[tok])
        n += 1
    return n, None


def compare_from_config(lm, golden: GoldenSet, cfg, pad_id: int = 0, thresholds: dict | None = None,
                        decode_against: str = "golden") -> GoldenReport:
    """cfg: a GoldenConfig; ``thresholds`` replace its tolerances (golden_int8.int8_thresholds)."""
    t = {"batched_max_abs_error": cfg.max_abs_error, "max_abs_error": cfg.max_abs_error, "off_threshold": cfg.off_threshold, "max_off_count": cfg.max_off_count,
         "min_top1_agreement": cfg.min_top1_agreement, "min_prefix_match": cfg.min_prefix_match, **(thresholds or {})}
    # An INT8 graph's KV decode (the engine, every prompt at once) and its prefill need not round alike at full size:
    # the Qwen2.5-7B shape's decode picked a token 0.043 below the prefill's argmax (its tolerance: 2 x the rounding's
    # own distance), where the fp32 graphs hold to 1e-3 and the 4-layer scaled shape's two INT8 paths to 4e-7. A
    # decoded token is held to the tolerance derived for the graph, not to fp32's.
    decode_tolerance = t["max_abs_error"] if thresholds and decode_against == "self" else None
    return compare_onnx(lm, golden, **t, check_batched=cfg.check_batched, pad_id=pad_id, decode_against=decode_against,
                        decode_tolerance=decode_tolerance)
