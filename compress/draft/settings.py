"""The draft stage's settings (``draft:`` in a pipeline config): what the drafter learns from and how it is judged."""

from __future__ import annotations

from pydantic import Field

from serve.config import Section


class DraftConfig(Section):
    """The champion's drafter (compress/draft/, docs/speculative.md): a draft head on the target's hidden state,
    distilled on the target's own answers, judged on the server one user at a time."""

    # Build a drafter for the accepted model: the compress flow's draft stage after registering it (the draft flow
    # builds one on demand whatever this says).
    enabled: bool = False
    # The draft stage builds a drafter only for a target of at least this many parameters; below, it measures what
    # drafting could give and says so in the run summary (docs/drafter.md: on SmolLM2-135M a head took 743 s and gave
    # 1.01x on chat).
    min_params: int = Field(500_000_000, ge=0)
    # Prompts the target answers to make the drafter's data (its own user turns, documentation questions, code
    # edits of standard-library functions; never the serving benchmark's prompts).
    prompts: int = Field(320, ge=8)
    # Share of those prompts that are user turns the target writes itself.
    own_turns: float = Field(0.3, ge=0, le=1)
    # Longest answer, in tokens.
    max_tokens: int = Field(192, ge=8)
    # Concurrent requests while the target answers.
    users: int = Field(12, ge=1)
    # The drafter's vocabulary: the target's most frequent answer tokens (it never drafts the others).
    vocab: int = Field(8192, ge=16)
    # Width of the head's MLP.
    width: int = Field(2048, ge=16)
    # Tokens drafted per check (the head is unrolled this many steps; serve.speculative_tokens caps it).
    steps: int = Field(4, ge=1, le=16)
    # Distillation budget: answer positions drawn (with replacement) over the whole run, planned before step 1.
    tokens: int = Field(400_000, ge=256)
    # Answer positions per optimizer step.
    batch_size: int = Field(256, ge=1)
    # Peak learning rate (AdamW, cosine to 0).
    lr: float = Field(1e-3, gt=0)
    # The KD temperature, linear from t_start to t_end over the run.
    t_start: float = Field(2.0, gt=0)
    # The temperature at the last step.
    t_end: float = Field(1.0, gt=0)
    # Weight of the hidden-state match (smooth L1) beside the KL term.
    feature_weight: float = Field(0.1, ge=0)
    # Share of the conversations held out to measure acceptance.
    held_out: float = Field(0.1, gt=0, lt=1)
    # Seeds the held-out split, the prompts' order and the head's initial weights.
    seed: int = 0
    # Register the drafter only when the served target at one user is at least this much faster with it (chat).
    min_speedup: float = Field(1.2, gt=0)
