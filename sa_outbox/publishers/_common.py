"""What every broker adapter shares: the message as a dict/JSON, the missing-extra error, AMQP routing, and for
the asyncio adapters the batch shape and the closing of abandoned connections."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

from .._durations import Duration, to_seconds
from .._messages import Message
from ..errors import ConfigurationError

__all__ = [
    "AmqpRouting",
    "BackgroundCloser",
    "envelope",
    "envelope_json",
    "headers_for",
    "missing_extra",
    "publish_each",
]

T = TypeVar("T")


def envelope(message: Message) -> dict[str, Any]:
    """The fields a consumer needs, JSON-ready (``message_id`` is the de-duplication key)."""
    return {
        "message_id": message.message_id,
        "aggregate_type": message.aggregate_type,
        "aggregate_id": message.aggregate_id,
        "event_type": message.event_type,
        "payload": message.payload,
        "attempts": message.attempts,
        "lease_version": message.lease_version,
        "created_at": message.created_at.isoformat(),
    }


def envelope_json(message: Message) -> bytes:
    return json.dumps(envelope(message), separators=(",", ":")).encode()


def headers_for(message: Message) -> dict[str, str]:
    """Metadata as string headers (AMQP headers, NATS headers, HTTP headers)."""
    return {
        "event-type": message.event_type,
        "aggregate-type": message.aggregate_type,
        "aggregate-id": message.aggregate_id,
        "lease-version": str(message.lease_version),
        "attempts": str(message.attempts),
    }


def missing_extra(extra: str, exc: ImportError) -> NoReturn:
    raise ConfigurationError(
        f"this publisher needs its extra: pip install 'sa-outbox[{extra}]' ({exc})"
    ) from exc


class AmqpRouting:
    """Where an AMQP publisher (pika or aio-pika) sends a message and what an unroutable one means."""

    def __init__(
        self,
        *,
        exchange: str = "",
        routing_key: str | Callable[[Message], str] | None = None,
        mandatory: bool = True,
        unroutable: str = "retry",
        timeout: Duration = 5.0,
    ) -> None:
        if unroutable not in ("retry", "dead"):
            raise ConfigurationError("unroutable must be 'retry' or 'dead'")
        self.exchange = exchange
        self.routing_key = routing_key
        self.mandatory = mandatory
        self.unroutable = unroutable
        self.timeout = to_seconds(timeout, name="timeout", allow_zero=False)

    def _key(self, message: Message) -> str:
        if self.routing_key is None:
            return message.event_type
        return self.routing_key(message) if callable(self.routing_key) else self.routing_key

    def _unroutable(self, text: str) -> BaseException:
        from ..errors import PermanentError, RetryableError

        return PermanentError(text) if self.unroutable == "dead" else RetryableError(text)


async def publish_each(
    connect: Callable[[], Awaitable[T]],
    publish: Callable[[T, Message], Awaitable[None]],
    messages: Sequence[Message],
) -> list[BaseException | None]:
    """The asyncio batch shape: connect once (a failure to connect fails every message with it), then publish
    every message concurrently and report per message, in order (``None`` for delivered)."""
    from ..errors import RetryableError

    try:
        target = await connect()
    except RetryableError as exc:
        return [exc] * len(messages)
    results = await asyncio.gather(*(publish(target, m) for m in messages), return_exceptions=True)
    return [r if isinstance(r, BaseException) else None for r in results]


class BackgroundCloser:
    """Closes connections a publisher abandoned (after a timeout or a loss) without waiting for them: a hung
    peer never answers a close. Each close is bounded by ``timeout``; :meth:`wait` awaits those in progress."""

    def __init__(self, timeout: float) -> None:
        self.timeout = to_seconds(timeout, name="timeout", allow_zero=False)
        self._tasks: set[asyncio.Future[None]] = set()

    def close_later(self, conn: Any) -> None:
        """Start closing ``conn`` (anything with an awaitable ``close()``) in the background."""
        task = asyncio.ensure_future(self.close_now(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close_now(self, conn: Any) -> None:
        """Close ``conn``, waiting at most ``timeout``; errors of an already broken connection are ignored."""
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(conn.close(), self.timeout)

    async def wait(self) -> None:
        """Until the closes in progress have finished (each is bounded)."""
        tasks, self._tasks = list(self._tasks), set()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
