"""Prefect flows (the DAGs) and the `compressor` command line."""

from flows import env as _env

_env.apply()
