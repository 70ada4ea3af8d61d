"""The pruning search's choice: candidates' measured figures -> Pareto front, the pick, the table and the plot.

Plain functions of numbers (no Prefect, no MLflow): flows/pipeline.py fans the branches out and hands their
figures here. A candidate is better when it is smaller, faster (decode ms/token) and closer to the teacher
(perplexity ratio on the selection split); the front is the set no other candidate beats on all three (when the
branches were scored on a chat set, search.chat_sets: faster and closer on chat, CHAT_OBJECTIVES). The
pick is the fastest candidate the gate accepted (ties: the smaller), whatever the front: speed is what the
search is for and the gate already said the quality is enough.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# (figure, direction) of the front: every one of them is "lower is better".
OBJECTIVES: tuple[tuple[str, str], ...] = (("size_bytes", "min"), ("ms_per_token", "min"),
                                           ("perplexity_ratio", "min"))
# Where the branches were scored on a chat set (search.chat_sets): decode speed against the chat perplexity ratio,
# the trade a chat model is deployed on.
CHAT_OBJECTIVES: tuple[tuple[str, str], ...] = (("ms_per_token", "min"), ("chat_perplexity_ratio", "min"))


@dataclass
class Candidate:
    """One branch of the search, as measured: its ratio, size, decode speed and quality against the teacher."""

    ratio: float
    size_bytes: float
    ms_per_token: float  # batch-1 decode step, milliseconds
    perplexity_ratio: float  # candidate / teacher perplexity on the selection split
    accepted: bool  # the gate's word on the selection split
    top1_agreement: float = math.nan
    reasons: list[str] = field(default_factory=list)
    artifact: str | None = None
    error: str | None = None  # the branch failed; its figures are NaN
    chat_perplexity_ratio: float = math.nan  # on search.chat_sets, against the teacher (NaN: not scored)

    @property
    def name(self) -> str:
        return f"mlp{self.ratio:g}"

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 / self.ms_per_token if self.ms_per_token > 0 else math.nan

    def measured(self) -> bool:
        return self.error is None and all(math.isfinite(getattr(self, k)) for k, _ in OBJECTIVES)


def _dominates(a: Candidate, b: Candidate, objectives) -> bool:
    """a is no worse than b on every objective and better on one."""
    better = False
    for key, direction in objectives:
        va, vb = getattr(a, key), getattr(b, key)
        if direction == "max":
            va, vb = -va, -vb
        if va > vb:
            return False
        better = better or va < vb
    return better


def front_objectives(cands: list[Candidate]) -> tuple[tuple[str, str], ...]:
    """CHAT_OBJECTIVES when every measured candidate has a chat figure, else OBJECTIVES."""
    pool = [c for c in cands if c.measured()]
    return CHAT_OBJECTIVES if pool and all(math.isfinite(c.chat_perplexity_ratio) for c in pool) else OBJECTIVES


def pareto_front(cands: list[Candidate], objectives=OBJECTIVES) -> list[Candidate]:
    """The measured candidates no other measured candidate dominates, in the input order.

    objectives: (attribute, "min" | "max") pairs; by default size, ms/token and perplexity ratio, all minimised.
    """
    for key, direction in objectives:
        if direction not in ("min", "max"):
            raise ValueError(f"pareto_front: objective {key!r} has direction {direction!r}; use 'min' or 'max'")
    pool = [c for c in cands if c.measured()]
    return [c for c in pool if not any(_dominates(o, c, objectives) for o in pool if o is not c)]


def pick_fastest_accepted(cands: list[Candidate]) -> Candidate | None:
    """The accepted candidate with the fewest ms/token (then the smallest); None when the gate accepted none."""
    ok = [c for c in cands if c.accepted and c.measured()]
    return min(ok, key=lambda c: (c.ms_per_token, c.size_bytes, c.ratio)) if ok else None


def best_rejected(cands: list[Candidate]) -> Candidate | None:
    """The candidate closest to passing when none passed: the lowest perplexity ratio (then the fastest)."""
    pool = [c for c in cands if c.measured()]
    return min(pool, key=lambda c: (c.perplexity_ratio, c.ms_per_token)) if pool else None


def describe(c: Candidate) -> str:
    """One line of a candidate's figures, for logs and the rejected run's message."""
    if c.error:
        return f"{c.name}: failed ({c.error})"
    return (f"{c.name}: {c.size_bytes / 2**20:.1f} MiB, {c.ms_per_token:.2f} ms/token ({c.tokens_per_s:.1f} tokens/s), "
            f"perplexity {c.perplexity_ratio:.4f}x, top-1 agreement {c.top1_agreement:.4f}, "
            f"{'accepted' if c.accepted else 'rejected'}" + (f" ({'; '.join(c.reasons)})" if c.reasons else ""))


def search_table(cands: list[Candidate], front: list[Candidate] | None = None,
                 picked: Candidate | None = None) -> list[dict]:
    """One row per candidate (the MLflow table and search.json): ratio, size, speed, quality, accepted, front, pick."""
    front = pareto_front(cands, front_objectives(cands)) if front is None else front
    rows = []
    for c in sorted(cands, key=lambda c: c.ratio):
        rows.append({"candidate": c.name, "mlp_ratio": c.ratio, "size_mb": c.size_bytes / 2**20,
                     "size_bytes": c.size_bytes, "ms_per_token": c.ms_per_token, "tokens_per_s": c.tokens_per_s,
                     "perplexity_ratio": c.perplexity_ratio, "top1_agreement": c.top1_agreement,
                     "chat_perplexity_ratio": c.chat_perplexity_ratio,
                     "accepted": bool(c.accepted), "on_front": any(c is f for f in front),
                     "picked": picked is c, "reasons": "; ".join(c.reasons), "error": c.error or "",
                     "artifact": c.artifact or ""})
    return rows


def pareto_figure(cands: list[Candidate], picked: Candidate | None = None, title: str = "pruning search"):
    """Size and decode speed against quality (perplexity ratio), one point per candidate.

    Each panel marks its own two-figure front (the step line): the candidates no other beats on that panel's
    size-or-speed and quality. Filled = accepted, hollow = rejected, the pick is ringed.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    pool = [c for c in cands if c.measured()]
    chat = front_objectives(cands) == CHAT_OBJECTIVES
    fig, axes = plt.subplots(1, 3 if chat else 2, figsize=(15 if chat else 10, 4.2))
    ppl = ("perplexity_ratio", "perplexity ratio to the teacher (selection split; lower is better)")
    panels = [(axes[0], "size_bytes", lambda c: c.size_bytes / 2**20, "size (MiB)", ppl),
              (axes[1], "ms_per_token", lambda c: c.tokens_per_s, "decode tokens/s (batch 1)", ppl)]
    if chat:
        panels.append((axes[2], "ms_per_token", lambda c: c.tokens_per_s, "decode tokens/s (batch 1)",
                       ("chat_perplexity_ratio", "chat perplexity ratio to the teacher (search.chat_sets)")))
    for ax, key, y, label, (xkey, xlabel) in panels:
        x = lambda c, xkey=xkey: getattr(c, xkey)  # noqa: E731
        front = sorted(pareto_front(pool, ((key, "min"), (xkey, "min"))), key=x)
        if front:
            ax.step([x(c) for c in front], [y(c) for c in front], where="post", color="tab:orange", lw=1.5,
                    label="Pareto front")
        for c in pool:
            ax.scatter([x(c)], [y(c)], s=60, color="tab:blue" if c.accepted else "white", edgecolors="tab:blue",
                       zorder=3)
            ax.annotate(c.name, (x(c), y(c)), textcoords="offset points", xytext=(5, 4), fontsize=8)
        if picked is not None and picked.measured():
            ax.scatter([x(picked)], [y(picked)], s=220, facecolors="none", edgecolors="tab:red",
                       lw=2, zorder=4, label=f"picked ({picked.name})")
        ax.scatter([], [], s=60, color="tab:blue", label="accepted")
        ax.scatter([], [], s=60, color="white", edgecolors="tab:blue", label="rejected")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if chat:
        axes[2].set_title("speed vs chat (upper-left is better)", fontsize=10)
    axes[0].set_title("size vs quality (lower-left is better)", fontsize=10)
    axes[1].set_title("speed vs quality (upper-left is better)", fontsize=10)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
