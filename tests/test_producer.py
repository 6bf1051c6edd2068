"""The write side: rows exist iff the caller's transaction commits; per-aggregate commit order; bad input."""

from __future__ import annotations

import datetime as dt
import decimal
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from sa_outbox import PayloadError, emit, enqueue
from sa_outbox._names import channel_for
from sa_outbox._producer import LOCK_AGGREGATES
from sa_outbox.models import Job, OutboxEvent

from .commit_order import assert_serialised, ids_by_payload, race
from .conftest import count_rows
from .models import Order


def _event(agg: str = "A", n: int = 0, **kw: Any) -> OutboxEvent:
    return OutboxEvent(
        aggregate_type="order", aggregate_id=agg, event_type="OrderChanged", **{"payload": {"n": n}, **kw}
    )


@contextmanager
def statement_log(engine: Engine) -> Iterator[list[str]]:
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, params: Any, context: Any, executemany: bool) -> None:
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


# --- rows go out with the caller's transaction, or not at all ---------------------------------------------


def test_event_and_job_written_in_callers_transaction(engine: Engine) -> None:
    with Session(engine, expire_on_commit=False) as s, s.begin():
        s.add(_event())
        job = enqueue(s, Job, "send_email", {"to": "a@example.com"}, queue="mail", priority=5)
    assert count_rows(engine, "outbox", "status = 'pending' AND attempts = 0 AND lease_version = 0") == 1
    assert count_rows(engine, "jobs", "status = 'queued' AND queue = 'mail' AND priority = 5") == 1
    assert job.id == 1


def test_rollback_leaves_no_rows(engine: Engine) -> None:
    with Session(engine) as s:
        s.add(_event())
        enqueue(s, Job, "t", {})
        s.flush()
        s.rollback()
    assert count_rows(engine, "outbox") == 0 and count_rows(engine, "jobs") == 0


def test_exception_inside_session_begin_leaves_no_rows(engine: Engine) -> None:
    with pytest.raises(RuntimeError), Session(engine) as s, s.begin():
        s.add(Order(status="paid"))
        s.add(_event())
        enqueue(s, Job, "t", {})
        s.flush()
        raise RuntimeError("business rule failed")
    assert count_rows(engine, "outbox") == 0 and count_rows(engine, "jobs") == 0
    assert count_rows(engine, "orders") == 0


def test_savepoint_rollback_discards_only_the_savepoints_rows(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        s.add(_event("kept"))
        nested = s.begin_nested()
        s.add(_event("dropped"))
        enqueue(s, Job, "dropped", {})
        s.flush()
        nested.rollback()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT aggregate_id FROM outbox")).scalars().all() == ["kept"]
    assert count_rows(engine, "jobs") == 0


@pytest.mark.parametrize("where", ["transaction", "savepoint"])
@pytest.mark.parametrize("columns", ["plain", "with available_at"])
def test_an_event_added_again_after_a_rollback_is_written_anew(
    engine: Engine, where: str, columns: str
) -> None:
    """A retry loop that keeps its objects: the event keeps the id its rolled-back write gave it, and added
    again it is written with a new one — not refused as an id given by hand (a hostile review)."""
    extra = {"available_at": dt.datetime.now(dt.UTC)} if columns != "plain" else {}
    ev = OutboxEvent(aggregate_type="order", aggregate_id="r", event_type="E", payload={}, **extra)
    with Session(engine) as s, s.begin():
        if where == "savepoint":
            with s.begin_nested() as sp:
                s.add(ev)
                s.flush()
                sp.rollback()
        else:
            s.add(ev)
            s.flush()
            s.rollback()
    with Session(engine) as s, s.begin():
        s.add(ev)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox")).scalar() == 1


def test_none_on_a_column_with_a_server_default_means_the_default(engine: Engine) -> None:
    """As for the ORM's own INSERT: ``available_at=None`` / ``created_at=None`` on an event the producer writes
    after the ORM's rows take the database's default (they were written as NULL, and refused)."""
    with Session(engine) as s, s.begin():
        s.add(OutboxEvent(aggregate_type="order", aggregate_id="n", event_type="E", payload={}, available_at=None,
                          created_at=None, headers={"k": "v"}))  # fmt: skip
    with engine.connect() as conn:
        row = conn.execute(text("SELECT available_at, created_at FROM outbox")).one()
    assert row.available_at is not None and row.created_at is not None


# --- per-aggregate commit order --------------------------------------------------------------------------


def _locking(lock: bool) -> Any:
    def factory(engine: Engine) -> Session:
        s = Session(engine)
        s.info[LOCK_AGGREGATES] = lock
        return s

    return factory


def _race(engine: Engine, *, lock: bool, make_event: Any) -> tuple[list[str], bool]:
    """T1 writes an event for the aggregate and holds its transaction; T2 writes one and commits.

    Returns the commit order and whether T2 finished while T1 was still open."""
    result = race(
        engine,
        lambda s, n: s.add(make_event(s, n)),
        app=f"producer_t2_{lock}",
        session_factory=_locking(lock),
    )
    return result.commits, not result.t2_waited_on_a_lock


def _ids_by_payload(engine: Engine) -> dict[int, int]:
    return ids_by_payload(engine)


def test_string_aggregate_lock_makes_id_order_equal_commit_order(engine: Engine) -> None:
    commits, early = _race(engine, lock=True, make_event=lambda s, n: _event("A", n))
    assert not early
    assert commits == ["T1", "T2"]
    ids = _ids_by_payload(engine)
    assert ids[1] < ids[2]  # T1 committed first and has the smaller id


def test_without_the_lock_a_later_id_commits_first(engine: Engine) -> None:
    """The failure the lock prevents: with the switch off, T2 commits while T1 is open, so the aggregate's
    id order (T1 < T2) differs from its commit order (T2, T1) and an ordered claim could skip T1's event."""
    commits, early = _race(engine, lock=False, make_event=lambda s, n: _event("A", n))
    assert early and commits == ["T2", "T1"]
    ids = _ids_by_payload(engine)
    assert ids[1] < ids[2]


def test_producers_deadlock_only_over_several_flushes_and_the_loser_is_rolled_back_whole(
    engine: Engine,
) -> None:
    """One flush takes its aggregates' locks in key order: two transactions writing events of A and B in
    opposite orders, one flush each, both commit. Over two flushes (A, then B; B, then A) they deadlock, as with
    any lock, as docs/writing-events.md says: PostgreSQL rolls one back whole and the other commits."""

    def run(flushes: list[list[str]], tag: str, gate: threading.Barrier, errors: list[str]) -> None:
        try:
            with Session(engine) as s, s.begin():
                for i, aggregates in enumerate(flushes):
                    for agg in aggregates:
                        s.add(
                            OutboxEvent(aggregate_type="order", aggregate_id=agg, event_type=tag, payload={})
                        )
                    s.flush()
                    if i == 0:
                        gate.wait(10)  # both hold their first flush's locks
        except Exception as exc:
            errors.append(f"{tag}: {exc}")

    for shape in ("one flush", "two flushes"):
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE outbox RESTART IDENTITY"))
        gate, errors = threading.Barrier(2), []
        if shape == "one flush":
            plans, gate = {"T1": [["A", "B"]], "T2": [["B", "A"]]}, threading.Barrier(1)
        else:
            plans = {"T1": [["A"], ["B"]], "T2": [["B"], ["A"]]}
        threads = [threading.Thread(target=run, args=(p, t, gate, errors)) for t, p in plans.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        with engine.connect() as conn:
            written = conn.execute(text("SELECT event_type, count(*) FROM outbox GROUP BY 1")).all()
        if shape == "one flush":
            assert errors == [] and sorted(written) == [("T1", 2), ("T2", 2)], (errors, written)
        else:
            assert len(errors) == 1 and "deadlock detected" in errors[0], errors
            loser = errors[0].split(":")[0]
            assert written == [("T2" if loser == "T1" else "T1", 2)], written  # the loser wrote nothing


def test_mapped_aggregate_row_lock_orders_commits(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        s.add(Order(status="new"))

    def make(s: Session, n: int) -> OutboxEvent:
        order = s.get(Order, 1)
        assert order is not None
        return OutboxEvent.for_aggregate(order, "OrderChanged", {"n": n})

    commits, early = _race(engine, lock=True, make_event=make)
    assert not early and commits == ["T1", "T2"]
    ids = _ids_by_payload(engine)
    assert ids[1] < ids[2]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT DISTINCT aggregate_type, aggregate_id FROM outbox")).all() == [
            ("order", "1")
        ]


def test_mapped_aggregate_lock_is_no_key_update_and_does_not_block_child_fk_inserts(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        s.add(Order(status="new"))
    with Session(engine) as s1:
        order = s1.get(Order, 1)
        s1.add(OutboxEvent.for_aggregate(order, "OrderChanged", {}))
        s1.flush()  # holds FOR NO KEY UPDATE on orders(1)
        with engine.connect() as other:
            other.execute(text("SET LOCAL lock_timeout = '2s'"))
            other.execute(text("INSERT INTO order_lines (order_id, sku) VALUES (1, 'x')"))  # FOR KEY SHARE
            other.commit()
        s1.commit()
    assert count_rows(engine, "order_lines") == 1


def test_for_aggregate_flushes_a_new_aggregate_to_learn_its_id(engine: Engine) -> None:
    with Session(engine, expire_on_commit=False) as s, s.begin():
        order = Order(status="new")
        s.add(order)
        ev = OutboxEvent.for_aggregate(order, "OrderCreated", {"status": "new"})
        s.add(ev)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT aggregate_type, aggregate_id FROM outbox")).one() == (
            "order",
            str(order.id),
        )


def test_each_aggregate_is_locked_once_per_transaction(engine: Engine) -> None:
    locked: list[list[str]] = []

    def record(conn: Any, cursor: Any, statement: str, params: Any, context: Any, executemany: bool) -> None:
        if "pg_advisory_xact_lock" in statement and params.get("types"):
            locked.append(list(params["ids"]))

    event.listen(engine, "before_cursor_execute", record)
    try:
        with Session(engine) as s, s.begin():
            for n in range(3):
                s.add(_event("A", n))
                s.add(_event("B", n))
                s.flush()
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert locked == [["A", "B"]]  # both aggregates, in key order, in the first flush only


def test_thousand_events_in_one_transaction_use_a_bounded_number_of_statements(engine: Engine) -> None:
    with statement_log(engine) as seen, Session(engine) as s, s.begin():
        for n in range(1000):
            s.add(_event(f"agg-{n % 50}", n))
    assert count_rows(engine, "outbox") == 1000
    inserts = [st for st in seen if st.lstrip().upper().startswith("INSERT")]
    assert len(inserts) <= 2, len(inserts)  # insertmanyvalues: one multi-row INSERT per 1000 rows
    assert len(seen) <= 4, seen[:5]


# --- bad input: refused at flush, nothing written ------------------------------------------------------


class NotJson:
    pass


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"x": NotJson()}, "NotJson"),
        ({"x": float("nan")}, "not JSON compliant"),
        ({"x": {1, 2}}, "set"),
        ({"x": b"bytes"}, "bytes"),
        ({"x": "nul\x00char"}, "NUL"),
        (None, "payload is required"),
        ({"blob": "x" * 2_000_000}, "over the limit of 1048576 bytes"),
    ],
)
def test_bad_payload_is_refused_with_nothing_written(engine: Engine, payload: Any, message: str) -> None:
    with Session(engine) as s:
        s.add(_event("ok", 1))
        s.add(OutboxEvent(aggregate_type="order", aggregate_id="A", event_type="Bad", payload=payload))
        with pytest.raises(PayloadError, match=message) as info:
            s.commit()
        assert "'Bad'" in str(info.value)  # names the event
        s.rollback()
    assert count_rows(engine, "outbox") == 0


def test_the_size_limit_counts_the_payloads_utf8_bytes_not_its_escapes(engine: Engine) -> None:
    """The limit is of the JSON's UTF-8 bytes: 300,000 × "é" (600,002 bytes) is within 1 MiB — before, it was
    refused as "1800014 bytes", its escaped ASCII text (\\u00e9, six characters each) — and 600,000 × "é"
    is refused with its UTF-8 size."""
    with Session(engine) as s, s.begin():
        s.add(
            OutboxEvent(
                aggregate_type="order", aggregate_id="A", event_type="Big", payload={"t": "é" * 300_000}
            )
        )
    with Session(engine) as s:
        s.add(
            OutboxEvent(
                aggregate_type="order", aggregate_id="A", event_type="Big", payload={"t": "é" * 600_000}
            )
        )
        with pytest.raises(PayloadError, match="payload is 1200008 bytes of JSON"):
            s.flush()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT length(payload->>'t') FROM outbox")).scalars().all() == [300_000]


@pytest.mark.parametrize("field", ["event_type", "aggregate_id", "aggregate_type"])
def test_empty_required_field_is_refused(engine: Engine, field: str) -> None:
    values = {"aggregate_type": "order", "aggregate_id": "A", "event_type": "E", "payload": {}}
    values[field] = "  "
    with Session(engine) as s:
        s.add(OutboxEvent(**values))
        with pytest.raises(PayloadError, match=f"{field} must be a non-empty string"):
            s.flush()
    assert count_rows(engine, "outbox") == 0


def test_refused_flush_sends_no_sql_and_leaves_the_session_usable(engine: Engine) -> None:
    with statement_log(engine) as seen, Session(engine) as s:
        bad = OutboxEvent(aggregate_type="order", aggregate_id="A", event_type="E", payload={"x": NotJson()})
        s.add(bad)
        with pytest.raises(PayloadError):
            s.flush()
        assert seen == []
        s.expunge(bad)
        s.add(_event("A", 1))
        s.commit()
    assert count_rows(engine, "outbox") == 1


def test_documented_encodings_for_datetime_decimal_uuid(engine: Engine) -> None:
    when = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)
    uid = uuid.UUID("12345678-1234-5678-1234-567812345678")
    with Session(engine) as s, s.begin():
        s.add(
            OutboxEvent(
                aggregate_type="o",
                aggregate_id="1",
                event_type="E",
                payload={"at": when, "amount": decimal.Decimal("10.10"), "id": uid, "day": when.date()},
            )
        )
    with engine.connect() as conn:
        payload = conn.execute(text("SELECT payload FROM outbox")).scalar_one()
    assert payload == {
        "at": "2026-11-29T12:00:00+00:00",
        "amount": "10.10",
        "id": str(uid),
        "day": "2026-11-29",
    }


def test_enqueue_refuses_unknown_task_with_registry(engine: Engine) -> None:
    with Session(engine) as s:
        with pytest.raises(PayloadError, match="'nope' is not in the task registry"):
            enqueue(s, Job, "nope", {}, registry={"send_email": print})
        s.commit()
    assert count_rows(engine, "jobs") == 0


def test_enqueue_refuses_bad_values(engine: Engine) -> None:
    with Session(engine) as s:
        with pytest.raises(PayloadError, match="max_attempts must be between 1 and"):
            enqueue(s, Job, "t", {}, max_attempts=0)
        with pytest.raises(PayloadError, match="timezone-aware"):
            enqueue(s, Job, "t", {}, run_at=dt.datetime(2030, 1, 1))
        with pytest.raises(PayloadError, match="queue must be a non-empty string"):
            enqueue(s, Job, "t", {}, queue="")
    assert count_rows(engine, "jobs") == 0


def test_enqueue_delay_is_counted_from_the_database_clock(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "t", {}, run_at=dt.timedelta(minutes=5))
    with engine.connect() as conn:
        delta = conn.execute(text("SELECT extract(epoch FROM run_at - created_at) FROM jobs")).scalar_one()
    assert 299 <= float(delta) <= 301


def test_enqueued_jobs_are_one_statement_that_also_sends_their_notifies(engine: Engine) -> None:
    """Jobs with only enqueue's columns set are written by the flush's own INSERT … SELECT FROM unnest, which
    carries the NOTIFYs (the ORM's INSERT and a separate NOTIFY statement made a job per transaction cost
    0.4× a Core INSERT); afterwards they are ordinary persistent objects."""
    at = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    with statement_log(engine) as seen, Session(engine, expire_on_commit=False) as s, s.begin():
        jobs = [enqueue(s, Job, "t", {"n": n}, queue=q) for n, q in enumerate(["a", "b", "a"])]
        later = enqueue(s, Job, "t", {}, run_at=dt.timedelta(minutes=5), priority=2, max_attempts=4)
        fixed = enqueue(s, Job, "t", {}, run_at=at, headers={"x-a": "1"})
        s.flush()
        assert len(seen) == 1 and "pg_notify" in seen[0] and "unnest" in seen[0]
        assert [j.id for j in jobs] == [1, 2, 3] and (later.id, fixed.id) == (4, 5)
        assert jobs[0].status == "queued" and later.run_at > later.created_at  # loaded from the database
        assert (later.priority, later.max_attempts, fixed.run_at, fixed.headers) == (2, 4, at, {"x-a": "1"})
        assert s.get(Job, 2) is jobs[1]
    assert jobs[2].unique_key is None and jobs[2].locked_by is None  # known NULL, as after the ORM's INSERT
    with Session(engine) as s:  # a rolled-back flush takes them out of the session again
        gone = enqueue(s, Job, "t", {})
        s.flush()
        s.rollback()
        assert gone not in s
    assert count_rows(engine, "jobs") == 5


@pytest.mark.parametrize(
    "options",
    [{}, {"run_at": dt.datetime(2030, 1, 1, tzinfo=dt.UTC)}, {"run_at": 30}, {"priority": 3, "headers": {"x-a": "1"}},
     {"max_attempts": 2}],
)  # fmt: skip
def test_one_enqueued_job_alone_in_its_flush(engine: Engine, options: dict[str, Any]) -> None:
    """The one-job statement (scalar parameters; NULL ones must still have their types)."""
    with Session(engine) as s, s.begin():
        job = enqueue(s, Job, "t", {"n": 1}, **options)
        s.flush()
        assert job.id == 1 and job.status == "queued" and job.payload == {"n": 1}
    assert count_rows(engine, "jobs") == 1


def test_a_job_with_other_columns_set_keeps_the_orm_insert(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        s.add(Job(task="t", payload={}, unique_key="k"))
    with pytest.raises(IntegrityError, match="ux_jobs_unique"), Session(engine) as s, s.begin():
        s.add(Job(task="t", payload={}, unique_key="k"))  # the ORM's own INSERT: a plain unique violation
    with Session(engine) as s, s.begin():
        s.add(Job(task="t", payload={}, status="failed", attempts=3))
    assert count_rows(engine, "jobs", "status = 'failed' AND attempts = 3") == 1


def test_literal_backslash_u_text_is_stored_as_written(engine: Engine) -> None:
    """Only a real NUL character is refused; the six characters ``\\u0000`` are ordinary text."""
    text_value = "C:\\u0000\\data \\\\u0000"
    with Session(engine) as s, s.begin():
        s.add(_event("A", 1, payload={"path": text_value, "\\u0000key": 1}))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT payload FROM outbox")).scalar_one() == {
            "path": text_value,
            "\\u0000key": 1,
        }
    with Session(engine) as s:
        s.add(_event("A", 2, payload={"x": "\\\x00"}))  # a backslash, then a real NUL
        with pytest.raises(PayloadError, match="NUL"):
            s.flush()


@pytest.mark.parametrize(
    "payload", [{1: "int", "1": "str"}, {"a": [{None: 1, "null": 2}]}, {1.5: 0, "1.5": 1}]
)
def test_dict_keys_that_would_become_the_same_json_key_are_refused(engine: Engine, payload: Any) -> None:
    with Session(engine) as s:
        s.add(_event("A", 1, payload=payload))
        with pytest.raises(PayloadError, match="mixes string and non-string keys"):
            s.flush()
    assert count_rows(engine, "outbox") == 0


def test_non_string_keys_alone_become_json_keys(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        s.add(_event("A", 1, payload={1: "one", 2: "two"}))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT payload FROM outbox")).scalar_one() == {"1": "one", "2": "two"}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"priority": 2**40}, r"priority must be between -2147483648 and 2147483647, got 1099511627776"),
        ({"priority": -(2**31) - 1}, "priority must be between"),
        ({"max_attempts": 2**31}, r"max_attempts must be between 1 and 2147483647"),
    ],
)
def test_job_integers_outside_the_column_range_are_refused_before_sql(
    engine: Engine, options: dict[str, Any], message: str
) -> None:
    with statement_log(engine) as seen, Session(engine) as s:
        with pytest.raises(PayloadError, match=message):
            enqueue(s, Job, "t", {}, **options)
        s.add(Job(task="t", payload={}, **options))
        with pytest.raises(PayloadError, match=message):
            s.flush()
    assert seen == []


def _incompressible(n: int) -> str:
    import random

    rnd = random.Random(n)
    return "".join(
        rnd.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") for _ in range(n)
    )


def test_text_over_the_index_entry_limit_is_refused_before_sql(engine: Engine) -> None:
    """``aggregate_id`` is in the btree index ix_outbox_aggregate (with the bigint id): an entry holds at most
    2,704 bytes, so an id of at most 2,684 bytes; the jobs ``queue`` shares ix_jobs_dequeue with three fixed
    columns: at most 2,672 bytes. Over it is a PayloadError naming the limit, before any SQL; at it is stored
    (incompressible text: the database's compression cannot rescue it)."""
    too_long, longest = _incompressible(2685), _incompressible(2684)
    with statement_log(engine) as seen, Session(engine) as s:
        s.add(_event(too_long, 1))
        with pytest.raises(
            PayloadError, match=r"aggregate_id is 2685 bytes.*at most 2684 bytes.*ix_outbox_aggregate"
        ):
            s.flush()
        s.rollback()
        with pytest.raises(PayloadError, match=r"aggregate_id is 8000 bytes"):
            emit(s, OutboxEvent, [("order", _incompressible(8000), "E", {})])
        with pytest.raises(PayloadError, match=r"queue is 2673 bytes.*at most 2672 bytes.*ix_jobs_dequeue"):
            enqueue(s, Job, "t", {}, queue=_incompressible(2673))
    assert seen == []
    with Session(engine) as s, s.begin():
        s.add(_event(longest, 1))
        emit(s, OutboxEvent, [("order", longest, "E", {"n": 2})])
        enqueue(s, Job, "t", {}, queue=_incompressible(2672))
        s.add(
            OutboxEvent(
                aggregate_type=_incompressible(9000),
                aggregate_id="A",
                event_type=_incompressible(9000),
                payload={},
            )
        )  # fmt: skip  (in no btree index: no limit but the row's)
    assert count_rows(engine, "outbox") == 3 and count_rows(engine, "jobs") == 1


# --- wake-ups: one NOTIFY per channel and committing transaction -----------------------------------------


def _listen(engine: Engine, channel: str) -> psycopg.Connection[Any]:
    url = engine.url.set(drivername="postgresql")
    conn = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)
    conn.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
    return conn


def _drain(conn: psycopg.Connection[Any], wait: float = 0.3) -> list[tuple[str, str]]:
    return [(n.channel, n.payload) for n in conn.notifies(timeout=wait)]


def test_one_notification_per_committing_transaction(engine: Engine) -> None:
    listener = _listen(engine, channel_for("outbox"))
    jobs_listener = _listen(engine, channel_for("jobs"))
    try:
        with Session(engine) as s, s.begin():
            for n in range(10):
                s.add(_event(f"a{n}", n))
                s.flush()
            enqueue(s, Job, "t", {}, queue="mail")
            enqueue(s, Job, "t", {}, queue="mail")
            enqueue(s, Job, "t", {}, queue="default")
        assert _drain(listener) == [("sa_outbox.outbox", "")]
        assert sorted(_drain(jobs_listener)) == [("sa_outbox.jobs", "default"), ("sa_outbox.jobs", "mail")]
        with Session(engine) as s:
            s.add(_event("x"))
            s.flush()
            s.rollback()
        assert _drain(listener) == []
    finally:
        listener.close()
        jobs_listener.close()


def test_written_events_behave_like_flushed_orm_objects(engine: Engine) -> None:
    """Plain events are inserted by one statement with the flush's locks; afterwards they are ordinary
    persistent objects (ids set, server defaults loadable) and a rollback takes them out of the session."""
    with Session(engine) as s:
        kept, dropped = _event("A", 1), _event("B", 2)
        s.add(kept)
        s.flush()
        with statement_log(engine) as seen:
            assert kept.id == 1  # loaded: no SELECT
        assert seen == []
        assert (
            kept in s and kept.status == "pending" and kept.attempts == 0
        )  # server defaults: loaded on access
        nested = s.begin_nested()
        s.add(dropped)
        s.flush()
        assert dropped.id == 2 and dropped in s
        nested.rollback()
        assert dropped not in s and kept in s
        s.commit()
    assert count_rows(engine, "outbox") == 1


def test_written_events_go_through_the_orm_lifecycle(engine: Engine) -> None:
    """Session lifecycle listeners see a plain event (one-statement path) exactly as an event the ORM inserts
    itself: pending → persistent at flush, persistent → transient when the transaction rolls back."""
    seen: list[tuple[str, str]] = []
    names = ("transient_to_pending", "pending_to_persistent", "pending_to_transient", "persistent_to_transient",
             "persistent_to_detached", "detached_to_persistent")  # fmt: skip

    def recorder(name: str) -> Any:
        def record(session: Session, instance: Any) -> None:
            if instance in labels:
                seen.append((name, labels[instance]))

        return record

    fast, orm = _event("fast", 1), _event("orm", 2, available_at=dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    labels = {fast: "fast", orm: "orm"}
    with Session(engine) as s:
        for name in names:
            event.listen(s, name, recorder(name))
        s.add_all([fast, orm])
        s.flush()
        s.rollback()
    for agg in ("fast", "orm"):
        assert [n for n, a in seen if a == agg] == [
            "transient_to_pending",
            "pending_to_persistent",
            "persistent_to_transient",
        ], seen


def test_events_with_other_columns_set_are_written_with_them(engine: Engine) -> None:
    """Values (and SQL expressions, evaluated by the database) of other columns are written as given; what
    the database computed loads on first access."""
    from sqlalchemy import func

    with statement_log(engine) as seen, Session(engine) as s, s.begin():
        s.add(_event("A", 1, available_at=dt.datetime(2030, 1, 1, tzinfo=dt.UTC)))
    inserts = [st for st in seen if st.lstrip().startswith("INSERT")]
    assert len(inserts) == 1 and "available_at" in inserts[0]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT extract(year FROM available_at) FROM outbox")).scalar_one() == 2030
    with Session(engine) as s, s.begin():
        ev = _event("B", 2, available_at=func.now() + dt.timedelta(hours=1))
        s.add(ev)
        s.flush()
        delay = s.execute(text("SELECT available_at - created_at FROM outbox WHERE id = :i"), {"i": ev.id})
        assert delay.scalar_one() == dt.timedelta(hours=1)
        assert ev.available_at - ev.created_at == dt.timedelta(hours=1)  # loaded from the row


# --- emit(): the ORM-free producer ------------------------------------------------------------------------


def test_emit_writes_in_the_callers_transaction_in_order(engine: Engine) -> None:

    with Session(engine) as s, s.begin():
        ids = emit(s, OutboxEvent, [("order", "A", "Created", {"n": 1}), ("order", "A", "Paid", {"n": 2})])
    assert ids == [1, 2]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT event_type FROM outbox ORDER BY id")).scalars().all() == [
            "Created",
            "Paid",
        ]
    with Session(engine) as s:
        emit(s, OutboxEvent, [("order", "B", "Created", {})])
        s.rollback()
    assert count_rows(engine, "outbox") == 2


def test_emit_refuses_bad_input_before_writing(engine: Engine) -> None:

    with Session(engine) as s, s.begin():
        with pytest.raises(PayloadError, match="'Bad'"):
            emit(s, OutboxEvent, [("order", "A", "Ok", {}), ("order", "A", "Bad", {"x": NotJson()})])
        with pytest.raises(PayloadError, match="aggregate_id must be a non-empty string"):
            emit(s, OutboxEvent, [("order", "", "E", {})])
    assert count_rows(engine, "outbox") == 0


def test_emit_takes_the_same_aggregate_lock_as_the_hook(engine: Engine) -> None:

    def emit_one(s: Session, n: int) -> None:
        emit(s, OutboxEvent, [("order", "A", "OrderChanged", {"n": n})])

    assert_serialised(engine, emit_one, lambda s, n: s.add(_event("A", n)), app="emit_t2")
