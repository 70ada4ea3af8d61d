"""Which version is champion, said where people look, always derived from the ``champion`` alias and its history.

MLflow's UI lets a person move an alias by hand, and MLflow records neither who moved it nor when. So the text that
names the champion (the registered model's description and ``champion`` tag, each version's description lead and
tags, its source run's tags, which MLflow's compare page shows) is never written as a standalone sentence: it is
rewritten from two facts, the alias as it is now and ``champion_history``, a registered-model tag holding the list
of terms (version, since, until, by whom). Every move made through this project (deploy, promote, rollback, the
pipeline) is recorded with who made it; a move made by hand is recorded when the next pipeline run, ``rollback``, or
a server following the alias notices the alias and the history disagree (``sync``).

Writes go under a lock beside a local sqlite store (``store_lock``), so two servers noticing the same move, or a
server noticing a move that ``deploy`` is still recording, write one term.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass

from serve.registry.client import client, store_lock, version_for_alias

log = logging.getLogger(__name__)

CHAMPION = "champion"
HISTORY_TAG = "champion_history"
FORMER_TAG = "was_champion"
KEEP_TERMS = 40  # a tag value holds 5,000 characters; the oldest terms go first


@dataclass(frozen=True)
class Term:
    """One version's time as champion: ``until`` None while it still is."""

    version: str
    since: str
    until: str | None
    by: str


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def history(model_name: str) -> list[Term]:
    """The champion's terms, oldest first, from the registered model's ``champion_history`` tag."""
    raw = client().get_registered_model(model_name).tags.get(HISTORY_TAG)
    try:
        return [Term(**t) for t in json.loads(raw)] if raw else []
    except (ValueError, TypeError):
        log.warning("%s: unreadable %s tag; starting the history again", model_name, HISTORY_TAG)
        return []


def previous_champion(model_name: str) -> str | None:
    """The version that was champion before the current term (what ``rollback`` goes back to), or None."""
    terms = history(model_name)
    current = terms[-1].version if terms and terms[-1].until is None else None
    return next((t.version for t in reversed(terms) if t.version != current), None)


def record_move(model_name: str, version: str | None, by: str) -> list[Term]:
    """The alias now names ``version`` (None: no champion): close the open term, open the new one, relabel.
    The caller holds ``champion_lock``."""
    terms = history(model_name)
    at = now()
    if terms and terms[-1].until is None:
        if terms[-1].version == version:
            relabel(model_name, terms)
            return terms
        terms[-1] = Term(terms[-1].version, terms[-1].since, at, terms[-1].by)
    if version is not None:
        terms.append(Term(str(version), at, None, by))
    terms = terms[-KEEP_TERMS:]
    client().set_registered_model_tag(model_name, HISTORY_TAG, json.dumps([asdict(t) for t in terms]))
    relabel(model_name, terms)
    return terms


def champion_lock(model_name: str):
    import mlflow

    return store_lock(f"champion-{model_name}", mlflow.get_tracking_uri())  # the store MlflowClient() writes to


def sync(model_name: str, noticed_by: str) -> bool:
    """Record a move of the alias that the history lacks (made by hand in the UI) and rewrite every label; True when
    there was one. Takes the lock."""
    with champion_lock(model_name):
        return _sync(model_name, noticed_by)


def _sync(model_name: str, noticed_by: str) -> bool:
    alias = version_for_alias(model_name, CHAMPION)
    current = alias.version if alias else None
    terms = history(model_name)
    recorded = terms[-1].version if terms and terms[-1].until is None else None
    if current == recorded:
        return False
    by = f"by hand, noticed by {noticed_by}" if terms else f"before the history was kept, noticed by {noticed_by}"
    record_move(model_name, current, by)
    return True


def move(model_name: str, version: str, by: str) -> None:
    """Point ``champion`` at ``version`` and record who did: any hand move before it is recorded first."""
    with champion_lock(model_name):
        _sync(model_name, by)
        client().set_registered_model_alias(model_name, CHAMPION, str(version))
        record_move(model_name, str(version), by)


def remove(model_name: str, by: str) -> None:
    """Delete the ``champion`` alias (a deploy reverted with no champion before it) and close its term."""
    with champion_lock(model_name):
        _sync(model_name, by)
        client().delete_registered_model_alias(model_name, CHAMPION)
        record_move(model_name, None, by)


def relabel(model_name: str, terms: list[Term]) -> None:
    """Rewrite every place that names the champion from ``terms`` (whose open term is the alias's version)."""
    c = client()
    current = terms[-1] if terms and terms[-1].until is None else None
    last_term = {t.version: t for t in terms}  # a version's latest term
    for mv in c.search_model_versions(f"name='{model_name}'"):
        v, tags = str(mv.version), dict(mv.tags)
        t = last_term.get(v)
        if current is not None and v == current.version:
            want = {CHAMPION: f"since {t.since} ({t.by})"}
            lead = f"Champion since {t.since} ({t.by}): what the servers serve."
            run_tag = f"version {v}: champion since {t.since}"
        elif t is not None:
            want = {FORMER_TAG: f"{t.since} to {t.until}"}
            lead = f"Was champion from {t.since} to {t.until}."
            run_tag = None
        else:
            want, lead, run_tag = {}, "", None
        for key in (CHAMPION, FORMER_TAG):
            if key in want and tags.get(key) != want[key]:
                c.set_model_version_tag(model_name, v, key, want[key])
            elif key not in want and key in tags:
                c.delete_model_version_tag(model_name, v, key)
        description = " ".join(x for x in (lead, tags.get("note", "")) if x)
        if (mv.description or "") != description:
            c.update_model_version(model_name, v, description=description)
        if mv.run_id:
            _label_run(c, mv.run_id, v, run_tag, f"version {v}: {t.since} to {t.until}" if t and run_tag is None
                       else None)
    c.update_registered_model(model_name, description=model_description(model_name, terms))
    # last: the model's tag says the labels are written (a reader that sees it sees the rest)
    c.set_registered_model_tag(model_name, CHAMPION, current.version if current else "none")


def _label_run(c, run_id: str, version: str, champion: str | None, former: str | None) -> None:
    """The source run's tags, which MLflow's version compare page lines up: ``champion`` only on the champion's."""
    try:
        tags = c.get_run(run_id).data.tags
    except Exception:  # noqa: BLE001 - a deleted run: nothing to label
        return
    for key, value in ((CHAMPION, champion), (FORMER_TAG, former)):
        if value is not None and tags.get(key) != value:
            c.set_tag(run_id, key, value)
        elif value is None and tags.get(key, "").startswith(f"version {version}:"):
            c.delete_tag(run_id, key)


def model_description(model_name: str, terms: list[Term]) -> str:
    current = terms[-1] if terms and terms[-1].until is None else None
    head = (f"Champion: version {current.version}, since {current.since} ({current.by}); the servers follow the "
            f"`champion` alias." if current else "No champion: no version has the `champion` alias.")
    before = [t for t in terms if t is not current][-5:]
    past = (" Before: " + "; ".join(f"version {t.version} {t.since} to {t.until} ({t.by})" for t in reversed(before))
            + ".") if before else ""
    return (head + past + f" Roll back with `prefect deployment run 'rollback/on-demand' -p model_name={model_name}` "
            f"(the previous champion) or by giving another version the `champion` alias here (the next pipeline run, "
            f"rollback or server poll records the move). Each version holds an MLflow Model "
            f"(`mlflow.pyfunc.load_model('models:/{model_name}@champion')`); its figures are its source run's. "
            f"The full history is the `{HISTORY_TAG}` tag.")
