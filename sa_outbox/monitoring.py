"""What an operator watches: depth, oldest ages, expired leases, attempts, dead letters and the aggregates
they block, deliveries failing because the destination is unavailable, table health and the xmin horizon — as frozen values for Python callers and as the data behind
``sa-outbox status/check``.

Every query reads the queue through its partial indexes (ready, leased/running, aggregate, dead/failed), so
it stays cheap on a table with millions of done rows; the number of done rows is counted exactly up to
``done_count_cap`` and estimated beyond that (``done_is_estimate`` says so).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime
from functools import cache
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Integer,
    Interval,
    bindparam,
    func,
    literal_column,
    or_,
    select,
    text,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import Select

from . import _partitions, _steps
from ._db import schema_checked
from ._durations import Duration, positive_int, to_seconds, to_timedelta
from ._sql import QueueSpec, const, queue_table, spec_for, translated_spec
from .errors import ConfigurationError

__all__ = [
    "BlockedAggregate",
    "DestinationOutage",
    "HorizonHolder",
    "QueueStatus",
    "TableHealth",
    "purge",
    "queue_status",
    "xmin_horizon",
]

DONE_COUNT_CAP = 100_000

log = logging.getLogger("sa_outbox.monitoring")


@dataclass(frozen=True)
class TableHealth:
    live_tuples: int
    dead_tuples: int
    dead_ratio: float
    last_vacuum: datetime | None
    last_autovacuum: datetime | None
    last_analyze: datetime | None
    last_autoanalyze: datetime | None
    autovacuum_count: int
    total_bytes: int


@dataclass(frozen=True)
class HorizonHolder:
    """Something that holds back this database's xmin horizon: VACUUM cannot remove dead tuples that became
    dead after it started (a transaction's snapshot or its own xid, a replication slot, a prepared
    transaction)."""

    kind: str  # transaction | replication_slot | prepared_transaction
    pid: int | None
    name: str  # application name, slot name or gid
    state: str | None
    age_seconds: float | None  # how long the transaction has been open
    xmin_age: int  # transactions since the oldest xid it holds back
    query: str | None
    #: what holds the horizon: "snapshot" (backend_xmin), "xid" (it wrote and has not ended; a READ COMMITTED
    #: session idle in transaction has no snapshot but still holds VACUUM back through its xid), or both.
    via: str = ""


@dataclass(frozen=True)
class BlockedAggregate:
    """An aggregate whose oldest dead message has later pending messages: an ordered dispatcher delivers none
    of them until an operator retries or skips the dead one (``sa-outbox dead retry|skip ID``)."""

    aggregate_type: str
    aggregate_id: str
    dead_id: int  # the first dead message of the aggregate
    waiting: int  # pending messages after it


@dataclass(frozen=True)
class DestinationOutage:
    """Deliveries are failing because the destination as a whole is unavailable: among the oldest due rows
    (the ones a dispatcher claims first) some were given back by a dispatcher that met
    :class:`~sa_outbox.DestinationUnavailable` — the broker is down or unreachable, and the dispatchers are
    probing it one message at a time (their circuit breaker) instead of spending attempts."""

    error: str  # the last_error of the first such row, with the cause when one carries it
    rows: int  # how many of the sampled rows say so
    sampled: int  # how many of the oldest due rows were read (at most OUTAGE_SAMPLE)


@dataclass(frozen=True)
class QueueStatus:
    """A snapshot of one outbox/jobs table. Ages are seconds (``None`` when there is no such row)."""

    table: str  # schema-qualified when the table is not in the search path's default schema
    kind: str  # outbox | jobs
    counts: dict[str, int]  # per status; "done" is exact up to done_count_cap
    done_is_estimate: bool
    #: For alerting: how long the oldest row that is due and not started (pending/queued, its available_at /
    #: run_at passed) has waited since it became due. Rows scheduled for later or deferred do not count.
    oldest_pending_age: float | None
    #: For information: age (from created_at) of the oldest unfinished row, due or not, started or not.
    oldest_unfinished_age: float | None
    expired_leases: int  # leased rows past their lease (outbox) / running jobs older than stale_after
    stale_after: float | None  # jobs: the reaping window expired_leases was counted with (seconds)
    attempts: dict[int, int]  # histogram over unfinished rows
    dead: int
    queues: dict[str, dict[str, int]]  # jobs: per queue, queued/running counts
    health: TableHealth | None
    blocked_aggregates: list[BlockedAggregate] = field(default_factory=list)  # outbox: the first few
    blocked_aggregates_total: int = 0
    horizon: list[HorizonHolder] = field(default_factory=list)
    #: About this table (expired leases, dead letters, blocked aggregates).
    warnings: list[str] = field(default_factory=list)
    #: About the whole database (what holds back the xmin horizon): the same for every table.
    horizon_warnings: list[str] = field(default_factory=list)
    #: Outbox: set while the oldest due rows say their destination was unavailable (see DestinationOutage).
    destination_unavailable: DestinationOutage | None = None
    #: Seconds since the last row finished ``done`` (``None`` when no done row is left: none yet, or purged).
    last_done_age: float | None = None
    #: Jobs: the paused queues (``sa-outbox jobs pause``) and since when (ISO 8601).
    paused_queues: dict[str, str] = field(default_factory=dict)
    #: Jobs: the concurrency keys with the most unfinished jobs (at most ``keys_limit``), queued/running each.
    concurrency_keys: dict[str, dict[str, int]] = field(default_factory=dict)
    #: The partitioned layout: partitions whose period has ended that unfinished or dead rows keep alive
    #: (``maintain_partitions`` retires a partition only once every row in it is finished).
    held_partitions: list[_partitions.PartitionInfo] = field(default_factory=list)
    #: The partitioned layout: how many partitions the table has (0 for a plain table).
    partitions: int = 0

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("last_vacuum", "last_autovacuum", "last_analyze", "last_autoanalyze"):
            if data["health"] and data["health"][key] is not None:
                data["health"][key] = data["health"][key].isoformat()
        data["attempts"] = {str(k): v for k, v in self.attempts.items()}
        data["held_partitions"] = [p.as_dict() for p in self.held_partitions]
        return data


regclass_name = _partitions.regclass_name


def _age(conn: Connection, expr: Any) -> float | None:
    value = conn.execute(select(func.extract("epoch", func.now() - expr))).scalar()
    return None if value is None else float(value)


#: The partitioned layout: the parent holds nothing; its leaf partitions' figures, summed (times: the latest).
_PARTITIONED_HEALTH = text(
    "SELECT sum(s.n_live_tup) AS n_live_tup, sum(s.n_dead_tup) AS n_dead_tup, max(s.last_vacuum) AS last_vacuum, "
    "max(s.last_autovacuum) AS last_autovacuum, max(s.last_analyze) AS last_analyze, "
    "max(s.last_autoanalyze) AS last_autoanalyze, sum(s.autovacuum_count) AS autovacuum_count, "
    "sum(pg_total_relation_size(s.relid)) AS total_bytes "
    "FROM pg_partition_tree(CAST(:t AS regclass)) p JOIN pg_stat_user_tables s ON s.relid = p.relid "
    "WHERE p.isleaf HAVING count(*) > 0"
)


def _health(conn: Connection, spec: QueueSpec) -> TableHealth | None:
    partitioned = _partitions.is_partitioned(conn, spec.table)
    row = conn.execute(
        _PARTITIONED_HEALTH
        if partitioned
        else text(
            "SELECT n_live_tup, n_dead_tup, last_vacuum, last_autovacuum, last_analyze, last_autoanalyze, "
            "autovacuum_count, pg_total_relation_size(relid) AS total_bytes "
            "FROM pg_stat_user_tables WHERE relid = CAST(:t AS regclass)"
        ),
        {"t": regclass_name(conn, spec.table)},
    ).first()
    if row is None:
        return None
    live, dead = int(row.n_live_tup), int(row.n_dead_tup)
    return TableHealth(
        live, dead, round(dead / (live + dead), 4) if live + dead else 0.0, row.last_vacuum, row.last_autovacuum,
        row.last_analyze, row.last_autoanalyze, int(row.autovacuum_count), int(row.total_bytes),
    )  # fmt: skip


# Only sessions of THIS database hold back its tables' horizon (PostgreSQL computes the data horizon per
# database; a snapshot in another database matters only for shared catalogs), plus walsenders, whose
# hot_standby_feedback holds every database. A session holds it through its snapshot (backend_xmin) or,
# without one, through its own xid (backend_xid: a READ COMMITTED session that wrote and sits idle in
# transaction). Autovacuum workers never hold it.
_TRANSACTIONS = text(
    """
    SELECT pid, application_name, state, EXTRACT(epoch FROM now() - xact_start) AS age,
           greatest(age(backend_xmin), age(backend_xid)) AS xmin_age,
           backend_xmin IS NOT NULL AS has_snapshot, backend_xid IS NOT NULL AS has_xid,
           left(query, 200) AS query
      FROM pg_stat_activity
     WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
       AND pid <> pg_backend_pid()
       AND (datname = current_database() OR backend_type = 'walsender')
       AND backend_type <> 'autovacuum worker'
     ORDER BY greatest(age(backend_xmin), age(backend_xid)) DESC
     LIMIT :n
    """
)


def xmin_horizon(conn: Connection, *, limit: int = 5) -> list[HorizonHolder]:
    """The oldest transactions of this database (by snapshot or by xid), replication slots and this
    database's prepared transactions holding back VACUUM of its tables, oldest first per kind."""
    limit = positive_int(limit, "limit")
    holders: list[HorizonHolder] = []
    for r in conn.execute(_TRANSACTIONS, {"n": limit}):
        age = None if r.age is None else float(r.age)
        via = " and ".join(w for w, on in (("snapshot", r.has_snapshot), ("xid", r.has_xid)) if on)
        holders.append(
            HorizonHolder(
                "transaction", r.pid, r.application_name or "", r.state, age, int(r.xmin_age), r.query, via
            )
        )
    for r in conn.execute(
        text(
            "SELECT slot_name, age(coalesce(xmin, catalog_xmin)) AS xmin_age FROM pg_replication_slots "
            "WHERE coalesce(xmin, catalog_xmin) IS NOT NULL"
        )
    ):
        holders.append(
            HorizonHolder("replication_slot", None, r.slot_name, None, None, int(r.xmin_age), None, "slot")
        )
    for r in conn.execute(
        text(
            "SELECT gid, EXTRACT(epoch FROM now() - prepared) AS age, age(transaction) AS xmin_age "
            "FROM pg_prepared_xacts WHERE database = current_database()"
        )
    ):
        holders.append(
            HorizonHolder(
                "prepared_transaction", None, r.gid, None, float(r.age), int(r.xmin_age), None, "xid"
            )
        )
    return holders


def long_horizon_holders(conn: Connection, long_transaction: Duration) -> list[HorizonHolder]:
    """:func:`xmin_horizon`, keeping transactions open at least ``long_transaction``."""
    threshold = to_seconds(long_transaction, name="long_transaction")
    return [h for h in xmin_horizon(conn) if h.kind != "transaction" or (h.age_seconds or 0) >= threshold]


def describe_holder(h: HorizonHolder) -> str:
    """One line naming what holds the horizon and what that costs (for status and doctor)."""
    if h.kind == "transaction":
        through = {"xid": "its uncommitted writes (xid)", "snapshot": "its snapshot"}.get(
            h.via, "its snapshot and uncommitted writes"
        )
        return (
            f"transaction pid {h.pid} ({h.name or 'no application_name'}, {h.state}) has been open "
            f"{h.age_seconds or 0:.0f}s and holds back the xmin horizon through {through} ({h.xmin_age} xids): "
            "VACUUM cannot remove dead queue rows and every SKIP LOCKED claim slows down; end it "
            f"(COMMIT/ROLLBACK in its client, or SELECT pg_terminate_backend({h.pid}))"
        )
    return f"{h.kind.replace('_', ' ')} {h.name!r} holds back the xmin horizon ({h.xmin_age} xids)"


@cache
def _blocked_statement(spec: QueueSpec) -> Select[Any]:
    """Aggregates whose first dead message has pending messages after it, first dead message first. Both
    sides read the aggregate partial index ``(aggregate_id, id) WHERE status IN (pending, processing, dead)``:
    the cost follows the unfinished and dead rows, never the done history."""
    dead, later = spec.table.alias("d"), spec.table.alias("w")
    heads = (
        select(dead.c.aggregate_type, dead.c.aggregate_id, func.min(dead.c.id).label("dead_id"))
        .where(dead.c.status == const(spec.dead))
        .group_by(dead.c.aggregate_type, dead.c.aggregate_id)
        .subquery("heads")
    )
    waiting = (
        select(func.count())
        .select_from(later)
        .where(
            later.c.aggregate_id == heads.c.aggregate_id,
            later.c.aggregate_type == heads.c.aggregate_type,
            later.c.id > heads.c.dead_id,
            later.c.status == const(spec.ready),
        )
        .scalar_subquery()
    )
    per_head = select(heads, waiting.label("waiting")).subquery("per_head")
    return (
        select(per_head, func.count().over().label("total"))
        .where(per_head.c.waiting > 0)
        .order_by(per_head.c.dead_id)
        .limit(bindparam("n", type_=Integer))
    )


#: How many of the oldest due rows are read to tell whether deliveries fail with DestinationUnavailable.
OUTAGE_SAMPLE = 20

# What a dispatcher writes in last_error when it gives a row back because its destination was unavailable:
# the message it published and the rest of its batch (``_steps``). tests/test_operations.py pins both
# against rows a real dispatcher wrote.
UNAVAILABLE_ERROR = _steps.UNAVAILABLE_PREFIX
UNAVAILABLE_RELEASE = _steps.RELEASED_UNAVAILABLE


@cache
def _oldest_due_statement(spec: QueueSpec) -> Select[Any]:
    """The ``:n`` oldest due ready rows in the claim's order, read through the ready partial index
    ``(available_at, id) WHERE status = 'pending'`` under a LIMIT: a few index entries and heap rows, never
    every pending row (tests/test_operations.py pins the plan)."""
    c = spec.c
    return (
        select(c.last_error)
        .where(c.status == const(spec.ready), spec.due <= func.now())
        .order_by(*spec.claim_order())
        .limit(bindparam("n", type_=Integer))
    )


@cache
def _last_done_statement(spec: QueueSpec) -> Select[Any]:
    """Seconds since the newest ``done`` row finished: max() over the done partial index (one entry)."""
    c = spec.c
    newest = select(func.max(spec.finished)).where(c.status == const(spec.done)).scalar_subquery()
    return select(func.extract("epoch", func.now() - newest))


def destination_outage(
    conn: Connection, spec: QueueSpec, sample: int = OUTAGE_SAMPLE
) -> DestinationOutage | None:
    """Whether the oldest due rows of an outbox were given back because the destination was unavailable."""
    if spec.kind != "outbox":
        return None
    errors = list(conn.execute(_oldest_due_statement(spec), {"n": sample}).scalars())
    marked = [e for e in errors if e and (e.startswith(UNAVAILABLE_ERROR) or e == UNAVAILABLE_RELEASE)]
    if not marked:
        return None
    first = next((e for e in marked if e.startswith(UNAVAILABLE_ERROR)), marked[0])
    return DestinationOutage(first, len(marked), len(errors))


def describe_outage(
    outage: DestinationOutage, oldest_pending_age: float | None, last_done_age: float | None
) -> str:
    """One line for status and doctor."""
    since = (
        f"no message delivered for {last_done_age:.0f}s"
        if last_done_age is not None
        else "no delivered message on record"
    )
    waited = f"; the oldest due message has waited {oldest_pending_age:.0f}s" if oldest_pending_age else ""
    return (
        f"deliveries are failing: the destination is unavailable ({outage.error}; {outage.rows} of the "
        f"{outage.sampled} oldest due messages were given back for it); {since}{waited}"
    )


def describe_held_partition(p: _partitions.PartitionInfo, spec: QueueSpec) -> str:
    """One line for status and doctor: a past partition that rows keep alive."""
    until = p.upper.isoformat() if p.upper is not None else "?"
    what = []
    if p.unfinished:
        what.append(f"{p.unfinished} unfinished ({spec.ready}/{spec.active}) row(s)")
    if p.dead:
        what.append(f"{p.dead} {spec.dead} row(s) ({dead_list_command(spec)})")
    return (
        f"partition {p.name} (ended {until}) is kept alive by {' and '.join(what)}: it is retired once every row "
        "in it is finished"
    )


def describe_closed_partition(p: _partitions.PartitionInfo, spec: QueueSpec) -> str:
    """One line for status and doctor: a partition closed to writes by a retire (``spec``: as the connection's
    schema_translate_map places the table, for the command it names)."""
    command = _partitions.partitions_command(spec)
    if p.detach_pending:
        return (
            f"partition {p.name} is being detached by a retire that has not finished (one in progress, or one "
            "interrupted): its rows are hidden — from the loops, and from dead list and retry — and cannot be "
            f"changed until `{command}` finishes the retire (it attaches the partition again if rows hold it)"
        )
    return (
        f"partition {p.name} is closed to writes by a retire that has not finished (one in progress, or a run "
        f"that stopped before detaching it): its rows cannot be changed until `{command}` retires it or opens "
        "it again"
    )


def describe_interrupted_retire(table: str, spec: QueueSpec) -> str:
    """One line for status and doctor: a table a retire has detached and not settled yet."""
    return (
        f"table {table} was detached by a retire that has not finished (one in progress, or a run that "
        "stopped): its rows are seen by no loop nor dead list until "
        f"`{_partitions.partitions_command(spec)}` counts them again and drops it, or attaches it again"
    )


def dead_list_command(spec: QueueSpec) -> str:
    """The command that lists this table's dead letters (``--jobs`` and the table option when needed)."""
    name = spec.table.fullname
    if spec.kind == "jobs":
        return "sa-outbox dead list --jobs" + ("" if name == "jobs" else f" --jobs-table {name}")
    return "sa-outbox dead list" + ("" if name == "outbox" else f" --outbox-table {name}")


_LIVE_TUPLES = text(
    "SELECT coalesce(s.n_live_tup, c.reltuples::bigint) FROM pg_class c "
    "LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid WHERE c.oid = CAST(:t AS regclass)"
)
#: The partitioned layout: the parent holds no rows, its leaf partitions do.
_LIVE_TUPLES_PARTITIONED = text(
    "SELECT coalesce(sum(coalesce(s.n_live_tup, greatest(c.reltuples, 0)::bigint)), 0) "
    "FROM pg_partition_tree(CAST(:t AS regclass)) p JOIN pg_class c ON c.oid = p.relid "
    "LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid WHERE p.isleaf"
)


def _done_count(conn: Connection, spec: QueueSpec, others: int, cap: int) -> tuple[int, bool]:
    """Done rows: counted exactly up to ``cap``; beyond it estimated from the statistics' live-tuple count
    (kept current by every insert and delete, so a purge shows at once — unlike reltuples, which only moves
    at the next VACUUM/ANALYZE) minus the unfinished and dead rows counted exactly."""
    t, c = spec.table, spec.c
    capped: Any = (
        select(literal_column("1")).select_from(t).where(c.status == const(spec.done)).limit(cap + 1)
    )
    done = int(conn.execute(select(func.count()).select_from(capped.subquery())).scalar_one())
    if done <= cap:
        return done, False
    live = conn.execute(
        _LIVE_TUPLES_PARTITIONED if _partitions.is_partitioned(conn, t) else _LIVE_TUPLES,
        {"t": regclass_name(conn, t)},
    ).scalar_one()
    return max(int(live) - others, cap + 1), True


@dataclass(frozen=True)
class Essentials:
    """What ``doctor`` reads of a table: the few figures it reports, none of the counts that read every
    unfinished row (a 500,000-row backlog made the full :func:`queue_status` cost over a second)."""

    kind: str
    dead: int
    expired_leases: int
    oldest_pending_age: float | None
    last_done_age: float | None
    destination_unavailable: DestinationOutage | None
    health: TableHealth | None


def essentials(conn: Connection, model: type[Any], *, stale_after: Duration = 60.0) -> Essentials:
    """The figures of :class:`Essentials` for one table, each through an index (dead rows, expired leases,
    the oldest due row, the newest done one) or the statistics views."""
    stale = to_timedelta(stale_after, name="stale_after", allow_zero=False)
    spec = spec_for(model)
    t, c = spec.table, spec.c
    dead = int(
        conn.execute(select(func.count()).select_from(t).where(c.status == const(spec.dead))).scalar_one()
    )
    params = {} if spec.kind == "outbox" else {"stale_after": stale}
    expired = int(
        conn.execute(select(func.count()).select_from(t).where(spec.lease_expired()), params).scalar_one()
    )
    oldest_due = conn.execute(
        select(func.min(spec.due)).where(c.status == const(spec.ready), spec.due <= func.now())
    ).scalar()
    last_done = conn.execute(_last_done_statement(spec)).scalar()
    return Essentials(
        spec.kind, dead, expired, _age(conn, oldest_due) if oldest_due is not None else None,
        None if last_done is None else float(last_done), destination_outage(conn, spec), _health(conn, spec),
    )  # fmt: skip


@schema_checked
def queue_status(
    engine: Engine | Connection,
    model: type[Any],
    *,
    stale_after: Duration = 60.0,
    long_transaction: Duration = 60.0,
    done_count_cap: int = DONE_COUNT_CAP,
    blocked_limit: int = 10,
    keys_limit: int = 10,
) -> QueueStatus:
    """A snapshot of one outbox/jobs table.

    ``stale_after`` is the workers' reaping window (a running job locked longer ago counts as an expired
    lease; pass the ``stale_after`` your workers use); ``long_transaction`` is the age at which an open
    transaction is reported as holding back the xmin horizon; at most ``blocked_limit`` blocked aggregates
    are listed (``blocked_aggregates_total`` counts them all), and the ``keys_limit`` busiest concurrency keys. Invalid options raise ``ConfigurationError``
    before any query."""
    stale = to_timedelta(stale_after, name="stale_after", allow_zero=False)
    to_seconds(long_transaction, name="long_transaction")
    if isinstance(done_count_cap, bool) or not isinstance(done_count_cap, int) or done_count_cap < 0:
        raise ConfigurationError(f"done_count_cap must be an integer >= 0, got {done_count_cap!r}")
    blocked_limit = positive_int(blocked_limit, "blocked_limit")
    keys_limit = positive_int(keys_limit, "keys_limit")
    if isinstance(engine, Engine):
        with engine.connect() as conn:
            return queue_status(conn, model, stale_after=stale, long_transaction=long_transaction,
                                done_count_cap=done_count_cap, blocked_limit=blocked_limit,
                                keys_limit=keys_limit)  # fmt: skip
    conn = engine
    spec = spec_for(model)
    t, c = spec.table, spec.c
    counts: dict[str, int] = {}
    for status in (spec.ready, spec.active, spec.dead):
        counts[status] = int(
            conn.execute(select(func.count()).select_from(t).where(c.status == const(status))).scalar_one()
        )
    if spec.kind == "jobs":
        counts["cancelled"] = int(
            conn.execute(select(func.count()).select_from(t).where(c.status == "cancelled")).scalar_one()
        )
    counts[spec.done], estimate = _done_count(conn, spec, sum(counts.values()), done_count_cap)

    # An OR of the two states, not IN: the planner ORs their two partial indexes (BitmapOr) for an OR, while
    # `status IN (…)` matches neither index predicate and fell to a Seq Scan of the jobs table (measured at
    # 1M rows: 180 ms per statement vs 23 ms).
    unfinished = or_(c.status == const(spec.ready), c.status == const(spec.active))
    oldest = conn.execute(select(func.min(c.created_at)).where(unfinished)).scalar()
    oldest_unfinished = _age(conn, oldest) if oldest is not None else None
    oldest_due = conn.execute(
        select(func.min(spec.due)).where(c.status == const(spec.ready), spec.due <= func.now())
    ).scalar()
    oldest_pending = _age(conn, oldest_due) if oldest_due is not None else None
    expired_q = select(func.count()).select_from(t).where(spec.lease_expired())
    params = {} if spec.kind == "outbox" else {"stale_after": stale}
    expired = int(conn.execute(expired_q, params).scalar_one())
    attempts = {
        int(a): int(n)
        for a, n in conn.execute(
            select(c.attempts, func.count()).where(unfinished).group_by(c.attempts).order_by(c.attempts)
        )
    }
    queues: dict[str, dict[str, int]] = {}
    if spec.kind == "jobs":
        for q, st, n in conn.execute(
            select(c.queue, c.status, func.count()).where(unfinished).group_by(c.queue, c.status)
        ):
            queues.setdefault(q, {spec.ready: 0, spec.active: 0})[st] = int(n)
    paused: dict[str, str] = {}
    keys: dict[str, dict[str, int]] = {}
    if spec.kind == "jobs":
        paused, keys = _jobs_extras(conn, spec, keys_limit)
    blocked: list[BlockedAggregate] = []
    blocked_total = 0
    if spec.kind == "outbox" and counts[spec.dead]:
        for r in conn.execute(_blocked_statement(spec), {"n": blocked_limit}):
            blocked.append(BlockedAggregate(r.aggregate_type, r.aggregate_id, int(r.dead_id), int(r.waiting)))
            blocked_total = int(r.total)
    outage = destination_outage(conn, spec)
    last_done = conn.execute(_last_done_statement(spec)).scalar()
    last_done_age = None if last_done is None else float(last_done)
    health = _health(conn, spec)
    horizon = long_horizon_holders(conn, long_transaction)
    warnings: list[str] = []
    if expired:
        warnings.append(f"{expired} expired lease(s): a dispatcher/worker crashed or its lease is too short")
    if counts[spec.dead]:
        warnings.append(f"{counts[spec.dead]} {spec.dead} row(s) need a person ({dead_list_command(spec)})")
    if blocked_total:
        first = blocked[0]
        warnings.append(
            f"{blocked_total} aggregate(s) have pending messages behind a dead one (the first: "
            f"{first.aggregate_type}/{first.aggregate_id}, {first.waiting} waiting behind dead {first.dead_id}): "
            "an ordered dispatcher delivers none of them until the dead message is retried or skipped"
        )
    parts = _partitions.list_partitions(conn, model, counts=False)
    held = _partitions.held_partitions(conn, model) if parts else []
    for p in held:
        warnings.append(describe_held_partition(p, spec))
    if parts:
        placed = translated_spec(conn, spec)
        warnings += [describe_closed_partition(p, placed) for p in parts if p.closed]
        warnings += [
            describe_interrupted_retire(n, placed) for n in _partitions.interrupted_retires(conn, model)
        ]
    if outage is not None:
        warnings.append(
            describe_outage(outage, oldest_pending, last_done_age) + ": the broker is down or unreachable and "
            "the dispatchers are probing it one message at a time; nothing goes dead for it, the backlog is "
            "delivered once it answers (check the broker, and the network and URL from the dispatchers' hosts)"
        )  # fmt: skip
    return QueueStatus(
        t.fullname, spec.kind, counts, estimate, oldest_pending, oldest_unfinished, expired,
        stale.total_seconds() if spec.kind == "jobs" else None, attempts, counts[spec.dead], queues, health,
        blocked, blocked_total, horizon, warnings, [describe_holder(h) for h in horizon], outage, last_done_age,
        paused, keys, held, len(parts),
    )  # fmt: skip


def _jobs_extras(
    conn: Connection, spec: QueueSpec, keys_limit: int
) -> tuple[dict[str, str], dict[str, dict[str, int]]]:
    """Paused queues (when the ``<jobs>_queues`` table exists) and the busiest concurrency keys."""
    c = spec.c
    paused: dict[str, str] = {}
    queues = queue_table(spec.table)
    if conn.execute(select(func.to_regclass(regclass_name(conn, queues)))).scalar() is not None:
        for name, at in conn.execute(
            select(queues.c.queue, queues.c.paused_at).where(queues.c.paused_at.is_not(None))
        ):
            paused[name] = at.isoformat()
    keys: dict[str, dict[str, int]] = {}
    if "concurrency_key" in c and keys_limit:
        queued = func.count().filter(c.status == const(spec.ready))
        running = func.count().filter(c.status == const(spec.active))
        stmt = (
            select(c.concurrency_key, queued, running)
            .where(
                or_(c.status == const(spec.ready), c.status == const(spec.active)), c.concurrency_key != ""
            )
            .group_by(c.concurrency_key)
            .order_by((queued + running).desc(), c.concurrency_key)
            .limit(keys_limit)
        )
        for key, q, r in conn.execute(stmt):
            keys[key] = {spec.ready: int(q), spec.active: int(r)}
    return paused, keys


@schema_checked
def purge(
    engine: Engine, model: type[Any], *, older_than: Duration, batch_size: int = 10_000, dry_run: bool = False
) -> int:
    """Delete ``done`` rows finished more than ``older_than`` before the call started, ``batch_size`` (>= 1)
    rows per short transaction (through the done index: no long lock, no huge transaction). The cutoff is
    fixed once from the database clock, so rows finished while it runs are left for the next purge and it
    ends under any load. Returns how many rows were (or, with ``dry_run``, would be) deleted. Pending,
    leased and dead rows are never touched. A database error part way is raised with ``deleted_before``: how
    many rows the committed batches deleted."""
    from ._sql import purge_selection, purge_statement

    spec = spec_for(model)
    age = to_timedelta(older_than, name="older_than")
    batch_size = positive_int(batch_size, "batch_size")
    with engine.connect() as conn:
        cutoff = conn.execute(select(func.now() - bindparam("age", age, type_=Interval))).scalar_one()
        if dry_run:
            sel = purge_selection(spec).subquery()
            return int(conn.execute(select(func.count()).select_from(sel), {"cutoff": cutoff}).scalar_one())
    stmt = purge_statement(spec)
    total = 0
    while True:
        try:
            with engine.begin() as conn:
                deleted = conn.execute(stmt, {"cutoff": cutoff, "batch": batch_size}).rowcount
        except (
            DBAPIError
        ) as exc:  # (an outage part way: what the earlier batches deleted goes with the error)
            exc.deleted_before = total  # type: ignore[attr-defined]
            raise
        total += deleted
        if deleted < batch_size:
            break
    log.info(
        "purged %d done row(s) of %s finished before %s", total, spec.table.fullname, cutoff.isoformat(),
        extra={"table": spec.table.fullname, "deleted": total},
    )  # fmt: skip
    return total
