"""The producer behaviours under AsyncSession (psycopg async driver): the same sync flush hooks run."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from sa_outbox import PayloadError, emit, enqueue, lock_aggregate
from sa_outbox.models import Job, OutboxEvent

from .conftest import count_rows
from .models import Order


def _event(agg: str = "A", n: int = 0, payload: Any = None) -> OutboxEvent:
    return OutboxEvent(
        aggregate_type="order",
        aggregate_id=agg,
        event_type="OrderChanged",
        payload={"n": n} if payload is None else payload,
    )


def _run(url: URL, body: Any) -> Any:
    async def main() -> Any:
        aengine = create_async_engine(url)
        try:
            return await body(aengine)
        finally:
            await aengine.dispose()

    return asyncio.run(main())


def test_async_commit_rollback_and_exception(engine: Engine, async_url: URL) -> None:
    async def body(aengine: AsyncEngine) -> None:
        async with AsyncSession(aengine) as s, s.begin():
            s.add(_event("kept"))
            enqueue(s.sync_session, Job, "t", {})
        async with AsyncSession(aengine) as s:
            s.add(_event("rolled-back"))
            await s.flush()
            await s.rollback()
        with pytest.raises(RuntimeError):
            async with AsyncSession(aengine) as s, s.begin():
                s.add(_event("exception"))
                await s.flush()
                raise RuntimeError("boom")
        async with AsyncSession(aengine) as s, s.begin():
            nested = await s.begin_nested()
            s.add(_event("savepoint"))
            await s.flush()
            await nested.rollback()

    _run(async_url, body)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT aggregate_id FROM outbox")).scalars().all() == ["kept"]
    assert count_rows(engine, "jobs") == 1


def test_async_bad_payload_refused_nothing_written(engine: Engine, async_url: URL) -> None:
    async def body(aengine: AsyncEngine) -> None:
        async with AsyncSession(aengine) as s:
            s.add(_event("ok"))
            s.add(_event("bad", payload={"x": object()}))
            with pytest.raises(PayloadError, match="not JSON-serialisable"):
                await s.commit()

    _run(async_url, body)
    assert count_rows(engine, "outbox") == 0


def test_async_thousand_events_bounded_statements(engine: Engine, async_url: URL) -> None:
    async def body(aengine: AsyncEngine) -> list[str]:
        seen: list[str] = []
        event.listen(aengine.sync_engine, "before_cursor_execute", lambda c, cur, st, *a: seen.append(st))
        async with AsyncSession(aengine) as s, s.begin():
            s.add_all(_event(f"a{n % 20}", n) for n in range(1000))
        return seen

    seen = _run(async_url, body)
    assert count_rows(engine, "outbox") == 1000
    assert len(seen) <= 4


def test_async_aggregate_lock_orders_commits(engine: Engine, async_url: URL) -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO orders (status) VALUES ('new')"))

    async def body(aengine: AsyncEngine) -> list[str]:
        order: list[str] = []

        async def producer(name: str, hold: asyncio.Event | None, flushed: asyncio.Event | None) -> None:
            async with AsyncSession(aengine) as s:
                await s.execute(text(f"SET application_name = 'async_{name}'"))
                o = await s.get(Order, 1)
                s.add(OutboxEvent.for_aggregate(o, "OrderChanged", {"n": name}))
                await s.flush()
                if flushed:
                    flushed.set()
                if hold:
                    await hold.wait()
                await s.commit()
                order.append(name)

        hold, flushed = asyncio.Event(), asyncio.Event()
        t1 = asyncio.create_task(producer("t1", hold, flushed))
        await flushed.wait()
        t2 = asyncio.create_task(producer("t2", None, None))
        async with aengine.connect() as conn:  # wait until t2 is blocked on t1's row lock
            for _ in range(500):
                waiting = (
                    await conn.execute(
                        text(
                            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'async_t2' "
                            "AND wait_event_type = 'Lock'"
                        )
                    )
                ).scalar_one()
                await conn.rollback()  # pg_stat_activity is a per-transaction snapshot
                if waiting:
                    break
                await asyncio.sleep(0.02)
            assert waiting == 1
        assert not t2.done()
        hold.set()
        await asyncio.gather(t1, t2)
        return order

    assert _run(async_url, body) == ["t1", "t2"]
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT payload->>'n' FROM outbox ORDER BY id")).scalars().all()
    assert rows == ["t1", "t2"]


def test_async_for_aggregate_of_a_just_added_aggregate(engine: Engine, async_url: URL) -> None:
    """The order has no id until the flush inserts it: the event learns it at flush, with no I/O (and so no
    MissingGreenlet) when it is built."""

    async def body(aengine: AsyncEngine) -> int:
        async with AsyncSession(aengine, expire_on_commit=False) as s, s.begin():
            s.add(_event("before", 1))
            order = Order(status="new")
            s.add(order)
            s.add(OutboxEvent.for_aggregate(order, "OrderCreated", {"n": 2}))
            s.add(_event("after", 3))
        return order.id

    order_id = _run(async_url, body)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT aggregate_id, payload->>'n' FROM outbox ORDER BY id")).all() == [
            ("before", "1"),
            (str(order_id), "2"),  # written in the order the code added them
            ("after", "3"),
        ]


def test_async_emit_enqueue_and_lock_aggregate_take_the_async_session(engine: Engine, async_url: URL) -> None:
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO orders (status) VALUES ('new')"))

    def locks_held(pid: int) -> list[str]:
        """What the async transaction holds, seen from another connection."""
        with engine.connect() as conn:
            held = list(
                conn.execute(
                    text("SELECT locktype FROM pg_locks WHERE pid = :p AND locktype = 'advisory'"), {"p": pid}
                ).scalars()
            )
            try:
                conn.execute(text("SELECT 1 FROM orders WHERE id = 1 FOR NO KEY UPDATE NOWAIT"))
            except OperationalError:
                held.append("order row")
        return held

    async def body(aengine: AsyncEngine) -> tuple[list[int], list[str]]:
        async with AsyncSession(aengine) as s, s.begin():
            pid = (await s.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            s.add(_event("A", 1))
            ids = await emit(s, OutboxEvent, [("order", "A", "OrderChanged", {"n": 2})])
            await lock_aggregate(s, "order", "B")
            order = await s.get(Order, 1)
            await lock_aggregate(s, order)
            enqueue(s, Job, "t", {})
            held = await asyncio.to_thread(locks_held, pid)
            with pytest.raises(PayloadError, match="not JSON-serialisable"):
                await emit(s, OutboxEvent, [("order", "A", "Bad", {"x": object()})])
        return ids, held

    ids, held = _run(async_url, body)
    assert ids == [2]
    assert held == ["advisory", "advisory", "order row"]  # (order, A), (order, B) and the order's row
    with engine.connect() as conn:
        assert conn.execute(text("SELECT payload->>'n' FROM outbox ORDER BY id")).scalars().all() == [
            "1",
            "2",
        ]
    assert count_rows(engine, "jobs") == 1
