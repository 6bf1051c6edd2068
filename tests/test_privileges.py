"""Least privilege: the documented grants are enough, and nothing more is needed.

Producer: ``GRANT INSERT, SELECT (id) ON outbox`` (SELECT on id for ``RETURNING id``) — and the same on jobs to
enqueue. Dispatcher: ``GRANT SELECT, UPDATE ON outbox`` (DELETE only for a role that purges). Worker:
``GRANT SELECT, UPDATE ON jobs``. No DDL, no sequence grants (identity columns need none).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.orm import Session

from sa_outbox import Dispatcher, Worker, enqueue
from sa_outbox.models import Job, OutboxEvent
from sa_outbox.monitoring import purge
from sa_outbox.testing import RecordingPublisher, drain

from .helpers import statuses

GRANTS = {
    "producer": ["GRANT INSERT, SELECT (id) ON outbox TO {r}", "GRANT INSERT, SELECT (id) ON jobs TO {r}"],
    "dispatcher": ["GRANT SELECT, UPDATE ON outbox TO {r}"],
    "worker": ["GRANT SELECT, UPDATE ON jobs TO {r}"],
}


@pytest.fixture
def roles(engine: Engine, db_url: URL) -> Iterator[dict[str, Engine]]:
    suffix = uuid.uuid4().hex[:6]
    names = {kind: f"sa_outbox_{kind}_{suffix}" for kind in GRANTS}
    engines: dict[str, Engine] = {}
    with engine.begin() as conn:
        for kind, role in names.items():
            conn.execute(text(f"CREATE ROLE {role} LOGIN"))
            conn.execute(text(f"GRANT USAGE ON SCHEMA public TO {role}"))
            for grant in GRANTS[kind]:
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
