"""What a distillation run hands back: a DistillReport (figures, per-step history, the curves' plot) or a DistillError.

The Prefect task logs the report and the torchrun launcher reads it back from a rank's report.json;
neither needs the training loop's internals for that.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


class DistillError(ValueError):
    """A distillation set-up that cannot run, phrased for the user."""


@dataclass
class DistillReport:
    steps: int  # optimizer steps done (all attempts together)
    seconds: float  # wall time of the stage over all attempts, evals and checkpoints included
    train_seconds: float  # time in optimizer steps alone
    best_step: int  # 0 = the untrained student stayed best
    teacher_perplexity: float
    perplexity_before: float
    perplexity_after: float  # of the best checkpoint, which the student holds on return
    kl_before: float
    kl_after: float
    top1_before: float
    top1_after: float
    stop_reason: str  # steps | time | early_stop
    resumed_from: int  # step the last call started from (0 = fresh)
    device: str
    world_size: int = 1  # processes (torchrun ranks) that trained together in the last call
    history: list[dict] = field(default_factory=list)  # per step: step, T, alpha, kd_loss, ce_loss, hidden_loss, loss, lr
    evals: list[dict] = field(default_factory=list)  # per eval: step, perplexity, kl, top1_agreement
    plan: dict = field(default_factory=dict)  # a token budget's plan: Plan.to_dict() (estimate_seconds, tokens/s, ...)

    @property
    def seconds_per_step(self) -> float:
        return self.train_seconds / max(self.steps, 1)

    def metrics(self) -> dict[str, float]:
        """Flat numeric summary, for MLflow."""
        return {
            "distill_steps": self.steps,
            "distill_seconds": round(self.seconds, 3),
            "distill_seconds_per_step": round(self.seconds_per_step, 4),
            "distill_best_step": self.best_step,
            "distill_teacher_perplexity": self.teacher_perplexity,
            "distill_perplexity_before": self.perplexity_before,
            "distill_perplexity_after": self.perplexity_after,
            "distill_kl_before": self.kl_before,
            "distill_kl_after": self.kl_after,
            "distill_top1_before": self.top1_before,
            "distill_top1_after": self.top1_after,
            "distill_early_stopped": float(self.stop_reason == "early_stop"),
            "distill_resumed_from": self.resumed_from,
            "distill_world_size": self.world_size,
            **({"distill_planned_seconds": self.plan["estimate_seconds"],
                "distill_planned_tokens_per_second": self.plan["tokens_per_second"]} if self.plan else {}),
        }

    def figure(self):
        """Loss curves, the T and alpha schedules and the eval curves, as a matplotlib Figure."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(13, 3.8), layout="constrained")
        ax_loss, ax_sched, ax_eval = fig.subplots(1, 3)
        steps = [h["step"] for h in self.history]
        ax_loss.plot(steps, [h["kd_loss"] for h in self.history], label="KD (T²·KL)", lw=1)
        ax_loss.plot(steps, [h["ce_loss"] for h in self.history], label="CE", lw=1)
        if any(h.get("hidden_loss") for h in self.history):
            ax_loss.plot(steps, [h.get("hidden_loss", 0.0) for h in self.history], label="hidden states", lw=1)
        ax_loss.plot(steps, [h["loss"] for h in self.history], "k--", label="loss (α-weighted)", lw=1)
        ax_loss.set(title="training loss", xlabel="step")
        ax_loss.legend()
        ax_sched.plot(steps, [h["T"] for h in self.history], label="T", color="tab:red")
        ax_sched.set(title="schedules", xlabel="step", ylabel="temperature T")
        ax_alpha = ax_sched.twinx()
        ax_alpha.plot(steps, [h["alpha"] for h in self.history], label="α", color="tab:purple", ls="--")
        ax_alpha.set(ylabel="α", ylim=(0, 1.05))
        _legend(ax_sched, ax_alpha, "lower left")
        e_steps = [e["step"] for e in self.evals]
        ax_eval.plot(e_steps, [e["perplexity"] for e in self.evals], "o-", label="student ppl", color="tab:blue")
        ax_eval.axhline(self.teacher_perplexity, color="tab:blue", ls=":", label="teacher ppl")
        ax_eval.set(title="eval", xlabel="step", ylabel="perplexity")
        ax_kl = ax_eval.twinx()
        ax_kl.plot(e_steps, [e["kl"] for e in self.evals], "s-", color="tab:orange", label="KL to teacher")
        ax_kl.set(ylabel="KL (T=1)")
        _legend(ax_eval, ax_kl)
        return fig

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DistillReport":
        return cls(**d)


def _legend(ax, twin, loc: str = "upper right") -> None:
    """One legend for an axis and its twinx."""
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc=loc)
