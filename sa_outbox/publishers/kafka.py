"""Kafka publisher (extra ``kafka``, confluent-kafka / librdkafka): an idempotent producer, ``acks=all``.

* **Record.** Topic from the message (default ``outbox.event.<aggregate_type>``, the topic Debezium's outbox
  event router picks for the same table); key = ``aggregate_id``; value = the JSON envelope (``message_id``,
  aggregate, event type, payload, ``attempts``, ``lease_version``, ``created_at``); headers ``message_id``
  (consumers de-duplicate on it), ``event-type``, ``aggregate-type``, ``aggregate-id``, ``lease-version``,
  ``attempts``, then the message's own ``headers`` (a trace context, …) except those names. The record's
  timestamp is the produce time, not ``created_at``: an old backlog stamped with its creation time could fall
  straight out of the topic's time-based retention.
* **Order.** The key picks the partition with ``murmur2`` (librdkafka's ``murmur2_random``), the partitioner
  of the Java client, so Kafka Connect/Debezium and this publisher put an aggregate in the same partition.
  In ordered mode the dispatcher claims an aggregate's next event only after the previous one was finalized
  ``done``, which happens only after its delivery report said that the partition leader and its in-sync
  replicas (``acks=all``) wrote it; the next event, same key, same partition, is therefore appended after it.
  The idempotent producer (``enable.idempotence``: sequence numbers per partition) keeps the records of one
  batch in produce order through librdkafka's own retries and writes each produce once. Neither holds when
  the topic's partition count changes (keys move), and a retried message can appear twice (at least once):
  consumers de-duplicate by ``message_id``.
* **Waiting.** ``publish`` waits for its delivery report. ``publish_many`` (the dispatcher's batch path)
  produces the whole batch, then waits for all the reports together and returns one outcome per message.
  One deadline: each call returns within ``timeout`` seconds in total; a message with no report by then is
  :class:`~sa_outbox.RetryableError` (it may still be delivered), or :class:`~sa_outbox.DestinationUnavailable`
  when no broker is reachable. librdkafka's own ``message.timeout.ms`` defaults to the same ``timeout``, so a
  message left behind does not linger in the local queue.
* **Size.** Each record is measured as librdkafka measures it (key + value + headers + the record overhead)
  against the producer's ``message.max.bytes`` before producing: a larger one is
  :class:`~sa_outbox.PermanentError`, naming both sizes.

Failures (the full table is in docs/kafka.md):

* :class:`~sa_outbox.DestinationUnavailable` — no broker reachable: connection refused or lost on every
  broker (``_ALL_BROKERS_DOWN``, ``_TRANSPORT``), DNS failure (``_RESOLVE``), TLS or SASL failure
  (``_SSL``, ``_AUTHENTICATION``, ``SASL_AUTHENTICATION_FAILED``), ``CLUSTER_AUTHORIZATION_FAILED`` (no
  idempotent write to this cluster at all), and a message timed out or unreported at the deadline while no
  broker has answered since the last time all of them went down.
* :class:`~sa_outbox.PermanentError` — the message or its topic is refused: over ``message.max.bytes``
  (checked here) or the broker's/topic's limit (``MSG_SIZE_TOO_LARGE``, ``RECORD_LIST_TOO_LARGE``),
  ``TOPIC_AUTHORIZATION_FAILED``, an invalid topic name (checked here; ``TOPIC_EXCEPTION``),
  ``INVALID_RECORD``, ``POLICY_VIOLATION``.
* :class:`~sa_outbox.RetryableError` — anything else: a timeout while brokers answer, ``NOT_ENOUGH_REPLICAS``,
  leader changes, an unknown topic (topics are often created by their consumers' deployment, later), the
  local queue full, and a *fatal* idempotent-producer error (the producer is discarded; the next call uses a
  new one).

librdkafka's log lines go to the ``sa_outbox.publishers.kafka.librdkafka`` logger (connection failures at
INFO: they reach the dispatcher as the failure classes above). Safe to share between threads.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._durations import Duration, to_seconds
from .._messages import Message
from ..errors import ConfigurationError, DestinationUnavailable, NoAnswer, PermanentError, RetryableError
from ._common import envelope_json, headers_for, missing_extra

try:
    from confluent_kafka import KafkaError, KafkaException, Producer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    missing_extra("kafka", exc)

__all__ = ["KafkaPublisher", "KafkaRecord"]

LOG = logging.getLogger("sa_outbox.publishers.kafka")

# librdkafka's RD_KAFKAP_MESSAGE_V2_MAX_OVERHEAD: what a record adds to its key, value and headers when the
# producer checks it against message.max.bytes (pinned by a test at the exact boundary).
_RECORD_OVERHEAD = 36
_DEFAULT_MAX_MESSAGE_BYTES = 1_000_000  # librdkafka's default message.max.bytes
_LEGAL_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")

# Delivery error codes (KafkaError constants; negative ones are librdkafka's own, the rest the broker's).
_PERMANENT = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE,  # over the broker's message.max.bytes / the topic's max.message.bytes
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.TOPIC_EXCEPTION,  # invalid topic
    KafkaError.INVALID_RECORD,  # e.g. a compacted topic refusing a record (the key is always set here)
    KafkaError.POLICY_VIOLATION,
    KafkaError._INVALID_ARG,
})  # fmt: skip
_UNAVAILABLE = frozenset({
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._TRANSPORT,
    KafkaError._RESOLVE,
    KafkaError._SSL,
    KafkaError._AUTHENTICATION,
    KafkaError.SASL_AUTHENTICATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,  # idempotent writes need the IdempotentWrite cluster ACL
})  # fmt: skip
_NO_BROKER = frozenset(
    {KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE, KafkaError._SSL, KafkaError._AUTHENTICATION}
)
_NO_ANSWER = frozenset({KafkaError._MSG_TIMED_OUT, KafkaError._TIMED_OUT})
#: How long after a lost broker connection (with no answer from any broker since) an unreported message still
#: counts as an outage: long enough for librdkafka to conclude that every broker is down, short enough that a
#: single unreachable partition leader does not refund a message's attempts forever.
_DROP_GRACE = 30.0
_UNKNOWN_TOPIC = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC})

# Settings the publisher owns: its guarantees rest on them.
_OWNED = (
    "bootstrap.servers",
    "error_cb",
    "on_delivery",
    "on.delivery",
    "dr_cb",
    "dr_msg_cb",
    "transactional.id",
)
_PENDING: Any = object()
_FORKED_AWAY: list[Any] = []  # producers a forked child inherited from its parent


def _varint_size(n: int) -> int:
    """Bytes of a zigzag varint (how record headers encode their lengths)."""
    return max(1, math.ceil((n << 1).bit_length() / 7))


@dataclass(frozen=True, slots=True)
class KafkaRecord:
    """What :class:`KafkaPublisher` produces for one message."""

    message_id: str
    topic: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]

    @property
    def size(self) -> int:
        """The size librdkafka checks against ``message.max.bytes``."""
        headers = sum(
            _varint_size(len(k.encode())) + len(k.encode()) + _varint_size(len(v)) + len(v)
            for k, v in self.headers
        )
        return _RECORD_OVERHEAD + len(self.key) + len(self.value) + headers


class _Batch:
    """The outcomes of one call, settled by delivery callbacks served on any thread that polls."""

    def __init__(self, size: int) -> None:
        self.results: list[Any] = [_PENDING] * size
        self.left = size
        self.lock = threading.Lock()

    def settle(self, index: int, outcome: BaseException | None) -> None:
        with self.lock:
            if self.results[index] is _PENDING:
                self.results[index] = outcome
                self.left -= 1

    def settle_rest(self, outcome: Callable[[], BaseException]) -> None:
        with self.lock:
            for i, r in enumerate(self.results):
                if r is _PENDING:
                    self.results[i] = outcome()
            self.left = 0


class _LibrdkafkaLog:
    """librdkafka's log lines (forwarded while polling) on a logger of ours; connection failures (facility
    ``FAIL``, logged by librdkafka at ERROR on every reconnect) at INFO."""

    logger = logging.getLogger("sa_outbox.publishers.kafka.librdkafka")

    def log(self, level: int, fmt: str, *args: Any) -> None:
        if args and args[0] == "FAIL":
            level = min(level, logging.INFO)
        self.logger.log(level, fmt, *args)


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes", "on")


class KafkaPublisher:
    """``KafkaPublisher("kafka-1:9092,kafka-2:9092")``.

    ``topic`` is a string or a callable of the message (default ``topic_prefix + aggregate_type``: one topic
    per aggregate type keeps each aggregate in one partition, whatever its event types). ``timeout``
    (seconds) bounds each ``publish`` / ``publish_many`` call as a whole and is the default
    ``message.timeout.ms``. ``config`` adds librdkafka settings (``security.protocol``, ``sasl.*``,
    ``compression.type``, ``linger.ms``, ``message.max.bytes``, …); settings that would weaken the delivery
    guarantee (``enable.idempotence=false``, ``acks`` other than ``all``, ``transactional.id``) or that the
    publisher owns (``bootstrap.servers``, the callbacks) are refused. ``close()`` flushes and frees the
    producer; a later publish makes a new one.
    """

    def __init__(
        self,
        bootstrap_servers: str | Sequence[str],
        *,
        topic: str | Callable[[Message], str] | None = None,
        topic_prefix: str = "outbox.event.",
        timeout: Duration = 5.0,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        servers = bootstrap_servers if isinstance(bootstrap_servers, str) else ",".join(bootstrap_servers)
        if not servers.strip():
            raise ConfigurationError("bootstrap_servers is empty: give host:port[,host:port…]")
        if isinstance(topic, str):
            self._legal_topic(topic, ConfigurationError)
        self.bootstrap_servers = servers
        self.topic = topic
        self.topic_prefix = topic_prefix
        self.timeout = to_seconds(timeout, name="timeout", allow_zero=False)
        self.config = self._settings(dict(config or {}))
        self.max_message_bytes = int(self.config.get("message.max.bytes", _DEFAULT_MAX_MESSAGE_BYTES))
        self._lock = threading.Lock()  # guards making and dropping the producer
        self._pid = os.getpid()
        self._producer: Any = None  # confluent_kafka.Producer; Any: the extra admits releases without stubs
        self._up = False  # a broker answered since the last time all of them were down
        self._last_error = ""  # the latest connection-level error, for the failure's text
        # When a broker connection was lost (_TRANSPORT) with no broker answering since: librdkafka reports
        # that before it concludes _ALL_BROKERS_DOWN (which, on a loaded machine, can come after the deadline).
        # It counts as an outage only for _DROP_GRACE: one broker that stays unreachable while the others are
        # up (a partition whose leader is gone) must spend attempts, not be refunded forever.
        self._dropped_at: float | None = None
        self._current()  # a bad setting fails here, as a ConfigurationError

    def _settings(self, user: dict[str, Any]) -> dict[str, Any]:
        owned = [k for k in _OWNED if k in user]
        if owned:
            raise ConfigurationError(
                f"KafkaPublisher config may not set {', '.join(owned)}: the publisher owns them "
                "(bootstrap servers are its first argument; transactions are not used)"
            )
        if "enable.idempotence" in user and not _truthy(user["enable.idempotence"]):
            raise ConfigurationError(
                "KafkaPublisher needs enable.idempotence=true: without it librdkafka's retries can reorder "
                "and duplicate records within a partition"
            )
        for key in ("acks", "request.required.acks"):
            if key in user and str(user[key]).strip().lower() not in ("all", "-1"):
                raise ConfigurationError(
                    f"KafkaPublisher needs {key}=all: a message is finalized 'done' only when every in-sync "
                    f"replica has it, got {user[key]!r}"
                )
        settings: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap_servers,
            "enable.idempotence": True,
            "acks": "all",
            "partitioner": "murmur2_random",  # the Java client's: same key, same partition
            # The claimed batch is the unit of batching: publish_many produces it back to back, then waits.
            # Lingering would only hold its tail back (measured: 1,000 rows through the dispatcher in 0.25 s
            # with librdkafka's default of 5 ms, 0.16 s with 0; one by one 5.4 s against 0.12 s).
            "linger.ms": 0,
            "logger": _LibrdkafkaLog(),
        }
        if "delivery.timeout.ms" not in user:
            settings["message.timeout.ms"] = max(1, math.ceil(self.timeout * 1000))
        # A topic the cluster does not have is reported (UNKNOWN_TOPIC_OR_PART: retryable, and proof that a
        # broker answered) within the call, not after librdkafka's default 30 s, when every message of the
        # call would already have been reported as unanswered (an outage).
        settings["topic.metadata.propagation.max.ms"] = max(1, math.ceil(self.timeout * 500))
        settings.update(user)
        settings["error_cb"] = self._on_error
        return settings

    # --- the producer ------------------------------------------------------------------------------------

    def _current(self) -> Any:
        """The producer, made on first use, after :meth:`close`, a fatal error, or in a forked child."""
        with self._lock:
            if self._pid != os.getpid():  # librdkafka's threads did not survive the fork: a new producer
                # Never freed here: destroying it would wait for the parent's threads, which this process
                # does not have.
                _FORKED_AWAY.append(self._producer)
                self._pid, self._producer = os.getpid(), None
            if self._producer is None:
                try:
                    self._producer = Producer(self.config)
                except (KafkaException, ValueError, TypeError) as exc:
                    raise ConfigurationError(f"KafkaPublisher config refused by librdkafka: {exc}") from exc
            return self._producer

    def _discard(self, producer: Any) -> None:
        """Stop using ``producer`` (after a fatal error); its queued messages are dropped."""
        with self._lock:
            if self._producer is producer:
                self._producer = None
        try:
            producer.purge()
            producer.poll(0)
        except (KafkaException, RuntimeError):
            pass

    def _on_error(self, err: Any) -> None:
        """librdkafka's client-level errors (served while polling): they tell whether any broker is reachable."""
        code = err.code()
        if code in _UNAVAILABLE:
            self._last_error = f"{err.name()}: {err.str()}"
        if code in _NO_BROKER:
            self._up = False
        if code == KafkaError._TRANSPORT and self._dropped_at is None:
            self._dropped_at = time.monotonic()

    # --- the record ---------------------------------------------------------------------------------------

    def _topic(self, message: Message) -> str:
        if self.topic is None:
            return f"{self.topic_prefix}{message.aggregate_type}"
        return self.topic(message) if callable(self.topic) else self.topic

    @staticmethod
    def _legal_topic(topic: str, error: type[Exception]) -> None:
        if not _LEGAL_TOPIC.fullmatch(topic) or topic in (".", ".."):
            raise error(f"{topic!r} is not a valid Kafka topic name (1 to 249 of a-z A-Z 0-9 . _ -)")

    def record(self, message: Message) -> KafkaRecord:
        """The record this publisher produces for ``message`` (see the module docs)."""
        topic = self._topic(message)
        self._legal_topic(topic, PermanentError)
        own = {"message_id": message.message_id, **headers_for(message)}
        extra = getattr(message, "headers", None) or {}  # Message.headers, where this Message has it
        headers = [(k, v.encode()) for k, v in own.items()]
        headers += [(str(k), str(v).encode()) for k, v in extra.items() if k not in own]
        return KafkaRecord(
            message.message_id, topic, message.aggregate_id.encode(), envelope_json(message), headers
        )

    def check_size(self, record: KafkaRecord) -> int:
        """``record.size``; :class:`~sa_outbox.PermanentError` when over the producer's ``message.max.bytes``."""
        size = record.size
        if size > self.max_message_bytes:
            payload = len(json.dumps(json.loads(record.value)["payload"], separators=(",", ":")).encode())
            raise PermanentError(
                f"message {record.message_id} is {size:,} bytes as produced to Kafka (key, JSON envelope and "
                f"headers; the payload alone is {payload:,}), over the producer's message.max.bytes of "
                f"{self.max_message_bytes:,} bytes: raise message.max.bytes in config= (and the broker's "
                "message.max.bytes / the topic's max.message.bytes) or lower sa_outbox_max_payload_bytes on "
                "the model"
            )
        return size

    # --- publishing ---------------------------------------------------------------------------------------

    def publish(self, message: Message) -> None:
        """Produce one message and wait for its delivery report; raises its failure class."""
        error = self.publish_many([message])[0]
        if error is not None:
            raise error

    def publish_many(self, messages: Sequence[Message]) -> list[BaseException | None]:
        """Produce a batch, then wait for all its delivery reports together (within ``timeout`` in total).

        One entry per message, in order: ``None`` when Kafka acknowledged it, else its failure class.
        """
        deadline = time.monotonic() + self.timeout
        batch = _Batch(len(messages))
        if not messages:
            return []
        producer = self._current()
        for i, m in enumerate(messages):
            try:
                record = self.record(m)
                self.check_size(record)
            except Exception as exc:  # this message's own failure (a bad topic callable, too large)
                batch.settle(i, exc)
                continue
            if not self._produce(producer, batch, i, record, deadline):
                break
        while batch.left and (remaining := deadline - time.monotonic()) > 0:
            if not self._serve(producer, batch, min(remaining, 0.1)):
                break
        batch.settle_rest(self._unreported)
        return list(batch.results)

    def _produce(
        self, producer: Any, batch: _Batch, index: int, record: KafkaRecord, deadline: float
    ) -> bool:
        """Hand one record to librdkafka; False when the producer is gone (the batch is settled)."""
        on_delivery = functools.partial(self._delivered, batch, index, record.topic)
        while True:
            try:
                producer.produce(
                    record.topic, value=record.value, key=record.key, headers=record.headers,
                    on_delivery=on_delivery,
                )  # fmt: skip
                return True
            except BufferError:  # the local queue is full: serve reports to make room, until the deadline
                if time.monotonic() >= deadline:
                    batch.settle(index, NoAnswer(  # (the brokers did not take what was queued before it)
                        "librdkafka's local queue stayed full until the deadline (queue.buffering.max.*)"
                    ))  # fmt: skip
                    return True
                if not self._serve(producer, batch, 0.05):
                    return False
            except KafkaException as exc:
                error = exc.args[0]
                if error.fatal() or error.code() == KafkaError._FATAL:
                    self._fatal(producer, batch, error)
                    return False
                batch.settle(index, self._failure(error, record.topic))
                return True

    def _serve(self, producer: Any, batch: _Batch, seconds: float) -> bool:
        """Serve delivery reports and errors for up to ``seconds``; False when the producer is gone."""
        try:
            producer.poll(seconds)
        except KafkaException as exc:  # a fatal error: this producer cannot produce any more
            self._fatal(producer, batch, exc.args[0])
            return False
        if producer is not self._producer:  # another call met a fatal error, or close() ran
            batch.settle_rest(lambda: NoAnswer("the kafka producer was replaced before the report came"))
            return False
        return True

    def _fatal(self, producer: Any, batch: _Batch, error: Any) -> None:
        self._discard(producer)
        cls = DestinationUnavailable if error.code() in _UNAVAILABLE else RetryableError
        text = f"{error.name()}: {error.str()}"
        LOG.warning("kafka producer hit a fatal error; the next publish uses a new producer: %s", text,
                    extra={"bootstrap_servers": self.bootstrap_servers})  # fmt: skip
        batch.settle_rest(
            lambda: cls(f"the kafka producer hit a fatal error ({text}); the next publish uses a new one")
        )

    def _delivered(self, batch: _Batch, index: int, topic: str, err: Any, _msg: Any) -> None:
        if err is None:
            self._up, self._dropped_at = True, None
            batch.settle(index, None)
            return
        if err.code() >= 0 or err.code() in _UNKNOWN_TOPIC:  # a broker answered (metadata, for a topic)
            self._up, self._dropped_at = True, None
        batch.settle(index, self._failure(err, topic))

    def _failure(self, err: Any, topic: str) -> BaseException:
        """The failure class of a delivery error (see the module docs)."""
        code, text = err.code(), f"{err.name()}: {err.str()}"
        if code in _PERMANENT:
            return PermanentError(f"kafka refused the message for topic {topic!r}: {text}")
        if code in _UNAVAILABLE:
            return DestinationUnavailable(f"kafka at {self.bootstrap_servers} is unavailable: {text}")
        if code in _NO_ANSWER:
            return self._unreported()
        if code in _UNKNOWN_TOPIC:
            return RetryableError(
                f"topic {topic!r} does not exist (yet), and the cluster does not create topics on use: {text}"
            )
        return RetryableError(f"kafka did not take the message for topic {topic!r}: {text}")

    def _unreported(self) -> BaseException:
        """A message with no delivery report by the deadline (or timed out inside librdkafka)."""
        dropped = self._dropped_at is not None and time.monotonic() - self._dropped_at < _DROP_GRACE
        if not self._up or dropped:
            last = f" (last error: {self._last_error})" if self._last_error else ""
            return DestinationUnavailable(
                f"no Kafka broker reachable at {self.bootstrap_servers} within {self.timeout:g}s{last}"
            )
        return NoAnswer(
            f"no delivery report from kafka within {self.timeout:g}s (the message may still be written: "
            "consumers de-duplicate by message_id)"
        )

    def close(self) -> None:
        """Flush what is still queued (at most ``timeout``), drop the rest and free the producer."""
        with self._lock:
            producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            if producer.flush(self.timeout):
                producer.purge()
                producer.poll(0)
        except (KafkaException, RuntimeError):
            pass
        close = getattr(producer, "close", None)  # confluent-kafka >= 2.12; before, freed with the object
        if close is not None:
            close()
