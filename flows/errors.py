"""Which exceptions mean bad input (the message names the field and the fix) rather than a bug.

Prefect-free on purpose: the CLI consults it on its error path, where importing Prefect would bind
Prefect's log handlers to whatever stream is current.
"""

from __future__ import annotations

# Errors that mean "the input is wrong": their message names the field and the fix, a traceback adds nothing.
USER_ERRORS = ("ConfigError", "DataError", "ModelError", "ArtifactError", "RegistryError", "GoldenMismatch",
               "UnsupportedArchitectureError", "GqaBuildError", "QuantizeError", "DistillError", "EvaluateError",
               "SmokeTestFailed", "Reverted", "BudgetExceeded", "MemoryBudgetError", "DiskSpaceError",
               "ReferenceSettingError")


def is_user_error(e: BaseException) -> bool:
    """Bad input (a message naming the field and the fix), as opposed to a bug that needs its traceback."""
    return type(e).__name__ in USER_ERRORS
