"""NATS JetStream publisher (extra ``nats``, nats-py).

Each message is published with the ``Nats-Msg-Id`` header set to the outbox id, so the stream's duplicate
window drops a re-publish after a lost lease (the second publish is acknowledged as a duplicate and the
stream keeps one copy). The subject comes from the event (default ``<prefix>.<event_type>``). The message's
``headers`` (with the publish span's ``traceparent``) travel as NATS headers. ``envelope="cloudevents"``
sends a binary-mode CloudEvent (NATS protocol binding: ``ce-*`` headers and ``content-type``, the payload
JSON as the body).

Failures:

* :class:`~sa_outbox.DestinationUnavailable` — no server reachable (``NoServersError``, connection refused,
  DNS failure, a connect that does not finish in time), the connection lost or closed under a publish, or
  JetStream answering "temporarily unavailable" (503). A ``publish_many`` that cannot connect returns it for
  every message; the next call reconnects.
* :class:`~sa_outbox.RetryableError` — no acknowledgement within the deadline (the connection is dropped,
  since a hung one would time out every later call too; the next call reconnects), no stream bound to the
  subject yet (no responders), any other JetStream error.
* :class:`~sa_outbox.PermanentError` — the message is too big: larger than the server's ``max_payload``
  (checked before sending, envelope and headers included; the message names both sizes) or than the stream's
  ``max_msg_size`` (JetStream error 10054).

**Message size.** NATS refuses a message larger than the server's ``max_payload``, 1 MiB by default, and
the limit applies to what is sent: the JSON envelope (``message_id``, aggregate, event type, attempts,
``created_at`` and the payload) plus the headers, a few hundred bytes more than the payload itself. The model's
default payload limit (``sa_outbox_max_payload_bytes``) is also 1 MiB, so a payload near it does not fit a
default server. Either raise ``max_payload`` in ``nats-server.conf`` (e.g. ``max_payload: 8MB``; NATS
advises at most 8 MB and refuses more than 64 MB) or set ``sa_outbox_max_payload_bytes`` on the model a few
KiB below the server's limit. The client library checks the payload alone and a server that receives an
oversize message drops the whole connection, so this publisher checks the full size first.

``timeout`` bounds each call as a whole (``publish`` / ``publish_many``, connecting included).
:class:`AsyncNatsPublisher` is for :class:`~sa_outbox.AsyncDispatcher`; ``publish_many`` awaits the acks of
a whole batch together. :class:`NatsPublisher` is the same for the sync :class:`~sa_outbox.Dispatcher`: it
runs the async client on a private event loop thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .._durations import Duration, to_seconds
from .._messages import Message
from ..errors import DestinationUnavailable, NoAnswer, PermanentError, RetryableError
from ._common import (
    BackgroundCloser,
    Envelope,
    ce_header_value,
    envelope,
    headers_for,
    missing_extra,
    outgoing_headers,
    payload_json,
    publish_each,
)

try:
    from nats import errors as nerr
    from nats.aio.client import Client as NATS
    from nats.js import errors as jserr
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    missing_extra("nats", exc)

__all__ = ["AsyncNatsPublisher", "NatsPublisher"]

# The connection is gone: the destination as a whole is unavailable (checked before nats' TimeoutError,
# which is an OSError too).
_LOST = (
    nerr.ConnectionClosedError,
    nerr.StaleConnectionError,  # includes UnexpectedEOF
    nerr.OutboundBufferLimitError,
    nerr.ConnectionReconnectingError,
    nerr.ConnectionDrainingError,
)
_STREAM_MAX_MSG_SIZE = 10054  # JetStream: "message size exceeds maximum allowed"


def _wire_size(body: bytes, headers: dict[str, str]) -> int:
    """What the server counts against ``max_payload``: the body plus the encoded header block
    (``NATS/1.0\\r\\n`` + ``key: value\\r\\n`` per header + ``\\r\\n``)."""
    block = 10 + sum(len(k.encode()) + 2 + len(v.encode()) + 2 for k, v in headers.items()) + 2
    return len(body) + block


class AsyncNatsPublisher:
    """``AsyncNatsPublisher("nats://127.0.0.1:4222", subject_prefix="orders")``. ``envelope`` is ``"outbox"``
    (the JSON envelope) or ``"cloudevents"`` (needs ``source``)."""

    messaging_system = "nats"

    def __init__(
        self,
        url: str = "nats://127.0.0.1:4222",
        *,
        subject: Callable[[Message], str] | None = None,
        subject_prefix: str = "outbox",
        timeout: Duration = 5.0,
        envelope: str = "outbox",
        source: str | Callable[[Message], str] | None = None,
    ) -> None:
        self.envelope = Envelope(envelope, source)
        self.url = url
        self.subject = subject or (lambda m: f"{subject_prefix}.{m.event_type}")
        self.timeout = to_seconds(timeout, name="timeout", allow_zero=False)
        self._nc: Any = None
        self._js: Any = None
        self._max_payload = 1024 * 1024  # the server's, learnt at connect (its INFO)
        self._closer = BackgroundCloser(self.timeout)

    async def _connect_by(self, deadline: float) -> Any:
        """The JetStream context of a live connection, connecting first if needed (by ``deadline``)."""
        if self._nc is not None and not self._nc.is_closed:
            return self._js

        async def quiet(exc: Exception) -> None:  # errors surface as failure classes, not stderr noise
            return None

        # nats-py makes at most two attempts here (max_reconnect_attempts=1; 0 would mean "retry forever"),
        # each bounded by connect_timeout: half the time left each. A client object of our own, so that a
        # failed handshake can be closed (nats.connect would leak its socket).
        remaining = max(0.05, deadline - asyncio.get_running_loop().time())
        nc = NATS()
        try:
            options: dict[str, Any] = {
                "connect_timeout": remaining / 2
            }  # nats-py annotates it int; float works
            await nc.connect(
                self.url, max_reconnect_attempts=1, reconnect_time_wait=0, allow_reconnect=False, error_cb=quiet,
                **options,
            )  # fmt: skip
        except (nerr.Error, OSError, TimeoutError) as exc:  # NoServersError, refused, DNS, a hung handshake
            await self._closer.close_now(nc)
            raise DestinationUnavailable(f"nats unavailable at {self.url}: {exc!r}") from exc
        self._nc, self._js, self._max_payload = nc, nc.jetstream(timeout=self.timeout), nc.max_payload
        return self._js

    def messaging_destination(self, message: Message) -> str:
        """``messaging.destination.name`` of the publish span: the subject."""
        return self.subject(message)

    def _frame(self, message: Message) -> tuple[str, bytes, dict[str, str]]:
        """Subject, body and headers: the message's headers, then (CloudEvents, binary mode) the ``ce-*``
        attributes (percent-encoded as in HTTP) and ``content-type``, then ``Nats-Msg-Id`` and the
        ``Outbox-*`` metadata."""
        headers = outgoing_headers(message)
        if self.envelope.cloudevents:
            attributes = self.envelope.ce_attributes(message)
            headers["content-type"] = attributes.pop("datacontenttype")
            headers.update({f"ce-{k}": ce_header_value(v) for k, v in attributes.items()})
            body = payload_json(message)
        else:
            body = json.dumps(envelope(message), separators=(",", ":")).encode()
        headers["Nats-Msg-Id"] = message.message_id
        headers.update({f"Outbox-{k.title()}": v for k, v in headers_for(message).items()})
        limit = self._max_payload
        size = _wire_size(body, headers)
        if size > limit:
            raise PermanentError(
                f"message {message.message_id} is {size:,} bytes as sent to NATS (JSON envelope and headers; "
                f"the payload alone is {len(json.dumps(message.payload, separators=(',', ':')).encode()):,}), over "
                f"the server's max_payload of {limit:,} bytes: raise max_payload in nats-server.conf or lower "
                "sa_outbox_max_payload_bytes on the model"
            )
        return self.subject(message), body, headers

    async def _publish(self, js: Any, message: Message, deadline: float) -> None:
        subject, body, headers = self._frame(message)
        remaining = max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            await js.publish(subject, body, timeout=remaining, headers=headers)
        except nerr.MaxPayloadError as exc:  # the server's limit changed since we connected
            raise PermanentError(
                f"message {message.message_id} is over the NATS server's max_payload"
            ) from exc
        except nerr.BadSubjectError as exc:  # whitespace in it (an event type with a space): every try
            raise PermanentError(
                f"message {message.message_id}: {subject!r} is not a valid NATS subject"
            ) from exc
        except (nerr.NoRespondersError, jserr.NoStreamResponseError) as exc:
            raise RetryableError(
                f"no JetStream stream bound to subject {subject!r} (yet): {type(exc).__name__}"
            ) from exc
        except _LOST as exc:
            self._discard()
            raise DestinationUnavailable(f"nats connection lost: {type(exc).__name__}") from exc
        except jserr.ServiceUnavailableError as exc:
            raise DestinationUnavailable(f"JetStream is unavailable: {exc}") from exc
        except jserr.APIError as exc:
            if exc.err_code == _STREAM_MAX_MSG_SIZE:
                raise PermanentError(
                    f"message {message.message_id} ({len(body):,} bytes) is over the stream's max_msg_size: {exc}"
                ) from exc
            raise RetryableError(f"jetstream refused the message: {exc}") from exc
        except (nerr.TimeoutError, TimeoutError) as exc:
            if self._nc is None or self._nc.is_closed:
                raise DestinationUnavailable(f"nats connection lost under a publish to {subject!r}") from exc
            self._discard()
            raise NoAnswer(
                f"no JetStream acknowledgement within {self.timeout:g}s (the connection is dropped; the next "
                "publish reconnects)"
            ) from exc

    def _discard(self) -> None:
        """Forget the connection; close it in the background (a hung one may never answer)."""
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None and not nc.is_closed:
            self._closer.close_later(nc)

    async def publish(self, message: Message) -> None:
        """Publish one message and await its JetStream ack (within ``timeout``); raises its failure class."""
        deadline = asyncio.get_running_loop().time() + self.timeout
        await self._publish(await self._connect_by(deadline), message, deadline)

    async def publish_many(self, messages: Sequence[Message]) -> list[BaseException | None]:
        """Publish a batch and await all its acks together (within ``timeout`` in total); one entry per
        message: ``None`` when acknowledged, else its failure class."""
        deadline = asyncio.get_running_loop().time() + self.timeout
        return await publish_each(
            lambda: self._connect_by(deadline), lambda js, m: self._publish(js, m, deadline), messages
        )

    async def close(self) -> None:
        """Close the connection (waits at most ``timeout``)."""
        self._discard()
        await self._closer.wait()

    async def aclose(self) -> None:
        """The same as :meth:`close`."""
        await self.close()


class NatsPublisher:
    """The sync face of :class:`AsyncNatsPublisher` (same arguments), for the sync Dispatcher."""

    messaging_system = "nats"

    def __init__(self, url: str = "nats://127.0.0.1:4222", **options: Any) -> None:
        self.inner = AsyncNatsPublisher(url, **options)
        self.timeout = self.inner.timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sa_outbox-nats", daemon=True)
        self._thread.start()

    def _call(self, coro: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self.timeout + 1)  # the coroutine keeps its own deadline; this is a backstop
        except TimeoutError as exc:
            future.cancel()
            raise NoAnswer(f"nats publish did not finish within {self.timeout:g}s") from exc

    def messaging_destination(self, message: Message) -> str:
        """See :meth:`AsyncNatsPublisher.messaging_destination`."""
        return self.inner.messaging_destination(message)

    def publish(self, message: Message) -> None:
        """See :meth:`AsyncNatsPublisher.publish`."""
        self._call(self.inner.publish(message))

    def publish_many(self, messages: Sequence[Message]) -> list[BaseException | None]:
        """See :meth:`AsyncNatsPublisher.publish_many`."""
        try:
            result: list[BaseException | None] = self._call(self.inner.publish_many(messages))
        except RetryableError as exc:
            return [exc] * len(messages)
        return result

    def close(self) -> None:
        """Close the connection and stop the private loop thread."""
        if self._loop.is_closed():
            return
        try:
            self._call(self.inner.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()
