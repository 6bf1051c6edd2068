"""Least privilege: the documented grants are enough, and nothing more is needed.

Producer: ``GRANT INSERT, SELECT (id) ON outbox`` (SELECT on id for ``RETURNING id``) — and the same on jobs to
enqueue. Dispatcher: ``GRANT SELECT, UPDATE ON outbox`` (DELETE only for a role that purges). Worker:
``GRANT SELECT, UPDATE ON jobs``. No DDL, no sequence grants (identity columns need none).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.orm import Session

from sa_outbox import Dispatcher, Limit, Schedule, Worker, enqueue, enqueue_many, sync_schedules
from sa_outbox.models import Job, JobSchedule, OutboxEvent
from sa_outbox.monitoring import purge
from sa_outbox.testing import RecordingPublisher, drain

from .helpers import statuses

GRANTS = {
    "producer": ["GRANT INSERT, SELECT (id) ON outbox TO {r}", "GRANT INSERT, SELECT (id) ON jobs TO {r}"],
    "dispatcher": ["GRANT SELECT, UPDATE ON outbox TO {r}"],
    "worker": ["GRANT SELECT, UPDATE ON jobs TO {r}"],
}


#: What the capabilities beyond the basics add (docs/production.md): unique keys for a producer, a rate limit
#: and cron schedules for a worker.
MORE_GRANTS = {
    "producer": [
        # SELECT on the whole table: replace/debounce tell an update from an insert by the row's xmax, a
        # system column no column grant covers
        "GRANT INSERT, SELECT, UPDATE (task, queue, payload, priority, run_at, max_attempts, headers, "
        "concurrency_key) ON jobs TO {r}",
    ],
    "worker": [
        "GRANT SELECT, UPDATE ON jobs TO {r}",
        "GRANT SELECT, INSERT, DELETE ON jobs_starts TO {r}",
        "GRANT INSERT ON jobs TO {r}",
        "GRANT SELECT, UPDATE ON schedules TO {r}",
    ],
}


@pytest.fixture
def roles(engine: Engine, db_url: URL) -> Iterator[dict[str, Engine]]:
    yield from _roles(engine, db_url, GRANTS)


@pytest.fixture
def more_roles(engine: Engine, db_url: URL) -> Iterator[dict[str, Engine]]:
    yield from _roles(engine, db_url, MORE_GRANTS)


def _roles(engine: Engine, db_url: URL, grants: dict[str, list[str]]) -> Iterator[dict[str, Engine]]:
    suffix = uuid.uuid4().hex[:6]
    names = {kind: f"sa_outbox_{kind}_{suffix}" for kind in grants}
    engines: dict[str, Engine] = {}
    with engine.begin() as conn:
        for kind, role in names.items():
            conn.execute(text(f"CREATE ROLE {role} LOGIN"))
            conn.execute(text(f"GRANT USAGE ON SCHEMA public TO {role}"))
            for grant in grants[kind]:
                conn.execute(text(grant.format(r=role)))
    for kind, role in names.items():
        engines[kind] = create_engine(db_url.set(username=role, password=None))
    yield engines
    for e in engines.values():
        e.dispose()
    with engine.begin() as conn:
        for role in names.values():
            conn.execute(
                text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'")
            )
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))


def test_documented_grants_are_enough_and_no_more_is_given(engine: Engine, roles: dict[str, Engine]) -> None:
    with Session(roles["producer"]) as s, s.begin():
        s.add(OutboxEvent(aggregate_type="order", aggregate_id="1", event_type="E", payload={}))
        s.add(
            OutboxEvent(
                aggregate_type="order",
                aggregate_id="1",
                event_type="E",
                payload={},
                available_at=None or text("now()"),
            )
        )
        enqueue(s, Job, "t", {})
    pub = RecordingPublisher()
    assert drain(Dispatcher(roles["dispatcher"], OutboxEvent, pub, listen=False)) == 2
    assert drain(Worker(roles["worker"], Job, {"t": lambda j: None}, listen=False)) == 1
    assert statuses(engine) == {"done": 2} and statuses(engine, "jobs") == {"done": 1}
    # ... and nothing beyond them: the producer cannot change rows, the dispatcher cannot delete.
    with pytest.raises(ProgrammingError, match="permission denied"), roles["producer"].begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 'done'"))
    with pytest.raises(ProgrammingError, match="permission denied"):
        purge(roles["dispatcher"], OutboxEvent, older_than=0)


def test_unique_keys_rate_limits_and_schedules_work_with_their_documented_grants(
    engine: Engine, more_roles: dict[str, Engine]
) -> None:
    producer, worker_engine = more_roles["producer"], more_roles["worker"]
    with Session(producer) as s, s.begin():
        assert enqueue(s, Job, "t", {"n": 1}, unique_key="k1").inserted
        assert not enqueue(s, Job, "t", {"n": 2}, unique_key="k1").inserted  # skip
        enqueue(s, Job, "t", {"n": 3}, unique_key="k2", on_conflict="replace")
        enqueue(s, Job, "t", {"n": 4}, unique_key="k2", on_conflict="replace")
        enqueue(s, Job, "t", {"n": 5}, unique_key="k3", on_conflict="debounce", debounce=0.01, max_delay=60)
        enqueue_many(s, Job, [{"task": "t", "payload": {"n": 6}, "unique_key": "k4"}, ("t", {"n": 7})])
    sync_schedules(engine, JobSchedule, [Schedule("every-minute", "* * * * *", task="t")])
    with engine.begin() as conn:  # due now
        conn.execute(text("UPDATE schedules SET next_run_at = now() - interval '1 second'"))
    seen: list[Any] = []
    worker = Worker(
        worker_engine, Job, {"t": lambda j: seen.append(j.payload)}, listen=False, schedules=JobSchedule,
        limits={"default": Limit(rate="1000/s")},
    )  # fmt: skip
    assert drain(worker) == 6  # k1, k2 (replaced), k3, k4, the plain one, the schedule's job
    assert {"n": 4} in seen and {"n": 2} not in seen and {"n": 3} not in seen
    assert statuses(engine, "jobs") == {"done": 6}


def test_a_worker_denied_the_schedules_table_says_so_and_fires_once_granted(
    engine: Engine, roles: dict[str, Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """Permission denied is not "the table is missing": the worker names the error and tries again at its
    next maintenance step (it used to turn cron off for the life of the process)."""
    sync_schedules(engine, JobSchedule, [Schedule("every-minute", "* * * * *", task="t")])
    with engine.begin() as conn:
        conn.execute(text("UPDATE schedules SET next_run_at = now() - interval '1 second'"))
    worker = Worker(roles["worker"], Job, {"t": lambda j: None}, listen=False, schedules=JobSchedule)
    worker.run_once()
    assert worker.schedules is JobSchedule
    assert any("permission denied for table schedules" in r.getMessage() for r in caplog.records)
    assert not any("is missing" in r.getMessage() for r in caplog.records)
    role = roles["worker"].url.username
    with engine.begin() as conn:
        conn.execute(text(f"GRANT SELECT, UPDATE ON schedules TO {role}"))
        conn.execute(text(f"GRANT INSERT ON jobs TO {role}"))
    worker.run_once()
    assert statuses(engine, "jobs") == {"done": 1}  # the slot's job, fired and run now


def test_a_consumer_with_the_documented_inbox_grants_gets_every_receipt(engine: Engine, db_url: URL) -> None:
    """docs/production.md: ``GRANT INSERT, SELECT, UPDATE (position, received_at) ON inbox`` — enough for
    NEW, DUPLICATE and STALE, with and without ``aggregate=`` (a stale receipt's record is undone with a
    savepoint, not deleted: no DELETE grant)."""
    from sa_outbox import Receipt, receive
    from sa_outbox.models import Inbox

    with engine.begin() as conn:
        conn.execute(text("TRUNCATE inbox"))
    grants = {"consumer": ["GRANT INSERT, SELECT, UPDATE (position, received_at) ON inbox TO {r}"]}
    for engines in _roles(engine, db_url, grants):
        consumer = engines["consumer"]
        got = []
        for message_id, position in (
            ("a", 10),
            ("a", 20),
            ("b", 5),
            ("c", 30),
            ("plain", None),
            ("plain", None),
        ):
            with Session(consumer) as s, s.begin():
                aggregate = None if position is None else "order-1"
                got.append(receive(s, Inbox, "billing", message_id, aggregate=aggregate, position=position))
        assert got == [
            Receipt.NEW,
            Receipt.DUPLICATE,
            Receipt.STALE,
            Receipt.NEW,
            Receipt.NEW,
            Receipt.DUPLICATE,
        ]
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT message_id FROM inbox WHERE consumer = 'billing' ORDER BY 1")
        ).scalars()
        assert list(rows) == ["a", "c", "plain", "sa_outbox:head:order-1"]
