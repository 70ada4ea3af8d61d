"""flows/outcome.py's filter on Prefect's flow-run logger: a run that ends in a verdict or on bad input loses only
Prefect's "Engine execution exited with unexpected exception" traceback; a bug keeps it."""

from __future__ import annotations

import logging
import sys

import pytest

from flows.outcome import RunNotAccepted, _QuietExpectedEnds

ENGINE_LINE = "Engine execution exited with unexpected exception"


def _record(exc: BaseException, msg: str = ENGINE_LINE) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, msg, None, info)


class ConfigError(ValueError):  # named as the project's: flows/errors.USER_ERRORS goes by the class name
    pass


@pytest.mark.parametrize("exc, shown", [
    (RunNotAccepted("rejected: top-1 agreement 0.7 < 0.8", {}), False),  # a verdict: the state says it
    (ConfigError("data.bogus: unknown key"), False),                        # bad input: the state names the key
    (ZeroDivisionError("a bug"), True),                                     # a bug keeps its traceback
])
def test_only_expected_ends_lose_the_engine_traceback(exc, shown):
    f = _QuietExpectedEnds()
    assert f.filter(_record(exc)) is shown
    assert f.filter(_record(exc, "another line")) is True  # only Prefect's engine line is dropped
    assert _QuietExpectedEnds in {type(x) for x in logging.getLogger("prefect.flow_runs").filters}
