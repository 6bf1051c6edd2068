"""envelope="cloudevents": what each real broker delivered, parsed back with the CloudEvents SDK.

Binary mode where the broker has headers (RabbitMQ, NATS, Redis, HTTP, MQTT v5), structured mode where it has
none (MQTT 3.1.1). Every event is checked attribute by attribute against the outbox row it came from.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.bindings import rabbitmq as ce_rabbitmq
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from dateutil.parser import isoparse
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from sa_outbox import ConfigurationError, Message, PermanentError
from sa_outbox.inbox import (
    headers_from_amqp,
    headers_from_mqtt,
    headers_from_nats,
    headers_from_redis,
    message_id_from_mqtt,
    message_id_from_redis,
)
from sa_outbox.models import OutboxEvent
from sa_outbox.publishers.http import WebhookPublisher
from sa_outbox.publishers.mqtt import MQTTPublisher
from sa_outbox.publishers.nats import NatsPublisher
from sa_outbox.publishers.rabbitmq import RabbitMQPublisher
from sa_outbox.publishers.redis import RedisStreamPublisher

from . import test_publishers as brokers
from .brokers import redis_call
from .helpers import row, statuses
from .test_publishers import AMQP, NATS, REDIS, _dispatch, _mqtt_roundtrip, _stream_messages

# The brokers' fixtures (a queue bound to an exchange, a JetStream stream, a stream key, a webhook receiver).
rabbit_queue, jetstream, stream_key, webhook = (
    brokers.rabbit_queue, brokers.jetstream, brokers.stream_key, brokers.webhook,
)  # fmt: skip

SOURCE = "https://shop.example.com/orders"
AGGREGATE = "Zoë 7%"  # a space, a '%' and non-ASCII: percent-encoded in HTTP-style headers
PAYLOAD = {"total": "9.90", "lines": [1, 2]}
HEADERS = {"x-tenant": "acme"}


def _write(engine: Engine, n: int = 1) -> None:
    with Session(engine) as s, s.begin():
        for _ in range(n):
            s.add(OutboxEvent(aggregate_type="order", aggregate_id=AGGREGATE, event_type="com.shop.order.paid",
                              payload=PAYLOAD, headers=HEADERS))  # fmt: skip


def _check(engine: Engine, event: Any, *, id_: str = "1") -> None:
    """The CloudEvent is the outbox row: id, source, type, subject, time, datacontenttype, data."""
    r = row(engine, "outbox", int(id_))
    assert event.get_specversion() == "1.0"
    assert (
        event.get_id() == id_ and event.get_source() == SOURCE and event.get_type() == "com.shop.order.paid"
    )
    assert event.get_subject() == f"order/{AGGREGATE}"
    assert event.get_time() == r.created_at
    assert event.get_datacontenttype() == "application/json"
    assert event.get_data() == PAYLOAD


def test_rabbitmq_binary_mode_per_the_rabbitmq_binding(engine: Engine, rabbit_queue: Any) -> None:
    """Parsed by the SDK's RabbitMQ binding; and the SDK's own encoding of the parsed event is exactly what
    the publisher sent (it wrote what the binding says, not something the parser merely tolerates)."""
    exchange, (ch, queue) = rabbit_queue
    _write(engine)
    pub = RabbitMQPublisher(
        AMQP, exchange=exchange, routing_key="order.x", envelope="cloudevents", source=SOURCE
    )
    _dispatch(engine, pub)
    pub.close()
    _, props, body = ch.basic_get(queue, auto_ack=True)
    headers = headers_from_amqp(props)
    message = ce_rabbitmq.RabbitMQMessage(headers=headers, content_type=props.content_type, body=body)
    event = ce_rabbitmq.from_rabbitmq(message, JSONFormat())
    _check(engine, event)
    assert props.message_id == "1" and headers["x-tenant"] == "acme" and headers["ce-id"] == "1"
    theirs = ce_rabbitmq.to_binary(event, JSONFormat())
    assert {k: v for k, v in headers.items() if k.startswith("ce-")} == theirs.headers
    assert (props.content_type, json.loads(body)) == (theirs.content_type, json.loads(theirs.body))


def test_async_rabbitmq_binary_mode(rabbit_queue: Any) -> None:
    from sa_outbox.publishers.aio_rabbitmq import AsyncRabbitMQPublisher

    exchange, (ch, queue) = rabbit_queue
    created = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
    m = Message(9, "9", "order", "A", "com.shop.order.paid", PAYLOAD, 1, 1, created)

    async def go() -> None:
        pub = AsyncRabbitMQPublisher(AMQP, exchange=exchange, routing_key="order.x", envelope="cloudevents",
                                     source=lambda m: f"/shop/{m.aggregate_type}")  # fmt: skip
        try:
            await pub.publish(m)
        finally:
            await pub.close()

    asyncio.run(go())
    _, props, body = ch.basic_get(queue, auto_ack=True)
    event = ce_rabbitmq.from_rabbitmq(
        ce_rabbitmq.RabbitMQMessage(headers_from_amqp(props), props.content_type, body), JSONFormat()
    )
    assert (event.get_id(), event.get_source(), event.get_time()) == ("9", "/shop/order", created)
    assert headers_from_amqp(props)["ce-time"] == "2026-01-02T03:04:05.678000Z"  # RFC 3339, UTC as Z


def test_nats_binary_mode_with_percent_encoded_ce_headers(engine: Engine, jetstream: tuple[str, str]) -> None:
    stream, prefix = jetstream
    _write(engine)
    pub = NatsPublisher(NATS, subject_prefix=prefix, envelope="cloudevents", source=SOURCE)
    _dispatch(engine, pub)
    pub.close()
    msg = _stream_messages(stream)[0]
    headers = headers_from_nats(msg)
    assert headers["ce-subject"] == "order/Zo%C3%AB%207%25" and headers["Nats-Msg-Id"] == "1"
    _check(engine, ce_http.from_binary(ce_http.HTTPMessage(headers, msg.data), JSONFormat()))


def test_redis_binary_mode_as_the_kafka_binding_lays_out_headers(engine: Engine, stream_key: str) -> None:
    _write(engine)
    _dispatch(engine, RedisStreamPublisher(REDIS, stream=stream_key, envelope="cloudevents", source=SOURCE))
    (_, fields), = redis_call(REDIS, "xrange", stream_key)  # fmt: skip
    ce_fields = {k.decode(): v for k, v in fields.items() if k.startswith(b"ce_") or k == b"content-type"}
    event = ce_kafka.from_binary(ce_kafka.KafkaMessage(ce_fields, None, fields[b"data"]), JSONFormat())
    _check(engine, event)
    assert message_id_from_redis(fields) == "1" and headers_from_redis(fields) == HEADERS
    assert b"payload" not in fields  # the envelope's fields are replaced by the event's


def test_webhook_binary_mode_per_the_http_binding(engine: Engine, webhook: Any) -> None:
    url, hook = webhook
    _write(engine)
    _dispatch(engine, WebhookPublisher(url, envelope="cloudevents", source=SOURCE))
    headers, body = hook.received[0]
    event = ce_http.from_http(ce_http.HTTPMessage(headers, json.dumps(body).encode()), JSONFormat())
    _check(engine, event)
    assert headers["Idempotency-Key"] == "1" and headers["x-tenant"] == "acme"


def test_mqtt5_binary_mode_with_unprefixed_user_properties(engine: Engine) -> None:
    pub = MQTTPublisher(protocol="5", envelope="cloudevents", source=SOURCE)
    (msg,) = _mqtt_roundtrip(engine, pub, _write, n=1)
    props = dict(msg.properties.UserProperty)
    attributes: dict[str, Any] = {k: v for k, v in props.items() if k in
                                  {"specversion", "id", "source", "type", "subject", "time"}}  # fmt: skip
    attributes["time"] = isoparse(attributes["time"])
    attributes["datacontenttype"] = msg.properties.ContentType
    _check(engine, CloudEvent(attributes, JSONFormat().read_data(msg.payload, msg.properties.ContentType)))
    assert headers_from_mqtt(msg)["x-tenant"] == "acme" and message_id_from_mqtt(msg) == "1"


def test_mqtt311_structured_mode_carries_trace_headers_as_extensions(engine: Engine) -> None:
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

    def write(engine: Engine, n: int) -> None:
        with Session(engine) as s, s.begin():
            s.add(OutboxEvent(aggregate_type="order", aggregate_id=AGGREGATE, event_type="com.shop.order.paid",
                              payload=PAYLOAD, headers={"traceparent": traceparent}))  # fmt: skip
            s.add(OutboxEvent(aggregate_type="order", aggregate_id="B", event_type="com.shop.order.paid",
                              payload=PAYLOAD, headers={"X-Tenant": "acme"}))  # fmt: skip

    pub = MQTTPublisher(envelope="cloudevents", source=SOURCE)
    (msg,) = _mqtt_roundtrip(engine, pub, write, n=1)
    event = JSONFormat().read(None, msg.payload)
    _check(engine, event)
    assert event.get_extension("traceparent") == traceparent
    assert headers_from_mqtt(msg) == {"traceparent": traceparent} and message_id_from_mqtt(msg) == "1"
    # A header that is not a valid extension attribute name cannot travel in a structured event.
    dead = row(engine, "outbox", 2)
    assert dead.status == "dead" and "'X-Tenant' cannot travel in a structured CloudEvent" in dead.last_error
    assert statuses(engine) == {"done": 1, "dead": 1}


def test_cloudevents_needs_a_source_and_a_known_envelope() -> None:
    with pytest.raises(ConfigurationError, match="needs source="):
        RedisStreamPublisher(REDIS, envelope="cloudevents")
    with pytest.raises(ConfigurationError, match="envelope must be one of"):
        RedisStreamPublisher(REDIS, envelope="json")
    with pytest.raises(ConfigurationError, match="protocol must be"):
        MQTTPublisher(protocol="4")


def test_mqtt5_header_named_like_an_attribute_is_refused_per_message() -> None:
    pub = MQTTPublisher(protocol="5", envelope="cloudevents", source=SOURCE)
    m = Message(1, "1", "o", "1", "E", {}, 1, 1, datetime.now(UTC), headers={"subject": "x"})
    with pytest.raises(PermanentError, match="'subject' has the name of a CloudEvents attribute"):
        pub._frame(m)
