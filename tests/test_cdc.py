"""CDC mode: an insert-only outbox table that Debezium's outbox event router reads from the WAL.

``CdcOutboxMixin`` rows are written by the producer's own paths (``session.add`` and the flush hook,
``for_aggregate``, ``emit``, ORM-enabled ``INSERT``): validated, locked per aggregate, with headers and the
trace context, and — by default — deleted again in the same transaction, so the table stays empty while the
WAL keeps every event. ``sa_outbox.cdc`` writes the Debezium connector configuration for such a table.

Debezium itself cannot run here (no JVM, no Kafka Connect). What Debezium reads is checked with PostgreSQL's
own logical decoding on a throwaway cluster with ``wal_level=logical`` (``tests/logical_pg.py``): wal2json for
the concurrency test and ``pgoutput`` — the plugin the generated configuration names — through the generated
publication. The configuration's option names are checked against the Debezium documentation's (quoted below).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import random
import re
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from sqlalchemy import (
    BigInteger,
    Engine,
    ForeignKey,
    Identity,
    Integer,
    MetaData,
    create_engine,
    delete,
    event,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.ext.mutable import MutableDict
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship
from sqlalchemy.orm.attributes import flag_modified

from sa_outbox import CdcOutboxMixin, Dispatcher, PayloadError, SchemaError, emit
from sa_outbox._cli import main
from sa_outbox._names import channel_for
from sa_outbox._producer import LOCK_AGGREGATES
from sa_outbox.cdc import debezium_config, headers_from_debezium, setup_sql
from sa_outbox.testing import RecordingPublisher

from .commit_order import race
from .logical_pg import WAL2JSON_OPTIONS, Change, LogicalCluster, Slot, Transaction, logical_cluster


class CdcBase(DeclarativeBase):
    metadata = MetaData()


class Account(CdcBase):
    __tablename__ = "cdc_accounts"
    __outbox_aggregate_type__ = "account"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    balance: Mapped[int] = mapped_column(Integer, default=0)


class CdcEvent(CdcOutboxMixin, CdcBase):
    """The default: each row is deleted in the transaction that inserted it."""

    __tablename__ = "cdc_outbox"


class KeptEvent(CdcOutboxMixin, CdcBase):
    __tablename__ = "cdc_outbox_kept"
    sa_outbox_delete_after_insert = False


TABLES = "public.cdc_outbox,public.cdc_outbox_kept"


def _event(model: type[Any] = CdcEvent, agg: str = "7", n: int = 0, **kw: Any) -> Any:
    return model(
        aggregate_type="customer", aggregate_id=agg, event_type="Charged", **{"payload": {"n": n}, **kw}
    )


class _Written:
    """Rows inserted into and deleted from a table since this was made, in the session's transaction (from
    PostgreSQL's per-transaction statistics; compared with a reading taken at the start, since PostgreSQL
    ≥ 15 also counts earlier transactions of the backend whose statistics it has not flushed yet)."""

    def __init__(self, session: Session, table: str = "cdc_outbox") -> None:
        self.session, self.table = session, table
        self.start = self._now()

    def _now(self) -> tuple[int, int]:
        row = self.session.execute(
            text("SELECT n_tup_ins, n_tup_del FROM pg_stat_xact_user_tables WHERE relname = :t"),
            {"t": self.table},
        ).one()
        return int(row[0]), int(row[1])

    def __call__(self) -> tuple[int, int]:
        now = self._now()
        return now[0] - self.start[0], now[1] - self.start[1]


# --- the shared test database: the producer side ------------------------------------------------------------


@pytest.fixture(scope="module")
def cdc_engine(shared_engine: Engine) -> Iterator[Engine]:
    CdcBase.metadata.create_all(shared_engine)
    yield shared_engine
    CdcBase.metadata.drop_all(shared_engine)


@pytest.fixture
def db(cdc_engine: Engine) -> Engine:
    with cdc_engine.begin() as conn:
        conn.execute(text("TRUNCATE cdc_outbox, cdc_outbox_kept, cdc_accounts RESTART IDENTITY"))
        conn.execute(text("INSERT INTO cdc_accounts (balance) VALUES (0), (0), (0)"))
    return cdc_engine


def test_the_table_has_the_columns_the_connector_config_maps(db: Engine) -> None:
    columns = {c["name"]: c for c in sa_inspect(db).get_columns("cdc_outbox")}
    assert set(columns) == {
        "id", "aggregate_type", "aggregate_id", "event_type", "payload", "headers", "tracingspancontext",
        "created_at",
    }  # fmt: skip
    assert type(columns["id"]["type"]).__name__ == "UUID"
    assert type(columns["payload"]["type"]).__name__ == "JSONB" and not columns["payload"]["nullable"]
    assert columns["headers"]["nullable"] and columns["tracingspancontext"]["nullable"]
    # No dispatcher columns: nothing ever UPDATEs a row of this table (the event router refuses updates).
    assert not {"status", "attempts", "lease_version", "available_at"} & set(columns)


def test_session_add_inserts_and_deletes_the_row_in_the_same_transaction(db: Engine) -> None:
    with Session(db) as s, s.begin():
        written = _Written(s)
        ev = _event(headers={"x-tenant": "acme"})
        s.add(ev)
        s.flush()
        assert isinstance(ev.id, uuid.UUID)
        assert written() == (1, 1)  # the WAL has the insert; the table has nothing
        assert s.execute(select(func.count()).select_from(CdcEvent)).scalar_one() == 0
        assert ev not in s  # what the ORM makes of a row deleted in this transaction
    state = sa_inspect(ev)
    assert state.detached
    # Everything is readable without the row: the database's values came back with the insert.
    assert ev.created_at is not None and ev.payload == {"n": 0} and ev.headers == {"x-tenant": "acme"}


def test_keep_mode_leaves_the_rows_for_a_retention_job_of_your_own(db: Engine) -> None:
    with Session(db) as s, s.begin():
        written = _Written(s, "cdc_outbox_kept")
        ev = _event(KeptEvent, headers={"x-tenant": "acme"})
        s.add(ev)
        s.flush()
        assert written() == (1, 0)
        assert ev in s
        ev_id = ev.id
    with db.connect() as conn:
        row = conn.execute(select(KeptEvent.__table__)).one()._mapping
    assert row["id"] == ev_id and row["payload"] == {"n": 0} and row["headers"] == {"x-tenant": "acme"}
    assert row["tracingspancontext"] is None


@pytest.mark.parametrize("model", [CdcEvent, KeptEvent], ids=["deleted", "kept"])
def test_a_rolled_back_event_leaves_nothing_and_is_transient_again(db: Engine, model: type[Any]) -> None:
    """As for rows the ORM inserted (and deleted) itself: a rolled back transaction or savepoint makes its
    events transient again (``Session._register_persistent`` / ``_remove_newly_deleted``, pinned here)."""
    with Session(db) as s:
        s.begin()
        ev = _event(model)
        s.add(ev)
        s.flush()
        s.rollback()
        assert sa_inspect(ev).transient and ev.payload == {"n": 0}
        with s.begin():
            kept = _event(model, n=1)
            s.add(kept)
            with s.begin_nested():
                dropped = _event(model, n=2)
                s.add(dropped)
                s.flush()
                s.get_nested_transaction().rollback()  # type: ignore[union-attr]
            assert sa_inspect(dropped).transient
        assert sa_inspect(kept).detached if model is CdcEvent else sa_inspect(kept).persistent
    with db.connect() as conn:
        rows = conn.execute(select(KeptEvent.payload)).scalars().all()
    assert rows == ([{"n": 1}] if model is KeptEvent else [])


@pytest.mark.parametrize("model", [CdcEvent, KeptEvent], ids=["deleted", "kept"])
def test_a_value_set_on_an_event_already_written_is_refused_where_it_is_set(
    db: Engine, model: type[Any]
) -> None:
    """Debezium streams the INSERT (and the DELETE behind it): a change after the flush never reaches the broker
    — silently dropped with the deleted row, or an UPDATE the router drops (a review: the WAL held the draft).
    Refused at the assignment; before the flush, and again once a rollback made the event transient, values
    may change."""
    with Session(db) as s:
        s.begin()
        ev = _event(model)
        ev.payload = {"n": 5}  # pending: fine
        s.add(ev)
        s.flush()
        with pytest.raises(PayloadError, match=r"already written .*'payload'.*insert-only"):
            ev.payload = {"total": "9.90"}
        with pytest.raises(PayloadError, match="'event_type'"):
            ev.event_type = "OrderPaid"
        assert ev.payload == {"n": 5}
        s.rollback()
        ev.payload = {"n": 6}  # transient again: may change, and be added anew
        with s.begin():
            s.add(ev)
    if model is KeptEvent:
        with Session(db) as s, s.begin():
            loaded = s.execute(select(KeptEvent)).scalar_one()
            assert loaded.payload == {"n": 6}
            with pytest.raises(PayloadError, match="insert-only"):
                loaded.payload = {"n": 7}


class _MutableBase(DeclarativeBase):
    metadata = MetaData()


class _MutableEvent(CdcOutboxMixin, _MutableBase):
    """A kept CDC table whose payload tracks changes made in place (``MutableDict``)."""

    __tablename__ = "cdc_outbox_mutable"
    sa_outbox_delete_after_insert = False

    payload: Mapped[dict[str, Any]] = mapped_column(MutableDict.as_mutable(JSONB), nullable=False)


@pytest.mark.parametrize("model", [CdcEvent, KeptEvent], ids=["deleted", "kept"])
def test_a_change_marked_with_flag_modified_on_an_event_already_written_is_refused(
    db: Engine, model: type[Any]
) -> None:
    """``flag_modified`` after an in-place change is SQLAlchemy's way to say "this value changed": on a written
    CDC event the change would never reach the broker (the deleted row's, or an UPDATE the router drops; before,
    a kept event's UPDATE went through silently). Refused where it is marked; the row keeps what was written."""
    with Session(db) as s:
        s.begin()
        ev = _event(model, n=5)
        s.add(ev)
        s.flush()
        ev.payload["n"] = 6  # untracked by SQLAlchemy: a plain dict changed in place
        with pytest.raises(PayloadError, match=r"already written .*'payload'.*insert-only"):
            flag_modified(ev, "payload")
        s.commit()
    if model is KeptEvent:
        with db.connect() as conn:
            assert conn.execute(select(KeptEvent.payload)).scalars().all() == [{"n": 5}]


def test_a_change_refused_in_a_savepoint_is_allowed_once_the_savepoint_rolled_back(db: Engine) -> None:
    """Written in a savepoint, an event is refused a change there like anywhere; the savepoint's rollback makes it
    transient again (never written), so it may change and be added anew — the row has the new value."""
    with Session(db) as s:
        s.begin()
        ev = _event(KeptEvent, n=1)
        savepoint = s.begin_nested()
        s.add(ev)
        s.flush()
        with pytest.raises(PayloadError, match="insert-only"):
            flag_modified(ev, "payload")
        savepoint.rollback()
        assert sa_inspect(ev).transient
        ev.payload["n"] = 2
        flag_modified(ev, "payload")
        s.add(ev)
        s.commit()
    with db.connect() as conn:
        assert conn.execute(select(KeptEvent.payload)).scalars().all() == [{"n": 2}]


def test_an_in_place_change_of_a_mutable_payload_on_an_event_already_written_is_refused(db: Engine) -> None:
    """A ``MutableDict`` column marks its own changes: on a written CDC event that change is refused where it
    is made (before: UPDATEd at the next flush, an UPDATE Debezium's router drops — the broker never saw it);
    before the flush it is an ordinary change."""
    _MutableBase.metadata.create_all(db)
    try:
        with Session(db) as s:
            s.begin()
            ev = _event(_MutableEvent, n=1)
            ev.payload["n"] = 2  # pending: fine
            s.add(ev)
            s.flush()
            with pytest.raises(PayloadError, match=r"already written .*'payload'.*insert-only"):
                ev.payload["n"] = 3
            s.commit()
        with db.connect() as conn:
            assert conn.execute(select(_MutableEvent.payload)).scalars().all() == [{"n": 2}]
    finally:
        _MutableBase.metadata.drop_all(db)


def test_an_orm_update_statement_on_a_cdc_table_is_refused(db: Engine) -> None:
    """``session.execute(update(CdcModel))`` changes written events behind the stream's back (the router drops
    UPDATEs): refused before it runs, naming the way out; deletes (a retention job) still go through."""
    with Session(db) as s, s.begin():
        s.add(_event(KeptEvent, n=1))
    with (
        Session(db) as s,
        s.begin(),
        pytest.raises(PayloadError, match=r"UPDATE of cdc_outbox_kept.*insert-only"),
    ):
        s.execute(update(KeptEvent).values(payload={"n": 9}))
    with Session(db) as s, s.begin():
        assert s.execute(select(KeptEvent.payload)).scalars().all() == [{"n": 1}]
        s.execute(delete(KeptEvent))
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(KeptEvent)).scalar_one() == 0


class _RelBase(DeclarativeBase):
    metadata = MetaData()


class _Shop(_RelBase):
    __tablename__ = "cdc_rel_shop"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    events: Mapped[list[_ShopEvent]] = relationship(back_populates="shop")


class _ShopEvent(CdcOutboxMixin, _RelBase):
    __tablename__ = "cdc_rel_events"
    sa_outbox_delete_after_insert = False

    shop_id: Mapped[int | None] = mapped_column(ForeignKey("cdc_rel_shop.id"))
    shop: Mapped[_Shop | None] = relationship(back_populates="events")


def test_deleting_an_aggregate_nulls_its_kept_events_key_as_the_orm_does_for_any_child(db: Engine) -> None:
    """The insert-only guard is for the application's sets: the ORM's own — a deleted parent's children get
    their foreign key nulled at the flush — go through (a review: "already written … 'shop_id'" on
    session.delete(shop), in the same transaction and a later one)."""
    _RelBase.metadata.create_all(db)
    try:
        with Session(db) as s, s.begin():
            shop = _Shop()
            shop.events.append(_event(_ShopEvent))
            s.add(shop)
            s.flush()
            s.delete(shop)
        with Session(db) as s, s.begin():
            other = _Shop(events=[_event(_ShopEvent, n=1)])
            s.add(other)
            s.flush()
            other_id = other.id
        with Session(db) as s, s.begin():  # a later transaction: the ORM loads the events to null their key
            s.delete(s.get(_Shop, other_id))
        with db.connect() as conn:
            keys = conn.execute(text("SELECT shop_id FROM cdc_rel_events")).scalars().all()
        assert keys == [None, None]
    finally:
        _RelBase.metadata.drop_all(db)


def test_emit_returns_uuids_in_write_order_after_the_pending_events(db: Engine) -> None:
    with Session(db) as s, s.begin():
        first = _event(KeptEvent, n=0)
        s.add(first)
        ids = emit(s, KeptEvent, [("customer", "7", "Charged", {"n": 1}), ("customer", "8", "Charged", {"n": 2},
                                   {"x-request-id": "r-2"})], headers={"x-tenant": "acme"})  # fmt: skip
        assert first.id is not None  # the pending event was written first
    assert all(isinstance(i, uuid.UUID) for i in ids)
    with db.connect() as conn:
        rows = {r.id: r for r in conn.execute(select(KeptEvent.__table__))}
    assert [rows[i].payload["n"] for i in ids] == [1, 2]
    assert rows[ids[1]].headers == {"x-tenant": "acme", "x-request-id": "r-2"}
    with Session(db) as s, s.begin():
        written = _Written(s)
        deleted = emit(s, CdcEvent, [("customer", "7", "Charged", {"n": 3})] * 3)
        assert len(set(deleted)) == 3 and written() == (3, 3)


def test_orm_insert_statements_are_validated_and_deleted_too(db: Engine) -> None:
    rows = [{"aggregate_type": "customer", "aggregate_id": "7", "event_type": "Charged", "payload": {"n": n}}
            for n in range(3)]  # fmt: skip
    with Session(db) as s, s.begin():
        written = _Written(s)
        returned = s.execute(insert(CdcEvent).returning(CdcEvent.id), rows).scalars().all()
        assert written() == (3, 3) and len(set(returned)) == 3  # RETURNING still works
        s.execute(insert(CdcEvent), rows)
        assert written() == (6, 6)
    with Session(db) as s, s.begin():
        s.execute(insert(KeptEvent), [{**rows[0], "headers": {"traceparent": _TP}}])
    with db.connect() as conn:
        kept = conn.execute(select(KeptEvent.__table__)).one()
    assert isinstance(kept.id, uuid.UUID) and kept.tracingspancontext == f"traceparent={_TP}\n"
    with pytest.raises(PayloadError, match="Out of range float"), Session(db) as s, s.begin():
        s.execute(insert(CdcEvent), [{**rows[0], "payload": {"x": float("nan")}}])


def test_a_watched_connection_takes_sqlalchemys_own_path_with_the_same_result(db: Engine) -> None:
    """With a SQL listener attached the statements go through SQLAlchemy's regular execution (``_execute.run``):
    the UUIDs, ``created_at`` and the DELETE come out the same."""
    engine = create_engine(db.url)
    seen: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *a: seen.append(a[2].split()[0]))
    try:
        with Session(engine) as s, s.begin():
            written = _Written(s)
            ev = _event(n=1)
            s.add(ev)
            s.flush()
            [other] = emit(s, CdcEvent, [("customer", "7", "Charged", {"n": 2})])
            assert written() == (2, 2) and isinstance(other, uuid.UUID)
        assert ev.created_at is not None and seen.count("DELETE") == 2
    finally:
        engine.dispose()


def test_an_event_with_other_columns_set_is_written_alone_and_deleted_too(db: Engine) -> None:
    """A column given as a SQL expression takes the one-row INSERT; every column comes back with it (the row
    is gone before anything could load it)."""
    with Session(db) as s, s.begin():
        written = _Written(s)
        ev = _event(n=1, created_at=func.now() - dt.timedelta(days=1))
        s.add(ev)
        s.flush()
        assert written() == (1, 1)
        yesterday = s.execute(select(func.now() - dt.timedelta(days=1))).scalar_one()
    assert sa_inspect(ev).detached and ev.created_at == yesterday and ev.headers is None


def test_a_refused_payload_or_header_writes_nothing(db: Engine) -> None:
    for bad in ({"payload": {"x": float("nan")}}, {"headers": {"bad name": "x"}}):
        with pytest.raises(PayloadError), Session(db) as s, s.begin():
            s.add(_event(KeptEvent, n=1))
            s.add(_event(KeptEvent, n=2, **bad))
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(KeptEvent)).scalar_one() == 0


class SmallEvent(CdcOutboxMixin, CdcBase):
    __tablename__ = "cdc_outbox_small"
    sa_outbox_delete_after_insert = False
    sa_outbox_max_payload_bytes = 100


def _write(db: Engine, path: str, model: type[Any], atype: str, payload: Any) -> None:
    """One event through one of the producer's paths, in a transaction of its own."""
    with Session(db) as s, s.begin():
        if path == "add":
            s.add(model(aggregate_type=atype, aggregate_id="1", event_type="E", payload=payload))
        elif path == "emit":
            emit(s, model, [(atype, "1", "E", payload)])
        else:
            s.execute(insert(model), [{"aggregate_type": atype, "aggregate_id": "1", "event_type": "E",
                                       "payload": payload}])  # fmt: skip


@pytest.mark.parametrize("path", ["add", "emit", "orm_insert"])
def test_what_kafka_would_refuse_is_refused_as_it_is_written(db: Engine, path: str) -> None:
    """In the WAL nothing turns an event into a dead letter: the connector's producer fails on a record Kafka
    refuses and the connector stops. So the producer refuses, on every path, with nothing written: an
    aggregate type that makes no legal topic (``outbox.event.<type>``: a space, a slash, past 249), and a
    payload over the limit as the record value carries it — PostgreSQL's jsonb text, a space after each ``:``
    and ``,`` and numbers in plain notation — though its compact JSON is within it (before: all accepted)."""
    SmallEvent.__table__.create(db, checkfirst=True)
    try:
        for atype in ("cust omer", "cust/omer", "c" * 237, "kundé"):
            with pytest.raises(PayloadError, match="which Kafka refuses"):
                _write(db, path, SmallEvent, atype, {})
        for payload in ([0] * 40, [1e300]):  # compact: 81 and 8 bytes; as jsonb text: 118 and 303
            with pytest.raises(PayloadError, match="as the record value carries it"):
                _write(db, path, SmallEvent, "customer", payload)
        _write(db, path, SmallEvent, "c" * 236, [0] * 33)  # the longest legal topic; 99 bytes as jsonb text
        with db.connect() as conn:
            rows = conn.execute(text("SELECT aggregate_type, payload::text FROM cdc_outbox_small")).all()
        assert rows == [("c" * 236, "[" + ", ".join(["0"] * 33) + "]")]
        # a polling outbox keeps its own rules: its publishers refuse per message (dead letters)
        from sa_outbox.models import OutboxEvent

        with Session(db) as s:
            s.add(OutboxEvent(aggregate_type="cust omer", aggregate_id="1", event_type="E", payload={}))
            s.flush()
            assert s.execute(select(func.count()).select_from(OutboxEvent)).scalar_one() == 1
            s.rollback()
    finally:
        SmallEvent.__table__.drop(db)


def test_a_cdc_events_span_context_follows_its_headers_when_it_is_written_again(db: Engine) -> None:
    """An event written, rolled back, then added again with other headers: its ``tracingspancontext`` is
    derived again from them (before: the first traceparent's stayed, beside the new headers). One the
    application set itself is kept."""
    other = "00-3333333333333333333333333333333a-3333333333333333-01"
    with Session(db) as s:
        ev = _event(KeptEvent, n=1, headers={"traceparent": _TP})
        with s.begin():
            s.add(ev)
            s.flush()
            s.rollback()
        ev.headers = {"traceparent": other}
        own = _event(KeptEvent, n=2, headers={"traceparent": _TP}, tracingspancontext="traceparent=mine\n")
        with s.begin():
            s.add_all([ev, own])
    with db.connect() as conn:
        rows = dict(conn.execute(text("SELECT payload->>'n', tracingspancontext FROM cdc_outbox_kept")).all())
    assert rows == {"1": f"traceparent={other}\n", "2": "traceparent=mine\n"}


_TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def tracer() -> Any:
    """A tracer of a provider of its own, not the global one: an SDK provider installed globally makes every
    later test's dispatcher open recording publish spans, whose traceparent then appears in headers that
    those tests compare exactly. The producer reads the active span from the context, whoever made it."""
    return TracerProvider().get_tracer("tests.cdc")


def test_the_active_span_goes_into_headers_and_debeziums_tracing_column(db: Engine, tracer: Any) -> None:
    with tracer.start_as_current_span("request") as span, Session(db) as s, s.begin():
        ctx = span.get_span_context()
        expected = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
        s.add(_event(KeptEvent, n=1, headers={"x-tenant": "acme"}))
        emit(s, KeptEvent, [("customer", "7", "Charged", {"n": 2})])
    with Session(db) as s, s.begin():
        s.add(_event(KeptEvent, n=3, headers={"traceparent": _TP, "tracestate": "vendor=a\\b"}))  # relayed
    with db.connect() as conn:
        rows = {r.payload["n"]: r for r in conn.execute(select(KeptEvent.__table__))}
    for n in (1, 2):
        assert rows[n].headers["traceparent"] == expected
        # java.util.Properties text, what the event router's tracing reads (tracing.span.context.field)
        assert rows[n].tracingspancontext == f"traceparent={expected}\n"
    assert rows[1].headers["x-tenant"] == "acme"
    assert rows[3].tracingspancontext == f"traceparent={_TP}\ntracestate=vendor=a\\\\b\n"


@pytest.mark.parametrize("path", ["add", "for_aggregate", "emit", "orm_insert"])
def test_every_path_takes_the_aggregate_lock(db: Engine, path: str) -> None:
    """T1 writes and holds its transaction; T2 writes for the same aggregate and must wait for T1's commit."""

    def write(s: Session, n: int) -> None:
        if path == "add":
            s.add(_event(KeptEvent, agg="1", n=n))
        elif path == "for_aggregate":
            account = s.get(Account, 1)
            s.add(KeptEvent.for_aggregate(account, "Touched", {"n": n}))
        elif path == "emit":
            emit(s, KeptEvent, [("customer", "1", "Charged", {"n": n})])
        else:
            s.execute(insert(KeptEvent), [{"aggregate_type": "customer", "aggregate_id": "1",
                                           "event_type": "Charged", "payload": {"n": n}}])  # fmt: skip

    result = race(db, write, app=f"cdc-{path}")
    assert result.t2_waited_on_a_lock and result.commits == ["T1", "T2"]


class _DomainCdcSession(Session):
    """An application session whose own ``before_flush`` listener (registered after sa_outbox's hook, so it runs
    after it) turns each changed account into a CDC event: ``session.info["cdc_model"]`` says into which table,
    ``session.info["cdc_bad"]`` makes the payload unserialisable; the events it made are kept in
    ``session.info["cdc_added"]`` (the session's identity map holds its objects weakly)."""


@event.listens_for(_DomainCdcSession, "before_flush")
def _account_events(session: Session, flush_context: Any, instances: Any) -> None:
    model = session.info.get("cdc_model", CdcEvent)
    for obj in list(session.dirty):
        if isinstance(obj, Account):
            payload: Any = {"x": object()} if session.info.get("cdc_bad") else {"n": obj.balance}
            ev = model.for_aggregate(obj, "Charged", payload)
            session.add(ev)
            session.info.setdefault("cdc_added", []).append(ev)


def _cdc_domain(model: type[Any], bad: bool = False) -> Any:
    def factory(engine: Engine) -> Session:
        s = _DomainCdcSession(engine)
        s.info.update(cdc_model=model, cdc_bad=bad)
        return s

    return factory


@pytest.mark.parametrize("model", [CdcEvent, KeptEvent], ids=["deleted", "kept"])
def test_an_event_a_before_flush_listener_adds_is_written_like_any_other(
    db: Engine, model: type[Any]
) -> None:
    """The listener's event belongs to the flush that ran the listener: inserted (and, by default, deleted) in
    it, the same as one added with ``session.add``; once written it is insert-only like any other."""
    table = model.__tablename__
    with _cdc_domain(model)(db) as s, s.begin():
        written = _Written(s, table)
        s.get_one(Account, 1).balance = 5
        s.flush()
        assert written() == ((1, 1) if model is CdcEvent else (1, 0))
        (ev,) = s.info["cdc_added"]
        assert isinstance(ev.id, uuid.UUID) and ev.created_at is not None
        assert (ev in s) is (model is KeptEvent)  # a deleted event is detached, as with session.add
        assert ev.payload == {"n": 5} and ev.aggregate_id == "1"
        if model is KeptEvent:
            with pytest.raises(PayloadError, match="insert-only"):
                ev.payload = {"n": 6}
    with db.connect() as conn:
        kept = conn.execute(select(KeptEvent.aggregate_type, KeptEvent.aggregate_id, KeptEvent.payload)).all()
    assert kept == ([("account", "1", {"n": 5})] if model is KeptEvent else [])


@pytest.mark.parametrize("model", [CdcEvent, KeptEvent], ids=["deleted", "kept"])
def test_a_before_flush_listeners_bad_event_writes_nothing(db: Engine, model: type[Any]) -> None:
    """Refused before any of the flush's SQL: neither the account's change nor an event is written."""
    with _cdc_domain(model, bad=True)(db) as s:
        s.begin()
        written = _Written(s, model.__tablename__)
        s.get_one(Account, 1).balance = 5
        with s.no_autoflush:
            with pytest.raises(PayloadError, match=r"'Charged'.*not JSON-serialisable"):
                s.flush()
            assert s.execute(text("SELECT balance FROM cdc_accounts WHERE id = 1")).scalar_one() == 0
            assert written() == (0, 0)
        s.rollback()


def test_a_before_flush_listeners_event_takes_the_aggregate_lock(db: Engine) -> None:
    """T2's listener-made event for account 1 waits for T1's (the account's row lock), and commits after it."""

    def write(s: Session, n: int) -> None:
        s.get_one(Account, 1).balance = n

    result = race(db, write, app="cdc-listener", session_factory=_cdc_domain(KeptEvent))
    assert result.t2_waited_on_a_lock and result.commits == ["T1", "T2"]
    with db.connect() as conn:
        rows = conn.execute(select(KeptEvent.payload).order_by(KeptEvent.created_at)).scalars().all()
    assert rows == [{"n": 1}, {"n": 2}]


def test_no_notify_is_sent_for_a_cdc_table(db: Engine) -> None:
    """Nobody polls a CDC table: its events leave through the WAL, so the producer wakes no dispatcher."""
    url = db.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(
            psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel_for("cdc_outbox")))
        )
        with Session(db) as s, s.begin():
            s.add(_event())
        listener.execute("SELECT 1")
        assert list(listener.notifies(timeout=0.2)) == []


def test_a_dispatcher_refuses_a_cdc_model(db: Engine) -> None:
    with pytest.raises(SchemaError):
        Dispatcher(db, CdcEvent, RecordingPublisher())


# --- the Debezium connector configuration --------------------------------------------------------------------

# Option names as the Debezium documentation spells them (debezium/debezium, documentation/modules/ROOT/pages/
# transformations/outbox-event-router.adoc, "Configuration options"): every option of the outbox event router.
# There is no `table.field.event.type` among them: the event type travels through
# `table.fields.additional.placement` ("Emitting messages with additional fields").
EVENT_ROUTER_OPTIONS = {
    "table.op.invalid.behavior", "table.field.event.id", "table.field.event.key", "table.field.event.timestamp",
    "table.field.event.payload", "table.expand.json.payload", "table.fields.additional.placement",
    "table.field.event.schema.version", "route.by.field", "route.topic.regex", "route.topic.replacement",
    "route.tombstone.on.empty.payload", "tracing.span.context.field", "tracing.operation.name",
    "tracing.with.context.field.only",
}  # fmt: skip
# The placements `table.fields.additional.placement` allows ("The allowed values for placement are").
PLACEMENTS = {"header", "envelope", "partition"}
# PostgreSQL connector options (connectors/postgresql.adoc, "Required connector configuration properties" and
# the advanced ones), with the values we rely on: `publication.autocreate.mode` is one of all_tables, disabled,
# filtered; `plugin.name` pgoutput.
POSTGRES_CONNECTOR_OPTIONS = {
    "connector.class", "tasks.max", "plugin.name", "slot.name", "publication.name", "publication.autocreate.mode",
    "database.hostname", "database.port", "database.user", "database.password", "database.dbname",
    "topic.prefix", "table.include.list", "tombstones.on.delete",
}  # fmt: skip
# Kafka Connect's own connector-level options: converters, transforms and predicates (the transform's `type`
# and `predicate`; TopicNameMatches' `pattern`).
KAFKA_CONNECT_OPTIONS = {
    "key.converter", "value.converter", "value.converter.schemas.enable", "header.converter", "transforms",
    "predicates",
}  # fmt: skip


def _config(**kw: Any) -> dict[str, str]:
    options = {"url": "postgresql+psycopg://app:secret@db.example.com:6543/shop", **kw}
    out = debezium_config(CdcEvent, **options)
    assert set(out) == {"name", "config"}
    config: dict[str, str] = out["config"]
    assert all(isinstance(v, str) for v in config.values())  # Kafka Connect's REST API takes strings
    return config


def test_every_option_of_the_config_is_a_documented_debezium_or_kafka_connect_option() -> None:
    config = _config()
    for key in config:
        if key.startswith("transforms.outbox."):
            option = key.removeprefix("transforms.outbox.")
            assert option in EVENT_ROUTER_OPTIONS | {"type", "predicate"}, key
        elif key.startswith("predicates.outbox_table."):
            assert key.removeprefix("predicates.outbox_table.") in {"type", "pattern"}, key
        else:
            assert key in POSTGRES_CONNECTOR_OPTIONS | KAFKA_CONNECT_OPTIONS, key
    assert "transforms.outbox.table.field.event.type" not in config


def test_the_config_maps_the_event_router_fields_to_the_mixins_columns() -> None:
    config = _config()
    columns = set(CdcEvent.__table__.c.keys())
    router = {
        k.removeprefix("transforms.outbox."): v for k, v in config.items() if k.startswith("transforms.")
    }
    assert router["type"] == "io.debezium.transforms.outbox.EventRouter"
    assert router["table.field.event.id"] == "id"
    assert router["table.field.event.key"] == "aggregate_id"
    assert router["table.field.event.payload"] == "payload"
    assert router["route.by.field"] == "aggregate_type"
    assert router["route.topic.replacement"] == "outbox.event.${routedByValue}"  # KafkaPublisher's topics
    assert router["tracing.span.context.field"] == "tracingspancontext"
    placements = {}
    for entry in router["table.fields.additional.placement"].split(","):
        column, placement, alias = entry.split(":")
        assert column in columns and placement in PLACEMENTS
        placements[alias] = (column, placement)
    # The header names KafkaPublisher writes, so that consumers read both the same way.
    assert placements == {
        "message_id": ("id", "header"), "event-type": ("event_type", "header"),
        "aggregate-type": ("aggregate_type", "header"), "aggregate-id": ("aggregate_id", "header"),
        "created-at": ("created_at", "header"), "outbox-headers": ("headers", "header"),
    }  # fmt: skip
    for option in ("table.field.event.id", "table.field.event.key", "table.field.event.payload",
                   "route.by.field", "tracing.span.context.field"):  # fmt: skip
        assert router[option] in columns


def test_the_config_names_the_table_slot_publication_and_database() -> None:
    config = _config(slot_name="orders_outbox", topic_prefix="shop")
    assert config["connector.class"] == "io.debezium.connector.postgresql.PostgresConnector"
    assert config["plugin.name"] == "pgoutput"
    assert config["publication.autocreate.mode"] == "filtered"
    assert config["slot.name"] == "orders_outbox"
    assert config["table.include.list"] == r"public\.cdc_outbox"
    assert (config["database.hostname"], config["database.port"], config["database.user"],
            config["database.dbname"]) == ("db.example.com", "6543", "app", "shop")  # fmt: skip
    assert "database.password" not in config  # never copied from the URL
    assert _config(password="${file:/secrets/pg.properties:password}")["database.password"].startswith(
        "${file:"
    )
    # The router only sees the outbox table's records (a heartbeat added later does not reach it).
    assert config["transforms.outbox.predicate"] == "outbox_table"
    assert re.fullmatch(config["predicates.outbox_table.pattern"], "shop.public.cdc_outbox")
    assert not re.fullmatch(config["predicates.outbox_table.pattern"], "__debezium-heartbeat.shop")
    # The key as plain UTF-8 text: the same bytes, hence the same partition, as KafkaPublisher's key.
    assert config["key.converter"] == "org.apache.kafka.connect.storage.StringConverter"
    assert config["tombstones.on.delete"] == "false"


def _debezium_split(include_list: str) -> list[str]:
    """Debezium's split of an include list (``Strings.RegExSplitterByComma``): at commas not escaped by a
    backslash, each entry trimmed, ``\\,`` then read as a comma."""
    parts, current, chars = [], "", iter(include_list)
    for ch in chars:
        if ch == "\\":
            current += ch + next(chars)
        elif ch == ",":
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p.strip().replace("\\,", ",") for p in parts if p]


def _debezium_topic(name: str) -> str:
    """Debezium's default topic naming (``AbstractTopicNamingStrategy.sanitizedTopicName``): each UTF-16 code
    unit outside A-Z a-z 0-9 . _ - becomes ``_``."""
    units = name.encode("utf-16-le", "surrogatepass")
    chars = [chr(int.from_bytes(units[i : i + 2], "little")) for i in range(0, len(units), 2)]
    return "".join(c if re.fullmatch(r"[A-Za-z0-9._-]", c) else "_" for c in chars)[:249]


@pytest.mark.parametrize(
    ("schema", "table"),
    [("Tenant A", "Outbox"), ("public", "événements"), ("public", 'ev"il'), ("public", "a,b"), (" s", "t "),
     ("public", "out\\box"), ("public", "🎉events"), ("x'y", "t")],
)  # fmt: skip
def test_odd_table_names_are_streamed_and_routed(schema: str, table: str) -> None:
    """The include list must select the table, and the router's predicate must match the topic Debezium
    streams it to — which its default naming writes with ``_`` for every character outside A-Z a-z 0-9 . _ -.
    Before: the predicate named the raw table (``shop\\.Tenant A\\.Outbox``), matched no record, and the
    router never ran — the raw change events, deletes included, went to Debezium's own topic, with exit 0."""
    moved = CdcEvent.__table__.to_metadata(MetaData(), schema=schema, name=table)
    config = debezium_config(moved, url="postgresql://app@db:5432/shop", topic_prefix="shop")["config"]
    [entry] = _debezium_split(config["table.include.list"])
    assert re.fullmatch(entry, f"{schema}.{table}")
    assert not re.fullmatch(entry, f"{schema}.{table}x") and not re.fullmatch(entry, f"public.{table}_other")
    topic = _debezium_topic(f"shop.{schema}.{table}")
    assert re.fullmatch(config["predicates.outbox_table.pattern"], topic), (config, topic)


def test_the_record_value_is_the_payloads_json_whatever_its_shape() -> None:
    """The payload column's text as PostgreSQL sends it, through Kafka Connect's string converter — not
    expanded by the router, which dropped fields holding null and empty arrays, and sent a payload with a
    top-level scalar, an array of mixed numbers or an integer past 64 bits as one JSON string."""
    config = _config()
    assert config["transforms.outbox.table.expand.json.payload"] == "false"
    assert config["value.converter"] == "org.apache.kafka.connect.storage.StringConverter"
    assert "value.converter.schemas.enable" not in config


@pytest.mark.parametrize(
    "options",
    [{"url": "postgresql://app@db:0/shop"}, {"slot_name": ""}, {"publication_name": ""}, {"topic_prefix": ""},
     {"name": ""}, {"name": "  "}],
)  # fmt: skip
def test_blank_names_and_port_zero_are_refused_not_replaced(options: dict[str, Any]) -> None:
    """Before: port 0 printed 5432, and an empty slot, publication, prefix or connector name its default."""
    with pytest.raises(ValueError):
        _config(**options)


def test_slot_and_publication_names_follow_postgresqls_rules() -> None:
    config = _config()
    assert re.fullmatch(r"[a-z0-9_]{1,63}", config["slot.name"])
    assert config["publication.name"] == config["slot.name"]
    with pytest.raises(ValueError, match="lower-case letters, numbers"):
        _config(slot_name="Orders-Outbox")


def test_setup_sql_creates_the_publication_and_slot_the_config_names() -> None:
    config = _config()
    statements = setup_sql(CdcEvent)
    assert statements == [
        f'CREATE PUBLICATION "{config["publication.name"]}" FOR TABLE "public"."cdc_outbox"',
        f"SELECT pg_create_logical_replication_slot('{config['slot.name']}', 'pgoutput')",
    ]


def test_headers_from_debezium_unfolds_the_event_headers() -> None:
    record = [("id", b"4d47e190-0402-4048-bc2c-89dd54343cdc"), ("message_id", b"4d47e190-0402-4048-bc2c-89dd54343cdc"),
              ("event-type", b"OrderPaid"), ("outbox-headers", b'{"x-tenant":"acme","event-type":"spoof","traceparent":"' + _TP.encode() + b'"}')]  # fmt: skip
    assert headers_from_debezium(record) == {
        "id": "4d47e190-0402-4048-bc2c-89dd54343cdc", "message_id": "4d47e190-0402-4048-bc2c-89dd54343cdc",
        "event-type": "OrderPaid", "x-tenant": "acme", "traceparent": _TP,
    }  # fmt: skip
    assert headers_from_debezium([("outbox-headers", None), ("event-type", b"E")]) == {"event-type": "E"}
    assert headers_from_debezium([("outbox-headers", b"null"), ("event-type", b"E")]) == {"event-type": "E"}
    for bad, problem in (([("event-type", b"\xff")], "not UTF-8"), ([("outbox-headers", b"{nope")], "not JSON"),
                         ([("outbox-headers", b"[1]")], "not a JSON object"),
                         ([("outbox-headers", b'{"x": true}')], "not a string")):  # fmt: skip
        with pytest.raises(PayloadError, match=problem):
            headers_from_debezium(bad)


def test_the_cli_refuses_a_polling_outbox_table(db: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    url = db.url.render_as_string(hide_password=False)
    assert main(["cdc", "debezium-config", "--url", url, "--table", "outbox"]) == 2
    assert "CdcOutboxMixin" in capsys.readouterr().err
    assert main(["cdc", "debezium-config", "--url", url, "--table", "no_such_table"]) == 2


def test_the_cli_checks_the_table_through_url_and_prints_the_debezium_url(
    db: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """The application's URL may be PgBouncer or a socket; Debezium connects to the server itself."""
    url = db.url.render_as_string(hide_password=False)
    argv = ["cdc", "debezium-config", "--url", url, "--table", "cdc_outbox",
            "--debezium-url", "postgresql://debezium:secret@db.internal:5433/shop"]  # fmt: skip
    assert main(argv) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["database.hostname"], config["database.port"], config["database.user"],
            config["database.dbname"]) == ("db.internal", "5433", "debezium", "shop")  # fmt: skip
    assert "secret" not in json.dumps(config)
    for bad in (
        "not a url",
        "postgresql://u@h:notaport/db",
    ):  # a usage error, one line (before: a traceback, 1)
        assert main([*argv[:-1], bad]) == 2
        err = capsys.readouterr().err
        assert "sa-outbox: error: invalid database URL for Debezium" in err and "Traceback" not in err
    for bad, said in (  # URLs the config would carry wrongly: refused, naming what is wrong (before: printed)
        ("postgresql://u@h:99999/db", "port 99999 is not a TCP port"),
        ("mysql://u@h:3306/db", "is not PostgreSQL's (mysql://"),
        ("postgresql://u@/db?host=db.internal", "query options (host)"),
        ("postgresql://u@h/db?sslmode=require", "query options (sslmode)"),
    ):
        assert main([*argv[:-1], bad]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err


def test_the_cli_prints_the_setup_sql_and_warns_about_wal_level(
    db: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    url = db.url.render_as_string(hide_password=False)
    assert main(["cdc", "setup-sql", "--url", url, "--table", "cdc_outbox"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"{s};" for s in setup_sql(CdcEvent)]
    # The test server is not set up for logical decoding: said on stderr, the output stays usable.
    assert "wal_level=replica" in err and "Debezium needs wal_level=logical" in err


def test_the_cli_warns_about_a_table_whose_deletes_a_publication_would_refuse(
    db: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """Published, a table without a replica identity key refuses DELETEs — every producer transaction of
    insert-then-delete mode fails. setup-sql warned about REPLICA IDENTITY NOTHING only; a dropped primary key
    (the DEFAULT identity's key) went unsaid (a review)."""
    url = db.url.render_as_string(hide_password=False)

    def warnings() -> str:
        assert main(["cdc", "setup-sql", "--url", url, "--table", "cdc_noid"]) == 0
        return capsys.readouterr().err

    with db.begin() as conn:
        conn.execute(text("CREATE TABLE cdc_noid (LIKE cdc_outbox INCLUDING DEFAULTS)"))  # no primary key
    try:
        assert "cdc_noid has no primary key: once it is in a publication, its DELETEs fail" in warnings()
        with db.begin() as conn:  # what the warning says
            conn.execute(text("CREATE PUBLICATION cdc_noid_pub FOR TABLE cdc_noid"))
        with pytest.raises(DBAPIError, match="does not have a replica identity"), db.begin() as conn:
            conn.execute(text("DELETE FROM cdc_noid"))
        with db.begin() as conn:
            conn.execute(text("ALTER TABLE cdc_noid REPLICA IDENTITY NOTHING"))
        assert "REPLICA IDENTITY NOTHING" in warnings()
        with db.begin() as conn:
            conn.execute(text("ALTER TABLE cdc_noid REPLICA IDENTITY DEFAULT, ADD PRIMARY KEY (id)"))
        said = warnings()
        assert "cdc_noid has" not in said and "wal_level" in said
    finally:
        with db.begin() as conn:
            conn.execute(text("DROP PUBLICATION IF EXISTS cdc_noid_pub"))
            conn.execute(text("DROP TABLE cdc_noid"))


def test_the_cli_warns_when_the_slot_and_publication_names_may_be_another_tables(
    db: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """Default names come from the table's name, lower-cased, other characters as "_", cut at 63: "Outbox-CDC"
    and "outbox_cdc" share one, and so do two schemas' tables; the second setup then failed on "publication
    already exists" (a review). Said when the name is not kept whole, and when a publication of that name
    already publishes another table."""
    url = db.url.render_as_string(hide_password=False)

    def warnings(*argv: str) -> str:
        assert main(["cdc", "setup-sql", "--url", url, *argv]) == 0
        return capsys.readouterr().err

    with db.begin() as conn:
        conn.execute(text('CREATE TABLE "Outbox-CDC" (LIKE cdc_outbox INCLUDING ALL)'))
        conn.execute(text("CREATE PUBLICATION sa_outbox_cdc_outbox FOR TABLE cdc_outbox_kept"))
    try:
        assert "name sa_outbox_outbox_cdc does not keep the table's name 'Outbox-CDC' whole" in warnings(
            "--table", "Outbox-CDC"
        )
        assert "give this table its own" not in warnings(
            "--table", "Outbox-CDC", "--slot-name", "outbox_cdc_2"
        )
        said = warnings("--table", "cdc_outbox")
        assert "publication sa_outbox_cdc_outbox already publishes public.cdc_outbox_kept" in said, said
        assert "give this table its own" not in warnings("--table", "cdc_outbox", "--slot-name", "cdc_own")
        # the publication of exactly this table: no clash
        said = warnings("--table", "cdc_outbox_kept", "--publication-name", "sa_outbox_cdc_outbox")
        assert "already publishes" not in said and "give this table its own" not in said, said
    finally:
        with db.begin() as conn:
            conn.execute(text("DROP PUBLICATION sa_outbox_cdc_outbox"))
            conn.execute(text('DROP TABLE "Outbox-CDC"'))


# --- logical decoding on a throwaway cluster -----------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[LogicalCluster]:
    with logical_cluster() as c:
        yield c


@pytest.fixture(scope="module")
def logical(cluster: LogicalCluster) -> Iterator[Engine]:
    engine = create_engine(cluster.url, pool_size=12, max_overflow=4)
    CdcBase.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO cdc_accounts (balance) SELECT 0 FROM generate_series(1, 3)"))
    yield engine
    engine.dispose()


@pytest.fixture
def wal(logical: Engine) -> Iterator[Slot]:
    """A wal2json slot created now: it decodes what the test writes afterwards."""
    with Slot(
        logical, f"t_{uuid.uuid4().hex[:12]}", "wal2json", (*WAL2JSON_OPTIONS, "add-tables", TABLES)
    ) as s:
        yield s


def _inserts(txns: list[Transaction]) -> list[Change]:
    return [c for tx in txns for c in tx.changes if c.action == "I"]


def _n(change: Change) -> int:
    return int(json.loads(change.values["payload"] or "null")["n"])


N_PRODUCERS, N_TRANSACTIONS = 8, 25
AGGREGATES = [("customer", f"c{i}") for i in range(4)]


def _planned(rng: random.Random, key: tuple[int, int, int], atype: str, aid: str) -> dict[str, Any]:
    """One event a producer is about to write (its expected columns; ``id`` once known)."""
    p, t, i = key
    headers = {"x-producer": str(p)}
    if rng.random() < 0.5:
        headers["traceparent"] = f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01"
    payload = {
        "p": p,
        "t": t,
        "i": i,
        "n": i,
        "text": 'é ✓ "q" \\ \u2028',
        "nested": {"list": [1, 2.5, None]},
    }
    return {"aggregate_type": atype, "aggregate_id": aid, "event_type": f"E{i}", "payload": payload,
            "headers": headers, "id": None}  # fmt: skip


def _columns(ev: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in ev.items() if k != "id"}


def _as_tuple(ev: dict[str, Any]) -> tuple[str, str, str, Any, dict[str, str]]:
    return ev["aggregate_type"], ev["aggregate_id"], ev["event_type"], ev["payload"], ev["headers"]


def _transaction(s: Session, path: str, events: list[dict[str, Any]], account_id: int) -> None:
    """Write ``events`` (one aggregate) through ``path``, recording the ids the path gives back."""
    if path == "add":
        objs = [CdcEvent(**_columns(ev)) for ev in events]
        s.add_all(objs)
        s.flush()
        for ev, obj in zip(events, objs, strict=True):
            ev["id"] = obj.id
    elif path == "emit":
        for ev, new_id in zip(events, emit(s, CdcEvent, [_as_tuple(ev) for ev in events]), strict=True):
            ev["id"] = new_id
    elif path == "orm_insert":
        s.execute(insert(CdcEvent), [_columns(ev) for ev in events])  # ids made by the producer, not returned
    elif path == "for_aggregate":
        account = s.get(Account, account_id)
        for ev in events:
            obj = CdcEvent.for_aggregate(account, ev["event_type"], ev["payload"])
            obj.headers = ev["headers"]
            s.add(obj)
            s.flush()
            ev["id"] = obj.id
    else:  # mixed: add, emit (which writes the added one first), add (written at commit)
        first, second, third = events
        a, c = CdcEvent(**_columns(first)), CdcEvent(**_columns(third))
        s.add(a)
        [second["id"]] = emit(s, CdcEvent, [_as_tuple(second)])
        s.add(c)
        s.flush()
        first["id"], third["id"] = a.id, c.id


def _produce(engine: Engine, p: int, committed: dict[tuple[int, int, int], dict[str, Any]],
             errors: list[BaseException]) -> None:  # fmt: skip
    """One producer: transactions over one aggregate each, through a random path, some rolled back."""
    rng = random.Random(p)
    try:
        for t in range(N_TRANSACTIONS):
            path = rng.choice(["add", "emit", "orm_insert", "for_aggregate", "mixed"])
            account_id = rng.randint(1, 3)
            atype, aid = ("account", str(account_id)) if path == "for_aggregate" else rng.choice(AGGREGATES)
            count = 3 if path == "mixed" else rng.randint(1, 3)
            events = [_planned(rng, (p, t, i), atype, aid) for i in range(count)]
            with Session(engine) as s:
                s.begin()
                _transaction(s, path, events, account_id)
                if rng.random() < 0.15:
                    s.rollback()
                    continue
                s.commit()
            for ev in events:
                committed[(p, t, ev["payload"]["i"])] = ev
    except BaseException as exc:
        errors.append(exc)


def test_eight_concurrent_producers_decode_in_commit_order_with_every_event_intact(
    logical: Engine, wal: Slot
) -> None:
    committed: dict[tuple[int, int, int], dict[str, Any]] = {}
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_produce, args=(logical, p, committed, errors)) for p in range(N_PRODUCERS)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads) and not errors, errors
    txns = wal.take()

    # Transactions arrive whole, in commit order.
    commit_lsns = [tx.commit_lsn for tx in txns]
    assert commit_lsns == sorted(commit_lsns) and len(set(commit_lsns)) == len(txns)
    # ... and the producers really overlapped: the commit order switches between them all the time.
    owners = [json.loads(tx.changes[0].values["payload"] or "{}")["p"] for tx in txns]
    assert sum(a != b for a, b in itertools.pairwise(owners)) >= N_PRODUCERS

    inserts = _inserts(txns)
    by_key: dict[tuple[int, int, int], Change] = {}
    for change in inserts:
        payload = json.loads(change.values["payload"] or "null")
        key = (payload["p"], payload["t"], payload["i"])
        assert key not in by_key, f"{key} decoded twice"
        by_key[key] = change
    # Exactly the committed events: none of a rolled-back transaction, none missing.
    assert by_key.keys() == committed.keys()
    assert len(committed) > 200

    for key, change in by_key.items():  # payload, headers and the columns the router maps, intact
        ev, values = committed[key], change.values
        assert (values["aggregate_type"], values["aggregate_id"], values["event_type"]) == (
            ev["aggregate_type"], ev["aggregate_id"], ev["event_type"])  # fmt: skip
        assert json.loads(values["payload"] or "null") == ev["payload"]
        assert json.loads(values["headers"] or "null") == ev["headers"]
        tp = ev["headers"].get("traceparent")
        assert values["tracingspancontext"] == (f"traceparent={tp}\n" if tp else None)
        if ev["id"] is not None:
            assert values["id"] == str(ev["id"])

    for tx in txns:
        ins = [c for c in tx.changes if c.action == "I"]
        keys = [json.loads(c.values["payload"] or "null") for c in ins]
        assert len({(k["p"], k["t"]) for k in keys}) == 1  # one producer transaction
        assert [k["i"] for k in keys] == sorted(k["i"] for k in keys)  # in the order the code wrote them
        # Insert then delete: each inserted row is deleted later in the same transaction (the router drops
        # the deletes; the table stays empty).
        position = {c.values["id"]: at for at, c in enumerate(tx.changes) if c.action == "I"}
        deletes = [(at, c.values["id"]) for at, c in enumerate(tx.changes) if c.action == "D"]
        assert sorted(i for _, i in deletes) == sorted(position)
        assert all(at > position[i] for at, i in deletes)
        assert {c.action for c in tx.changes} == {"I", "D"}  # never an UPDATE

    # Per aggregate, the stream order is the write order (the WAL position of each insert): the producer's
    # aggregate lock makes a second writer wait for the first one's commit.
    by_aggregate: dict[tuple[str | None, str | None], list[int]] = defaultdict(list)
    for change in inserts:
        by_aggregate[(change.values["aggregate_type"], change.values["aggregate_id"])].append(change.lsn)
    assert len(by_aggregate) == len(AGGREGATES) + 3
    for aggregate, positions in by_aggregate.items():
        assert positions == sorted(positions), aggregate
    with logical.connect() as conn:
        assert conn.execute(select(func.count()).select_from(CdcEvent)).scalar_one() == 0


def test_the_stream_is_in_commit_order_not_write_order(logical: Engine, wal: Slot) -> None:
    """What an id-cursor poller gets wrong: a row written first but committed later arrives later."""
    with Session(logical) as first, Session(logical) as second:
        first.add(_event(agg="a", n=1))
        first.flush()
        second.add(_event(agg="b", n=2))
        second.commit()
        first.commit()
    inserts = _inserts(wal.take())
    assert [_n(c) for c in inserts] == [2, 1]
    assert inserts[1].lsn < inserts[0].lsn  # n=1 was written first


@pytest.mark.parametrize("locking", [True, False], ids=["locked", "unlocked"])
def test_the_aggregate_lock_makes_an_aggregates_stream_order_its_write_order(
    logical: Engine, wal: Slot, locking: bool
) -> None:
    def session(engine: Engine) -> Session:
        s = Session(engine)
        s.info[LOCK_AGGREGATES] = locking
        return s

    def write(s: Session, n: int) -> None:
        s.add(_event(agg="same", n=n))

    result = race(logical, write, app=f"cdc-lock-{locking}", session_factory=session)
    inserts = _inserts(wal.take())
    written_first = min(inserts, key=lambda c: c.lsn)
    if locking:  # T2 waited for T1: T1's event is first in the WAL and in the stream
        assert result.t2_waited_on_a_lock and [_n(c) for c in inserts] == [1, 2]
        assert inserts[0] is written_first
    else:  # without the lock T2 commits first: the stream reverses the write order of one aggregate
        assert not result.t2_waited_on_a_lock and [_n(c) for c in inserts] == [2, 1]
        assert inserts[1] is written_first


def test_an_async_session_writes_and_deletes_the_same_way(cluster: LogicalCluster, wal: Slot) -> None:
    async def write() -> list[uuid.UUID]:
        engine = create_async_engine(cluster.url.set(drivername="postgresql+psycopg_async"))
        try:
            async with AsyncSession(engine) as s, s.begin():
                s.add(_event(n=1, headers={"traceparent": _TP}))
                ids = await emit(s, CdcEvent, [("customer", "7", "Charged", {"n": 2})])
                account = await s.get(Account, 1)
                s.add(CdcEvent.for_aggregate(account, "Touched", {"n": 3}))
                # A new aggregate's key is known only once the flush inserted it: the event waits for it.
                new = Account()
                s.add(new)
                late = CdcEvent.for_aggregate(new, "Opened", {"n": 4})
                s.add(late)
                await s.flush()
                assert sa_inspect(late).deleted and late.aggregate_id == str(new.id)
            return ids
        finally:
            await engine.dispose()

    [emitted] = asyncio.run(write())
    [tx] = wal.take()
    assert [(c.action, _n(c) if c.action == "I" else None) for c in tx.changes] == [
        ("I", 1), ("D", None), ("I", 2), ("D", None), ("I", 3), ("D", None), ("I", 4), ("D", None)]  # fmt: skip
    assert tx.changes[2].values["id"] == str(emitted)
    assert tx.changes[0].values["tracingspancontext"] == f"traceparent={_TP}\n"
    assert (tx.changes[4].values["aggregate_type"], tx.changes[4].values["aggregate_id"]) == ("account", "1")


def test_keep_mode_decodes_inserts_only(logical: Engine, wal: Slot) -> None:
    with Session(logical) as s, s.begin():
        s.add_all([_event(KeptEvent, n=1), _event(KeptEvent, n=2)])
    [tx] = wal.take()
    assert [(c.action, c.table, _n(c)) for c in tx.changes] == [
        ("I", "public.cdc_outbox_kept", 1), ("I", "public.cdc_outbox_kept", 2)]  # fmt: skip
    with logical.begin() as conn:
        conn.execute(text("TRUNCATE cdc_outbox_kept"))


def test_the_payload_column_carries_every_json_shape_the_producer_accepts(logical: Engine, wal: Slot) -> None:
    """The record value is the payload column's text as decoding sends it (the configuration's string
    converter, no expansion by the router): nulls, empty arrays, mixed numbers, integers past 64 bits, a
    top-level array or scalar all arrive as written."""
    shapes = [{"a": None, "b": [], "c": [1, 2.5, None]}, {"big": 10**20}, [1, "two", None], "just text", 5, True,
              {"tiny": 1.5e-7}]  # fmt: skip
    with Session(logical) as s, s.begin():
        emit(s, KeptEvent, [("customer", "7", "E", p) for p in shapes])
    [tx] = wal.take()
    try:
        assert [json.loads(c.values["payload"] or "") for c in tx.changes] == shapes
    finally:
        with logical.begin() as conn:
            conn.execute(text("TRUNCATE cdc_outbox_kept"))


def test_pgoutput_through_the_generated_publication_carries_what_the_config_maps(
    logical: Engine, cluster: LogicalCluster
) -> None:
    """The plugin Debezium uses, the publication and slot ``setup_sql`` creates (what
    ``publication.autocreate.mode=filtered`` would create from the include list), and the configuration's
    column names checked against the columns PostgreSQL actually sends."""
    names = {"slot_name": f"t_pgoutput_{uuid.uuid4().hex[:8]}", "publication_name": "t_pub_cdc"}
    config = debezium_config(CdcEvent, url=cluster.url, **names)["config"]
    with logical.connect() as conn:
        for statement in setup_sql(CdcEvent, **names):
            conn.execute(text(statement))
            conn.commit()
    slot = Slot(
        logical, names["slot_name"], "pgoutput", ("proto_version", "1", "publication_names", "t_pub_cdc")
    )
    try:
        with Session(logical) as s, s.begin():
            ev = _event(n=1, headers={"x-tenant": "acme", "traceparent": _TP})
            s.add(ev)
            s.flush()
            [other] = emit(s, CdcEvent, [("customer", "8", "Charged", {"n": 2})])
        with Session(logical) as s, s.begin():  # a table outside the include list is not published
            s.add(_event(KeptEvent, n=3))
        [tx] = slot.take()
    finally:
        slot.drop()
        with logical.begin() as conn:
            conn.execute(text("DROP PUBLICATION t_pub_cdc"))
            conn.execute(text("TRUNCATE cdc_outbox_kept"))
    # Insert then delete, per flush; no UPDATE, and nothing of the table outside the include list.
    assert [(c.action, c.table) for c in tx.changes] == [
        ("I", "public.cdc_outbox"),
        ("D", "public.cdc_outbox"),
    ] * 2
    assert re.fullmatch(config["table.include.list"], tx.changes[0].table)
    first, first_gone, second, second_gone = tx.changes
    deletes = [first_gone, second_gone]
    # Every column the configuration names is a column PostgreSQL sends for the table.
    placement = [
        e.split(":")[0] for e in config["transforms.outbox.table.fields.additional.placement"].split(",")
    ]
    for column in [*placement, *(config[f"transforms.outbox.{o}"] for o in (
            "table.field.event.id", "table.field.event.key", "table.field.event.payload", "route.by.field",
            "tracing.span.context.field"))]:  # fmt: skip
        assert column in first.values, column
    assert first.values["id"] == str(ev.id) and second.values["id"] == str(other)
    assert json.loads(first.values["payload"] or "null") == {"n": 1}
    assert json.loads(first.values["headers"] or "null") == {"x-tenant": "acme", "traceparent": _TP}
    assert first.values["tracingspancontext"] == f"traceparent={_TP}\n"
    assert (first.values["aggregate_type"], first.values["aggregate_id"], first.values["event_type"]) == (
        "customer", "7", "Charged")  # fmt: skip
    # A delete carries the key only (REPLICA IDENTITY DEFAULT): the router drops deletes.
    assert [d.values for d in deletes] == [{"id": str(ev.id)}, {"id": str(other)}]


def test_the_cli_prints_the_connector_json_for_the_table(
    logical: Engine, cluster: LogicalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    url = cluster.url.render_as_string(hide_password=False)
    argv = ["cdc", "debezium-config", "--url", url, "--table", "public.cdc_outbox", "--topic-prefix", "shop"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out)
    assert printed == debezium_config(CdcEvent, url=cluster.url, topic_prefix="shop")
    config = printed["config"]
    assert (config["database.hostname"], config["database.port"]) == ("127.0.0.1", str(cluster.port))
    assert config["table.include.list"] == r"public\.cdc_outbox" and config["topic.prefix"] == "shop"
    assert err == ""  # wal_level=logical: nothing to warn about
