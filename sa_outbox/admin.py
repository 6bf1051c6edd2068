"""Operator actions on dead letters (outbox ``dead``, jobs ``failed``), for the CLI and for Python callers.

A bulk action selects its rows **once**, in one statement, when it starts (the ids of the dead rows that
match), then changes them in batches of ``batch_size`` ids, one short transaction each (no long lock, no huge
transaction). So it ends after ``ceil(selected / batch_size)`` statements even while dispatchers keep
dead-lettering messages, never acts twice on one row, and returns exactly the ids it changed: a selected row
that someone else requeued or skipped meanwhile is left alone and not reported. ``dry_run=True`` returns the
ids the same call would select and writes nothing. A call must name what it acts on: ids, at least one
filter, or ``all=True``. Bad arguments raise :class:`~sa_outbox.errors.ConfigurationError` before any SQL.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Engine

from . import _sql
from ._durations import Duration, positive_int, to_timedelta
from ._sql import QueueSpec, spec_for
from .errors import ConfigurationError

__all__ = ["list_dead", "retry_dead", "skip_dead"]

log = logging.getLogger("sa_outbox.admin")

_TEXT_FILTERS = ("event_type", "aggregate_type", "aggregate_id", "task", "queue", "error_contains")


def _ids(ids: Iterable[int]) -> list[int]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise ConfigurationError(f"ids must be a collection of integers, got {ids!r}")
    out = list(ids)
    bad = [i for i in out if isinstance(i, bool) or not isinstance(i, int)]
    if bad:
        raise ConfigurationError(f"ids must be integers, got {bad[0]!r}")
    return out


def _filters(
    spec: QueueSpec,
    *,
    ids: Iterable[int] | None,
    all: bool,
    older_than: Duration | None,
    **named: Any,
) -> dict[str, Any]:
    filters: dict[str, Any] = {k: v for k, v in named.items() if v is not None}
    for key, value in filters.items():
        if key not in ("error_contains",) and key not in spec.c:
            raise ConfigurationError(
                f"filter {key!r} does not apply to the {spec.kind} table {spec.table.fullname!r}"
            )
        if key in _TEXT_FILTERS and (not isinstance(value, str) or not value):
            raise ConfigurationError(f"filter {key} must be a non-empty string, got {value!r}")
    if ids is not None:
        filters["ids"] = _ids(ids)
    if older_than is not None:
        filters["older_than"] = to_timedelta(older_than, name="older_than")
    if not filters and not all:
        raise ConfigurationError("name the rows to act on: ids, a filter, or all=True")
    return filters


def list_dead(
    engine: Engine, model: type[Any], *, limit: int = 100, ids: Iterable[int] | None = None,
    older_than: Duration | None = None, **filters: Any,
) -> list[dict[str, Any]]:  # fmt: skip
    """Up to ``limit`` (>= 1) dead/failed rows matching the filters (all of them when none is given), oldest
    first, each as a dict of its columns."""
    spec = spec_for(model)
    limit = positive_int(limit, "limit")
    f = _filters(spec, ids=ids, all=True, older_than=older_than, **filters)
    selection = _sql.dead_selection(spec, f)
    stmt = (
        spec.table.select().where(spec.c.id.in_(selection.limit(limit).scalar_subquery())).order_by(spec.c.id)
    )
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(stmt)]


def _bulk(
    engine: Engine, model: type[Any], action: str, *, batch_size: int, dry_run: bool, ids: Iterable[int] | None,
    all: bool, older_than: Duration | None, filters: dict[str, Any],
) -> list[int]:  # fmt: skip
    spec = spec_for(model)
    if action == "skip" and spec.kind != "outbox":
        raise ConfigurationError("skip applies to outbox dead letters; requeue failed jobs with retry_dead")
    batch_size = positive_int(batch_size, "batch_size")
    f = _filters(spec, ids=ids, all=all, older_than=older_than, **filters)
    with engine.connect() as conn:  # the selection, taken once: everything below acts on these ids only
        selected = list(conn.execute(_sql.dead_selection(spec, f)).scalars())
    if dry_run:
        return selected
    stmt = _sql.requeue_statement(spec) if action == "retry" else _sql.skip_statement(spec)
    changed: list[int] = []
    for start in range(0, len(selected), batch_size):
        with engine.begin() as conn:
            changed += conn.execute(stmt, {"ids": selected[start : start + batch_size]}).scalars()
    changed.sort()
    verb = "requeued" if action == "retry" else "skipped"
    log.info(
        "%s %d %s row(s) of %s (%d selected; %d no longer %s)", verb, len(changed), spec.dead,
        spec.table.fullname, len(selected), len(selected) - len(changed), spec.dead,
        extra={"table": spec.table.fullname, "action": action, "selected": len(selected), "changed": len(changed)},
    )  # fmt: skip
    return changed


def retry_dead(
    engine: Engine, model: type[Any], *, ids: Iterable[int] | None = None, all: bool = False,
    older_than: Duration | None = None, batch_size: int = 1000, dry_run: bool = False, **filters: Any,
) -> list[int]:  # fmt: skip
    """Requeue dead/failed rows: back to pending/queued, attempts reset, due now. Filters: ``event_type``,
    ``aggregate_type``, ``aggregate_id`` (outbox), ``task``, ``queue`` (jobs), ``error_contains``,
    ``older_than``. Selects the rows once and returns the ids it changed (see the module docstring)."""
    return _bulk(engine, model, "retry", batch_size=batch_size, dry_run=dry_run, ids=ids, all=all,
                 older_than=older_than, filters=filters)  # fmt: skip


def skip_dead(
    engine: Engine, model: type[Any], *, ids: Iterable[int] | None = None, all: bool = False,
    older_than: Duration | None = None, batch_size: int = 1000, dry_run: bool = False, **filters: Any,
) -> list[int]:  # fmt: skip
    """Mark dead outbox rows done without delivering them, so the next message of an ordered aggregate can be
    claimed; the skip is recorded in ``last_error``. Selects the rows once and returns the ids it changed."""
    return _bulk(engine, model, "skip", batch_size=batch_size, dry_run=dry_run, ids=ids, all=all,
                 older_than=older_than, filters=filters)  # fmt: skip
