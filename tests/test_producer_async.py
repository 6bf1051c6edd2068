"""The producer behaviours under AsyncSession (psycopg async driver): the same sync flush hooks run."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from sa_outbox import PayloadError, enqueue
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
