"""The pruning sections: ``prune:`` (what is cut, how it is ranked and re-fit) and ``search:`` (one branch per MLP ratio)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from compress.evaluate.settings import check_chat_sets
from serve.config import Section


class PruneConfig(Section):
    # Run the prune stage on the fp32 model before distillation and quantization.
    enabled: bool = False
    # "both" = structured first, then unstructured on the smaller model (docs/pruning.md)
    method: Literal["structured", "unstructured", "both"] = "structured"
    # structured: fraction of MLP neurons / KV-head groups (a KV head with its query heads) / layers removed.
    # The same count in every layer (one intermediate_size and head count per config); heads round to whole
    # KV groups (SmolLM2 has 3: 0.25 and 0.34 both remove one) and kept neurons to a multiple of 8.
    mlp_ratio: float = Field(0.25, ge=0, lt=1)
    # structured: share of KV-head groups removed (see mlp_ratio).
    head_ratio: float = Field(0.0, ge=0, lt=1)
    # structured: share of decoder layers dropped, the least important by the sensitivity scan (see mlp_ratio).
    layer_ratio: float = Field(0.0, ge=0, lt=1)
    # structured: how neurons and heads are ranked; activation = calib activations with the weights, weight_norm =
    # weights alone (no forward pass).
    importance: Literal["activation", "weight_norm"] = "activation"
    # unstructured: share of decoder linear weights zeroed (2:4 needs 0.5)
    sparsity: float = Field(0.5, ge=0, lt=1)
    # unstructured: none = zeros anywhere; 2:4 = two of every four consecutive weights (needs sparsity 0.5).
    pattern: Literal["none", "2:4"] = "none"
    # unstructured: how the sparsity is spread; global = one threshold over all layers, per_layer = the same share in
    # each, sensitivity = less in the layers the scan ranks sensitive.
    allocation: Literal["global", "per_layer", "sensitivity"] = "per_layer"
    # magnitude = |w|; wanda = |w| * input feature norm on calib, per output row (much better on SmolLM2)
    unstructured_score: Literal["magnitude", "wanda"] = "magnitude"
    # Never dropped and never sparsified (their width still follows the global count); negative = from the end.
    protected_layers: list[int] = Field(default_factory=lambda: [0, -1])
    # Run the per-layer sensitivity scan (ranks layers to drop, drives allocation=sensitivity) on this many calib blocks.
    sensitivity: bool = True
    # Calib blocks the sensitivity scan reads.
    sensitivity_blocks: int = Field(8, ge=1)
    # After a structured cut, re-fit each cut layer's o_proj / down_proj by ridge least squares on the calib
    # blocks so its output stays the teacher's (compress/prune/reconstruct.py; one-shot figures in docs/pruning.md).
    reconstruct: bool = True
    # The ridge pulls each kept column toward its plainly cut weight, relative to that input's energy
    # (0 = plain least squares, which over-fits a few thousand calib tokens; large = no reconstruction).
    # 0.5: best or near-best held-out layer error on SmolLM2 with 16 and 64 calib blocks (docs/pruning.md).
    reconstruct_ridge: float = Field(0.5, ge=0)
    # teacher = fit on the teacher's activations (one pass; better on SmolLM2: 25 % cut 25.77 -> 23.17);
    # student = on the cut student's own activations layer by layer (tries to correct earlier layers' loss).
    reconstruct_inputs: Literal["teacher", "student"] = "teacher"


# search.mlp_ratios: auto. On SmolLM2-135M with 60 KD steps these span the range that matters: 0.1 close to
# lossless, 0.25 accepted on held-out text, 0.35 past what the steps recover (docs/scaling.md).
AUTO_MLP_RATIOS = (0.1, 0.25, 0.35)


class SearchConfig(Section):
    """A pruning search (flows/pipeline.py, docs/scaling.md): one branch per MLP ratio, prune -> distill -> INT8 ->
    gate on the selection split, run in parallel; the fastest accepted candidate goes on to the verdict."""

    # Empty = no search: the one candidate of `prune.mlp_ratio`. Each value replaces prune.mlp_ratio in its branch.
    # auto = AUTO_MLP_RATIOS, written out as the list when the config is read (what the run logs and hashes).
    mlp_ratios: list[float] = Field(default_factory=list)
    # threads = Prefect's ThreadPoolTaskRunner in the flow's process; dask = prefect-dask's DaskTaskRunner
    # (the `dask` extra): a LocalCluster started for the run, or the scheduler at dask_address.
    task_runner: Literal["threads", "dask"] = "threads"
    # e.g. tcp://10.0.0.5:8786; null = a LocalCluster of `workers` workers, started and closed by the flow.
    dask_address: str | None = None
    # Branches at once: threads of the pool, or workers of the LocalCluster (one thread each).
    workers: int = Field(2, ge=1, le=64)
    # LocalCluster only: a process per worker (isolation, no GIL sharing; each pays torch's import) or threads
    # of the flow's own process.
    dask_processes: bool = True
    # The share of each accuracy tolerance the selection gate keeps in reserve (tasks/search.py gate_config):
    # at 0.25 a 1.10 perplexity-ratio limit is 1.075 on the selection split, a 0.05 downstream drop 0.0375.
    # A branch chosen on the split it was gated on looks better there than on the verdict's text; a borderline
    # branch is then not the one sent on (docs/scaling.md).
    selection_margin: float = Field(0.0, ge=0, lt=1)
    # Chat sets the branches are also scored on, in the model's chat template, when it has one: the selection gate
    # then checks the chat limits there and the Pareto front is decode tokens/s against the chat perplexity ratio.
    # selection = compress/evaluate/chatsets/selection.jsonl (24 prompts the gate never reads). Never the gate's own
    # accept.chat_sets: a branch chosen on the prompts the verdict reads would be tuned on them. [] = no chat scoring.
    chat_sets: list[str] = Field(default_factory=lambda: ["selection"])

    @field_validator("chat_sets")
    @classmethod
    def _chat_sets_exist(cls, v: list[str]) -> list[str]:
        return check_chat_sets(v)

    @field_validator("mlp_ratios", mode="before")
    @classmethod
    def _auto_ratios(cls, v):
        if isinstance(v, str):
            if v.strip().lower() != "auto":
                raise ValueError(f"search.mlp_ratios {v!r}: give a list of ratios, e.g. [0.1, 0.25], or auto")
            return list(AUTO_MLP_RATIOS)
        return v

    @model_validator(mode="after")
    def _ratios_and_runner(self) -> "SearchConfig":
        bad = [r for r in self.mlp_ratios if not 0 <= r < 1]
        if bad:
            raise ValueError(f"search.mlp_ratios {bad}: each ratio is the share of MLP neurons removed, 0 <= r < 1")
        if len(set(self.mlp_ratios)) != len(self.mlp_ratios):
            raise ValueError(f"search.mlp_ratios {self.mlp_ratios} repeats a ratio; list each once")
        if self.dask_address is not None and self.task_runner != "dask":
            raise ValueError(f"search.dask_address {self.dask_address!r} is set but search.task_runner is "
                             f"{self.task_runner!r}; set search.task_runner: dask, or drop the address")
        return self
