"""Dispatcher/Worker factories for the fault-injection run (configured through environment variables)."""

from __future__ import annotations

import os

from sqlalchemy import create_engine, text

from sa_outbox import Backoff, ClaimedJob, Dispatcher, Worker
from sa_outbox.models import Job, OutboxEvent
from sa_outbox.publishers.redis import RedisStreamPublisher


def _engine() -> object:
    url = os.environ["DATABASE_URL"]
    app = os.environ.get("FAULT_APP", "fault")
    return create_engine(url, pool_size=3, connect_args={"application_name": app})


def dispatcher() -> Dispatcher:
    publisher = RedisStreamPublisher(
        os.environ.get("FAULT_REDIS_URL", "redis://127.0.0.1:6379/0"),
        stream=os.environ["FAULT_STREAM"],
        timeout=1.0,
    )
    return Dispatcher(
        _engine(), OutboxEvent, publisher, batch=20, lease=3, publish_timeout=1, max_attempts=50,  # type: ignore[arg-type]
        ordered=["OrderUpdated"], backoff=Backoff(0.05, 0.5), poll_interval=0.2,
    )  # fmt: skip


def worker() -> Worker:
    engine = _engine()

    def record(job: ClaimedJob) -> None:
        with engine.begin() as conn:  # type: ignore[attr-defined]
            conn.execute(
                text("INSERT INTO fault_job_calls (job_id, pid) VALUES (:j, :p)"),
                {"j": job.id, "p": os.getpid()},
            )

    return Worker(
        engine, Job, {"record": record}, batch=10, stale_after=3, poll_interval=0.2,  # type: ignore[arg-type]
        backoff=Backoff(0.05, 0.5, jitter=False),
    )  # fmt: skip
