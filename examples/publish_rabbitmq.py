"""Publish outbox events to RabbitMQ (publisher confirms, persistent, message_id = outbox id) and read them
back with a consumer. Needs RabbitMQ on 127.0.0.1:5672 (``AMQP_URL`` to change) and ``sa-outbox[rabbitmq]``."""

from __future__ import annotations

import json
import os

import pika
from sqlalchemy import create_engine
from sqlalchemy.orm import DeclarativeBase, Session

from sa_outbox import Dispatcher, OutboxMixin
from sa_outbox.embedded import database_url
from sa_outbox.publishers.rabbitmq import RabbitMQPublisher
from sa_outbox.testing import drain

AMQP = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


class Base(DeclarativeBase):
    pass


class OutboxEvent(OutboxMixin, Base):
    __tablename__ = "ex_rabbit_outbox"


def main() -> None:
    conn = pika.BlockingConnection(pika.URLParameters(AMQP))
    channel = conn.channel()
    channel.exchange_declare("ex_orders", "topic")
    channel.queue_declare("ex_billing", durable=True)
    channel.queue_bind("ex_billing", "ex_orders", routing_key="order.*")
    with database_url() as url:
        engine = create_engine(url)
        Base.metadata.create_all(engine)
        publisher = RabbitMQPublisher(
            AMQP, exchange="ex_orders", routing_key=lambda m: f"order.{m.event_type}"
        )
        try:
            with Session(engine) as s, s.begin():
                for n in range(3):
                    s.add(
                        OutboxEvent(
                            aggregate_type="order", aggregate_id=str(n), event_type="paid", payload={"n": n}
                        )
                    )
            drain(Dispatcher(engine, OutboxEvent, publisher, listen=False))
            for _ in range(3):
                _, props, body = channel.basic_get("ex_billing", auto_ack=True)
                print(
                    f"consumed message_id={props.message_id} headers={props.headers} payload={json.loads(body)['payload']}"
                )
        finally:
            publisher.close()
            Base.metadata.drop_all(engine)
            engine.dispose()
            channel.queue_delete("ex_billing")
            channel.exchange_delete("ex_orders")
            conn.close()


if __name__ == "__main__":
    main()
