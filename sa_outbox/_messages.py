"""Values that cross the boundary between the engine and user code: frozen, cheap to build."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

__all__ = ["BatchPublisher", "ClaimedJob", "Message", "Publisher"]

_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


def _no_headers() -> Mapping[str, str]:
    return _NO_HEADERS


def _read_only(headers: Any) -> Mapping[str, str]:
    """The row's headers as a read-only mapping (the column is NULL when there are none)."""
    return MappingProxyType(headers) if headers else _NO_HEADERS


def _freeze_headers(value: Any) -> None:
    """``__post_init__`` of both values: a mapping given by hand is copied behind a read-only view."""
    if type(value.headers) is not MappingProxyType:
        object.__setattr__(value, "headers", MappingProxyType(dict(value.headers or {})))


@dataclass(frozen=True, slots=True)
class Message:
    """One claimed outbox event, as handed to a :class:`Publisher`.

    ``message_id`` is ``str(id)``: stable across retries and re-claims, the downstream de-duplication key.
    ``lease_version`` is the fencing token of this claim (downstream may use it to reject stale deliveries).
    ``attempts`` counts this attempt (1 on the first delivery). ``headers`` is a read-only mapping of the
    event's headers (empty when it has none); publishers copy it into the broker's own header slot.
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
    headers: Mapping[str, str] = field(default_factory=_no_headers)

    def __post_init__(self) -> None:
        _freeze_headers(self)

    @classmethod
    def from_row(cls, row: Any) -> Message:
        """From a claim row: (id, lease_version, attempts, aggregate_type, aggregate_id, event_type, payload,
        created_at, headers) — the order of ``_sql.claim_returning``."""
        id_, version, attempts, atype, aid, etype, payload, created, headers = row
        return cls(id_, str(id_), atype, aid, etype, payload, attempts, version, created, _read_only(headers))


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """One claimed job, as handed to its handler. ``headers`` is a read-only mapping of the job's headers
    (empty when it has none)."""

    id: int
    task: str
    queue: str
    payload: Any
    attempts: int
    max_attempts: int
    lease_version: int
    priority: int
    created_at: datetime
    headers: Mapping[str, str] = field(default_factory=_no_headers)

    def __post_init__(self) -> None:
        _freeze_headers(self)

    @classmethod
    def from_row(cls, row: Any) -> ClaimedJob:
        """From a claim row: (id, lease_version, attempts, max_attempts, task, queue, payload, priority,
        created_at, headers) — the order of ``_sql.claim_returning``."""
        id_, version, attempts, max_attempts, task, queue, payload, priority, created, headers = row
        return cls(id_, task, queue, payload, attempts, max_attempts, version, priority, created,
                   _read_only(headers))  # fmt: skip


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
