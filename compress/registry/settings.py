"""The registry section (``registry:``): the model's name, what is registered and promoted."""

from __future__ import annotations

from typing import Literal

from serve.config import Section


class RegistryConfig(Section):
    # Registered model name in MLflow; the server follows models:/<model_name>@champion.
    model_name: str = "smollm2-135m"
    # Register the uncompressed export as a version too (the baseline candidates are compared with).
    register_baseline: bool = True
    # The baseline version's weights: copy = the fp32 graph's files uploaded (servable from the registry); digest =
    # only its manifest, tokenizer and a record of the weights (their sha256 and the source checkpoint's path and
    # sha256), not a second fp32 copy in the store; auto = digest when the graph's weights exceed 2 GiB (a 1B+).
    baseline_weights: Literal["auto", "copy", "digest"] = "auto"
    # Accepted candidates become `champion` (via the deploy flow) when true.
    promote: bool = False
    # An accepted candidate that is worse than the current champion on the chat set (its chat perplexity ratio
    # above the champion's) does not take `champion` unless this is true; the run says which is better on what.
    promote_when_worse: bool = False
    # Live server to smoke-test after promotion. None = the `serve` section's host:port when a server
    # there serves this model, else promote without a smoke test (said in the run's final state).
    server_url: str | None = None
