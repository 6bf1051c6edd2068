"""RabbitMQ publisher for asyncio (extra ``aio-rabbitmq``, aio-pika): the same message shape and error mapping
as :mod:`sa_outbox.publishers.rabbitmq`, for :class:`~sa_outbox.AsyncDispatcher`.

The channel runs in publisher-confirm mode; ``publish_many`` sends a whole batch and awaits all its confirms
together (one wait for the batch, not one round trip per message), reporting per message: a nack, a return
(unroutable, ``mandatory``), a timeout or a lost connection is retryable (``unroutable="dead"`` makes an
unroutable message permanent).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from .._messages import Message
from ..errors import RetryableError
from ._common import AmqpRouting, envelope_json, headers_for, missing_extra

try:
    import aio_pika
    from aio_pika import exceptions as apex
    from aiormq import exceptions as amqex
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    missing_extra("aio-rabbitmq", exc)

__all__ = ["AsyncRabbitMQPublisher"]


class AsyncRabbitMQPublisher(AmqpRouting):
    """``AsyncRabbitMQPublisher("amqp://guest:guest@127.0.0.1/", exchange="orders")``; same options as
    :class:`~sa_outbox.publishers.rabbitmq.RabbitMQPublisher`."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(**options)
        self.url = url
        self._conn: Any = None
        self._exchange: Any = None

    async def _ensure(self) -> Any:
        if self._conn is None or self._conn.is_closed:
            try:
                self._conn = await asyncio.wait_for(
                    aio_pika.connect(self.url, timeout=self.timeout), self.timeout
                )
            except (OSError, TimeoutError, amqex.AMQPError) as exc:
                self._conn = None
                raise RetryableError(f"rabbitmq unavailable: {type(exc).__name__}: {exc}") from exc
            channel = await self._conn.channel(publisher_confirms=True, on_return_raises=True)
            self._exchange = (
                channel.default_exchange if not self.exchange else await channel.get_exchange(self.exchange)
            )
        return self._exchange

    def _message(self, message: Message) -> Any:
        return aio_pika.Message(
            envelope_json(message), message_id=message.message_id, content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT, type=message.event_type, headers=dict(headers_for(message)),
        )  # fmt: skip

    async def _publish(self, exchange: Any, message: Message) -> None:
        try:
            await exchange.publish(
                self._message(message), self._key(message), mandatory=self.mandatory, timeout=self.timeout
            )
        except apex.DeliveryError as exc:
            returned = getattr(exc, "frame", None) is not None and type(exc.frame).__name__.endswith("Return")
            text = f"rabbitmq did not take the message: {exc!r}"
            if returned:
                raise self._unroutable(f"unroutable: {text}") from exc
            raise RetryableError(text) from exc
        except (OSError, TimeoutError, amqex.AMQPError, apex.AMQPException) as exc:
            await self.close()
            raise RetryableError(f"rabbitmq publish failed: {type(exc).__name__}: {exc}") from exc

    async def publish(self, message: Message) -> None:
        await self._publish(await self._ensure(), message)

    async def publish_many(self, messages: Sequence[Message]) -> list[BaseException | None]:
        try:
            exchange = await self._ensure()
        except RetryableError as exc:
            return [exc] * len(messages)
        results = await asyncio.gather(
            *(self._publish(exchange, m) for m in messages), return_exceptions=True
        )
        return [r if isinstance(r, BaseException) else None for r in results]

    async def close(self) -> None:
        conn, self._conn, self._exchange = self._conn, None, None
        if conn is not None and not conn.is_closed:
            try:
                await conn.close()
            except Exception:  # already broken
                return
