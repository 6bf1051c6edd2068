"""Shared builders for the test suite: fast backoff, loops of either flavour driven from a test, rows."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from sa_outbox import AsyncDispatcher, AsyncWorker, Backoff, Dispatcher, Worker
from sa_outbox.models import Job, OutboxEvent

FAST = Backoff(0.001, 0.001, jitter=False)


class Runner:
    """Builds a Dispatcher/Worker of the requested flavour and drives it synchronously for the test."""

    def __init__(self, kind: str, engine: Engine, async_url: URL) -> None:
        self.kind = kind
        self.engine = engine
        self.loop = asyncio.new_event_loop() if kind == "async" else None
        self.aengine = create_async_engine(async_url) if kind == "async" else None
        self.loops: list[Any] = []

    def dispatcher(self, publisher: Any, **kw: Any) -> Any:
        kw.setdefault("listen", False)
        kw.setdefault("backoff", FAST)
        d = (
            AsyncDispatcher(self.aengine, OutboxEvent, publisher, **kw)
            if self.aengine
            else Dispatcher(self.engine, OutboxEvent, publisher, **kw)
        )
        self.loops.append(d)
        return d

    def worker(self, handlers: dict[str, Any], **kw: Any) -> Any:
        kw.setdefault("listen", False)
        w = (
            AsyncWorker(self.aengine, Job, handlers, **kw)
            if self.aengine
            else Worker(self.engine, Job, handlers, **kw)
        )
        self.loops.append(w)
        return w

    def run_once(self, lp: Any) -> int:
        if self.loop is not None:
            return int(self.loop.run_until_complete(lp.run_once()))
        return int(lp.run_once())

    def drain(self, lp: Any) -> int:
        total = 0
        for _ in range(1000):
            n = self.run_once(lp)
            if not n:
                return total
            total += n
        raise AssertionError("did not drain")

    def run(self, lp: Any, **kw: Any) -> None:
        """``run()`` of either flavour, blocking (no signal handlers)."""
        kw.setdefault("install_signal_handlers", False)
        if self.loop is not None:
            self.loop.run_until_complete(lp.run(**kw))
        else:
            lp.run(**kw)

    def run_in_thread(self, lp: Any) -> threading.Thread:
        if self.loop is not None:
            loop = self.loop
            target: Any = lambda: loop.run_until_complete(lp.run(install_signal_handlers=False))  # noqa: E731
        else:
            target = lambda: lp.run(install_signal_handlers=False)  # noqa: E731
        t = threading.Thread(target=target)
        t.start()
        return t

    def close(self) -> None:
        if self.loop is not None:
            for lp in self.loops:
                self.loop.run_until_complete(lp.close())
            assert self.aengine is not None
            self.loop.run_until_complete(self.aengine.dispose())
            self.loop.close()


def expire_leases(engine: Engine, table: str, ids: list[int] | None = None) -> int:
    """Make leased rows look as if their lease ran out — instead of sleeping past it (River's testfactory
    idea: build the state, do not wait for it). Outbox: ``lease_until`` in the past; jobs: ``locked_at`` a day
    ago (older than any ``stale_after``). Returns how many rows were changed."""
    from sqlalchemy import text

    sql = (
        "UPDATE outbox SET lease_until = now() - interval '1 second' WHERE status = 'processing'"
        if table == "outbox"
        else "UPDATE jobs SET locked_at = now() - interval '1 day' WHERE status = 'running'"
    )
    if ids is not None:
        sql += " AND id = ANY(:ids)"
    with engine.begin() as conn:
        return int(conn.execute(text(sql), {"ids": ids}).rowcount)


def make_due(engine: Engine, table: str, ids: list[int] | None = None) -> int:
    """Make rows waiting for a backoff or a Defer due now (instead of sleeping until they are)."""
    from sqlalchemy import text

    sql = (
        "UPDATE outbox SET available_at = now() WHERE status = 'pending' AND available_at > now()"
        if table == "outbox"
        else "UPDATE jobs SET run_at = now() WHERE status = 'queued' AND run_at > now()"
    )
    if ids is not None:
        sql += " AND id = ANY(:ids)"
    with engine.begin() as conn:
        return int(conn.execute(text(sql), {"ids": ids}).rowcount)
