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
from a fenced-off dispatcher can arrive after a newer event.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    Engine,
    Index,
    PrimaryKeyConstraint,
    Text,
    delete,
    func,
    select,
    text,
    tuple_,
)
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Mapped, Session, declared_attr, mapped_column
from sqlalchemy.sql.elements import conv

from ._durations import Duration, to_timedelta
from .errors import PayloadError

__all__ = [
    "InboxMixin",
    "Receipt",
    "message_id_from_amqp",
    "message_id_from_http",
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
) -> Receipt:
    """Record ``message_id`` for ``consumer`` in the caller's transaction; ``Receipt.NEW`` means apply it.

    Call it before the handler's business writes, in the same transaction (``session.begin()``). On
    ``DUPLICATE``/``STALE`` skip the handler (and commit: nothing was written). An exception in the handler
    rolls back the record with the effects, so the redelivery is applied.
    """
    if not consumer or not str(message_id):
        raise PayloadError("inbox: consumer and message_id must be non-empty")
    if (aggregate is None) != (position is None):
        raise PayloadError("inbox: give aggregate and position together (or neither)")
    t = model.__table__
    if aggregate is not None:
        # Serialise this consumer's messages of one aggregate, then compare with the newest applied position.
        session.execute(
            select(func.pg_advisory_xact_lock(func.hashtextextended(consumer + ":" + aggregate, 7)))
        )
        newest = session.execute(
            select(func.max(t.c.position)).where(t.c.consumer == consumer, t.c.aggregate == aggregate)
        ).scalar()
        if newest is not None and position is not None and position <= newest:
            already = session.execute(
                select(t.c.message_id).where(t.c.consumer == consumer, t.c.message_id == str(message_id))
            ).first()
            return Receipt.DUPLICATE if already else Receipt.STALE
    stmt = (
        insert(t)
        .values(
            consumer=consumer,
            message_id=str(message_id),
            event_type=event_type,
            source=source,
            aggregate=aggregate,
            position=position,
        )
        .on_conflict_do_nothing(index_elements=["consumer", "message_id"])
        .returning(t.c.message_id)
    )
    inserted = session.execute(stmt).first()
    return Receipt.NEW if inserted is not None else Receipt.DUPLICATE


def purge_inbox(engine: Engine, model: type[Any], *, older_than: Duration, batch_size: int = 10_000) -> int:
    """Delete inbox rows received more than ``older_than`` ago, in batches. Keep the window longer than the
    longest redelivery your broker can make (its retention / redelivery window), or a very late duplicate
    would be applied again."""
    t = model.__table__
    age = to_timedelta(older_than, name="older_than")
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
    """Redis Streams: the ``message_id`` field of the entry."""
    value = fields.get("message_id") or fields.get(b"message_id")
    if not value:
        raise PayloadError("stream entry has no message_id field")
    return value.decode() if isinstance(value, bytes) else str(value)


def message_id_from_http(headers: Mapping[str, str]) -> str:
    """HTTP webhook: the ``Idempotency-Key`` header (case-insensitive)."""
    for key, value in headers.items():
        if key.lower() == "idempotency-key" and value:
            return value
    raise PayloadError("request has no Idempotency-Key header")
