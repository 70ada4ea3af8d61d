"""Roll the `champion` alias back (to the previous or a named version); servers follow the alias."""

from __future__ import annotations

from prefect import flow

from compress.registry import store as registry
from flows.outcome import flow_state


@flow(name="rollback")
def rollback_flow(model_name: str, to_version: str | int | None = None, alias: str = "champion",
                  tracking_uri: str | None = None):
    """Completed "RolledBack" returns {"from", "to"}; Failed "RegistryError" names what is missing."""
    return flow_state(lambda: rollback(model_name, to_version, alias, tracking_uri), "RolledBack",
                      lambda r: f"{model_name}@{alias}: {r['from']} -> {r['to']}")


def rollback(model_name: str, to_version: str | int | None, alias: str = "champion",
             tracking_uri: str | None = None) -> dict:
    registry.configure(tracking_uri)
    before = registry.version_for_alias(model_name, alias)
    to = registry.rollback(model_name, None if to_version is None else str(to_version), alias)
    return {"from": before.version if before else None, "to": to}
