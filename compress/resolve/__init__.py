"""The run's config with every `auto` made concrete in one step, after the load stage (docs/architecture.md).

Entry points (lazy): ``resolve_config(cfg, *, params, model_dir, exporter_auto) -> ResolvedConfig`` and ``Setting``
(auto.py). It reads the rules where the stages keep them (export, evaluate, distill), so it sits above them.
"""

from compress._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "auto": ["ResolvedConfig", "Setting", "resolve_config"],
})
