"""The drafter judged where it runs: the serving engine, one user at a time, speculation off and on.

The prompts are the gate's chat selection set (compress/evaluate/chatsets/selection.jsonl), which the drafter never
trained on (its prompts: compress/draft/conversations.py). Each prompt is answered greedily on a fresh engine per
setting, one request at a time (the one-user case that drafting is for); tokens/s = answer tokens / wall time.
The texts must be identical: drafts only ever change the speed.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

CHATSET = Path(__file__).resolve().parent.parent / "evaluate" / "chatsets" / "selection.jsonl"


@dataclass
class Judgement:
    tokens_per_s_off: float
    tokens_per_s_on: float
    speedup: float
    identical: int
    prompts: int
    acceptance: float  # accepted drafts / drafted tokens
    tokens_per_check: float  # tokens a drafted check produced (accepted drafts + the target's own)

    def metrics(self) -> dict[str, float]:
        return {f"draft_judge_{k}": float(v) for k, v in asdict(self).items()}


def judge_prompts(n: int) -> list[list[dict]]:
    rows = [json.loads(line) for line in CHATSET.read_text().splitlines() if line.strip()]
    return [r["messages"] for r in rows[:n]]


def _answer(target: Path, speculative: str, prompts: list[list[dict]], max_tokens: int, **serve) -> tuple:
    from compress.draft.conversations import chat_ids
    from serve.config import ServeConfig
    from serve.engine.engine import Engine
    from serve.engine.sampling import SamplingParams

    eng = Engine(target, ServeConfig(speculative=speculative, result_cache_size=0, enable_prefix_caching=False,
                                     **serve), start=False)
    try:
        texts, tokens, wall = [], 0, 0.0
        for msgs in prompts:
            ids = chat_ids(eng, msgs)
            t0 = time.perf_counter()
            handle = eng.add_request(ids, SamplingParams.greedy(max_tokens))
            eng.run_until_done()
            wall += time.perf_counter() - t0
            out = handle.result().output_ids
            texts.append(out)
            tokens += len(out)
        c = eng.drafter.counters if eng.drafter is not None else None
        return texts, tokens, wall, c
    finally:
        eng.shutdown()


def judge_drafter(target: str | Path, drafter: str | Path, *, prompts: int = 8, max_tokens: int = 128,
                  **serve) -> Judgement:
    """Tokens/s of the target served alone and with ``drafter`` (``serve``: further ServeConfig keys)."""
    target = Path(target)
    chats = judge_prompts(prompts)
    off_texts, off_tokens, off_wall, _ = _answer(target, "off", chats, max_tokens, **serve)
    on_texts, on_tokens, on_wall, c = _answer(target, str(drafter), chats, max_tokens, **serve)
    off_rate, on_rate = off_tokens / off_wall, on_tokens / on_wall
    acc = c.accepted_tokens / c.draft_tokens if c and c.draft_tokens else 0.0
    per_check = (c.accepted_tokens + c.drafts) / c.drafts if c and c.drafts else 0.0
    return Judgement(round(off_rate, 2), round(on_rate, 2), round(on_rate / off_rate, 3),
                     sum(a == b for a, b in zip(off_texts, on_texts)), len(chats), round(acc, 3), round(per_check, 2))


@dataclass
class DraftingBound:
    """What drafting can give this target on this machine, from its measured check costs: ``costs[n]`` a check of n
    positions over a decode step, the first-draft acceptance a drafter needs to pay at all (one draft, ``break_even``),
    and the most it gives one user at a few acceptance rates (``at``: rate -> speed-up), before the drafter's own cost."""

    costs: list[float]
    break_even: float
    at: dict[str, float]  # "0.5" -> speed-up

    def metrics(self) -> dict[str, float]:
        return {"draft_check2_cost": self.costs[2], "draft_break_even_acceptance": self.break_even,
                **{f"draft_bound_at_{round(100 * float(a))}": x for a, x in self.at.items()}}

    def line(self) -> str:
        at = " / ".join(f"{x:.2f}x" for x in self.at.values())
        rates = " / ".join(f"{float(a):.0%}" for a in self.at)
        return (f"a check of 2 positions costs {self.costs[2]:.2f} decode steps here, so a drafter pays once its first "
                f"draft stands in more than {self.break_even:.0%} of checks; at {rates} it gives one user at most {at}")


def drafting_bound(target: str | Path, rates: tuple[float, ...] = (0.5, 0.7), k_max: int = 4) -> DraftingBound:
    """Time checks of 1 .. k_max + 1 positions on the target's engine (serve/engine/drafter.py ``calibrate``, as the
    server does at start-up) and turn them into what a drafter of each acceptance rate can give at one user."""
    from serve.config import ServeConfig
    from serve.engine.engine import Engine

    from serve.engine.speculative import best_length, draft_rate

    eng = Engine(Path(target), ServeConfig(speculative="prompt_lookup", speculative_tokens=k_max, prefill_chunk=0,
                                           result_cache_size=0, enable_prefix_caching=False), start=False)
    try:
        costs = list(eng.drafter.costs or [])
    finally:
        eng.shutdown()
    if len(costs) < 3:
        raise RuntimeError(f"timing checks on {target} failed; see the log")
    at = {str(a): round(draft_rate(a, costs, best_length(a, costs, k_max)), 3) for a in rates}
    return DraftingBound([round(c, 3) for c in costs], round(max(0.0, costs[2] - 1.0), 3), at)
