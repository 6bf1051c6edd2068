"""RabbitMQ publisher (extra ``rabbitmq``, pika): persistent messages with publisher confirms.

* ``message_id`` property = the outbox id (consumers de-duplicate on it); the message's ``headers`` (with the
  publish span's ``traceparent``) and then event type, aggregate, lease version and attempts travel as AMQP
  headers; ``content_type`` is JSON; ``delivery_mode=2`` (persistent). ``envelope="cloudevents"`` (with
  ``source=``) sends a binary-mode CloudEvent per the CloudEvents RabbitMQ binding: ``ce-*`` headers,
  ``content_type`` ``application/json``, the payload JSON as the body.
* Every message waits for the broker's publisher confirm, and every outcome is per message. ``publish_many``
  (the dispatcher's batch path) pipelines: it publishes the whole batch back to back on one confirm-mode
  channel, then waits once for all the confirms, matched to messages by delivery tag. A message the broker
  acks is delivered; one it nacks (a queue at ``max-length`` with ``overflow=reject-publish``, an internal
  error) is :class:`~sa_outbox.RetryableError` — the messages of the same batch that fit stay delivered.
* One deadline: ``publish`` and ``publish_many`` return within ``timeout`` seconds in total — connecting
  included — whatever the network does (a hung connection cannot hold a call longer). Messages still
  unconfirmed at the deadline are :class:`~sa_outbox.RetryableError` (they may have reached the broker: at
  least once), and the connection is dropped so that the next call starts on a fresh one.
* The destination as a whole is down — connection refused or lost (a broker restart), DNS failure, a handshake
  that does not finish in time, a broker that blocks publishers (memory/disk alarm) past the deadline, refused
  credentials — is :class:`~sa_outbox.DestinationUnavailable` for every message of the call; the next call
  reconnects.
* Unroutable messages (``mandatory=True`` and no queue bound) and a missing exchange: by default
  **retryable** — the topology is often declared by consumers that start later, and retrying ends ``dead``
  after ``max_attempts`` anyway, where an operator sees it; ``unroutable="dead"`` makes them
  :class:`~sa_outbox.PermanentError` instead. Any other channel error is retryable.

pika's blocking connection cannot pipeline confirms (in confirm mode each ``basic_publish`` waits for its own
confirm) nor bound a call in time (its socket timeout covers connecting only). So the publisher drives pika's
asynchronous ``SelectConnection`` on a private I/O thread, started at the first publish and stopped by
:meth:`RabbitMQPublisher.close`; calls from any thread hand their batch to it and wait with a deadline.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from .._durations import Duration
from .._messages import Message
from ..errors import DestinationUnavailable, NoAnswer, RetryableError
from ._common import AmqpRouting, missing_extra

try:
    import pika  # type: ignore[import-untyped]
    from pika import exceptions as pex
    from pika.adapters.select_connection import IOLoop  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    missing_extra("rabbitmq", exc)

__all__ = ["RabbitMQPublisher"]

LOG = logging.getLogger("sa_outbox.publishers.rabbitmq")

_PENDING: Any = object()


class _Batch:
    """The messages of one call and their outcomes, shared by the caller and the I/O thread (under a lock).

    ``frames`` holds each message ready to send (routing key, body, properties), built on the caller's thread
    so that a failing ``routing_key`` callable fails its own message, never the I/O thread.
    """

    def __init__(self, messages: Sequence[Message]) -> None:
        self.messages = messages
        self.frames: list[tuple[str, bytes, Any] | None] = [None] * len(messages)
        self.results: list[Any] = [_PENDING] * len(messages)
        self.sent = [False] * len(messages)
        self.left = len(messages)
        self.lock = threading.Lock()
        self.done = threading.Event()
        if not messages:
            self.done.set()

    def settle(self, index: int, outcome: BaseException | None) -> None:
        with self.lock:
            if self.results[index] is _PENDING:
                self.results[index] = outcome
                self.left -= 1
                if self.left == 0:
                    self.done.set()

    def settle_rest(self, outcome: Callable[[bool], BaseException]) -> None:
        """Every message still pending gets ``outcome(sent)``."""
        with self.lock:
            for i, r in enumerate(self.results):
                if r is _PENDING:
                    self.results[i] = outcome(self.sent[i])
            self.left = 0
            self.done.set()


def _cause(error: BaseException) -> str:
    """The innermost reason pika wraps in its connection errors (whose own text is often empty)."""
    seen = 0
    while seen < 5:
        seen += 1
        inner = getattr(error, "exceptions", None) or [a for a in error.args if isinstance(a, BaseException)]
        if not inner:
            break
        error = inner[-1]
    return f"{type(error).__name__}: {error}"


def _serve(ioloop: Any) -> None:
    """Run the I/O loop until stopped; a bug in a callback is logged and the loop goes on serving."""
    while True:
        try:
            ioloop.start()
            return
        except Exception:
            LOG.exception("sa_outbox rabbitmq I/O thread: a callback failed; the loop goes on")


class RabbitMQPublisher(AmqpRouting):
    """``RabbitMQPublisher("amqp://guest:guest@127.0.0.1:5672/%2F", exchange="orders")``.

    ``routing_key`` is a string or a callable of the message (default: the event type). ``timeout`` (seconds)
    bounds each ``publish`` / ``publish_many`` call as a whole, connecting included. ``envelope`` is
    ``"outbox"`` (the JSON envelope) or ``"cloudevents"`` (needs ``source``). Safe to share between
    threads. ``close()`` disconnects and stops the I/O thread; a later publish starts them again.
    """

    def __init__(
        self,
        url: str,
        *,
        exchange: str = "",
        routing_key: str | Callable[[Message], str] | None = None,
        mandatory: bool = True,
        unroutable: str = "retry",
        timeout: Duration = 5.0,
        envelope: str = "outbox",
        source: str | Callable[[Message], str] | None = None,
    ) -> None:
        super().__init__(exchange=exchange, routing_key=routing_key, mandatory=mandatory, unroutable=unroutable,
                         timeout=timeout, envelope=envelope, source=source)  # fmt: skip
        params = pika.URLParameters(url)
        params.socket_timeout = params.stack_timeout = params.blocked_connection_timeout = self.timeout
        params.connection_attempts = 1
        self.params = params
        self._where = f"{params.host}:{params.port}"
        self._lock = threading.Lock()  # guards starting/stopping the I/O thread
        self._pid = os.getpid()
        self._ioloop: Any = None
        self._thread: threading.Thread | None = None
        # Owned by the I/O thread from here on.
        self._conn: Any = None
        self._channel: Any = None  # open and in confirm mode, or None
        self._opening_channel = False
        self._blocked = False
        self._waiting: deque[_Batch] = deque()
        self._inflight: dict[int, tuple[_Batch, int]] = {}
        self._tags_by_id: dict[str, deque[int]] = {}
        self._returned: set[int] = set()
        self._next_tag = 0

    # --- the caller's side -----------------------------------------------------------------------------

    def publish(self, message: Message) -> None:
        """Deliver one message; returns when the broker confirmed it, raises the failure class otherwise."""
        error = self._run([message])[0]
        if error is not None:
            raise error

    def publish_many(self, messages: Sequence[Message]) -> list[BaseException | None]:
        """Publish a batch back to back and wait once for all its confirms (within ``timeout`` in total).

        One entry per message, in order: ``None`` when the broker confirmed it, else its failure class.
        """
        return self._run(messages)

    def _run(self, messages: Sequence[Message]) -> list[BaseException | None]:
        batch = _Batch(messages)
        for i, m in enumerate(messages):
            try:
                batch.frames[i] = (self._key(m), *self._body_and_props(m))
            except Exception as exc:  # a bug in a routing_key callable: that message's own failure
                batch.settle(i, exc)
        if batch.done.is_set():
            return list(batch.results)
        ioloop = self._start()
        ioloop.add_callback_threadsafe(lambda: self._submit(batch, ioloop))
        if not batch.done.wait(self.timeout):
            blocked = self._blocked

            def late(sent: bool) -> BaseException:
                if blocked:
                    return DestinationUnavailable(
                        f"rabbitmq at {self._where} blocks publishers (a memory or disk alarm) for over "
                        f"{self.timeout:g}s"
                    )
                if not sent:
                    return DestinationUnavailable(
                        f"rabbitmq at {self._where} did not open a connection and channel within {self.timeout:g}s"
                    )
                return NoAnswer(
                    f"no publisher confirm from rabbitmq at {self._where} within {self.timeout:g}s "
                    "(the connection is dropped; the next publish reconnects)"
                )

            batch.settle_rest(late)
            ioloop.add_callback_threadsafe(lambda: self._drop_connection("a publish timed out"))
        return list(batch.results)

    def _start(self) -> Any:
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's connection and thread are not ours
                self._pid, self._thread, self._waiting, self._inflight = os.getpid(), None, deque(), {}
                self._tags_by_id, self._returned = {}, set()
                self._reset()
            if self._thread is None or not self._thread.is_alive():
                self._ioloop = IOLoop()
                self._thread = threading.Thread(
                    target=_serve, args=(self._ioloop,), name="sa_outbox-rabbitmq", daemon=True
                )
                self._thread.start()
            return self._ioloop

    def close(self) -> None:
        """Close the connection and stop the I/O thread (waits at most ``timeout`` + 1 s)."""
        with self._lock:
            ioloop, thread, self._ioloop, self._thread = self._ioloop, self._thread, None, None
        if ioloop is None or thread is None:
            return
        ioloop.add_callback_threadsafe(lambda: self._shutdown(ioloop))
        thread.join(self.timeout + 1)
        if not thread.is_alive():
            ioloop.close()

    # --- the I/O thread's side -------------------------------------------------------------------------

    def _submit(self, batch: _Batch, ioloop: Any) -> None:
        if self._channel is not None:
            self._send(batch)
            return
        self._waiting.append(batch)
        if self._conn is None:
            self._conn = pika.SelectConnection(
                self.params,
                on_open_callback=self._on_connection_open,
                on_open_error_callback=self._on_connection_error,
                on_close_callback=self._on_connection_closed,
                custom_ioloop=ioloop,
            )
        elif self._conn.is_open and not self._opening_channel:
            self._open_channel()

    def _on_connection_open(self, conn: Any) -> None:
        if conn is not self._conn:
            return
        self._blocked = False
        conn.add_on_connection_blocked_callback(lambda *_: setattr(self, "_blocked", True))
        conn.add_on_connection_unblocked_callback(lambda *_: setattr(self, "_blocked", False))
        self._open_channel()

    def _open_channel(self) -> None:
        self._opening_channel = True
        self._conn.channel(on_open_callback=self._on_channel_open)

    def _on_channel_open(self, channel: Any) -> None:
        if channel.connection is not self._conn:
            return
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        # Each channel's confirms go to a callback bound to that channel object: a confirm is one of the
        # current channel's only if it came on that very channel. Checked by channel *number* (1 on every
        # connection), a late ack on a connection dropped after a timeout confirmed the message with the same
        # delivery tag on the next connection — one that never reached the broker (a hostile review: reported
        # delivered, never on the queue).
        channel.confirm_delivery(
            ack_nack_callback=lambda frame: self._on_confirm(channel, frame),
            callback=lambda _: self._on_ready(channel),
        )

    def _on_ready(self, channel: Any) -> None:
        self._opening_channel = False
        if channel.connection is not self._conn or not channel.is_open:
            return
        self._channel, self._next_tag = channel, 0
        while self._waiting and self._channel is not None:
            self._send(self._waiting.popleft())

    def _send(self, batch: _Batch) -> None:
        channel = self._channel
        for i, (m, frame) in enumerate(zip(batch.messages, batch.frames, strict=True)):
            if batch.done.is_set():
                return  # the caller gave up (deadline): publish nothing more of it
            if frame is None:
                continue  # already failed on the caller's side
            key, body, props = frame
            try:
                channel.basic_publish(self.exchange, key, body, props, mandatory=self.mandatory)
            except (pex.AMQPError, OSError) as exc:  # the channel or connection is already closing
                batch.settle(
                    i, DestinationUnavailable(f"rabbitmq connection lost: {type(exc).__name__}: {exc}")
                )
                continue
            self._next_tag += 1
            with batch.lock:
                batch.sent[i] = True
            self._inflight[self._next_tag] = (batch, i)
            self._tags_by_id.setdefault(m.message_id, deque()).append(self._next_tag)

    def _on_return(self, channel: Any, method: Any, properties: Any, body: bytes) -> None:
        # A mandatory message no queue took: basic.return arrives before the basic.ack of the same message.
        tags = self._tags_by_id.get(str(properties.message_id))
        if channel is self._channel and tags:
            self._returned.add(tags[0])

    def _on_confirm(self, channel: Any, frame: Any) -> None:
        method = frame.method
        if channel is not self._channel:
            return  # a confirm of a channel (or connection) this publisher has given up on
        acked = isinstance(method, pika.spec.Basic.Ack)
        tags = [method.delivery_tag]
        if method.multiple:  # every tag up to this one; _inflight holds tags in increasing order
            tags = list(itertools.takewhile(lambda t: t <= method.delivery_tag, self._inflight))
        for tag in tags:
            entry = self._inflight.pop(tag, None)
            if entry is None:
                continue
            batch, i = entry
            message, key = batch.messages[i], batch.frames[i][0]  # type: ignore[index]
            queue = self._tags_by_id.get(message.message_id)
            if queue and tag in queue:
                queue.remove(tag)
                if not queue:
                    del self._tags_by_id[message.message_id]
            if not acked:
                batch.settle(i, RetryableError(
                    f"rabbitmq nacked the message (a queue at max-length with overflow=reject-publish, or a "
                    f"broker error): exchange {self.exchange!r} routing key {key!r}"
                ))  # fmt: skip
            elif tag in self._returned:
                self._returned.discard(tag)
                batch.settle(i, self._unroutable(
                    f"unroutable: no queue bound for exchange {self.exchange!r} routing key {key!r}"
                ))  # fmt: skip
            else:
                batch.settle(i, None)

    def _on_channel_closed(self, channel: Any, reason: BaseException) -> None:
        if channel.connection is not self._conn or not isinstance(reason, pex.ChannelClosedByBroker):
            return  # closed with its connection: the connection's callback fails what is in flight
        # The broker closed the channel (e.g. 404: no such exchange): what was in flight on it failed; the
        # batches still waiting get a fresh channel.
        self._channel, self._opening_channel = None, False
        self._fail_inflight(self._channel_error(reason))
        if self._waiting and self._conn.is_open:
            self._open_channel()

    def _channel_error(self, reason: Any) -> Callable[[], BaseException]:
        code, text = reason.reply_code, reason.reply_text
        if code == 404:
            return lambda: self._unroutable(
                f"exchange {self.exchange!r} does not exist (declare it, or let its consumers): {code} {text}"
            )
        return lambda: RetryableError(f"rabbitmq closed the channel: {code} {text}")

    def _on_connection_error(self, conn: Any, error: BaseException) -> None:
        if conn is not self._conn:
            return
        self._reset()
        self._fail_waiting(
            lambda: DestinationUnavailable(f"rabbitmq unavailable at {self._where}: {_cause(error)}")
        )  # fmt: skip

    def _on_connection_closed(self, conn: Any, reason: BaseException) -> None:
        if conn is not self._conn:
            return
        self._reset()
        lost = lambda: DestinationUnavailable(f"rabbitmq connection lost: {_cause(reason)}")  # noqa: E731
        self._fail_inflight(lost)
        self._fail_waiting(lost)

    def _reset(self) -> None:
        self._conn = self._channel = None
        self._opening_channel = self._blocked = False

    def _fail_inflight(self, error: Callable[[], BaseException]) -> None:
        inflight, self._inflight = self._inflight, {}
        self._tags_by_id.clear()
        self._returned.clear()
        for batch, i in inflight.values():
            batch.settle(i, error())

    def _fail_waiting(self, error: Callable[[], BaseException]) -> None:
        while self._waiting:
            self._waiting.popleft().settle_rest(lambda _sent: error())

    def _drop_connection(self, why: str) -> None:
        """Forget the current connection (a hung one never answers a close) and close it if it can be."""
        conn = self._conn
        if conn is None:
            return
        self._reset()
        self._fail_inflight(lambda: RetryableError(f"rabbitmq connection dropped: {why}"))
        self._fail_waiting(lambda: DestinationUnavailable(f"rabbitmq connection dropped: {why}"))
        if not (conn.is_closing or conn.is_closed):
            conn.close()

    def _shutdown(self, ioloop: Any) -> None:
        conn = self._conn
        self._drop_connection("the publisher was closed")
        if conn is None or conn.is_closed:
            ioloop.stop()
            return
        conn.add_on_close_callback(lambda *_: ioloop.stop())
        ioloop.call_later(self.timeout, ioloop.stop)  # a hung connection: stop anyway

    def _body_and_props(self, message: Message) -> tuple[bytes, Any]:
        body, headers, content_type = self._frame(message)
        props = pika.BasicProperties(
            message_id=message.message_id,
            content_type=content_type,
            delivery_mode=2,
            type=message.event_type,
            headers=headers,
        )
        return body, props
