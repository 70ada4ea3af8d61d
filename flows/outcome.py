"""The final Prefect state of a flow run: a name that is the outcome, a message a person can act on.

`prefect deployment run ... --watch` prints the final state's name and exits 0 only on a
Completed state, and the Prefect UI shows name and message on the run page. So the outcome
is carried there, not only in the worker's log (docs/operations.md lists every name and
exit code):

- compress: Completed "Accepted" (or "Completed" when no gate ran); Failed "Rejected" (the
  gate said no), Failed "Blocked" (accurate enough, but under the speed floor), Failed
  "<ErrorName>" for bad input or a failed stage.
- deploy: Completed "Deployed"; Failed "Reverted" (the smoke test failed and the alias moved back).
- rollback: Completed "RolledBack".
- draft: Completed "Registered" (the drafter pays and is linked from the target version), Completed "NotRegistered"
  (the figures and why).
"""

from __future__ import annotations

import logging
from typing import Callable

from prefect import get_run_logger
from prefect.states import Completed, Failed, State

from flows.errors import is_user_error


class RunNotAccepted(RuntimeError):
    """Raised by a direct call of the compress flow whose candidate was rejected or blocked; `.outcome` is the summary."""

    def __init__(self, message: str, outcome: dict):
        super().__init__(message)
        self.outcome = outcome


class _QuietExpectedEnds(logging.Filter):
    """Prefect's engine, in a worker's flow-run process, logs "Engine execution exited with unexpected exception"
    and a traceback whenever a run ends Failed: a Rejected or Blocked verdict and bad input included. Their final
    state already carries the name and the message a person acts on; the traceback is Prefect's own frames."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        expected = isinstance(exc, RunNotAccepted) or (exc is not None and is_user_error(exc))
        return not (expected and str(record.msg).startswith("Engine execution exited with unexpected exception"))


_flow_runs_log = logging.getLogger("prefect.flow_runs")
if not any(isinstance(f, _QuietExpectedEnds) for f in _flow_runs_log.filters):
    _flow_runs_log.addFilter(_QuietExpectedEnds())


def versions_line(registered: list[dict]) -> str:
    parts = [f"{r['name']} v{r['version']} ({', '.join(r['aliases']) or 'no alias'})" for r in registered]
    return "registered: " + "; ".join(parts) if parts else "nothing registered"


def pipeline_outcome(out: dict) -> tuple[str, str]:
    """(state name, message) of a finished pipeline run."""
    verdict, bench = out.get("verdict"), out.get("benchmark") or {}
    blocked = out.get("promotion_blocked") or bench.get("promotion_blocked")
    if verdict is None:
        name, head = "Completed", "no acceptance gate ran"
    elif not verdict["accepted"]:
        name, head = "Rejected", "rejected: " + "; ".join(verdict["reasons"])
    elif blocked:
        name, head = "Blocked", f"accepted but not promoted: {blocked}"
    else:
        name, head = "Accepted", "accepted"
        dep = out.get("deployed")
        if dep:
            head += f"; champion {dep['previous']} -> {dep['version']}, smoke test {dep['smoke']}"
    return name, f"{head} | {versions_line(out.get('registered', []))} | MLflow run {out.get('run_url', '')}"


def _failed(e: Exception) -> State:
    log = get_run_logger()
    message = f"{type(e).__name__}: {e}"
    if is_user_error(e):
        log.error("%s", message)
    else:
        log.exception("%s", message)
    return Failed(name=type(e).__name__, message=message, data=e)


def pipeline_state(run: Callable[[], dict]) -> State:
    try:
        out = run()
    except Exception as e:
        return _failed(e)
    name, message = pipeline_outcome(out)
    log = get_run_logger()
    (log.info if name in ("Accepted", "Completed") else log.warning)("%s: %s", name, message)
    if name in ("Accepted", "Completed"):
        return Completed(name=name, message=message, data=out)
    return Failed(name=name, message=message, data=RunNotAccepted(message, out))


def flow_state(run: Callable[[], dict], name: str | Callable[[dict], str], message: Callable[[dict], str]) -> State:
    """A deploy, rollback or draft flow's state: Completed `name` (or `name(result)`) with `message(result)`, or
    Failed naming the error."""
    try:
        out = run()
    except Exception as e:
        return _failed(e)
    name = name(out) if callable(name) else name
    text = message(out)
    get_run_logger().info("%s: %s", name, text)
    return Completed(name=name, message=text, data=out)
