"""An asyncio web app (Starlette) writes an order and its event in one AsyncSession transaction per request;
an AsyncDispatcher delivers them to RabbitMQ with the aio-pika publisher. Run as a script it serves two requests in-process
(httpx's ASGI transport, no port needed) and prints what the broker received.

Needs ``starlette``, RabbitMQ on 127.0.0.1:5672 and ``sa-outbox[aio-rabbitmq,rabbitmq]`` (aio-pika publishes,
pika reads the queue back).
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pika
from sqlalchemy import BigInteger, Identity, Text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from sa_outbox import AsyncDispatcher, OutboxMixin
from sa_outbox.embedded import database_url
from sa_outbox.publishers.aio_rabbitmq import AsyncRabbitMQPublisher

AMQP = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "ex_web_orders"
    __outbox_aggregate_type__ = "order"
    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    item: Mapped[str] = mapped_column(Text)


class OutboxEvent(OutboxMixin, Base):
    __tablename__ = "ex_web_outbox"


def make_app(sessions: async_sessionmaker[AsyncSession]) -> Starlette:
    async def create_order(request: Request) -> JSONResponse:
        body = await request.json()
        async with sessions() as session, session.begin():
            order = Order(item=body["item"])
            session.add(order)
            await session.flush()  # the order's id, for the event
            session.add(OutboxEvent.for_aggregate(order, "OrderCreated", {"item": order.item}))
        return JSONResponse({"id": order.id}, status_code=201)

    return Starlette(routes=[Route("/orders", create_order, methods=["POST"])])


async def serve_and_deliver(url: str) -> None:
    engine = create_async_engine(url.replace("+psycopg:", "+psycopg_async:"))
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    publisher = AsyncRabbitMQPublisher(AMQP, exchange="", routing_key="ex_web_events")
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=make_app(sessions)), base_url="http://app"
        ) as client:
            for item in ("book", "lamp"):
                response = await client.post("/orders", json={"item": item})
                print("POST /orders ->", response.status_code, response.json())
        dispatcher = AsyncDispatcher(engine, OutboxEvent, publisher, listen=False)
        await dispatcher.run(install_signal_handlers=False, until_idle=True)
        await dispatcher.close()
    finally:
        await publisher.close()
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.drop_all)
        await engine.dispose()


def main() -> None:
    conn = pika.BlockingConnection(pika.URLParameters(AMQP))
    channel = conn.channel()
    channel.queue_declare("ex_web_events", durable=True)
    try:
        with database_url() as url:
            asyncio.run(serve_and_deliver(url))
        for _ in range(2):
            _, props, body = channel.basic_get("ex_web_events", auto_ack=True)
            print(
                f"broker got message_id={props.message_id}: {json.loads(body)['event_type']} {json.loads(body)['payload']}"
            )
    finally:
        channel.queue_delete("ex_web_events")
        conn.close()


if __name__ == "__main__":
    main()
