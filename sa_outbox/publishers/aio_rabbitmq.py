"""RabbitMQ publisher for asyncio (extra ``aio-rabbitmq``, aio-pika): the same message shape and error mapping
as :mod:`sa_outbox.publishers.rabbitmq` (headers, ``envelope="cloudevents"``), for
:class:`~sa_outbox.AsyncDispatcher`.

* The channel runs in publisher-confirm mode; ``publish_many`` sends a whole batch and awaits all its confirms
  together (one wait for the batch, not one round trip per message), reporting per message: a nack or a
  message still unconfirmed at the deadline is :class:`~sa_outbox.RetryableError`.
* One deadline: ``publish`` and ``publish_many`` return within ``timeout`` seconds in total, connecting
  included; a call that timed out drops the connection (it may hang), and the next call reconnects.
* The destination as a whole is down — connection refused or lost (a broker restart), DNS failure, a handshake
  that does not finish in time, refused credentials — is :class:`~sa_outbox.DestinationUnavailable` for every
  message of the call. The publisher notices a lost connection (aio-pika's ``is_closed`` does not) and the
  next call opens a new connection, channel and exchange handle.
* Unroutable messages (``mandatory``) and an exchange that does not exist (yet) are retryable by default —
  consumers often declare the topology later; nothing is cached until the exchange exists, so the first
  call after it is declared goes through. ``unroutable="dead"`` makes both permanent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from .._messages import Message
from ..errors import DestinationUnavailable, NoAnswer, RetryableError
from ._common import AmqpRouting, BackgroundCloser, missing_extra, publish_each

try:
    import aio_pika
    from aio_pika import exceptions as apex
    from aiormq import exceptions as amqex
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    missing_extra("aio-rabbitmq", exc)

__all__ = ["AsyncRabbitMQPublisher"]

# The connection is gone or never came: the destination as a whole is unavailable.
_CONNECTION_ERRORS = (OSError, amqex.AMQPConnectionError, amqex.ChannelInvalidStateError)


class AsyncRabbitMQPublisher(AmqpRouting):
    """``AsyncRabbitMQPublisher("amqp://guest:guest@127.0.0.1/", exchange="orders")``; same options as
    :class:`~sa_outbox.publishers.rabbitmq.RabbitMQPublisher`. Use it from one event loop at a time; a call
    from another loop (e.g. a second ``asyncio.run``) opens its own connection."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(**options)
        self.url = url
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._conn: Any = None
        self._channel: Any = None
        self._exchange: Any = None
        self._lost = False  # set by the connection's close callback: aio-pika's is_closed stays false
        self._closer = BackgroundCloser(self.timeout)

    # --- connection, channel, exchange: cached only once all three exist ---------------------------------

    def _usable(self) -> bool:
        return (
            self._exchange is not None
            and not self._lost
            and self._loop is asyncio.get_running_loop()
            and not self._conn.is_closed
            and not self._channel.is_closed
        )

    async def _ensure(self) -> Any:
        if self._usable():
            return self._exchange
        loop = asyncio.get_running_loop()
        if self._lock is None or self._loop is not loop:
            self._lock, self._conn, self._channel, self._exchange = asyncio.Lock(), None, None, None
            self._loop, self._lost = loop, False
        async with self._lock:  # concurrent publishes share one connection attempt
            if self._usable():
                return self._exchange
            if self._conn is None or self._lost or self._conn.is_closed:
                self._discard()
                try:
                    conn = await aio_pika.connect(self.url, timeout=self.timeout)
                except (*_CONNECTION_ERRORS, TimeoutError) as exc:
                    raise DestinationUnavailable(
                        f"rabbitmq unavailable: {type(exc).__name__}: {exc}"
                    ) from exc
                conn.close_callbacks.add(self._on_connection_closed)
                self._conn, self._lost = conn, False
            try:
                channel = await self._conn.channel(publisher_confirms=True, on_return_raises=True)
                exchange = (
                    channel.default_exchange
                    if not self.exchange
                    else await channel.get_exchange(self.exchange)
                )
            except amqex.ChannelNotFoundEntity as exc:
                raise self._unroutable(
                    f"exchange {self.exchange!r} does not exist (declare it, or let its consumers): {exc}"
                ) from exc
            except amqex.AMQPChannelError as exc:
                raise RetryableError(f"rabbitmq refused the channel: {type(exc).__name__}: {exc}") from exc
            except (*_CONNECTION_ERRORS, TimeoutError) as exc:
                self._discard()
                raise DestinationUnavailable(
                    f"rabbitmq connection lost: {type(exc).__name__}: {exc}"
                ) from exc
            except RuntimeError as exc:
                # aiormq's answer to opening a channel on a connection that closed after its handshake (a
                # broker restart in between; aio-pika's is_closed has not noticed yet): a connection that
                # cannot open a channel is dropped, the next call opens a new one.
                self._discard()
                raise DestinationUnavailable(
                    f"rabbitmq connection lost before its channel opened: RuntimeError: {exc}"
                ) from exc
            self._channel, self._exchange = channel, exchange
            return exchange

    def _on_connection_closed(self, sender: Any, exc: BaseException | None = None) -> None:
        if sender is self._conn:
            self._lost = True

    def _discard(self) -> None:
        """Forget the connection; close it in the background (a hung one never answers a close)."""
        conn, self._conn, self._channel, self._exchange = self._conn, None, None, None
        if conn is not None and not conn.is_closed:
            self._closer.close_later(conn)

    # --- publishing -------------------------------------------------------------------------------------

    def _message(self, message: Message) -> Any:
        body, headers, content_type = self._frame(message)
        return aio_pika.Message(
            body, message_id=message.message_id, content_type=content_type,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT, type=message.event_type, headers=dict(headers),
        )  # fmt: skip

    async def _publish(self, exchange: Any, message: Message, deadline: float) -> None:
        remaining = max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            await asyncio.wait_for(
                exchange.publish(self._message(message), self._key(message), mandatory=self.mandatory,
                                 timeout=remaining),
                remaining,
            )  # fmt: skip
        except apex.DeliveryError as exc:
            returned = getattr(exc, "frame", None) is not None and type(exc.frame).__name__.endswith("Return")
            if returned:
                raise self._unroutable(
                    f"unroutable: no queue bound for exchange {self.exchange!r} routing key {self._key(message)!r}"
                ) from exc
            raise RetryableError(
                f"rabbitmq nacked the message (a queue at max-length with overflow=reject-publish, or a broker "
                f"error): {exc!r}"
            ) from exc
        except TimeoutError as exc:
            self._discard()
            raise NoAnswer(
                f"no publisher confirm from rabbitmq within {self.timeout:g}s (the connection is dropped; the "
                "next publish reconnects)"
            ) from exc
        except amqex.ChannelNotFoundEntity as exc:  # the exchange was deleted meanwhile
            self._channel = self._exchange = None
            raise self._unroutable(f"exchange {self.exchange!r} does not exist: {exc}") from exc
        except amqex.AMQPChannelError as exc:
            self._channel = self._exchange = None
            raise RetryableError(f"rabbitmq closed the channel: {type(exc).__name__}: {exc}") from exc
        except _CONNECTION_ERRORS as exc:
            lost = self._lost or isinstance(exc, OSError | amqex.AMQPConnectionError)
            self._discard()
            if not lost:  # only the channel was closed (ours, after another publish's timeout): no verdict
                raise NoAnswer(f"rabbitmq channel closed: {type(exc).__name__}: {exc}") from exc
            raise DestinationUnavailable(f"rabbitmq connection lost: {type(exc).__name__}: {exc}") from exc

    async def _connect_by(self, deadline: float) -> Any:
        remaining = max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            return await asyncio.wait_for(self._ensure(), remaining)
        except TimeoutError as exc:
            self._discard()
            raise DestinationUnavailable(
                f"rabbitmq did not open a connection and channel within {self.timeout:g}s"
            ) from exc

    async def publish(self, message: Message) -> None:
        """Deliver one message: returns once the broker confirmed it (within ``timeout``), raises otherwise."""
        deadline = asyncio.get_running_loop().time() + self.timeout
        await self._publish(await self._connect_by(deadline), message, deadline)

    async def publish_many(self, messages: Sequence[Message]) -> list[BaseException | None]:
        """Publish a batch and await all its confirms together, within ``timeout`` in total; one entry per
        message, in order: ``None`` when confirmed, else its failure class."""
        deadline = asyncio.get_running_loop().time() + self.timeout
        return await publish_each(
            lambda: self._connect_by(deadline),
            lambda exchange, m: self._publish(exchange, m, deadline),
            messages,
        )

    async def close(self) -> None:
        """Close the connection (waits at most ``timeout`` for the broker to answer)."""
        if self._loop is asyncio.get_running_loop():
            self._discard()
        else:  # opened on another loop, which is gone: nothing can be awaited there
            self._conn = self._channel = self._exchange = None
        await self._closer.wait()

    async def aclose(self) -> None:
        """The same as :meth:`close`."""
        await self.close()
