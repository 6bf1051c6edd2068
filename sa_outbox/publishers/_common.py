"""What every broker adapter shares: the message as a dict/JSON and the missing-extra error."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NoReturn

from .._messages import Message
from ..errors import ConfigurationError

__all__ = ["AmqpRouting", "envelope", "envelope_json", "headers_for", "missing_extra"]


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
        timeout: float = 5.0,
    ) -> None:
        if unroutable not in ("retry", "dead"):
            raise ConfigurationError("unroutable must be 'retry' or 'dead'")
        self.exchange = exchange
        self.routing_key = routing_key
        self.mandatory = mandatory
        self.unroutable = unroutable
        self.timeout = timeout

    def _key(self, message: Message) -> str:
        if self.routing_key is None:
            return message.event_type
        return self.routing_key(message) if callable(self.routing_key) else self.routing_key

    def _unroutable(self, text: str) -> BaseException:
        from ..errors import PermanentError, RetryableError

        return PermanentError(text) if self.unroutable == "dead" else RetryableError(text)
