"""RabbitMQ publisher (extra ``rabbitmq``, pika): persistent messages with publisher confirms.

* ``message_id`` property = the outbox id (consumers de-duplicate on it); event type, aggregate, lease version
  and attempts travel as headers; ``content_type`` is JSON; ``delivery_mode=2`` (persistent).
* Every publish waits for the broker's confirm. A nack, a lost connection, a closed channel or a timeout is
  :class:`~sa_outbox.RetryableError`, and the next publish reconnects.
* ``publish_many`` (used by the dispatcher for whole batches) publishes a batch inside one AMQP transaction on
  a second channel: the messages go out back to back and one ``tx.commit`` round trip makes the broker take
  responsibility for all of them (or none: a failed commit is retryable for the whole batch). Messages the
  broker returns as unroutable during the commit are reported per message.
* Unroutable messages (``mandatory=True`` and no queue bound): by default **retryable** — the topology is often
  declared by consumers that start later, and retrying ends ``dead`` after ``max_attempts`` anyway, where an
  operator sees it; ``unroutable="dead"`` makes it a :class:`~sa_outbox.PermanentError` instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from .._messages import Message
from ..errors import PermanentError, RetryableError
from ._common import AmqpRouting, envelope_json, headers_for, missing_extra

try:
    import pika  # type: ignore[import-untyped]
    from pika import exceptions as pex
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    missing_extra("rabbitmq", exc)

__all__ = ["RabbitMQPublisher"]

_RETRYABLE = (
    pex.AMQPConnectionError,
    pex.AMQPChannelError,
    pex.StreamLostError,
    pex.ConnectionClosed,
    pex.ChannelClosed,
    pex.NackError,
    OSError,
)


class RabbitMQPublisher(AmqpRouting):
    """``RabbitMQPublisher("amqp://guest:guest@127.0.0.1:5672/%2F", exchange="orders")``.

    ``routing_key`` is a string or a callable of the message (default: the event type). ``timeout`` bounds
    connecting, socket I/O and a blocked connection.
    """

    def __init__(
        self,
        url: str,
        *,
        exchange: str = "",
        routing_key: str | Callable[[Message], str] | None = None,
        mandatory: bool = True,
        unroutable: str = "retry",
        timeout: float = 5.0,
    ) -> None:
        super().__init__(exchange=exchange, routing_key=routing_key, mandatory=mandatory, unroutable=unroutable,
                         timeout=timeout)  # fmt: skip
        params = pika.URLParameters(url)
        params.socket_timeout = timeout
        params.blocked_connection_timeout = timeout
        params.connection_attempts = 1
        params.stack_timeout = timeout
        self.params = params
        self._conn: Any = None
        self._channel: Any = None
        self._tx_channel: Any = None
        self._returned: list[str] = []

    def _ensure(self) -> Any:
        if self._channel is None or not self._channel.is_open or not self._conn.is_open:
            self.close()
            self._conn = pika.BlockingConnection(self.params)
            self._channel = self._conn.channel()
            self._channel.confirm_delivery()
        return self._channel

    def _ensure_tx(self) -> Any:
        self._ensure()
        if self._tx_channel is None or not self._tx_channel.is_open:
            self._tx_channel = self._conn.channel()
            self._tx_channel.tx_select()
            self._tx_channel.add_on_return_callback(self._on_return)
        return self._tx_channel

    def _on_return(self, channel: Any, method: Any, properties: Any, body: bytes) -> None:
        self._returned.append(str(properties.message_id))

    def _props(self, message: Message) -> Any:
        return pika.BasicProperties(
            message_id=message.message_id,
            content_type="application/json",
            delivery_mode=2,
            type=message.event_type,
            headers=headers_for(message),
        )

    def publish_many(self, messages: Sequence[Message]) -> list[BaseException | None]:
        """One AMQP transaction for the batch (see the module docs); per-message outcomes."""
        self._returned = []
        try:
            channel = self._ensure_tx()
            for m in messages:
                channel.basic_publish(
                    self.exchange, self._key(m), envelope_json(m), self._props(m), mandatory=self.mandatory
                )
            channel.tx_commit()
            self._conn.process_data_events(0)  # deliver any basic.return that arrived with the commit
        except _RETRYABLE as exc:
            self.close()
            return [RetryableError(f"rabbitmq batch publish failed: {type(exc).__name__}: {exc}")] * len(
                messages
            )
        returned = set(self._returned)
        out: list[BaseException | None] = []
        for m in messages:
            if m.message_id in returned:
                text = (
                    f"unroutable: no queue bound for exchange {self.exchange!r} routing key {self._key(m)!r}"
                )
                out.append(PermanentError(text) if self.unroutable == "dead" else RetryableError(text))
            else:
                out.append(None)
        return out

    def publish(self, message: Message) -> None:
        props = self._props(message)
        try:
            channel = self._ensure()
            channel.basic_publish(
                self.exchange, self._key(message), envelope_json(message), props, mandatory=self.mandatory
            )
        except pex.UnroutableError as exc:
            text = f"unroutable: no queue bound for exchange {self.exchange!r} routing key {self._key(message)!r}"
            raise self._unroutable(text) from exc
        except _RETRYABLE as exc:
            self.close()
            raise RetryableError(f"rabbitmq publish failed: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        conn, self._conn, self._channel, self._tx_channel = self._conn, None, None, None
        if conn is not None and conn.is_open:
            with contextlib.suppress(Exception):  # closing a broken connection: nothing left to do
                conn.close()
