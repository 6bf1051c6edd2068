"""Publishers against the real brokers of this machine: outbox row → dispatcher → broker → a real consumer.

A broker the suite needs that is not running fails these tests (CI starts them; see .ci/run).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pika
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from sa_outbox import Backoff, Dispatcher, Message
from sa_outbox.models import OutboxEvent
from sa_outbox.publishers.http import WebhookPublisher
from sa_outbox.publishers.nats import AsyncNatsPublisher, NatsPublisher
from sa_outbox.publishers.rabbitmq import RabbitMQPublisher
from sa_outbox.publishers.redis import RedisStreamPublisher
from sa_outbox.testing import drain

from .brokers import redis_call
from .helpers import row, statuses

AMQP = "amqp://guest:guest@127.0.0.1:5672/%2F"
NATS = "nats://127.0.0.1:4222"
REDIS = "redis://127.0.0.1:6379/0"
CLOSED = 1  # nothing listens on port 1
FAST = Backoff(0.001, 0.001, jitter=False)


def _business_tx(engine: Engine, n: int, event_type: str = "OrderPaid") -> None:
    """Events written the way an application writes them: in a business transaction through the session."""
    with Session(engine) as s, s.begin():
        for i in range(n):
            s.add(
                OutboxEvent(
                    aggregate_type="order", aggregate_id=str(i), event_type=event_type, payload={"n": i}
                )
            )


def _dispatch(engine: Engine, publisher: Any, **kw: Any) -> Dispatcher:
    d = Dispatcher(engine, OutboxEvent, publisher, listen=False, backoff=FAST, **kw)
    drain(d)
    return d


# --- RabbitMQ ------------------------------------------------------------------------------------------


@pytest.fixture
def rabbit_queue() -> Iterator[tuple[str, Any]]:
    conn = pika.BlockingConnection(pika.URLParameters(AMQP))
    ch = conn.channel()
    exchange, queue = f"sa_outbox_test_{uuid.uuid4().hex[:6]}", f"q_{uuid.uuid4().hex[:6]}"
    ch.exchange_declare(exchange, "topic", auto_delete=False)
    ch.queue_declare(queue, durable=True)
    ch.queue_bind(queue, exchange, routing_key="order.*")
    yield exchange, (ch, queue)
    ch.queue_delete(queue)
    ch.exchange_delete(exchange)
    conn.close()


def test_rabbitmq_end_to_end_with_ids_headers_and_payloads(engine: Engine, rabbit_queue: Any) -> None:
    exchange, (ch, queue) = rabbit_queue
    _business_tx(engine, 5)
    pub = RabbitMQPublisher(AMQP, exchange=exchange, routing_key=lambda m: f"order.{m.event_type}")
    _dispatch(engine, pub)
    pub.close()
    got = []
    for _ in range(5):
        method, props, body = ch.basic_get(queue, auto_ack=True)
        assert method is not None
        got.append((props, json.loads(body)))
    assert [int(p.message_id) for p, _ in got] == [1, 2, 3, 4, 5]
    props, body = got[0]
    assert props.delivery_mode == 2 and props.content_type == "application/json"
    assert props.headers["event-type"] == "OrderPaid" and props.headers["lease-version"] == "1"
    assert body["payload"] == {"n": 0} and body["message_id"] == "1" and body["aggregate_id"] == "0"
    assert statuses(engine) == {"done": 5}


def test_rabbitmq_down_keeps_messages_pending_then_delivers_all(engine: Engine, rabbit_queue: Any) -> None:
    exchange, (ch, queue) = rabbit_queue
    _business_tx(engine, 3)
    down = RabbitMQPublisher(
        f"amqp://guest:guest@127.0.0.1:{CLOSED}/%2F", exchange=exchange, routing_key="order.x", timeout=1
    )
    d = Dispatcher(engine, OutboxEvent, down, listen=False, backoff=FAST)
    assert d.run_once() == 3
    r = row(engine, "outbox", 1)
    assert r.status == "pending" and r.last_error.startswith("DestinationUnavailable: rabbitmq unavailable")
    time.sleep(0.01)
    up = RabbitMQPublisher(AMQP, exchange=exchange, routing_key="order.x")
    _dispatch(engine, up)
    up.close()
    assert statuses(engine) == {"done": 3}
    assert ch.queue_declare(queue, passive=True).method.message_count == 3


def test_rabbitmq_unroutable_is_retryable_by_default(engine: Engine, rabbit_queue: Any) -> None:
    exchange, _ = rabbit_queue
    _business_tx(engine, 1)
    pub = RabbitMQPublisher(AMQP, exchange=exchange, routing_key="nobody.listens")
    Dispatcher(engine, OutboxEvent, pub, listen=False, backoff=FAST).run_once()
    pub.close()
    r = row(engine, "outbox", 1)
    assert r.status == "pending" and "unroutable" in r.last_error


# --- NATS JetStream ------------------------------------------------------------------------------------


@pytest.fixture
def jetstream() -> Iterator[tuple[str, str]]:
    name = f"SAOUTBOX{uuid.uuid4().hex[:6].upper()}"
    prefix = name.lower()

    async def setup() -> None:
        nc = await __import__("nats").connect(NATS)
        await nc.jetstream().add_stream(name=name, subjects=[f"{prefix}.>"], duplicate_window=120)
        await nc.close()

    async def teardown() -> None:
        nc = await __import__("nats").connect(NATS)
        await nc.jetstream().delete_stream(name)
        await nc.close()

    asyncio.run(setup())
    yield name, prefix
    asyncio.run(teardown())


def _stream_messages(stream: str) -> list[Any]:
    async def read() -> list[Any]:
        nc = await __import__("nats").connect(NATS)
        js = nc.jetstream()
        info = await js.stream_info(stream)
        out = [await js.get_msg(stream, seq) for seq in range(info.state.first_seq, info.state.last_seq + 1)]
        await nc.close()
        return out

    return asyncio.run(read())


def test_nats_end_to_end_with_msg_id_header(engine: Engine, jetstream: tuple[str, str]) -> None:
    stream, prefix = jetstream
    _business_tx(engine, 4)
    pub = NatsPublisher(NATS, subject_prefix=prefix)
    _dispatch(engine, pub)
    pub.close()
    msgs = _stream_messages(stream)
    assert [m.headers["Nats-Msg-Id"] for m in msgs] == ["1", "2", "3", "4"]
    assert msgs[0].subject == f"{prefix}.OrderPaid"
    assert json.loads(msgs[0].data)["payload"] == {"n": 0}
    assert statuses(engine) == {"done": 4}


def test_nats_duplicate_window_drops_a_republish(engine: Engine, jetstream: tuple[str, str]) -> None:
    stream, prefix = jetstream
    _business_tx(engine, 1)
    pub = RecordingThenNats(prefix)
    _dispatch(engine, pub)
    # A lost lease: the same message (same id) is published again by another dispatcher.
    pub.nats.publish(pub.seen[0])
    pub.nats.close()
    msgs = _stream_messages(stream)
    assert len(msgs) == 1 and msgs[0].headers["Nats-Msg-Id"] == "1"


def test_two_outboxes_into_one_stream_keep_their_messages_apart_by_message_id_prefix(
    engine: Engine, jetstream: tuple[str, str]
) -> None:
    """Each outbox table numbers its events from 1: two services' dispatchers publishing into one JetStream
    stream sent the same Nats-Msg-Ids, and the stream's duplicate window dropped the second service's messages
    as duplicates (a review: 30 of 60 kept, every row marked done). With a message_id_prefix each, every
    message is kept, and one consumer's inbox applies each once."""
    from sa_outbox import Receipt, receive
    from sa_outbox.inbox import message_id_from_nats
    from sa_outbox.models import Inbox, model_for

    stream, subject = jetstream
    other = model_for("outbox", "payments_outbox")
    other.__table__.create(engine)
    try:
        _business_tx(engine, 3)
        with Session(engine) as s, s.begin():
            s.add_all(other(aggregate_type="payment", aggregate_id=str(i), event_type="PaymentTaken",
                            payload={"n": i}) for i in range(3))  # fmt: skip
        pub = NatsPublisher(NATS, subject_prefix=subject)
        for model, prefix in ((OutboxEvent, "orders:"), (other, "payments:")):
            drain(Dispatcher(engine, model, pub, listen=False, backoff=FAST, message_id_prefix=prefix))
        pub.close()
        msgs = _stream_messages(stream)
        ids = [m.headers["Nats-Msg-Id"] for m in msgs]
        assert ids == ["orders:1", "orders:2", "orders:3", "payments:1", "payments:2", "payments:3"], ids
        with Session(engine) as s, s.begin():
            receipts = [receive(s, Inbox, "ledger", message_id_from_nats(m)) for m in msgs]
        assert receipts == [Receipt.NEW] * 6
    finally:
        other.__table__.drop(engine)


def test_message_id_prefix_is_checked_when_the_dispatcher_is_made(engine: Engine) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    from sa_outbox import AsyncDispatcher, ConfigurationError
    from sa_outbox.testing import RecordingPublisher

    aengine = create_async_engine(engine.url.set(drivername="postgresql+psycopg_async"))  # (never connects)
    for bad in ("with space", "tab\t", "é:", "x" * 65, 7, "sa_outbox:head:"):
        with pytest.raises(ConfigurationError, match="message_id_prefix"):
            Dispatcher(engine, OutboxEvent, RecordingPublisher(), message_id_prefix=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="message_id_prefix"):
            AsyncDispatcher(aengine, OutboxEvent, RecordingPublisher(), message_id_prefix=bad)  # type: ignore[arg-type]
    pub = RecordingPublisher()
    _business_tx(engine, 2)
    drain(Dispatcher(engine, OutboxEvent, pub, listen=False, message_id_prefix="x" * 64))
    assert [m.message_id for m in pub.messages] == ["x" * 64 + "1", "x" * 64 + "2"]


class RecordingThenNats:
    def __init__(self, prefix: str) -> None:
        self.nats = NatsPublisher(NATS, subject_prefix=prefix)
        self.seen: list[Message] = []

    def publish(self, message: Message) -> None:
        self.seen.append(message)
        self.nats.publish(message)


def test_nats_down_is_destination_unavailable(engine: Engine) -> None:
    _business_tx(engine, 1)
    pub = NatsPublisher(f"nats://127.0.0.1:{CLOSED}", timeout=1)
    Dispatcher(engine, OutboxEvent, pub, listen=False, backoff=FAST).run_once()
    pub.close()
    r = row(engine, "outbox", 1)
    assert r.status == "pending" and r.last_error.startswith("DestinationUnavailable: nats")


def test_nats_async_batch_publish(jetstream: tuple[str, str]) -> None:
    from datetime import UTC, datetime

    stream, prefix = jetstream
    messages = [Message(i, str(i), "o", "1", "E", {"i": i}, 1, 1, datetime.now(UTC)) for i in range(1, 201)]

    async def go() -> list[BaseException | None]:
        pub = AsyncNatsPublisher(NATS, subject_prefix=prefix)
        try:
            return await pub.publish_many(messages)
        finally:
            await pub.close()

    assert asyncio.run(go()) == [None] * 200
    assert len(_stream_messages(stream)) == 200


# --- Redis Streams --------------------------------------------------------------------------------------


@pytest.fixture
def stream_key() -> Iterator[str]:
    key = f"sa_outbox_test:{uuid.uuid4().hex[:8]}"
    yield key
    redis_call(REDIS, "delete", key)


def test_redis_end_to_end(engine: Engine, stream_key: str) -> None:
    _business_tx(engine, 3)
    pub = RedisStreamPublisher(REDIS, stream=stream_key, maxlen=1000)
    _dispatch(engine, pub)
    entries = redis_call(REDIS, "xrange", stream_key, decode=True)
    assert [f["message_id"] for _, f in entries] == ["1", "2", "3"]
    assert json.loads(entries[0][1]["payload"]) == {"n": 0} and entries[0][1]["event_type"] == "OrderPaid"
    assert statuses(engine) == {"done": 3}


def test_redis_down_is_retryable_then_delivered(engine: Engine, stream_key: str) -> None:
    _business_tx(engine, 2)
    Dispatcher(engine, OutboxEvent, RedisStreamPublisher(f"redis://127.0.0.1:{CLOSED}/0", stream=stream_key, timeout=1),
               listen=False, backoff=FAST).run_once()  # fmt: skip
    assert statuses(engine) == {"pending": 2} and "redis unavailable" in row(engine, "outbox", 1).last_error
    time.sleep(0.01)
    _dispatch(engine, RedisStreamPublisher(REDIS, stream=stream_key))
    assert statuses(engine) == {"done": 2} and redis_call(REDIS, "xlen", stream_key) == 2


def test_redis_batch_publish_uses_one_round_trip_per_batch(stream_key: str) -> None:
    from datetime import UTC, datetime

    messages = [Message(i, str(i), "o", "1", "E", {"i": i}, 1, 1, datetime.now(UTC)) for i in range(1, 1001)]
    pub = RedisStreamPublisher(REDIS, stream=stream_key)
    t0 = time.perf_counter()
    for m in messages:
        pub.publish(m)
    one_by_one = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert pub.publish_many(messages) == [None] * 1000
    batched = time.perf_counter() - t0
    print(f"redis 1,000 messages: one by one {one_by_one * 1000:.1f} ms, pipelined {batched * 1000:.1f} ms")
    assert redis_call(REDIS, "xlen", stream_key) == 2000


# --- HTTP webhook ---------------------------------------------------------------------------------------


class _Hook(BaseHTTPRequestHandler):
    script: ClassVar[list[tuple[int, dict[str, str]]]] = []
    received: ClassVar[list[tuple[dict[str, str], Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).received.append((dict(self.headers), body))
        status, headers = type(self).script.pop(0) if type(self).script else (200, {})
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, type[_Hook]]]:
    handler = type("Hook", (_Hook,), {"script": [], "received": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", handler
    server.shutdown()
    server.server_close()


def test_webhook_end_to_end_with_idempotency_key(engine: Engine, webhook: Any) -> None:
    url, hook = webhook
    _business_tx(engine, 2)
    _dispatch(engine, WebhookPublisher(url))
    assert [h["Idempotency-Key"] for h, _ in hook.received] == ["1", "2"]
    assert (
        hook.received[0][1]["payload"] == {"n": 0}
        and hook.received[0][0]["X-Outbox-Event-Type"] == "OrderPaid"
    )
    assert statuses(engine) == {"done": 2}


def test_webhook_status_classes(engine: Engine, webhook: Any) -> None:
    url, hook = webhook
    _business_tx(engine, 4)
    hook.script[:] = [(503, {}), (429, {"Retry-After": "120"}), (400, {}), (200, {})]
    Dispatcher(engine, OutboxEvent, WebhookPublisher(url), listen=False, backoff=FAST).run_once()
    r1, r2, r3, r4 = (row(engine, "outbox", i) for i in (1, 2, 3, 4))
    assert (r1.status, r1.attempts) == ("pending", 1) and "HTTP 503" in r1.last_error  # retryable
    assert (r2.status, r2.attempts) == ("pending", 0) and "Retry-After 120s" in r2.last_error  # deferred
    assert r3.status == "dead" and "HTTP 400" in r3.last_error  # permanent
    assert r4.status == "done"


def test_webhook_network_error_is_retryable(engine: Engine) -> None:
    _business_tx(engine, 1)
    Dispatcher(
        engine, OutboxEvent, WebhookPublisher(f"http://127.0.0.1:{CLOSED}/", timeout=1), listen=False
    ).run_once()
    r = row(engine, "outbox", 1)
    assert r.status == "pending" and "ConnectError" in r.last_error


def test_webhook_retry_after_longer_than_the_cap_is_a_plain_retry(engine: Engine, webhook: Any) -> None:
    url, hook = webhook
    _business_tx(engine, 1)
    hook.script[:] = [(503, {"Retry-After": "86400"})]
    Dispatcher(engine, OutboxEvent, WebhookPublisher(url, max_retry_after=60), listen=False).run_once()
    r = row(engine, "outbox", 1)
    assert (r.status, r.attempts) == ("pending", 1) and r.last_error.startswith("RetryableError: HTTP 503")


def test_async_webhook_publisher_under_async_dispatcher(engine: Engine, webhook: Any, async_url: Any) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    from sa_outbox import AsyncDispatcher
    from sa_outbox.publishers.http import AsyncWebhookPublisher

    url, hook = webhook
    _business_tx(engine, 3)
    hook.script[:] = [(200, {}), (503, {}), (200, {})]

    async def go() -> None:
        aengine = create_async_engine(async_url)
        pub = AsyncWebhookPublisher(url)
        d = AsyncDispatcher(aengine, OutboxEvent, pub, listen=False, backoff=FAST)
        await d.run_once()
        await d.close()
        await pub.aclose()
        await aengine.dispose()

    asyncio.run(go())
    assert sorted(h["Idempotency-Key"] for h, _ in hook.received) == ["1", "2", "3"]
    assert statuses(engine) == {"done": 2, "pending": 1}


def test_rabbitmq_batch_publish_pipelines_its_confirms(engine: Engine, rabbit_queue: Any) -> None:
    from datetime import UTC, datetime

    exchange, (ch, queue) = rabbit_queue
    messages = [Message(i, str(i), "o", "1", "x", {"i": i}, 1, 1, datetime.now(UTC)) for i in range(1, 1001)]
    pub = RabbitMQPublisher(AMQP, exchange=exchange, routing_key="order.x")
    t0 = time.perf_counter()
    for m in messages[:200]:
        pub.publish(m)  # one confirm round trip per message
    one_by_one = (time.perf_counter() - t0) * 5  # scaled to 1,000
    t0 = time.perf_counter()
    assert pub.publish_many(messages) == [None] * 1000
    batched = time.perf_counter() - t0
    print(
        f"rabbitmq 1,000 messages: one by one with confirms ~{one_by_one * 1000:.0f} ms, pipelined confirms {batched * 1000:.0f} ms"
    )
    assert ch.queue_declare(queue, passive=True).method.message_count == 1200
    # Unroutable messages in a batch are reported per message; the routable ones are delivered.
    mixed = RabbitMQPublisher(
        AMQP, exchange=exchange, routing_key=lambda m: "order.x" if m.id % 2 else "nowhere"
    )
    results = mixed.publish_many(messages[:4])
    assert [r is None for r in results] == [True, False, True, False]
    assert "unroutable" in str(results[1])
    pub.close()
    mixed.close()


def test_dispatcher_uses_the_batch_form(engine: Engine, rabbit_queue: Any) -> None:
    exchange, (ch, queue) = rabbit_queue
    _business_tx(engine, 30)
    pub = RabbitMQPublisher(AMQP, exchange=exchange, routing_key="order.x")
    calls = []
    real = pub.publish_many

    def counting(messages: Any) -> Any:
        calls.append(len(messages))
        return real(messages)

    pub.publish_many = counting  # type: ignore[method-assign]
    drain(Dispatcher(engine, OutboxEvent, pub, listen=False, batch=10))
    pub.close()
    assert calls == [10, 10, 10] and statuses(engine) == {"done": 30}
    assert ch.queue_declare(queue, passive=True).method.message_count == 30


def test_async_rabbitmq_publisher_batch_confirms_under_async_dispatcher(
    engine: Engine, rabbit_queue: Any, async_url: Any
) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    from sa_outbox import AsyncDispatcher
    from sa_outbox.publishers.aio_rabbitmq import AsyncRabbitMQPublisher

    exchange, (ch, queue) = rabbit_queue
    _business_tx(engine, 25)

    async def go() -> None:
        aengine = create_async_engine(async_url)
        pub = AsyncRabbitMQPublisher(AMQP, exchange=exchange, routing_key="order.x")
        d = AsyncDispatcher(aengine, OutboxEvent, pub, listen=False, batch=10)
        await d.run(install_signal_handlers=False, until_idle=True)
        await d.close()
        await pub.close()
        await aengine.dispose()

    asyncio.run(go())
    assert statuses(engine) == {"done": 25}
    ids = []
    for _ in range(25):
        _, props, body = ch.basic_get(queue, auto_ack=True)
        ids.append(int(props.message_id))
        assert (
            props.headers["event-type"] == "OrderPaid" and json.loads(body)["message_id"] == props.message_id
        )
    assert sorted(ids) == list(range(1, 26))


def test_async_rabbitmq_unroutable_is_retryable_and_down_is_unavailable(rabbit_queue: Any) -> None:
    from datetime import UTC, datetime

    from sa_outbox.publishers.aio_rabbitmq import AsyncRabbitMQPublisher

    exchange, _ = rabbit_queue
    m = Message(1, "1", "o", "1", "x", {}, 1, 1, datetime.now(UTC))

    async def go() -> tuple[Any, Any]:
        lost = AsyncRabbitMQPublisher(AMQP, exchange=exchange, routing_key="nobody.home")
        down = AsyncRabbitMQPublisher(f"amqp://guest:guest@127.0.0.1:{CLOSED}/", timeout=1)
        try:
            return (await lost.publish_many([m]))[0], (await down.publish_many([m]))[0]
        finally:
            await lost.close()
            await down.close()

    unroutable, unavailable = asyncio.run(go())
    assert type(unroutable).__name__ == "RetryableError" and "unroutable" in str(unroutable)
    assert type(unavailable).__name__ == "DestinationUnavailable" and "unavailable" in str(unavailable)


# --- MQTT (Mosquitto) ----------------------------------------------------------------------------------


def test_mqtt_end_to_end_qos1(engine: Engine) -> None:
    import paho.mqtt.client as mqtt

    from sa_outbox.publishers.mqtt import MQTTPublisher

    prefix = f"sa_outbox_test_{uuid.uuid4().hex[:6]}"
    got: list[dict[str, Any]] = []
    subscribed = threading.Event()
    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    sub.on_connect = lambda c, u, f, r, p: c.subscribe(f"{prefix}/#", qos=1)
    sub.on_subscribe = lambda c, u, mid, r, p: subscribed.set()
    sub.on_message = lambda c, u, msg: got.append(json.loads(msg.payload))
    sub.connect("127.0.0.1", 1883)
    sub.loop_start()
    try:
        assert subscribed.wait(5)
        _business_tx(engine, 4)
        pub = MQTTPublisher("127.0.0.1", 1883, topic_prefix=prefix)
        _dispatch(engine, pub)
        pub.close()
        deadline = time.monotonic() + 5
        while len(got) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sub.loop_stop()
        sub.disconnect()
    assert sorted(m["message_id"] for m in got) == ["1", "2", "3", "4"]
    assert got[0]["event_type"] == "OrderPaid" and statuses(engine) == {"done": 4}


def test_mqtt_down_is_destination_unavailable(engine: Engine) -> None:
    from sa_outbox.publishers.mqtt import MQTTPublisher

    _business_tx(engine, 1)
    Dispatcher(engine, OutboxEvent, MQTTPublisher("127.0.0.1", CLOSED, timeout=1), listen=False).run_once()
    r = row(engine, "outbox", 1)
    assert r.status == "pending" and r.last_error.startswith("DestinationUnavailable: mqtt broker")


# --- headers: every publisher copies them into the broker's own header slot -----------------------------

HEADERS = {"x-tenant": "acme", "x-note": "crème brûlée"}  # non-ASCII on purpose: every slot carries UTF-8


def _tx_with_headers(engine: Engine, n: int = 2) -> None:
    with Session(engine) as s, s.begin():
        for i in range(n):
            s.add(OutboxEvent(aggregate_type="order", aggregate_id=str(i), event_type="OrderPaid",
                              payload={"n": i}, headers=HEADERS if i == 0 else None))  # fmt: skip


def test_rabbitmq_headers_travel_as_amqp_headers(engine: Engine, rabbit_queue: Any) -> None:
    from sa_outbox.inbox import headers_from_amqp

    exchange, (ch, queue) = rabbit_queue
    _tx_with_headers(engine)
    pub = RabbitMQPublisher(AMQP, exchange=exchange, routing_key="order.x")
    _dispatch(engine, pub)
    pub.close()
    got = [headers_from_amqp(ch.basic_get(queue, auto_ack=True)[1]) for _ in range(2)]
    assert {k: got[0][k] for k in HEADERS} == HEADERS and got[0]["event-type"] == "OrderPaid"
    assert not set(HEADERS) & set(got[1])  # an event without headers sends only the publisher's own


def test_async_rabbitmq_headers_travel_as_amqp_headers(rabbit_queue: Any) -> None:
    from sa_outbox.inbox import headers_from_amqp
    from sa_outbox.publishers.aio_rabbitmq import AsyncRabbitMQPublisher

    exchange, (ch, queue) = rabbit_queue
    m = Message(1, "1", "o", "1", "x", {}, 1, 1, datetime.now(UTC), headers=HEADERS)

    async def go() -> list[BaseException | None]:
        pub = AsyncRabbitMQPublisher(AMQP, exchange=exchange, routing_key="order.x")
        try:
            return await pub.publish_many([m])
        finally:
            await pub.close()

    assert asyncio.run(go()) == [None]
    got = headers_from_amqp(ch.basic_get(queue, auto_ack=True)[1])
    assert {k: got[k] for k in HEADERS} == HEADERS


def test_nats_headers_travel_as_nats_headers(engine: Engine, jetstream: tuple[str, str]) -> None:
    from sa_outbox.inbox import headers_from_nats

    stream, prefix = jetstream
    _tx_with_headers(engine)
    pub = NatsPublisher(NATS, subject_prefix=prefix)
    _dispatch(engine, pub)
    pub.close()
    first = headers_from_nats(_stream_messages(stream)[0])
    assert {k: first[k] for k in HEADERS} == HEADERS and first["Nats-Msg-Id"] == "1"


def test_redis_headers_travel_as_header_fields(engine: Engine, stream_key: str) -> None:
    from sa_outbox.inbox import headers_from_redis

    _tx_with_headers(engine)
    _dispatch(engine, RedisStreamPublisher(REDIS, stream=stream_key))
    entries = redis_call(REDIS, "xrange", stream_key)
    assert headers_from_redis(entries[0][1]) == HEADERS and headers_from_redis(entries[1][1]) == {}
    assert entries[0][1][b"header:x-tenant"] == b"acme" and entries[0][1][b"message_id"] == b"1"


def test_webhook_headers_travel_as_http_headers_under_the_configured_ones(
    engine: Engine, webhook: Any
) -> None:
    url, hook = webhook
    with Session(engine) as s, s.begin():
        s.add(OutboxEvent(aggregate_type="order", aggregate_id="1", event_type="E", payload={},
                          headers={**HEADERS, "Authorization": "from-the-event", "idempotency-key": "x"}))  # fmt: skip
    _dispatch(engine, WebhookPublisher(url, headers={"Authorization": "Bearer configured"}))
    received = hook.received[0][0]
    assert received["x-tenant"] == "acme"
    assert received["x-note"].encode("latin-1").decode() == HEADERS["x-note"]  # UTF-8 on the wire
    assert received["Authorization"] == "Bearer configured"  # the configured headers win
    assert received["Idempotency-Key"] == "1"  # and the publisher's own
    assert sum(k.lower() == "idempotency-key" for k in received) == 1


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_mqtt_headers_travel_as_user_properties_or_in_the_body(engine: Engine, protocol: str) -> None:
    from sa_outbox.inbox import headers_from_mqtt, message_id_from_mqtt
    from sa_outbox.publishers.mqtt import MQTTPublisher

    got = _mqtt_roundtrip(engine, MQTTPublisher("127.0.0.1", 1883, protocol=protocol), _tx_with_headers)
    assert sorted(message_id_from_mqtt(m) for m in got) == ["1", "2"]
    first = next(m for m in got if message_id_from_mqtt(m) == "1")
    assert headers_from_mqtt(first) == HEADERS
    if protocol == "5":
        assert "headers" not in json.loads(first.payload)  # the body is the plain envelope
    else:
        assert json.loads(first.payload)["headers"] == HEADERS


def _mqtt_roundtrip(engine: Engine, pub: Any, write: Any, n: int = 2) -> list[Any]:
    """Subscribe (MQTT v5, so user properties arrive), write the events, dispatch them through ``pub`` on its
    topic prefix, and return the paho messages the subscriber got."""
    import paho.mqtt.client as mqtt

    prefix = f"sa_outbox_test_{uuid.uuid4().hex[:6]}"
    pub.topic = lambda m: f"{prefix}/{m.event_type}"
    got: list[Any] = []
    subscribed = threading.Event()
    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    sub.on_connect = lambda c, u, f, r, p: c.subscribe(f"{prefix}/#", qos=1)
    sub.on_subscribe = lambda c, u, mid, r, p: subscribed.set()
    sub.on_message = lambda c, u, msg: got.append(msg)
    sub.connect("127.0.0.1", 1883)
    sub.loop_start()
    try:
        assert subscribed.wait(5)
        write(engine, n)
        _dispatch(engine, pub)
        pub.close()
        deadline = time.monotonic() + 5
        while len(got) < n and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sub.loop_stop()
        sub.disconnect()
    assert len(got) == n
    return got


def test_webhook_sends_a_non_ascii_aggregate_id_as_utf8(engine: Engine, webhook: Any) -> None:
    """httpx encodes str header values as ASCII: the X-Outbox-Aggregate-Id of 'Zoë' made every publish of
    that aggregate fail (and end dead) before the values were sent as UTF-8 bytes."""
    url, hook = webhook
    with Session(engine) as s, s.begin():
        s.add(OutboxEvent(aggregate_type="order", aggregate_id="Zoë", event_type="E", payload={}))
    _dispatch(engine, WebhookPublisher(url))
    assert statuses(engine) == {"done": 1}
    assert hook.received[0][0]["X-Outbox-Aggregate-Id"].encode("latin-1").decode() == "Zoë"
