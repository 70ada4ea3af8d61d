"""Promotion as compare-and-set: the champion is read again, judged and moved under one lock per model.

Two runs (a cron run and one on demand, or two configs of one model) can each compare their candidate with the
champion and then move the alias; without a lock the later one overwrites a champion it never compared with.
Every run takes the model's promotion lock before it moves ``champion`` and re-reads the champion inside it
(``lost_race``): a champion that moved meanwhile is compared again, and a candidate worse than it on the chat set
is not promoted (the run ends with that reason, never a traceback).

The lock: a file lock beside a local sqlite store (``<store>.promote-<model>.lock``, every process on this
machine honours it); for a remote tracking server, Prefect's global concurrency limit ``promote-<model>``, which
every worker shares once an operator creates it (``prefect gcl create promote-<model> --limit 1``;
docs/reliability.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from compress.registry.store import store_lock
from tasks.results import Judged


@contextmanager
def promotion_lock(tracking_uri: str, model_name: str) -> Iterator[None]:
    """Hold the model's promotion lock (see the module docstring) for the block."""
    with store_lock(f"promote-{model_name}", tracking_uri) as held:
        if held:
            yield
            return
    from prefect.concurrency.sync import concurrency

    with concurrency(f"promote-{model_name}", occupy=1):
        yield


@dataclass(frozen=True)
class Promotion:
    """What a judged candidate's registration does: the aliases it is registered with, whether the run moves
    ``champion`` to it (under the lock, see promote_if_still_best), and why not when it is blocked."""

    aliases: tuple[str, ...]
    promote: bool
    blocked: str | None


def verdict_status(verdict: Judged | None) -> str:
    """unchecked (no gate ran), accepted or rejected: the candidate version's ``verdict`` tag."""
    return "unchecked" if verdict is None else verdict.status


def decide_promotion(status: str, promote: bool, bench_blocked: str | None, champion_vs: dict | None,
                     promote_when_worse: bool) -> Promotion:
    """The promotion rules in one place (tests/test_promotion.py covers them as a table):

    - only an ``accepted`` candidate is promoted, and only with ``registry.promote``;
    - the benchmark's speed floor blocks it (``bench_blocked``: the reason, or None);
    - so does being worse than the champion on the chat set (``champion_vs["worse_on_use"]``,
      flows/pipeline.compare_with_champion), unless ``registry.promote_when_worse``;
    - ``candidate`` names only versions that may be promoted: a rejected or blocked one moves no alias."""
    blocked = bench_blocked
    if status == "accepted" and promote and not blocked and champion_vs and champion_vs["worse_on_use"] \
            and not promote_when_worse:
        u = champion_vs["use"]
        blocked = (f"worse than champion v{champion_vs['version']} on the chat set: perplexity ratio "
                   f"{u['candidate']:.4f}x vs {u['champion']:.4f}x (registry.promote_when_worse: true lets it through)")
    aliases = ("candidate",) if status != "rejected" and not blocked else ()
    return Promotion(aliases, status == "accepted" and promote and not blocked, blocked)


def lost_race(judged: dict | None, now: dict | None, promote_when_worse: bool) -> str | None:
    """Inside the lock: why the candidate may no longer take ``champion``, or None. ``judged`` is the comparison the
    run made with the champion of its time, ``now`` the same comparison with the champion read again
    (flows/pipeline.compare_with_champion: None without a champion)."""
    if now is None or (judged is not None and now["version"] == judged["version"]):
        return None  # no champion, or the one the run already judged against
    if now["worse_on_use"] and not promote_when_worse:
        u = now["use"]
        return (f"the champion moved to v{now['version']} while this run was judged, and this candidate is worse than "
                f"it on the chat set: perplexity ratio {u['candidate']:.4f}x vs {u['champion']:.4f}x "
                f"(registry.promote_when_worse: true lets it through)")
    return None


def promote_if_still_best(tracking_uri: str, model_name: str, judged: dict | None, compare: Callable[[], dict | None],
                          promote_when_worse: bool, promote: Callable[[], dict]) -> tuple[dict | None, str | None]:
    """(what ``promote`` returned, None), or (None, why not) when the champion moved to a better one meanwhile."""
    with promotion_lock(tracking_uri, model_name):
        why = lost_race(judged, compare(), promote_when_worse)
        if why is not None:
            return None, why
        return promote(), None
