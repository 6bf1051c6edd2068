"""Operator actions on dead letters select their rows once and report exactly what they changed, also while
dispatchers keep dead-lettering messages under them."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL

from sa_outbox import Dispatcher, PermanentError
from sa_outbox.admin import list_dead, retry_dead, skip_dead
from sa_outbox.errors import ConfigurationError
from sa_outbox.models import OutboxEvent

from .helpers import seed_events, statuses


def seed_dead(engine: Engine, n: int) -> None:
    """n dead messages (ids 1..n), written dead in one statement: the running dispatchers never see them
    pending."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status, attempts, "
                "last_error) SELECT 'order', 'agg-' || g, 'E', '{}', 'dead', 1, 'broken' "
                "FROM generate_series(1, :n) AS g"
            ),
            {"n": n},
        )


class FailingPublisher:
    """Fails every message permanently (straight back to dead) and counts publishes per message id."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: collections.Counter[int] = collections.Counter()

    def publish(self, message: Any) -> None:
        with self.lock:
            self.calls[message.id] += 1
        raise PermanentError("the destination still refuses it")


@pytest.fixture
def dispatchers(engine: Engine) -> Iterator[tuple[FailingPublisher, threading.Event]]:
    """Four dispatcher threads (each with its own connection) whose publisher fails permanently; they run
    until the test sets the event, or 60 s at most."""
    publisher = FailingPublisher()
    stop = threading.Event()

    def run() -> None:
        d = Dispatcher(engine, OutboxEvent, publisher, listen=False, batch=10, poll_interval=0.05)
        deadline = time.monotonic() + 60
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                if d.run_once() == 0:
                    time.sleep(0.005)
        finally:
            d.close()

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        yield publisher, stop
    finally:
        stop.set()
        for t in threads:
            t.join(30)


@pytest.fixture
def command_engine(db_url: URL) -> Iterator[Engine]:
    """The operator command's own engine, so that a listener can watch only its statements."""
    engine = create_engine(db_url)
    yield engine
    engine.dispose()


def _wait_between_batches(
    command_engine: Engine, engine: Engine, stop: threading.Event, limit: int
) -> list[int]:
    """Before each UPDATE of the command after the first, wait (bounded) until the dispatchers have
    dead-lettered again every row the command already requeued: the worst interleaving, made deterministic.
    After ``limit`` batches the dispatchers are stopped so that a command that never ends still ends."""
    batches = [0]

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not statement.lstrip().upper().startswith("UPDATE"):
            return
        batches[0] += 1
        if batches[0] > limit:
            stop.set()
            return
        deadline = time.monotonic() + 10
        while batches[0] > 1 and time.monotonic() < deadline and not stop.is_set():
            with engine.connect() as c:
                waiting = c.execute(
                    text(
                        "SELECT count(*) FROM outbox WHERE status <> 'dead' "
                        "AND last_error LIKE '%requeued by operator%'"
                    )
                ).scalar_one()
            if waiting == 0:
                return
            time.sleep(0.01)

    event.listen(command_engine, "before_cursor_execute", before)
    return batches


def test_dead_retry_selects_its_rows_once_while_dispatchers_dead_letter_them_again(
    engine: Engine,
    command_engine: Engine,
    dispatchers: tuple[FailingPublisher, threading.Event],
) -> None:
    publisher, stop = dispatchers
    seed_dead(engine, 200)
    dry = retry_dead(command_engine, OutboxEvent, all=True, batch_size=20, dry_run=True)
    batches = _wait_between_batches(command_engine, engine, stop, limit=30)
    requeued = retry_dead(command_engine, OutboxEvent, all=True, batch_size=20)
    stop.set()
    assert len(requeued) == len(set(requeued)), "a row was requeued twice by one command"
    assert requeued == dry == list(range(1, 201))  # the dry run and the real run report the same set
    assert batches[0] <= 11  # 10 batches of 20 (+ at most one that finds nothing): it ends by itself
    assert max(publisher.calls.values()) == 1  # each message went out once per retry, not thousands of times


def test_dead_skip_leaves_rows_dead_lettered_after_it_started(
    engine: Engine,
    command_engine: Engine,
    dispatchers: tuple[FailingPublisher, threading.Event],
) -> None:
    publisher, stop = dispatchers
    seed_dead(engine, 100)
    seen = [0]

    def seed_more(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # After the first batch, more messages fail while the command runs: they were not selected.
        if statement.lstrip().upper().startswith("UPDATE"):
            seen[0] += 1
            if seen[0] == 2:
                seed_events(engine, 100, start=100)
                # (until the dispatchers have dead-lettered all of them: none pending, and none claimed and not
                # yet written — clean-clone CI once checked with the last batch of 10 still processing)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and {"pending", "processing"} & statuses(engine).keys():
                    time.sleep(0.01)

    event.listen(command_engine, "before_cursor_execute", seed_more)
    skipped = skip_dead(command_engine, OutboxEvent, all=True, batch_size=20)
    stop.set()
    assert skipped == list(range(1, 101))
    assert statuses(engine) == {"done": 100, "dead": 100}  # the later dead letters still wait for a person
    assert publisher.calls.keys() == set(range(101, 201))


# --- bad input: refused before any SQL, with a message naming the problem (issue #17, item 7) ---------------


@pytest.mark.timeout(60)  # a batch size of 0 used to loop forever
@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True])
def test_dead_retry_and_skip_refuse_a_batch_size_below_one(engine: Engine, batch_size: Any) -> None:
    seed_events(engine, 3)
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 'dead' WHERE id = 1"))
    for action in (retry_dead, skip_dead):
        with pytest.raises(ConfigurationError, match=r"batch_size must be an integer >= 1"):
            action(engine, OutboxEvent, all=True, batch_size=batch_size)
    assert statuses(engine) == {"dead": 1, "pending": 2}  # nothing half-written


@pytest.mark.parametrize("limit", [0, -5])
def test_dead_list_refuses_a_limit_below_one(engine: Engine, limit: int) -> None:
    with pytest.raises(ConfigurationError, match=r"limit must be an integer >= 1"):
        list_dead(engine, OutboxEvent, limit=limit)


def test_an_empty_error_filter_is_refused_instead_of_matching_every_dead_row(engine: Engine) -> None:
    seed_events(engine, 2)
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 'dead', last_error = 'boom'"))
    with pytest.raises(ConfigurationError, match="error_contains must be a non-empty string"):
        retry_dead(engine, OutboxEvent, error_contains="")
    with pytest.raises(ConfigurationError, match="event_type must be a non-empty string"):
        skip_dead(engine, OutboxEvent, event_type=7)
    assert statuses(engine) == {"dead": 2}


def test_ids_given_as_one_string_are_refused_instead_of_read_digit_by_digit(engine: Engine) -> None:
    seed_events(engine, 12)
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 'dead'"))
    with pytest.raises(ConfigurationError, match="ids must be a collection of integers"):
        retry_dead(engine, OutboxEvent, ids="12")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="ids must be integers"):
        retry_dead(engine, OutboxEvent, ids=["12"])  # type: ignore[list-item]
    assert statuses(engine) == {"dead": 12}
