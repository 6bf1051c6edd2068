"""Seeding and reading helpers shared by the dispatcher and worker tests."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, insert, select, text

from sa_outbox import ClaimedJob, Message
from sa_outbox import engine as eng
from sa_outbox.models import Job, OutboxEvent
from sa_outbox.sql import spec_for

OUTBOX = spec_for(OutboxEvent)
JOBS = spec_for(Job)


def seed_events(
    engine: Engine, n: int, *, aggregate: str | None = None, event_type: str = "E", start: int = 0
) -> None:
    rows = [
        {
            "aggregate_type": "order",
            "aggregate_id": aggregate or f"agg-{i}",
            "event_type": event_type,
            "payload": {"n": i},
        }
        for i in range(start, start + n)
    ]
    with engine.begin() as conn:
        conn.execute(insert(OutboxEvent), rows)


def seed_jobs(engine: Engine, n: int, *, task: str = "noop", queue: str = "default", **kw: Any) -> None:
    rows = [{"task": task, "queue": queue, "payload": {"n": i}, **kw} for i in range(n)]
    with engine.begin() as conn:
        conn.execute(insert(Job), rows)


def row(engine: Engine, table: str, id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(f"SELECT * FROM {table} WHERE id = :id"), {"id": id}).one()


def statuses(engine: Engine, table: str = "outbox") -> dict[str, int]:
    with engine.connect() as conn:
        return dict(conn.execute(text(f"SELECT status, count(*) FROM {table} GROUP BY status")).all())  # type: ignore[arg-type]


def ids_with_status(engine: Engine, status: str) -> list[int]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                select(OutboxEvent.id).where(OutboxEvent.status == status).order_by(OutboxEvent.id)
            ).scalars()
        )


def claim(engine: Engine, owner: str, batch: int, lease: float, **kw: Any) -> list[Any]:
    """The document's claim(): rescue + claim in one short transaction (as run_once does)."""
    from datetime import timedelta

    with engine.begin() as conn:
        eng.rescue(conn, OUTBOX, max_attempts=kw.pop("max_attempts", 12))
        rows = eng.claim(conn, OUTBOX, owner=owner, batch=batch, lease=timedelta(seconds=lease), **kw)
    return [Message.from_row(r) for r in rows]


def claim_jobs(conn: Any, owner: str, batch: int = 1, queue: str = "default") -> list[ClaimedJob]:
    return [ClaimedJob.from_row(r) for r in eng.claim(conn, JOBS, owner=owner, batch=batch, queue=queue)]


def mark_done(engine: Engine, r: Any) -> bool:
    """The document's mark_done(): a fenced finalize; False = the lease was lost."""
    outcome = eng.Outcome(r.id, r.lease_version, "done")
    with engine.begin() as conn:
        return r.id in eng.finalize(conn, OUTBOX, [outcome])
