"""Promote an accepted version to `champion`, smoke-test the live server, move the alias back on failure.

The server follows the registry alias (it polls it), so promotion is the deploy;
the smoke test waits until the server reports the new version, then sends the
golden prompts through the OpenAI-compatible API. A server that does not answer, does
not pick the version up, or fails a prompt fails the deploy: the alias moves back to
where it was and the run ends Failed "Reverted" (flows/outcome.py).
"""

from __future__ import annotations

import time

import httpx
from prefect import flow, get_run_logger

from compress.registry import store as registry
from compress.config import GoldenConfig
from flows.outcome import flow_state


class SmokeTestFailed(RuntimeError):
    pass


def served_model(server_url: str, model_name: str, timeout: float = 5) -> tuple[str | None, str | None]:
    """(version, artifact digest) the server reports for `model_name` on /v1/models; (None, None) if it serves none."""
    r = httpx.get(f"{server_url.rstrip('/')}/v1/models", timeout=timeout)
    r.raise_for_status()
    for m in r.json().get("data", []):
        if m.get("id") == model_name:
            return (str(m["version"]) if m.get("version") is not None else None), m.get("artifact_sha256")
    return None, None


def served_version(server_url: str, model_name: str, timeout: float = 5) -> str | None:
    return served_model(server_url, model_name, timeout)[0]


def wait_for_version(server_url: str, model_name: str, version: str, timeout_s: float,
                     unreachable_s: float = 15.0, artifact_sha256: str | None = None) -> None:
    """Until the server reports `version`; a server that never answers fails after `unreachable_s`.

    `artifact_sha256`: the version's digest in this registry. A server that reports the version number
    with other files follows another MLflow store, and smoke-testing it would prove nothing.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    last, answered = None, False
    while time.monotonic() < deadline:
        try:
            last, digest = served_model(server_url, model_name)
            answered = True
            if last == str(version):
                if artifact_sha256 and digest and digest != artifact_sha256:
                    raise SmokeTestFailed(
                        f"server {server_url} serves version {version} of {model_name} with other files (manifest "
                        f"sha256 {digest[:12]}..., this registry's is {artifact_sha256[:12]}...): it follows another "
                        f"MLflow store; point it at this one (MLFLOW_TRACKING_URI) or smoke-test another server")
                return
        except httpx.HTTPError as e:
            last = f"unreachable ({type(e).__name__})"
            if not answered and time.monotonic() - start > unreachable_s:
                raise SmokeTestFailed(
                    f"no server answers at {server_url} ({type(e).__name__}); start one that follows the alias "
                    f"(compressor serve --model models:/{model_name}@champion) or pass -p server_url=null to "
                    f"promote without a smoke test") from None
        time.sleep(0.5)
    raise SmokeTestFailed(f"server {server_url} still serves version {last} of {model_name} after {timeout_s:.0f} s, not {version}")


def smoke_test(server_url: str, model_name: str, prompts: list[str], max_tokens: int = 8) -> list[str]:
    """Every prompt must complete with 200 and non-empty text; returns the texts."""
    texts = []
    with httpx.Client(base_url=server_url.rstrip("/"), timeout=60) as client:
        for p in prompts:
            r = client.post("/v1/completions", json={"model": model_name, "prompt": p, "max_tokens": max_tokens,
                                                     "temperature": 0})
            if r.status_code != 200:
                raise SmokeTestFailed(f"prompt {p!r}: HTTP {r.status_code}: {r.text[:200]}")
            text = r.json()["choices"][0]["text"]
            if not text:
                raise SmokeTestFailed(f"prompt {p!r}: empty completion")
            texts.append(text)
    return texts


class Reverted(RuntimeError):
    """The smoke test failed after promotion; the alias was moved back."""


@flow(name="deploy")
def deploy_flow(model_name: str, version: str | int | None = None, server_url: str | None = "http://127.0.0.1:8000",
                alias: str = "champion", wait_s: float = 120.0, prompts: list[str] | None = None,
                tracking_uri: str | None = None):
    """Promote `version` (None = the current `candidate`) to `alias` and smoke-test `server_url` (None = no smoke test).

    Completed "Deployed" returns {"version", "previous", "smoke", "texts"}; a failed smoke test ends Failed
    "Reverted" with the alias back where it was (a direct call raises `Reverted`).
    """
    return flow_state(lambda: deploy(model_name, version, server_url, alias, wait_s, prompts, tracking_uri),
                      "Deployed", lambda d: f"{model_name}@{alias}: {d['previous']} -> {d['version']}; smoke test "
                                            f"{d['smoke']}")


def deploy(model_name: str, version: str | int | None, server_url: str | None, alias: str = "champion",
           wait_s: float = 120.0, prompts: list[str] | None = None, tracking_uri: str | None = None) -> dict:
    log = get_run_logger()
    registry.configure(tracking_uri)
    if version is None:
        cand = registry.version_for_alias(model_name, "candidate")
        if cand is None:
            raise registry.RegistryError(f"{model_name} has no 'candidate' alias; pass version=")
        version = cand.version
    version = str(version)  # `-p version=3` arrives as a JSON int
    previous = registry.promote(model_name, version, alias, by="deploy")
    log.info("%s@%s: %s -> %s", model_name, alias, previous, version)
    if server_url is None:
        return {"version": version, "previous": previous, "smoke": "skipped (no server_url)"}
    try:
        wait_for_version(server_url, model_name, version, wait_s,
                         artifact_sha256=registry.get_version(model_name, version).tags.get("artifact_sha256"))
        texts = smoke_test(server_url, model_name, prompts or GoldenConfig().prompts)
    except Exception as e:
        if previous is not None:
            registry.set_alias(model_name, alias, previous, by="deploy reverted (smoke test failed)")
        else:
            registry.delete_alias(model_name, alias, by="deploy reverted (smoke test failed)")
        raise Reverted(f"smoke test of {model_name} v{version} on {server_url} failed ({e}); "
                       f"{model_name}@{alias} moved back to {previous}") from e
    log.info("smoke test passed: %s", texts)
    return {"version": version, "previous": previous, "smoke": f"passed on {server_url}", "texts": texts}
