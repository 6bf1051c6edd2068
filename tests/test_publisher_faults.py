"""Publishers under broker faults: outages, restarts, hung connections, broker-side limits, odd HTTP answers.

Every fault is real: a private broker on a free port (stopped, restarted or configured with a limit), or a
:class:`~tests.brokers.TcpProxy` in front of a shared broker that the test freezes or cuts. The shared brokers
themselves are never stopped or reconfigured. Waits are bounded: a call that used to hang runs on a helper
thread that the test joins with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import unquote

import pika
import pytest
from sqlalchemy import Engine, text

from sa_outbox import (
    Backoff,
    DestinationUnavailable,
    Dispatcher,
    Message,
    NoAnswer,
    PermanentError,
    RetryableError,
)
from sa_outbox.models import OutboxEvent

from .brokers import (
    PrivateMosquitto,
    PrivateNats,
    PrivateRabbit,
    PrivateRedis,
    TcpProxy,
    closed_port,
    redis_call,
)
from .helpers import row, seed_events, statuses

AMQP_PORT = 5672
NATS_PORT = 4222
REDIS_PORT = 6379
MQTT_PORT = 1883
NOWHERE = "sa-outbox-nowhere.invalid"  # RFC 6761: never resolves


def msg(i: int, payload: Any = None, *, created_at: datetime | None = None, event_type: str = "x") -> Message:
    return Message(
        i, str(i), "order", str(i), event_type, {"i": i} if payload is None else payload, 1, 1,
        created_at or datetime.now(UTC),
    )  # fmt: skip


def bounded(fn: Callable[[], Any], limit: float) -> tuple[Any, float]:
    """Run ``fn`` on a helper thread; (its result or exception, seconds taken). Fails the test when it is
    still running after ``limit`` seconds (the thread is left behind as a daemon)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    elapsed = time.monotonic() - t0
    assert not thread.is_alive(), f"still blocked after {limit:g}s"
    return out[0], elapsed


def raised(fn: Callable[[], Any]) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:
        return exc
    return None


def kinds(results: list[BaseException | None]) -> list[str]:
    return [type(r).__name__ if r is not None else "ok" for r in results]


@pytest.fixture
def proxy_to() -> Iterator[Callable[[int], TcpProxy]]:
    proxies: list[TcpProxy] = []

    def make(port: int) -> TcpProxy:
        proxies.append(TcpProxy(port))
        return proxies[-1]

    yield make
    for p in proxies:
        p.close()


class Frozen:
    """What a sync publisher did through a frozen connection: a batch of 10 on the open connection, then one
    publish, then one batch after a thaw."""

    def __init__(self, proxy: TcpProxy, pub: Any, name: str, timeout: float) -> None:
        self.timeout = timeout
        pub.publish(msg(1))
        proxy.freeze()
        self.batch, self.batch_took = bounded(lambda: pub.publish_many([msg(i) for i in range(3, 13)]), 60)
        self.single, self.single_took = bounded(lambda: raised(lambda: pub.publish(msg(2))), 60)
        print(f"{name} frozen: publish {self.single_took:.1f}s, publish_many(10) {self.batch_took:.1f}s "
              f"(timeout={timeout:g})")  # fmt: skip
        proxy.thaw()
        proxy.cut()
        self.after = pub.publish_many([msg(20)])

    def bounded(self) -> bool:
        """Both calls returned within 3 × timeout with a retryable failure (a timeout, or
        DestinationUnavailable when the hung peer does not even complete a new handshake), and the publisher
        recovered after."""
        return (
            isinstance(self.single, RetryableError) and self.single_took < 3 * self.timeout
            and all(isinstance(r, RetryableError) for r in self.batch) and len(self.batch) == 10
            and self.batch_took < 3 * self.timeout
            and self.after == [None]
        )  # fmt: skip


UNAVAILABLE_CYCLE = [["ok"], ["DestinationUnavailable"] * 3, ["ok"]]


def unreachable(pub: Any) -> list[str]:
    """What a sync publisher whose destination cannot be reached returns for a batch of two and a single
    publish (then closed); ``["DestinationUnavailable"] * 3`` is the right answer."""
    try:
        return kinds(pub.publish_many([msg(1), msg(2)])) + kinds([raised(lambda: pub.publish(msg(3)))])
    finally:
        pub.close()


def through_an_outage(pub: Any, down: Callable[[], Any], up: Callable[[], Any]) -> list[list[str]]:
    """What a sync publisher returns before, during (a batch of two and a single publish) and after an
    outage; ``UNAVAILABLE_CYCLE`` is the right answer."""
    before = kinds(pub.publish_many([msg(1)]))
    down()
    during = kinds(pub.publish_many([msg(2), msg(3)])) + kinds([raised(lambda: pub.publish(msg(4)))])
    up()
    return [before, during, kinds(pub.publish_many([msg(5)]))]


# --- RabbitMQ: a private node for restarts and queue limits ---------------------------------------------


@pytest.fixture(scope="module")
def rabbit() -> Iterator[PrivateRabbit]:
    node = PrivateRabbit()
    node.start()
    try:
        yield node
    finally:
        node.close()


SHARED_AMQP = f"amqp://guest:guest@127.0.0.1:{AMQP_PORT}/%2F"


@pytest.fixture
def shared_queue() -> Iterator[str]:
    """A durable queue of its own on the shared RabbitMQ, deleted afterwards."""
    name = f"sa_outbox_faults.{uuid.uuid4().hex[:8]}"
    _queue(SHARED_AMQP, name)
    yield name
    conn = pika.BlockingConnection(pika.URLParameters(SHARED_AMQP))
    conn.channel().queue_delete(name)
    conn.close()


def _queue(url: str, name: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    conn.channel().queue_declare(name, durable=True)
    conn.close()


def _queue_depth(url: str, name: str) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    depth = int(conn.channel().queue_declare(name, passive=True).method.message_count)
    conn.close()
    return depth


def _queue_ids(url: str, name: str) -> list[str]:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ids = []
    while True:
        method, props, _ = ch.basic_get(name, auto_ack=True)
        if method is None:
            break
        ids.append(props.message_id)
    conn.close()
    return ids


def _limited_queue(rabbit: PrivateRabbit, max_length: int) -> str:
    """A durable queue that refuses what exceeds ``max_length`` (a ``reject-publish`` policy on the node)."""
    name = f"lim.{uuid.uuid4().hex[:6]}"
    policy = f'{{"max-length":{max_length},"overflow":"reject-publish"}}'
    rabbit.ctl("set_policy", f"lim-{name}", f"^{name}$", policy, "--apply-to", "queues")
    _queue(rabbit.url, name)
    return name


def test_rabbitmq_batch_on_a_reject_publish_queue_reports_each_message(rabbit: PrivateRabbit) -> None:
    """Item 12: a full queue nacks what does not fit; the messages it took are delivered, once."""
    from sa_outbox.publishers.rabbitmq import RabbitMQPublisher

    name = _limited_queue(rabbit, 3)
    pub = RabbitMQPublisher(rabbit.url, routing_key=name, timeout=5)
    try:
        results = pub.publish_many([msg(i) for i in range(1, 9)])
    finally:
        pub.close()
    assert kinds(results) == ["ok"] * 3 + ["RetryableError"] * 5
    assert "nack" in str(results[3])
    assert _queue_ids(rabbit.url, name) == ["1", "2", "3"]  # each taken message exactly once


def test_rabbitmq_single_publish_on_a_full_queue_is_retryable_and_the_channel_goes_on(
    rabbit: PrivateRabbit,
) -> None:
    from sa_outbox.publishers.rabbitmq import RabbitMQPublisher

    name = _limited_queue(rabbit, 1)
    pub = RabbitMQPublisher(rabbit.url, routing_key=name, timeout=5)
    try:
        first = raised(lambda: pub.publish(msg(1)))
        full = raised(lambda: pub.publish(msg(2)))
        assert _queue_ids(rabbit.url, name) == ["1"]  # consumed: room again
        again = pub.publish_many([msg(3)])
    finally:
        pub.close()
    assert first is None and type(full) is RetryableError and "nack" in str(full)
    assert again == [None] and _queue_ids(rabbit.url, name) == ["3"]


def _restart_mid_stream(
    rabbit: PrivateRabbit,
    publish_batch: Callable[[list[Message]], list[Any]],
    publish_one: Callable[[Message], Any],
) -> dict[str, Any]:
    """Publish 10-message batches while the node restarts, restart it again while the publisher is idle, then
    publish 5 single messages and 10 more batches."""
    queue = f"restart.{uuid.uuid4().hex[:6]}"
    _queue(rabbit.url, queue)
    outcomes: list[BaseException | None] = []
    restarted = threading.Event()
    restarter = threading.Thread(target=lambda: (rabbit.restart(), restarted.set()), daemon=True)
    n = 0

    def batch() -> list[Any]:
        nonlocal n
        ms = [msg(n + i + 1, event_type=queue) for i in range(10)]
        n += 10
        return publish_batch(ms)

    for _ in range(3):
        outcomes += batch()
    restarter.start()
    deadline = time.monotonic() + 90
    try:
        while not restarted.is_set() and time.monotonic() < deadline:
            outcomes += batch()
            time.sleep(0.05)
    finally:  # a failing publisher must not leave the node half-restarted for the module's next tests
        restarter.join(120)
    assert restarted.is_set(), "the private node did not come back"
    rabbit.restart()  # and once more while the publisher holds an idle connection
    singles = []
    for _ in range(5):
        n += 1
        single = msg(n, event_type=queue)
        singles.append(raised(lambda m=single: publish_one(m)))  # type: ignore[misc]
    after = singles
    for _ in range(10):
        after += batch()
    outcomes += after
    delivered = sum(r is None for r in outcomes)
    return {
        "queue": queue, "sent": n, "delivered": delivered, "after": after,
        "errors": sorted({type(r).__name__ for r in outcomes if r is not None}),
        "depth": _queue_depth(rabbit.url, queue),
    }  # fmt: skip


def test_async_rabbitmq_reconnects_after_a_broker_restart(rabbit: PrivateRabbit) -> None:
    """Item 10: after the node restarts, the async publisher reconnects instead of failing forever."""
    from sa_outbox.publishers.aio_rabbitmq import AsyncRabbitMQPublisher

    # The publisher lives on an event loop that keeps running, as in an application.
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    pub = AsyncRabbitMQPublisher(rabbit.url, routing_key=lambda m: m.event_type, timeout=3)
    try:
        figures = _restart_mid_stream(
            rabbit, lambda ms: call(pub.publish_many(ms)), lambda m: call(pub.publish(m))
        )
    finally:
        call(pub.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    print(f"async rabbitmq through two restarts: {figures['delivered']}/{figures['sent']} delivered, "
          f"{kinds(figures['after']).count('ok')}/105 after; errors {figures['errors']}")  # fmt: skip
    assert kinds(figures["after"]) == ["ok"] * 105  # every batch once the node is back
    assert set(figures["errors"]) <= {"DestinationUnavailable", "RetryableError"}
    assert figures["delivered"] <= figures["depth"] <= figures["sent"]  # confirmed means stored


def test_rabbitmq_reconnects_after_a_broker_restart(rabbit: PrivateRabbit) -> None:
    from sa_outbox.publishers.rabbitmq import RabbitMQPublisher

    pub = RabbitMQPublisher(rabbit.url, routing_key=lambda m: m.event_type, timeout=3)
    try:
        figures = _restart_mid_stream(rabbit, pub.publish_many, pub.publish)
    finally:
        pub.close()
    print(f"rabbitmq (pika) through two restarts: {figures['delivered']}/{figures['sent']} delivered, "
          f"{kinds(figures['after']).count('ok')}/105 after; errors {figures['errors']}")  # fmt: skip
    assert kinds(figures["after"]) == ["ok"] * 105
    assert set(figures["errors"]) <= {"DestinationUnavailable", "RetryableError"}
    assert figures["delivered"] <= figures["depth"] <= figures["sent"]


def _declare_bound(url: str, exchange: str, queue: str) -> None:
    """What a consumer starting later does: declare the exchange and a queue bound to routing key "k"."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.exchange_declare(exchange, "direct")
    ch.queue_declare(queue)
    ch.queue_bind(queue, exchange, routing_key="k")
    conn.close()


def test_async_rabbitmq_missing_exchange_at_first_use_recovers_once_declared(rabbit: PrivateRabbit) -> None:
    """Item 11: the exchange does not exist yet; a consumer declares it later; then messages flow."""
    from sa_outbox.publishers.aio_rabbitmq import AsyncRabbitMQPublisher

    exchange, queue = f"late.{uuid.uuid4().hex[:6]}", f"late.q.{uuid.uuid4().hex[:6]}"

    async def go() -> tuple[list[Any], Any, list[Any]]:
        pub = AsyncRabbitMQPublisher(rabbit.url, exchange=exchange, routing_key="k", timeout=3)
        try:
            before = await pub.publish_many([msg(1), msg(2)])
            single = None
            try:
                await pub.publish(msg(3))
            except BaseException as exc:
                single = exc
            _declare_bound(rabbit.url, exchange, queue)
            after = await pub.publish_many([msg(4), msg(5)])
            return before, single, after
        finally:
            await pub.close()

    before, single, after = asyncio.run(go())
    assert kinds(before) == ["RetryableError"] * 2 and "does not exist" in str(before[0])
    assert type(single) is RetryableError
    assert kinds(after) == ["ok", "ok"]
    assert _queue_ids(rabbit.url, queue) == ["4", "5"]


def test_rabbitmq_missing_exchange_is_retryable_then_flows(rabbit: PrivateRabbit) -> None:
    from sa_outbox.publishers.rabbitmq import RabbitMQPublisher

    exchange, queue = f"late.{uuid.uuid4().hex[:6]}", f"late.q.{uuid.uuid4().hex[:6]}"
    pub = RabbitMQPublisher(rabbit.url, exchange=exchange, routing_key="k", timeout=3)
    try:
        before = pub.publish_many([msg(1), msg(2)])
        _declare_bound(rabbit.url, exchange, queue)
        after = pub.publish_many([msg(4), msg(5)])
    finally:
        pub.close()
    assert kinds(before) == ["RetryableError"] * 2 and "does not exist" in str(before[0])
    assert kinds(after) == ["ok", "ok"]
    assert _queue_ids(rabbit.url, queue) == ["4", "5"]


def test_rabbitmq_publish_through_a_frozen_connection_returns_within_its_timeout(
    proxy_to: Callable[[int], TcpProxy], shared_queue: str
) -> None:
    """Item 14: a hung connection (no byte moves, socket open) bounds publish and publish_many by timeout."""
    from sa_outbox.publishers.rabbitmq import RabbitMQPublisher

    proxy = proxy_to(AMQP_PORT)
    pub = RabbitMQPublisher(
        f"amqp://guest:guest@127.0.0.1:{proxy.port}/%2F", routing_key=shared_queue, timeout=2
    )
    try:
        frozen = Frozen(proxy, pub, "rabbitmq", 2)
    finally:
        pub.close()
    assert frozen.bounded()


def test_rabbitmq_a_late_confirm_on_a_dropped_connection_never_confirms_a_message_of_the_next_one(
    proxy_to: Callable[[int], TcpProxy], shared_queue: str
) -> None:
    """A publish times out with its confirms held back; the publisher drops that connection (its close still
    pending) and opens another, where a message is confirmed (delivery tag 1) and the next one (tag 2) never
    reaches the broker. Then the first connection's late confirms arrive: they must not settle the lost one.
    Matched by channel number only, they did — reported delivered, never on the queue (a hostile review)."""
    from sa_outbox.publishers.rabbitmq import RabbitMQPublisher

    proxy = proxy_to(AMQP_PORT)
    pub = RabbitMQPublisher(
        f"amqp://guest:guest@127.0.0.1:{proxy.port}/%2F", routing_key=shared_queue, timeout=1
    )
    try:
        assert pub.publish_many([msg(1)]) == [None]  # connection 0, tag 1
        proxy.gate(0, to_client=False)  # connection 0: the broker's confirms held back
        assert kinds(pub.publish_many([msg(2), msg(3), msg(4)])) == ["NoAnswer"] * 3
        assert pub.publish_many([msg(5)]) == [None]  # connection 1, tag 1
        proxy.gate(1, to_server=False, to_client=False)  # connection 1 hung: the next message goes nowhere
        result: list[Any] = []
        lost = threading.Thread(target=lambda: result.extend(pub.publish_many([msg(6)])))
        lost.start()
        time.sleep(0.3)
        proxy.gate(0, to_client=True)  # connection 0's late confirms (tags 1-4) arrive now
        lost.join(10)
        assert kinds(result) == ["NoAnswer"], result
    finally:
        proxy.cut()  # (a hung connection is never closed: reset them all, as a broker restart would)
        with contextlib.suppress(IndexError):  # (no second connection if the test failed before it)
            proxy.gate(1, to_server=True, to_client=True)  # (what it held goes nowhere now)
        pub.close()
    conn = pika.BlockingConnection(pika.URLParameters(SHARED_AMQP))
    channel = conn.channel()
    seen = []
    while (got := channel.basic_get(shared_queue, auto_ack=True))[0] is not None:
        seen.append(got[1].message_id)
    conn.close()
    assert "6" not in seen and {"1", "5"} <= set(seen), seen


def test_rabbitmq_refused_and_lost_connections_are_destination_unavailable(
    proxy_to: Callable[[int], TcpProxy], shared_queue: str
) -> None:
    """Issue 19 §1: connection refused / lost → DestinationUnavailable for the call and every batch entry."""
    from sa_outbox.publishers.rabbitmq import RabbitMQPublisher

    for url in (
        f"amqp://guest:guest@127.0.0.1:{closed_port()}/%2F",
        f"amqp://guest:guest@{NOWHERE}:5672/%2F",
    ):
        assert (
            unreachable(RabbitMQPublisher(url, routing_key="q", timeout=2)) == ["DestinationUnavailable"] * 3
        )
    proxy = proxy_to(AMQP_PORT)
    lost = RabbitMQPublisher(
        f"amqp://guest:guest@127.0.0.1:{proxy.port}/%2F", routing_key=shared_queue, timeout=2
    )
    try:
        assert (
            through_an_outage(lost, lambda: (proxy.refuse(), proxy.cut()), proxy.accept) == UNAVAILABLE_CYCLE
        )
    finally:
        lost.close()


def test_async_rabbitmq_refused_lost_and_frozen(
    proxy_to: Callable[[int], TcpProxy], shared_queue: str
) -> None:
    """Issue 19 §1 and item 14 for aio-pika: refused/lost → DestinationUnavailable; a hung connection is
    bounded by the timeout, and the publisher reconnects afterwards."""
    from sa_outbox.publishers.aio_rabbitmq import AsyncRabbitMQPublisher

    proxy = proxy_to(AMQP_PORT)

    async def go() -> dict[str, Any]:
        refused = AsyncRabbitMQPublisher(f"amqp://guest:guest@127.0.0.1:{closed_port()}/", timeout=2)
        pub = AsyncRabbitMQPublisher(
            f"amqp://guest:guest@127.0.0.1:{proxy.port}/", routing_key=shared_queue, timeout=2
        )
        out: dict[str, Any] = {}
        try:
            out["refused"] = kinds(await refused.publish_many([msg(1), msg(2)]))
            out["first"] = kinds(await pub.publish_many([msg(1)]))
            proxy.refuse()
            proxy.cut()
            await asyncio.sleep(0.2)
            out["lost"] = kinds(await pub.publish_many([msg(2), msg(3)]))
            proxy.accept()
            out["back"] = kinds(await pub.publish_many([msg(4)]))
            proxy.freeze()
            t0 = time.monotonic()
            out["frozen"] = kinds(
                await asyncio.wait_for(pub.publish_many([msg(i) for i in range(5, 15)]), 60)
            )
            out["frozen_took"] = time.monotonic() - t0
            proxy.thaw()
            proxy.cut()
            out["after"] = kinds(await pub.publish_many([msg(20)]))
        finally:
            await asyncio.wait_for(refused.close(), 10)
            await asyncio.wait_for(pub.close(), 10)
        return out

    out = asyncio.run(go())
    print(f"aio-pika frozen: publish_many(10) {out['frozen_took']:.1f}s (timeout=2)")
    assert out["refused"] == ["DestinationUnavailable"] * 2
    assert out["first"] == ["ok"] and out["back"] == ["ok"] and out["after"] == ["ok"]
    assert out["lost"] == ["DestinationUnavailable"] * 2
    assert set(out["frozen"]) == {"NoAnswer"} and out["frozen_took"] < 3 * 2


def test_async_rabbitmq_connection_lost_between_connect_and_channel(
    proxy_to: Callable[[int], TcpProxy], shared_queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broker restart that lands between the connection's handshake and the channel's open (aiormq then
    raises a bare ``RuntimeError("... closed")``, seen in CI) is DestinationUnavailable for the call, and the
    next call reconnects — not an unclassified exception out of the publisher."""
    import aio_pika

    from sa_outbox.publishers.aio_rabbitmq import AsyncRabbitMQPublisher

    proxy = proxy_to(AMQP_PORT)
    real_connect = aio_pika.connect
    cuts = 0

    async def connect_then_lose_it(*args: Any, **kwargs: Any) -> Any:
        nonlocal cuts
        conn = await real_connect(*args, **kwargs)
        if cuts == 0:  # the first connection dies at once, before the publisher opens its channel
            cuts += 1
            proxy.cut()
            for _ in range(200):
                if conn.is_closed:
                    break
                await asyncio.sleep(0.01)
        return conn

    monkeypatch.setattr(aio_pika, "connect", connect_then_lose_it)

    async def go() -> tuple[list[str], list[str], bool]:
        pub = AsyncRabbitMQPublisher(
            f"amqp://guest:guest@127.0.0.1:{proxy.port}/", routing_key=shared_queue, timeout=5
        )
        try:
            lost = kinds(await pub.publish_many([msg(1), msg(2)]))
            back = kinds(await pub.publish_many([msg(3)]))
        finally:
            await asyncio.wait_for(pub.close(), 10)
        return lost, back, cuts == 1

    lost, back, did_cut = asyncio.run(go())
    assert did_cut
    assert lost == ["DestinationUnavailable"] * 2
    assert back == ["ok"]


# --- Redis: private servers for memory limits, replicas, scripts and failed saves ------------------------


@pytest.fixture
def private_redis() -> Iterator[Callable[..., PrivateRedis]]:
    servers: list[PrivateRedis] = []

    def start(*args: str) -> PrivateRedis:
        servers.append(PrivateRedis(*args))
        servers[-1].start()
        return servers[-1]

    yield start
    for s in reversed(servers):
        s.close()


def _redis_outcomes(url: str) -> tuple[BaseException | None, list[str]]:
    from sa_outbox.publishers.redis import RedisStreamPublisher

    pub = RedisStreamPublisher(url, stream="s", timeout=2)
    try:
        return raised(lambda: pub.publish(msg(1))), kinds(pub.publish_many([msg(2), msg(3)]))
    finally:
        pub.close()


def test_redis_out_of_memory_is_transient_then_delivers(private_redis: Callable[..., PrivateRedis]) -> None:
    """Item 13: OOM (maxmemory + noeviction) is the destination refusing writes for now, not a bad message."""
    import redis

    server = private_redis("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    client = redis.Redis.from_url(server.url)
    for i in range(100):  # fill up to maxmemory
        if raised(lambda i=i: client.set(f"ballast:{i}", b"x" * 100_000)) is not None:  # type: ignore[misc]
            break
    single, batch = _redis_outcomes(server.url)
    assert type(single) is DestinationUnavailable and "OOM" in str(single)
    assert batch == ["DestinationUnavailable"] * 2
    client.flushall()
    assert _redis_outcomes(server.url) == (None, ["ok", "ok"])
    client.close()


def test_redis_readonly_replica_is_transient(private_redis: Callable[..., PrivateRedis]) -> None:
    """Item 13: READONLY is what a client still connected to a demoted master sees right after a failover."""

    primary = private_redis()
    replica = private_redis("--replicaof", "127.0.0.1", str(primary.port))
    single, batch = _redis_outcomes(replica.url)
    assert type(single) is DestinationUnavailable and "READONLY" in str(single)
    assert batch == ["DestinationUnavailable"] * 2
    redis_call(replica.url, "replicaof", "NO", "ONE")  # the failover completes: it is the primary now
    assert _redis_outcomes(replica.url) == (None, ["ok", "ok"])


def test_redis_busy_script_is_transient(private_redis: Callable[..., PrivateRedis]) -> None:
    """Item 13: BUSY (a script runs past busy-reply-threshold) passes once the script ends."""

    server = private_redis("--busy-reply-threshold", "100")
    blocker = threading.Thread(
        target=lambda: raised(lambda: redis_call(server.url, "eval", "while true do end", 0)),
        daemon=True,
    )
    blocker.start()
    time.sleep(0.5)
    try:
        single, batch = _redis_outcomes(server.url)
    finally:
        redis_call(server.url, "script_kill")
        blocker.join(10)
    assert type(single) is DestinationUnavailable and "BUSY" in str(single)
    assert batch == ["DestinationUnavailable"] * 2


def test_redis_misconf_after_a_failed_save_is_transient(private_redis: Callable[..., PrivateRedis]) -> None:
    """Item 13: MISCONF (the last background save failed, stop-writes-on-bgsave-error) is not a bad message."""
    import shutil

    import redis

    server = private_redis(
        "--enable-protected-configs", "yes", "--save", "3600 1"
    )  # MISCONF needs save points
    client = redis.Redis.from_url(server.url)
    gone = server.dir / "gone"
    gone.mkdir()
    client.config_set("dir", str(gone))
    shutil.rmtree(gone)
    client.bgsave()
    deadline = time.monotonic() + 10
    while client.info("persistence")["rdb_last_bgsave_status"] != "err" and time.monotonic() < deadline:
        time.sleep(0.05)
    single, batch = _redis_outcomes(server.url)
    client.close()
    assert type(single) is DestinationUnavailable and "MISCONF" in str(single)
    assert batch == ["DestinationUnavailable"] * 2


def test_redis_error_replies_are_classified() -> None:
    """The replies no single server can be made to give here (cluster, loading): classified by their code."""
    import redis.exceptions as rex

    from sa_outbox.publishers.redis import classify_redis_error

    assert type(classify_redis_error(rex.BusyLoadingError("Redis is loading the dataset in memory"))) is (
        DestinationUnavailable
    )
    assert (
        type(classify_redis_error(rex.MasterDownError("Link with MASTER is down"))) is DestinationUnavailable
    )
    assert type(classify_redis_error(rex.ClusterDownError("The cluster is down"))) is DestinationUnavailable
    assert type(classify_redis_error(rex.TryAgainError("Multiple keys request during rehashing"))) is (
        RetryableError
    )
    assert (
        type(classify_redis_error(rex.ResponseError("WRONGTYPE Operation against a key"))) is PermanentError
    )
    assert type(classify_redis_error(rex.ResponseError("ERR syntax error"))) is PermanentError


def test_redis_refused_stopped_and_unknown_host_are_destination_unavailable(
    private_redis: Callable[..., PrivateRedis],
) -> None:
    """Issue 19 §1: nothing listening, a server that went away, a name that does not resolve."""
    from sa_outbox.publishers.redis import RedisStreamPublisher

    for url in (f"redis://127.0.0.1:{closed_port()}/0", f"redis://{NOWHERE}:6379/0"):
        assert unreachable(RedisStreamPublisher(url, stream="s", timeout=2)) == ["DestinationUnavailable"] * 3
    server = private_redis()
    pub = RedisStreamPublisher(server.url, stream="s", timeout=2)
    try:
        assert through_an_outage(pub, server.stop, server.start) == UNAVAILABLE_CYCLE
    finally:
        pub.close()


def test_redis_publish_through_a_frozen_connection_returns_within_its_timeout(
    proxy_to: Callable[[int], TcpProxy],
) -> None:
    """Item 14: redis-py retries a timed-out command by default (10 times with backoff); one deadline here."""
    import redis

    from sa_outbox.publishers.redis import RedisStreamPublisher

    stream = f"sa_outbox_test:{uuid.uuid4().hex[:8]}"
    proxy = proxy_to(REDIS_PORT)
    pub = RedisStreamPublisher(f"redis://127.0.0.1:{proxy.port}/0", stream=stream, timeout=1)
    try:
        frozen = Frozen(proxy, pub, "redis", 1)
    finally:
        pub.close()
        with redis.Redis(port=REDIS_PORT) as cleanup:
            cleanup.delete(stream)
    assert frozen.bounded()


def test_redis_that_answers_nothing_is_destination_unavailable_not_a_failed_message(
    proxy_to: Callable[[int], TcpProxy], private_redis: Callable[..., PrivateRedis]
) -> None:
    """A hung Redis (a frozen proxy in front of it: connections open, no reply) timed every XADD out as a
    RetryableError, so an outage spent attempts and sent messages to dead (a hostile review). A PING after the
    timeout that gets no answer either makes it DestinationUnavailable; a write that times out on a server
    that still answers (writes paused, as during a failover) is NoAnswer (no verdict on the message)."""
    import redis

    from sa_outbox.publishers.redis import RedisStreamPublisher

    proxy = proxy_to(REDIS_PORT)
    pub = RedisStreamPublisher(f"redis://127.0.0.1:{proxy.port}/0", stream=f"sa_outbox_test:{uuid.uuid4().hex[:8]}",
                               timeout=0.5)  # fmt: skip
    try:
        assert pub.publish_many([msg(1)]) == [None]
        proxy.freeze()
        single = raised(lambda: pub.publish(msg(2)))
        batch = pub.publish_many([msg(3), msg(4)])
        assert type(single) is DestinationUnavailable and "PING got no answer" in str(single)
        assert kinds(batch) == ["DestinationUnavailable"] * 2
        proxy.thaw()
        proxy.cut()
        assert pub.publish_many([msg(5)]) == [None]
    finally:
        pub.close()
        with redis.Redis(port=REDIS_PORT) as cleanup:
            cleanup.delete(pub.stream)  # type: ignore[arg-type]
    server = private_redis()
    client = redis.Redis.from_url(server.url)
    paused = RedisStreamPublisher(server.url, stream="s", timeout=0.5)
    try:
        client.execute_command("CLIENT", "PAUSE", "3000", "WRITE")
        slow = raised(lambda: paused.publish(msg(6)))
        assert type(slow) is NoAnswer and "answers PING" in str(slow), slow
    finally:
        paused.close()
        client.close()


# --- NATS JetStream: a private server with a small max_payload --------------------------------------------


def _add_stream(url: str, name: str, subjects: str) -> None:
    import nats

    async def go() -> None:
        nc = await nats.connect(url)
        await nc.jetstream().add_stream(name=name, subjects=[subjects])
        await nc.close()

    asyncio.run(go())


@pytest.fixture
def shared_stream() -> Iterator[str]:
    """A stream of its own on the shared NATS (subjects ``<prefix>.>``); yields the subject prefix."""
    import nats

    name = f"SAOUTBOXF{uuid.uuid4().hex[:6].upper()}"
    _add_stream(f"nats://127.0.0.1:{NATS_PORT}", name, f"{name.lower()}.>")
    yield name.lower()

    async def drop() -> None:
        nc = await nats.connect(f"nats://127.0.0.1:{NATS_PORT}")
        await nc.jetstream().delete_stream(name)
        await nc.close()

    asyncio.run(drop())


def test_nats_message_over_max_payload_is_permanent_and_names_both_sizes() -> None:
    """Item 17: too big for the server is permanent at once, checked before sending (envelope and headers
    included, which the client library does not count), and the connection stays usable."""
    from sa_outbox.publishers._common import envelope_json, headers_for
    from sa_outbox.publishers.nats import NatsPublisher

    def _wire_size(m: Message) -> int:  # what nats-server counts: body + "NATS/1.0" header block
        headers = {
            "Nats-Msg-Id": m.message_id,
            **{f"Outbox-{k.title()}": v for k, v in headers_for(m).items()},
        }
        return (
            len(envelope_json(m))
            + len("NATS/1.0\r\n\r\n")
            + sum(len(f"{k}: {v}\r\n") for k, v in headers.items())
        )

    server = PrivateNats(max_payload=4096)
    server.start()
    try:
        _add_stream(server.url, "S", "s.>")
        pub = NatsPublisher(server.url, subject_prefix="s", timeout=2)
        big = msg(2, {"s": "x" * 5000})
        near = next(
            m
            for n in range(3700, 4096)
            if 4096 - 100 < len(envelope_json(m := msg(3, {"s": "y" * n}))) <= 4096
        )  # fits the library's check on the body alone, not the server's on body + headers
        try:
            results = pub.publish_many([msg(1), big, near, msg(4)])
            single = raised(lambda: pub.publish(big))
        finally:
            pub.close()
    finally:
        server.close()
    assert kinds(results) == ["ok", "PermanentError", "PermanentError", "ok"]
    text = str(single).replace(",", "")
    assert type(single) is PermanentError and "max_payload of 4096 bytes" in text
    assert f"{_wire_size(big)} bytes as sent" in text


def test_nats_message_over_the_stream_max_msg_size_is_permanent(shared_stream: str) -> None:
    import nats

    from sa_outbox.publishers.nats import NatsPublisher

    async def limit() -> None:
        nc = await nats.connect(f"nats://127.0.0.1:{NATS_PORT}")
        js = nc.jetstream()
        config = (await js.stream_info(shared_stream.upper())).config
        config.max_msg_size = 1000
        await js.update_stream(config)
        await nc.close()

    asyncio.run(limit())
    pub = NatsPublisher(f"nats://127.0.0.1:{NATS_PORT}", subject_prefix=shared_stream, timeout=2)
    try:
        results = pub.publish_many([msg(1), msg(2, {"s": "x" * 2000})])
    finally:
        pub.close()
    assert kinds(results) == ["ok", "PermanentError"] and "max_msg_size" in str(results[1])


def test_nats_refused_stopped_and_unknown_host_are_destination_unavailable() -> None:
    """Issue 19 §1: NoServersError, a server that went away, a name that does not resolve."""
    from sa_outbox.publishers.nats import AsyncNatsPublisher, NatsPublisher

    for url in (f"nats://127.0.0.1:{closed_port()}", f"nats://{NOWHERE}:4222"):
        assert unreachable(NatsPublisher(url, timeout=2)) == ["DestinationUnavailable"] * 3
    server = PrivateNats()
    server.start()
    try:
        _add_stream(server.url, "S", "s.>")
        pub = NatsPublisher(server.url, subject_prefix="s", timeout=2)
        try:
            assert through_an_outage(pub, server.stop, server.start) == UNAVAILABLE_CYCLE
        finally:
            pub.close()

        async def lost() -> list[str]:  # the async face, the server stopping under an open connection
            apub = AsyncNatsPublisher(server.url, subject_prefix="s", timeout=2)
            try:
                first = await apub.publish_many([msg(1)])
                server.stop()
                await asyncio.sleep(0.3)
                return kinds(first + await apub.publish_many([msg(2), msg(3)]))
            finally:
                await apub.close()

        assert asyncio.run(lost()) == ["ok", "DestinationUnavailable", "DestinationUnavailable"]
    finally:
        server.close()


def test_nats_publish_through_a_frozen_connection_returns_within_its_timeout(
    proxy_to: Callable[[int], TcpProxy], shared_stream: str
) -> None:
    from sa_outbox.publishers.nats import NatsPublisher

    proxy = proxy_to(NATS_PORT)
    pub = NatsPublisher(f"nats://127.0.0.1:{proxy.port}", subject_prefix=shared_stream, timeout=1)
    try:
        frozen = Frozen(proxy, pub, "nats", 1)
    finally:
        pub.close()
    assert frozen.bounded()


# --- MQTT (Mosquitto) -------------------------------------------------------------------------------------


def test_mqtt_batch_through_a_frozen_connection_has_one_deadline(proxy_to: Callable[[int], TcpProxy]) -> None:
    """Item 14: publish_many waited the full timeout per message in turn (10 x 2 s); one deadline now."""
    from sa_outbox.publishers.mqtt import MQTTPublisher

    proxy = proxy_to(MQTT_PORT)
    pub = MQTTPublisher(
        "127.0.0.1", proxy.port, topic_prefix=f"sa_outbox_faults_{uuid.uuid4().hex[:6]}", timeout=2
    )
    try:
        frozen = Frozen(proxy, pub, "mqtt", 2)
    finally:
        pub.close()
    assert frozen.bounded()


def test_mqtt_refused_stopped_and_unknown_host_are_destination_unavailable() -> None:
    """Issue 19 §1: connection refused, a broker that went away, a name that does not resolve."""
    from sa_outbox.publishers.mqtt import MQTTPublisher

    for host, port in (("127.0.0.1", closed_port()), (NOWHERE, 1883)):
        assert unreachable(MQTTPublisher(host, port, timeout=2)) == ["DestinationUnavailable"] * 3
    server = PrivateMosquitto()
    server.start()
    pub = MQTTPublisher("127.0.0.1", server.port, timeout=2)
    try:
        assert through_an_outage(pub, server.stop, server.start) == UNAVAILABLE_CYCLE
    finally:
        pub.close()
        server.close()


# --- HTTP webhooks: a scripted server in a thread -----------------------------------------------------------


class _Receiver(BaseHTTPRequestHandler):
    """Answers by path: ``/ok``; ``/status/<code>`` (query ``retry_after``, ``location``); ``/trickle-headers``;
    ``/trickle/<code>`` (headers at once, then the body a byte every 0.5 s); ``/huge/<code>`` (a 256 MB
    body); ``/gzip-broken``; ``/slow`` (answers after 10 s). Requests are recorded; ``sent`` counts body bytes
    the server managed to write."""

    protocol_version = "HTTP/1.1"
    received: ClassVar[list[tuple[str, str, dict[str, str], bytes]]] = []
    sent: ClassVar[list[int]] = []
    stop: ClassVar[threading.Event]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).received.append(("POST", self.path, dict(self.headers), body))
        path, _, query = self.path.partition("?")
        params = {k: unquote(v) for k, v in (p.split("=", 1) for p in query.split("&") if "=" in p)}
        parts = path.strip("/").split("/")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            getattr(self, "answer_" + parts[0].replace("-", "_"))(*parts[1:], **params)

    def raw(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()

    def trickle(self, data: bytes) -> None:
        for i in range(len(data)):
            if type(self).stop.wait(0.5):
                return
            self.raw(data[i : i + 1])

    def answer_ok(self) -> None:
        self.raw(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    def answer_status(self, code: str, retry_after: str | None = None, location: str | None = None) -> None:
        extra = f"Retry-After: {retry_after}\r\n" if retry_after is not None else ""
        extra += f"Location: {location}\r\n" if location is not None else ""
        self.raw(f"HTTP/1.1 {code} X\r\n{extra}Content-Length: 4\r\n\r\nnope".encode("latin-1"))

    def answer_trickle_headers(self) -> None:
        self.raw(b"HTTP/1.1 200 OK\r\n")
        self.trickle(b"X-Slow: " + b"x" * 200 + b"\r\nContent-Length: 0\r\n\r\n")

    def answer_trickle(self, code: str) -> None:
        self.raw(f"HTTP/1.1 {code} X\r\nContent-Length: 1000\r\n\r\n".encode())
        self.trickle(b"e" * 1000)

    def answer_huge(self, code: str) -> None:
        size, chunk = 256 * 1024 * 1024, b"z" * (1024 * 1024)
        self.raw(f"HTTP/1.1 {code} X\r\nContent-Length: {size}\r\n\r\n".encode())
        for _ in range(size // len(chunk)):
            self.raw(chunk)
            type(self).sent.append(len(chunk))

    def answer_gzip_broken(self) -> None:
        self.raw(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 10\r\n\r\nnot-gzip!!")

    def answer_slow(self) -> None:
        if not type(self).stop.wait(10):
            self.answer_ok()

    def answer_new(self) -> None:
        self.answer_ok()

    def answer_hangup(self) -> None:
        """The connection closed after the request, no answer (a receiver that crashed, a proxy's reset)."""
        self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[tuple[str, type[_Receiver]]]:
    handler = type("Receiver", (_Receiver,), {"received": [], "sent": [], "stop": threading.Event()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    handler.stop.set()
    server.shutdown()
    server.server_close()


def _webhook(url: str, message: Message | None = None, **options: Any) -> tuple[BaseException | None, float]:
    """Publish one message with the sync and the async webhook publisher; (outcome, seconds) of each must
    agree — the sync one's is returned, the async one's is asserted equal in kind."""
    from sa_outbox.publishers.http import AsyncWebhookPublisher, WebhookPublisher

    m = message or msg(1)
    pub = WebhookPublisher(url, **options)
    try:
        outcome, took = bounded(lambda: raised(lambda: pub.publish(m)), 60)
    finally:
        pub.close()

    async def go() -> BaseException | None:
        apub = AsyncWebhookPublisher(url, **options)
        try:
            return await asyncio.wait_for(_catch(apub.publish(m)), 60)
        finally:
            await apub.aclose()

    async_outcome = asyncio.run(go())
    assert type(async_outcome) is type(outcome), (outcome, async_outcome)
    return outcome, took


async def _catch(coro: Any) -> BaseException | None:
    try:
        await coro
    except BaseException as exc:
        return exc
    return None


def test_webhook_trickled_response_headers_are_bounded_by_the_timeout(receiver: Any) -> None:
    """Item 14: the timeout was per read; a byte every 0.5 s held a call for as long as the server liked."""
    base, _ = receiver
    outcome, took = _webhook(f"{base}/trickle-headers", timeout=2)
    print(f"webhook, headers trickled: {took:.1f}s (timeout=2)")
    assert type(outcome) is NoAnswer and took < 3 * 2


def test_webhook_trickled_error_body_is_bounded_by_the_timeout(receiver: Any) -> None:
    base, _ = receiver
    outcome, took = _webhook(f"{base}/trickle/500", timeout=2)
    assert type(outcome) is RetryableError and "HTTP 500" in str(outcome) and took < 3 * 2


def test_webhook_2xx_is_delivered_whatever_its_body(receiver: Any) -> None:
    """Item 16: the receiver took the message once it answered 2xx; a slow, broken or huge body must not turn a
    delivered message into a retry (a second delivery)."""
    base, hook = receiver
    for path in ("/trickle/200", "/gzip-broken", "/huge/200"):
        outcome, took = _webhook(f"{base}{path}", timeout=2)
        assert outcome is None and took < 3 * 2, path
    assert sum(hook.sent) < 64 * 1024 * 1024  # the 256 MB body was not read


def test_webhook_reads_only_a_prefix_of_an_error_body(receiver: Any) -> None:
    """Item 16: a large error body was read whole (512 MB → 1-2 GB RSS); only a prefix is read for the text."""
    base, hook = receiver
    outcome, took = _webhook(f"{base}/huge/500", timeout=5)
    assert type(outcome) is RetryableError and str(outcome).count("z") <= 200 and took < 3 * 5
    assert sum(hook.sent) < 64 * 1024 * 1024


def test_webhook_retry_after_zero_or_past_is_floored(receiver: Any) -> None:
    """Item 15: Retry-After 0 (or a past date) refunded the attempt and came back at once (~1,800 POST/s)."""
    from sa_outbox import Defer

    base, _ = receiver
    for value in ("0", "Wed,%2021%20Oct%202015%2007:28:00%20GMT"):
        outcome, _took = _webhook(f"{base}/status/503?retry_after={value}")
        assert isinstance(outcome, Defer) and outcome.delay == timedelta(seconds=1), value
    outcome, _took = _webhook(f"{base}/status/429?retry_after=0", min_retry_after=5)
    assert isinstance(outcome, Defer) and outcome.delay == timedelta(seconds=5)


def test_webhook_deferrals_stop_refunding_past_max_defer_age(receiver: Any) -> None:
    """Item 15: a receiver that always answers Retry-After <= 300 parked messages forever; past max_defer_age
    (message age, from created_at) a Retry-After is a plain retryable failure: attempts are spent."""
    from sa_outbox import Defer

    base, _ = receiver
    fresh, _took = _webhook(f"{base}/status/429?retry_after=30")
    old = msg(1, created_at=datetime.now(UTC) - timedelta(hours=2))
    aged, _took = _webhook(f"{base}/status/429?retry_after=30", old)
    kept, _took = _webhook(f"{base}/status/429?retry_after=30", old, max_defer_age=None)
    assert isinstance(fresh, Defer) and fresh.delay == timedelta(seconds=30)
    assert type(aged) is RetryableError and "max_defer_age" in str(aged)
    assert isinstance(kept, Defer)


def test_webhook_malformed_retry_after_is_ignored(receiver: Any) -> None:
    """Item 16: a malformed Retry-After raised ValueError (unclassified); it is treated as absent."""
    base, _ = receiver
    for value in ("soon", "-5", "Wed,%2099%20Foo%202015", "1.5", "%C2%B2"):
        outcome, _took = _webhook(f"{base}/status/503?retry_after={value}")
        assert type(outcome) is RetryableError and "HTTP 503" in str(outcome), value


def test_webhook_follows_307_and_308_keeping_method_and_body(receiver: Any) -> None:
    """Item 16: 307/308 mean "POST the same thing there"; followed on the same origin, up to max_redirects."""
    base, hook = receiver
    for code in ("307", "308"):
        outcome, _took = _webhook(f"{base}/status/{code}?location=/new")
        assert outcome is None, code
    redirected = [(method, path, headers["Idempotency-Key"], json.loads(body)["message_id"])
                  for method, path, headers, body in hook.received if path == "/new"]  # fmt: skip
    assert redirected == [("POST", "/new", "1", "1")] * 4  # sync and async, 307 and 308
    loop, _took = _webhook(f"{base}/status/307?location=/status/307%3Flocation=/new", max_redirects=0)
    assert type(loop) is PermanentError and "redirect" in str(loop)


def test_webhook_other_redirects_are_permanent_with_the_new_location(receiver: Any) -> None:
    """Item 16: 301/302/303 would turn the POST into a GET; a redirect to another origin could leak the
    headers: both are a configuration to fix, said clearly (PermanentError naming the Location)."""
    base, hook = receiver
    for code in ("301", "302", "303"):
        outcome, _took = _webhook(f"{base}/status/{code}?location=/new")
        assert type(outcome) is PermanentError and "/new" in str(outcome), code
    away, _took = _webhook(f"{base}/status/307?location=http://{NOWHERE}/new")
    assert type(away) is PermanentError and NOWHERE in str(away)
    assert not [path for _, path, _, _ in hook.received if path == "/new"]


def test_webhook_close_works_sync_and_async() -> None:
    """Item 16: AsyncWebhookPublisher.close() raised (it called a sync close on an AsyncClient)."""
    from sa_outbox.publishers.http import AsyncWebhookPublisher, WebhookPublisher

    sync = WebhookPublisher("http://127.0.0.1:1/")
    sync.close()
    assert sync.client.is_closed

    async def go() -> tuple[bool, bool]:
        a, b = AsyncWebhookPublisher("http://127.0.0.1:1/"), AsyncWebhookPublisher("http://127.0.0.1:1/")
        await a.close()
        await b.aclose()
        return a.client.is_closed, b.client.is_closed

    assert asyncio.run(go()) == (True, True)


def test_webhook_connect_failures_are_destination_unavailable_not_timeouts_or_5xx(receiver: Any) -> None:
    """Issue 19 §1: refused and DNS failure mean the receiver is down; a slow answer or a 5xx is this
    message's failure."""
    base, _ = receiver
    for url in (f"http://127.0.0.1:{closed_port()}/", f"http://{NOWHERE}/"):
        outcome, _took = _webhook(url, timeout=2)
        assert type(outcome) is DestinationUnavailable, url
    slow, _took = _webhook(f"{base}/slow", timeout=1)
    assert type(slow) is NoAnswer
    # a connection closed before any answer: no verdict either (as a plain RetryableError a network fault sent
    # messages to dead: a hostile review, 20 dropped connections in 6 s, 18-20 dead)
    hangup, _took = _webhook(f"{base}/hangup", timeout=2)
    assert type(hangup) is NoAnswer and "Server disconnected" in str(hangup), hangup
    err, _took = _webhook(f"{base}/status/502")
    assert type(err) is RetryableError


def test_rabbitmq_a_failing_routing_key_callable_fails_only_its_message(shared_queue: str) -> None:
    """The I/O thread never runs user code: a routing_key callable that raises fails its own message (an
    unclassified error the dispatcher logs with its traceback), and the others of the batch go out."""
    from sa_outbox.publishers.rabbitmq import RabbitMQPublisher

    pub = RabbitMQPublisher(
        SHARED_AMQP, routing_key=lambda m: shared_queue if m.id != 2 else str(1 / 0), timeout=2
    )
    try:
        results = pub.publish_many([msg(1), msg(2), msg(3)])
    finally:
        pub.close()
    assert kinds(results) == ["ok", "ZeroDivisionError", "ok"]
    assert _queue_ids(SHARED_AMQP, shared_queue) == ["1", "3"]


# --- a message whose content the broker or its client refuses: that message is permanent -------------------


def test_a_message_a_broker_refuses_for_its_content_is_permanent_and_the_batch_goes_on(
    shared_queue: str, shared_stream: str
) -> None:
    """An event type of 300 characters (an AMQP routing key and type property hold 255 bytes), a control
    character in an MQTT topic or MQTT v5 user property (Mosquitto drops the connection), a space in a NATS
    subject: the same message fails at every try, whatever the broker's health. Reported as a lost connection
    (DestinationUnavailable), it was refunded at every try and the circuit's probe took it again, so one such
    message stopped every dispatcher for good (a hostile review: 13 of 6,601 delivered in 120 s). Each is now
    a PermanentError naming what is wrong, and the rest of the batch is delivered."""
    from sa_outbox.publishers.aio_rabbitmq import AsyncRabbitMQPublisher
    from sa_outbox.publishers.mqtt import MQTTPublisher
    from sa_outbox.publishers.nats import NatsPublisher
    from sa_outbox.publishers.rabbitmq import RabbitMQPublisher

    long_type = "order." + "x" * 300
    cases: list[tuple[str, Any, Message, str]] = [
        ("rabbitmq", RabbitMQPublisher(SHARED_AMQP, timeout=3), msg(1, event_type=long_type), "routing key"),
        ("rabbitmq key", RabbitMQPublisher(SHARED_AMQP, routing_key=shared_queue, timeout=3),
         msg(2, event_type=long_type), "type property"),
        ("mqtt topic", MQTTPublisher("127.0.0.1", MQTT_PORT, topic_prefix="sa_outbox_poison", timeout=3),
         msg(3, event_type="order\x01placed"), "topic"),
        ("mqtt v5 header", MQTTPublisher("127.0.0.1", MQTT_PORT, topic_prefix="sa_outbox_poison", timeout=3,
                                         protocol="5"),
         Message(4, "4", "order", "4", "x", {}, 1, 1, datetime.now(UTC), {"x-note": "a\tb"}), "header 'x-note'"),
        ("nats", NatsPublisher(f"nats://127.0.0.1:{NATS_PORT}", subject_prefix=shared_stream, timeout=3),
         msg(5, event_type="order placed"), "NATS subject"),
    ]  # fmt: skip
    for name, pub, poison, what in cases:
        try:
            good = msg(10, event_type=shared_queue if name == "rabbitmq" else "ok")
            results = pub.publish_many([poison, good])
            assert isinstance(results[0], PermanentError) and what in str(results[0]), (name, results)
            assert results[1] is None, (name, results)
            assert isinstance(raised(lambda pub=pub, poison=poison: pub.publish(poison)), PermanentError), (
                name
            )
        finally:
            pub.close()

    async def aio() -> list[BaseException | None]:
        pub = AsyncRabbitMQPublisher(SHARED_AMQP, timeout=3)
        try:
            return await pub.publish_many([msg(6, event_type=long_type), msg(7, event_type=shared_queue)])
        finally:
            await pub.close()

    results = asyncio.run(aio())
    assert isinstance(results[0], PermanentError) and "AMQP carries at most 255" in str(results[0])
    assert results[1] is None


# --- a stall on a working connection: NoAnswer never spends a message's last attempt -----------------------


def test_no_answer_on_the_last_attempt_gives_the_attempt_back_instead_of_dead(
    engine: Engine, proxy_to: Callable[[int], TcpProxy]
) -> None:
    """A message on its last attempt meets a stall of its established connection (no PUBACK within the
    timeout): it went dead, and its ordered aggregate blocked, for a network fault (a hostile review, all four
    brokers). The publisher now says NoAnswer; the attempt is refunded, the message is pending again after the
    backoff, and delivered once the network answers."""
    from sa_outbox.publishers.mqtt import MQTTPublisher

    proxy = proxy_to(MQTT_PORT)
    pub = MQTTPublisher(
        "127.0.0.1", proxy.port, topic_prefix=f"sa_outbox_stall_{uuid.uuid4().hex[:6]}", timeout=1
    )
    d = Dispatcher(
        engine, OutboxEvent, pub, ordered=True, max_attempts=1, backoff=Backoff(0.05, 0.1), listen=False
    )
    try:
        seed_events(engine, 1, aggregate="a")
        d.run(install_signal_handlers=False, until_idle=True)  # connects; the first event is delivered
        seed_events(engine, 1, aggregate="a", start=1)
        proxy.freeze()
        d.run(install_signal_handlers=False, max_batches=1)
        r = row(engine, "outbox", 2)
        assert (r.status, r.attempts) == ("pending", 0), (r.status, r.attempts, r.last_error)
        assert "no answer on its last attempt (1/1)" in r.last_error and "NoAnswer" in r.last_error
        proxy.thaw()
        proxy.cut()
        for _ in range(50):  # (due again after the backoff: 0.05-0.1 s)
            d.run(install_signal_handlers=False, until_idle=True)
            if statuses(engine, "outbox") == {"done": 2}:
                break
            time.sleep(0.05)
        assert statuses(engine, "outbox") == {"done": 2}
    finally:
        d.close()
        pub.close()


def test_decide_refunds_only_the_last_attempt_of_no_answer() -> None:
    from sa_outbox._sql import spec_for
    from sa_outbox._steps import decide

    spec = spec_for(OutboxEvent)
    backoff = Backoff(1, 2)
    early = decide(
        spec, id=1, lease_version=1, attempts=1, max_attempts=3, error=NoAnswer("x"), backoff=backoff
    )
    last = decide(
        spec, id=1, lease_version=3, attempts=3, max_attempts=3, error=NoAnswer("x"), backoff=backoff
    )
    plain = decide(spec, id=1, lease_version=3, attempts=3, max_attempts=3, error=RetryableError("x"),
                   backoff=backoff)  # fmt: skip
    assert (early.status, early.refund) == ("pending", 0)
    assert (last.status, last.refund, last.kind) == ("pending", 1, "retry") and last.delay is not None
    assert plain.status == "dead"


@pytest.mark.parametrize(
    "last_error",
    [
        "no answer on its last attempt (2/2), tried again later: NoAnswer: x",
        "DestinationUnavailable: connection refused",
        "released: destination unavailable",
    ],
    ids=["no-answer", "unavailable", "released-unavailable"],
)
def test_a_crash_right_after_an_outage_refund_rescues_the_row_once_not_to_dead(
    engine: Engine, last_error: str
) -> None:
    """A row whose last attempt was refunded for NoAnswer is at its last attempt at every claim while the stall
    lasts; a dispatcher killed then left it to the rescue's poison rule, which sent it to dead (a hostile
    review: kill -9 during a write pause, the event already on the broker six times, its aggregate blocked).
    The rescue gives it back once; a second crash in a row is the poison rule again. The same for a row whose
    last outcome was the refund of an outage (DestinationUnavailable, or the rest of its batch released for
    one): a stall's NoAnswer refund followed by an outage, then a kill -9 during the circuit's probe, sent the
    row to dead (a hostile review, stop 60: Redis CLIENT PAUSE WRITE, then ALL)."""
    from sa_outbox._sql import spec_for
    from sa_outbox._steps import claim, rescue

    from .factories import expire_leases

    spec = spec_for(OutboxEvent)
    seed_events(engine, 1, aggregate="a")
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET attempts = 1, last_error = :e"), {"e": last_error})
    outcomes = []
    for _ in range(2):
        with engine.begin() as conn:
            assert len(claim(conn, spec, owner="doomed", batch=1)) == 1  # attempts 2 of 2; then it dies
        expire_leases(engine, "outbox")
        with engine.begin() as conn:
            outcomes.append([r[1] for r in rescue(conn, spec, max_attempts=2)])
        with engine.begin() as conn:
            conn.execute(text("UPDATE outbox SET attempts = 1 WHERE status = 'pending'"))
    assert outcomes == [["pending"], ["dead"]]
    assert "after max attempts (worker crash?)" in row(engine, "outbox", 1).last_error
