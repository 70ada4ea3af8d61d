"""Roll the `champion` alias back (to the previous or a named version); servers follow the alias."""

from __future__ import annotations

from prefect import flow, get_run_logger

from compress import registry


@flow(name="rollback")
def rollback_flow(model_name: str, to_version: str | None = None, alias: str = "champion",
                  tracking_uri: str | None = None) -> str:
    log = get_run_logger()
    registry.configure(tracking_uri)
    before = registry.version_for_alias(model_name, alias)
    to = registry.rollback(model_name, to_version, alias)
    log.info("%s@%s: %s -> %s", model_name, alias, before.version if before else None, to)
    return to
