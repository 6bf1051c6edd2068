"""The partitioned layout (``sa_outbox_partitioned``): schema, claims, rescue, dead letters, purge, status,
doctor and plans on a table partitioned by created_at; partitions created ahead and retired only once every
row in them is finished; a producer writing while partitions are retired loses nothing."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, MetaData, create_engine, insert, inspect, select, text, update
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import DeclarativeBase, Session
from sqlalchemy.schema import CreateTable

from sa_outbox import (
    AsyncDispatcher,
    ConfigurationError,
    Dispatcher,
    JobMixin,
    OutboxMixin,
    PartitionClosedError,
    PayloadError,
    SchemaError,
    Worker,
    _sql,
    enqueue,
    enqueue_many,
    list_partitions,
    maintain_partitions,
    purge,
    queue_status,
    retry_dead,
)
from sa_outbox._partitions import (
    PartitionReport,
    _detach,
    _retire,
    _settle_detached,
    partition_name,
    period_start,
)
from sa_outbox.doctor import doctor
from sa_outbox.migration import create_partitions, storage_parameters_sql
from sa_outbox.models import JobSchedule, OutboxEvent
from sa_outbox.testing import RecordingPublisher

from .conftest import ROOT
from .helpers import KEPT, fresh_schema
from .test_explain import nodes, scans
from .test_generic_plans import generic_plan

SCHEMA = "sa_outbox_parts"


class PBase(DeclarativeBase):
    metadata = MetaData(schema=SCHEMA)


class PEvent(OutboxMixin, PBase):
    __tablename__ = "pev"
    sa_outbox_partitioned = "day"


class PJob(JobMixin, PBase):
    __tablename__ = "pjobs"
    sa_outbox_partitioned = "day"


@pytest.fixture
def pengine(shared_engine: Engine) -> Iterator[Engine]:
    """Fresh partitioned outbox and jobs tables (create_all: today's partition and three ahead)."""
    with fresh_schema(shared_engine, SCHEMA, PBase.metadata):
        yield shared_engine


def day_start(engine: Engine, days_ago: int) -> datetime:
    with engine.connect() as conn:
        now = conn.execute(text("SELECT now()")).scalar_one()
    return period_start(now, "day") - timedelta(days=days_ago)


def add_past_partition(engine: Engine, model: Any, days_ago: int) -> tuple[str, datetime]:
    """A partition for the day ``days_ago`` days before today (maintain never creates past ones)."""
    table = model.__table__
    start = day_start(engine, days_ago)
    name = partition_name(table.name, start)
    with engine.begin() as conn:
        prep = conn.dialect.identifier_preparer
        ddl = _sql.create_partition_ddl(
            prep, table, name, start, start + timedelta(days=1), storage_parameters_sql()
        )
        conn.execute(text(ddl))
    return name, start


def add_events(engine: Engine, n: int, *, created_at: datetime | None = None, status: str = "pending",
               aggregate: str | None = None) -> list[int]:  # fmt: skip
    rows = [
        {"aggregate_type": "order", "aggregate_id": aggregate or f"a{i}", "event_type": "E", "payload": {"i": i},
         "status": status, **({"created_at": created_at} if created_at else {}),
         **({"done_at": created_at or datetime.now().astimezone()} if status == "done" else {})}
        for i in range(n)
    ]  # fmt: skip
    with engine.begin() as conn:
        return list(conn.execute(insert(PEvent).returning(PEvent.id), rows).scalars())


def maintain_in_thread(engine: Engine) -> tuple[threading.Thread, dict[str, Any]]:
    """``maintain_partitions(engine, PEvent)`` started in a thread of its own; its report lands under
    ``"report"`` once the thread ends."""
    result: dict[str, Any] = {}
    t = threading.Thread(target=lambda: result.update(report=maintain_partitions(engine, PEvent)))
    t.start()
    return t, result


def yesterday_with_an_open_writer(engine: Engine) -> tuple[str, datetime, Connection, Any]:
    """Yesterday's partition holding two done events, and a transaction that has written a pending "Today"
    event into today's partition and is still open: it uses the parent, so a ``DETACH … CONCURRENTLY`` waits
    for it, and it holds nothing of yesterday's partition. (the partition's name and start, the writer's
    connection, its transaction)"""
    name, start = add_past_partition(engine, PEvent, 1)
    add_events(engine, 2, created_at=start, status="done")
    writer = engine.connect()
    tx = writer.begin()
    writer.execute(
        insert(PEvent).values(aggregate_type="o", aggregate_id="today", event_type="Today", payload={})
    )
    return name, start, writer, tx


def ddl_waits(engine: Engine, pattern: str, seconds: float = 30) -> bool:
    """Wait (bounded) until a statement like ``pattern`` (``ALTER TABLE%DETACH%``, ``ALTER TABLE%ADD
    CONSTRAINT%``) waits for a lock; whether it did."""
    deadline = time.monotonic() + seconds
    with engine.connect() as watcher:
        while time.monotonic() < deadline:
            waiting = watcher.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE query LIKE :pattern "
                    "AND wait_event_type = 'Lock' AND datname = current_database()"
                ),
                {"pattern": pattern},
            ).scalar_one()
            watcher.rollback()
            if waiting:
                return True
            time.sleep(0.02)
    return False


def detach_waits(engine: Engine, seconds: float = 30) -> bool:
    return ddl_waits(engine, "ALTER TABLE%DETACH%", seconds)


def close_waits(engine: Engine, seconds: float = 30) -> bool:
    return ddl_waits(engine, "ALTER TABLE%ADD CONSTRAINT%", seconds)


def is_open(engine: Engine, name: str) -> bool:
    """Whether partition ``name`` takes a write (an insert through the parent, of its rows' first
    ``created_at``; rolled back)."""
    with engine.connect() as conn, conn.begin() as tx:
        try:
            conn.execute(
                text(f"INSERT INTO {SCHEMA}.pev (aggregate_type, aggregate_id, event_type, payload, "
                     "created_at) SELECT 'o', 'probe', 'E', '{}', min(created_at) FROM " + f"{SCHEMA}.{name}")
            )  # fmt: skip
            return True
        except DBAPIError:
            return False
        finally:
            tx.rollback()


def names(engine: Engine, model: Any) -> list[str]:
    return [p.name for p in list_partitions(engine, model, counts=False)]


# --- schema --------------------------------------------------------------------------------------------------


def test_partitioned_layout_is_range_partitioned_on_created_at_with_id_and_created_at_as_key(
    pengine: Engine,
) -> None:
    ddl = str(CreateTable(PEvent.__table__).compile(dialect=pengine.dialect))
    assert "PARTITION BY RANGE (created_at)" in ddl
    assert list(PEvent.__table__.primary_key.columns.keys()) == ["id", "created_at"]
    assert [c.name for c in inspect(PEvent).primary_key] == ["id"]  # the ORM identity stays the id
    assert "ux_pjobs_unique" not in {i.name for i in PJob.__table__.indexes}
    with Session(pengine) as s:
        s.add(PEvent(aggregate_type="order", aggregate_id="1", event_type="E", payload={}))
        s.commit()
        assert s.get(PEvent, 1) is not None


def test_a_bad_period_is_refused_naming_the_value() -> None:
    class Base(DeclarativeBase):
        pass

    with pytest.raises(ConfigurationError, match=r"sa_outbox_partitioned = 'hour'.*'day', 'week', 'month'"):

        class Hourly(OutboxMixin, Base):
            __tablename__ = "hourly"
            sa_outbox_partitioned = "hour"


def test_create_all_creates_todays_partition_and_three_ahead_with_the_storage_parameters(
    pengine: Engine,
) -> None:
    today = day_start(pengine, 0)
    expected = [partition_name("pev", today + timedelta(days=d)) for d in range(4)]
    assert names(pengine, PEvent) == expected
    with pengine.connect() as conn:
        options = conn.execute(
            text("SELECT reloptions FROM pg_class WHERE oid = CAST(:t AS regclass)"),
            {"t": f"{SCHEMA}.{expected[0]}"},
        ).scalar_one()
    assert "autovacuum_vacuum_scale_factor=0.01" in options


def test_the_migration_helper_creates_partitions_idempotently(pengine: Engine) -> None:
    with pengine.begin() as conn:
        for name in names(pengine, PEvent)[1:]:
            conn.execute(text(f"DROP TABLE {SCHEMA}.{name}"))
        created = create_partitions(conn, "pev", period="day", schema=SCHEMA, ahead=2)
        again = create_partitions(conn, "pev", period="day", schema=SCHEMA, ahead=2)
    assert len(created) == 2 and again == []
    assert len(names(pengine, PEvent)) == 3


def test_a_row_without_a_partition_is_refused_not_swallowed(pengine: Engine) -> None:
    with pytest.raises(DBAPIError, match="no partition of relation"):
        add_events(pengine, 1, created_at=day_start(pengine, 30))


def test_unique_key_enqueue_and_schedules_are_refused_on_a_partitioned_jobs_table(pengine: Engine) -> None:
    with Session(pengine) as s:
        with pytest.raises(ConfigurationError, match=r"partitioned by created_at.*unique_key"):
            enqueue(s, PJob, "t", {}, unique_key="k")
        with pytest.raises(ConfigurationError, match="partitioned"):
            enqueue_many(s, PJob, [{"task": "t", "payload": {}, "unique_key": "k"}])
        job = enqueue(s, PJob, "t", {})  # a plain enqueue works
        s.commit()
        assert job.id is not None
    with pytest.raises(ConfigurationError, match="schedules cannot fire into"):
        Worker(pengine, PJob, {"t": lambda j: None}, schedules=JobSchedule)


# --- the loops on the partitioned layout -----------------------------------------------------------------------


def test_claim_and_ordered_claim_across_partitions(pengine: Engine) -> None:
    _, yesterday = add_past_partition(pengine, PEvent, 1)
    old = add_events(pengine, 2, created_at=yesterday + timedelta(hours=1), aggregate="X")
    new = add_events(pengine, 2, aggregate="X")
    pub = RecordingPublisher()
    d = Dispatcher(pengine, PEvent, pub, ordered=True, listen=False)
    for _ in range(4):
        assert d.run_once() == 1  # one head at a time, across the two partitions
    assert pub.ids == old + new
    with pengine.connect() as conn:
        assert conn.execute(select(PEvent.status).distinct()).scalars().all() == ["done"]
    plain = RecordingPublisher()
    add_events(pengine, 5)
    assert Dispatcher(pengine, PEvent, plain, batch=10, listen=False).run_once() == 5


def test_the_statement_that_finishes_a_head_claims_its_successor_across_partitions(pengine: Engine) -> None:
    """The partitioned layout's ordered probe (a plain NOT EXISTS) also skips the rows the statement's own
    finalize finished: the successor is claimed by the statement that writes its predecessor's ``done`` — in
    the same partition and across two — and not by one whose outcome the fence turned away."""
    from sa_outbox import _steps

    spec = _sql.spec_for(PEvent)
    _, yesterday = add_past_partition(pengine, PEvent, 1)
    old = add_events(pengine, 2, created_at=yesterday + timedelta(hours=1), aggregate="X")
    new = add_events(pengine, 1, aggregate="X")

    def turn(outcome: Any) -> tuple[set[int], list[Any]]:
        with pengine.begin() as conn:
            return _steps.finalize_and_claim(
                conn, spec, [outcome], owner="A", batch=10, lease=timedelta(seconds=30), ordered=True
            )

    with pengine.begin() as conn:
        [head] = _steps.claim(conn, spec, owner="A", batch=10, lease=timedelta(seconds=30), ordered=True)
    assert head[0] == old[0]
    assert turn(_steps.Outcome(head[0], head[1] - 1, "done")) == (
        set(),
        [],
    )  # fenced out: old[1] stays blocked
    applied, [second] = turn(_steps.Outcome(head[0], head[1], "done"))
    assert applied == {old[0]} and second[0] == old[1]
    applied, [third] = turn(_steps.Outcome(second[0], second[1], "done"))
    assert applied == {old[1]} and third[0] == new[0]  # in today's partition


def test_rescue_and_dead_retry_on_the_partitioned_layout(pengine: Engine) -> None:
    add_past_partition(pengine, PJob, 2)
    with pengine.begin() as conn:
        conn.execute(insert(PJob), [{"task": "t", "payload": {}, "created_at": day_start(pengine, 2),
                                     "status": "running", "locked_at": datetime.now().astimezone() - timedelta(hours=1),
                                     "locked_by": "crashed", "lease_version": 1, "attempts": 1}])  # fmt: skip
    seen: list[int] = []
    w = Worker(pengine, PJob, {"t": lambda j: seen.append(j.lease_version)}, stale_after=60, listen=False)
    w.run_once()  # rescues the stale job, then claims it again
    assert seen == [2]
    add_events(pengine, 1)
    d = Dispatcher(pengine, PEvent, RecordingPublisher(fail=lambda m: _permanent()), listen=False)
    assert d.run_once() == 1
    assert retry_dead(pengine, PEvent, all=True) == [1]
    with pengine.connect() as conn:
        assert conn.execute(select(PEvent.status)).scalar_one() == "pending"


def _permanent() -> BaseException:
    from sa_outbox import PermanentError

    return PermanentError("nope")


def test_purge_deletes_done_rows_of_every_partition(pengine: Engine) -> None:
    _, yesterday = add_past_partition(pengine, PEvent, 1)
    add_events(pengine, 3, created_at=yesterday, status="done")
    add_events(pengine, 2, status="done")
    add_events(pengine, 1)
    assert purge(pengine, PEvent, older_than=0) == 5
    with pengine.connect() as conn:
        assert conn.execute(select(PEvent.status)).scalars().all() == ["pending"]


# --- plans ------------------------------------------------------------------------------------------------------


def test_the_claims_update_prunes_to_the_partitions_of_the_picked_rows(pengine: Engine) -> None:
    for days in (1, 2, 3):
        _, start = add_past_partition(pengine, PEvent, days)
        add_events(pengine, 20, created_at=start, status="done")
    add_events(pengine, 5)  # today's partition only
    stmt = _sql.claim_statement(_sql.spec_for(PEvent), limit=50)
    with pengine.connect() as conn:
        compiled = stmt.compile(dialect=conn.dialect)
        params = compiled.construct_params({"owner": "explain", "lease": timedelta(seconds=60)})
        raw = conn.exec_driver_sql("EXPLAIN (ANALYZE, FORMAT JSON) " + str(compiled), params).scalar_one()
        conn.rollback()
    plan = raw[0]["Plan"]
    assert plan["Node Type"] == "ModifyTable" and plan["Actual Rows"] == 5
    [append] = [n for n in plan["Plans"] if n["Node Type"] == "Append"]
    # 7 partitions (3 past, today, 3 ahead): pruned at run time on the picked rows' created_at range, the
    # UPDATE reads today's partition only (the others: "never executed").
    read = [s[1] for s in scans(append) if s[0] != "Append"]
    executed = [
        n.get("Relation Name") for n in nodes(append) if "Scan" in n["Node Type"] and n["Actual Loops"]
    ]
    assert len(read) == 7 and executed == [names(pengine, PEvent)[3]], (read, executed)


def test_the_generic_plan_of_the_claim_reads_the_ready_index_of_each_partition(pengine: Engine) -> None:
    big, start = add_past_partition(pengine, PEvent, 1)
    for _ in range(5):
        add_events(pengine, 1000, created_at=start, status="done")
    add_events(pengine, 50)
    with pengine.begin() as conn:
        conn.execute(text(f"ANALYZE {SCHEMA}.pev"))
    stmt = _sql.claim_statement(_sql.spec_for(PEvent), limit=50)
    p = generic_plan(pengine, stmt, {"owner": "w", "lease": timedelta(seconds=60)})
    assert not [n for n in nodes(p) if n["Node Type"] in ("Hash Join", "Nested Loop", "Merge Join")], scans(p)
    assert not [s for s in scans(p) if s[0] == "Seq Scan" and s[1] == big], scans(p)
    limits = [n for n in nodes(p) if n["Node Type"] == "Limit"]
    [lock_rows] = [n for n in limits[0]["Plans"] if n["Parent Relationship"] != "InitPlan"]
    assert lock_rows["Node Type"] == "LockRows"
    # The partition full of history is read through its copy of the ready index (tiny partitions may be
    # read whole: the planner's right choice at their size).
    assert ("Index Scan", big, f"{big}_available_at_id_idx") in scans(lock_rows), scans(lock_rows)


@pytest.mark.parametrize("which", ["outbox rescue", "jobs rescue", "outbox finalize", "jobs finalize",
                                   "outbox finalize, one outcome", "jobs finalize, one outcome",
                                   "outbox extend", "ordered claim"])  # fmt: skip
def test_generic_plans_of_the_other_statements_never_read_a_partition_whole(
    pengine: Engine, which: str
) -> None:
    big, start = add_past_partition(pengine, PEvent, 1)
    jbig, jstart = add_past_partition(pengine, PJob, 1)
    for _ in range(5):
        add_events(pengine, 1000, created_at=start, status="done")
    with pengine.begin() as conn:
        conn.execute(
            text(f"INSERT INTO {SCHEMA}.pjobs (task, payload, status, created_at) "
                 "SELECT 't', '{}', 'done', :c FROM generate_series(1, 5000)"), {"c": jstart},
        )  # fmt: skip
        conn.execute(text(f"ANALYZE {SCHEMA}.pev"))
        conn.execute(text(f"ANALYZE {SCHEMA}.pjobs"))
    ev, jobs = _sql.spec_for(PEvent), _sql.spec_for(PJob)
    outcomes = {"ids": [1, 2], "versions": [1, 1], "statuses": ["done", "done"], "delays": [None, None],
                "errors": [None, None], "refunds": [0, 0], "results": [None, None]}  # fmt: skip
    one = {"o_id": 1, "o_version": 1, "o_status": "done", "o_delay": None, "o_error": None, "o_refund": 0,
           "o_result": None}  # fmt: skip
    stmt, params = {
        "outbox rescue": (_sql.rescue_statement(ev), {"limit": 1000, "max_attempts": 12, **KEPT}),
        "jobs rescue": (_sql.rescue_statement(jobs), {"limit": 1000, "stale_after": timedelta(seconds=60), **KEPT}),
        "outbox finalize": (_sql.finalize_statement(ev), outcomes),
        "jobs finalize": (_sql.finalize_statement(jobs), outcomes),
        "outbox finalize, one outcome": (_sql.finalize_statement(ev, single=True), one),
        "jobs finalize, one outcome": (_sql.finalize_statement(jobs, single=True), one),
        "outbox extend": (_sql.extend_statement(ev), {"lease": timedelta(seconds=60), "ids": [1], "versions": [1]}),
        "ordered claim": (_sql.claim_statement(ev, ordered=True), {"owner": "w", "batch": 50,
                                                                    "lease": timedelta(seconds=60)}),
    }[which]  # fmt: skip
    p = generic_plan(pengine, stmt, params)
    # The partition holding 5,000 rows is read through an index (the empty ones may be read whole: the
    # planner's right choice at their size, and a hash join over what the index scans return is fine).
    assert [s for s in scans(p) if s[1] in (big, jbig)], scans(p)
    whole = [s for s in scans(p) if s[0] == "Seq Scan" and s[1] in (big, jbig)]
    assert not whole, scans(p)


# --- maintenance ------------------------------------------------------------------------------------------------


def test_maintain_retires_finished_partitions_and_keeps_those_with_unfinished_or_dead_rows(
    pengine: Engine,
) -> None:
    finished, f_start = add_past_partition(pengine, PEvent, 3)
    pending, p_start = add_past_partition(pengine, PEvent, 2)
    dead, d_start = add_past_partition(pengine, PEvent, 1)
    add_events(pengine, 10, created_at=f_start, status="done")
    add_events(pengine, 9, created_at=p_start, status="done")
    kept_id = add_events(pengine, 1, created_at=p_start)[0]
    add_events(pengine, 1, created_at=d_start, status="dead")
    report = maintain_partitions(pengine, PEvent)
    assert report.retired == [finished] and report.errors == []
    assert report.kept == {pending: {"unfinished": 1, "dead": 0}, dead: {"unfinished": 0, "dead": 1}}
    assert finished not in names(pengine, PEvent)
    with pengine.connect() as conn:
        assert conn.execute(select(PEvent.id).where(PEvent.status == "pending")).scalars().all() == [kept_id]
    # Once its row is finished the partition goes; dead rows go only with keep_dead=False.
    with pengine.begin() as conn:
        conn.execute(update(PEvent).where(PEvent.id == kept_id).values(status="done", done_at=p_start))
    assert maintain_partitions(pengine, PEvent).retired == [pending]
    assert maintain_partitions(pengine, PEvent, keep_dead=False).retired == [dead]


def test_maintain_can_archive_instead_of_dropping(pengine: Engine) -> None:
    name, start = add_past_partition(pengine, PEvent, 1)
    add_events(pengine, 3, created_at=start, status="done")
    report = maintain_partitions(pengine, PEvent, archive=True)
    assert report.archived == [name] and report.retired == []
    assert name not in names(pengine, PEvent)
    with pengine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {SCHEMA}.{name}")).scalar_one() == 3


def test_maintain_creates_the_partitions_ahead_and_refuses_a_plain_table(pengine: Engine) -> None:
    with pengine.begin() as conn:
        for name in names(pengine, PEvent)[1:]:
            conn.execute(text(f"DROP TABLE {SCHEMA}.{name}"))
    report = maintain_partitions(pengine, PEvent, ahead=5)
    assert len(report.created) == 5 and len(names(pengine, PEvent)) == 6
    from sa_outbox.models import OutboxEvent

    with pytest.raises(SchemaError, match="not a partitioned table"):
        maintain_partitions(pengine, OutboxEvent)


def test_an_events_explicit_created_at_is_kept_on_every_write_path(pengine: Engine) -> None:
    """``created_at`` is part of the partitioned table's key and picks the partition: a value given to
    ``session.add`` is written as given (it was silently replaced by now(), in today's partition — a hostile
    review), as with an INSERT statement; an ``id`` given by hand is refused, naming it (it was dropped)."""
    name, start = add_past_partition(pengine, PEvent, 1)
    at = start + timedelta(hours=1)
    fields = {"aggregate_type": "o", "aggregate_id": "1", "event_type": "E", "payload": {}}
    with Session(pengine) as s, s.begin():
        s.add(PEvent(**fields, created_at=at))
        s.execute(insert(PEvent), [{**fields, "created_at": at}])
        s.add(PEvent(**fields))
    with pengine.connect() as conn:
        rows = conn.execute(
            text(f"SELECT tableoid::regclass::text AS part, created_at FROM {SCHEMA}.pev ORDER BY id")
        )
        got = [(r.part.split(".")[-1], r.created_at == at) for r in rows]
    assert got[:2] == [(name, True), (name, True)] and got[2][0] != name, got
    with pytest.raises(PayloadError, match="id is given"), Session(pengine) as s, s.begin():
        s.add(PEvent(**fields, id=10**9))
        s.flush()
    with pytest.raises(PayloadError, match="id is given"), Session(pengine) as s, s.begin():
        s.add(OutboxEvent(**fields, id=10**9))
        s.flush()


def late_producer(engine: Engine, start: datetime, aggregate: str = "1") -> tuple[Connection, Any, int]:
    """A transaction (left open) that has written a pending "Late" event of ``aggregate`` into the partition
    starting at ``start``: (its connection, the transaction, the row's id)."""
    producer = engine.connect()
    tx = producer.begin()
    row_id = producer.execute(
        insert(PEvent).values(aggregate_type="o", aggregate_id=aggregate, event_type="Late", payload={},
                              created_at=start).returning(PEvent.id)
    ).scalar_one()  # fmt: skip
    return producer, tx, row_id


def late_commit_while_closing(
    engine: Engine, start: datetime, *, watch: Engine | None = None
) -> tuple[threading.Thread, dict[str, Any], int]:
    """A late producer (:func:`late_producer`, aggregate "A") commits while a maintainer, started in a thread
    after its insert, waits to close the partition (seen from ``watch``, default ``engine``): (the maintainer's
    thread, still running, its result, the late row's id)."""
    producer, tx, row_id = late_producer(engine, start, "A")
    t, result = maintain_in_thread(engine)
    try:
        assert close_waits(watch or engine), "the maintainer never tried to close the partition"
    finally:
        tx.commit()
        producer.close()
    return t, result, row_id


def test_a_producer_writing_into_a_partition_being_retired_keeps_it(pengine: Engine) -> None:
    """The count before closing cannot see an uncommitted row; closing the partition waits for that producer,
    and the count in the same transaction finds its row: the partition is kept, open, and its rows delivered
    in order — the aggregate's next event, written into today's partition after it, comes second. (Before, a
    DETACH … CONCURRENTLY hid the row while the partition was "detach pending": the next event came first, a
    hostile review.) A producer that outlasts the close's lock timeout makes the run report it, and leaves
    the partition attached and open."""
    name, start = add_past_partition(pengine, PEvent, 1)
    add_events(pengine, 3, created_at=start, status="done")
    t, result, row_id = late_commit_while_closing(pengine, start)
    with pengine.begin() as conn:  # the aggregate's next event
        conn.execute(
            insert(PEvent).values(aggregate_type="o", aggregate_id="A", event_type="Next", payload={})
        )
    pub = RecordingPublisher()
    d = Dispatcher(pengine, PEvent, pub, listen=False, ordered=True)
    deadline = time.monotonic() + 30
    while len(pub.messages) < 2 and time.monotonic() < deadline:
        d.run_once()
    d.close()
    t.join(60)
    assert not t.is_alive()
    assert [m.event_type for m in pub.messages] == ["Late", "Next"]
    report = result["report"]
    assert report.kept == {name: {"unfinished": 1, "dead": 0}} and not report.errors, report
    assert name in names(pengine, PEvent) and is_open(pengine, name)
    with pengine.connect() as conn:
        assert conn.execute(select(PEvent.status).where(PEvent.id == row_id)).scalar_one() == "done"
    producer, tx, _ = late_producer(pengine, start, "B")  # holds the partition past the close's lock timeout
    try:
        report = maintain_partitions(pengine, PEvent)
    finally:
        tx.commit()
        producer.close()
    assert [e.split(":")[0] for e in report.errors] == [name] and "lock timeout" in report.errors[0], report
    assert name in names(pengine, PEvent) and is_open(pengine, name)
    assert maintain_partitions(pengine, PEvent).kept == {name: {"unfinished": 1, "dead": 0}}


def test_the_close_counts_after_its_lock_whatever_the_sessions_isolation(
    pengine: Engine, db_url: URL
) -> None:
    """A maintainer whose sessions default to REPEATABLE READ: the close's count still sees the row a late
    producer committed while the close waited for its lock. (Its count used the transaction's snapshot, taken
    before the wait: the partition was closed and detached with the pending row inside, and while the detach
    waited for an older transaction the aggregate's next event was delivered first — a hostile review.)"""
    name, start, writer, writer_tx = yesterday_with_an_open_writer(pengine)  # would keep a DETACH waiting
    producer, tx, _ = late_producer(pengine, start, "A")
    rr = create_engine(db_url, connect_args={"options": "-c default_transaction_isolation=repeatable\\ read"})
    t, result = maintain_in_thread(rr)
    pub = RecordingPublisher()
    d = Dispatcher(pengine, PEvent, pub, listen=False, ordered=True)
    try:
        assert close_waits(pengine), "the maintainer never tried to close the partition"
        tx.commit()
        producer.close()
        detach_waits(
            pengine, seconds=3
        )  # (the old code's detach, with the row inside, waited for the writer)
        with pengine.begin() as conn:
            conn.execute(
                insert(PEvent).values(aggregate_type="o", aggregate_id="A", event_type="Next", payload={})
            )
        for _ in range(5):
            d.run_once()
    finally:
        writer_tx.commit()
        writer.close()
        t.join(60)
        rr.dispose()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len([m for m in pub.messages if m.aggregate_id == "A"]) < 2:
        d.run_once()
    d.close()
    assert [m.event_type for m in pub.messages if m.aggregate_id == "A"] == ["Late", "Next"]
    assert result["report"].kept == {name: {"unfinished": 1, "dead": 0}}, result["report"]
    assert is_open(pengine, name)


def test_reopening_a_partition_left_closed_waits_for_its_lock_no_longer_than_the_close(
    pengine: Engine,
) -> None:
    """A partition a run closed and could not retire (it died, or its detach was refused) is opened again by
    the next run that keeps it — a DDL whose lock wait stalls the claims: it gives up like the close, reports
    it, and a later run opens it (a hostile review: a claim waited out an 8 s reader's transaction)."""
    name, start = add_past_partition(pengine, PEvent, 1)
    add_events(pengine, 2, created_at=start, status="dead")
    with pengine.begin() as conn:
        conn.execute(text(_sql.close_partition_ddl(conn.dialect.identifier_preparer, name, SCHEMA)))
    assert not is_open(pengine, name)
    with pengine.connect() as reader:
        reader.execute(text(f"SELECT count(*) FROM {SCHEMA}.{name}"))  # holds the partition
        t, result = maintain_in_thread(pengine)
        t.join(30)
        finished_while_held = not t.is_alive()
        reader.rollback()
    t.join(30)
    assert finished_while_held, "the reopen waited for the reader's transaction"
    report = result["report"]
    assert report.kept == {name: {"unfinished": 0, "dead": 2}}, report
    assert len(report.errors) == 1 and "lock timeout" in report.errors[0], report
    assert maintain_partitions(pengine, PEvent).errors == [] and is_open(pengine, name)


def test_a_write_into_a_closed_partition_fails_even_from_an_older_snapshot(pengine: Engine) -> None:
    """A REPEATABLE READ producer whose snapshot predates the retire still sees the partition attached while
    its DETACH … CONCURRENTLY runs, and routed its insert into it; once the detach returned, the drop took the
    committed row (a hostile review). The partition is closed before the detach: that insert fails, loudly."""
    name, start, writer, writer_tx = yesterday_with_an_open_writer(pengine)  # keeps the DETACH waiting
    producer = pengine.connect().execution_options(isolation_level="REPEATABLE READ")
    tx = producer.begin()
    producer.execute(text("SELECT 1"))  # its snapshot
    t, result = maintain_in_thread(pengine)
    try:
        assert detach_waits(pengine), "the maintainer never reached its DETACH"
        with pytest.raises(DBAPIError, match="sa_outbox_retiring"):
            producer.execute(
                insert(PEvent).values(aggregate_type="o", aggregate_id="rr", event_type="E", payload={},
                                      created_at=start + timedelta(hours=1))
            )  # fmt: skip
    finally:
        tx.rollback()
        producer.close()
        writer_tx.commit()
        writer.close()
        t.join(60)
    assert not t.is_alive()
    assert result["report"].retired == [name] and not result["report"].errors, result["report"]


def test_a_retire_whose_process_died_mid_detach_is_finished_by_the_next_run(
    pengine: Engine, db_url: URL
) -> None:
    """The maintaining process is killed (-9) while its DETACH … CONCURRENTLY waits for an older transaction;
    the server completes the detach once that transaction ends, and the partition is a table of its own. The
    next run finds it by its mark, counts again and finishes the retire; the other rows are delivered."""
    name, _, writer, tx = yesterday_with_an_open_writer(pengine)
    code = (
        "from sqlalchemy import create_engine\n"
        "from sa_outbox import maintain_partitions\n"
        "from tests.test_partitions import PEvent\n"
        f"maintain_partitions(create_engine({db_url.render_as_string(hide_password=False)!r}), PEvent)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    maintainer = subprocess.Popen([sys.executable, "-c", code], env=env)
    detached = False
    try:
        assert detach_waits(pengine), "the maintainer never reached its DETACH"
        maintainer.kill()
        maintainer.wait(10)
    finally:
        tx.commit()
        writer.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not detached:  # the server finishes the detach on its own
        detached = name not in names(pengine, PEvent)
        time.sleep(0.05)
    assert detached, "the detach did not complete on the server"
    with pengine.connect() as conn:
        assert conn.execute(text(f"SELECT to_regclass('{SCHEMA}.{name}') IS NOT NULL")).scalar_one()
    [found] = [f for f in doctor(pengine, [PEvent]) if f.check == "partitions" and name in f.message]
    assert found.status == "warn" and "detached by a retire" in found.message, found
    assert [w for w in queue_status(pengine, PEvent).warnings if name in w and "detached by a retire" in w]
    report = maintain_partitions(pengine, PEvent)
    assert report.retired == [name] and not report.errors, report
    with pengine.connect() as conn:
        assert conn.execute(text(f"SELECT to_regclass('{SCHEMA}.{name}') IS NULL")).scalar_one()
    assert [f.status for f in doctor(pengine, [PEvent]) if f.check == "partitions"] == ["ok"]
    pub = RecordingPublisher()
    Dispatcher(pengine, PEvent, pub, listen=False).run_once()
    assert [m.event_type for m in pub.messages] == ["Today"]


def test_a_second_maintainer_leaves_a_detach_in_progress_to_its_own_maintainer(pengine: Engine) -> None:
    """Every loop runs the partition step, so two maintainers meet: while the first's DETACH … CONCURRENTLY
    waits for an older transaction, the partition reads "detach pending" — as one whose maintainer died. The
    second's FINALIZE finishes it, or the first does and the second's FINALIZE finds nothing to finish. Either
    way the loser's failed DETACH is no failure of its run (the model-based suite met it: "could not finish an
    interrupted detach: … is not a partition of …"; the other order: "could not retire it: …"), and no
    partition is left "detach pending"."""
    name, _, writer, tx = yesterday_with_an_open_writer(pengine)
    reports: dict[str, Any] = {}
    first = threading.Thread(target=lambda: reports.update(first=maintain_partitions(pengine, PEvent)))
    second = threading.Thread(target=lambda: reports.update(second=maintain_partitions(pengine, PEvent)))
    first.start()
    try:
        assert detach_waits(pengine), "the first maintainer never reached its DETACH"
        assert [
            p.detach_pending for p in list_partitions(pengine, PEvent, counts=False) if p.name == name
        ] == [True]
        second.start()
        assert ddl_waits(pengine, "%DETACH%FINALIZE%"), (
            "the second maintainer never tried to finish the detach"
        )
    finally:
        tx.commit()
        writer.close()
        first.join(60)
        second.join(60)
    assert not first.is_alive() and not second.is_alive()
    assert not reports["first"].errors and not reports["second"].errors, (reports["first"], reports["second"])
    assert not [p for p in list_partitions(pengine, PEvent, counts=False) if p.detach_pending]
    assert maintain_partitions(pengine, PEvent).errors == []
    assert name not in names(pengine, PEvent)
    pub = RecordingPublisher()
    Dispatcher(pengine, PEvent, pub, listen=False).run_once()
    assert [m.event_type for m in pub.messages] == ["Today"]


def test_a_close_that_meets_another_maintainers_detach_is_no_failure(pengine: Engine) -> None:
    """A maintainer that listed the partitions before another one began its detach tries to close the
    partition, and waits for the lock the other's DETACH … CONCURRENTLY holds until its timeout: the other
    maintainer settles that partition, and the run reports no error."""
    name, _, writer, tx = yesterday_with_an_open_writer(pengine)
    stale = list_partitions(pengine, PEvent, counts=False)
    first, result = maintain_in_thread(pengine)
    report = PartitionReport(PEvent.__table__.fullname)
    try:
        assert detach_waits(pengine), "the first maintainer never reached its DETACH"
        with pengine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            _retire(conn, _sql.spec_for(PEvent), stale, archive=False, keep_dead=True, report=report)
    finally:
        tx.commit()
        writer.close()
        first.join(60)
    assert report == PartitionReport(PEvent.__table__.fullname), report
    assert result["report"].retired == [name] and not result["report"].errors, result["report"]


def test_a_detach_that_finds_another_maintainers_detach_pending_is_no_failure(pengine: Engine) -> None:
    """A maintainer that closed the partition before another one began its detach sends its own DETACH …
    CONCURRENTLY while the other's waits for an older transaction: PostgreSQL refuses it, "already pending
    detach" (55000). That partition is the other maintainer's to settle, not a failure of this run (CI's
    model-based suite through PgBouncer on PostgreSQL 18 met it: "could not retire it: … already pending
    detach": the partition reading "detach pending" afterwards was taken for this run's own failed step)."""
    name, _, writer, tx = yesterday_with_an_open_writer(pengine)
    first, result = maintain_in_thread(pengine)
    try:
        assert detach_waits(pengine), "the first maintainer never reached its DETACH"
        with pengine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            assert _detach(conn, PEvent.__table__, name, mode="concurrently") is False
    finally:
        tx.commit()
        writer.close()
        first.join(60)
    assert result["report"].retired == [name] and not result["report"].errors, result["report"]


def test_settling_a_retire_that_another_maintainer_settled_meanwhile_is_no_failure(pengine: Engine) -> None:
    """The second half of a retire (count again, then attach or drop), run on a partition another maintainer
    has just attached again: its ATTACH fails ("… is already a partition"), and that is no failure — the table
    is no marked, detached one any more. On a table still marked and detached, a failure is raised: here the
    ATTACH's lock timeout."""
    name, start = add_past_partition(pengine, PEvent, 1)
    add_events(pengine, 1, created_at=start)  # unfinished: the settle attaches it
    spec, day = _sql.spec_for(PEvent), timedelta(days=1)
    report = PartitionReport(PEvent.__table__.fullname)
    with pengine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        _settle_detached(conn, spec, name, start, start + day, archive=False, keep_dead=True, report=report)
        assert report == PartitionReport(PEvent.__table__.fullname)
        prep = conn.dialect.identifier_preparer
        conn.execute(text(_sql.detach_partition_ddl(prep, PEvent.__table__, name, mode="concurrently")))
        marker = (
            f"{_sql.RETIRING}drop|{start.isoformat()}|{(start + day).isoformat()}|{PEvent.__table__.fullname}"
        )
        conn.execute(text(_sql.comment_table_ddl(prep, name, SCHEMA, marker)))
        with pengine.connect() as holder:
            holder.execute(text(f"LOCK TABLE {SCHEMA}.pev IN SHARE UPDATE EXCLUSIVE MODE"))
            conn.execute(text("SET lock_timeout = '200ms'"))
            try:
                with pytest.raises(DBAPIError, match="lock timeout"):
                    _settle_detached(
                        conn, spec, name, start, start + day, archive=False, keep_dead=True, report=report
                    )
            finally:
                conn.execute(text("RESET lock_timeout"))
                holder.rollback()
        conn.execute(text(f"DROP TABLE {SCHEMA}.{name}"))


def test_concurrent_producers_lose_nothing_while_maintain_retires(pengine: Engine) -> None:
    """Producers write into yesterday's partition (explicit created_at) and today's while maintain runs again
    and again: every insert that committed is still in the table (an insert that met a detached partition
    failed loudly instead)."""
    _, start = add_past_partition(pengine, PEvent, 1)
    add_events(pengine, 5, created_at=start, status="done")
    committed: list[int] = []
    refused: list[str] = []
    stop = threading.Event()

    def produce() -> None:
        i = 0
        while not stop.is_set() and i < 400:
            i += 1
            values: dict[str, Any] = {
                "aggregate_type": "o",
                "aggregate_id": str(i),
                "event_type": "E",
                "payload": {},
            }
            if i % 2:
                values["created_at"] = start + timedelta(minutes=1)
            try:
                with pengine.begin() as conn:
                    committed.append(
                        conn.execute(insert(PEvent).values(values).returning(PEvent.id)).scalar_one()
                    )
            except DBAPIError as exc:
                refused.append(str(exc.orig))

    t = threading.Thread(target=produce)
    t.start()
    try:
        reports = [maintain_partitions(pengine, PEvent) for _ in range(6)]
    finally:
        stop.set()
        t.join(60)
    assert committed
    # (an insert that met the partition closed, or detached, failed loudly)
    assert all("no partition" in r or "sa_outbox_retiring" in r for r in refused), refused[:3]
    with pengine.connect() as conn:
        present = set(conn.execute(select(PEvent.id)).scalars())
    assert set(committed) <= present, sorted(set(committed) - present)[:10]
    assert all(not r.errors for r in reports), [r.errors for r in reports]


# --- status and doctor -------------------------------------------------------------------------------------------


def test_status_shows_unfinished_rows_held_in_old_partitions(pengine: Engine) -> None:
    name, start = add_past_partition(pengine, PEvent, 2)
    add_events(pengine, 2, created_at=start)
    add_events(pengine, 1, created_at=start, status="dead")
    add_events(pengine, 4)
    st = queue_status(pengine, PEvent)
    assert st.counts["pending"] == 6 and st.partitions == 5
    [held] = st.held_partitions
    assert (held.name, held.unfinished, held.dead) == (name, 2, 1)
    assert any(name in w and "2 unfinished" in w for w in st.warnings), st.warnings
    assert json.loads(json.dumps(st.as_dict()))["held_partitions"][0]["name"] == name
    assert (
        st.health is not None and st.health.total_bytes > 0
    )  # the partitions' figures, not the empty parent's


def test_doctors_autovacuum_fix_names_the_partitions(pengine: Engine) -> None:
    first = names(pengine, PEvent)[-1]
    with pengine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {SCHEMA}.{first} RESET (autovacuum_vacuum_scale_factor)"))
    [f] = [f for f in doctor(pengine, [PEvent]) if f.check == "autovacuum settings"]
    assert f.status == "warn" and f.fix is not None
    assert f.fix.splitlines()[-1].startswith(
        f"ALTER TABLE {SCHEMA}.{first} SET (autovacuum_vacuum_scale_factor"
    )
    for line in f.fix.splitlines():  # each line runs as printed
        with pengine.begin() as conn:
            conn.execute(text(line))
    assert [g.status for g in doctor(pengine, [PEvent]) if g.check == "autovacuum settings"] == ["ok"]


def test_doctor_flags_missing_partitions_and_held_ones(pengine: Engine) -> None:
    def partition_findings() -> list[Any]:
        return [f for f in doctor(pengine, [PEvent]) if f.check == "partitions"]

    assert [f.status for f in partition_findings()] == ["ok"]
    claim = [f for f in doctor(pengine, [PEvent]) if f.check in ("claim plan", "autovacuum settings")]
    assert [f.status for f in claim] == ["ok", "ok"], claim
    with pengine.begin() as conn:
        conn.execute(text(f"DROP TABLE {SCHEMA}.{names(pengine, PEvent)[1]}"))  # tomorrow's
    [f] = partition_findings()
    assert (
        f.status == "warn"
        and "inserts will fail when it starts" in f.message
        and "partitions maintain" in (f.fix or "")
    )
    with pengine.begin() as conn:
        conn.execute(text(f"DROP TABLE {SCHEMA}.{names(pengine, PEvent)[0]}"))  # today's
    assert partition_findings()[0].status == "fail"
    maintain_partitions(pengine, PEvent)
    name, start = add_past_partition(pengine, PEvent, 1)
    add_events(pengine, 1, created_at=start)
    [f] = partition_findings()
    assert f.status == "warn" and name in f.message


# --- the loops' maintenance step and the CLI ----------------------------------------------------------------------


def test_a_dispatchers_first_run_once_creates_missing_partitions(pengine: Engine) -> None:
    with pengine.begin() as conn:
        for name in names(pengine, PEvent)[1:]:
            conn.execute(text(f"DROP TABLE {SCHEMA}.{name}"))
    d = Dispatcher(pengine, PEvent, RecordingPublisher(), listen=False, maintain_partitions=3600)
    d.run_once()
    assert d.partitions is not None
    d.partitions.wait(60)
    assert len(names(pengine, PEvent)) == 4
    assert d.partitions.last is not None and len(d.partitions.last.created) == 3
    d.run_once()  # not due again for an hour: nothing started
    assert not d.partitions.busy()


def test_a_workers_partition_step_creates_them_too_and_claims_go_on(pengine: Engine) -> None:
    with pengine.begin() as conn:
        for name in names(pengine, PJob)[1:]:
            conn.execute(text(f"DROP TABLE {SCHEMA}.{name}"))
    with Session(pengine) as s, s.begin():
        enqueue_many(s, PJob, [("t", {"n": i}) for i in range(3)])
    ran: list[int] = []
    w = Worker(
        pengine, PJob, {"t": lambda j: ran.append(j.id)}, batch=5, listen=False, maintain_partitions=60
    )
    assert w.run_once() == 3 and sorted(ran) == [1, 2, 3]
    assert w.partitions is not None
    w.partitions.wait(60)
    assert len(names(pengine, PJob)) == 4


def test_an_async_loops_partition_step_runs_as_a_task(pengine: Engine, async_url: URL) -> None:
    with pengine.begin() as conn:
        for name in names(pengine, PEvent)[1:]:
            conn.execute(text(f"DROP TABLE {SCHEMA}.{name}"))

    async def main() -> None:
        aengine = create_async_engine(async_url)
        try:
            d = AsyncDispatcher(aengine, PEvent, RecordingPublisher(), listen=False, maintain_partitions=3600)
            await d.run_once()
            assert d.partitions is not None and d.partitions.task is not None
            await d.partitions.task
        finally:
            await aengine.dispose()

    asyncio.run(main())
    assert len(names(pengine, PEvent)) == 4


def test_a_plain_table_turns_the_step_off_with_one_warning(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    from sa_outbox.models import OutboxEvent

    d = Dispatcher(engine, OutboxEvent, RecordingPublisher(), listen=False, maintain_partitions=1)
    d.run_once()
    assert d.partitions is not None
    d.partitions.wait(30)
    assert not d.partitions.enabled
    assert [r.message for r in caplog.records if "partition maintenance turned off" in r.message]


def test_cli_partitions_list_and_maintain(
    pengine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    from sa_outbox._cli import main

    name, start = add_past_partition(pengine, PEvent, 1)
    add_events(pengine, 2, created_at=start, status="done")
    url = ["--url", db_url.render_as_string(hide_password=False), "--outbox-table", f"{SCHEMA}.pev",
           "--jobs-table", f"{SCHEMA}.pjobs"]  # fmt: skip
    assert main(["partitions", "list", "--json", *url]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed[f"{SCHEMA}.pev"][0]["name"] == name
    assert main(["partitions", "maintain", "--json", *url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report[f"{SCHEMA}.pev"]["retired"] == [name]
    assert main(["partitions", "maintain", *url, "--outbox-table", "outbox", "--jobs-table", "jobs"]) == 2
    assert "no partitioned table" in capsys.readouterr().err


def test_rows_in_a_partition_left_closed_are_refused_whole_naming_it_until_maintain_opens_it(
    pengine: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `--retire-dead` run closes a past partition whose only unfinished rows are dead, to drop it; a run that
    stops before its detach leaves it closed. Its rows cannot be changed: retrying or skipping them is refused
    before anything is written (not batch by batch, the first batches committed), naming the partition; status,
    doctor and `partitions list` show it; a maintain that keeps dead rows opens it, and the retry then works."""
    from sa_outbox._cli import main
    from sa_outbox.admin import retry_jobs, skip_dead

    name, start = add_past_partition(pengine, PEvent, 1)
    jname, _ = add_past_partition(pengine, PJob, 1)
    old = add_events(pengine, 2, created_at=start, status="dead")
    new = add_events(pengine, 1, status="dead")
    with pengine.begin() as conn:
        [job] = conn.execute(
            insert(PJob).values(task="t", payload={}, status="failed", created_at=start).returning(PJob.id)
        ).scalars()
        for part in (name, jname):
            conn.execute(text(_sql.close_partition_ddl(conn.dialect.identifier_preparer, part, SCHEMA)))

    def statuses() -> list[str]:
        with pengine.connect() as conn:
            return list(conn.execute(select(PEvent.status).order_by(PEvent.id)).scalars())

    url = ["--url", db_url.render_as_string(hide_password=False), "--outbox-table", f"{SCHEMA}.pev",
           "--jobs-table", f"{SCHEMA}.pjobs"]  # fmt: skip
    for act in (retry_dead, skip_dead):
        for dry_run in (True, False):  # a dry run says what the call would do: refuse
            with pytest.raises(PartitionClosedError, match=rf"2 of the selected row\(s\).*{name} \(2\).*"
                                                           r"Nothing was changed$") as refused:  # fmt: skip
                act(pengine, PEvent, all=True, batch_size=1, dry_run=dry_run)
            assert (refused.value.changed, refused.value.partitions) == ([], {name: 2})
        assert statuses() == ["dead", "dead", "dead"]  # today's row, in the first batch, neither
    with pytest.raises(SchemaError, match=rf"{jname} \(1\)"):
        retry_jobs(pengine, PJob, ids=[job])
    assert retry_dead(pengine, PEvent, ids=new) == new  # rows elsewhere are not held back

    st = queue_status(pengine, PEvent)
    assert any(name in w and "closed to writes" in w for w in st.warnings), st.warnings
    closed = [f for f in doctor(pengine, [PEvent, PJob]) if f.check == "partitions" and "closed" in f.message]
    assert sorted(n for f in closed for n in (name, jname) if n in f.message) == sorted([name, jname])
    assert all(f.status == "warn" and "partitions maintain" in (f.fix or "") for f in closed), closed
    held = [f for f in doctor(pengine, [PEvent, PJob]) if "kept alive" in f.message]
    assert held == [], held  # ("retry its rows" would be refused: the closed finding says what to do)
    assert main(["dead", "retry", "--all", "--json", *url]) == 2
    out, err = capsys.readouterr()
    assert out == "" and name in err and "Nothing was changed" in err
    assert main(["partitions", "list", *url]) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if name in x]
    assert "closed to writes" in line
    assert main(["partitions", "list", "--json", *url]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [p["closed"] for p in listed[f"{SCHEMA}.pev"] if p["name"] == name] == [True]

    assert maintain_partitions(pengine, PEvent).kept == {name: {"unfinished": 0, "dead": 2}}
    assert maintain_partitions(pengine, PJob).kept == {jname: {"unfinished": 0, "dead": 1}}
    assert is_open(pengine, name) and is_open(pengine, jname)
    assert retry_dead(pengine, PEvent, all=True) == old
    assert retry_jobs(pengine, PJob, ids=[job]) == [job]
    assert not [f for f in doctor(pengine, [PEvent, PJob]) if "closed" in f.message]


def test_a_partition_closed_while_a_retry_runs_stops_it_with_the_ids_already_changed(pengine: Engine) -> None:
    """The refusal is checked once, before the batches; a partition a retire closes between two batches stops
    the call at the batch that meets it, with the same error, counting every selected row the partition holds
    (not only that batch's) and carrying every id the earlier batches changed."""
    from sqlalchemy import event

    name, start = add_past_partition(pengine, PEvent, 1)
    first = add_events(pengine, 1, status="dead")  # today's: the first batch
    add_events(pengine, 2, created_at=start, status="dead")
    statements: list[str] = []

    def close_before_the_second_batch(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith(("UPDATE", "WITH")) and "requeued" in str(args):
            statements.append(statement)
            if len(statements) == 2:
                with pengine.begin() as other:
                    prep = other.dialect.identifier_preparer
                    other.execute(text(_sql.close_partition_ddl(prep, name, SCHEMA)))

    event.listen(pengine, "before_cursor_execute", close_before_the_second_batch)
    try:
        with pytest.raises(PartitionClosedError, match=rf"cannot retry 2 .*{name} \(2\).*It was closed while "
                                                       rf"this ran: 1 row\(s\) were changed before it: {first[0]}$"
                           ) as stopped:  # fmt: skip
            retry_dead(pengine, PEvent, all=True, batch_size=1)
    finally:
        event.remove(pengine, "before_cursor_execute", close_before_the_second_batch)
    assert len(statements) == 2
    assert (stopped.value.changed, stopped.value.partitions) == (first, {name: 2})
    with pengine.connect() as conn:
        assert list(conn.execute(select(PEvent.status).order_by(PEvent.id)).scalars()) == [
            "pending",
            "dead",
            "dead",
        ]
