"""What the dashboard's pages read, bounded on big tables.

Every statement reads one state through its partial index, and no statement reads more than ``cap`` index
entries of one state: a count that reaches the cap is replaced by an estimate (the planner's row estimate for
that state, or for ``done`` the table statistics as ``queue_status`` does) and shown as one. So a page costs
the same on a table of a thousand rows and on a backlog of a million. Ages are computed by the database
(``now()``), never by this process's clock. The actions are not here: they are ``sa_outbox.admin``'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import (
    Connection,
    Integer,
    and_,
    bindparam,
    desc,
    func,
    literal_column,
    or_,
    select,
)
from sqlalchemy.sql import ColumnElement, Select

from .. import admin, monitoring
from .._sql import QueueSpec, const, job_filters, queue_table
from .._sql import dead_selection as _dead_selection
from ..monitoring import DestinationOutage, TableHealth

#: Index entries read at most per state when counting: beyond, the figure is an estimate.
COUNT_CAP = 50_000
#: Finished rows read at most for the last hour's throughput: beyond, the rate of the newest is extrapolated.
THROUGHPUT_CAP = 20_000
#: Rows per page of a list.
PAGE_SIZE = 50
#: Jobs lists with a task/queue filter look at most at this many rows of the chosen status (newest first).
SEARCH_WINDOW = 20_000

JOB_STATUSES = ("queued", "running", "failed", "cancelled", "done")


@dataclass(frozen=True)
class Count:
    """A number of rows: exact, or (``estimated``) more than the cap and estimated from the statistics."""

    value: int
    estimated: bool = False


@dataclass(frozen=True)
class Throughput:
    """Rows finished per minute over the last hour, oldest minute first (60 buckets; ``None`` for a minute
    not measured). Exact while the hour holds at most ``cap`` finished rows; beyond, only the newest ``cap``
    rows are read (the minutes they cover) and ``total`` is extrapolated from their rate."""

    per_minute: list[int | None]
    total: int
    estimated: bool
    measured_minutes: int


@dataclass(frozen=True)
class TableOverview:
    name: str
    kind: str
    counts: dict[str, Count]
    oldest_due_age: float | None
    oldest_unfinished_age: float | None
    unfinished_age_estimated: bool
    expired_leases: int
    stale_after: float | None
    last_done_age: float | None
    throughput: Throughput
    outage: DestinationOutage | None
    blocked_total: int
    health: TableHealth | None
    warnings: list[str] = field(default_factory=list)
    blocked_partial: bool = False  # more dead rows than the cap: blocked_total counts those of the first ones


def _where_status(spec: QueueSpec, status: str) -> ColumnElement[bool]:
    where: ColumnElement[bool] = spec.c.status == const(status)
    return where


def capped_count(
    conn: Connection, spec: QueueSpec, where: ColumnElement[bool], cap: int = COUNT_CAP
) -> Count:
    """Rows matching ``where``: counted exactly up to ``cap``; beyond, the planner's estimate."""
    inner = select(literal_column("1")).select_from(spec.table).where(where).limit(cap + 1).subquery()
    n = int(conn.execute(select(func.count()).select_from(inner)).scalar_one())
    return Count(n) if n <= cap else beyond_cap(conn, spec, where, cap)


def beyond_cap(conn: Connection, spec: QueueSpec, where: ColumnElement[bool], cap: int) -> Count:
    """Rows matching ``where``, found to be more than ``cap``: the planner's estimate, never below the cap."""
    estimate = planner_estimate(conn, select(literal_column("1")).select_from(spec.table).where(where))
    return Count(max(estimate, cap + 1), True)


def planner_estimate(conn: Connection, stmt: Select[Any]) -> int:
    """The planner's row estimate for ``stmt`` (``EXPLAIN`` without ``ANALYZE``: nothing is read)."""
    compiled = stmt.compile(dialect=conn.dialect)
    plan = conn.exec_driver_sql(
        "EXPLAIN (FORMAT JSON) " + str(compiled), compiled.construct_params()
    ).scalar_one()
    return int(plan[0]["Plan"]["Plan Rows"])


def status_counts(
    conn: Connection, spec: QueueSpec, cap: int = COUNT_CAP, *, dead: Count | None = None
) -> dict[str, Count]:
    """Rows per status, each read through its partial index and capped. ``done`` beyond the cap comes from
    the statistics' live tuples minus the other states (as ``queue_status`` reports it). Jobs: ``cancelled``
    has no index of its own (it shares the finished index with ``done``): counted while the finished rows are
    under the cap, else the planner's estimate from the statistics' sample of the status column. ``dead``:
    the dead rows when the caller has counted them already."""
    counts = {
        status: capped_count(conn, spec, _where_status(spec, status), cap)
        for status in (spec.ready, spec.active)
    }
    counts[spec.dead] = (
        dead if dead is not None else capped_count(conn, spec, _where_status(spec, spec.dead), cap)
    )
    done, estimated = monitoring._done_count(conn, spec, sum(c.value for c in counts.values()), cap)
    if spec.kind == "outbox":
        counts[spec.done] = Count(done, estimated)
        return counts
    if not estimated:
        cancelled = capped_count(conn, spec, _where_status(spec, "cancelled"), cap)
    else:
        stmt: Select[Any] = (
            select(literal_column("1")).select_from(spec.table).where(_where_status(spec, "cancelled"))
        )
        cancelled = Count(planner_estimate(conn, stmt), True)
        done = max(done - cancelled.value, cap + 1)  # the live tuples counted the cancelled rows as done
    counts[spec.done] = Count(done, estimated)
    counts["cancelled"] = cancelled
    return counts


def _age_of(conn: Connection, expr: Any) -> float | None:
    value = conn.execute(select(func.extract("epoch", func.now() - expr))).scalar()
    return None if value is None else float(value)


@cache
def _oldest_due(spec: QueueSpec) -> Select[Any]:
    """When the oldest due ready row became due (the claim's index)."""
    c = spec.c
    return select(func.min(spec.due)).where(c.status == const(spec.ready), spec.due <= func.now())


@cache
def _oldest_created(spec: QueueSpec, status: str) -> Select[Any]:
    c = spec.c
    return select(func.min(c.created_at)).where(c.status == const(status))


def oldest_unfinished(
    conn: Connection, spec: QueueSpec, counts: dict[str, Count], oldest_due: Any
) -> tuple[float | None, bool]:
    """Age (from created_at) of the oldest unfinished row, exact while the ready rows are under the cap.
    Beyond (a backlog) it is not computed, as it would read every ready row: a row becomes due no earlier
    than it was created, so the oldest due row's age is a lower bound, returned with ``True``."""
    oldest: list[Any] = []
    estimated = counts[spec.ready].estimated
    if estimated:
        if oldest_due is not None:
            oldest.append(oldest_due)
    elif counts[spec.ready].value:
        oldest.append(conn.execute(_oldest_created(spec, spec.ready)).scalar())
    if counts[
        spec.active
    ].value:  # leased rows are few (as many as the loops hold); an estimate counts them too
        oldest.append(conn.execute(_oldest_created(spec, spec.active)).scalar())
    found = [o for o in oldest if o is not None]
    if not found:
        return None, estimated
    return _age_of(conn, min(found)), estimated


def throughput(conn: Connection, spec: QueueSpec, cap: int = THROUGHPUT_CAP) -> Throughput:
    """Finished rows per minute over the last hour from ``done_at`` / ``finished_at``, read backwards
    through the finished rows' partial index, at most ``cap`` entries (jobs: done and cancelled, the
    index's own predicate, so the index alone answers)."""
    c = spec.c
    finished = (
        c.status == const(spec.done)
        if spec.kind == "outbox"
        else or_(c.status == const(spec.done), c.status == const("cancelled"))
    )
    hour_ago = func.now() - literal_column("interval '1 hour'")
    newest = (
        select(spec.finished.label("t"))
        .where(finished, spec.finished > hour_ago)
        .order_by(desc(spec.finished))
        .limit(cap + 1)
        .subquery()
    )
    # Minute 59 is the current (partial) minute; minute 0 started 59 minutes before it.
    bucket = (59 - func.floor(func.extract("epoch", func.date_trunc("minute", func.now()) - func.date_trunc(
        "minute", newest.c.t)) / 60)).label("m")  # fmt: skip
    rows = conn.execute(select(bucket, func.count()).group_by(bucket)).all()
    per: dict[int, int] = {int(m): int(n) for m, n in rows if m is not None and 0 <= m <= 59}
    measured = sum(per.values())
    if measured <= cap:
        return Throughput([per.get(m, 0) for m in range(60)], measured, False, 60)
    # More than `cap` rows in the hour: the oldest bucket read is partial; report the minutes fully read.
    first = min(per)
    buckets: list[int | None] = [None if m <= first else per.get(m, 0) for m in range(60)]
    covered = 59 - first
    rate = sum(v for v in buckets if v is not None) / max(covered, 1)
    return Throughput(buckets, int(rate * 60), True, covered)


def expired_leases(conn: Connection, spec: QueueSpec, stale_after: float) -> int:
    from datetime import timedelta

    params = {} if spec.kind == "outbox" else {"stale_after": timedelta(seconds=stale_after)}
    return int(conn.execute(select(func.count()).select_from(spec.table).where(spec.lease_expired()),
                            params).scalar_one())  # fmt: skip


def blocked_aggregates(
    conn: Connection, spec: QueueSpec, limit: int
) -> tuple[list[monitoring.BlockedAggregate], int]:
    """Aggregates with pending messages behind a dead one (``monitoring``'s statement), the first ``limit``."""
    rows = conn.execute(monitoring._blocked_statement(spec), {"n": limit}).all()
    found = [
        monitoring.BlockedAggregate(r.aggregate_type, r.aggregate_id, int(r.dead_id), int(r.waiting))
        for r in rows
    ]
    return found, int(rows[0].total) if rows else 0


@cache
def _dead_and_blocked(spec: QueueSpec, cap: int) -> Select[Any]:
    """Outbox: dead rows (up to ``cap + 1``), and the aggregates among theirs whose first dead message has
    a pending message after it — in one pass over those dead rows (there is no index of dead rows alone: the aggregate index also holds every
    pending row), each aggregate probed once through the aggregate index for the first pending successor."""
    dead, later = spec.table.alias("d"), spec.table.alias("w")
    # the first cap + 1 dead rows by id (the dead rows' partial index): their aggregates' first dead
    # message is their smallest id among them; more dead rows than that are counted from the statistics
    first = (
        select(dead.c.aggregate_type, dead.c.aggregate_id, dead.c.id)
        .where(dead.c.status == const(spec.dead))
        .order_by(dead.c.id)
        .limit(cap + 1)
        .subquery("first_dead")
    )
    heads = (
        select(first.c.aggregate_type, first.c.aggregate_id, func.min(first.c.id).label("dead_id"),
               func.count().label("n"))
        .group_by(first.c.aggregate_type, first.c.aggregate_id)
        .subquery("heads")
    )  # fmt: skip
    waiting = (
        select(literal_column("1"))
        .select_from(later)
        .where(
            later.c.aggregate_id == heads.c.aggregate_id,
            later.c.aggregate_type == heads.c.aggregate_type,
            later.c.id > heads.c.dead_id,
            later.c.status == const(spec.ready),
        )
        .exists()
    )
    return select(func.coalesce(func.sum(heads.c.n), 0), func.count().filter(waiting))


def overview(conn: Connection, spec: QueueSpec, *, stale_after: float, cap: int = COUNT_CAP) -> TableOverview:
    blocked_total = 0
    blocked_partial = False
    dead: Count | None = None
    if spec.kind == "outbox":
        n, blocked_total = (int(x) for x in conn.execute(_dead_and_blocked(spec, cap)).one())
        dead = Count(n)
        if n > cap:  # read no further: the statistics' figure, and the blocked ones among those read
            dead, blocked_partial = beyond_cap(conn, spec, _where_status(spec, spec.dead), cap), True
    counts = status_counts(conn, spec, cap, dead=dead)
    due = conn.execute(_oldest_due(spec)).scalar()
    oldest_due_age = _age_of(conn, due) if due is not None else None
    unfinished_age, unfinished_estimated = oldest_unfinished(conn, spec, counts, due)
    expired = expired_leases(conn, spec, stale_after)
    last_done = conn.execute(monitoring._last_done_statement(spec)).scalar()
    outage = monitoring.destination_outage(conn, spec)
    warnings: list[str] = []
    if expired:
        warnings.append(f"{expired} expired lease(s): a dispatcher/worker crashed or its lease is too short")
    if blocked_total:
        warnings.append(
            f"{'at least ' if blocked_partial else ''}{blocked_total} ordered aggregate(s) wait behind a dead message"
        )
    if outage is not None:
        warnings.append(
            monitoring.describe_outage(
                outage, oldest_due_age, None if last_done is None else float(last_done)
            )
        )
    return TableOverview(
        spec.table.fullname, spec.kind, counts, oldest_due_age, unfinished_age, unfinished_estimated, expired,
        stale_after if spec.kind == "jobs" else None, None if last_done is None else float(last_done),
        throughput(conn, spec), outage, blocked_total, monitoring._health(conn, spec), warnings, blocked_partial,
    )  # fmt: skip


# --- lists ----------------------------------------------------------------------------------------------


def _age_column(col: Any, name: str) -> Any:
    return func.extract("epoch", func.now() - col).label(name)


def dead_page(
    conn: Connection, spec: QueueSpec, filters: dict[str, Any], *, after: int | None, limit: int = PAGE_SIZE
) -> tuple[list[dict[str, Any]], Count]:
    """A page of dead/failed rows matching ``filters`` (as ``admin``'s dead-letter functions take them; they
    are validated there), in id order after ``after``, and how many match in all (capped)."""
    checked = admin._filters(spec, ids=None, all=True, older_than=filters.pop("older_than", None), **filters)
    ids = _dead_selection(spec, checked)
    if after is not None:
        ids = ids.where(spec.c.id > after)
    picked = ids.limit(limit).subquery()
    t = spec.table
    stmt = select(t, _age_column(t.c.created_at, "age")).join(picked, picked.c.id == t.c.id).order_by(t.c.id)
    rows = [dict(r._mapping) for r in conn.execute(stmt)]
    matching = _dead_selection(spec, checked).order_by(None)
    where = matching.whereclause
    assert where is not None
    return rows, capped_count(conn, spec, where)


def row_detail(conn: Connection, spec: QueueSpec, row_id: int) -> dict[str, Any] | None:
    """One row with its ages; for a dead outbox row also ``waiting``: the pending messages of its aggregate
    after it, which an ordered dispatcher holds back until it is retried or skipped (the aggregate index)."""
    t, c = spec.table, spec.c
    ages = [_age_column(c.created_at, "age"), _age_column(spec.due, "due_age"),
            _age_column(spec.finished, "finished_age")]  # fmt: skip
    r = conn.execute(select(t, *ages).where(c.id == row_id)).first()
    if r is None:
        return None
    out = dict(r._mapping)
    if spec.kind == "outbox" and out["status"] == spec.dead:
        later = (
            select(func.count())
            .select_from(t)
            .where(c.aggregate_id == out["aggregate_id"], c.aggregate_type == out["aggregate_type"],
                   c.id > row_id, c.status == const(spec.ready))
        )  # fmt: skip
        out["waiting"] = int(conn.execute(later).scalar_one())
    return out


def jobs_page(
    conn: Connection, spec: QueueSpec, *, status: str, task: str | None, queue: str | None,
    before: int | None, limit: int = PAGE_SIZE,
) -> tuple[list[dict[str, Any]], bool]:  # fmt: skip
    """A page of jobs of one status, newest first (ids below ``before``), filtered by task/queue.

    Queued, running and failed jobs are read in id order (failed: through their own index). Done and
    cancelled jobs have no id index of their own: the page looks at the ``SEARCH_WINDOW`` most recently
    finished ones (the finished index, newest first) and ``True`` is returned when that window was full, so
    neither a rare task nor a backlog of newer queued jobs makes the page walk a million rows."""
    c = spec.c
    where = [c.status == const(status), *job_filters(spec, {"task": task, "queue": queue})]
    if before is not None:
        where.append(c.id < bindparam("before", before, type_=Integer))
    cols = [c.id, c.queue, c.task, c.status, c.priority, c.attempts, c.max_attempts, c.locked_by, c.last_error,
            c.cancel_requested_at, _age_column(c.created_at, "age"), _age_column(c.run_at, "due_age"),
            _age_column(c.finished_at, "finished_age"), _age_column(c.locked_at, "locked_age")]  # fmt: skip
    if status not in ("done", "cancelled"):
        stmt = select(*cols).where(*where).order_by(c.id.desc()).limit(limit)
        return [dict(r._mapping) for r in conn.execute(stmt)], False
    # The window is a subquery with a LIMIT, so it is computed on its own first (with the columns the filters
    # read); joined bare, the planner walked the primary key past every newer queued job instead.
    window = (
        select(c.id, c.task, c.queue)
        .where(c.status == const(status))
        .order_by(c.finished_at.desc())
        .limit(SEARCH_WINDOW)
        .subquery()
    )
    w = window.c
    picked = select(w.id).where(*_job_filters_on(w, task, queue))
    if before is not None:
        picked = picked.where(w.id < bindparam("before", before, type_=Integer))
    page = picked.order_by(w.id.desc()).limit(limit).subquery()
    stmt = select(*cols).join(page, page.c.id == c.id).order_by(c.id.desc())
    rows = [dict(r._mapping) for r in conn.execute(stmt)]
    cut = False
    if len(rows) < limit:
        cut = int(conn.execute(select(func.count()).select_from(window)).scalar_one()) >= SEARCH_WINDOW
    return rows, cut


def _job_filters_on(cols: Any, task: str | None, queue: str | None) -> list[ColumnElement[bool]]:
    """The task/queue filters on another selectable's columns (values bound)."""
    where: list[ColumnElement[bool]] = []
    if task is not None:
        where.append(cols.task == bindparam("f_task", task))
    if queue is not None:
        where.append(cols.queue == bindparam("f_queue", queue))
    return where


#: The most (queue, task) pairs the jobs page's summary lists: those with the most jobs.
SUMMARY_ROWS = 100


def job_summary(
    conn: Connection, spec: QueueSpec, cap: int = COUNT_CAP, limit: int = SUMMARY_ROWS
) -> tuple[list[dict[str, Any]], bool, int]:
    """Queued, running and failed jobs per (queue, task), by name: the ``limit`` pairs with the most jobs, and
    how many pairs are left out. Reads at most ``cap`` rows of each state: a state beyond that is summarised
    from its first ``cap`` rows (``True`` returned: the figures are a sample)."""
    c = spec.c
    sampled = False
    per: dict[tuple[str, str], dict[str, int]] = {}
    for status in ("queued", "running", "failed"):
        rows = select(c.queue, c.task).where(c.status == const(status)).limit(cap + 1).subquery()
        got = conn.execute(
            select(rows.c.queue, rows.c.task, func.count()).group_by(rows.c.queue, rows.c.task)
        ).all()
        if sum(int(n) for _, _, n in got) > cap:
            sampled = True
        for q, task, n in got:
            per.setdefault((q, task), {"queued": 0, "running": 0, "failed": 0})[status] = int(n)
    kept = sorted(per.items(), key=lambda kv: -sum(kv[1].values()))[:limit]
    return [{"queue": q, "task": t, **v} for (q, t), v in sorted(kept)], sampled, len(per) - len(kept)


def cancellable(
    conn: Connection, spec: QueueSpec, task: str | None, queue: str | None
) -> tuple[Count, list[int]]:
    """The queued and running jobs a cancel by task/queue reaches: how many (capped), and the first 100 of
    them — queued ones in the dequeue index's order, so the search stops after 100 index entries."""
    c = spec.c
    filters = job_filters(spec, {"task": task, "queue": queue})
    queued = (
        select(c.id)
        .where(c.status == const("queued"), *filters)
        .order_by(c.queue, c.priority.desc(), c.run_at, c.id)
        .limit(100)
    )
    running = select(c.id).where(c.status == const("running"), *filters).limit(100)
    first = sorted({*conn.execute(queued).scalars(), *conn.execute(running).scalars()})[:100]
    both = or_(c.status == const("queued"), c.status == const("running"))
    return capped_count(conn, spec, and_(both, *filters)), first


@dataclass(frozen=True)
class QueueRow:
    """A queue of a jobs table as the queues page shows it: ``admin.list_queues``' state with bounded counts."""

    name: str
    paused_at: datetime | None
    paused_by: str | None
    queued: Count
    running: int

    @property
    def paused(self) -> bool:
        return self.paused_at is not None


#: The most queues the queues page lists (a table of tens of thousands of queues — one per tenant, say —
#: must not make it read or render them all).
QUEUES_SHOWN = 100


def queue_rows(
    conn: Connection, spec: QueueSpec, cap: int = COUNT_CAP, limit: int = QUEUES_SHOWN
) -> tuple[list[QueueRow], bool]:
    """The queues with a state row or unfinished jobs (as ``admin.list_queues``), by name — at most ``limit``
    of them, the paused ones first when there are more (``True`` returned: more exist). Their queued jobs are
    counted through the dequeue index, ``cap`` entries in all (shared among the queues shown, at least 500
    each), estimated beyond; the queues with queued jobs are found by skipping through that index (one probe
    per queue, stopped after ``limit + 1``), not by reading every queued row."""
    c = spec.c
    table = queue_table(spec.table)
    queued = c.status == const("queued")
    # A loose index scan: the smallest queue name, then the next one after it, … (the index leads on queue).
    first = (
        select(c.queue.label("queue")).where(queued).order_by(c.queue).limit(1).cte("names", recursive=True)
    )
    step = select(c.queue).where(queued, c.queue > first.c.queue).order_by(c.queue).limit(1).scalar_subquery()
    names = first.union_all(select(step).where(first.c.queue.is_not(None)))
    with_queued = [
        q for q in conn.execute(select(names.c.queue).limit(limit + 1)).scalars() if q is not None
    ]  # (the recursion stops at the limit: the CTE is read as the outer query asks)
    running: dict[str, int] = dict(conn.execute(
        select(c.queue, func.count()).where(c.status == const("running")).group_by(c.queue)).all())  # fmt: skip
    # the state rows, paused ones first (one statement): a queue shown that is not among them is not paused
    stated = conn.execute(
        select(table).order_by(table.c.paused_at.is_(None), table.c.queue).limit(limit + 1)
    ).all()
    states = {r.queue: r for r in stated}
    paused = [r.queue for r in stated if r.paused_at is not None]
    ordered = [*paused, *sorted({*with_queued, *running, *states} - set(paused))]
    shown = sorted(ordered[:limit])
    more = len(ordered) > limit or len(with_queued) > limit or len(stated) > limit
    each = max(min(cap, 500), cap // max(1, len(shown)))
    out = []
    for name in shown:
        # (counted for every queue shown: one beyond the names the cut scan found may have queued jobs too)
        n = capped_count(conn, spec, and_(queued, c.queue == name), each)
        state = states.get(name)
        out.append(QueueRow(name, state.paused_at if state else None, state.paused_by if state else None, n,
                            int(running.get(name, 0))))  # fmt: skip
    return out, more


def pretty_json(value: Any) -> str:
    if value is None:
        return "null"
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def timestamp(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(sep=" ", timespec="seconds")
