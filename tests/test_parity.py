"""One behaviour suite for the sync classes and their asyncio twins (AsyncDispatcher, AsyncWorker)."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from sa_outbox import (
    AsyncDispatcher,
    AsyncWorker,
    ClaimedJob,
    ConfigurationError,
    Defer,
    Message,
    PermanentError,
    RetryableError,
    enqueue,
)
from sa_outbox.models import Job, OutboxEvent
from sa_outbox.testing import RecordingPublisher

from .factories import FAST, Runner, expire_leases, make_due
from .helpers import claim_jobs, row, seed_events, seed_jobs, statuses


def test_dispatch_each_message_once_and_done(runner: Runner, engine: Engine) -> None:
    seed_events(engine, 30)
    pub = RecordingPublisher()
    assert runner.drain(runner.dispatcher(pub, batch=7)) == 30
    assert sorted(pub.ids) == list(range(1, 31)) and statuses(engine) == {"done": 30}


def test_failure_classes(runner: Runner, engine: Engine) -> None:
    seed_events(engine, 3)

    def fail(m: Message) -> BaseException | None:
        return {
            1: RetryableError("timeout"),
            2: Defer(timedelta(minutes=1), "later"),
            3: PermanentError("422"),
        }[m.id]

    d = runner.dispatcher(RecordingPublisher(fail=fail), max_attempts=2)
    assert runner.run_once(d) == 3
    assert (row(engine, "outbox", 1).status, row(engine, "outbox", 1).attempts) == ("pending", 1)
    assert (row(engine, "outbox", 2).status, row(engine, "outbox", 2).attempts) == ("pending", 0)
    assert row(engine, "outbox", 3).status == "dead"
    make_due(engine, "outbox", ids=[1])  # the retry's backoff has passed (the Defer's minute has not)
    assert runner.run_once(d) == 1
    assert (row(engine, "outbox", 1).status, row(engine, "outbox", 1).attempts) == ("dead", 2)


def test_ordered_claim_heads_only(runner: Runner, engine: Engine) -> None:
    seed_events(engine, 3, aggregate="X")
    seed_events(engine, 2, aggregate="Y")
    pub = RecordingPublisher()
    d = runner.dispatcher(pub, ordered=True)
    assert runner.run_once(d) == 2 and pub.ids == [1, 4]
    runner.drain(d)
    assert pub.ids == [1, 4, 2, 5, 3]


def test_async_publisher_is_awaited(runner: Runner, engine: Engine) -> None:
    seed_events(engine, 5)
    got: list[int] = []

    class AsyncPub:
        async def publish(self, message: Message) -> None:
            await asyncio.sleep(0)
            got.append(message.id)

    class SyncPub:
        def publish(self, message: Message) -> None:
            got.append(message.id)

    runner.drain(runner.dispatcher(AsyncPub() if runner.kind == "async" else SyncPub()))
    assert sorted(got) == [1, 2, 3, 4, 5]


def test_worker_outcomes_and_unknown_task(runner: Runner, engine: Engine) -> None:
    seed_jobs(engine, 2, task="ok")
    seed_jobs(engine, 1, task="boom")
    seed_jobs(engine, 1, task="nobody")
    seen: list[int] = []

    async def ok_async(job: ClaimedJob) -> None:
        seen.append(job.id)

    def ok_sync(job: ClaimedJob) -> None:
        seen.append(job.id)

    def boom(job: ClaimedJob) -> None:
        raise RetryableError("later")

    w = runner.worker(
        {"ok": ok_async if runner.kind == "async" else ok_sync, "boom": boom},
        backoff=FAST,
        unknown_task_grace=0,
    )
    assert runner.run_once(w) == 4
    assert sorted(seen) == [1, 2]
    assert row(engine, "jobs", 3).status == "queued" and row(engine, "jobs", 3).attempts == 1
    assert (
        row(engine, "jobs", 4).status == "failed"
        and "no handler registered" in row(engine, "jobs", 4).last_error
    )


def test_worker_reaps_stale_jobs(runner: Runner, engine: Engine) -> None:
    seed_jobs(engine, 1)
    with engine.begin() as conn:
        [old] = claim_jobs(conn, "crashed")
    expire_leases(engine, "jobs")
    done: list[int] = []
    w = runner.worker({"noop": lambda j: done.append(j.lease_version)}, stale_after=0.2)
    runner.run_once(w)
    runner.run_once(w)
    assert done == [old.lease_version + 1]
    assert row(engine, "jobs", 1).status == "done"


def test_idle_loop_wakes_on_notify(runner: Runner, engine: Engine) -> None:
    seen = threading.Event()
    w = runner.worker({"t": lambda j: seen.set()}, listen=True, poll_interval=10)
    thread = runner.run_in_thread(w)
    try:
        time.sleep(0.5)
        t0 = time.perf_counter()
        with Session(engine) as s, s.begin():
            enqueue(s, Job, "t", {})
        assert seen.wait(5)
        assert time.perf_counter() - t0 < 2.0  # well under the 10 s poll interval
    finally:
        if runner.loop is not None:
            runner.loop.call_soon_threadsafe(w.stop)
        else:
            w.stop()
        thread.join(15)
    assert not thread.is_alive()


def test_async_classes_refuse_a_sync_engine(engine: Engine) -> None:
    with pytest.raises(ConfigurationError, match="AsyncEngine"):
        AsyncDispatcher(engine, OutboxEvent, RecordingPublisher())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="AsyncEngine"):
        AsyncWorker(engine, Job, {})  # type: ignore[arg-type]


def test_hot_path_goes_straight_to_the_driver_unless_observed(
    runner: Runner, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sync and async loops send claim/finalize straight to psycopg (compiled once, prepared); with a
    before_cursor_execute listener on the engine they go through SQLAlchemy, where the listener sees them."""
    from sqlalchemy import event

    from sa_outbox import _execute

    direct: list[str] = []
    real = _execute._compiled

    def counting(stmt: Any, conn: Any) -> Any:
        found = real(stmt, conn)
        direct.append(found.sql)
        return found

    monkeypatch.setattr(_execute, "_compiled", counting)
    seed_events(engine, 10)
    assert runner.drain(runner.dispatcher(RecordingPublisher(), batch=5)) == 10
    assert any("SKIP LOCKED" in st for st in direct), direct

    direct.clear()
    seen: list[str] = []
    observed = runner.aengine.sync_engine if runner.aengine else engine
    listener = lambda conn, cur, st, *rest: seen.append(st)  # noqa: E731
    event.listen(observed, "before_cursor_execute", listener)
    try:
        seed_events(engine, 10, start=11)
        assert runner.drain(runner.dispatcher(RecordingPublisher(), batch=5)) == 10
    finally:
        event.remove(observed, "before_cursor_execute", listener)
    assert direct == [] and any("SKIP LOCKED" in st for st in seen)
    assert statuses(engine) == {"done": 20}


def test_a_statement_without_rows_runs_on_the_observed_path_too(engine: Engine) -> None:
    """The regular path (a listener is attached) returns [] for a statement that returns no rows (a DELETE
    without RETURNING), as the driver path does, instead of failing to iterate its result."""
    from sqlalchemy import delete, event

    from sa_outbox import _execute

    seed_events(engine, 2)
    seen: list[str] = []
    listener = lambda conn, cur, st, *rest: seen.append(st)  # noqa: E731
    event.listen(engine, "before_cursor_execute", listener)
    try:
        with engine.begin() as conn:
            assert _execute.run(conn, delete(OutboxEvent.__table__), {}) == []
    finally:
        event.remove(engine, "before_cursor_execute", listener)
    assert any(st.startswith("DELETE") for st in seen) and statuses(engine) == {}


@pytest.mark.parametrize("method", ["publish", "publish_many"])
def test_sync_publishers_never_block_the_event_loop(engine: Engine, async_url: URL, method: str) -> None:
    """A blocking publisher (pika, a sync HTTP client) under AsyncDispatcher runs off the event loop: other
    tasks keep running while it blocks; messages still go out in id order."""
    seed_events(engine, 6)
    order: list[int] = []

    class Blocking:
        def publish(self, message: Message) -> None:
            time.sleep(0.05)
            order.append(message.id)

    class BlockingBatch:
        def publish(self, message: Message) -> None:
            raise AssertionError("a batch publisher gets its batches through publish_many")

        def publish_many(self, messages: list[Message]) -> list[BaseException | None]:
            time.sleep(0.3)
            order.extend(m.id for m in messages)
            return [None] * len(messages)

    runner = Runner("async", engine, async_url)
    d = runner.dispatcher(Blocking() if method == "publish" else BlockingBatch(), batch=10)

    async def main() -> float:
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        t = asyncio.create_task(ticker())
        try:
            assert await d.run_once() == 6
        finally:
            done.set()
            await t
        return max(gaps)

    assert runner.loop is not None
    try:
        worst_gap = runner.loop.run_until_complete(main())
    finally:
        runner.close()
    assert order == [1, 2, 3, 4, 5, 6] and statuses(engine) == {"done": 6}
    assert worst_gap < 0.2, f"the event loop stalled for {worst_gap:.3f}s"


def test_hanging_handler_times_out_as_retryable(runner: Runner, engine: Engine) -> None:
    """handler_timeout holds for both flavours and for sync and async handlers: a hanging handler is a
    retryable failure, the batch's other jobs complete, and the loop is not held until stale_after."""
    seed_jobs(engine, 1, task="hang")
    seed_jobs(engine, 1, task="hang_async")
    seed_jobs(engine, 1, task="ok")
    release = threading.Event()

    async def hang_async(job: ClaimedJob) -> None:
        await asyncio.sleep(10)

    handlers: dict[str, Any] = {"hang": lambda j: release.wait(10), "ok": lambda j: None}
    if runner.kind == "async":
        handlers["hang_async"] = hang_async
    else:
        handlers["hang_async"] = lambda j: release.wait(10)
    w = runner.worker(handlers, handler_timeout=0.3, stale_after=5, concurrency=3)
    started = time.monotonic()
    try:
        assert runner.run_once(w) == 3
        assert time.monotonic() - started < 3
    finally:
        release.set()
    for job_id in (1, 2):
        r = row(engine, "jobs", job_id)
        assert (r.status, r.attempts) == ("queued", 1), r
        assert "handler exceeded handler_timeout (0.3s)" in r.last_error
    assert row(engine, "jobs", 3).status == "done"


def test_hanging_publisher_times_out_as_retryable_when_enforced(runner: Runner, engine: Engine) -> None:
    """enforce_publish_timeout bounds every publish for both flavours (an async publisher is cancelled)."""
    seed_events(engine, 1)
    release = threading.Event()

    class Hangs:
        def publish(self, message: Message) -> None:
            release.wait(10)

    class HangsAsync:
        async def publish(self, message: Message) -> None:
            await asyncio.sleep(10)

    pub: Any = Hangs() if runner.kind == "sync" else HangsAsync()
    d = runner.dispatcher(pub, lease=5, publish_timeout=0.3, enforce_publish_timeout=True)
    started = time.monotonic()
    try:
        assert runner.run_once(d) == 1
        assert time.monotonic() - started < 3
    finally:
        release.set()
    r = row(engine, "outbox", 1)
    assert (r.status, r.attempts) == ("pending", 1), r
    assert "publish exceeded publish_timeout (0.3s)" in r.last_error


def test_hanging_async_publish_many_is_bounded_by_the_lease_budget(engine: Engine, async_url: URL) -> None:
    """An async publish_many that never returns is cancelled when the lease budget (lease − publish_timeout)
    is spent: the batch is retried, never published on an expired lease."""
    seed_events(engine, 2)

    class HangsAsyncBatch:
        async def publish(self, message: Message) -> None:
            raise AssertionError("batches go through publish_many")

        async def publish_many(self, messages: list[Message]) -> list[BaseException | None]:
            await asyncio.sleep(10)
            return [None] * len(messages)

    runner = Runner("async", engine, async_url)
    d = runner.dispatcher(HangsAsyncBatch(), lease=1.5, publish_timeout=0.5)
    started = time.monotonic()
    try:
        assert runner.run_once(d) == 2
        took = time.monotonic() - started
    finally:
        runner.close()
    assert took < 3
    for i in (1, 2):
        r = row(engine, "outbox", i)
        assert (r.status, r.attempts) == ("pending", 1) and "lease budget" in r.last_error, r


def test_a_handlers_own_timeout_error_is_reported_as_raised(runner: Runner, engine: Engine) -> None:
    """Without handler_timeout, a TimeoutError the handler raises itself (a network call) is that error, retried
    like any unclassified failure — not mistaken for handler_timeout."""
    seed_jobs(engine, 1, task="net")

    async def net_async(job: ClaimedJob) -> None:
        raise TimeoutError("upstream did not answer")

    def net_sync(job: ClaimedJob) -> None:
        raise TimeoutError("upstream did not answer")

    w = runner.worker({"net": net_async if runner.kind == "async" else net_sync}, backoff=FAST)
    assert runner.run_once(w) == 1
    r = row(engine, "jobs", 1)
    assert (r.status, r.attempts) == ("queued", 1) and "upstream did not answer" in r.last_error, r


def test_an_outage_on_the_last_attempt_does_not_kill_the_message(runner: Runner, engine: Engine) -> None:
    """DestinationUnavailable refunds the attempt, whatever attempt it was: an outage never sends a message to
    dead (found while writing the docs: on the last attempt it did)."""
    from sa_outbox import DestinationUnavailable

    seed_events(engine, 1)
    d = runner.dispatcher(
        RecordingPublisher(fail=lambda m: DestinationUnavailable("broker down")), max_attempts=1
    )
    assert runner.run_once(d) == 1
    r = row(engine, "outbox", 1)
    assert (r.status, r.attempts) == ("pending", 0) and r.last_error.startswith("DestinationUnavailable")


def test_run_once_closes_the_circuit_once_the_destination_is_back(runner: Runner, engine: Engine) -> None:
    from sa_outbox import DestinationUnavailable

    seed_events(engine, 2)
    down = [True]
    d = runner.dispatcher(
        RecordingPublisher(fail=lambda m: DestinationUnavailable("down") if down[0] else None)
    )
    runner.run_once(d)
    assert d.circuit_open
    down[0] = False
    runner.drain(d)
    assert statuses(engine) == {"done": 2} and not d.circuit_open
