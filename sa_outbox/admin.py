"""Operator actions on dead letters (outbox ``dead``, jobs ``failed``), for the CLI and for Python callers.

Every bulk action runs in batches of ``batch_size`` rows, one short transaction each (no long lock, no huge
transaction), and returns the ids it changed. ``dry_run=True`` returns the ids it *would* change and writes
nothing. A call must name what it acts on: ids, at least one filter, or ``all=True``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Engine

from . import _sql
from ._durations import Duration, to_timedelta
from ._sql import QueueSpec, spec_for
from .errors import ConfigurationError

__all__ = ["list_dead", "retry_dead", "skip_dead"]


def _filters(
    spec: QueueSpec,
    *,
    ids: Iterable[int] | None,
    all: bool,
    older_than: Duration | None,
    **named: Any,
) -> dict[str, Any]:
    filters: dict[str, Any] = {k: v for k, v in named.items() if v is not None}
    for key in filters:
        if key not in ("error_contains",) and key not in spec.c:
            raise ConfigurationError(
                f"filter {key!r} does not apply to the {spec.kind} table {spec.table.name!r}"
            )
    if ids is not None:
        filters["ids"] = [int(i) for i in ids]
    if older_than is not None:
        filters["older_than"] = to_timedelta(older_than, name="older_than")
    if not filters and not all:
        raise ConfigurationError("name the rows to act on: ids, a filter, or all=True")
    return filters


def list_dead(
    engine: Engine, model: type[Any], *, limit: int = 100, ids: Iterable[int] | None = None,
    older_than: Duration | None = None, **filters: Any,
) -> list[dict[str, Any]]:  # fmt: skip
    """Dead/failed rows matching the filters (all of them when none is given), oldest first."""
    spec = spec_for(model)
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
    f = _filters(spec, ids=ids, all=all, older_than=older_than, **filters)
    selection = _sql.dead_selection(spec, f)
    if dry_run:
        with engine.connect() as conn:
            return list(conn.execute(selection).scalars())
    stmt = (_sql.requeue_statement if action == "retry" else _sql.skip_statement)(spec, selection, batch_size)
    changed: list[int] = []
    while True:
        with engine.begin() as conn:
            got = list(conn.execute(stmt).scalars())
        changed += got
        if len(got) < batch_size:
            return sorted(changed)


def retry_dead(
    engine: Engine, model: type[Any], *, ids: Iterable[int] | None = None, all: bool = False,
    older_than: Duration | None = None, batch_size: int = 1000, dry_run: bool = False, **filters: Any,
) -> list[int]:  # fmt: skip
    """Requeue dead/failed rows: back to pending/queued, attempts reset, due now. Filters: ``event_type``,
    ``aggregate_type``, ``aggregate_id`` (outbox), ``task``, ``queue`` (jobs), ``error_contains``,
    ``older_than``."""
    return _bulk(engine, model, "retry", batch_size=batch_size, dry_run=dry_run, ids=ids, all=all,
                 older_than=older_than, filters=filters)  # fmt: skip


def skip_dead(
    engine: Engine, model: type[Any], *, ids: Iterable[int] | None = None, all: bool = False,
    older_than: Duration | None = None, batch_size: int = 1000, dry_run: bool = False, **filters: Any,
) -> list[int]:  # fmt: skip
    """Mark dead outbox rows done without delivering them, so the next message of an ordered aggregate can be
    claimed; the skip is recorded in ``last_error``."""
    return _bulk(engine, model, "skip", batch_size=batch_size, dry_run=dry_run, ids=ids, all=all,
                 older_than=older_than, filters=filters)  # fmt: skip
