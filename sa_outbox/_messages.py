"""Values that cross the boundary between the engine and user code: frozen, cheap to build."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from .errors import JobCancelled

__all__ = ["BatchPublisher", "ClaimedJob", "Message", "Publisher"]

_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


def _no_headers() -> Mapping[str, str]:
    return _NO_HEADERS


#: The C scanner :func:`json.loads` runs (a decoder of the same defaults as its own): ``jsonb``'s text has no
#: surrounding whitespace, so one scan reads it, without ``loads``' type checks and two whitespace matches
#: (~0.5 µs instead of ~1.7 µs per claimed row).
_SCAN: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _is_stdlib_loads(loads: Any) -> bool:
    """Whether ``loads`` is the standard library's own :func:`json.loads` — not merely what the name holds
    now: an application that replaced ``json.loads`` (say, floats as ``Decimal``) gets its function called."""
    code = getattr(loads, "__code__", None)
    return (
        code is not None
        and getattr(loads, "__module__", None) == "json"
        and getattr(loads, "__qualname__", None) == "loads"
        and code.co_filename == getattr(json, "__file__", None)
    )


def _json(text: str | None, loads: Callable[[str], Any]) -> Any:
    """A claim row's payload: the column's JSON text (``_sql.claim_returning`` casts it) decoded — by
    ``loads``, or, when that is the standard library's :func:`json.loads`, by its scanner (the same values; any
    text the scan does not read to the end goes to ``loads``, which decodes it or raises its own error)."""
    if text is None:
        return None
    if loads is _STDLIB_LOADS:
        try:
            value, end = _SCAN(text, 0)
        except StopIteration:
            return loads(text)
        return value if end == len(text) else loads(text)
    return loads(text)


#: ``json.loads`` as this module found it, when it is the standard library's (else nothing takes the scan).
_STDLIB_LOADS: Any = json.loads if _is_stdlib_loads(json.loads) else object()


def slot_setters(cls: type, names: Sequence[str]) -> tuple[Callable[[Any, Any], None], ...]:
    """The slot setters of a frozen slotted dataclass, in ``names`` order, for a hot path that fills a new
    instance through them (its values already of the fields' types) instead of the frozen ``__init__``'s
    ``object.__setattr__`` per field and ``__post_init__`` (``from_row`` here, ``_steps.done_outcome``).
    Refuses a ``names`` that leaves a field out: a field added to the class must be set there too."""
    found = tuple(cls.__dict__[n].__set__ for n in names)
    missing = set(getattr(cls, "__slots__", ())) - set(names)
    if missing:
        raise AssertionError(f"the fast builder of {cls.__name__} does not set {sorted(missing)}")
    return found


def json_loads_of(engine: Any) -> Callable[[str], Any]:
    """What decodes JSON read through ``engine``: its ``json_deserializer`` when one was given to
    ``create_engine`` (SQLAlchemy installs it as psycopg's JSON loader too), else :func:`json.loads` — so a
    claimed payload decodes as the same value an ORM query on that engine returns."""
    return getattr(getattr(engine, "dialect", None), "_json_deserializer", None) or json.loads


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

    ``message_id`` is ``str(id)`` after the dispatcher's ``message_id_prefix`` (none by default): stable across
    retries and re-claims, the downstream de-duplication key.
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
    def from_row(cls, row: Any, loads: Callable[[str], Any] = json.loads, prefix: str = "") -> Message:
        """From a claim row: (id, lease_version, attempts, aggregate_type, aggregate_id, event_type, payload,
        created_at, headers) — the order of ``_sql.claim_returning`` (whose trailing age is not part of it);
        ``prefix``: the dispatcher's ``message_id_prefix``."""
        id_, version, attempts, atype, aid, etype, payload, created, headers = row[:9]
        if cls is not Message:  # a subclass: its own __init__ and fields
            return cls(id_, f"{prefix}{id_}", atype, aid, etype, _json(payload, loads), attempts, version,
                       created, _read_only(headers))  # fmt: skip
        s_id, s_mid, s_atype, s_aid, s_etype, s_payload, s_attempts, s_version, s_created, s_headers = (
            _MESSAGE_SETTERS
        )
        m = object.__new__(cls)
        s_id(m, id_)
        s_mid(m, f"{prefix}{id_}" if prefix else str(id_))
        s_atype(m, atype)
        s_aid(m, aid)
        s_etype(m, etype)
        s_payload(m, _json(payload, loads))
        s_attempts(m, attempts)
        s_version(m, version)
        s_created(m, created)
        s_headers(m, _read_only(headers))
        return m


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """One claimed job, as handed to its handler. ``headers`` is a read-only mapping of the job's headers
    (empty when it has none).

    ``cancel_requested`` turns true when :func:`sa_outbox.cancel_jobs` asks for this job to stop while it runs
    (the worker learns it with its next heartbeat): a long handler checks it, or calls
    :meth:`raise_if_cancelled`, between steps. A handler that stops after a request is recorded ``cancelled``;
    one that finishes anyway, ``done``.
    """

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
    _cancel: CancelToken = field(default_factory=lambda: CancelToken(), repr=False, compare=False)

    def __post_init__(self) -> None:
        _freeze_headers(self)

    @classmethod
    def from_row(
        cls, row: Any, cancel: CancelToken | None = None, loads: Callable[[str], Any] = json.loads
    ) -> ClaimedJob:
        """From a claim row: (id, lease_version, attempts, max_attempts, task, queue, payload, priority,
        created_at, headers) — the order of ``_sql.claim_returning`` (whose trailing age is not part of it)."""
        id_, version, attempts, max_attempts, task, queue, payload, priority, created, headers = row[:10]
        if cls is not ClaimedJob:  # a subclass: its own __init__ and fields
            return cls(id_, task, queue, _json(payload, loads), attempts, max_attempts, version, priority, created,
                       _read_only(headers), cancel or CancelToken())  # fmt: skip
        (s_id, s_task, s_queue, s_payload, s_attempts, s_max,
         s_version, s_priority, s_created, s_headers, s_cancel) = _JOB_SETTERS  # fmt: skip
        job = object.__new__(cls)
        s_id(job, id_)
        s_task(job, task)
        s_queue(job, queue)
        s_payload(job, _json(payload, loads))
        s_attempts(job, attempts)
        s_max(job, max_attempts)
        s_version(job, version)
        s_priority(job, priority)
        s_created(job, created)
        s_headers(job, _read_only(headers))
        s_cancel(job, cancel or CancelToken())
        return job

    @property
    def cancel_requested(self) -> bool:
        """True once this job's cancellation was requested (see the class docs)."""
        return self._cancel.is_set()

    def raise_if_cancelled(self) -> None:
        """Raise :class:`~sa_outbox.errors.JobCancelled` if this job's cancellation was requested: the job is
        then recorded ``cancelled``."""
        if self._cancel.is_set():
            raise JobCancelled(f"job {self.id} ({self.task}) was cancelled")


_MESSAGE_SETTERS = slot_setters(
    Message, ("id", "message_id", "aggregate_type", "aggregate_id", "event_type", "payload", "attempts",
              "lease_version", "created_at", "headers"),
)  # fmt: skip
_JOB_SETTERS = slot_setters(
    ClaimedJob, ("id", "task", "queue", "payload", "attempts", "max_attempts", "lease_version", "priority",
                 "created_at", "headers", "_cancel"),
)  # fmt: skip


class CancelToken:
    """A thread-safe "stop" flag the worker sets when a job's cancellation is requested (with an optional
    callback, e.g. cancelling an asyncio task).

    A plain attribute rather than a ``threading.Event``: nobody waits on it (handlers poll it), and one is made
    per claimed job. Setting it is one store under the GIL."""

    __slots__ = ("_on_set", "_set")

    def __init__(self) -> None:
        self._set = False
        self._on_set: Callable[[], None] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            callback = self._on_set
            if callback is not None:
                callback()

    def on_set(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` when the token is set (at once if it already is)."""
        self._on_set = callback
        if callback is not None and self._set:
            callback()


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
