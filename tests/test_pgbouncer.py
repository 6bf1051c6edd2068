"""Through PgBouncer in transaction pooling mode (issue #23 §1): a private PgBouncer (the machine's package,
1.18 here) in front of the test database, and everything sa_outbox does, sent through it.

The settings a user needs come from one helper, :func:`sa_outbox.pgbouncer_engine`; the tests in "what breaks
without them" show each one's reason on this PgBouncer: psycopg's server-side prepared statements fail a drain
(and the loop stops with an error that names the fix), and LISTEN through the pooler never wakes a loop.

PgBouncer refuses to run as root: as root the fixture starts it (``-u``) as the owner of the server's socket
directory (the embedded server's data directory is closed to anyone else), else as ``postgres``. Its
databases (aliases of the one test database, each its own pool of server connections):

* ``<db>`` — the main pool (``POOL`` server connections) the working tests share;
* ``<db>_one`` — one server connection, for deterministic demonstrations of what prepared statements do;
* ``<db>_shared`` — two server connections shared by four clients;
* ``<db>_listen`` — where a LISTEN is sent through the pooler on purpose (its server connections keep it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, event, select, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from sa_outbox import (
    AsyncWorker,
    Backoff,
    ClaimedJob,
    ConfigurationError,
    Dispatcher,
    Receipt,
    RetryableError,
    Worker,
    _execute,
    cancel_jobs,
    emit,
    enqueue,
    maintain_partitions,
    pgbouncer_async_engine,
    pgbouncer_engine,
    receive,
)
from sa_outbox._cli import main as cli
from sa_outbox._names import channel_for
from sa_outbox.admin import pause_queue, resume_queue
from sa_outbox.doctor import doctor
from sa_outbox.models import Inbox, Job, OutboxEvent
from sa_outbox.testing import RecordingPublisher, drain

from .commit_order import assert_serialised
from .factories import FAST, Runner
from .helpers import fresh_schema, row, seed_events, seed_jobs, statuses
from .models import Order
from .pooler import POOL, PrivatePgBouncer
from .test_loop_guarantees import _turns_failed_behind_a_refusal, wait_until
from .test_lost_connection_autocommit import limited_workers_losing_connections

# --- a private PgBouncer: tests/pooler.py ------------------------------------------------------------


@pytest.fixture(scope="session")
def bouncer(server_url: URL, db_url: URL) -> Iterator[PrivatePgBouncer]:
    name = str(db_url.database)
    aliases = {name: (name, POOL), f"{name}_one": (name, 1), f"{name}_shared": (name, 2),
               f"{name}_listen": (name, 2), f"{name}_cut": (name, 2),
               f"{name}_lost": (name, 6), f"{name}_pause": (name, 1)}  # fmt: skip
    server = PrivatePgBouncer(server_url, aliases)
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def pooled_url(bouncer: PrivatePgBouncer, db_url: URL) -> URL:
    return bouncer.url(str(db_url.database))


@pytest.fixture(scope="session")
def pooled(pooled_url: URL, db_url: URL) -> Iterator[tuple[Engine, dict[str, Any]]]:
    """The engine and wake-up options a user gets from the helper: through PgBouncer, LISTEN on the server."""
    engine, wakeups = pgbouncer_engine(pooled_url, direct_url=db_url, pool_size=10, max_overflow=20)
    yield engine, dict(wakeups)
    engine.dispose()


@pytest.fixture
def pengine(engine: Engine, pooled: tuple[Engine, dict[str, Any]]) -> Engine:
    """The pooled engine, after ``engine`` (direct) emptied the tables."""
    return pooled[0]


class PooledRunner(Runner):
    """tests.factories.Runner with both flavours' engines from the helper (through PgBouncer)."""

    def __init__(self, kind: str, engine: Engine, url: URL, direct: URL) -> None:
        super().__init__(kind, engine, url.set(drivername="postgresql+psycopg_async"))
        if self.aengine is not None:  # replaced before it ever connected
            self.aengine, _ = pgbouncer_async_engine(url, direct_url=direct)


@pytest.fixture(params=["sync", "async"])
def prunner(request: pytest.FixtureRequest, pengine: Engine, pooled_url: URL, db_url: URL) -> Iterator[Any]:
    r = PooledRunner(request.param, pengine, pooled_url, db_url)
    yield r
    r.close()


def occupy_prepared_names(url: URL, n: int = 20) -> None:
    """What any earlier client of the pool leaves behind: psycopg's statement names ``_pg3_0`` …
    ``_pg3_{n-1}`` prepared on the server connection(s) it used (PgBouncer resets nothing between clients of
    a transaction pool)."""
    with psycopg.connect(url.set(drivername="postgresql").render_as_string(hide_password=False),
                         autocommit=True) as conn:  # fmt: skip
        for i in range(n):
            try:
                conn.execute(f"SELECT {i} AS n".encode(), prepare=True)
            except psycopg.errors.DuplicatePreparedStatement:
                return  # an earlier test left them there already


def listeners(engine: Engine) -> set[int]:
    """Backends of the test database whose last statement was a LISTEN (a waker, once its LISTEN is up)."""
    with engine.connect() as conn:
        return set(conn.execute(text(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'"
        )).scalars())  # fmt: skip


def wait_for_listeners(engine: Engine, count: int, *, before: set[int], among: Any = None) -> None:
    """Until ``count`` backends not in ``before`` (and in ``among()`` when given) have run their LISTEN: a
    commit made now is sure to be notified to them."""

    def up() -> bool:
        new = listeners(engine) - before
        return len(new & set(among()) if among is not None else new) >= count

    assert wait_until(up, 15), "the loops' LISTEN never ran"


# --- the helper -----------------------------------------------------------------------------------------


def test_pgbouncer_engine_switches_prepared_statements_off_and_listens_on_the_server(
    pooled_url: URL, db_url: URL
) -> None:
    engine, wakeups = pgbouncer_engine(pooled_url.render_as_string(hide_password=False), direct_url=db_url)
    try:
        assert wakeups == {"listen": True, "listen_url": db_url.set(drivername="postgresql+psycopg")}
        with engine.connect() as conn:
            assert conn.connection.driver_connection.prepare_threshold is None  # type: ignore[union-attr]
            assert conn.execute(text("SELECT 1")).scalar_one() == 1
    finally:
        engine.dispose()
    poll_only = pgbouncer_engine(pooled_url)
    assert poll_only[1] == {"listen": False}
    poll_only[0].dispose()
    kept, _ = pgbouncer_engine(pooled_url, prepared_statements=True)  # PgBouncer >= 1.21 with tracking on
    with kept.connect() as conn:
        assert conn.connection.driver_connection.prepare_threshold == 5  # type: ignore[union-attr]
    kept.dispose()
    plain, _ = pgbouncer_engine(pooled_url.set(drivername="postgresql"))
    assert plain.dialect.driver == "psycopg"
    plain.dispose()

    async def check_async() -> None:
        aengine, awake = pgbouncer_async_engine(pooled_url, direct_url=db_url)
        try:
            assert awake == wakeups and aengine.url.drivername == "postgresql+psycopg_async"
            async with aengine.connect() as conn:
                raw = await conn.get_raw_connection()
                assert raw.driver_connection.prepare_threshold is None  # type: ignore[union-attr]
        finally:
            await aengine.dispose()

    asyncio.run(check_async())


def test_pgbouncer_engine_refuses_other_drivers_and_contradicting_settings(pooled_url: URL) -> None:
    with pytest.raises(ConfigurationError, match="psycopg 3"):
        pgbouncer_engine(pooled_url.set(drivername="postgresql+asyncpg"))
    with pytest.raises(ConfigurationError, match="direct_url: not a database URL"):
        pgbouncer_engine(pooled_url, direct_url="not a url")
    with pytest.raises(ConfigurationError, match="prepared_statements=True"):
        pgbouncer_engine(pooled_url, connect_args={"prepare_threshold": 5})
    engine, _ = pgbouncer_engine(pooled_url, connect_args={"application_name": "billing"})
    with engine.connect() as conn:
        assert conn.execute(text("SHOW application_name")).scalar_one() == "billing"
        assert conn.connection.driver_connection.prepare_threshold is None  # type: ignore[union-attr]
    engine.dispose()


# --- what breaks without the settings -------------------------------------------------------------------


def _drain_with_four_dispatchers(engine: Engine, attempts: int) -> tuple[int, list[BaseException]]:
    """Four dispatchers (threads, one engine) call run_once until the outbox looks drained or each made
    ``attempts`` calls; returns (messages published, errors raised by run_once)."""
    publisher = RecordingPublisher()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one() -> None:
        d = Dispatcher(engine, OutboxEvent, publisher, batch=10, backoff=FAST, listen=False)
        idle = 0
        for _ in range(attempts):
            try:
                idle = idle + 1 if d.run_once() == 0 else 0
            except Exception as exc:
                with lock:
                    errors.append(exc)
            if idle >= 3:
                break
        d.close()

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return len(set(publisher.ids)), errors


def test_psycopg_prepared_statements_fail_a_drain_through_pgbouncer_118(
    engine: Engine, bouncer: PrivatePgBouncer, db_url: URL
) -> None:
    """Four dispatchers share two server connections. With psycopg's prepared statements (sa_outbox prepares
    its claim and finalize at once) a statement name is prepared on one server connection and missing, or
    another client's, on the next: errors by the hundred. Through the helper's engine: none, all delivered."""
    url = bouncer.url(f"{db_url.database}_shared")
    seed_events(engine, 300)
    default = create_engine(url, pool_size=4)  # what a user gets without the setting
    try:
        published, errors = _drain_with_four_dispatchers(default, attempts=40)
    finally:
        default.dispose()
    print(f"\nPgBouncer 1.18, psycopg's default prepare: {len(errors)} errors, {published} of 300 published")
    assert errors, "no error through PgBouncer with prepared statements on"
    assert all(isinstance(e, ConfigurationError) and "pgbouncer_engine()" in str(e) for e in errors), {
        type(e).__name__: str(e)[:200] for e in errors
    }
    with engine.begin() as conn:  # what the failed claims left leased goes back
        conn.execute(
            text("UPDATE outbox SET status = 'pending', lease_until = NULL WHERE status = 'processing'")
        )
    helper, _ = pgbouncer_engine(url, pool_size=4)
    try:
        published, errors = _drain_with_four_dispatchers(helper, attempts=1000)
    finally:
        helper.dispose()
    assert errors == []
    assert statuses(engine) == {"done": 300}


def test_a_loops_statements_never_take_another_clients_prepared_name_through_the_pooler(
    engine: Engine, bouncer: PrivatePgBouncer, db_url: URL
) -> None:
    """Another client of the pool prepared psycopg's names ``_pg3_0`` … on the one server connection. psycopg's
    cursor would prepare the loop's first statement as ``_pg3_0`` too (before the direct path: "prepared
    statement "_pg3_0" already exists", or another client's SQL run under a name it took for its own). The
    loop's statements are prepared under names unique to its process: it drains, and the other client's
    statements are still there with their own SQL. (With two server connections a name prepared on one is
    missing on the other: test_psycopg_prepared_statements_fail_a_drain_through_pgbouncer_118.)"""
    url = bouncer.url(f"{db_url.database}_one")
    seed_events(engine, 3)
    occupy_prepared_names(url)
    default = create_engine(url)
    try:
        publisher = RecordingPublisher()
        assert drain(Dispatcher(default, OutboxEvent, publisher, listen=False)) == 3
        assert publisher.ids == [1, 2, 3]
        with default.connect() as conn:
            names = dict(conn.exec_driver_sql("SELECT name, statement FROM pg_prepared_statements").all())
    finally:
        default.dispose()
    assert names["_pg3_0"] == "SELECT 0 AS n" and names["_pg3_1"] == "SELECT 1 AS n"
    loops = {n: st for n, st in names.items() if n.startswith(_execute._NAME_PREFIX)}
    assert any("SKIP LOCKED" in st for st in loops.values()), names


def test_listen_through_the_pooler_never_wakes_a_loop(
    engine: Engine, bouncer: PrivatePgBouncer, db_url: URL, pooled: tuple[Engine, dict[str, Any]]
) -> None:
    """A loop listening through PgBouncer: its LISTEN runs on some server connection and what PostgreSQL
    delivers there later is dropped (PgBouncer logs "got packet 'A' from server when not linked"). The jobs
    still run — found by polling — but no wake-up ever arrives (the waker's self-check notices and polls). The same loop listening on the server itself
    (the helper's ``direct_url``) is woken by each commit."""
    pooled_engine, wakeups = pooled
    handled: list[int] = []
    alias = f"{db_url.database}_listen"
    through = Worker(pooled_engine, Job, {"t": lambda j: handled.append(j.id)}, poll_interval=0.2,
                     listen_url=bouncer.url(alias))  # fmt: skip
    thread = threading.Thread(target=through.run, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        # (its self-check finds the LISTEN deaf within 2 s, closes it and polls: see the next test)
        for n in range(3):
            with Session(pooled_engine) as s, s.begin():
                enqueue(s, Job, "t", {"n": n})
            assert wait_until(lambda n=n: len(handled) == n + 1, 10)  # type: ignore[misc]
    finally:
        through.stop()
        thread.join(30)
    assert through.stats.wakeups == 0
    bouncer.admin(f"RECONNECT {db_url.database}_listen")  # drop the server connection that kept the LISTEN

    direct = Worker(pooled_engine, Job, {"t": lambda j: handled.append(j.id)}, poll_interval=30, **wakeups)
    thread = threading.Thread(target=direct.run, kwargs={"install_signal_handlers": False})
    before = listeners(engine)
    thread.start()
    try:
        wait_for_listeners(engine, 1, before=before)
        with Session(pooled_engine) as s, s.begin():
            enqueue(s, Job, "t", {"n": 3})
        assert wait_until(lambda: len(handled) == 4 and direct.stats.wakeups >= 1, 10)
    finally:
        direct.stop()
        thread.join(30)


def test_a_loop_listening_through_the_pooler_says_so_and_names_listen_url(
    caplog: pytest.LogCaptureFixture,
    bouncer: PrivatePgBouncer,
    db_url: URL,
    pooled: tuple[Engine, dict[str, Any]],
) -> None:
    """The loops listen on the engine's URL by default: behind PgBouncer that is the pooler, where nothing
    arrives, silently (the previous test). A waker that NOTIFYs its own channel from a second connection
    after its LISTEN (a same-connection check passes falsely) can tell, warn once, and poll."""
    pooled_engine, _ = pooled
    w = Worker(pooled_engine, Job, {"t": lambda j: None}, poll_interval=0.2,
               listen_url=bouncer.url(f"{db_url.database}_listen"))  # fmt: skip
    thread = threading.Thread(target=w.run, kwargs={"install_signal_handlers": False})
    with caplog.at_level(logging.WARNING, logger="sa_outbox.wakeup"):
        thread.start()
        try:
            warned = wait_until(lambda: any("listen_url" in r.getMessage() for r in caplog.records), 5)
        finally:
            w.stop()
            thread.join(30)
            bouncer.admin(f"RECONNECT {db_url.database}_listen")
    assert warned


# --- the producer ----------------------------------------------------------------------------------------


def test_session_hook_emit_and_enqueue_through_pgbouncer_and_notify_reaches_a_direct_listener(
    pengine: Engine, engine: Engine, db_url: URL
) -> None:
    listener = psycopg.connect(db_url.set(drivername="postgresql").render_as_string(hide_password=False),
                               autocommit=True)  # fmt: skip
    try:
        for model in (OutboxEvent, Job):
            listener.execute(f'LISTEN "{channel_for(model.__table__)}"'.encode())
        with Session(pengine) as s, s.begin():
            order = Order(status="paid")
            s.add(order)
            s.add(OutboxEvent.for_aggregate(order, "OrderPaid", {"n": 1}))
            s.add(
                OutboxEvent(
                    aggregate_type="customer", aggregate_id="7", event_type="Charged", payload={"n": 2}
                )
            )
            ids = emit(
                s, OutboxEvent, [("customer", "7", "Mailed", {"n": 3}), ("customer", "8", "Mailed", {"n": 4})]
            )
            enqueue(s, Job, "receipt", {"order": 1}, queue="mail")
        assert ids == [3, 4]
        got = {n.channel for n in listener.notifies(timeout=10, stop_after=2)}
        assert got == {channel_for(OutboxEvent.__table__), channel_for(Job.__table__)}
    finally:
        listener.close()
    with Session(pengine) as s, s.begin():
        s.add(OutboxEvent(aggregate_type="customer", aggregate_id="7", event_type="Lost", payload={}))
        emit(s, OutboxEvent, [("customer", "7", "Lost", {})])
        enqueue(s, Job, "lost", {})
        s.flush()
        s.rollback()
    with engine.connect() as conn:
        events = conn.execute(
            text("SELECT aggregate_type, aggregate_id, event_type FROM outbox ORDER BY id")
        ).all()
        jobs = conn.execute(text("SELECT task, queue FROM jobs")).all()
    assert [tuple(e) for e in events] == [("order", "1", "OrderPaid"), ("customer", "7", "Charged"),
                                          ("customer", "7", "Mailed"), ("customer", "8", "Mailed")]  # fmt: skip
    assert [tuple(j) for j in jobs] == [("receipt", "mail")]


def _string_event(s: Session, n: int) -> None:
    s.add(OutboxEvent(aggregate_type="account", aggregate_id="A", event_type="E", payload={"n": n}))


def _emitted(s: Session, n: int) -> None:
    emit(s, OutboxEvent, [("account", "A", "E", {"n": n})])


def _order_event(s: Session, n: int) -> None:
    order = s.get(Order, 1)
    assert order is not None
    s.add(OutboxEvent.for_aggregate(order, "OrderChanged", {"n": n}))


@pytest.mark.parametrize(
    "first,second",
    [(_string_event, _string_event), (_string_event, _emitted), (_order_event, _order_event)],
    ids=["advisory-lock", "advisory-lock-emit", "row-lock"],
)
def test_aggregate_locks_keep_commit_order_through_pgbouncer(
    pengine: Engine, engine: Engine, first: Any, second: Any
) -> None:
    """T1 writes an event and holds its transaction (on one server connection); T2 writes one for the same
    aggregate through the pooler: it waits on T1's transaction-scoped lock, commits after it, and has the
    larger id. ``pg_advisory_xact_lock`` and the row lock live as long as the transaction, which is exactly
    how long PgBouncer keeps the server connection: they work in transaction pooling mode."""
    with Session(engine) as s, s.begin():
        s.add(Order(status="new"))
    assert_serialised(pengine, first, second, app="pgbouncer_t2")


def test_async_session_producer_through_pgbouncer(engine: Engine, pooled_url: URL, db_url: URL) -> None:
    async def produce() -> list[int]:
        aengine, _ = pgbouncer_async_engine(pooled_url, direct_url=db_url)
        try:
            async with AsyncSession(aengine) as s, s.begin():
                s.add(OutboxEvent(aggregate_type="a", aggregate_id="1", event_type="E", payload={}))
                ids = await emit(s, OutboxEvent, [("a", "1", "F", {}), ("a", "2", "G", {})])
                enqueue(s, Job, "t", {})
            async with AsyncSession(aengine) as s, s.begin():
                await emit(s, OutboxEvent, [("a", "1", "Lost", {})])
                await s.rollback()
            return ids
        finally:
            await aengine.dispose()

    assert asyncio.run(produce()) == [2, 3]
    assert statuses(engine) == {"pending": 3}
    assert statuses(engine, "jobs") == {"queued": 1}


# --- the loops ---------------------------------------------------------------------------------------------


def test_dispatchers_and_workers_drain_through_pgbouncer(prunner: PooledRunner, engine: Engine) -> None:
    for n in range(30):
        seed_events(engine, 1, aggregate=f"agg-{n % 3}", start=n)
    seed_jobs(engine, 30, task="t")
    publisher = RecordingPublisher()
    handled: list[int] = []
    ordered = prunner.dispatcher(publisher, ordered=True, batch=5)
    plain = prunner.dispatcher(RecordingPublisher(), batch=7)
    worker = prunner.worker({"t": lambda j: handled.append(j.id)}, batch=4, concurrency=2)
    assert prunner.drain(ordered) == 30
    assert prunner.drain(worker) == 30
    seed_events(engine, 10, start=30)
    assert prunner.drain(plain) == 10
    assert publisher.ids == sorted(publisher.ids) and len(publisher.ids) == 30
    for agg in ("agg-0", "agg-1", "agg-2"):
        ns = [m.payload["n"] for m in publisher.messages if m.aggregate_id == agg]
        assert ns == sorted(ns) and len(ns) == 10
    assert sorted(handled) == list(range(1, 31))
    assert statuses(engine) == {"done": 40} and statuses(engine, "jobs") == {"done": 30}


def test_idle_loops_wake_up_on_a_commit_through_pgbouncer(
    prunner: PooledRunner, engine: Engine, pooled: tuple[Engine, dict[str, Any]]
) -> None:
    """The helper's wake-up options: LISTEN on the server, commits through the pooler: both loops are
    notified of the commit (their wake-up counters move)."""
    _, wakeups = pooled
    publisher = RecordingPublisher()
    handled: list[int] = []
    d = prunner.dispatcher(publisher, poll_interval=30, **wakeups)
    w = prunner.worker({"t": lambda j: handled.append(j.id)}, poll_interval=30, **wakeups)
    before = listeners(engine)
    threads = [prunner.run_in_thread(d)] if prunner.kind == "sync" else []
    if prunner.kind == "sync":
        threads.append(prunner.run_in_thread(w))
    else:  # one event loop drives both async loops in one thread

        async def both() -> None:
            await asyncio.gather(d.run(install_signal_handlers=False), w.run(install_signal_handlers=False))

        assert prunner.loop is not None
        loop = prunner.loop
        threads.append(threading.Thread(target=lambda: loop.run_until_complete(both())))
        threads[0].start()
    try:
        wait_for_listeners(engine, 2, before=before)  # both idle, their LISTEN up on the server
        with Session(prunner.engine) as s, s.begin():
            s.add(OutboxEvent(aggregate_type="a", aggregate_id="1", event_type="E", payload={}))
            enqueue(s, Job, "t", {})
        assert wait_until(
            lambda: len(publisher.ids) == 1 and len(handled) == 1 and d.stats.wakeups and w.stats.wakeups, 10
        ), (d.stats, w.stats)
    finally:
        d.stop()
        w.stop()
        for t in threads:
            t.join(30)


# --- the inbox, jobs control, transactional handlers ---------------------------------------------------


def test_inbox_receive_through_pgbouncer(pengine: Engine, engine: Engine) -> None:
    def apply(message_id: str, **kw: Any) -> Receipt:
        with Session(pengine) as s, s.begin():
            return receive(s, Inbox, "billing", message_id, event_type="OrderPaid", **kw)

    assert apply("1") is Receipt.NEW
    assert apply("1") is Receipt.DUPLICATE
    assert apply("7", aggregate="order-1", position=7) is Receipt.NEW
    assert apply("5", aggregate="order-1", position=5) is Receipt.STALE
    assert apply("7", aggregate="order-1", position=7) is Receipt.DUPLICATE
    with Session(pengine) as s, s.begin():
        assert receive(s, Inbox, "billing", "9")
        s.rollback()  # the consumer failed: its record goes with its effects
    assert apply("9") is Receipt.NEW


def test_a_worker_of_several_queues_claims_them_in_one_statement_through_pgbouncer(
    prunner: PooledRunner, engine: Engine
) -> None:
    """The claim of several queues (one statement, each queue's pick under the batch's LIMIT) through the
    pooler: strict priority with a list, caps with shares, ``unique_running`` across queues, inline (a claim
    sent ahead is refused there: claimed after the jobs in hand) and with threads."""
    seed_jobs(engine, 6, task="t", queue="b")
    seed_jobs(engine, 6, task="t", queue="c")
    seed_jobs(engine, 1, task="t", queue="c", unique_key="k")
    order: list[str] = []
    inline = prunner.worker({"t": lambda j: order.append(j.queue)}, queues=["a", "b", "c"], batch=4,
                            unique_running=True)  # fmt: skip
    assert prunner.drain(inline) == 13
    assert order == ["b"] * 6 + ["c"] * 7
    seed_jobs(engine, 6, task="t", queue="a")
    seed_jobs(engine, 6, task="t", queue="b")
    seen: list[str] = []
    shared = prunner.worker({"t": lambda j: seen.append(j.queue)}, queues={"a": 1, "b": 2}, batch=10)
    assert prunner.drain(shared) == 12
    assert sorted(seen) == ["a"] * 6 + ["b"] * 6
    assert statuses(engine, "jobs") == {"done": 25}


def test_cancel_and_pause_through_pgbouncer(prunner: PooledRunner, engine: Engine) -> None:
    pooled_engine = prunner.engine
    seed_jobs(engine, 2, task="mail")
    seed_jobs(engine, 1, task="long")
    assert cancel_jobs(pooled_engine, Job, task="mail").cancelled == [1, 2]
    started = threading.Event()

    def long(job: ClaimedJob) -> None:
        started.set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            job.raise_if_cancelled()  # the request arrives with a heartbeat, through the pooler
            time.sleep(0.02)

    w = prunner.worker({"long": long, "mail": lambda j: None, "t": lambda j: None}, heartbeat=0.1)
    thread = threading.Thread(target=lambda: prunner.run_once(w))
    thread.start()
    assert started.wait(20)
    assert cancel_jobs(pooled_engine, Job, ids=[3]).requested == [3]
    thread.join(30)
    assert not thread.is_alive()
    assert [row(engine, "jobs", i).status for i in (1, 2, 3)] == ["cancelled"] * 3

    pause_queue(pooled_engine, Job, "default", by="ops")
    seed_jobs(engine, 2, task="t")
    assert prunner.drain(w) == 0
    resume_queue(pooled_engine, Job, "default")
    assert prunner.drain(w) == 2


def test_a_concurrency_1_worker_behind_pgbouncer_gives_back_its_batch_on_a_pause(
    prunner: PooledRunner, engine: Engine
) -> None:
    """The maintenance step between two inline jobs (the pauses it reads, the give-back it writes) goes through
    the pooler like every other statement: no job of the batch starts more than about a second after the
    pause."""
    from .test_jobs_control import _pause_during_a_batch

    _pause_during_a_batch(prunner, engine, "sync def")


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_worker_starts_no_job_of_a_queue_paused_during_a_database_outage(
    engine: Engine, bouncer: PrivatePgBouncer, db_url: URL, flavour: str
) -> None:
    """A worker with handler threads (concurrency 2) runs a long job and short ones; the database goes out of
    reach (PgBouncer's DISABLE and KILL of its alias: connections cut, new ones refused) and the queue is
    paused meanwhile, then the database comes back. Whatever the worker knew of the pauses is as old as the
    outage: it starts nothing until it has read them again — no job starts later than a second after the
    pause (the once-a-second maintenance, as without an outage). Before, a threaded worker's first claim
    after the outage used the pauses of before it and started the paused queue's jobs (a review: 1.6–17 s
    after the pause; here ~2.5 s)."""
    alias = f"{db_url.database}_cut"
    seed_jobs(engine, 1, task="long", priority=5)
    seed_jobs(engine, 12, task="short")
    starts: list[tuple[int, float]] = []
    lock = threading.Lock()

    def record(job: ClaimedJob) -> None:
        with lock:
            starts.append((job.id, time.monotonic()))

    def long(job: ClaimedJob) -> None:
        record(job)
        time.sleep(4.0)

    def short(job: ClaimedJob) -> None:
        record(job)
        time.sleep(0.4)

    url = bouncer.url(alias)
    weng, _ = pgbouncer_engine(url)
    runner = PooledRunner(flavour, weng, url, db_url)
    w = runner.worker(
        {"long": long, "short": short}, concurrency=2, batch=2, poll_interval=0.2, stale_after=30
    )
    t = runner.run_in_thread(w)
    try:
        assert wait_until(lambda: len(starts) >= 3, 10)  # the long job and two short ones have started
        bouncer.admin(f"DISABLE {alias}")
        bouncer.admin(f"KILL {alias}")
        time.sleep(0.3)
        pause_queue(engine, Job, "default", by="ops")  # (directly: the worker's alias is cut)
        paused_at = time.monotonic()
        time.sleep(2.0)
        bouncer.admin(f"ENABLE {alias}")
        bouncer.admin(f"RESUME {alias}")  # (after a KILL, new connections wait for it)
        time.sleep(2.5)  # back: the worker reads the pauses and gives back what it holds
        late = [(job_id, round(at - paused_at, 2)) for job_id, at in starts if at > paused_at + 1.0]
        assert late == [], late
        resume_queue(engine, Job, "default")
        assert wait_until(lambda: statuses(engine, "jobs") == {"done": 13}, 30), statuses(engine, "jobs")
    finally:
        bouncer.admin(f"ENABLE {alias}")
        if any(p["database"] == alias and p["paused"] for p in bouncer.admin("SHOW DATABASES")):
            bouncer.admin(f"RESUME {alias}")
        w.stop()
        t.join(15)
        runner.close()
        weng.dispose()
    assert not t.is_alive()
    counts = Counter(job_id for job_id, _ in starts)
    assert sorted(counts) == list(range(1, 14)), counts  # every job ran ...
    assert [j for j, n in counts.items() if n > 1] == [], counts  # ... once: the long job's lease survived


@pytest.fixture
def effects(engine: Engine) -> Iterator[Engine]:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS pgb_effects (job_id bigint PRIMARY KEY)"))
        conn.execute(text("TRUNCATE pgb_effects"))
    yield engine
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE pgb_effects"))


def _effects(engine: Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT job_id FROM pgb_effects ORDER BY 1")).scalars())


def test_transactional_handlers_through_pgbouncer(prunner: PooledRunner, effects: Engine) -> None:
    """The handler's writes and the job's fenced completion in one transaction — one server connection for
    its duration — and a handler that raises leaves nothing."""
    seed_jobs(effects, 4, task="charge")
    seed_jobs(effects, 1, task="flaky")

    def charge(job: ClaimedJob, session: Session) -> None:
        session.execute(text("INSERT INTO pgb_effects VALUES (:j)"), {"j": job.id})

    def flaky(job: ClaimedJob, session: Session) -> None:
        session.execute(text("INSERT INTO pgb_effects VALUES (:j)"), {"j": job.id})
        raise RetryableError("card service timeout")

    async def charge_async(job: ClaimedJob, session: AsyncSession) -> None:
        await session.execute(text("INSERT INTO pgb_effects VALUES (:j)"), {"j": job.id})

    async def flaky_async(job: ClaimedJob, session: AsyncSession) -> None:
        await session.execute(text("INSERT INTO pgb_effects VALUES (:j)"), {"j": job.id})
        raise RetryableError("card service timeout")

    handlers: dict[str, Any] = (
        {"charge": charge, "flaky": flaky}
        if prunner.kind == "sync"
        else {"charge": charge_async, "flaky": flaky_async}
    )
    w = prunner.worker(handlers, concurrency=2, backoff=Backoff(60, 60, jitter=False))
    assert prunner.drain(w) == 5
    assert _effects(effects) == [1, 2, 3, 4]
    assert statuses(effects, "jobs") == {"done": 4, "queued": 1}
    assert "card service timeout" in row(effects, "jobs", 5).last_error


def test_a_sync_transactional_handler_under_the_async_worker_through_pgbouncer(
    effects: Engine, bouncer: PrivatePgBouncer, db_url: URL
) -> None:
    """AsyncWorker runs a sync handler that takes a session on a sync engine of its own. Built from the URL
    alone it prepares statements again: the fenced completions collide with the names another client left on
    the server connection, and the jobs fail."""
    url = bouncer.url(f"{db_url.database}_one")
    occupy_prepared_names(url)
    seed_jobs(effects, 3, task="charge")

    def charge(job: ClaimedJob, session: Session) -> None:
        session.execute(text("INSERT INTO pgb_effects VALUES (:j)"), {"j": job.id})

    async def run() -> int:
        aengine, wakeups = pgbouncer_async_engine(url)
        w = AsyncWorker(aengine, Job, {"charge": charge}, concurrency=2, **wakeups)
        try:
            return int(await w.run_once())
        finally:
            await w.close()
            await aengine.dispose()

    assert asyncio.run(run()) == 3
    assert _effects(effects) == [1, 2, 3] and statuses(effects, "jobs") == {"done": 3}


# --- the CLI against the PgBouncer URL --------------------------------------------------------------------


def _cli(capsys: pytest.CaptureFixture[str], url: URL, *argv: str) -> tuple[int, str]:
    code = cli([*argv, "--url", url.render_as_string(hide_password=False)])
    out = capsys.readouterr()
    assert code == 0, (argv, out.out, out.err)
    return code, out.out


def test_cli_operations_through_pgbouncer(
    capsys: pytest.CaptureFixture[str], engine: Engine, pooled_url: URL
) -> None:
    seed_events(engine, 6)
    seed_jobs(engine, 2, task="t")
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 'dead', last_error = 'boom' WHERE id IN (1, 2)"))
        conn.execute(
            text("UPDATE outbox SET status = 'done', done_at = now() - interval '2 days' WHERE id > 4")
        )
    status = json.loads(_cli(capsys, pooled_url, "status", "--json")[1])
    assert (status["outbox"]["dead"], status["jobs"]["counts"]["queued"]) == (2, 2)
    findings = json.loads(_cli(capsys, pooled_url, "doctor", "--json")[1])
    assert not [f for f in findings["findings"] if f["status"] == "fail"], findings
    _cli(capsys, pooled_url, "locks")
    dead = json.loads(_cli(capsys, pooled_url, "dead", "list", "--json")[1])
    assert sorted(r["id"] for r in dead) == [1, 2], dead
    _cli(capsys, pooled_url, "dead", "retry", "1")
    _cli(capsys, pooled_url, "dead", "skip", "2")
    _cli(capsys, pooled_url, "purge", "--older-than", "1d")
    _cli(capsys, pooled_url, "check", "--max-dead", "0")
    assert statuses(engine) == {"pending": 3, "done": 1}  # 1 retried, 2 skipped (done), 5 and 6 purged


def test_cli_purge_in_many_batches_through_pgbouncer(
    capsys: pytest.CaptureFixture[str], engine: Engine, bouncer: PrivatePgBouncer, db_url: URL
) -> None:
    """psycopg prepares a statement at its 6th execution on a connection: the purge's DELETE, batch after
    batch, then collides with the names earlier clients left on the server connection."""
    url = bouncer.url(f"{db_url.database}_one")
    occupy_prepared_names(url)
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status, done_at) "
            "SELECT 'a', g::text, 'E', '{}', 'done', now() - interval '2 days' FROM generate_series(1, 200) g"
        ))  # fmt: skip
    _cli(capsys, url, "purge", "--older-than", "1d", "--batch-size", "10")
    assert statuses(engine) == {}


# --- nothing is left on a server connection -----------------------------------------------------------------


def test_nothing_sa_outbox_does_leaves_state_on_a_server_connection(
    capsys: pytest.CaptureFixture[str],
    engine: Engine,
    pooled: tuple[Engine, dict[str, Any]],
    pooled_url: URL,
    bouncer: PrivatePgBouncer,
    db_url: URL,
) -> None:
    """After producers, both loops (sync and async), transactional handlers, ``doctor`` (its ``SET LOCAL``)
    and the CLI have run through the pool, every server connection of it is as a new one: no setting changed
    by a plain ``SET``, no LISTEN, no prepared statement, no WITH HOLD cursor, no advisory lock."""
    pooled_engine, wakeups = pooled
    with Session(pooled_engine) as s, s.begin():
        for n in range(5):
            s.add(OutboxEvent(aggregate_type="a", aggregate_id=str(n % 2), event_type="E", payload={}))
            enqueue(s, Job, "t", {"n": n})
        emit(s, OutboxEvent, [("a", "9", "E", {})])
    assert drain(Dispatcher(pooled_engine, OutboxEvent, RecordingPublisher(), ordered=True, **wakeups)) == 6

    def t(job: ClaimedJob, session: Session) -> None:
        session.execute(text("SELECT 1"))

    assert drain(Worker(pooled_engine, Job, {"t": t}, **wakeups)) == 5
    with Session(pooled_engine) as s, s.begin():
        enqueue(s, Job, "t", {})

    async def async_drain() -> int:
        aengine, awake = pgbouncer_async_engine(pooled_url, direct_url=db_url)
        w = AsyncWorker(aengine, Job, {"t": lambda j: None}, **awake)
        try:
            return int(await w.run_once())
        finally:
            await w.close()
            await aengine.dispose()

    assert asyncio.run(async_drain()) == 1
    assert not [f for f in doctor(pooled_engine, [OutboxEvent, Job]) if f.status == "fail"]
    for argv in (["doctor"], ["status"], ["locks"], ["dead", "list"], ["purge", "--older-than", "0s"]):
        _cli(capsys, pooled_url, *argv)

    state = _server_connection_state(bouncer, pooled_url)
    assert len(state) >= 1
    leftovers = {pid: s for pid, s in state.items() if s != CLEAN}
    assert leftovers == {}, leftovers
    assert set(state) >= set(bouncer.server_pids(str(db_url.database)))


CLEAN = {"set": [], "listening": 0, "prepared": 0, "cursors": 0, "advisory_locks": 0}
#: What PgBouncer itself sets on a server connection for each client (its tracked startup parameters).
_PGBOUNCER_SETS = (
    "application_name",
    "client_encoding",
    "DateStyle",
    "TimeZone",
    "standard_conforming_strings",
)


def _server_connection_state(bouncer: PrivatePgBouncer, url: URL) -> dict[int, dict[str, Any]]:
    """Hold ``POOL`` transactions open at once through the pooler — one on each of its server connections —
    and read each one's session state."""
    conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
    sql = (
        b"SELECT pg_backend_pid(), "
        b"  (SELECT coalesce(array_agg(name ORDER BY name), '{}') FROM pg_settings "
        b"   WHERE source = 'session' AND name <> ALL(%(tracked)s::text[])), "
        b"  (SELECT count(*) FROM pg_listening_channels()), (SELECT count(*) FROM pg_prepared_statements), "
        b"  (SELECT count(*) FROM pg_cursors WHERE is_holdable), "
        b"  (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid())"
    )
    conns = [psycopg.connect(conninfo) for _ in range(POOL)]  # transactions: each holds a server connection
    try:
        rows = [c.execute(sql, {"tracked": list(_PGBOUNCER_SETS)}).fetchone() for c in conns]
    finally:
        for c in conns:
            c.close()
    out = {}
    for r in rows:
        assert r is not None
        pid, sets, listening, prepared, cursors, locks = r
        out[int(pid)] = {"set": list(sets), "listening": listening, "prepared": prepared, "cursors": cursors,
                         "advisory_locks": locks}  # fmt: skip
    assert len(out) == POOL, "two of the open transactions shared a server connection"
    return out


# --- a short fault profile --------------------------------------------------------------------------------


def test_terminated_server_connections_lose_nothing_through_pgbouncer(
    engine: Engine, pooled: tuple[Engine, dict[str, Any]], pooled_url: URL, bouncer: PrivatePgBouncer,
    db_url: URL,
) -> None:  # fmt: skip
    """Producers, an ordered Dispatcher, a Worker and an AsyncWorker run through PgBouncer while the test
    terminates every server connection PgBouncer holds (``pg_terminate_backend`` on the real server), again
    and again. Then: every committed event delivered, each aggregate's events first delivered in id order,
    every job done, nothing leased, nothing dead."""
    pooled_engine, wakeups = pooled
    alias = str(db_url.database)
    publisher = RecordingPublisher()
    handled: Counter[int] = Counter()
    lock = threading.Lock()

    def record(job: ClaimedJob) -> None:
        with lock:
            handled[job.id] += 1

    d = Dispatcher(pooled_engine, OutboxEvent, publisher, ordered=True, batch=10, lease=3, publish_timeout=1,
                   poll_interval=0.2, backoff=Backoff(0.01, 0.1), max_attempts=100, **wakeups)  # fmt: skip
    w = Worker(pooled_engine, Job, {"t": record}, batch=5, stale_after=3, poll_interval=0.2,
               backoff=Backoff(0.01, 0.1, jitter=False), **wakeups)  # fmt: skip
    stop_async = threading.Event()
    async_errors: list[BaseException] = []

    async def async_worker() -> None:
        aengine, awake = pgbouncer_async_engine(pooled_url, direct_url=db_url)
        aw = AsyncWorker(aengine, Job, {"t": record}, batch=5, stale_after=3, poll_interval=0.2,
                         backoff=Backoff(0.01, 0.1, jitter=False), **awake)  # fmt: skip
        task = asyncio.ensure_future(aw.run(install_signal_handlers=False))
        try:
            while not stop_async.is_set() and not task.done():
                await asyncio.sleep(0.05)
        finally:
            aw.stop()
            await task
            await aw.close()
            await aengine.dispose()

    def run_async() -> None:
        try:
            asyncio.run(async_worker())
        except BaseException as exc:
            async_errors.append(exc)

    producer_errors = Counter[str]()

    def produce(k: int) -> None:
        for i in range(120):
            try:
                with Session(pooled_engine) as s, s.begin():
                    s.add(OutboxEvent(aggregate_type="acct", aggregate_id=str((k * 120 + i) % 8), event_type="E",
                                      payload={"k": k, "i": i}))  # fmt: skip
                    enqueue(s, Job, "t", {"k": k, "i": i}, max_attempts=100)
            except Exception as exc:  # a terminated server connection: this transaction's outcome is unknown
                producer_errors[type(exc).__name__] += 1
            time.sleep(0.005)

    loops = [threading.Thread(target=lp.run, kwargs={"install_signal_handlers": False}) for lp in (d, w)]
    loops.append(threading.Thread(target=run_async))
    producers = [threading.Thread(target=produce, args=(k,)) for k in range(2)]
    terminated = 0
    for t in (*loops, *producers):
        t.start()
    try:
        for _ in range(6):
            time.sleep(0.4)
            pids = bouncer.server_pids(alias)
            with engine.connect() as conn:
                terminated += int(conn.execute(
                    # (only this database's: a pid PgBouncer still lists may be gone, and reused by a backend of
                    # another test process — pids wrap at 32,768 here)
                    text("SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                         "WHERE pid = ANY(CAST(:p AS int[])) AND datname = current_database()"),
                    {"p": pids},
                ).scalar_one())  # fmt: skip
        for t in producers:
            t.join(60)

        def settled() -> bool:
            with engine.connect() as conn:
                return not conn.execute(text(
                    "SELECT (SELECT count(*) FROM outbox WHERE status <> 'done') "
                    "     + (SELECT count(*) FROM jobs WHERE status <> 'done')"
                )).scalar_one()  # fmt: skip

        assert wait_until(settled, 60, every=0.2), (statuses(engine), statuses(engine, "jobs"))
    finally:
        d.stop()
        w.stop()
        stop_async.set()
        for t in loops:
            t.join(30)
    assert not async_errors, async_errors
    print(f"\nterminated {terminated} server connections; producer errors {dict(producer_errors)}; "
          f"db errors: dispatcher {d.stats.db_errors}, worker {w.stats.db_errors}")  # fmt: skip
    assert terminated >= 3
    with engine.connect() as conn:
        events = {r.id: r for r in conn.execute(text("SELECT id, aggregate_id, lease_version FROM outbox"))}
        jobs = {r.id: r for r in conn.execute(text("SELECT id, lease_version FROM jobs"))}
    assert len(events) >= 120 and set(publisher.ids) == set(events)
    first_seen: list[int] = []
    for i in publisher.ids:
        if i not in first_seen:
            first_seen.append(i)
    for agg in {e.aggregate_id for e in events.values()}:
        mine = [i for i in first_seen if events[i].aggregate_id == agg]
        assert mine == sorted(mine), (agg, mine)
    assert set(handled) == set(jobs)
    twice = [j for j, n in handled.items() if n > 1]
    assert all(jobs[j].lease_version >= 2 for j in twice), twice  # only a lost lease runs a job again


def test_a_lease_guard_through_pgbouncer_keeps_a_held_job_from_the_rescue_and_leaves_no_lock(
    engine: Engine, pooled: tuple[Engine, dict[str, Any]]
) -> None:
    """The heartbeat's lease guards are transaction-scoped, so they work through a pooler in transaction
    mode: three running jobs whose rows a transaction held for twice stale_after are not rescued the moment
    it commits, each runs once, and no server connection keeps an advisory lock afterwards."""
    from datetime import timedelta

    from sa_outbox import _steps
    from sa_outbox._sql import spec_for

    pooled_engine, wakeups = pooled
    seed_jobs(engine, 3, task="held")
    started, release = threading.Semaphore(0), threading.Event()
    calls: list[int] = []

    def held(job: ClaimedJob) -> None:
        calls.append(job.id)
        started.release()
        release.wait(20)

    w = Worker(pooled_engine, Job, {"held": held}, concurrency=3, batch=3, stale_after=1.0, heartbeat=0.2,
               **wakeups)  # fmt: skip
    t = threading.Thread(target=w.run_once)
    t.start()
    locker, rescuer = engine.connect(), engine.connect()
    try:
        for _ in range(3):
            assert started.acquire(timeout=20)
        locker.begin()
        locker.execute(text("SELECT id FROM jobs FOR UPDATE"))
        time.sleep(2.0)
        assert (
            rescuer.execute(
                text("SELECT count(*) FROM jobs WHERE locked_at < now() - interval '1 s'")
            ).scalar()
            == 3
        )
        rescuer.rollback()
        locker.commit()
        taken = _steps.rescue(rescuer, spec_for(Job), stale_after=timedelta(seconds=1))
        rescuer.commit()
        assert taken == []
    finally:
        if locker.in_transaction():
            locker.rollback()
        locker.close()
        rescuer.close()
        release.set()
        t.join(20)
    assert statuses(engine, "jobs") == {"done": 3} and sorted(calls) == [1, 2, 3]
    assert w.stats.lost_leases == 0
    with engine.connect() as conn:
        # (this database's: the server is shared with the other test processes and their databases)
        held = text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        assert not conn.execute(held).scalar()


def test_partition_retire_and_related_events_through_pgbouncer(pengine: Engine, engine: Engine) -> None:
    """The retire's close is one transaction of several statements (BEGIN, SET LOCAL lock_timeout, the
    constraint, the count, COMMIT or ROLLBACK), and a deferred event with a relationship is written by the
    producer after the ORM's rows: both through PgBouncer in transaction mode. A late producer, also through
    the pooler, keeps its partition; once every row is finished the partition is closed and retired, and an
    ordered dispatcher through the pooler delivers the aggregate's events in order."""
    from .test_partitions import (
        SCHEMA,
        PBase,
        PEvent,
        add_events,
        add_past_partition,
        late_commit_while_closing,
        names,
    )
    from .test_producer_relationships import SCHEMA as REL
    from .test_producer_relationships import Account, AccountEvent, RelBase

    with fresh_schema(engine, SCHEMA, PBase.metadata), fresh_schema(engine, REL, RelBase.metadata):
        name, start = add_past_partition(engine, PEvent, 1)
        add_events(engine, 2, created_at=start, status="done")
        t, result, _ = late_commit_while_closing(pengine, start, watch=engine)  # both through the pooler
        t.join(60)
        assert result["report"].kept == {name: {"unfinished": 1, "dead": 0}}, result["report"]
        with Session(pengine) as s, s.begin():
            s.add(PEvent(aggregate_type="o", aggregate_id="A", event_type="Next", payload={}))
        pub = RecordingPublisher()
        d = Dispatcher(pengine, PEvent, pub, listen=False, ordered=True)
        try:
            while d.run_once():
                pass
        finally:
            d.close()
        assert [m.event_type for m in pub.messages] == ["Late", "Next"]
        report = maintain_partitions(pengine, PEvent)
        assert report.retired == [name] and not report.errors and name not in names(engine, PEvent), report

        with Session(pengine) as s, s.begin():
            account = Account(name="pooled")
            s.add(account)
            account.events.append(
                AccountEvent(aggregate_type="account", aggregate_id="p", event_type="E", payload={})
            )
        with engine.connect() as conn:
            rows = conn.execute(text(f"SELECT account_id, aggregate_id FROM {REL}.account_event")).all()
            accounts = conn.execute(text(f"SELECT id, name FROM {REL}.account")).all()
        assert [tuple(r) for r in rows] == [(1, "p")] and [tuple(a) for a in accounts] == [(1, "pooled")], (
            rows,
            accounts,
        )


def test_a_closed_partition_refuses_retries_whole_through_pgbouncer(pengine: Engine, engine: Engine) -> None:
    """The refusal of a retry into a partition a retire left closed, through PgBouncer in transaction mode: the
    check (its own statements) and the batches run on whatever server connection the pooler gives each
    transaction. Refused before anything is written, naming the partition; closed between two batches, the
    call stops at the batch that meets it with the ids the earlier batches changed; once maintain opens it
    again, the retry goes through."""
    from sqlalchemy import event, select

    from sa_outbox import PartitionClosedError, _sql, maintain_partitions, retry_dead

    from .test_partitions import SCHEMA, PBase, PEvent, add_events, add_past_partition

    def statuses() -> list[str]:
        with engine.connect() as conn:
            return list(conn.execute(select(PEvent.status).order_by(PEvent.id)).scalars())

    def close(name: str) -> None:
        with pengine.begin() as conn:  # (a pooled connection of its own, beside the call's)
            conn.execute(text(_sql.close_partition_ddl(conn.dialect.identifier_preparer, name, SCHEMA)))

    with fresh_schema(engine, SCHEMA, PBase.metadata):
        name, start = add_past_partition(engine, PEvent, 1)
        today = add_events(engine, 1, status="dead")  # the first batch
        old = add_events(engine, 2, created_at=start, status="dead")
        close(name)
        with pytest.raises(PartitionClosedError, match=rf"{name} \(2\).*Nothing was changed$") as refused:
            retry_dead(pengine, PEvent, all=True, batch_size=1)
        assert (refused.value.changed, refused.value.partitions) == ([], {name: 2})
        assert statuses() == ["dead", "dead", "dead"]

        assert maintain_partitions(pengine, PEvent).kept == {name: {"unfinished": 0, "dead": 2}}
        batches: list[str] = []

        def close_before_the_second_batch(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if statement.lstrip().upper().startswith(("UPDATE", "WITH")) and "requeued" in str(args):
                batches.append(statement)
                if len(batches) == 2:
                    close(name)

        event.listen(pengine, "before_cursor_execute", close_before_the_second_batch)
        try:
            with pytest.raises(PartitionClosedError, match=rf"It was closed while this ran: 1 row\(s\) were "
                                                           rf"changed before it: {today[0]}$") as stopped:  # fmt: skip
                retry_dead(pengine, PEvent, all=True, batch_size=1)
        finally:
            event.remove(pengine, "before_cursor_execute", close_before_the_second_batch)
        assert (stopped.value.changed, stopped.value.partitions) == (today, {name: 2})
        assert statuses() == ["pending", "dead", "dead"]

        assert maintain_partitions(pengine, PEvent).kept == {name: {"unfinished": 0, "dead": 2}}
        assert retry_dead(pengine, PEvent, all=True) == old
        assert statuses() == ["pending", "pending", "pending"]


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize(
    ("second", "ordered"),
    [(None, False), ("cut off too", False), ("started as it ends", False), ("cut off too", True),
     ("started as it ends", True)],
)  # fmt: skip
def test_a_dispatcher_back_from_an_outage_longer_than_its_lease_publishes_nothing_twice(
    engine: Engine, bouncer: PrivatePgBouncer, db_url: URL, flavour: str, second: str | None, ordered: bool
) -> None:
    """A dispatcher publishes a batch, then the database goes out of reach (PgBouncer's DISABLE and KILL) for
    twice the lease, so the batch's outcomes cannot be written and its leases run out meanwhile. Back, no
    message goes out twice: not by the dispatcher's own rescue (before: the three messages of the batch, every
    run), nor by a second dispatcher cut off too, nor by one started as the outage ends (before: its first
    rescue took the batch at once) — their rescue waits while the first writes what it published. In ordered
    mode (three aggregates of two events) each aggregate's events also go out in order."""
    alias = f"{db_url.database}_cut"
    # What keeps a rescue off a batch published before the outage is time: the first dispatcher tries again at
    # least every lease / 4 (jittered), the others wait 1.5 × that — a margin of lease / 8 (7.5 s with the
    # default lease). At lease 2 s that was 0.25 s, and a loaded CI machine missed it (2 runs of about 110:
    # events published twice, in 2 of about 100 runs); 3 s gives 0.375 s.
    lease = 3.0
    for n in range(6):
        seed_events(engine, 1, aggregate=f"agg-{n % 3}", start=n)
    cut = threading.Event()

    def first_batch_then_cut(message: Any) -> None:
        if not cut.is_set():
            cut.set()
            bouncer.admin(f"DISABLE {alias}")
            bouncer.admin(f"KILL {alias}")
        return None

    publisher = RecordingPublisher(fail=first_batch_then_cut)
    url = bouncer.url(alias)
    deng, _ = pgbouncer_engine(url)
    runners: list[PooledRunner] = []
    loops: list[Any] = []
    threads: list[threading.Thread] = []

    def start() -> None:  # (one runner each: an async runner's event loop runs one loop at a time)
        runners.append(PooledRunner(flavour, deng, url, db_url))
        loops.append(
            runners[-1].dispatcher(
                publisher, batch=3, lease=lease, publish_timeout=1.0, poll_interval=0.2, ordered=ordered
            )
        )
        threads.append(runners[-1].run_in_thread(loops[-1]))

    start()
    try:
        assert wait_until(cut.is_set, 10)
        if second == "cut off too":
            start()
        time.sleep(2 * lease)
        bouncer.admin(f"ENABLE {alias}")
        bouncer.admin(f"RESUME {alias}")
        if second == "started as it ends":
            start()
        assert wait_until(lambda: statuses(engine) == {"done": 6}, 30), statuses(engine)
    finally:
        bouncer.admin(f"ENABLE {alias}")
        if any(p["database"] == alias and p["paused"] for p in bouncer.admin("SHOW DATABASES")):
            bouncer.admin(f"RESUME {alias}")
        for d in loops:
            d.stop()
        for t in threads:
            t.join(15)
        for r in runners:
            r.close()
        deng.dispose()
    assert not any(t.is_alive() for t in threads)
    counts = Counter(publisher.ids)
    assert sorted(counts) == list(range(1, 7)) and max(counts.values()) == 1, counts
    if ordered:
        for agg in ("agg-0", "agg-1", "agg-2"):
            ns = [m.payload["n"] for m in publisher.messages if m.aggregate_id == agg]
            assert ns == sorted(ns), (agg, ns)


class _PausedPair:
    """Two dispatchers, A and B (``flavour``), through the one-server-connection alias ``<db>_pause`` — its queue
    goes in order at RESUME — each watched by a ``before_cursor_execute`` listener of the test's (``on_a``,
    ``on_b``); ``end()`` resumes the pool, stops and closes both."""

    lease = 3.0

    def __init__(
        self, bouncer: PrivatePgBouncer, db_url: URL, flavour: str, on_a: Any, on_b: Any, publisher: Any,
        b_poll: float,
    ) -> None:  # fmt: skip
        self.bouncer, self.alias = bouncer, f"{db_url.database}_pause"
        url = bouncer.url(self.alias)
        self.ra = PooledRunner(flavour, pgbouncer_engine(url)[0], url, db_url)
        self.rb = PooledRunner(flavour, pgbouncer_engine(url)[0], url, db_url)
        for r, listener in ((self.ra, on_a), (self.rb, on_b)):
            event.listen(r.aengine.sync_engine if r.aengine is not None else r.engine, "before_cursor_execute",
                         listener)  # fmt: skip
        options = dict(batch=6, lease=self.lease, publish_timeout=1.0)
        self.a = self.ra.dispatcher(publisher, poll_interval=0.2, **options)
        self.b = self.rb.dispatcher(publisher, poll_interval=b_poll, **options)
        self.threads: list[threading.Thread] = []

    def start_a(self) -> None:
        self.threads.append(self.ra.run_in_thread(self.a))

    def start_b(self) -> None:
        self.threads.append(self.rb.run_in_thread(self.b))

    def pause(self) -> None:
        self.bouncer.admin(f"PAUSE {self.alias}")

    def resume(self) -> None:
        self.bouncer.admin(f"RESUME {self.alias}")

    def end(self) -> None:
        if any(p["database"] == self.alias and p["paused"] for p in self.bouncer.admin("SHOW DATABASES")):
            self.resume()
        for d in (self.a, self.b):
            d.stop()
        for t in self.threads:
            t.join(15)
        for r in (self.ra, self.rb):
            r.close()
            r.engine.dispose()
        assert not any(t.is_alive() for t in self.threads)


def _published_once_each(publisher: RecordingPublisher, n: int) -> None:
    counts = Counter(publisher.ids)
    assert sorted(counts) == list(range(1, n + 1)) and max(counts.values()) == 1, counts


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_rescue_held_back_by_a_pooler_pause_takes_no_lease_that_ran_out_during_it(
    engine: Engine, bouncer: PrivatePgBouncer, db_url: URL, flavour: str
) -> None:
    """PgBouncer's PAUSE holds every client's next statement, without an error, until RESUME. A dispatcher
    (A) publishes a batch as the pause begins: its finalize waits in the pooler's queue, behind the rescue of
    a second dispatcher (B), while the batch's leases run out. At RESUME (one server connection: the queue
    goes in order) B's rescue ran first and took the batch, and B published all six messages again (before,
    every run). B's rescue now sees how long it was held back — its transaction begins before the statement —
    and takes no lease that ran out meanwhile: A's finalize goes through, nothing is published twice."""
    seed_events(engine, 6)
    claimed, cut, b_queued = threading.Event(), threading.Event(), threading.Event()

    def hold_a(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if cut.is_set():  # A's finalize: sent once B's rescue step waits in the pooler's queue
            b_queued.wait(4 * pair.lease)

    def mark_b(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        if cut.is_set() and (statement == "BEGIN" or "expired_for" in (parameters or {})):
            b_queued.set()

    def first_message(message: Any) -> None:
        if not claimed.is_set():
            claimed.set()
            pair.start_b()
            time.sleep(1.5)  # B past its start's grace, its rescue running each second
            pair.pause()
            cut.set()
        return None

    publisher = RecordingPublisher(fail=first_message)
    pair = _PausedPair(bouncer, db_url, flavour, hold_a, mark_b, publisher, b_poll=1.0)
    try:
        pair.start_a()
        assert wait_until(cut.is_set, 15)
        assert wait_until(b_queued.is_set, 5), "B sent no rescue during the pause"
        time.sleep(2 * pair.lease)
        pair.resume()
        assert wait_until(lambda: statuses(engine) == {"done": 6}, 30), statuses(engine)
        time.sleep(1.5)  # (a second publish of a rescued message would be under way by now)
    finally:
        b_queued.set()
        pair.end()
    _published_once_each(publisher, 6)


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_loop_held_in_its_claim_by_a_pooler_pause_rescues_no_lease_that_ran_out_during_it(
    engine: Engine, bouncer: PrivatePgBouncer, db_url: URL, flavour: str
) -> None:
    """The busy form of the test above (a second review): the statement the PAUSE holds is B's claim, not its
    rescue. A dispatcher (A) published a batch as the pause began; B's claim waits in the pooler's queue. After
    RESUME B's claim comes back, its rescue step is due and begins at once — its BEGIN not held at all — just
    before A's finalize (one server connection: B's block goes first). Before, B's rescue took A's batch, whose
    leases ran out during the pause, and B published all six messages again (every run; the review: a whole
    batch in 5 of 8 runs of busy dispatchers). B's claim took the pause's length to come back: B takes that as
    an outage, and its rescue leaves those leases to A, whose finalize goes through."""
    seed_events(engine, 6)
    claimed, cut, resumed, b_rescues = (threading.Event() for _ in range(4))

    def hold_a(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if cut.is_set() and b_rescues.wait(4 * pair.lease):  # A's finalize: after B's rescue step has begun
            time.sleep(0.3)

    def b_claims_into_the_pause(conn: Any, cursor: Any, statement: str, parameters: Any, *args: Any) -> None:
        params = parameters if isinstance(parameters, dict) else {}
        if claimed.is_set() and not cut.is_set() and "lease" in params:  # (a claim's)
            pair.pause()  # (this claim of B's is the statement the pause holds)
            cut.set()
        elif resumed.is_set() and (statement == "BEGIN" or "expired_for" in params):
            b_rescues.set()

    def first_message(message: Any) -> None:
        if not claimed.is_set():
            pair.start_b()
            time.sleep(1.5)  # B past its start's grace, claiming every 0.05 s
            claimed.set()
            assert cut.wait(10), "B sent no claim"
        return None

    publisher = RecordingPublisher(fail=first_message)
    pair = _PausedPair(bouncer, db_url, flavour, hold_a, b_claims_into_the_pause, publisher, b_poll=0.05)
    try:
        pair.start_a()
        assert wait_until(cut.is_set, 15)
        time.sleep(2 * pair.lease)
        resumed.set()
        pair.resume()
        assert wait_until(b_rescues.is_set, 5), "B began no rescue after the pause"
        assert wait_until(lambda: statuses(engine) == {"done": 6}, 30), statuses(engine)
        time.sleep(1.5)  # (a second publish of a rescued message would be under way by now)
    finally:
        b_rescues.set()
        pair.end()
    _published_once_each(publisher, 6)


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["async", "sync"])
def test_no_claim_is_handed_out_twice_when_limited_workers_lose_server_connections_through_pgbouncer(
    engine: Engine,
    bouncer: PrivatePgBouncer,
    db_url: URL,
    flavour: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The lost-connection run of test_lost_connection_autocommit (three workers, a limited queue's claims in a
    transaction block, the backends terminated every 20 ms for 2.9 s at a time) through PgBouncer in
    transaction pooling mode: there the server connection dies under a client connection that PgBouncer may
    keep or close, and the block's BEGIN ... COMMIT is the one stretch that pins a server connection. No
    (job id, lease_version) may reach a worker's hands twice, and every job is done."""
    alias = f"{db_url.database}_lost"
    url = bouncer.url(alias)

    def terminate(conn: Any) -> None:
        # (only this database's: a pid PgBouncer still lists may be gone and reused by another test's backend)
        conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE pid = ANY(CAST(:p AS int[])) AND datname = current_database()"),
                     {"p": bouncer.server_pids(alias)})  # fmt: skip

    limited_workers_losing_connections(
        engine,
        flavour,
        monkeypatch,
        caplog,
        sync_engine=lambda: pgbouncer_engine(url)[0],
        async_engine=lambda: pgbouncer_async_engine(url)[0],
        terminate=terminate,
    )


def test_migrations_through_pgbouncer_leave_no_lock_timeout_on_the_server_connection(
    bouncer: PrivatePgBouncer, db_url: URL
) -> None:
    """``run_migrations_with_lock_retries`` bounds each revision's lock waits with ``SET LOCAL``: through
    PgBouncer in transaction mode (one server connection here) a session ``SET`` would stay on the server
    connection for the next client, and would not even follow the upgrade's next transaction."""
    from sa_outbox.migration import run_migrations_with_lock_retries

    url = bouncer.url(f"{db_url.database}_one")
    engine, _ = pgbouncer_engine(url)
    seen: list[str] = []
    between: list[str] = []

    class TwoRevisions:  # alembic's context, as run_migrations_with_lock_retries uses it
        def configure(self, **kw: Any) -> None:
            assert kw["transaction_per_migration"] is True

        def begin_transaction(self) -> Any:
            return contextlib.nullcontext()

        def get_revision_argument(self) -> str:
            return "head"

        def run_migrations(self) -> None:
            for _ in range(2):  # each revision its own transaction, committed
                seen.append(conn.execute(text("SHOW lock_timeout")).scalar_one())
                conn.commit()
                with engine.connect() as other:  # another client, on the same (only) server connection
                    between.append(other.execute(text("SHOW lock_timeout")).scalar_one())

    try:
        with engine.connect() as conn:
            run_migrations_with_lock_retries(TwoRevisions(), conn, lock_timeout=0.25)
        with engine.connect() as other:  # the next client, on the same (only) server connection
            after = other.execute(text("SHOW lock_timeout")).scalar_one()
    finally:
        engine.dispose()
    assert seen == ["250ms", "250ms"]
    assert between == ["0", "0"] and after == "0"


def test_notifications_do_not_cut_short_the_fault_wait_of_loops_through_pgbouncer(
    prunner: PooledRunner, engine: Engine, db_url: URL
) -> None:
    """The loops' statements through PgBouncer, their LISTEN on the server (the helper's ``direct_url``), a
    trigger refusing their outcomes (a fault the producers do not share) and a producer notifying 100 times a
    second: a worker and an ordered dispatcher try again at their backoff's pace, not at each notification
    (test_loop_guarantees' test of the direct path). Once the trigger is gone each outcome is written; ran and
    published once. Before ecafda2, sync and async: each heard notification was one more failed turn, which
    took the backoff to its 30 s cap within the 6 s — the job still ``running`` 15 s after the trigger went."""
    listen = {"listen": True, "listen_url": db_url.set(drivername="postgresql+psycopg")}
    seed_jobs(engine, 1, task="t")
    ran: list[int] = []
    w = prunner.worker({"t": lambda job: ran.append(job.id)}, concurrency=1, stale_after=10.0, heartbeat=0,
                       poll_interval=0.5, **listen)  # fmt: skip
    tries, heard = _turns_failed_behind_a_refusal(prunner, engine, w, "jobs", notify="default")
    assert heard >= 20, f"the worker's LISTEN connection heard {heard} notifications in 4 s"
    assert 1 <= tries <= 8, f"the worker failed {tries} turns in 4 s"
    assert ran == [1]

    seed_events(engine, 1)
    pub = RecordingPublisher()
    d = prunner.dispatcher(pub, ordered=True, poll_interval=0.5, **listen)
    tries, heard = _turns_failed_behind_a_refusal(prunner, engine, d, "outbox", notify="")
    assert heard >= 20, f"the dispatcher's LISTEN connection heard {heard} notifications in 4 s"
    assert 1 <= tries <= 8, f"the ordered dispatcher failed {tries} turns in 4 s"
    assert len(pub.messages) == 1


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_tenants_through_pgbouncer_stay_in_their_schemas(
    engine: Engine, pooled_url: URL, db_url: URL, flavour: str
) -> None:
    """Two tenants' producers, ordered dispatchers and workers through the pooler (prepared statements off: the
    cursor path, each statement's text with its tenant's schema written in), sharing the pooler's server
    connections: every row is written, delivered and run in its own tenant's schema, in its aggregates' order,
    and the default schema's tables stay empty."""
    from .test_tenants import tenant_schemas

    tenants = ("tenant_p", "tenant_q")
    with tenant_schemas(engine, tenants, jobs=0):
        for name in tenants:
            placed, _ = pgbouncer_engine(pooled_url, direct_url=db_url, pool_size=2)
            placed = placed.execution_options(schema_translate_map={None: name})
            try:
                with Session(placed) as s, s.begin():
                    for n in range(12):
                        s.add(OutboxEvent(aggregate_type="a", aggregate_id=f"{name}-{n % 3}", event_type="E",
                                          payload={"n": n}))  # fmt: skip
                        enqueue(s, Job, "t", {"who": name, "n": n})
            finally:
                placed.dispose()
        for name in tenants:
            publisher, ran = RecordingPublisher(), []
            runner = PooledRunner(flavour, pooled_engine_for(pooled_url, db_url, name), pooled_url, db_url)
            if runner.aengine is not None:
                runner.aengine = runner.aengine.execution_options(schema_translate_map={None: name})
            try:
                assert runner.drain(runner.dispatcher(publisher, ordered=True, batch=5)) == 12
                assert runner.drain(runner.worker({"t": payloads_into(ran)}, batch=4)) == 12
            finally:
                runner.close()
                runner.engine.dispose()
            assert {m.aggregate_id.rsplit("-", 1)[0] for m in publisher.messages} == {name}
            for agg in range(3):
                ns = [m.payload["n"] for m in publisher.messages if m.aggregate_id == f"{name}-{agg}"]
                assert ns == sorted(ns) and len(ns) == 4
            assert sorted(p["n"] for p in ran) == list(range(12)) and {p["who"] for p in ran} == {name}
        with engine.connect() as conn:
            for name in tenants:
                for table in ("outbox", "jobs"):
                    got = conn.execute(text(f"SELECT DISTINCT status FROM {name}.{table}")).scalars().all()
                    assert got == ["done"], (name, table, got)
    assert statuses(engine) == {} and statuses(engine, "jobs") == {}


def payloads_into(ran: list[Any]) -> Any:
    """A handler that records each job's payload (one parameter: not a transactional handler)."""
    return lambda job: ran.append(job.payload)


def pooled_engine_for(pooled_url: URL, db_url: URL, tenant: str) -> Engine:
    """A pooled engine (the helper's) carrying ``tenant``'s translate map."""
    engine, _ = pgbouncer_engine(pooled_url, direct_url=db_url, pool_size=3)
    return engine.execution_options(schema_translate_map={None: tenant})


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_workers_leases_are_renewed_while_the_pooler_has_no_free_server_connection(
    engine: Engine, bouncer: PrivatePgBouncer, db_url: URL, flavour: str
) -> None:
    """A worker on pgbouncer_engine(direct_url=…) renews its leases on the server itself. Through the pooler its
    beats waited for a server connection like any client: with every one taken for longer than stale_after, the
    leases ran out and other workers rescued and ran the live worker's jobs a second time (a review: 2–4 of 8,
    PgBouncer pool of 2). Here the alias's one server connection is held for twice stale_after while a job
    runs: its lease must stay fresh throughout, and the job end done on its first lease."""
    alias = bouncer.url(f"{db_url.database}_one")
    seed_jobs(engine, 1, task="t")
    started, gate = threading.Event(), threading.Event()

    def handler(job: ClaimedJob) -> None:
        started.set()
        gate.wait(30)

    async def ahandler(job: ClaimedJob) -> None:
        started.set()
        await asyncio.to_thread(gate.wait, 30)

    holder = psycopg.connect(alias.set(drivername="postgresql").render_as_string(hide_password=False))
    if flavour == "sync":
        pengine, wakeups = pgbouncer_engine(alias, direct_url=db_url)
        w: Any = Worker(pengine, Job, {"t": handler}, stale_after=2, heartbeat=0.25, **wakeups)
        thread = threading.Thread(target=w.run, kwargs={"install_signal_handlers": False})
    else:
        aengine, wakeups = pgbouncer_async_engine(alias, direct_url=db_url)
        w = AsyncWorker(aengine, Job, {"t": ahandler}, stale_after=2, heartbeat=0.25, **wakeups)

        async def main() -> None:
            try:
                await w.run(install_signal_handlers=False)
            finally:
                await w.close()
                await aengine.dispose()

        thread = threading.Thread(target=asyncio.run, args=(main(),))
    thread.start()
    try:
        assert started.wait(20)
        holder.execute("SELECT 1")  # a transaction left open: the alias's only server connection is taken
        ages = []
        for _ in range(16):  # 4 s: twice stale_after
            time.sleep(0.25)
            with engine.connect() as conn:  # (the test's direct engine)
                ages.append(conn.execute(text(
                    "SELECT extract(epoch FROM clock_timestamp() - locked_at) FROM jobs WHERE id = 1"
                )).scalar_one())  # fmt: skip
        holder.rollback()
        assert max(ages) < 1.5, ages  # renewed every 0.25 s throughout (it reached 4 s through the pooler)
    finally:
        holder.close()
        gate.set()
        wait_until(lambda: statuses(engine, "jobs") == {"done": 1}, timeout=20)
        w.stop()
        thread.join(20)
        if flavour == "sync":
            w.close()
            pengine.dispose()
    r = row(engine, "jobs", 1)
    assert (r.status, r.lease_version, r.attempts) == ("done", 1, 1), r


def test_a_direct_lease_route_that_reaches_another_table_is_not_used(
    engine: Engine, db_url: URL, caplog: pytest.LogCaptureFixture
) -> None:
    """The direct route carries the engine's URL, connect_args and execution options, not its events: a
    search_path set by a ``connect`` listener on the pooled engine would have the beats renew another schema's
    table (and this worker's leases run out). The route is checked against the loop's own connection before its
    first renewal; one that disagrees is not used — the beats go through the engine, and that is logged."""
    from sqlalchemy import event

    with fresh_schema(engine, "lease_route"):
        schema_engine = engine.execution_options(schema_translate_map={None: "lease_route"})
        Job.__table__.create(schema_engine)
        seed_jobs(schema_engine, 1, task="t")
        # ("pooled" by name only: a plain SET through the shared PgBouncer would stay on its server connection
        # for every later client — here the server itself, whose connections go with this engine)
        pengine, wakeups = pgbouncer_engine(
            db_url.update_query_dict({"application_name": "route"}), direct_url=db_url
        )

        @event.listens_for(pengine, "connect")
        def search_path(dbapi_conn: Any, _: Any) -> None:
            with dbapi_conn.cursor() as cur:
                cur.execute("SET search_path TO lease_route")
            dbapi_conn.commit()

        w = Worker(pengine, Job, {"t": lambda job: time.sleep(0.8)}, stale_after=2, heartbeat=0.2, **wakeups)
        try:
            with caplog.at_level(logging.ERROR, logger="sa_outbox"):
                drain(w)
        finally:
            w.close()
            pengine.dispose()
        assert "resolves table jobs to" in caplog.text and "go through the engine instead" in caplog.text
        assert w._beat_db.engine is pengine and w._guard_db.engine is pengine
        with schema_engine.connect() as conn:
            assert tuple(conn.execute(select(Job.status, Job.lease_version)).one()) == ("done", 1)


def _cut_inside_the_first_connect(engine: Any, db_url: URL, app: str, raised: list[str]) -> None:
    """On ``engine``'s first new connection, in its connect event: a transaction opened through the pooler, its
    server connection terminated on the server, then the ROLLBACK SQLAlchemy's own first connect sends — what a
    loop's engine meets when a pooler's server connection dies between the dialect's start-up queries and that
    rollback (the model suite's pooled scenarios: a dispatcher died of it). PgBouncer answers that ROLLBACK with
    the lost server's error and the ROLLBACK's result, and psycopg raises ``InternalError("received 2 results
    from command 'ROLLBACK'")``, on a connection it then closes. ``raised``: what the cut's ROLLBACK raised."""
    sync_engine = engine.sync_engine if hasattr(engine, "sync_engine") else engine

    @event.listens_for(sync_engine, "connect")
    def cut(dbapi_connection: Any, _record: Any) -> None:
        if raised:
            return
        cur = dbapi_connection.cursor()
        cur.execute("SELECT 1")  # (a transaction open: psycopg's implicit BEGIN)
        cur.close()
        with psycopg.connect(
            db_url.set(drivername="postgresql").render_as_string(False), autocommit=True
        ) as k:
            k.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s "
                "AND datname = current_database()", (app,),
            )  # fmt: skip
        time.sleep(0.3)  # PgBouncer sees its server connection closed
        try:
            dbapi_connection.rollback()
        except Exception as exc:
            raised.append(f"{type(exc).__name__}: {exc}")
            raise
        raised.append("nothing")


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_server_connection_lost_inside_a_loops_first_connect_is_an_outage_through_pgbouncer(
    engine: Engine, pooled_url: URL, db_url: URL, flavour: str
) -> None:
    """The pooler's answer to a transaction whose server connection died is psycopg's client-side
    ``InternalError`` (no SQLSTATE), raised where SQLAlchemy has no connection to test for a disconnect (a new
    connection's connect event): the loop took it for a fatal error and died — one lost server connection
    stopped a worker for good. It is a lost connection: the loop retries, and drains."""
    seed_jobs(engine, 6, task="t")
    app = f"cut-once-{flavour}"
    done: list[int] = []
    raised: list[str] = []

    def handle(job: ClaimedJob) -> None:
        done.append(job.id)

    opts: dict[str, Any] = dict(batch=3, poll_interval=0.1, backoff=Backoff(0.01, 0.05, jitter=False))
    if flavour == "sync":
        pe, _ = pgbouncer_engine(pooled_url, direct_url=db_url, connect_args={"application_name": app})
        _cut_inside_the_first_connect(pe, db_url, app, raised)
        w = Worker(pe, Job, {"t": handle}, listen=False, **opts)
        try:
            w.run(install_signal_handlers=False, until_idle=True)
        finally:
            w.close()
            pe.dispose()
        failed = w.stats.db_errors
    else:

        async def run() -> int:
            ae, _ = pgbouncer_async_engine(
                pooled_url, direct_url=db_url, connect_args={"application_name": app}
            )
            _cut_inside_the_first_connect(ae, db_url, app, raised)
            aw = AsyncWorker(ae, Job, {"t": handle}, listen=False, **opts)
            try:
                await aw.run(install_signal_handlers=False, until_idle=True)
            finally:
                await aw.close()
                await ae.dispose()
            return aw.stats.db_errors

        failed = asyncio.run(run())
    assert raised and "received 2 results" in raised[0], raised  # the pooler's answer, as the model met it
    assert sorted(done) == sorted(set(done)) and len(done) == 6, done
    assert statuses(engine, "jobs") == {"done": 6}
    assert failed >= 1  # the lost connection was a failed turn, retried


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_transactional_job_whose_session_cannot_connect_is_deferred_not_failed(
    engine: Engine, server_url: URL, db_url: URL, flavour: str
) -> None:
    """PgBouncer at its ``max_client_conn`` (as a server at ``max_connections``): the loop, connected before,
    claims on; each transactional handler's session is refused a connection. Before, that was the handler's
    failure — every claim spent an attempt, and 3 jobs of 3 attempts ended ``failed`` in seconds without their
    handler ever running (a hostile review). Now the handler is not called and the job is deferred, its attempt
    refunded, until a connection can be had: then every job runs once and ends done on its first attempt."""
    name = str(db_url.database)
    bouncer = PrivatePgBouncer(server_url, {name: (name, 2)}, max_client_conn="3")
    bouncer.start()
    seed_jobs(engine, 3, task="t", max_attempts=2)
    ran: list[int] = []
    others: list[psycopg.Connection[Any]] = []
    opts: dict[str, Any] = dict(batch=3, poll_interval=0.1, backoff=Backoff(0.01, 0.05, jitter=False))
    try:
        url = bouncer.url(name)
        conninfo = url.set(drivername="postgresql").render_as_string(False)
        others = [psycopg.connect(conninfo) for _ in range(2)]  # two of the pooler's three client slots

        def refused_meanwhile() -> None:  # the loop's connection took the third slot: sessions are refused
            def all_deferred() -> bool:
                return all(
                    (r.last_error or "").startswith(
                        "deferred: not run: the transaction for its handler could not"
                    )
                    for r in _job_rows(engine)
                )

            assert wait_until(all_deferred, 10), _job_rows(engine)  # each job's turn came, and was deferred
            assert not ran, ran
            assert all(r.attempts == 0 for r in _job_rows(engine) if r.status == "queued"), _job_rows(engine)
            for o in others:
                o.close()
            assert wait_until(lambda: {r.status for r in _job_rows(engine)} == {"done"}, 15), _job_rows(
                engine
            )

        if flavour == "sync":
            pe, wakeups = pgbouncer_engine(url, direct_url=db_url)

            def handle(job: ClaimedJob, session: Session) -> None:
                session.execute(text("SELECT 1"))
                ran.append(job.id)

            w = Worker(pe, Job, {"t": handle}, **wakeups, **opts)
            t = threading.Thread(target=w.run, kwargs={"install_signal_handlers": False})
            t.start()
            try:
                refused_meanwhile()
            finally:
                w.stop()
                t.join(30)
                w.close()
                pe.dispose()
        else:

            async def handle_async(job: ClaimedJob, session: AsyncSession) -> None:
                await session.execute(text("SELECT 1"))
                ran.append(job.id)

            async def run() -> None:
                ae, wakeups = pgbouncer_async_engine(url, direct_url=db_url)
                aw = AsyncWorker(ae, Job, {"t": handle_async}, **wakeups, **opts)
                try:
                    task = asyncio.ensure_future(aw.run(install_signal_handlers=False))
                    try:
                        await asyncio.to_thread(refused_meanwhile)
                    finally:
                        aw.stop()
                        await asyncio.wait_for(task, 30)
                finally:
                    await aw.close()
                    await ae.dispose()

            asyncio.run(run())
    finally:
        for o in others:
            o.close()
        bouncer.close()
    assert len(ran) == 3 == len(set(ran)), ran  # each job's handler ran once, once a connection could be had
    rows = _job_rows(engine)
    assert [(r.status, r.attempts) for r in rows] == [("done", 1)] * 3, rows


def _job_rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT id, status, attempts, last_error FROM jobs ORDER BY id")))
