"""The two-connection commit-order shape shared by the producer tests (deterministic, no timed assertions).

T1 writes an event for an aggregate and keeps its transaction open; T2, on its own connection, writes one for
the same aggregate and commits. With the aggregate lock T2 waits on a lock until T1 commits, so the
aggregate's id order is its commit order (what the ordered claim relies on); without it T2 commits first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

Write = Callable[[Session, int], None]


@dataclass
class Race:
    t2_waited_on_a_lock: bool
    commits: list[str]


def backend_pid(session: Session) -> int:
    pid = session.connection().execute(text("SELECT pg_backend_pid()")).scalar_one()
    return int(pid)


def backend_waits_on(engine: Engine, app: str, blocker: int) -> bool:
    """Whether the backend named ``app`` waits on a lock that backend ``blocker`` holds.

    Not any lock: T2 can wait a moment on locks that have nothing to do with T1 — the cluster-wide lock a
    committing NOTIFY takes while another database's transaction commits its own, a relation extension lock
    autovacuum holds — and such a wait says nothing about the aggregate lock (CI once saw one without it)."""
    with engine.connect() as conn:
        found = conn.execute(
            text(
                "SELECT 1 FROM pg_stat_activity WHERE application_name = :a"
                " AND CAST(:b AS integer) = ANY(pg_blocking_pids(pid))"
            ),
            {"a": app, "b": blocker},
        ).first()
    return found is not None


def wait_until_waiting_or_done(
    engine: Engine, app: str, done: threading.Event, blocker: int, timeout: float = 15.0
) -> bool:
    """Poll until the backend named ``app`` waits on a lock held by backend ``blocker`` (True) or its thread
    finished (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if backend_waits_on(engine, app, blocker):
            return True
        if done.is_set():
            return False
        time.sleep(0.02)
    raise AssertionError(f"{app} neither waited on backend {blocker}'s lock nor finished within {timeout}s")


def race(
    engine: Engine,
    write: Write,
    *,
    app: str,
    session_factory: Callable[[Engine], Session] = Session,
    first: Write | None = None,
) -> Race:
    """T1 runs ``first`` (default ``write``) with 1 and flushes; T2 runs ``write`` with 2 and commits.

    A commit is recorded under a mutex that T1 holds across its own commit, so the recorded order is the real
    commit order even when T2's commit returns before T1's thread records its own.
    """
    commits: list[str] = []
    record = threading.Lock()
    done = threading.Event()
    errors: list[BaseException] = []

    def t2() -> None:
        try:
            with session_factory(engine) as s:
                s.connection().execute(text("SELECT set_config('application_name', :a, true)"), {"a": app})
                write(s, 2)
                s.commit()
                with record:
                    commits.append("T2")
        except BaseException as exc:  # reported by the caller's thread
            errors.append(exc)
        finally:
            done.set()

    with session_factory(engine) as s1:
        (first or write)(s1, 1)
        s1.flush()
        t1 = backend_pid(s1)
        thread = threading.Thread(target=t2)
        thread.start()
        waited = wait_until_waiting_or_done(engine, app, done, t1)
        with record:
            s1.commit()
            commits.append("T1")
    thread.join(15)
    assert not thread.is_alive()
    if errors:
        raise errors[0]
    return Race(waited, commits)


def ids_by_payload(engine: Engine, table: str = "outbox") -> dict[int, int]:
    """Event id by ``payload->>'n'`` (the newest row of each n)."""
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT id, payload->>'n' FROM {table} ORDER BY id"))
        return {int(n): int(i) for i, n in rows}


def assert_serialised(
    engine: Engine,
    first: Write,
    second: Write,
    *,
    app: str,
    session_factory: Callable[[Engine], Session] = Session,
) -> None:
    """T1 writes with ``first`` (payload n=1) and holds its transaction; T2 writes with ``second`` (n=2): T2
    waits on a lock, commits after T1, and its event has the larger id."""
    result = race(engine, second, first=first, app=app, session_factory=session_factory)
    assert result.t2_waited_on_a_lock and result.commits == ["T1", "T2"]
    ids = ids_by_payload(engine)
    assert ids[1] < ids[2]
