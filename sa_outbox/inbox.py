"""The transactional inbox: consumers apply each message exactly once.

Leases and fencing protect the outbox's database state, not the outside world: a message can be delivered
twice (a lost lease, a publish whose finalize failed). The inbox closes the loop on the consumer's side: in
the *same transaction* as the consumer's business writes, :func:`receive` records ``(consumer, message_id)``
with ``INSERT … ON CONFLICT DO NOTHING`` and says whether the message is new. The record and the effects
commit or roll back together, so at-least-once delivery becomes exactly-once effects.

Concurrent deliveries of one id: the second ``INSERT`` waits on the first transaction's uncommitted index
entry; when the first commits, the second sees the conflict and reports a duplicate; when it rolls back, the
second proceeds and applies the effect. One row, one lock: no deadlock.

Ordered aggregates: pass ``aggregate=`` and ``position=`` (e.g. the outbox id, or a version) and a message
older than one already applied for that aggregate is reported ``STALE`` instead of applied — a late publish
from a fenced-off dispatcher can arrive after a newer event. The newest applied position of each
(consumer, aggregate) is kept in one *head* row of the inbox table (``message_id`` ``sa_outbox:head:<aggregate>``,
``source`` ``sa_outbox.head``), written with ``INSERT … ON CONFLICT DO UPDATE``: receipts of one aggregate
serialise on that row, and a receipt whose snapshot is older than the head's last change cannot read a stale
position at any isolation level — at READ COMMITTED it waits and sees the newest head; at REPEATABLE READ and
SERIALIZABLE PostgreSQL raises a serialization failure (SQLSTATE 40001), which the consumer retries like any
other at those levels (a redelivery does it), and the retry reports ``STALE``.

Trace context: pass the broker message's headers (``headers=``, see the ``headers_from_*`` helpers) and the
receipt joins the producer's trace — on the consumer's own span when it already continues that trace
(:func:`consume_span`), else on a short ``receive <consumer>`` span, child of the producer's context.

Every identifier must fit the inbox's btree index entries (2,704 bytes: ``consumer`` and ``message_id``
together, ``consumer`` and ``aggregate`` together); longer ones are a :class:`~sa_outbox.errors.PayloadError`
naming the limit, before any SQL.
"""

from __future__ import annotations

import email.header
import enum
import functools
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    Engine,
    Index,
    PrimaryKeyConstraint,
    Table,
    Text,
    bindparam,
    delete,
    func,
    select,
    text,
    tuple_,
)
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Mapped, Session, declared_attr, mapped_column
from sqlalchemy.sql.elements import conv

from . import _tracing
from ._durations import Duration, to_timedelta
from ._names import RESERVED_ID_PREFIX
from ._payload import check_index_entries, check_int, require_text
from ._sql import BIGINT_RANGE
from .errors import ConfigurationError, PayloadError

__all__ = [
    "InboxMixin",
    "Receipt",
    "consume_span",
    "headers_from_amqp",
    "headers_from_http",
    "headers_from_mqtt",
    "headers_from_nats",
    "headers_from_redis",
    "message_id_from_amqp",
    "message_id_from_http",
    "message_id_from_kafka",
    "message_id_from_mqtt",
    "message_id_from_nats",
    "message_id_from_redis",
    "purge_inbox",
    "receive",
]


class InboxMixin:
    """Columns of an inbox table: ``class Inbox(InboxMixin, Base): __tablename__ = "inbox"``."""

    consumer: Mapped[str] = mapped_column(Text, nullable=False)
    message_id: Mapped[str] = mapped_column(Text, nullable=False)
    source: Mapped[str | None] = mapped_column(Text)
    event_type: Mapped[str | None] = mapped_column(Text)
    #: Ordering help: the aggregate the message belongs to and its position (outbox id or version).
    aggregate: Mapped[str | None] = mapped_column(Text)
    position: Mapped[int | None] = mapped_column(BigInteger)
    received_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=text("now()")
    )

    @declared_attr.directive
    @classmethod
    def __table_args__(cls) -> tuple[Any, ...]:
        t: str = cls.__tablename__  # type: ignore[attr-defined]
        return (
            PrimaryKeyConstraint("consumer", "message_id", name=conv(f"pk_{t}")),
            Index(conv(f"ix_{t}_received"), "received_at"),
            Index(
                conv(f"ix_{t}_position"),
                "consumer",
                "aggregate",
                "position",
                postgresql_where=text("aggregate IS NOT NULL"),
            ),
        )


class Receipt(enum.Enum):
    """What :func:`receive` found. Only ``NEW`` is truthy: ``if receive(...): apply(...)``."""

    NEW = "new"
    DUPLICATE = "duplicate"
    STALE = "stale"

    def __bool__(self) -> bool:
        return self is Receipt.NEW


#: The message_id prefix of the rows that hold each (consumer, aggregate)'s newest applied position.
HEAD_PREFIX = RESERVED_ID_PREFIX + "head:"
_HEAD_SOURCE = "sa_outbox.head"


@dataclass(frozen=True)
class _Statements:
    head: Any
    record: Any
    recorded: Any


@functools.cache
def _statements(t: Table) -> _Statements:
    """The inbox statements of one table, built once (values only as bound parameters)."""
    consumer, aggregate = bindparam("consumer", type_=Text), bindparam("aggregate", type_=Text)
    # The head row of (consumer, aggregate): its position moves forward only. ON CONFLICT DO UPDATE waits for
    # a concurrent receipt of the aggregate and judges the newest committed head (READ COMMITTED), or fails
    # with a serialization error when that head changed after this transaction's snapshot (REPEATABLE READ,
    # SERIALIZABLE): an older position is never compared with a stale head. RETURNING gives the position it
    # holds when this message moved it (or created it), nothing when the message is not newer. A head created
    # where older rows of the aggregate exist (recorded before heads existed) starts from their newest.
    newest_recorded = (
        select(func.max(t.c.position))
        .where(t.c.consumer == consumer, t.c.aggregate == aggregate)
        .scalar_subquery()
    )
    position = bindparam("position", type_=BigInteger)
    new_head = insert(t).values(
        consumer=consumer,
        message_id=bindparam("head_id", type_=Text),
        source=_HEAD_SOURCE,
        aggregate=aggregate,
        position=func.greatest(position, newest_recorded),
    )
    head = new_head.on_conflict_do_update(
        index_elements=[t.c.consumer, t.c.message_id],
        set_={"position": new_head.excluded.position, "received_at": func.now()},
        where=t.c.position < new_head.excluded.position,
    ).returning(t.c.position)
    # The message's own record: a concurrent delivery of the same id waits on this index entry.
    record = (
        insert(t)
        .values(
            consumer=consumer,
            message_id=bindparam("message_id", type_=Text),
            event_type=bindparam("event_type", type_=Text),
            source=bindparam("source", type_=Text),
            aggregate=aggregate,
            position=position,
        )
        .on_conflict_do_nothing(index_elements=[t.c.consumer, t.c.message_id])
        .returning(t.c.message_id)
    )
    recorded = select(t.c.message_id).where(
        t.c.consumer == consumer, t.c.message_id == bindparam("message_id", type_=Text)
    )
    return _Statements(head, record, recorded)


def receive(
    session: Session,
    model: type[Any],
    consumer: str,
    message_id: str | int,
    *,
    event_type: str | None = None,
    source: str | None = None,
    aggregate: str | None = None,
    position: int | None = None,
    headers: Mapping[Any, Any] | None = None,
) -> Receipt:
    """Record ``message_id`` for ``consumer`` in the caller's transaction; ``Receipt.NEW`` means apply it.

    Call it before the handler's business writes, in the same transaction (``session.begin()``). On
    ``DUPLICATE``/``STALE`` skip the handler (and commit: nothing was written). An exception in the handler
    rolls back the record with the effects, so the redelivery is applied.

    With ``aggregate=`` and ``position=``, a position not newer than the newest applied for that aggregate is
    ``STALE`` (``DUPLICATE`` if this very message was recorded, whatever its position: a duplicate never moves
    the head). The receipt then runs in a savepoint of its own (the session flushes pending objects first, as
    ``Session.begin_nested`` does). Both hold at every isolation level: at REPEATABLE READ and
    SERIALIZABLE a concurrent receipt of the aggregate can end in a serialization failure (SQLSTATE 40001);
    retry the transaction, as PostgreSQL requires at those levels. Bad input (empty ids, a position outside
    ``bigint``, ids too long for the inbox's index entries) is a :class:`PayloadError` before any SQL.

    ``headers``: the broker message's headers (str or bytes names and values). When they carry a trace
    context and ``opentelemetry-api`` is installed, the receipt (``sa_outbox.inbox.receipt``) is recorded in
    the producer's trace (see the module docs); nothing is stored.
    """
    what = f"inbox: message {message_id!r:.80} for consumer {consumer!r:.80}"
    consumer = require_text(consumer, what, "consumer")
    message_id = require_text(message_id, what, "message_id")
    if message_id.startswith(HEAD_PREFIX):
        raise PayloadError(
            f"{what}: message ids starting with {HEAD_PREFIX!r} are reserved for the inbox's own rows"
        )
    if (aggregate is None) != (position is None):
        raise PayloadError(f"{what}: give aggregate and position together (or neither)")
    if aggregate is not None:
        aggregate = require_text(aggregate, what, "aggregate")
        check_int(position, what=what, name="position", low=BIGINT_RANGE[0], high=BIGINT_RANGE[1])
    if headers is not None and not isinstance(headers, Mapping):
        raise PayloadError(f"{what}: headers must be a mapping, got {type(headers).__name__}")
    t = model.__table__
    values: dict[str, Any] = {"consumer": consumer, "message_id": message_id, "aggregate": aggregate,
                              "position": position}  # fmt: skip
    check_index_entries(t, values, what=what)
    if aggregate is not None:  # the head row's message id holds the aggregate
        check_index_entries(t, {**values, "message_id": HEAD_PREFIX + aggregate}, what=what)
    if headers and _tracing.ENABLED:
        with _tracing.receive_span(headers, consumer, message_id) as span:
            receipt = _record(session, t, values, event_type, source)
            span.set("sa_outbox.inbox.receipt", receipt.value)
            return receipt
    return _record(session, t, values, event_type, source)


def _record(
    session: Session, t: Table, values: dict[str, Any], event_type: str | None, source: str | None
) -> Receipt:
    """The receipt's statements (see :func:`receive`); ``values`` are checked."""
    aggregate, position = values["aggregate"], values["position"]
    stmts = _statements(t)
    params = {**values, "event_type": event_type, "source": source}
    if aggregate is None:
        inserted = session.execute(stmts.record, params).first()
        return Receipt.NEW if inserted is not None else Receipt.DUPLICATE
    params["head_id"] = HEAD_PREFIX + aggregate
    # In a savepoint: the head first (receipts of one aggregate queue on its row before they touch any record,
    # so a transaction that receives several of the aggregate's messages cannot deadlock with another that
    # receives one of them — with the record first it did, 5 of 5 rounds in a review), then the record. A
    # record that is already there makes the receipt a duplicate whatever its position says, and the head's
    # move is rolled back with the savepoint: a replay at a later offset moved it, before, and the next message
    # in between was then turned down as stale without ever being applied.
    nested = session.begin_nested()
    try:
        moved = session.execute(stmts.head, params).first()
        if moved is None or moved[0] != position:  # not newer than the newest applied position
            already = session.execute(stmts.recorded, params).first()
            nested.commit()
            return Receipt.DUPLICATE if already else Receipt.STALE
        if session.execute(stmts.record, params).first() is None:
            nested.rollback()
            return Receipt.DUPLICATE
        nested.commit()
        return Receipt.NEW
    except BaseException:
        if nested.is_active:
            nested.rollback()
        raise


def purge_inbox(engine: Engine, model: type[Any], *, older_than: Duration, batch_size: int = 10_000) -> int:
    """Delete inbox rows received more than ``older_than`` ago, in batches of ``batch_size`` (one short
    transaction each); returns how many. Keep the window longer than the longest redelivery your broker can
    make (its retention / redelivery window), or a very late duplicate would be applied again. Bad options
    are a :class:`ConfigurationError` before any SQL."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigurationError(f"purge_inbox: batch_size must be an integer >= 1, got {batch_size!r}")
    age = to_timedelta(older_than, name="older_than")
    t = model.__table__
    total = 0
    while True:
        victims = (
            select(t.c.consumer, t.c.message_id)
            .where(t.c.received_at < func.now() - age)
            .limit(batch_size)
            .with_for_update(skip_locked=True)
        )
        stmt = delete(t).where(tuple_(t.c.consumer, t.c.message_id).in_(victims))
        with engine.begin() as conn:
            deleted = conn.execute(stmt).rowcount
        total += deleted
        if deleted < batch_size:
            return total


# --- where our publishers put the message id --------------------------------------------------------------


def message_id_from_amqp(properties: Any) -> str:
    """RabbitMQ (pika ``BasicProperties`` / aio-pika message): the ``message_id`` property."""
    value = getattr(properties, "message_id", None)
    if not value:
        raise PayloadError("AMQP message has no message_id property")
    return str(value)


def message_id_from_nats(msg: Any) -> str:
    """NATS JetStream: the ``Nats-Msg-Id`` header."""
    headers = getattr(msg, "headers", None) or {}
    value = headers.get("Nats-Msg-Id")
    if not value:
        raise PayloadError("NATS message has no Nats-Msg-Id header")
    return str(value)


def message_id_from_redis(fields: Mapping[Any, Any]) -> str:
    """Redis Streams: the ``message_id`` field of the entry (``ce_id`` of a CloudEvent)."""
    value = (
        fields.get("message_id") or fields.get(b"message_id") or fields.get("ce_id") or fields.get(b"ce_id")
    )
    if not value:
        raise PayloadError("stream entry has no message_id (or ce_id) field")
    return value.decode() if isinstance(value, bytes) else str(value)


def message_id_from_http(headers: Mapping[str, str]) -> str:
    """HTTP webhook: the ``Idempotency-Key`` header (case-insensitive)."""
    for key, value in headers.items():
        if key.lower() == "idempotency-key" and value:
            return value
    raise PayloadError("request has no Idempotency-Key header")


def message_id_from_kafka(msg: Any) -> str:
    """Kafka (a confluent-kafka ``Message``): the ``message_id`` header."""
    for key, value in getattr(msg, "headers", lambda: None)() or []:
        if key == "message_id" and value:
            return value.decode() if isinstance(value, bytes) else str(value)
    raise PayloadError("Kafka record has no message_id header")


def message_id_from_mqtt(msg: Any) -> str:
    """MQTT (a paho message): ``message_id`` of the JSON envelope, ``id`` of a structured CloudEvent, or the
    ``id`` user property of a binary one (MQTT v5)."""
    props = dict(getattr(getattr(msg, "properties", None), "UserProperty", None) or [])
    if props.get("id") and props.get("specversion"):
        return str(props["id"])
    try:
        body = json.loads(msg.payload)
    except (TypeError, ValueError):
        body = None
    if isinstance(body, dict):
        value = body.get("message_id") or (body.get("id") if "specversion" in body else None)
        if value:
            return str(value)
    raise PayloadError("MQTT message has no message_id (envelope) or id (CloudEvent)")


# --- where our publishers put the headers -----------------------------------------------------------------
# Each returns the broker message's header slot as a plain dict of strings (bytes decoded as UTF-8): the
# event's headers among the publisher's own (``traceparent`` included), ready for ``receive(headers=…)`` and
# :func:`consume_span`.


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes | bytearray) else str(value)


def headers_from_amqp(properties: Any) -> dict[str, str]:
    """RabbitMQ (pika ``BasicProperties`` / aio-pika message): the AMQP headers."""
    return {_text(k): _text(v) for k, v in (getattr(properties, "headers", None) or {}).items()}


def _nats_value(value: Any) -> str:
    """A NATS header value as text. ``js.get_msg`` (nats-py parses those headers with ``email``) hands out a
    non-ASCII value as an ``email.header.Header``: its bytes are the UTF-8 the publisher sent."""
    if isinstance(value, email.header.Header):
        raw = b"".join(
            p if isinstance(p, bytes) else p.encode() for p, _ in email.header.decode_header(value)
        )
        return raw.decode("utf-8", "replace")
    return _text(value)


def headers_from_nats(msg: Any) -> dict[str, str]:
    """NATS: the message's headers (UTF-8 values, whichever nats-py path delivered them)."""
    return {_text(k): _nats_value(v) for k, v in (getattr(msg, "headers", None) or {}).items()}


def headers_from_redis(fields: Mapping[Any, Any]) -> dict[str, str]:
    """Redis Streams: the entry's ``header:<name>`` fields, by name."""
    prefix = "header:"
    out: dict[str, str] = {}
    for key, value in fields.items():
        name = _text(key)
        if name.startswith(prefix):
            out[name[len(prefix) :]] = _text(value)
    return out


def headers_from_http(headers: Mapping[Any, Any]) -> dict[str, str]:
    """HTTP webhook: the request's headers (names as received; trace extraction ignores their case)."""
    return {_text(k): _text(v) for k, v in headers.items()}


def headers_from_mqtt(msg: Any) -> dict[str, str]:
    """MQTT (a paho message): the user properties (MQTT v5), else the ``headers`` object of the JSON envelope
    (MQTT 3.1.1), else a structured CloudEvent's ``traceparent``/``tracestate`` extension attributes."""
    props = getattr(getattr(msg, "properties", None), "UserProperty", None)
    if props:
        return {_text(k): _text(v) for k, v in props}
    try:
        body = json.loads(msg.payload)
    except (TypeError, ValueError):
        return {}
    if not isinstance(body, dict):
        return {}
    if isinstance(body.get("headers"), dict):
        return {_text(k): _text(v) for k, v in body["headers"].items()}
    return {k: str(body[k]) for k in _tracing.TRACE_HEADERS if k in body}


@contextmanager
def consume_span(
    headers: Mapping[Any, Any] | None,
    *,
    consumer: str,
    message_id: str | int | None = None,
    destination: str | None = None,
) -> Iterator[None]:
    """The consumer's own span, continuing the producer's trace carried by ``headers``: a ``CONSUMER`` span
    ``process <destination or consumer>`` whose parent is the extracted context (the current one when the
    headers carry none), current inside the block — the handler's spans and :func:`receive`'s receipt land in
    it. A no-op without ``opentelemetry-api``.

    ::

        with consume_span(headers_from_amqp(props), consumer="billing", message_id=props.message_id):
            with Session(engine) as s, s.begin():
                if receive(s, Inbox, "billing", props.message_id, headers=headers_from_amqp(props)):
                    apply(...)
    """
    attributes: dict[str, Any] = {
        "messaging.operation": "process",
        "messaging.operation.name": "process",
        "messaging.consumer.group.name": consumer,
    }
    if message_id is not None:
        attributes["messaging.message.id"] = str(message_id)
    if destination is not None:
        attributes["messaging.destination.name"] = destination
    with _tracing.consumer_span(headers, f"process {destination or consumer}", attributes):
        yield
