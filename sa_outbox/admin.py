"""Operator actions, for the CLI and for Python callers: dead letters (outbox ``dead``, jobs ``failed``),
jobs (cancel, retry, update, read a result) and queues (pause, resume, list).

A bulk action selects its rows **once**, in one statement, when it starts (the ids of the dead rows that
match), then changes them in batches of ``batch_size`` ids, one short transaction each (no long lock, no huge
transaction). So it ends after ``ceil(selected / batch_size)`` statements even while dispatchers keep
dead-lettering messages, never acts twice on one row, and returns exactly the ids it changed: a selected row
that someone else requeued or skipped meanwhile is left alone and not reported. ``dry_run=True`` returns the
ids the same call would select and writes nothing. A call must name what it acts on: ids, at least one
filter, or ``all=True``. Bad arguments raise :class:`~sa_outbox.errors.ConfigurationError` before any SQL.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from sqlalchemy import Connection, Engine, func, or_, select, union, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from . import _partitions, _sql
from ._db import schema_checked
from ._durations import Duration, positive_int, to_timedelta
from ._sql import QueueSpec, queue_table, spec_for
from .errors import ConfigurationError, PartitionClosedError

__all__ = [
    "Cancellation",
    "QueueState",
    "cancel_jobs",
    "job_result",
    "list_dead",
    "list_queues",
    "pause_queue",
    "resume_queue",
    "retry_dead",
    "retry_jobs",
    "skip_dead",
    "update_jobs",
]

log = logging.getLogger("sa_outbox.admin")

_TEXT_FILTERS = ("event_type", "aggregate_type", "aggregate_id", "task", "queue", "error_contains")


def _ids(ids: Iterable[int]) -> list[int]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise ConfigurationError(f"ids must be a collection of integers, got {ids!r}")
    out = list(ids)
    bad = [i for i in out if isinstance(i, bool) or not isinstance(i, int)]
    if bad:
        raise ConfigurationError(f"ids must be integers, got {bad[0]!r}")
    low, high = _sql.BIGINT_RANGE
    wide = [i for i in out if not low <= i <= high]
    if wide:  # no row has such an id; sent, PostgreSQL would refuse the whole statement with a DataError
        raise ConfigurationError(f"ids must fit a bigint ({low} to {high}), got {wide[0]}")
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


@schema_checked
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
    spec, f = _dead_plan(model, action, ids=ids, all=all, older_than=older_than, filters=filters)
    batch_size = positive_int(batch_size, "batch_size")
    with engine.connect() as conn:  # the selection, taken once: everything below acts on these ids only
        selected = _dead_selected(conn, model, action, spec, f)
    if dry_run:
        return selected
    stmt = _sql.requeue_statement(spec) if action == "retry" else _sql.skip_statement(spec)
    changed = _in_batches(engine, model, stmt, selected, batch_size, action=action)
    verb = "requeued" if action == "retry" else "skipped"
    gone = len(selected) - len(changed)
    log.log(
        logging.WARNING if gone else logging.INFO,
        "%s %d %s row(s) of %s (%d selected; %d no longer %s%s)", verb, len(changed), spec.dead,
        spec.table.fullname, len(selected), gone, spec.dead,
        ": another operator acted on them meanwhile, or a retire dropped their partition" if gone else "",
        extra={"table": spec.table.fullname, "action": action, "selected": len(selected), "changed": len(changed)},
    )  # fmt: skip
    return changed


def _dead_plan(
    model: type[Any], action: str, *, ids: Iterable[int] | None, all: bool, older_than: Duration | None,
    filters: dict[str, Any],
) -> tuple[QueueSpec, dict[str, Any]]:  # fmt: skip
    """The table and the checked filters of a bulk ``action`` on dead letters (no SQL: bad arguments are refused
    before any)."""
    spec = spec_for(model)
    return spec, _filters(spec, ids=ids, all=all, older_than=older_than, **filters)


def _dead_selected(
    conn: Connection, model: type[Any], action: str, spec: QueueSpec, f: dict[str, Any]
) -> list[int]:
    """The ids a bulk ``action`` would change, read on ``conn`` — the call's own connection, or the dashboard's
    bounded transaction for its preview (one selection, the same for both)."""
    selected = list(conn.execute(_sql.dead_selection(spec, f)).scalars())
    _partitions.refuse_closed(conn, model, selected, action)
    return selected


@schema_checked
def retry_dead(
    engine: Engine, model: type[Any], *, ids: Iterable[int] | None = None, all: bool = False,
    older_than: Duration | None = None, batch_size: int = 1000, dry_run: bool = False, **filters: Any,
) -> list[int]:  # fmt: skip
    """Requeue dead/failed rows: back to pending/queued, attempts reset, due now. Filters: ``event_type``,
    ``aggregate_type``, ``aggregate_id`` (outbox), ``task``, ``queue`` (jobs), ``error_contains``,
    ``older_than``. Selects the rows once and returns the ids it changed (see the module docstring)."""
    return _bulk(engine, model, "retry", batch_size=batch_size, dry_run=dry_run, ids=ids, all=all,
                 older_than=older_than, filters=filters)  # fmt: skip


@schema_checked
def skip_dead(
    engine: Engine, model: type[Any], *, ids: Iterable[int] | None = None, all: bool = False,
    older_than: Duration | None = None, batch_size: int = 1000, dry_run: bool = False, **filters: Any,
) -> list[int]:  # fmt: skip
    """Mark dead outbox rows done without delivering them, so the next message of an ordered aggregate can be
    claimed; cancel failed jobs — discarded, never run again (they then count as finished: ``check`` no longer
    counts them, ``purge`` removes them with the done ones). Recorded in ``last_error``. Selects the rows once
    and returns the ids it changed."""
    return _bulk(engine, model, "skip", batch_size=batch_size, dry_run=dry_run, ids=ids, all=all,
                 older_than=older_than, filters=filters)  # fmt: skip


# --- jobs a team controls: cancel, retry, update, results; pausing queues ---------------------------------

#: Where a job action may run: an ``Engine`` (its own transaction), or a ``Connection``/``Session`` (the
#: caller's transaction); ``AsyncConnection``/``AsyncSession`` too, and then the call is awaited.
Bind = Engine | Connection | Session | AsyncConnection | AsyncSession

T = TypeVar("T")


def _run(bind: Any, fn: Callable[[Connection], T]) -> T | Awaitable[T]:
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            return fn(conn)
    if isinstance(bind, Connection):
        return fn(bind)
    if isinstance(bind, Session):
        return fn(bind.connection())
    if isinstance(bind, AsyncSession):
        return bind.run_sync(lambda s: fn(s.connection()))
    if isinstance(bind, AsyncConnection):
        return bind.run_sync(fn)
    raise ConfigurationError(
        f"bind must be an Engine, Connection, Session, AsyncConnection or AsyncSession, got {type(bind).__name__}"
    )


def _jobs_spec(model: type[Any]) -> QueueSpec:
    spec = spec_for(model)
    if spec.kind != "jobs":
        raise ConfigurationError(f"{model.__name__} is not a JobMixin model")
    return spec


def _job_filters(
    spec: QueueSpec, *, ids: Iterable[int] | None, task: str | None, queue: str | None, all: bool = False
) -> dict[str, Any]:
    filters: dict[str, Any] = {}
    if ids is not None:
        filters["ids"] = _ids(ids)
    for name, value in (("task", task), ("queue", queue)):
        if value is not None:
            if not isinstance(value, str) or not value:
                raise ConfigurationError(f"{name} must be a non-empty string, got {value!r}")
            filters[name] = value
    if not filters and not all:
        raise ConfigurationError("name the jobs to act on: ids, task, queue (or all=True)")
    return filters


@dataclass(frozen=True)
class Cancellation:
    """What :func:`cancel_jobs` did: queued jobs now ``cancelled``, and running jobs asked to stop."""

    cancelled: list[int]
    requested: list[int]


@schema_checked
def cancel_jobs(
    bind: Bind, model: type[Any], *, ids: Iterable[int] | None = None, task: str | None = None,
    queue: str | None = None,
) -> Any:  # fmt: skip
    """Cancel jobs (by ids, task and/or queue; at least one). A queued job becomes ``cancelled`` — final, it
    will not run. A running job gets a cancel request that its worker learns with its next heartbeat (on any
    host): a sync handler sees ``job.cancel_requested`` turn true, an async handler's task is cancelled; one
    that stops is recorded ``cancelled``, one that finishes anyway ``done``. Runs in ``bind``'s transaction
    (an Engine: its own) — await it with an async bind. Returns a :class:`Cancellation`."""
    spec = _jobs_spec(model)
    where = _sql.job_filters(spec, _job_filters(spec, ids=ids, task=task, queue=queue))
    stmt = _sql.cancel_statement(spec, where)

    def act(conn: Connection) -> Cancellation:
        rows = conn.execute(stmt).all()
        cancelled = sorted(r.id for r in rows if r.status == "cancelled")
        requested = sorted(r.id for r in rows if r.status == "running")
        log.info(
            "cancelled %d queued job(s) of %s; asked %d running job(s) to stop", len(cancelled),
            spec.table.fullname, len(requested),
            extra={"table": spec.table.fullname, "cancelled": len(cancelled), "requested": len(requested)},
        )  # fmt: skip
        return Cancellation(cancelled, requested)

    return _run(bind, act)


def _retry_jobs_plan(
    model: type[Any], *, ids: Iterable[int] | None, task: str | None, queue: str | None, statuses: Iterable[str],
    all: bool,
) -> tuple[QueueSpec, list[str], Any]:  # fmt: skip
    """:func:`retry_jobs`'s table, statuses and checked filters (no SQL)."""
    spec = _jobs_spec(model)
    wanted = _statuses(statuses, ("failed", "cancelled"))
    return spec, wanted, _sql.job_filters(spec, _job_filters(spec, ids=ids, task=task, queue=queue, all=all))


def _jobs_selected(
    conn: Connection, model: type[Any], spec: QueueSpec, wanted: list[str], where: Any
) -> list[int]:
    """The jobs :func:`retry_jobs` would requeue, read on ``conn`` (see :func:`_dead_selected`)."""
    selected = list(conn.execute(_sql.job_selection(spec, wanted, where)).scalars())
    _partitions.refuse_closed(conn, model, selected, "retry")
    return selected


@schema_checked
def retry_jobs(
    engine: Engine, model: type[Any], *, ids: Iterable[int] | None = None, task: str | None = None,
    queue: str | None = None, statuses: Iterable[str] = ("failed", "cancelled"), all: bool = False,
    batch_size: int = 1000, dry_run: bool = False,
) -> list[int]:  # fmt: skip
    """Requeue failed and/or cancelled jobs (``statuses``): back to queued, attempts reset, due now. Like
    :func:`retry_dead`, the jobs are selected once and changed in batches; returns the ids changed (or, with
    ``dry_run``, the ids that would be)."""
    spec, wanted, where = _retry_jobs_plan(model, ids=ids, task=task, queue=queue, statuses=statuses, all=all)
    batch_size = positive_int(batch_size, "batch_size")
    with engine.connect() as conn:
        selected = _jobs_selected(conn, model, spec, wanted, where)
    if dry_run:
        return selected
    changed = _in_batches(engine, model, _sql.retry_jobs_statement(spec, wanted), selected, batch_size,
                          action="retry", unique=True)  # fmt: skip
    left = sorted(set(selected) - set(changed))
    if left:
        c = spec.c
        with engine.connect() as conn:
            keyed = list(
                conn.execute(
                    select(c.id).where(
                        c.id.in_(left), c.status.in_(wanted), c.lease_version == 0, c.unique_key.is_not(None)
                    )
                ).scalars()
            )
        if keyed:
            log.warning(
                "left %d job(s) of %s %s: each never started and its unique key already has a job waiting (at "
                "most one waits per key, and one may have been enqueued meanwhile): %s", len(keyed),
                spec.table.fullname, "/".join(wanted),
                ", ".join(map(str, keyed[:50])) + (f", … ({len(keyed) - 50} more)" if len(keyed) > 50 else ""),
                extra={"table": spec.table.fullname, "left": len(keyed)},
            )  # fmt: skip
    return changed


@schema_checked
def update_jobs(
    engine: Engine, model: type[Any], *, ids: Iterable[int] | None = None, task: str | None = None,
    queue: str | None = None, all: bool = False, priority: int | None = None,
    run_at: dt.datetime | Duration | None = None, max_attempts: int | None = None,
    statuses: Iterable[str] = ("queued", "failed", "cancelled"), batch_size: int = 1000, dry_run: bool = False,
) -> list[int]:  # fmt: skip
    """Change ``priority``, ``run_at`` (an aware datetime, or a delay from the database's now) and/or
    ``max_attempts`` of queued, failed or cancelled jobs (never a running one: its worker owns it). Selected
    once, changed in batches; returns the ids changed (or, with ``dry_run``, that would be)."""
    spec = _jobs_spec(model)
    wanted = _statuses(statuses, ("queued", "failed", "cancelled"))
    batch_size = positive_int(batch_size, "batch_size")
    values: dict[str, Any] = {}
    if priority is not None:
        if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**31) <= priority < 2**31:
            raise ConfigurationError(f"priority must be a 32-bit integer, got {priority!r}")
        values["priority"] = priority
    if max_attempts is not None:
        if positive_int(max_attempts, "max_attempts") >= 2**31:
            raise ConfigurationError(f"max_attempts must be a 32-bit integer, got {max_attempts!r}")
        values["max_attempts"] = max_attempts
    if run_at is not None:
        if isinstance(run_at, dt.datetime):
            if run_at.tzinfo is None:
                raise ConfigurationError("run_at must be timezone-aware (a naive datetime is ambiguous)")
            values["run_at"] = run_at
        else:
            values["run_at"] = func.now() + to_timedelta(run_at, name="run_at delay")
    if not values:
        raise ConfigurationError("update_jobs needs at least one of priority, run_at, max_attempts")
    where = _sql.job_filters(spec, _job_filters(spec, ids=ids, task=task, queue=queue, all=all))
    with engine.connect() as conn:
        selected = list(conn.execute(_sql.job_selection(spec, wanted, where)).scalars())
        _partitions.refuse_closed(conn, model, selected, "update")
    if dry_run:
        return selected
    return _in_batches(engine, model, _sql.update_jobs_statement(spec, wanted, values), selected, batch_size,
                       action="update")  # fmt: skip


def _closed_meanwhile(
    engine: Engine, model: type[Any], action: str, selected: list[int], changed: list[int]
) -> PartitionClosedError:
    """The error of a call whose batch met a partition closed after the selection; every id the earlier batches
    changed is logged (WARNING) and carried by the error, the first 50 in its message."""
    done = sorted(changed)
    rest = sorted(set(selected) - set(done))
    with engine.connect() as conn:
        spec, _ = _partitions._table_of(conn, model)
        found = _partitions.closed_holding(conn, model, rest)
    head = (
        _partitions.closed_message(spec, found, action)
        if found
        else f"cannot {action} the selected row(s) of {spec.table.fullname}: a partition holding them was closed"
    )
    log.warning(
        "%s %d row(s) of %s before a partition closed by a retire stopped the call: %s", action, len(done),
        spec.table.fullname, ", ".join(map(str, done)) or "none",
        extra={"table": spec.table.fullname, "action": action, "changed": done, "closed": found},
    )  # fmt: skip
    shown = ", ".join(map(str, done[:50])) + (f", … ({len(done) - 50} more)" if len(done) > 50 else "")
    return PartitionClosedError(
        f"{head}. It was closed while this ran: {len(done)} row(s) were changed before it"
        + (f": {shown}" if done else ""),
        changed=done,
        partitions=found,
    )


def _statuses(given: Iterable[str], allowed: tuple[str, ...]) -> list[str]:
    wanted = [given] if isinstance(given, str) else list(given)
    if not wanted or any(s not in allowed for s in wanted):
        raise ConfigurationError(f"statuses must be among {', '.join(allowed)}, got {wanted!r}")
    return wanted


def _in_batches(
    engine: Engine, model: type[Any], stmt: Any, selected: list[int], batch_size: int, *, action: str,
    unique: bool = False,
) -> list[int]:  # fmt: skip
    """Run ``stmt`` on ``selected`` in batches of ``batch_size`` ids, a transaction each; the ids it changed. A
    database error part way is raised with ``changed_before``: the ids the committed batches changed.

    The callers refuse a selection that holds rows in a partition a retire has closed to writes
    (:class:`PartitionClosedError`, nothing changed); a partition closed while the batches run stops them at the
    batch that meets it, with the same error naming every id the earlier batches changed (once the retire's
    detach has begun its rows are hidden instead, and count as no longer selectable, like rows another
    operator acted on).
    ``unique``: the statement skips a job whose unique key has a waiting job, but one enqueued by a transaction
    still open when the statement ran is found only at the unique index, as a violation. The batch is then run
    again (which sees that job committed); after a second violation its jobs are run one at a time, and a job
    that still meets one is left as it is (a key enqueued that busily: the caller reports it), never raised."""
    changed: list[int] = []

    def once(ids: list[int]) -> bool:
        try:
            with engine.begin() as conn:
                changed.extend(conn.execute(stmt, {"ids": ids}).scalars())
            return True
        except IntegrityError as exc:
            if _partitions.is_closed_error(exc):
                raise _closed_meanwhile(engine, model, action, selected, changed) from exc
            if not unique or getattr(exc.orig, "sqlstate", None) != "23505":
                raise
            return False

    try:
        for start in range(0, len(selected), batch_size):
            batch = selected[start : start + batch_size]
            if once(batch) or once(batch):
                continue
            for one in batch:
                if not once([one]):
                    once([one])
    except DBAPIError as exc:  # (an outage part way: what the earlier batches committed goes with the error)
        exc.changed_before = sorted(changed)  # type: ignore[attr-defined]
        raise
    return sorted(changed)


def _statuses_of(engine: Engine, model: type[Any], ids: Iterable[int]) -> dict[int, str | None]:
    """The status of each of ``ids`` in ``model``'s table now (``None``: no such row) — what the CLI tells an
    operator about the ids a command named but did not act on."""
    spec = spec_for(model)
    wanted = _ids(ids)
    with engine.connect() as conn:
        rows = conn.execute(select(spec.c.id, spec.c.status).where(spec.c.id.in_(wanted))).all()
    found = {r.id: r.status for r in rows}
    return {i: found.get(i) for i in wanted}


@schema_checked
def job_result(bind: Engine | Connection | Session, model: type[Any], job_id: int) -> Any:
    """The value a done job's handler returned (stored as JSON with its completion; ``None`` if it returned
    nothing or its value could not be stored). Raises ``LookupError`` naming the status of a job that is not
    done, or that does not exist."""
    spec = _jobs_spec(model)
    stmt = select(spec.c.status, spec.c.result).where(spec.c.id == job_id)
    found = _run(bind, lambda conn: conn.execute(stmt).first())
    if found is None:
        raise LookupError(f"no job {job_id} in {spec.table.fullname}")
    status, result = cast(Any, found)
    if status != spec.done:
        raise LookupError(f"job {job_id} is {status}: it has no result (yet)")
    return result


# --- pausing queues -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueState:
    """A queue of a jobs table: paused or not (and since when, by whom), and how many jobs wait or run."""

    name: str
    paused_at: dt.datetime | None
    paused_by: str | None
    queued: int
    running: int

    @property
    def paused(self) -> bool:
        return self.paused_at is not None


def _queue_name(queue: str) -> str:
    if not isinstance(queue, str) or not queue:
        raise ConfigurationError(f"a queue name must be a non-empty string, got {queue!r}")
    return queue


def _run_logged(bind: Bind, fn: Callable[[Connection], T], done: Callable[[T], None]) -> T | Awaitable[T]:
    """:func:`_run`, then ``done(result)`` once the statement ran (with an Engine, once it committed): an action's
    log line is never written for a statement that failed."""
    result = _run(bind, fn)
    if isinstance(result, Awaitable):
        pending = result

        async def then() -> T:
            value = await pending
            done(value)
            return value

        return then()
    done(result)
    return result


@schema_checked
def pause_queue(bind: Bind, model: type[Any], queue: str, *, by: str | None = None) -> Any:
    """Pause a queue: no worker anywhere claims its jobs until :func:`resume_queue` (workers learn it within
    about a second; jobs already running finish). A queue with no jobs yet may be paused too: its jobs wait
    from the first. The state is a row of ``<jobs>_queues``, so it survives restarts and works behind
    PgBouncer. Await it with an async bind. Logged (INFO) once the statement ran — with an Engine, once it
    committed; with your Connection or Session, your rollback undoes the pause the line reports."""
    spec = _jobs_spec(model)
    table = queue_table(spec.table)
    stmt = (
        pg_insert(table)
        .values(queue=_queue_name(queue), paused_at=func.now(), paused_by=by)
        .on_conflict_do_update(
            index_elements=[table.c.queue], set_={"paused_at": func.now(), "paused_by": by}
        )
    )

    def done(_: None) -> None:
        log.info("queue %r of %s paused", queue, spec.table.fullname, extra={"queue": queue, "by": by})

    return _run_logged(bind, lambda conn: conn.execute(stmt) and None, done)


@schema_checked
def resume_queue(bind: Bind, model: type[Any], queue: str) -> Any:
    """Resume a paused queue; returns True, or False when no queue of that exact name (names are
    case-sensitive) was paused — nothing changed then, and nothing is logged. Await it with an async bind.
    Logged (INFO) as :func:`pause_queue` is."""
    spec = _jobs_spec(model)
    table = queue_table(spec.table)
    stmt = (
        update(table)
        .where(table.c.queue == _queue_name(queue), table.c.paused_at.is_not(None))
        .values(paused_at=None, paused_by=None)
        .returning(table.c.queue)
    )

    def done(resumed: bool) -> None:
        if resumed:
            log.info("queue %r of %s resumed", queue, spec.table.fullname, extra={"queue": queue})

    return _run_logged(bind, lambda conn: conn.execute(stmt).first() is not None, done)


@schema_checked
def list_queues(bind: Engine | Connection | Session, model: type[Any]) -> list[QueueState]:
    """Every queue that has unfinished jobs or a state row, with its pause state and queued/running counts."""
    spec = _jobs_spec(model)
    table = queue_table(spec.table)
    c = spec.c
    counts = (
        select(
            c.queue,
            func.count().filter(c.status == _sql.const("queued")).label("queued"),
            func.count().filter(c.status == _sql.const("running")).label("running"),
        )
        # OR, not IN: the planner reads the queued and the running partial indexes (BitmapOr) instead of the
        # whole table (measured at 1M rows: 175 ms → 30 ms).
        .where(or_(c.status == _sql.const("queued"), c.status == _sql.const("running")))
        .group_by(c.queue)
        .subquery()
    )
    names = union(select(table.c.queue.label("name")), select(counts.c.queue.label("name"))).subquery()
    stmt = (
        select(names.c.name, table.c.paused_at, table.c.paused_by, counts.c.queued, counts.c.running)
        .select_from(names)
        .outerjoin(table, table.c.queue == names.c.name)
        .outerjoin(counts, counts.c.queue == names.c.name)
        .order_by(names.c.name)
    )
    rows = cast(Any, _run(bind, lambda conn: conn.execute(stmt).all()))
    return [QueueState(r[0], r[1], r[2], int(r[3] or 0), int(r[4] or 0)) for r in rows]
