"""The runner for an artifact's attention layout, built the same way for the served model and for a draft model."""

from __future__ import annotations

from pathlib import Path

from serve.config import ServeConfig
from serve.engine.thread_priority import call_in_lowered_thread
from serve.runners.protocol import ModelRunner


def make_runner(artifact_dir: str | Path, manifest: dict, config: ServeConfig, num_blocks: int,
                row_tokens: int | None, max_model_len: int, hidden_states: bool = False) -> ModelRunner:
    """A ``gqa`` runner (in-place GroupQueryAttention rows, docs/gqa.md) or the ``standard`` one, its ONNX Runtime
    threads started at the model threads' lowered priority. ``hidden_states``: the gqa runner also returns the last
    hidden state (for a draft head); the standard layout has no such output."""
    bs = config.kv_block_size
    common = dict(providers=config.providers, intra_op_threads=config.intra_op_threads,
                  ort_spinning=config.ort_spinning)
    if manifest.get("attention_layout", "standard") == "gqa":
        from serve.runners.gqa import GqaRunner  # in-place GroupQueryAttention rows, host or GPU memory

        prompt = None
        if config.prompt_form != "off":
            from serve.config import ConfigError
            from serve.runners.prompt_form import prompt_graph

            try:
                prompt = prompt_graph(artifact_dir, manifest)
            except ValueError as e:
                raise ConfigError(str(e)) from None

        def make():
            return GqaRunner(artifact_dir, manifest, num_blocks, bs, max_batch_size=config.max_batch_size,
                             max_model_len=max_model_len, row_tokens=row_tokens,
                             decode_split_rows=config.decode_split_rows, kv_store_setting=config.kv_store,
                             uniform_kernels=config.uniform_kernels, hidden_states=hidden_states,
                             prompt_graph=prompt, **common)
    else:
        if config.prompt_form != "off":
            from serve.config import ConfigError

            raise ConfigError("serve.prompt_form: a prompt form shares the K/V rows of a 'gqa' artifact; this "
                              "artifact's attention layout is 'standard' (set serve.prompt_form: off)")
        if hidden_states:
            from serve.config import ConfigError

            raise ConfigError("serve.speculative: a draft head reads the hidden state that only 'gqa' artifacts "
                              "output; this artifact's attention layout is 'standard' (export it with the gqa "
                              "layout, or use prompt_lookup or a draft model)")
        from serve.runners.standard import Runner

        def make():
            return Runner(artifact_dir, manifest, num_blocks, bs, row_tokens=row_tokens, **common)
    # onnxruntime's intra-op threads, started in the session's constructor, inherit the lowered priority.
    return call_in_lowered_thread(make, config.model_thread_nice)
