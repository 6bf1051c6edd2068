"""Values that cross the boundary between the engine and user code: frozen, cheap to build."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

__all__ = ["BatchPublisher", "ClaimedJob", "Message", "Publisher"]


@dataclass(frozen=True, slots=True)
class Message:
    """One claimed outbox event, as handed to a :class:`Publisher`.

    ``message_id`` is ``str(id)``: stable across retries and re-claims, the downstream de-duplication key.
    ``lease_version`` is the fencing token of this claim (downstream may use it to reject stale deliveries).
    ``attempts`` counts this attempt (1 on the first delivery).
    """

    id: int
    message_id: str
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: Any
    attempts: int
    lease_version: int
    created_at: datetime

    @classmethod
    def from_row(cls, row: Any) -> Message:
        """From a claim row: (id, lease_version, attempts, aggregate_type, aggregate_id, event_type, payload,
        created_at) — the order of ``_sql.claim_returning``."""
        id_, version, attempts, atype, aid, etype, payload, created = row
        return cls(id_, str(id_), atype, aid, etype, payload, attempts, version, created)


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """One claimed job, as handed to its handler."""

    id: int
    task: str
    queue: str
    payload: Any
    attempts: int
    max_attempts: int
    lease_version: int
    priority: int
    created_at: datetime

    @classmethod
    def from_row(cls, row: Any) -> ClaimedJob:
        """From a claim row: (id, lease_version, attempts, max_attempts, task, queue, payload, priority,
        created_at) — the order of ``_sql.claim_returning``."""
        id_, version, attempts, max_attempts, task, queue, payload, priority, created = row
        return cls(id_, task, queue, payload, attempts, max_attempts, version, priority, created)


@runtime_checkable
class Publisher(Protocol):
    """Delivers one message to the outside world, or raises.

    Raise :class:`~sa_outbox.RetryableError` for transient failures, :class:`~sa_outbox.PermanentError` for
    ones retrying will not fix, :class:`~sa_outbox.Defer` to postpone without using an attempt. Any other
    exception is logged with its traceback and treated as retryable. Returning normally means delivered.
    A publisher must bound its own I/O with a timeout shorter than the dispatcher's ``publish_timeout``.
    """

    def publish(self, message: Message) -> None: ...


@runtime_checkable
class BatchPublisher(Publisher, Protocol):
    """A publisher that can deliver a batch with fewer round trips (e.g. confirms awaited once per batch).

    Returns one entry per message, in order: ``None`` for delivered, or the exception for that message
    (classified like a raised one). Raising from ``publish_many`` itself applies to every message.
    """

    def publish_many(self, messages: Sequence[Message]) -> Sequence[BaseException | None]: ...
