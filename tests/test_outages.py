"""Broker outages longer than the retry budget (issue #19 §1), on real brokers.

Each test runs a dispatcher with a tiny retry budget (``max_attempts=3``, backoff cap 0.05 s: 0.15 s of
retries) against a private broker of its own (``tests/brokers.py``), stops that broker for many times the
budget while events are being written, starts it again and then checks, from the rows and from what the
broker holds:

* nothing is dead, and every message was claimed exactly once more than before the outage (``attempts == 1``
  for events written during it): the outage spent no attempt;
* the publisher was called no more often during the outage than the circuit breaker's probe schedule allows
  (counted by :class:`Counting`, a thin wrapper that hands every call to the real publisher);
* every message reached the broker soon after it came back, ordered aggregates in order (read back from the
  broker itself);
* the dispatcher logged one WARNING when its circuit opened (with the cause) and one INFO when it closed.

The figures (outage as a multiple of the retry budget, calls during it, time from broker back to the last
message delivered) are printed by each test (``pytest -s``) and summed up in ``docs/outages.md``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pika
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from sa_outbox import AsyncDispatcher, Backoff, DestinationUnavailable, Dispatcher, Message
from sa_outbox.models import OutboxEvent

from .brokers import PrivateNats, PrivateRabbit, PrivateRedis, running

MAX_ATTEMPTS = 3
CAP = 0.05
BUDGET = MAX_ATTEMPTS * CAP  # the longest a message could be retried before going dead (no jitter)
OUTAGE = 4.0  # the broker stays down at least this long: > 25 x BUDGET
ORDERED = "OrderUpdated"
AGGREGATES = ("a1", "a2", "a3", "a4")
ROUNDS = 6  # round 0 before the outage, rounds 1.. during it

# The circuit breaker's schedule (sa_outbox/_backoff.py, DESTINATION_OUTAGE): after its n-th failure in a row
# the dispatcher claims nothing for at least 0.5 * 2**n * 0.5 seconds (half jitter), then probes one message.
PROBE_BASE, PROBE_MIN_FACTOR, PROBE_CAP = 0.5, 0.5, 60.0


def most_probes(seconds: float) -> int:
    """How many probes the schedule allows within ``seconds`` of the circuit opening: probe k comes at least
    sum(PROBE_BASE * PROBE_MIN_FACTOR * 2**n for n in 1..k) seconds after it opened."""
    k, waited = 0, 0.0
    while True:
        waited += min(PROBE_CAP, PROBE_BASE * 2 ** (k + 1)) * PROBE_MIN_FACTOR
        if waited > seconds:
            return k
        k += 1


def longest_pause(failures: int) -> float:
    """The longest the circuit stays open after ``failures`` failed calls in a row (before its next probe)."""
    return min(PROBE_CAP, PROBE_BASE * 2**failures)


# --- the counting wrapper ----------------------------------------------------------------------------------


@dataclass
class Call:
    at: float  # time.monotonic() when the call started
    messages: int
    unavailable: int  # how many of them failed with DestinationUnavailable
    delivered: int


class Counting:
    """A real publisher, every call handed to it unchanged; records when each call started and what came back.
    Not a mock: it decides nothing."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[Call] = []
        self._lock = threading.Lock()

    def _record(self, at: float, results: Sequence[BaseException | None]) -> None:
        call = Call(at, len(results), sum(isinstance(r, DestinationUnavailable) for r in results),
                    sum(r is None for r in results))  # fmt: skip
        with self._lock:
            self.calls.append(call)

    def publish(self, message: Message) -> None:
        at = time.monotonic()
        try:
            self.inner.publish(message)
        except Exception as exc:
            self._record(at, [exc])
            raise
        self._record(at, [None])

    def publish_many(self, messages: Sequence[Message]) -> list[BaseException | None]:
        at = time.monotonic()
        results = list(self.inner.publish_many(messages))
        self._record(at, results)
        return results

    def close(self) -> None:
        self.inner.close()

    def between(self, start: float, end: float) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if start <= c.at < end]

    def first_delivery_after(self, start: float) -> float | None:
        with self._lock:
            return next((c.at for c in self.calls if c.at >= start and c.delivered), None)


class AsyncCounting(Counting):
    """:class:`Counting` for an asyncio publisher (for :class:`AsyncDispatcher`)."""

    async def publish(self, message: Message) -> None:  # type: ignore[override]
        at = time.monotonic()
        try:
            await self.inner.publish(message)
        except Exception as exc:
            self._record(at, [exc])
            raise
        self._record(at, [None])

    async def publish_many(self, messages: Sequence[Message]) -> list[BaseException | None]:  # type: ignore[override]
        at = time.monotonic()
        results = list(await self.inner.publish_many(messages))
        self._record(at, results)
        return results

    async def close(self) -> None:  # type: ignore[override]
        await self.inner.close()


# --- brokers: a private instance, a destination on it, and reading back what it holds -----------------------


@dataclass(frozen=True)
class Received:
    id: int
    event_type: str
    aggregate_id: str


def _received(envelope: dict[str, Any]) -> Received:
    return Received(int(envelope["message_id"]), envelope["event_type"], envelope["aggregate_id"])


class RabbitDestination:
    """A durable queue on a private RabbitMQ node; messages are persistent, so they survive the restart."""

    name = "rabbitmq"

    def __init__(self, node: PrivateRabbit) -> None:
        self.node = node
        self.queue = f"outage.{uuid.uuid4().hex[:8]}"
        conn = pika.BlockingConnection(pika.URLParameters(node.url))
        conn.channel().queue_declare(self.queue, durable=True)
        conn.close()

    def publisher(self) -> Any:
        from sa_outbox.publishers.rabbitmq import RabbitMQPublisher

        return RabbitMQPublisher(self.node.url, routing_key=self.queue, timeout=1)

    def async_publisher(self) -> Any:
        from sa_outbox.publishers.aio_rabbitmq import AsyncRabbitMQPublisher

        return AsyncRabbitMQPublisher(self.node.url, routing_key=self.queue, timeout=1)

    def down(self) -> None:
        self.node.stop()

    def up(self) -> None:
        self.node.start()

    def received(self) -> list[Received]:
        conn = pika.BlockingConnection(pika.URLParameters(self.node.url))
        ch = conn.channel()
        out = []
        for _ in range(10_000):  # bounded: far more than any test writes
            method, _props, body = ch.basic_get(self.queue, auto_ack=True)
            if method is None:
                break
            out.append(_received(json.loads(body)))
        conn.close()
        return out


class NatsDestination:
    """A JetStream stream (file storage) on a private nats-server; it survives the restart."""

    name = "nats"

    def __init__(self, server: PrivateNats) -> None:
        self.server = server
        self.stream = f"OUTAGE{uuid.uuid4().hex[:6].upper()}"
        self.prefix = self.stream.lower()
        self._run(self._add())

    def _run(self, coro: Any) -> Any:
        return asyncio.run(coro)

    async def _add(self) -> None:
        import nats

        nc = await nats.connect(self.server.url)
        await nc.jetstream().add_stream(name=self.stream, subjects=[f"{self.prefix}.>"])
        await nc.close()

    def publisher(self) -> Any:
        from sa_outbox.publishers.nats import NatsPublisher

        return NatsPublisher(self.server.url, subject_prefix=self.prefix, timeout=1)

    def down(self) -> None:
        self.server.stop()

    def up(self) -> None:
        self.server.start()

    def received(self) -> list[Received]:
        async def read() -> list[Received]:
            import nats

            nc = await nats.connect(self.server.url)
            js = nc.jetstream()
            info = await js.stream_info(self.stream)
            out = [
                _received(json.loads((await js.get_msg(self.stream, seq)).data or b"{}"))
                for seq in range(info.state.first_seq, info.state.last_seq + 1)
            ]
            await nc.close()
            return out

        result: list[Received] = self._run(read())
        return result


class RedisDestination:
    """A stream on a private redis-server, stopped with SHUTDOWN SAVE so that it comes back with its data."""

    name = "redis"

    def __init__(self, server: PrivateRedis) -> None:
        self.server = server
        self.stream = f"outage:{uuid.uuid4().hex[:8]}"

    def publisher(self) -> Any:
        from sa_outbox.publishers.redis import RedisStreamPublisher

        return RedisStreamPublisher(self.server.url, stream=self.stream, timeout=1)

    def down(self) -> None:
        self.server.stop(save=True)

    def up(self) -> None:
        self.server.start()

    def received(self) -> list[Received]:
        import redis

        client = redis.Redis.from_url(self.server.url, decode_responses=True)
        try:
            return [
                Received(int(f["message_id"]), f["event_type"], f["aggregate_id"])
                for _, f in client.xrange(self.stream)
            ]
        finally:
            client.close()


# --- the scenario ------------------------------------------------------------------------------------------


@dataclass
class Figures:
    broker: str
    flavour: str
    outage_seconds: float = 0.0
    dead: int = 0
    calls_during: int = 0
    messages_during: int = 0
    calls_bound: int = 0
    failed_calls: int = 0
    recovery_seconds: float = 0.0
    recovery_bound: float = 0.0
    attempts_during: dict[int, int] = field(default_factory=dict)
    attempts_after: dict[int, int] = field(default_factory=dict)
    written: list[tuple[int, str, str]] = field(default_factory=list)  # (id, event_type, aggregate_id)
    received: list[Received] = field(default_factory=list)
    opened: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"{self.broker} ({self.flavour}): outage {self.outage_seconds:.1f}s = "
            f"{self.outage_seconds / BUDGET:.0f}x the retry budget ({BUDGET:g}s); dead {self.dead}; publish calls "
            f"during it {self.calls_during} ({self.messages_during} messages, bound {self.calls_bound}); "
            f"broker back -> last message delivered {self.recovery_seconds:.2f}s (bound {self.recovery_bound:g}s)"
        )


def write_round(engine: Engine, n: int) -> list[tuple[int, str, str]]:
    """One producer transaction: an ordered event per aggregate and an unordered note."""
    with Session(engine) as s, s.begin():
        events = [OutboxEvent(aggregate_type="order", aggregate_id=a, event_type=ORDERED, payload={"round": n})
                  for a in AGGREGATES]  # fmt: skip
        events.append(
            OutboxEvent(aggregate_type="note", aggregate_id=f"n{n}", event_type="Noted", payload={})
        )
        s.add_all(events)
        s.flush()
        return [(e.id, e.event_type, e.aggregate_id) for e in events]


def rows(engine: Engine) -> dict[int, tuple[str, int]]:
    with engine.connect() as conn:
        return {
            r.id: (r.status, r.attempts)
            for r in conn.execute(text("SELECT id, status, attempts FROM outbox"))
        }


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> float:
    """Poll ``predicate`` until true; returns time.monotonic() at that moment. Fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout:g}s")
        time.sleep(every)


def all_done(engine: Engine, ids: list[int]) -> Callable[[], bool]:
    def check() -> bool:
        with engine.connect() as conn:
            return bool(
                conn.execute(
                    text("SELECT count(*) = 0 FROM outbox WHERE id = ANY(:ids) AND status <> 'done'"),
                    {"ids": ids},
                ).scalar_one()
            )

    return check


class Running:
    """A dispatcher of either flavour running in a thread of its own until :meth:`stop`."""

    def __init__(self, flavour: str, engine: Engine, async_url: URL, publisher: Any) -> None:
        self.flavour = flavour
        self.dispatcher: Any = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        options: dict[str, Any] = dict(
            max_attempts=MAX_ATTEMPTS, backoff=Backoff(0.01, CAP), batch=50, lease=10, publish_timeout=3,
            poll_interval=0.2, ordered=[ORDERED],
        )  # fmt: skip
        if flavour == "sync":
            self.dispatcher = Dispatcher(engine, OutboxEvent, publisher, **options)
            target: Callable[[], None] = lambda: self.dispatcher.run(install_signal_handlers=False)  # noqa: E731
        else:

            async def main() -> None:
                aengine = create_async_engine(async_url)
                self.dispatcher = AsyncDispatcher(aengine, OutboxEvent, publisher, **options)
                self._ready.set()
                try:
                    await self.dispatcher.run(install_signal_handlers=False)
                finally:
                    await self.dispatcher.close()
                    await publisher.close()
                    await aengine.dispose()

            target = lambda: asyncio.run(main())  # noqa: E731
        self.thread = threading.Thread(target=self._guard(target), daemon=True)
        self.thread.start()
        if flavour == "sync":
            self._ready.set()
        assert self._ready.wait(30), "the dispatcher did not start"

    def _guard(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                self.error = exc
                self._ready.set()

        return run

    def stop(self) -> None:
        self.dispatcher.stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the dispatcher did not stop"
        if self.flavour == "sync":
            self.dispatcher.close()
        assert self.error is None, self.error


def through_an_outage(
    engine: Engine, async_url: URL, destination: Any, flavour: str, caplog: pytest.LogCaptureFixture
) -> Figures:
    """Round 0 delivered with the broker up; the broker stopped; rounds 1.. written; the broker kept down for
    OUTAGE seconds in all, then started; everything delivered; read back from the broker."""
    caplog.set_level(logging.INFO, logger="sa_outbox.dispatcher")
    figures = Figures(destination.name, flavour)
    if flavour == "sync":
        publisher: Counting = Counting(destination.publisher())
    else:
        publisher = AsyncCounting(destination.async_publisher())
    loop = Running(flavour, engine, async_url, publisher)
    try:
        figures.written += write_round(engine, 0)
        wait_until(all_done(engine, [w[0] for w in figures.written]), 30, "round 0 delivered")

        went_down = time.monotonic()
        destination.down()
        before = len(figures.written)
        for n in range(1, ROUNDS):
            figures.written += write_round(engine, n)
        during_ids = [w[0] for w in figures.written[before:]]
        wait_until(lambda: loop.dispatcher.circuit_open, 15, "the circuit open")
        time.sleep(max(0.0, went_down + OUTAGE - time.monotonic()))
        figures.attempts_during = {i: a for i, (_s, a) in rows(engine).items() if i in during_ids}
        destination.up()
        came_back = time.monotonic()

        delivered_at = wait_until(
            all_done(engine, during_ids), 90, "every message delivered after the outage"
        )
        wait_until(lambda: not loop.dispatcher.circuit_open, 10, "the circuit closed")
    finally:
        loop.stop()
        if flavour == "sync":
            publisher.close()
    # The outage as the dispatcher saw it: from the broker going down to the first call that delivered (a
    # RabbitMQ node takes messages a moment before its start-up command returns).
    ended = min(came_back, publisher.first_delivery_after(went_down) or came_back)
    during = publisher.between(went_down, ended)
    figures.outage_seconds = ended - went_down
    figures.calls_during = len(during)
    figures.messages_during = sum(c.messages for c in during)
    figures.failed_calls = sum(1 for c in during if c.unavailable)
    figures.calls_bound = 1 + most_probes(ended - went_down)
    figures.recovery_seconds = delivered_at - ended
    figures.recovery_bound = longest_pause(figures.failed_calls) + 5.0
    after = rows(engine)
    figures.dead = sum(1 for s, _a in after.values() if s == "dead")
    figures.attempts_after = {i: a for i, (_s, a) in after.items() if i in during_ids}
    figures.received = destination.received()
    for r in caplog.records:
        if r.name == "sa_outbox.dispatcher" and r.getMessage().startswith(
            "destination unavailable: not claiming"
        ):
            figures.opened.append(f"{r.levelname} {r.getMessage()}")
        if r.name == "sa_outbox.dispatcher" and r.getMessage().startswith("destination available again"):
            figures.closed.append(f"{r.levelname} {r.getMessage()}")
    print(figures.line())
    return figures


def assert_rode_it_out(f: Figures) -> None:
    assert f.outage_seconds >= OUTAGE > 25 * BUDGET
    assert f.dead == 0
    # No attempt spent on the outage: rows written during it were never charged for a failed claim, and each
    # was claimed exactly once more to be delivered.
    assert set(f.attempts_during.values()) <= {0, 1}, f.attempts_during  # 1: a probe in flight at that moment
    assert set(f.attempts_after.values()) == {1}, f.attempts_after
    # No hammering: the first failed batch, then probes no more often than the schedule allows.
    assert 1 <= f.failed_calls <= f.calls_during <= f.calls_bound, (f.calls_during, f.calls_bound)
    assert f.recovery_seconds <= f.recovery_bound
    # Everything is on the broker (a re-publish after a lost lease could duplicate; none is expected here).
    ids = [r.id for r in f.received]
    assert sorted(set(ids)) == sorted(w[0] for w in f.written)
    for aggregate in AGGREGATES:
        firsts: list[int] = []
        for r in f.received:
            if r.event_type == ORDERED and r.aggregate_id == aggregate and r.id not in firsts:
                firsts.append(r.id)
        assert firsts == sorted(firsts) and len(firsts) == ROUNDS, (aggregate, firsts)
    # One WARNING when the circuit opened, naming the cause; one INFO when it closed, with the outage length.
    assert (
        len(f.opened) == 1 and f.opened[0].startswith("WARNING") and "DestinationUnavailable" in f.opened[0]
    )
    assert len(f.closed) == 1 and f.closed[0].startswith("INFO") and "after" in f.closed[0]


def test_most_probes_follows_the_schedule() -> None:
    """The bound used below: probes at >= 0.5, 1.5, 3.5, 7.5 … seconds after the circuit opened."""
    assert [most_probes(s) for s in (0.4, 0.5, 1.4, 1.5, 3.5, 7.4, 7.5)] == [0, 1, 1, 2, 3, 3, 4]
    assert most_probes(3600) <= 3600 / 30 + 7  # an hour: about two probes a minute, whatever happens
    assert longest_pause(100) == 60.0


# --- one test per broker --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rabbit() -> Iterator[PrivateRabbit]:
    with running(PrivateRabbit()) as node:
        yield node


@pytest.fixture
def nats_server() -> Iterator[PrivateNats]:
    with running(PrivateNats()) as server:
        yield server


@pytest.fixture
def redis_server() -> Iterator[PrivateRedis]:
    with running(PrivateRedis()) as server:
        yield server


def test_rabbitmq_outage_longer_than_the_retry_budget_kills_nothing(
    engine: Engine, async_url: URL, rabbit: PrivateRabbit, caplog: pytest.LogCaptureFixture
) -> None:
    assert_rode_it_out(through_an_outage(engine, async_url, RabbitDestination(rabbit), "sync", caplog))


def test_rabbitmq_outage_through_the_async_dispatcher_and_aio_pika(
    engine: Engine, async_url: URL, rabbit: PrivateRabbit, caplog: pytest.LogCaptureFixture
) -> None:
    assert_rode_it_out(through_an_outage(engine, async_url, RabbitDestination(rabbit), "async", caplog))


def test_nats_jetstream_outage_longer_than_the_retry_budget_kills_nothing(
    engine: Engine, async_url: URL, nats_server: PrivateNats, caplog: pytest.LogCaptureFixture
) -> None:
    assert_rode_it_out(through_an_outage(engine, async_url, NatsDestination(nats_server), "sync", caplog))


def test_redis_streams_outage_longer_than_the_retry_budget_kills_nothing(
    engine: Engine, async_url: URL, redis_server: PrivateRedis, caplog: pytest.LogCaptureFixture
) -> None:
    assert_rode_it_out(through_an_outage(engine, async_url, RedisDestination(redis_server), "sync", caplog))


def test_a_circuit_closes_when_another_dispatcher_delivered_the_backlog(
    engine: Engine, redis_server: PrivateRedis
) -> None:
    """Two dispatchers meet the same outage; the broker comes back and the first one's probe gets through
    and delivers everything. The second one's probe then finds nothing to claim: the rows show that the
    destination is reachable (another dispatcher delivered them), so its circuit must close too — not stay
    open, with ``circuit_open`` (and the ``sa_outbox_circuit_open`` gauge) at 1, until new traffic comes."""
    from sa_outbox.publishers.redis import RedisStreamPublisher

    from .helpers import seed_events

    def dispatcher() -> Dispatcher:
        publisher = RedisStreamPublisher(redis_server.url, stream="two", timeout=1)
        return Dispatcher(engine, OutboxEvent, publisher, batch=1, max_attempts=MAX_ATTEMPTS,
                          backoff=Backoff(0.01, CAP), poll_interval=0.1, listen=False)  # fmt: skip

    first, second = dispatcher(), dispatcher()
    seed_events(engine, 2)
    redis_server.stop()
    assert first.run_once() == 1 and second.run_once() == 1  # one row each, refunded: both circuits open
    assert first.circuit_open and second.circuit_open
    redis_server.start()
    runs = [threading.Thread(target=lambda d=d: d.run(install_signal_handlers=False), daemon=True)
            for d in (first, second)]  # fmt: skip
    runs[0].start()
    try:
        wait_until(all_done(engine, [1, 2]), 30, "both rows delivered by the first dispatcher")
        runs[1].start()
        closed = wait_until(lambda: not second.circuit_open, 15, "the second circuit closed", every=0.1)
    finally:
        for d, t in zip((first, second), runs, strict=True):
            d.stop()
            if t.is_alive():
                t.join(30)
            d.close()
    assert closed and not first.circuit_open


def test_status_sees_an_outage_that_meets_a_backlog(engine: Engine, redis_server: PrivateRedis) -> None:
    """The broker goes down while more events wait than one batch holds (a burst, a dispatcher catching up).
    ``status``/``doctor`` read the oldest due rows through the ready index (a LIMIT, never every pending row)
    and must find there the rows the dispatcher gave back for the outage."""
    from sa_outbox.doctor import doctor
    from sa_outbox.monitoring import queue_status
    from sa_outbox.publishers.redis import RedisStreamPublisher

    from .helpers import seed_events

    publisher = RedisStreamPublisher(redis_server.url, stream="status", timeout=1)
    d = Dispatcher(engine, OutboxEvent, publisher, max_attempts=MAX_ATTEMPTS, backoff=Backoff(0.01, CAP),
                   poll_interval=0.2, batch=50)  # fmt: skip
    thread = threading.Thread(target=lambda: d.run(install_signal_handlers=False), daemon=True)
    thread.start()
    try:
        seed_events(engine, 1)
        wait_until(all_done(engine, [1]), 30, "the first event delivered")
        redis_server.stop()
        seed_events(engine, 200, start=1)  # four batches' worth
        wait_until(lambda: d.circuit_open, 15, "the circuit open")
        time.sleep(2.0)  # a probe or two
        during = queue_status(engine, OutboxEvent)
        findings = [f for f in doctor(engine, [OutboxEvent]) if f.check == "destination"]
        redis_server.start()
        wait_until(all_done(engine, list(range(1, 202))), 60, "everything delivered after the outage")
    finally:
        d.stop()
        thread.join(30)
        d.close()
    print("during the outage:", during.destination_unavailable, during.attempts, during.oldest_pending_age)
    assert during.attempts == {0: 200}  # the outage itself is handled: no attempt spent
    assert during.destination_unavailable is not None, (
        "status does not see the outage: the rows the dispatcher gave back left the head of the ready index "
        "(refunded with available_at = now()), and the oldest due rows were never tried"
    )
    assert [f.status for f in findings] == ["warn"]
