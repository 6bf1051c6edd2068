"""Bad input and misconfiguration: a clear error naming the problem, and nothing written."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest
from sqlalchemy import Engine, MetaData, create_engine
from sqlalchemy.orm import DeclarativeBase

from sa_outbox import ConfigurationError, Dispatcher, OutboxMixin, SchemaError, Worker
from sa_outbox._cli import main
from sa_outbox.models import Job, OutboxEvent
from sa_outbox.testing import RecordingPublisher

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
