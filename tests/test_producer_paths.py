"""Every way an application writes outbox rows through a Session keeps the producer's guarantees.

Rows added by the application's own ``before_flush`` listener, ORM-enabled ``INSERT`` statements run through
the session, and code that writes with Core after :func:`sa_outbox.lock_aggregate`: each is validated before
it is written, takes the same aggregate lock as ``session.add`` (proved with two connections: the second
producer waits and the id order is the commit order), and is announced with NOTIFY. Within one transaction
the outbox id order is the order the code wrote the events, whichever path wrote them.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, insert, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from sa_outbox import PayloadError, emit, enqueue, lock_aggregate
from sa_outbox._names import channel_for
from sa_outbox.models import Job, OutboxEvent

from .commit_order import assert_serialised, ids_by_payload
from .conftest import count_rows
from .models import Order, OrderLine


def _event(agg: str = "A", n: int = 0, **kw: Any) -> OutboxEvent:
    return OutboxEvent(
        aggregate_type="order", aggregate_id=agg, event_type="OrderChanged", **{"payload": {"n": n}, **kw}
    )


@pytest.fixture
def order(engine: Engine) -> Engine:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO orders (status) VALUES ('new')"))
    return engine


def _listen(engine: Engine, channel: str) -> psycopg.Connection[Any]:
    url = engine.url.set(drivername="postgresql")
    conn = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)
    conn.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
    return conn


def _notifications(conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    return sorted((n.channel, n.payload) for n in conn.notifies(timeout=0.3))


# --- the application's own before_flush listener ("domain events") -----------------------------------------


class DomainSession(Session):
    """An application session whose ``before_flush`` listener — registered after sa_outbox installed its hook,
    so it runs after it — turns what the unit of work holds into outbox rows and jobs."""


@event.listens_for(DomainSession, "before_flush")
def _domain_events(session: Session, flush_context: Any, instances: Any) -> None:
    for obj in list(session.new):
        if isinstance(obj, OrderLine):
            n = int(obj.sku)
            mode = session.info.get("domain_events", "string")
            if mode == "string":
                session.add(_event("customer-7", n))
            elif mode == "instance":
                order = session.get(Order, obj.order_id)
                session.add(OutboxEvent.for_aggregate(order, "LineAdded", {"n": n}))
            elif mode == "bad":
                session.add(_event("customer-7", n, payload={"x": object()}))
            elif mode == "job":
                enqueue(session, Job, "index_line", {"n": n}, queue="search")
        elif isinstance(obj, Order):
            session.add(OutboxEvent.for_aggregate(obj, "OrderCreated", {"n": 0}))


def _domain(mode: str) -> Any:
    def factory(engine: Engine) -> Session:
        s = DomainSession(engine)
        s.info["domain_events"] = mode
        return s

    return factory


def _add_line(s: Session, n: int) -> None:
    s.add(OrderLine(order_id=1, sku=str(n)))


@pytest.mark.parametrize("mode", ["string", "instance"])
def test_listener_added_events_take_the_aggregate_lock(order: Engine, mode: str) -> None:
    """The second producer's listener-added event waits for the first's lock (advisory for a string
    aggregate, the order's row for ``for_aggregate``); the aggregate's id order is its commit order."""
    assert_serialised(order, _add_line, _add_line, app=f"listener_{mode}", session_factory=_domain(mode))


def test_listener_added_event_is_validated_and_nothing_is_written(order: Engine) -> None:
    with _domain("bad")(order) as s:
        s.add(_event("A", 1))
        _add_line(s, 1)
        with pytest.raises(PayloadError, match=r"'OrderChanged'.*not JSON-serialisable"):
            s.commit()
    assert count_rows(order, "outbox") == 0 and count_rows(order, "order_lines") == 0


def test_listener_added_events_and_jobs_are_announced(order: Engine) -> None:
    events, jobs = _listen(order, channel_for("outbox")), _listen(order, channel_for("jobs"))
    try:
        for mode, listener in (("string", events), ("job", jobs)):
            with _domain(mode)(order) as s, s.begin():
                _add_line(s, 1)  # nothing for the outbox until the listener runs
            assert _notifications(listener) == ([(channel_for("outbox"), "")] if mode == "string" else
                                                 [(channel_for("jobs"), "search")])  # fmt: skip
    finally:
        events.close()
        jobs.close()
    assert count_rows(order, "outbox") == 1 and count_rows(order, "jobs", "queue = 'search'") == 1


def test_listener_added_event_for_a_new_aggregate_gets_its_id(engine: Engine) -> None:
    """The listener builds the event from an order that is inserted in the same flush: its id is only known
    once the ORM has inserted it, and the event still carries it."""
    with DomainSession(engine, expire_on_commit=False) as s, s.begin():
        new = Order(status="new")
        s.add(new)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT aggregate_type, aggregate_id, event_type FROM outbox")).all() == [
            ("order", str(new.id), "OrderCreated")
        ]


class UndoingSession(Session):
    """A listener that adds an event and takes it back out before the flush writes anything."""


_undone: list[OutboxEvent] = []


@event.listens_for(UndoingSession, "before_flush")
def _add_then_expunge(session: Session, flush_context: Any, instances: Any) -> None:
    undone = _event("undone", 0, available_at=dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    session.add(undone)
    session.expunge(undone)
    _undone.append(undone)  # the application keeps a reference


def test_an_event_a_listener_adds_then_removes_is_not_written(engine: Engine) -> None:
    _undone.clear()
    with UndoingSession(engine) as s, s.begin():
        s.add(_event("kept", 1))
    assert _undone and _undone[0].id is None and _undone[0] not in s
    with engine.connect() as conn:
        assert conn.execute(text("SELECT aggregate_id FROM outbox")).scalars().all() == ["kept"]


def test_a_flush_that_fails_after_the_events_were_written_leaves_nothing(engine: Engine) -> None:
    """Both kinds of write (the one statement in before_flush, and after_flush) happen before the ORM's own
    INSERT fails: the transaction rolls back with them, and the session writes again afterwards."""
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO orders (id, status) OVERRIDING SYSTEM VALUE VALUES (1, 'x')"))
    with Session(engine) as s:
        plain, later = _event("A", 1), _event("A", 2, available_at=dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
        s.add_all([plain, later, Order(id=1, status="duplicate")])
        with pytest.raises(IntegrityError):
            s.flush()
        s.rollback()
        assert plain not in s and later not in s
        s.add(_event("A", 3))
        s.commit()
    assert ids_by_payload(engine).keys() == {3}


# --- write order: within a transaction, id order is the order the code wrote the events ---------------------


def _event_types(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT event_type FROM outbox ORDER BY id")).scalars())


def test_emit_after_session_add_keeps_write_order(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        s.add(OutboxEvent(aggregate_type="order", aggregate_id="A", event_type="First", payload={}))
        emit(s, OutboxEvent, [("order", "A", "Second", {})])
    assert _event_types(engine) == ["First", "Second"]


def test_one_flush_keeps_add_order_whatever_columns_are_set(engine: Engine) -> None:
    later = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    with Session(engine) as s, s.begin():
        s.add(
            OutboxEvent(aggregate_type="o", aggregate_id="A", event_type="1", payload={}, available_at=later)
        )
        s.add(OutboxEvent(aggregate_type="o", aggregate_id="A", event_type="2", payload={}))
        s.add(
            OutboxEvent(aggregate_type="o", aggregate_id="A", event_type="3", payload={}, available_at=later)
        )
        s.add(OutboxEvent(aggregate_type="o", aggregate_id="A", event_type="4", payload={}))
    assert _event_types(engine) == ["1", "2", "3", "4"]


def test_for_aggregate_of_a_new_aggregate_keeps_add_order(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        s.add(OutboxEvent(aggregate_type="order", aggregate_id="X", event_type="1", payload={}))
        new = Order(status="new")
        s.add(new)
        s.add(OutboxEvent.for_aggregate(new, "2", {}))
        s.add(OutboxEvent(aggregate_type="order", aggregate_id="X", event_type="3", payload={}))
    assert _event_types(engine) == ["1", "2", "3"]


def test_session_insert_statement_after_add_keeps_write_order(engine: Engine) -> None:
    with Session(engine) as s, s.begin(), s.no_autoflush:
        s.add(OutboxEvent(aggregate_type="order", aggregate_id="A", event_type="First", payload={}))
        s.execute(
            insert(OutboxEvent),
            [{"aggregate_type": "order", "aggregate_id": "A", "event_type": "Second", "payload": {}}],
        )
    assert _event_types(engine) == ["First", "Second"]


# --- ORM-enabled INSERT statements through the session -------------------------------------------------------


def _session_insert(s: Session, n: int) -> None:
    s.execute(
        insert(OutboxEvent),
        [{"aggregate_type": "order", "aggregate_id": "A", "event_type": "E", "payload": {"n": n}}],
    )


def _session_add(s: Session, n: int) -> None:
    s.add(_event("A", n))


def test_session_insert_statement_takes_the_aggregate_lock(engine: Engine) -> None:
    assert_serialised(engine, _session_insert, _session_add, app="bulk_t2")
    assert_serialised(engine, _session_add, _session_insert, app="bulk_t2b")


def test_session_insert_statement_is_validated_and_normalised(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        with pytest.raises(PayloadError, match=r"'Bad'.*not JSON-serialisable"):
            s.execute(
                insert(OutboxEvent),
                [
                    {"aggregate_type": "order", "aggregate_id": "A", "event_type": "Ok", "payload": {}},
                    {
                        "aggregate_type": "order",
                        "aggregate_id": "A",
                        "event_type": "Bad",
                        "payload": {"x": object()},
                    },
                ],
            )
        with pytest.raises(PayloadError, match="aggregate_id must be a non-empty string"):
            s.execute(
                insert(OutboxEvent),
                {"aggregate_type": "o", "aggregate_id": " ", "event_type": "E", "payload": {}},
            )
        with pytest.raises(PayloadError, match="task must be a non-empty string"):
            s.execute(insert(Job), [{"task": "", "payload": {}}])
        s.execute(
            insert(OutboxEvent),
            {"aggregate_type": "o", "aggregate_id": 7, "event_type": "E",
             "payload": {"at": dt.datetime(2026, 1, 2, tzinfo=dt.UTC)}},
        )  # fmt: skip
    with engine.connect() as conn:
        assert conn.execute(text("SELECT aggregate_id, payload FROM outbox")).all() == [
            ("7", {"at": "2026-01-02T00:00:00+00:00"})
        ]


def test_session_insert_statements_are_announced(engine: Engine) -> None:
    events, jobs = _listen(engine, channel_for("outbox")), _listen(engine, channel_for("jobs"))
    try:
        with Session(engine) as s, s.begin():
            _session_insert(s, 1)
            s.execute(insert(Job), [{"task": "t", "queue": "mail", "payload": {}}])
        assert _notifications(events) == [(channel_for("outbox"), "")]
        assert _notifications(jobs) == [(channel_for("jobs"), "mail")]
    finally:
        events.close()
        jobs.close()


def test_session_insert_with_values_it_cannot_see_is_refused(engine: Engine) -> None:
    """Rows given inside the statement (``.values()``, ``from_select``) cannot be validated or locked before
    they are written: refused, naming what to do instead."""
    with Session(engine) as s, s.begin():
        with pytest.raises(PayloadError, match=r"pass the rows as parameters"):
            s.execute(
                insert(OutboxEvent).values(aggregate_type="o", aggregate_id="A", event_type="E", payload={})
            )
        source = select(OutboxEvent.aggregate_type, OutboxEvent.aggregate_id, OutboxEvent.event_type,
                        OutboxEvent.payload)  # fmt: skip
        with pytest.raises(PayloadError, match=r"pass the rows as parameters"):
            s.execute(insert(OutboxEvent).from_select(["aggregate_type", "aggregate_id", "event_type", "payload"],
                                                      source))  # fmt: skip
    assert count_rows(engine, "outbox") == 0


# --- code outside the ORM takes the same lock -------------------------------------------------------------


def _core_insert_after_lock_aggregate(s: Session, n: int) -> None:
    order = s.get(Order, 1)
    lock_aggregate(s, order)
    s.connection().execute(
        insert(OutboxEvent.__table__),
        {"aggregate_type": "order", "aggregate_id": "1", "event_type": "E", "payload": {"n": n}},
    )


def _for_aggregate(s: Session, n: int) -> None:
    s.add(OutboxEvent.for_aggregate(s.get(Order, 1), "E", {"n": n}))


def test_lock_aggregate_with_an_instance_takes_the_row_lock_of_for_aggregate(order: Engine) -> None:
    assert_serialised(order, _core_insert_after_lock_aggregate, _for_aggregate, app="lock_instance_t2")
    assert_serialised(order, _for_aggregate, _core_insert_after_lock_aggregate, app="lock_instance_t2b")


def test_lock_aggregate_refuses_what_it_cannot_lock(engine: Engine) -> None:
    with Session(engine) as s:
        with pytest.raises(PayloadError, match="mapped instance"):
            lock_aggregate(s, object())
        with pytest.raises(PayloadError, match="aggregate_id"):
            lock_aggregate(s, "order")
