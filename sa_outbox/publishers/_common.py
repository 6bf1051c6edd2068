"""What every broker adapter shares: the message as a dict/JSON, its headers as the broker gets them, the
CloudEvents 1.0 envelope, the missing-extra error, AMQP routing, and for the asyncio adapters the batch shape
and the closing of abandoned connections.

**Headers.** :func:`outgoing_headers` is what every publisher copies into the broker's own header slot: the
message's headers, with the trace context of its publish span when the dispatcher opened one
(:func:`sa_outbox._tracing.inject`). The publisher's own metadata headers are written after them and win.

**CloudEvents** (``envelope="cloudevents"``, :class:`Envelope`): ``id`` = ``message_id``, ``source`` = the
publisher's ``source`` option (required: a URI-reference naming the producing context, or a callable of the
message), ``type`` = ``event_type``, ``subject`` = ``"<aggregate_type>/<aggregate_id>"``, ``time`` =
``created_at`` (RFC 3339), ``datacontenttype`` = ``application/json``, ``data`` = the payload. Binary content
mode where the broker has headers — attributes as ``ce-*`` headers (HTTP, NATS, RabbitMQ per the RabbitMQ
binding), ``ce_*`` fields (Redis, as the Kafka binding does for its key/value headers), unprefixed MQTT v5
user properties — with the payload JSON as the body; structured mode (``application/cloudevents+json``)
where it has none (MQTT 3.1.1), the headers then travel as extension attributes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC
from typing import Any, NoReturn, TypeVar
from urllib.parse import quote

from .. import _tracing
from .._durations import Duration, to_seconds
from .._messages import Message
from ..errors import ConfigurationError, PermanentError

__all__ = [
    "CE_CONTENT_TYPE",
    "CE_STRUCTURED_CONTENT_TYPE",
    "ENVELOPES",
    "AmqpRouting",
    "BackgroundCloser",
    "Envelope",
    "ce_header_value",
    "envelope",
    "envelope_json",
    "headers_for",
    "missing_extra",
    "outgoing_headers",
    "payload_json",
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


def payload_json(message: Message) -> bytes:
    """The payload alone as JSON: the body of a binary-mode CloudEvent."""
    return json.dumps(message.payload, separators=(",", ":")).encode()


def outgoing_headers(message: Message) -> dict[str, str]:
    """The message's headers as the broker should get them (a new dict): with the trace context of its publish
    span when one is open (see :func:`sa_outbox._tracing.inject`), else as the producer wrote them."""
    headers = dict(message.headers)
    if _tracing.ENABLED:
        _tracing.inject(headers, message)
    return headers


# --- CloudEvents 1.0 ----------------------------------------------------------------------------------------

#: ``datacontenttype`` of the envelope: the payload is JSON.
CE_CONTENT_TYPE = "application/json"
#: The media type of a structured-mode CloudEvent in the JSON event format.
CE_STRUCTURED_CONTENT_TYPE = "application/cloudevents+json"
ENVELOPES = ("outbox", "cloudevents")
# Extension attribute names (CloudEvents 1.0 §"Attribute Naming Convention") and the names a context
# attribute already uses.
_CE_NAME = re.compile(r"[a-z0-9]{1,20}")
_CE_CORE = frozenset(
    {"id", "source", "specversion", "type", "datacontenttype", "dataschema", "subject", "time", "data",
     "data_base64"}
)  # fmt: skip
# HTTP binding §3.1.3.2: printable ASCII is kept as is except space, double quote and percent.
_CE_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in ' "%')


def ce_header_value(value: str) -> str:
    """A CloudEvents attribute value percent-encoded for an HTTP-style header (HTTP, NATS)."""
    return quote(value, safe=_CE_SAFE)


class Envelope:
    """The ``envelope`` option of every publisher: ``"outbox"`` (the JSON envelope of :func:`envelope`, the
    default) or ``"cloudevents"`` (CloudEvents 1.0, with ``source`` required: a string, or a callable of the
    message)."""

    def __init__(
        self, envelope: str = "outbox", source: str | Callable[[Message], str] | None = None
    ) -> None:
        if envelope not in ENVELOPES:
            raise ConfigurationError(f"envelope must be one of {ENVELOPES}, got {envelope!r}")
        if envelope == "cloudevents" and (source is None or (isinstance(source, str) and not source.strip())):
            raise ConfigurationError(
                "envelope='cloudevents' needs source=: a URI-reference naming the producing context "
                "(e.g. 'https://shop.example.com/orders' or '/billing'), or a callable of the message"
            )
        self.envelope = envelope
        self.source = source
        self.cloudevents = envelope == "cloudevents"

    def ce_attributes(self, message: Message) -> dict[str, str]:
        """The envelope's context attributes, each as its canonical string (``datacontenttype`` included)."""
        source = self.source(message) if callable(self.source) else self.source
        created = message.created_at
        if created.tzinfo is None:  # a value built by hand: the database's timestamptz always has a zone
            created = created.replace(tzinfo=UTC)
        time = created.isoformat()
        time = time[:-6] + "Z" if time.endswith("+00:00") else time  # RFC 3339
        return {
            "specversion": "1.0",
            "id": message.message_id,
            "source": str(source),
            "type": message.event_type,
            "subject": f"{message.aggregate_type}/{message.aggregate_id}",
            "time": time,
            "datacontenttype": CE_CONTENT_TYPE,
        }

    def ce_structured(self, message: Message, headers: dict[str, str]) -> bytes:
        """The event in structured mode (JSON event format), ``headers`` as extension attributes. A header that
        cannot be an extension attribute (its name is not 1–20 lowercase letters and digits, or is a context
        attribute's) cannot be carried: that message fails with :class:`PermanentError` naming it."""
        event: dict[str, Any] = self.ce_attributes(message)
        for name, value in headers.items():
            if _CE_NAME.fullmatch(name) is None or name in _CE_CORE:
                raise PermanentError(
                    f"message {message.message_id}: header {name!r} cannot travel in a structured CloudEvent "
                    "(extension attribute names are 1-20 lowercase letters and digits, other than the context "
                    "attributes'); use a broker with headers (binary mode) or rename it"
                )
            event[name] = value
        event["data"] = message.payload
        return json.dumps(event, separators=(",", ":")).encode()


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


def _short_string(message: Message, what: str, text: str) -> None:
    """PermanentError naming ``what`` when ``text`` is longer than an AMQP short string (255 bytes of UTF-8):
    the client refuses to encode the frame, for that message at every try — and reported as a lost connection,
    it held the publisher's circuit open for good (a hostile review: an event type of 300 characters)."""
    if len(text) > 63 and len(text.encode()) > 255:
        from ..errors import PermanentError

        raise PermanentError(
            f"message {message.message_id}: the {what} is {len(text.encode())} bytes; AMQP carries at most 255 "
            f"({text[:60]!r}…)"
        )


class AmqpRouting:
    """Where an AMQP publisher (pika or aio-pika) sends a message, what an unroutable one means, and what the
    message looks like: the JSON envelope, or a binary-mode CloudEvent per the CloudEvents RabbitMQ protocol
    binding (``ce-*`` headers, ``content_type`` = ``datacontenttype``, the payload JSON as the body)."""

    messaging_system = "rabbitmq"

    def __init__(
        self,
        *,
        exchange: str = "",
        routing_key: str | Callable[[Message], str] | None = None,
        mandatory: bool = True,
        unroutable: str = "retry",
        timeout: Duration = 5.0,
        envelope: str = "outbox",
        source: str | Callable[[Message], str] | None = None,
    ) -> None:
        if unroutable not in ("retry", "dead"):
            raise ConfigurationError("unroutable must be 'retry' or 'dead'")
        self.exchange = exchange
        self.routing_key = routing_key
        self.mandatory = mandatory
        self.unroutable = unroutable
        self.timeout = to_seconds(timeout, name="timeout", allow_zero=False)
        self.envelope = Envelope(envelope, source)

    def _key(self, message: Message) -> str:
        if self.routing_key is None:
            key = message.event_type
        else:
            key = self.routing_key(message) if callable(self.routing_key) else self.routing_key
        _short_string(message, "routing key", key)
        return key

    def messaging_destination(self, message: Message) -> str:
        """``messaging.destination.name`` of the publish span: the exchange (``amq.default`` for the default)."""
        return self.exchange or "amq.default"

    def _frame(self, message: Message) -> tuple[bytes, dict[str, str], str]:
        """Body, headers and content type of the AMQP message: the message's headers, then (CloudEvents) the
        ``ce-*`` attributes, then the publisher's own metadata headers."""
        headers = outgoing_headers(message)
        _short_string(message, "event type (the message's type property)", message.event_type)
        for name in headers:
            _short_string(message, "header name", name)
        if not self.envelope.cloudevents:
            return envelope_json(message), {**headers, **headers_for(message)}, "application/json"
        attributes = self.envelope.ce_attributes(message)
        content_type = attributes.pop("datacontenttype")
        ce = {f"ce-{k}": v for k, v in attributes.items()}
        return payload_json(message), {**headers, **ce, **headers_for(message)}, content_type

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
