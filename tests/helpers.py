"""Seeding and reading helpers shared by the dispatcher and worker tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, MetaData, insert, select, text

from sa_outbox import ClaimedJob, Message
from sa_outbox import _steps as eng
from sa_outbox._sql import spec_for
from sa_outbox.models import Job, OutboxEvent

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


def claim_forms_sent(monkeypatch: Any, key: str) -> list[bool]:
    """Record, claim by claim, one field of the statement shape each claim call asks for (``"levels"``,
    ``"settle"``): the real statement still runs; the list fills as the loop claims."""
    sent: list[bool] = []
    shape = eng._claim_shape

    def spy(*args: Any) -> dict[str, Any]:
        out = shape(*args)
        sent.append(out[key])
        return out

    monkeypatch.setattr(eng, "_claim_shape", spy)
    return sent


def mark_done(engine: Engine, r: Any) -> bool:
    """The document's mark_done(): a fenced finalize; False = the lease was lost."""
    outcome = eng.Outcome(r.id, r.lease_version, "done")
    with engine.begin() as conn:
        return r.id in eng.finalize(conn, OUTBOX, [outcome])


# history: 118,000 finished rows, 2,000 ready, 100 leased; backlog: 120,000 ready rows, 100 leased; a small
# backlog of 20,000 (where the planner's crossover to a hash join over the table sits); busy: half of 120,000
# leased.
QUEUE_SHAPES = {
    "history": (120_000, "CASE WHEN g <= 118000 THEN 'done' WHEN g <= 118100 THEN '{active}' ELSE '{ready}' END",
                "CASE WHEN g <= 118000 THEN now() END"),
    "backlog": (120_000, "CASE WHEN g <= 100 THEN '{active}' ELSE '{ready}' END", "NULL"),
    "small backlog": (20_000, "CASE WHEN g <= 100 THEN '{active}' ELSE '{ready}' END", "NULL"),
    "busy": (120_000, "CASE WHEN g % 2 = 0 THEN '{active}' ELSE '{ready}' END", "NULL"),
}  # fmt: skip


@contextmanager
def queue_tables_shaped(engine: Engine, shape: str) -> Iterator[None]:
    """Fill both queue tables to one of QUEUE_SHAPES (analyzed, as the planner would see them); empty after."""
    rows, status, finished = QUEUE_SHAPES[shape]
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox, jobs RESTART IDENTITY"))
        ob = status.format(active="processing", ready="pending")
        conn.execute(
            text(
                f"""
                INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status, done_at,
                                    lease_until, attempts)
                SELECT 'order', 'agg-' || (g % 1000), 'E', '{{}}', {ob}, {finished},
                       CASE WHEN ({ob}) = 'processing' THEN now() + interval '1 minute' END,
                       CASE WHEN ({ob}) = 'processing' THEN 1 ELSE 0 END
                  FROM generate_series(1, :rows) AS g
                """
            ),
            {"rows": rows},
        )
        jb = status.format(active="running", ready="queued")
        conn.execute(
            text(
                f"""
                INSERT INTO jobs (task, queue, payload, status, finished_at, locked_at, attempts)
                SELECT 'noop', CASE WHEN g % 2 = 0 THEN 'default' ELSE 'mail' END, '{{}}', {jb}, {finished},
                       CASE WHEN ({jb}) = 'running' THEN now() END,
                       CASE WHEN ({jb}) = 'running' THEN 1 ELSE 0 END
                  FROM generate_series(1, :rows) AS g
                """
            ),
            {"rows": rows},
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE outbox"))
        conn.execute(text("VACUUM ANALYZE jobs"))
    try:
        yield
    finally:
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE outbox, jobs RESTART IDENTITY"))


def wait_for_lock_wait(engine: Engine, which: Any, timeout: float = 10.0) -> bool:
    """Whether, within ``timeout``, a backend of this database waits on a lock: the backend whose pid
    ``which()`` gives (None: not known yet), or, with ``which`` a wait event name ("advisory", …), any backend
    waiting on one of that kind."""
    import time

    deadline = time.monotonic() + timeout
    with engine.connect() as probe:
        while time.monotonic() < deadline:
            if isinstance(which, str):
                sql = (
                    "SELECT count(*) > 0 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND wait_event = :w AND datname = current_database()"
                )
                waiting = probe.execute(text(sql), {"w": which}).scalar()
            else:
                pid = which()
                waiting = (
                    pid is not None
                    and probe.execute(
                        text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :p"),
                        {"p": pid},
                    ).scalar()
                )
            probe.rollback()
            if waiting:
                return True
            time.sleep(0.01)
    return False


@contextmanager
def fresh_schema(engine: Engine, schema: str, metadata: MetaData | None = None) -> Iterator[None]:
    """A schema of the test's own: created empty (with ``metadata``'s tables, when given), dropped with all in
    it afterwards."""
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        conn.execute(text(f"CREATE SCHEMA {schema}"))
        if metadata is not None:
            metadata.create_all(conn)
    try:
        yield
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))


#: The rescue statement's parameters beyond a loop's options: one lease the loop holds (left alone) and no
#: expiry margin (``_steps.rescue``).
KEPT: dict[str, Any] = {"kept_ids": [3], "kept_versions": [1], "expired_for": timedelta(0)}
