"""Process-wide defaults set before Prefect is imported (a 2-core box needs a longer ephemeral start-up)."""

import os

DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "TOKENIZERS_PARALLELISM": "false",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
}


def apply() -> None:
    for k, v in DEFAULTS.items():
        os.environ.setdefault(k, v)
