"""The pipeline's typed configuration, read from YAML with CLI overrides: PipelineConfig composes the sections that
each stage owns in its room (compress/<stage>/settings.py) with the server's (serve/config.py).

Every section is a pydantic model that forbids unknown keys, so a typo is an error naming the key instead of a
silently ignored setting. Checks across sections (a stage that needs another) live here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import Field, ValidationError, model_validator

# Each stage's section lives in its own room (compress/<stage>/settings.py); this module only composes them.
from compress.corpus.settings import DataConfig
from compress.distill.settings import DistillConfig
from compress.draft.settings import DraftConfig
from compress.evaluate.settings import AcceptConfig, BenchmarkConfig, GoldenConfig
from compress.export.settings import ExportConfig
from compress.loading.settings import ModelConfig
from compress.prune.settings import AUTO_MLP_RATIOS, PruneConfig, SearchConfig
from compress.quantize.settings import QuantizeConfig
from compress.registry.settings import RegistryConfig
# The serve and mlflow sections belong to the server (serve/ imports nothing from compress/); the
# pipeline's config embeds them and shares the loader's helpers, so both report errors alike.
from serve.config import (ConfigError, MlflowConfig, Section, ServeConfig, apply_overrides, format_errors,
                          project_root, read_yaml)

__all__ = ["ConfigError", "MlflowConfig", "ServeConfig", "PipelineConfig", "load_config", "apply_overrides",
           "project_root", "ModelConfig", "DataConfig", "ExportConfig", "GoldenConfig", "PruneConfig", "DistillConfig",
           "QuantizeConfig", "AcceptConfig", "BenchmarkConfig", "RegistryConfig", "SearchConfig", "DraftConfig",
           "AUTO_MLP_RATIOS"]


class PipelineConfig(Section):
    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data):
        if isinstance(data, dict) and "seed" in data:
            raise ValueError("seed (top level) was removed: it was read by nothing. The seeds that act are data.seed "
                             "(the splits), distill.seed (training) and benchmark.seed (the workload); set those")
        return data

    # The run's name: the MLflow run is named <name>-<UTC time> and tagged pipeline=<name>.
    name: str = "default"
    # Where stage outputs are cached (<workdir>/<stage>/<key>/, reused when the key matches); relative to the project
    # root.
    workdir: str = "artifacts"
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    golden: GoldenConfig = Field(default_factory=GoldenConfig)
    prune: PruneConfig = Field(default_factory=PruneConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    quantize: QuantizeConfig = Field(default_factory=QuantizeConfig)
    accept: AcceptConfig = Field(default_factory=AcceptConfig)
    benchmark: BenchmarkConfig = Field(default_factory=BenchmarkConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    search: SearchConfig = Field(default_factory=SearchConfig)
    draft: DraftConfig = Field(default_factory=DraftConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @model_validator(mode="after")
    def _int8_export_is_the_candidate(self) -> "PipelineConfig":
        if self.export.weights != "int8":
            return self
        if self.prune.enabled or self.distill.enabled:
            raise ValueError("export.weights int8 writes the INT8 candidate at export, with no fp32 graph, and "
                             "pruning and distillation start from the fp32 model: set prune.enabled and "
                             "distill.enabled to false, or export.weights to float32 (or auto) to run them")
        if self.quantize.enabled and self.quantize.target == "cuda":
            raise ValueError("quantize.target cuda builds the fp16 CUDA form from the fp32 graph, which export.weights "
                             "int8 never writes; set export.weights to float32 (or auto)")
        if self.quantize.enabled and self.quantize.method in ("static", "dynamic"):
            raise ValueError(f"quantize.method {self.quantize.method} (W8A8) calibrates the fp32 graph, which "
                             f"export.weights int8 never writes; set quantize.method to weight_only or auto, or "
                             f"export.weights to float32")
        if self.accept.reference == "artifact":
            raise ValueError("accept.reference artifact judges against the fp32 graph, which export.weights int8 never "
                             "writes; set accept.reference to auto or checkpoint, or export.weights to float32")
        return self

    @model_validator(mode="after")
    def _search_needs_its_stages(self) -> "PipelineConfig":
        if not self.search.mlp_ratios:
            return self
        if not self.prune.enabled or self.prune.method == "unstructured":
            raise ValueError(f"search.mlp_ratios {self.search.mlp_ratios} searches structured MLP pruning: set "
                             f"prune.enabled: true and prune.method: structured (or both), or search.mlp_ratios: []")
        if not self.accept.enabled:
            raise ValueError("search.mlp_ratios needs accept.enabled: true: the search keeps the fastest candidate "
                             "the gate accepts")
        shared = sorted(set(self.search.chat_sets) & set(self.accept.chat_sets))
        if shared:
            raise ValueError(f"search.chat_sets {shared} are also accept.chat_sets: a branch picked on the prompts the "
                             f"verdict reads is tuned on them; use 'selection' or another file for the search")
        return self

    def section_hash(self, *sections: str) -> str:
        """Stable hash of the named sections (all when none): the cache key part a stage depends on."""
        dump = self.model_dump(mode="json")
        # Where the search runs (threads, Dask) changes no result, and a config without a search hashes as it
        # did before the section existed: only the ratios searched count.
        if dump["export"]["exporter"] == "gqa":  # the gqa builder writes its own opset: changing it changes nothing
            del dump["export"]["opset"]
        search = dump.pop("search")
        if search["mlp_ratios"]:
            dump["search"] = {"mlp_ratios": search["mlp_ratios"], "chat_sets": search["chat_sets"]}
        if not sections:  # the drafter a version gets (the draft stage, after it is registered) is not the version
            dump.pop("draft")
        picked = {s: dump[s] for s in sections} if sections else dump
        return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a YAML config (or the defaults), apply KEY=VALUE overrides and validate."""
    data, origin = read_yaml(path)
    data = apply_overrides(data, overrides or [])
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_errors(e, origin)) from None

