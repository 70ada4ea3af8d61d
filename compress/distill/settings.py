"""The distill section (``distill:``): budget, schedules, data and where it trains."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from serve.config import Section


class DistillConfig(Section):
    """Knowledge distillation of the pruned student (compress/distill/train.py; formulas in docs/distillation.md).

    Schedules take the 0-based optimizer step i of `steps` total: constant | linear | cosine | step
    (a staircase held `t_step_every` steps). `steps` and `max_minutes` are both budgets: whichever
    ends first stops the run; the schedules always span `steps`.
    """

    # Run the distill stage: the pruned student learns from the original model (the teacher).
    enabled: bool = False
    # Optimizer steps; the schedules span them. Ignored when `tokens` is set.
    steps: int = Field(200, ge=1)
    # The budget in training tokens (null = `steps`): steps = tokens / (batch_size x grad_accum x positions per block),
    # rounded up. Before training the stage times a few steps and refuses, with its figures, a budget that cannot
    # finish within max_minutes.
    tokens: int | None = Field(None, ge=1)
    # Wall-clock budget over all attempts of the stage (a resumed run counts the time already spent).
    max_minutes: float = Field(30.0, gt=0)
    # Blocks per micro-batch.
    batch_size: int = Field(4, ge=1)
    # Micro-batches per optimizer step (the global batch is batch_size x grad_accum blocks).
    grad_accum: int = Field(1, ge=1)
    # Peak learning rate (AdamW).
    lr: float = Field(1e-4, gt=0)
    # Learning rate: linear warm-up over warmup_steps, then constant or decaying to lr * lr_end_ratio.
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    # lr_schedule linear or cosine: the last step's learning rate as a share of lr.
    lr_end_ratio: float = Field(0.1, ge=0, le=1)
    # Warm-up matters: Adam's first steps are large and a pretrained student loses ground on them.
    warmup_steps: int = Field(5, ge=0)
    # AdamW weight decay.
    weight_decay: float = Field(0.0, ge=0)
    # Gradient-norm clipping; 0 turns it off.
    max_grad_norm: float = Field(1.0, ge=0)
    # Distillation temperature at the first step.
    t_start: float = Field(4.0, gt=0)
    # Distillation temperature at the last step.
    t_end: float = Field(1.0, gt=0)
    # How the temperature goes from t_start to t_end (schedules: see above).
    t_schedule: Literal["constant", "linear", "cosine", "step"] = "cosine"
    # t_schedule step: steps each temperature is held.
    t_step_every: int = Field(50, ge=1)
    # alpha = 1: the student imitates the teacher alone. A CE share pulls it toward the data instead:
    # on SmolLM2, alpha 0.9 -> 0.5 took eval perplexity below the teacher's while KL to it rose
    # (docs/distillation.md).
    alpha_start: float = Field(1.0, ge=0, le=1)
    # alpha at the last step (alpha_start at the first).
    alpha_end: float = Field(1.0, ge=0, le=1)
    # How alpha goes from alpha_start to alpha_end.
    alpha_schedule: Literal["constant", "linear", "cosine", "step"] = "constant"
    # What the student trains on (compress/distill/data.py): the corpus's train split, the teacher's own
    # samples (generated_blocks of them, from a random first token at generation_temperature), or both.
    # The corpus alone teaches the corpus: held-out text of another genre recovers far less (docs/distillation.md).
    # chat: the teacher's own conversations in its chat template (generated_blocks of them), the distribution a
    # chat model is used on (what accept's chat set scores).
    # chat_mix: those conversations and the corpus's train blocks together (keeps the corpus's genres while learning chat).
    data: Literal["corpus", "generated", "mix", "chat", "chat_mix"] = "corpus"
    # data generated, mix or chat: how many samples (or conversations) the teacher writes.
    generated_blocks: int = Field(256, ge=1)
    # data generated or mix: the temperature the teacher samples at.
    generation_temperature: float = Field(1.0, gt=0)
    # Teacher logits kept as the top-k per position and reused on later epochs; 0 = full logits, no cache.
    teacher_topk: int = Field(0, ge=0)
    # Intermediate-state loss beside the logit KD (Minitron): weight of the mean, over the student's layers, of the
    # per-token ||h_s - h_t||^2 / ||h_t||^2 between each layer's output and the teacher layer it was cut from.
    # 0 = logits only. The teacher then runs every step (no top-k cache). docs/distillation.md.
    hidden_weight: float = Field(0.0, ge=0)
    # Steps between evaluations on the selection split (best checkpoint, early stopping).
    eval_every: int = Field(25, ge=1)
    # The eval metric that picks the best checkpoint and drives early stopping: KL to the teacher
    # (fidelity); perplexity rewards fitting the eval text, which can mean leaving the teacher.
    monitor: Literal["perplexity", "kl"] = "kl"
    # Evals in a row without improvement before stopping; 0 = never stop early.
    early_stop_patience: int = Field(4, ge=0)
    # Steps between checkpoints; a killed run resumes from the last one.
    checkpoint_every: int = Field(25, ge=1)
    # auto = CUDA when torch sees a GPU, else the CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Processes that train together through torchrun (DDP, one per GPU; gloo on CPU); 1 = in the flow's
    # own process. batch_size x grad_accum stays the global batch per step, split evenly over them, so the
    # result does not depend on the count and a checkpoint resumes on any count (docs/scaling.md).
    nproc_per_node: int = Field(1, ge=1)
    # Mixed precision (fp32 master weights): auto = bf16 on a GPU with bf16 (else fp16 with loss scaling) and on a
    # CPU with AVX-512 BF16 or AMX (detected; about 2x a fp32 step there), fp32 on other CPUs; off = fp32.
    amp: Literal["auto", "bf16", "fp16", "off"] = "auto"
    # The KD loss fused with the LM head, chunk by chunk: no full-vocabulary logits held for the backward
    # (compress/distill/fused.py). Families whose logits are not head(hidden) fall back to the plain loss.
    fused_loss: bool = True
    # torch.compile the student's and the teacher's bodies and the fused loss's per-chunk math (one pass over the
    # vocabulary): 1.4-1.5x a bf16 step on 2 cores, after a one-off compile of ~100 s (cached by inductor for the next
    # run). auto = on for single-process CPU runs of 200k tokens or more where a C++ compiler is installed.
    compile: Literal["auto", "on", "off"] = "auto"
    # Seed of the student's training (torch and the data order).
    seed: int = 0

    @model_validator(mode="after")
    def _hidden_states_need_the_teacher(self) -> "DistillConfig":
        if self.hidden_weight > 0 and self.teacher_topk > 0:
            raise ValueError(
                f"hidden_weight {self.hidden_weight} compares hidden states with the teacher's, which the top-k cache "
                f"does not keep (teacher_topk = {self.teacher_topk}); set teacher_topk: 0 or hidden_weight: 0")
        return self

    @model_validator(mode="after")
    def _global_batch_splits_over_processes(self) -> "DistillConfig":
        if (self.batch_size * self.grad_accum) % self.nproc_per_node:
            raise ValueError(
                f"batch_size x grad_accum = {self.batch_size * self.grad_accum} blocks per step cannot be split "
                f"evenly over nproc_per_node = {self.nproc_per_node} processes; make it a multiple of "
                f"{self.nproc_per_node}")
        return self
