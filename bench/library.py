"""The library's side of every scenario: one Worker / Dispatcher (sync or async) per process, as a user runs it.

Each loop drains through ``run(until_idle=True)`` with no LISTEN connection (a drain has no idle time to wake
from), on its own engine; the backends it opens are recorded from the pool's ``connect`` event so the harness
can read their CPU. ``sample_every`` (the memory mode) makes the handler/publisher read the process's RSS every
that many rows.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import create_engine, event, text

from sa_outbox import Dispatcher, Message, Worker
from sa_outbox.models import Job, OutboxEvent

from .harness import Harness, measured, rss_now


@dataclass(frozen=True)
class LoopOptions:
    batch: int | None = None  # None: the library's default
    concurrency: int = 1
    job_seconds: float = 0.0  # the handler's sleep (0: a no-op)
    ordered: bool = False  # dispatcher only
    sample_every: int = 0  # RSS sample every N rows (0: none)
    queues: tuple[str, ...] | None = None  # worker only; None: the library's default ("default",)

    def loop_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {} if self.batch is None else {"batch": self.batch}
        if self.queues is not None:
            kw["queues"] = self.queues
        return kw


class Counter:
    """Counts rows handled/published; with ``sample_every``, records (rows, RSS KiB) every that many rows."""

    def __init__(self, sample_every: int) -> None:
        self.n = 0
        self.every = sample_every
        self.samples: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, _row: Any = None) -> None:
        with self.lock:
            self.n += 1
            if self.every and self.n % self.every == 0:
                self.samples.append((self.n, rss_now()))


def _record_backends(engine: Any) -> list[int]:
    pids: list[int] = []

    @event.listens_for(engine, "connect")
    def on_connect(dbapi_conn: Any, _record: Any) -> None:
        pids.append(getattr(dbapi_conn, "driver_connection", dbapi_conn).info.backend_pid)

    return pids


def _handler(opts: LoopOptions, counter: Counter) -> Any:
    if opts.job_seconds:

        def sleepy(job: Any) -> None:
            time.sleep(opts.job_seconds)
            counter()

        return sleepy
    return counter


def library_worker(url: str, opts: LoopOptions, h: Harness) -> None:
    engine = create_engine(url, pool_size=2)
    pids = _record_backends(engine)
    counter = Counter(opts.sample_every)
    w = Worker(
        engine, Job, {"noop": _handler(opts, counter)}, concurrency=opts.concurrency, listen=False,
        **opts.loop_kwargs(),
    )  # fmt: skip
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
    with measured(h, lambda: list(pids)) as box:
        w.run(install_signal_handlers=False, until_idle=True)
        box.update(
            jobs=w.stats.done, claimed=w.stats.claimed, batches=w.stats.batches, rss_samples=counter.samples
        )
    w.close()
    engine.dispose()


class CountingPublisher:
    def __init__(self, counter: Counter) -> None:
        self.counter = counter

    def publish(self, message: Message) -> None:
        self.counter()


def library_dispatcher(url: str, opts: LoopOptions, h: Harness) -> None:
    engine = create_engine(url, pool_size=2)
    pids = _record_backends(engine)
    counter = Counter(opts.sample_every)
    d = Dispatcher(engine, OutboxEvent, CountingPublisher(counter), ordered=opts.ordered, listen=False,
                   **opts.loop_kwargs())  # fmt: skip
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
    with measured(h, lambda: list(pids)) as box:
        if opts.ordered:
            # The ordered claim can come back empty while other dispatchers hold the heads: stop only when
            # the table has nothing left for anyone.
            with engine.connect() as conn:
                while True:
                    d.run(install_signal_handlers=False, until_idle=True)
                    # (an index lookup, not a count: a count read the whole table, 4-17 ms of a 650 ms drain)
                    left = conn.execute(
                        text(
                            "SELECT EXISTS (SELECT FROM outbox WHERE status IN ('pending', 'processing', 'dead'))"
                        )
                    ).scalar_one()
                    conn.rollback()
                    if not left:
                        break
                    time.sleep(0.001)
        else:
            d.run(install_signal_handlers=False, until_idle=True)
        box.update(
            jobs=d.stats.done, claimed=d.stats.claimed, batches=d.stats.batches, rss_samples=counter.samples
        )
    d.close()
    engine.dispose()


class AsyncNoopPublisher:
    async def publish(self, message: Message) -> None:
        return None


async def _async_noop(job: Any) -> None:
    return None


def library_async_loop(url: str, kind: str, batch: int, flavour: str, h: Harness) -> None:
    """AsyncWorker / AsyncDispatcher in one process (psycopg async driver); ``flavour`` is the handler's or
    publisher's: ``sync`` (run off the event loop) or ``async``."""
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from sa_outbox import AsyncDispatcher, AsyncWorker

    async def main() -> None:
        engine = create_async_engine(url.replace("+psycopg:", "+psycopg_async:"), pool_size=2)
        pids = _record_backends(engine.sync_engine)
        if kind == "jobs":
            handler: Any = _async_noop if flavour == "async" else (lambda j: None)
            loop: Any = AsyncWorker(engine, Job, {"noop": handler}, batch=batch, listen=False)
        else:
            publisher: Any = AsyncNoopPublisher() if flavour == "async" else CountingPublisher(Counter(0))
            loop = AsyncDispatcher(engine, OutboxEvent, publisher, batch=batch, listen=False)
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
        with measured(
            h, lambda: list(pids)
        ) as box:  # waiting for the start blocks a loop that has nothing to do
            await loop.run(install_signal_handlers=False, until_idle=True)
            box.update(jobs=loop.stats.done)
        await loop.close()
        await engine.dispose()

    asyncio.run(main())
