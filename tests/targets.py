"""Dispatcher/Worker factories used by the CLI tests (configured through environment variables)."""

from __future__ import annotations

import contextlib
import os
import time

from sqlalchemy import create_engine, text

from sa_outbox import ClaimedJob, Dispatcher, Message, Worker
from sa_outbox.models import Job, OutboxEvent


class TablePublisher:
    """Records each publish in a table, optionally slowly (a stand-in broker with a real side effect)."""

    def __init__(self, url: str, delay: float) -> None:
        self.engine = create_engine(url, pool_size=1)
        self.delay = delay

    def publish(self, message: Message) -> None:
        time.sleep(self.delay)
        with self.engine.begin() as conn:
            conn.execute(
                text("INSERT INTO deliveries (message_id, pid) VALUES (:m, :p)"),
                {"m": message.id, "p": os.getpid()},
            )


def dispatcher() -> Dispatcher:
    url = os.environ["DATABASE_URL"]
    delay = float(os.environ.get("PUBLISH_DELAY", "0"))
    return Dispatcher(
        create_engine(url), OutboxEvent, TablePublisher(url, delay), batch=int(os.environ.get("BATCH", "10")),
        lease=30, publish_timeout=5, poll_interval=0.2,
    )  # fmt: skip


def worker() -> Worker:
    url = os.environ["DATABASE_URL"]
    engine = create_engine(url)
    delay = float(os.environ.get("JOB_DELAY", "0"))
    gate = os.environ.get(
        "GATE"
    )  # a file: each job writes GATE.started, then waits (<= 60 s) until GATE exists

    def record(job: ClaimedJob) -> None:
        time.sleep(delay)
        if gate:
            open(f"{gate}.started", "w").close()
        deadline = time.monotonic() + 60
        while gate and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        with engine.begin() as conn:
            conn.execute(
                text("INSERT INTO job_calls (job_id, pid) VALUES (:j, :p)"), {"j": job.id, "p": os.getpid()}
            )

    return Worker(engine, Job, {"record": record}, batch=int(os.environ.get("BATCH", "10")), poll_interval=0.2,
                  stale_after=float(os.environ.get("STALE_AFTER", "60")),
                  concurrency=int(os.environ.get("CONCURRENCY", "1")))  # fmt: skip


def async_dispatcher() -> object:
    from sqlalchemy.ext.asyncio import create_async_engine

    from sa_outbox import AsyncDispatcher
    from sa_outbox.embedded import normalize_url

    url = normalize_url(os.environ["DATABASE_URL"]).replace("+psycopg:", "+psycopg_async:")
    return AsyncDispatcher(create_async_engine(url), OutboxEvent, TablePublisher(os.environ["DATABASE_URL"], 0.0),
                           poll_interval=0.2)  # fmt: skip


not_a_loop = 42


def deaf_async_worker() -> object:
    """An AsyncWorker whose handler swallows every cancellation until the file GATE exists (bounded: 120 s):
    past its handler_timeout the loop abandons it, and the process must still end."""
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from sa_outbox import AsyncWorker
    from sa_outbox.embedded import normalize_url

    gate = os.environ["GATE"]

    async def deaf(job: ClaimedJob) -> None:
        open(f"{gate}.started", "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(gate) and time.monotonic() < deadline:
            with contextlib.suppress(asyncio.CancelledError):  # deaf
                await asyncio.sleep(0.05)

    url = normalize_url(os.environ["DATABASE_URL"]).replace("+psycopg:", "+psycopg_async:")
    return AsyncWorker(create_async_engine(url), Job, {"deaf": deaf}, handler_timeout=0.3, poll_interval=0.2)
