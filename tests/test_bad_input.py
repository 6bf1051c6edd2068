"""Bad input and misconfiguration: a clear error naming the problem, and nothing written."""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
import threading
import time
from typing import Any

import pytest
from sqlalchemy import Engine, MetaData, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import DeclarativeBase, Session
from sqlalchemy.pool import NullPool

from sa_outbox import (
    ConfigurationError,
    Dispatcher,
    OutboxMixin,
    PayloadError,
    SchemaError,
    Worker,
    enqueue,
    enqueue_many,
)
from sa_outbox._cli import main
from sa_outbox.admin import update_jobs
from sa_outbox.models import Job, OutboxEvent
from sa_outbox.testing import RecordingPublisher

from .conftest import count_rows, migrated_database
from .helpers import row, seed_jobs


class _Other(DeclarativeBase):
    metadata = MetaData()


class NeverMigrated(OutboxMixin, _Other):
    __tablename__ = "never_migrated_outbox"


def test_missing_table_says_to_run_the_migration(engine: Engine) -> None:
    d = Dispatcher(engine, NeverMigrated, RecordingPublisher(), listen=False)
    with pytest.raises(
        SchemaError, match=r"(?s)table 'never_migrated_outbox' is missing .* run the migration"
    ):
        d.run_once()


def test_operator_calls_on_an_older_schema_raise_schema_error_naming_the_migration(server_url: URL) -> None:
    """A database at revision 0002: an operator call that needs a newer column or table raised the driver's
    UndefinedColumn (a review); it raises SchemaError naming the table, the migration and doctor, as the loops
    do — and changes nothing. (Calls that need only what 0002 has still work.)"""
    from sa_outbox import admin, monitoring

    calls: list[tuple[str, Any]] = [  # each needs a column or table 0002 does not have
        ("outbox", lambda e: admin.list_dead(e, OutboxEvent)),
        ("jobs", lambda e: admin.cancel_jobs(e, Job, ids=[1])),
        ("jobs", lambda e: admin.job_result(e, Job, 1)),
        ("jobs", lambda e: admin.pause_queue(e, Job, "mail")),
        ("jobs", lambda e: admin.resume_queue(e, Job, "mail")),
        ("jobs", lambda e: admin.list_queues(e, Job)),
        ("jobs", lambda e: monitoring.queue_status(e, Job)),
    ]
    with migrated_database(server_url, "0002", "sa_outbox_old") as (url, engine):
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO jobs (task, payload, status) VALUES ('t', '{}', 'failed')"))
        for i, (table, call) in enumerate(calls):
            with pytest.raises(SchemaError) as raised:
                call(engine)
            message = str(raised.value)
            assert message.startswith(f"table '{table}' is missing or incomplete (")
            assert "alembic upgrade head" in message and "sa-outbox doctor" in message, (i, message)

        async def through_an_async_bind() -> list[str]:  # the statement runs at the caller's await
            async_engine = create_async_engine(url, poolclass=NullPool)
            messages = []
            try:
                async with async_engine.connect() as conn:
                    for call in (admin.pause_queue, admin.resume_queue):
                        with pytest.raises(SchemaError) as raised:
                            await call(conn, Job, "mail")
                        messages.append(str(raised.value))
                        await conn.rollback()
                    with pytest.raises(SchemaError) as raised:
                        await admin.cancel_jobs(conn, Job, ids=[1])
                    messages.append(str(raised.value))
            finally:
                await async_engine.dispose()
            return messages

        for message in asyncio.run(through_an_async_bind()):
            assert message.startswith("table 'jobs' is missing or incomplete (") and "alembic" in message
        with engine.connect() as conn:
            assert conn.execute(text("SELECT status, priority FROM jobs")).one() == ("failed", 0)
        assert monitoring.queue_status(engine, OutboxEvent).counts["pending"] == 0


def _a_real_deadlock(engine: Engine) -> Exception:
    """The error PostgreSQL raises in the transaction it picks as a deadlock's victim."""
    from sqlalchemy import text

    errors: list[Exception] = []
    ready = threading.Barrier(2)

    def side(first: int, second: int) -> None:
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": 7_000_000 + first})
            ready.wait(10)
            try:
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": 7_000_000 + second})
            except Exception as exc:  # the victim
                errors.append(exc)
            conn.rollback()

    threads = [threading.Thread(target=side, args=pair) for pair in ((1, 2), (2, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(errors) == 1, errors
    return errors[0]


def test_a_retried_step_names_its_cause_a_deadlock_is_not_only_database_unavailable(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A deadlock (or a serialization failure) is retried like an outage, and the warning said only "database
    unavailable (OperationalError)" (a review read it as an outage). It now carries the server's words."""
    import logging

    from sa_outbox._base import RunPolicy

    deadlock = _a_real_deadlock(engine)
    log = logging.getLogger("sa_outbox.worker")
    with caplog.at_level("WARNING", logger="sa_outbox.worker"):
        RunPolicy(log, "w", None).failed(deadlock)
    [record] = caplog.records
    assert "deadlock detected" in record.getMessage() and "retrying in" in record.getMessage()


def test_database_unreachable_at_start_retries_then_fails_clearly(caplog: pytest.LogCaptureFixture) -> None:
    engine = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/nowhere")
    d = Dispatcher(engine, OutboxEvent, RecordingPublisher(), listen=False)
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="sa_outbox.dispatcher"), pytest.raises(ConfigurationError) as info:
        d.run(install_signal_handlers=False, startup_timeout=1.0)
    assert "database unreachable for 1s since start" in str(info.value) and "DATABASE_URL" in str(info.value)
    assert 1.0 <= time.monotonic() - started < 10
    assert sum("database unavailable" in r.getMessage() for r in caplog.records) >= 2  # retried with backoff
    engine.dispose()


def test_cli_target_that_does_not_exist(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dispatch", "tests.targets:no_such_thing"]) == 2
    assert "has no attribute 'no_such_thing'" in capsys.readouterr().err
    assert main(["worker", "no_such_module_xyz:thing"]) == 2
    assert "cannot import module 'no_such_module_xyz'" in capsys.readouterr().err
    assert main(["worker", "tests.targets:not_a_loop"]) == 2
    assert "expected a Worker" in capsys.readouterr().err


def test_the_cli_called_in_process_leaves_the_callers_signal_handlers_as_they_were() -> None:
    """A stopped CLI process ignores SIGTERM/SIGINT until it exits (``python -m sa_outbox``), but ``main``
    called in a caller's process must not: its later children would inherit the ignored SIGTERM (a test
    suite's fault run could no longer stop its loops)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    assert main(["worker", "tests.targets:not_a_loop"]) == 2
    assert main(["worker", "--processes", "2", "tests.targets:not_a_loop"]) == 2
    assert {s: signal.getsignal(s) for s in before} == before
    assert signal.SIG_IGN not in before.values()


def test_hanging_handler_times_out_as_retryable(engine: Engine) -> None:
    seed_jobs(engine, 1, task="hang")
    release = threading.Event()
    w = Worker(
        engine, Job, {"hang": lambda j: release.wait(10)}, handler_timeout=0.3, stale_after=5, listen=False
    )
    started = time.monotonic()
    assert w.run_once() == 1
    assert time.monotonic() - started < 3
    r = row(engine, "jobs", 1)
    assert (r.status, r.attempts) == (
        "queued",
        1,
    ) and "handler exceeded handler_timeout (0.3s)" in r.last_error
    release.set()
    w.close()


def test_handler_timeout_must_be_shorter_than_stale_after(engine: Engine) -> None:
    with pytest.raises(ConfigurationError, match="handler_timeout must be shorter than stale_after"):
        Worker(engine, Job, {}, handler_timeout=60, stale_after=60)


def test_negative_delays_are_refused() -> None:
    from sa_outbox import Backoff, Defer

    with pytest.raises(ConfigurationError, match=r"Defer.delay must be >= 0"):
        Defer(-1, "no")
    with pytest.raises(ConfigurationError, match="backoff base must be > 0"):
        Backoff(0, 10)


def test_hanging_publisher_times_out_as_retryable_when_enforced(engine: Engine) -> None:
    from sa_outbox import Message

    from .helpers import seed_events

    release = threading.Event()

    class Hangs:
        def publish(self, message: Message) -> None:
            release.wait(10)

    seed_events(engine, 1)
    d = Dispatcher(
        engine, OutboxEvent, Hangs(), listen=False, lease=5, publish_timeout=0.3, enforce_publish_timeout=True
    )
    started = time.monotonic()
    assert d.run_once() == 1
    assert time.monotonic() - started < 3
    r = row(engine, "outbox", 1)
    assert (r.status, r.attempts) == (
        "pending",
        1,
    ) and "publish exceeded publish_timeout (0.3s)" in r.last_error
    release.set()


def test_sync_loops_refuse_async_handlers_and_publishers(engine: Engine) -> None:
    """An ``async def`` handler under the sync Worker would return a coroutine nobody awaits — the job
    marked done without running. Refused at construction and at registration, naming the async class."""
    from sa_outbox import Message

    async def send(job: Any) -> None: ...

    with pytest.raises(ConfigurationError, match=r"'send' is async.*AsyncWorker"):
        Worker(engine, Job, {"send": send})

    class AsyncCallable:
        async def __call__(self, job: Any) -> None: ...

    with pytest.raises(ConfigurationError, match=r"'obj' is async.*AsyncWorker"):
        Worker(engine, Job, {"obj": AsyncCallable()})
    w = Worker(engine, Job, {}, listen=False)
    with pytest.raises(ConfigurationError, match=r"'late' is async.*AsyncWorker"):
        w.task("late")(send)

    class AsyncPublisher:
        async def publish(self, message: Message) -> None: ...

    with pytest.raises(ConfigurationError, match=r"async.*AsyncDispatcher"):
        Dispatcher(engine, OutboxEvent, AsyncPublisher())


def test_a_handler_returning_an_awaitable_is_never_marked_done(engine: Engine) -> None:
    """A plain function that returns a coroutine (a lambda around an async one) slips past the constructor
    check; its job is retried with the reason, never marked done unrun."""
    seed_jobs(engine, 1, task="wrapped")

    async def send(job: Any) -> None:
        raise AssertionError("never awaited by the sync worker")

    w = Worker(engine, Job, {"wrapped": lambda job: send(job)}, listen=False)
    assert w.run_once() == 1
    r = row(engine, "jobs", 1)
    assert r.status == "queued" and r.attempts == 1
    assert "returned an awaitable" in r.last_error and "AsyncWorker" in r.last_error
    w.close()


# --- text and numbers the database cannot hold (a hostile review: raw DataError / OverflowError) -----------

LONE = "broken \ud83d emoji"  # half a surrogate pair: a Python str may hold it, UTF-8 and jsonb cannot


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: enqueue(s, Job, "t", {"text": LONE}), r"payload refused: a lone surrogate character \(\\ud83d\)"),
        (lambda s: enqueue(s, Job, "t", {LONE: 1}), r"lone surrogate character \(\\ud83d\)"),
        (lambda s: enqueue_many(s, Job, [("t", {"a": [LONE]})]), r"jobs\[0\].*lone surrogate"),
        (lambda s: enqueue_many(s, Job, [{"task": "t", "payload": {}, "concurrency_key": "a\x00b"}]),
         r"jobs\[0\].*concurrency_key contains a NUL character"),
        (lambda s: enqueue_many(s, Job, [{"task": "t", "payload": {}, "concurrency_key": LONE}]),
         r"concurrency_key is not valid Unicode"),
        (lambda s: enqueue(s, Job, LONE, {}), "task is not valid Unicode"),
        (lambda s: enqueue(s, Job, "t", {}, concurrency_key="a\x00b"), "concurrency_key contains a NUL"),
        (lambda s: s.add(Job(task="t", payload={}, concurrency_key=LONE)), "concurrency_key is not valid Unicode"),
        (lambda s: enqueue(s, Job, "t", {}, headers={"x-note": LONE}), "x-note.*is not valid Unicode"),
        (lambda s: s.add(OutboxEvent(aggregate_type="a", aggregate_id=LONE, event_type="E", payload={})),
         "aggregate_id is not valid Unicode"),
        (lambda s: s.add(OutboxEvent(aggregate_type="a", aggregate_id="1", event_type="E", payload={"x": LONE})),
         "lone surrogate"),
    ],
    ids=["payload", "payload-key", "bulk-payload", "concurrency-key-nul", "concurrency-key", "task",
         "enqueue-concurrency-key-nul", "orm-concurrency-key", "header",
         "aggregate-id", "event-payload"],
)  # fmt: skip
def test_text_that_is_not_valid_unicode_is_refused_before_any_sql(
    engine: Engine, call: Any, message: str
) -> None:
    with Session(engine) as s, pytest.raises(PayloadError, match=message), s.begin():
        call(s)
        s.flush()
    assert count_rows(engine, "jobs") == count_rows(engine, "outbox") == 0


def test_a_payload_nested_thousands_of_levels_deep_is_a_payload_error(engine: Engine) -> None:
    deep: Any = {}
    for _ in range(5000):
        deep = {"x": deep}
    for call in (lambda s: enqueue(s, Job, "t", deep), lambda s: s.add(OutboxEvent(
            aggregate_type="a", aggregate_id="1", event_type="E", payload=[deep]))):  # fmt: skip
        with Session(engine) as s, pytest.raises(PayloadError, match="nested too deeply"), s.begin():
            call(s)
            s.flush()
    assert count_rows(engine, "jobs") == count_rows(engine, "outbox") == 0


def test_a_payload_with_a_surrogate_pair_or_escaped_text_is_kept() -> None:
    """The check refuses only a lone surrogate: a whole pair (an emoji), the text "\\ud83d" itself (escaped
    backslash) and other escapes pass."""
    from sa_outbox._payload import encode_payload

    for fine in ({"e": "ok \U0001f600"}, {"e": "\\ud83d"}, {"e": "\\\\\ud83d\ude00"}, {"e": "\u00e9\u2028"}):
        encode_payload(fine, what="p")
    with pytest.raises(PayloadError, match="lone surrogate"):
        encode_payload({"e": "\\\ud83d"}, what="p")  # a backslash, then a lone surrogate
    with pytest.raises(PayloadError, match=r"lone surrogate character \(\\udc00\)"):
        encode_payload({"e": "\U0001f600\U0001f600\udc00"}, what="p")  # named, after two emoji
    encode_payload({"e": "\ud83d\ude00"}, what="p")  # a pair held as two code points: jsonb stores the emoji


@pytest.mark.parametrize(
    "call",
    [
        lambda s: enqueue(s, Job, "t", {}, run_at=dt.timedelta(days=10**8)),
        lambda s: enqueue(s, Job, "t", {}, run_at=1e300),
        lambda s: enqueue_many(s, Job, [{"task": "t", "payload": {}, "run_at": 1e300}]),
        lambda s: enqueue_many(s, Job, [{"task": "t", "payload": {}, "unique_key": "k", "on_conflict": "debounce",
                                         "debounce": 1, "max_delay": 1e300}]),
    ],
    ids=["timedelta", "seconds", "bulk", "max-delay"],
)  # fmt: skip
def test_a_delay_beyond_a_thousand_years_is_refused_before_any_sql(engine: Engine, call: Any) -> None:
    with (
        Session(engine) as s,
        pytest.raises((ConfigurationError, PayloadError), match=r"at most 365,000 days"),
        s.begin(),
    ):
        call(s)
        s.flush()
    assert count_rows(engine, "jobs") == 0


def test_update_jobs_refuses_max_attempts_beyond_the_column(engine: Engine) -> None:
    seed_jobs(engine, 1)
    with pytest.raises(ConfigurationError, match="max_attempts must be a 32-bit integer"):
        update_jobs(engine, Job, ids=[1], max_attempts=2**31)
    assert row(engine, "jobs", 1).max_attempts == 10


@pytest.mark.parametrize(
    "args",
    [
        ["jobs", "update", "--all", "--run-in", "99999999999d"],
        ["purge", "--older-than", "99999999999d"],
        ["dead", "retry", "--jobs", "--all", "--older-than", "300000000d"],
        ["status", "--stale-after", "99999999999d"],
    ],
)
def test_the_cli_refuses_a_huge_duration_in_one_line(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*args, "--url", "postgresql+psycopg://nobody@127.0.0.1:1/none"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "at most 365,000 days (about 1,000 years)" in err and "Traceback" not in err
