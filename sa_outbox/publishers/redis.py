"""Redis Streams publisher (extra ``redis``): ``XADD`` of the message's fields, optional ``MAXLEN ~``.

Each header of the message (with the publish span's ``traceparent``) is a field ``header:<name>``.
``envelope="cloudevents"`` writes a binary-mode CloudEvent the way the Kafka protocol binding does for a
record's headers — ``ce_id``, ``ce_source``, ``ce_type``, … and ``content-type`` fields, the payload JSON in
the ``data`` field — since Redis has no binding of its own and a stream entry is a set of fields, like Kafka
headers (``sa_outbox.inbox.message_id_from_redis`` reads ``ce_id`` then).

``publish_many`` sends a batch in one pipeline (one round trip) and reports per message. Redis Streams has no
server-side de-duplication: consumers de-duplicate by the ``message_id`` field (see
:func:`sa_outbox.inbox.message_id_from_redis`). Failures (:func:`classify_redis_error`):

* :class:`~sa_outbox.DestinationUnavailable` — the server as a whole cannot take writes now: connection
  refused or lost, DNS failure, a connect timeout, refused credentials, and the replies ``OOM`` (``maxmemory``
  reached with ``noeviction``), ``READONLY`` (connected to a replica, e.g. a demoted master right after a
  failover: the pool's connections are dropped so that the next call connects afresh), ``MISCONF`` (the last
  background save failed), ``BUSY`` (a script runs too long), ``LOADING``, ``MASTERDOWN``, ``CLUSTERDOWN``.
  A ``publish_many`` that cannot reach the server returns it for every message.
  A read timeout is one too when a ``PING`` right after it gets no answer either (a hung server, or a frozen
  proxy in front of it, still accepts connections).
* :class:`~sa_outbox.NoAnswer` — a read timeout the server answers ``PING`` after (writes paused, say).
* :class:`~sa_outbox.RetryableError` — this command failed: ``TRYAGAIN``, a garbled reply.
* :class:`~sa_outbox.PermanentError` — any other error reply (``WRONGTYPE`` on the stream key, ``NOPERM``,
  a syntax error): retrying the same command cannot succeed.

A publisher built from a URL makes one attempt per call (redis-py's own retries would multiply
``timeout``): ``timeout`` bounds connecting and each read and write, and the dispatcher owns retries.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from .._durations import Duration, to_seconds
from .._messages import Message
from ..errors import DestinationUnavailable, NoAnswer, PermanentError, RetryableError
from ._common import Envelope, envelope, missing_extra, outgoing_headers, payload_json

try:
    import redis
    from redis import exceptions as rex
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    missing_extra("redis", exc)

__all__ = ["HEADER_FIELD_PREFIX", "RedisStreamPublisher", "classify_redis_error"]

#: Each header of the message is a field ``header:<name>`` of the stream entry (in both envelopes), so that a
#: header can never overwrite an envelope field.
HEADER_FIELD_PREFIX = "header:"

# Error replies that mean "the server cannot take writes now", whatever the message.
_UNAVAILABLE_REPLIES = frozenset(
    {"OOM", "READONLY", "MISCONF", "BUSY", "LOADING", "MASTERDOWN", "CLUSTERDOWN"}
)
_RETRYABLE_REPLIES = frozenset({"TRYAGAIN"})
_REPLY_CLASSES: tuple[tuple[type[Exception], str], ...] = (
    (rex.BusyLoadingError, "LOADING"),
    (rex.ReadOnlyError, "READONLY"),
    (rex.OutOfMemoryError, "OOM"),
    (rex.MasterDownError, "MASTERDOWN"),
    (rex.ClusterDownError, "CLUSTERDOWN"),
    (rex.TryAgainError, "TRYAGAIN"),
)


def _reply_code(exc: Exception) -> str:
    """The error reply's code (``OOM``, ``READONLY``, …): redis-py strips it from the text of the errors it
    has a class for and keeps the whole reply in the text of the others."""
    for cls, code in _REPLY_CLASSES:
        if isinstance(exc, cls):
            return code
    words = str(exc).split(maxsplit=1)
    return words[0] if words and words[0].isupper() else ""


def classify_redis_error(exc: Exception) -> BaseException:
    """The failure class a redis-py exception means for the message being written (see the module docs)."""
    code = _reply_code(exc)
    text = f"{code} {exc}" if code and not str(exc).startswith(code) else str(exc)
    if code in _UNAVAILABLE_REPLIES:
        return DestinationUnavailable(f"redis cannot take writes now: {text}")
    if isinstance(exc, rex.TimeoutError):
        if "connecting" in str(exc):
            return DestinationUnavailable(f"redis unavailable: {exc}")
        return RetryableError(f"redis command timed out: {exc}")
    if isinstance(exc, rex.ConnectionError):  # refused, lost, DNS, credentials refused, too many clients
        return DestinationUnavailable(f"redis unavailable: {exc}")
    if code in _RETRYABLE_REPLIES:
        return RetryableError(f"redis asked to try again: {text}")
    if isinstance(exc, rex.ResponseError):
        return PermanentError(f"redis refused XADD: {text}")
    return RetryableError(f"redis error: {type(exc).__name__}: {exc}")


class RedisStreamPublisher:
    """``RedisStreamPublisher("redis://127.0.0.1:6379/0", stream="events")``; ``stream`` may be a callable of the
    message (e.g. ``lambda m: f"events.{m.aggregate_type}"``). ``timeout`` bounds every command.
    ``envelope`` is ``"outbox"`` (the envelope's fields) or ``"cloudevents"`` (needs ``source``)."""

    messaging_system = "redis"

    def __init__(
        self,
        url_or_client: str | Any,
        *,
        stream: str | Callable[[Message], str] = "outbox",
        maxlen: int | None = None,
        timeout: Duration = 5.0,
        envelope: str = "outbox",
        source: str | Callable[[Message], str] | None = None,
    ) -> None:
        self.envelope = Envelope(envelope, source)
        timeout = to_seconds(timeout, name="timeout", allow_zero=False)
        if isinstance(url_or_client, str):
            self.client = redis.Redis.from_url(
                url_or_client,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                retry=Retry(NoBackoff(), 0),
            )
        else:
            self.client = url_or_client
        self.stream = stream
        self.maxlen = maxlen
        self.timeout = timeout

    def _key(self, message: Message) -> str:
        return self.stream(message) if callable(self.stream) else self.stream

    def messaging_destination(self, message: Message) -> str:
        """``messaging.destination.name`` of the publish span: the stream key."""
        return self._key(message)

    def _fields(self, message: Message) -> dict[str, str]:
        """The entry: the envelope's fields (the payload as JSON text) — or, for CloudEvents, the attributes as
        ``ce_*`` fields, ``content-type`` and the payload JSON as ``data`` (the Kafka binding's binary mode,
        a field for each header) — and ``header:<name>`` per header."""
        if self.envelope.cloudevents:
            attributes = self.envelope.ce_attributes(message)
            fields = {"content-type": attributes.pop("datacontenttype")}
            fields.update({f"ce_{k}": v for k, v in attributes.items()})
            fields["data"] = payload_json(message).decode()
        else:
            plain = envelope(message)
            plain["payload"] = json.dumps(plain["payload"], separators=(",", ":"))
            fields = {k: str(v) for k, v in plain.items()}
        for name, value in outgoing_headers(message).items():
            fields[HEADER_FIELD_PREFIX + name] = value
        return fields

    def _add(self, target: Any, message: Message) -> Any:
        return target.xadd(
            self._key(message), self._fields(message), maxlen=self.maxlen, approximate=self.maxlen is not None
        )

    def _failure(self, exc: Exception) -> BaseException:
        if _reply_code(exc) == "READONLY":  # a demoted master: let the next call connect afresh (DNS, VIP)
            self.client.connection_pool.disconnect()
        failure = classify_redis_error(exc)
        if isinstance(exc, rex.TimeoutError) and not isinstance(failure, DestinationUnavailable):
            # A reply that never came: this command was slow, or the server answers nothing at all (hung,
            # stopped, a frozen proxy in front of it — the connection still opens). PING tells them apart; a
            # server that does not answer it either is down for every message, and spending this one's
            # attempts on it would send messages to dead for an outage.
            try:
                self.client.ping()
            except rex.RedisError as again:
                return DestinationUnavailable(f"redis unavailable: {exc}; PING got no answer either: {again}")
            return NoAnswer(f"redis command timed out (the server answers PING): {exc}")
        return failure

    def publish(self, message: Message) -> None:
        """``XADD`` one message; raises its failure class (see the module docs)."""
        try:
            self._add(self.client, message)
        except rex.RedisError as exc:
            raise self._failure(exc) from exc

    def publish_many(self, messages: Sequence[Message]) -> list[BaseException | None]:
        """``XADD`` a batch in one pipeline; one entry per message: ``None`` when written, else its failure
        class. A server out of reach fails every message with :class:`~sa_outbox.DestinationUnavailable`."""
        pipe = self.client.pipeline(transaction=False)
        for m in messages:
            self._add(pipe, m)
        try:
            results = pipe.execute(raise_on_error=False)
        except rex.RedisError as exc:
            return [self._failure(exc)] * len(messages)
        return [self._failure(r) if isinstance(r, Exception) else None for r in results]

    def close(self) -> None:
        self.client.close()
