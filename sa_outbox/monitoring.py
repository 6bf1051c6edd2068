"""What an operator watches: depth, oldest age, expired leases, attempts, dead letters, table health and
the xmin horizon — as frozen values for Python callers and as the data behind ``sa-outbox status/check``.

Every query reads the queue through its partial indexes (ready, leased/running, dead/failed), so it stays
cheap on a table with millions of done rows; the number of done rows is counted exactly up to
``done_count_cap`` and estimated from the planner's statistics beyond that.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, Interval, bindparam, func, literal_column, select, text

from ._durations import Duration, to_seconds
from ._sql import QueueSpec, const, spec_for

__all__ = ["HorizonHolder", "QueueStatus", "TableHealth", "purge", "queue_status", "xmin_horizon"]

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
    """Something that holds back the xmin horizon (VACUUM cannot remove dead tuples newer than it)."""

    kind: str  # transaction | replication_slot | prepared_transaction
    pid: int | None
    name: str  # application name, slot name or gid
    state: str | None
    age_seconds: float | None  # how long the transaction has been open
    xmin_age: int  # transactions since its xmin
    query: str | None


@dataclass(frozen=True)
class QueueStatus:
    table: str
    kind: str  # outbox | jobs
    counts: dict[str, int]  # per status; "done" is exact up to done_count_cap
    done_is_estimate: bool
    oldest_pending_age: (
        float | None
    )  # seconds; the most important number (pending/processing | queued/running)
    oldest_ready_age: float | None  # seconds since the oldest *due* ready row became due
    expired_leases: int  # leased rows past their lease (outbox) / running jobs older than stale_after
    attempts: dict[int, int]  # histogram over unfinished rows
    dead: int
    queues: dict[str, dict[str, int]]  # jobs: per queue, queued/running counts
    health: TableHealth | None
    horizon: list[HorizonHolder] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("last_vacuum", "last_autovacuum", "last_analyze", "last_autoanalyze"):
            if data["health"] and data["health"][key] is not None:
                data["health"][key] = data["health"][key].isoformat()
        data["attempts"] = {str(k): v for k, v in self.attempts.items()}
        return data


def _age(conn: Connection, expr: Any) -> float | None:
    value = conn.execute(select(func.extract("epoch", func.now() - expr))).scalar()
    return None if value is None else float(value)


def _health(conn: Connection, spec: QueueSpec) -> TableHealth | None:
    row = conn.execute(
        text(
            "SELECT n_live_tup, n_dead_tup, last_vacuum, last_autovacuum, last_analyze, last_autoanalyze, "
            "autovacuum_count, pg_total_relation_size(relid) AS total_bytes "
            "FROM pg_stat_user_tables WHERE relid = CAST(:t AS regclass)"
        ),
        {"t": spec.table.fullname},
    ).first()
    if row is None:
        return None
    live, dead = int(row.n_live_tup), int(row.n_dead_tup)
    return TableHealth(
        live, dead, round(dead / (live + dead), 4) if live + dead else 0.0, row.last_vacuum, row.last_autovacuum,
        row.last_analyze, row.last_autoanalyze, int(row.autovacuum_count), int(row.total_bytes),
    )  # fmt: skip


def xmin_horizon(conn: Connection, *, limit: int = 5) -> list[HorizonHolder]:
    """The oldest transactions, replication slots and prepared transactions holding back VACUUM."""
    holders: list[HorizonHolder] = []
    for r in conn.execute(
        text(
            "SELECT pid, application_name, state, EXTRACT(epoch FROM now() - xact_start) AS age, "
            "age(backend_xmin) AS xmin_age, left(query, 200) AS query FROM pg_stat_activity "
            "WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid() "
            "ORDER BY age(backend_xmin) DESC LIMIT :n"
        ),
        {"n": limit},
    ):
        age = None if r.age is None else float(r.age)
        holders.append(
            HorizonHolder(
                "transaction", r.pid, r.application_name or "", r.state, age, int(r.xmin_age), r.query
            )
        )
    for r in conn.execute(
        text(
            "SELECT slot_name, age(coalesce(xmin, catalog_xmin)) AS xmin_age FROM pg_replication_slots "
            "WHERE coalesce(xmin, catalog_xmin) IS NOT NULL"
        )
    ):
        holders.append(
            HorizonHolder("replication_slot", None, r.slot_name, None, None, int(r.xmin_age), None)
        )
    for r in conn.execute(
        text(
            "SELECT gid, EXTRACT(epoch FROM now() - prepared) AS age, age(transaction) AS xmin_age FROM pg_prepared_xacts"
        )
    ):
        holders.append(
            HorizonHolder("prepared_transaction", None, r.gid, None, float(r.age), int(r.xmin_age), None)
        )
    return holders


def queue_status(
    engine: Engine | Connection,
    model: type[Any],
    *,
    stale_after: Duration = 60.0,
    long_transaction: Duration = 60.0,
    done_count_cap: int = DONE_COUNT_CAP,
) -> QueueStatus:
    """A snapshot of one outbox/jobs table. ``stale_after`` is the jobs reaping window (what counts as an
    expired lease for jobs); ``long_transaction`` is the age at which an open transaction is reported as
    holding back the xmin horizon."""
    if isinstance(engine, Engine):
        with engine.connect() as conn:
            return queue_status(conn, model, stale_after=stale_after, long_transaction=long_transaction,
                                done_count_cap=done_count_cap)  # fmt: skip
    conn = engine
    spec = spec_for(model)
    t, c = spec.table, spec.c
    counts: dict[str, int] = {}
    for status in (spec.ready, spec.active, spec.dead):
        counts[status] = int(
            conn.execute(select(func.count()).select_from(t).where(c.status == const(status))).scalar_one()
        )
    capped: Any = (
        select(literal_column("1"))
        .select_from(t)
        .where(c.status == const(spec.done))
        .limit(done_count_cap + 1)
    )
    done = int(conn.execute(select(func.count()).select_from(capped.subquery())).scalar_one())
    estimate = done > done_count_cap
    if estimate:
        reltuples = conn.execute(
            text("SELECT reltuples::bigint FROM pg_class WHERE oid = CAST(:t AS regclass)"), {"t": t.fullname}
        ).scalar_one()
        done = max(int(reltuples) - sum(counts.values()), done_count_cap)
    counts[spec.done] = done

    unfinished = c.status.in_([const(spec.ready), const(spec.active)])
    oldest = conn.execute(select(func.min(c.created_at)).where(unfinished)).scalar()
    oldest_age = _age(conn, oldest) if oldest is not None else None
    oldest_due = conn.execute(
        select(func.min(spec.due)).where(c.status == const(spec.ready), spec.due <= func.now())
    ).scalar()
    oldest_ready_age = _age(conn, oldest_due) if oldest_due is not None else None
    expired_q = select(func.count()).select_from(t).where(spec.lease_expired())
    params = {} if spec.kind == "outbox" else {"stale_after": _td(stale_after)}
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
    health = _health(conn, spec)
    threshold = to_seconds(long_transaction, name="long_transaction")
    horizon = [h for h in xmin_horizon(conn) if h.kind != "transaction" or (h.age_seconds or 0) >= threshold]
    warnings: list[str] = []
    for h in horizon:
        if h.kind == "transaction":
            warnings.append(
                f"transaction pid {h.pid} ({h.name or 'no application_name'}, {h.state}) has been open "
                f"{h.age_seconds:.0f}s and holds back the xmin horizon: VACUUM cannot remove dead queue rows "
                "and every SKIP LOCKED claim slows down; end it (pg_terminate_backend) or fix the client"
            )
        else:
            warnings.append(
                f"{h.kind.replace('_', ' ')} {h.name!r} holds back the xmin horizon ({h.xmin_age} xids)"
            )
    if expired:
        warnings.append(f"{expired} expired lease(s): a dispatcher/worker crashed or its lease is too short")
    if counts[spec.dead]:
        warnings.append(f"{counts[spec.dead]} {spec.dead} row(s) need a person (sa-outbox dead list)")
    return QueueStatus(
        t.name, spec.kind, counts, estimate, oldest_age, oldest_ready_age, expired, attempts, counts[spec.dead],
        queues, health, horizon, warnings,
    )  # fmt: skip


def _td(value: Duration) -> Any:
    from ._durations import to_timedelta

    return to_timedelta(value, name="stale_after")


def purge(
    engine: Engine, model: type[Any], *, older_than: Duration, batch_size: int = 10_000, dry_run: bool = False
) -> int:
    """Delete ``done`` rows finished more than ``older_than`` before the call started, ``batch_size`` (>= 1)
    rows per short transaction (through the done index: no long lock, no huge transaction). The cutoff is
    fixed once from the database clock, so rows finished while it runs are left for the next purge and it
    ends under any load. Returns how many rows were (or, with ``dry_run``, would be) deleted. Pending,
    leased and dead rows are never touched."""
    from ._durations import to_timedelta
    from ._loop import positive_int
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
        with engine.begin() as conn:
            deleted = conn.execute(stmt, {"cutoff": cutoff, "batch": batch_size}).rowcount
        total += deleted
        if deleted < batch_size:
            break
    log.info(
        "purged %d done row(s) of %s finished before %s", total, spec.table.fullname, cutoff.isoformat(),
        extra={"table": spec.table.fullname, "deleted": total},
    )  # fmt: skip
    return total
