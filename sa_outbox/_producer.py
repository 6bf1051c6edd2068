"""The write side: events and jobs exist if and only if the caller's transaction commits.

Nothing here opens a connection or commits: rows are written in the caller's own ``Session``/``AsyncSession``
transaction (``AsyncSession`` runs these same listeners inside the sync session it wraps). In the spirit of
SQLAlchemy's ``examples/versioned_history``, the producer is a few session listeners that keep their state in
``session.info`` and do their work at flush, in four named steps:

1. **Validate** (:func:`_take`, in ``before_flush``; for rows that the application's own ``before_flush``
   listeners add after ours, at their ``session.add``): payload encodable and under the size limit, required
   text non-empty and small enough for its btree index entry, integers within their column. A refusal is a
   :class:`~sa_outbox.errors.PayloadError` *before any SQL of the flush* (a listener's row: when it is added,
   before any SQL that writes it), and the refused flush writes nothing.
2. **Plan the locks** (:func:`_plan`): each aggregate is locked once per transaction, so that within one
   aggregate the outbox ``id`` order is the commit order (the precondition of the ordered claim, docs/design.md
   "The producer lock"):

   * an event built with :meth:`OutboxMixin.for_aggregate` locks the aggregate's own row with
     ``SELECT … FOR NO KEY UPDATE`` (it does not block foreign-key inserts into child tables); an aggregate
     inserted by this transaction needs no lock (nobody else can see it before the commit);
   * an event given only ``aggregate_type``/``aggregate_id`` strings takes the transaction-scoped advisory lock
     ``pg_advisory_xact_lock(hashtextextended(aggregate_type || ':' || aggregate_id, 0))``.

   **The rule:** every producer of one aggregate must serialise on the *same* lock — always build that
   aggregate's events the same way (from the instance, or from strings). Code outside this library that writes
   to the outbox takes the same lock with :func:`lock_aggregate` (the instance, or the two strings) first.
3. **Lock** (:func:`_lock_rows`): the row locks, one statement per aggregate table in primary-key order; the
   advisory locks in key order (two producers locking {A, B} in one flush each cannot deadlock; over several
   flushes in opposite orders they can, as with any lock), riding on step 4.
4. **Insert and notify** (:func:`_insert_events`): the events in the order the code added them (``id`` order =
   write order within the transaction); plain events (only the four event columns set) as one
   ``INSERT … SELECT … FROM unnest(…)`` that also takes the advisory locks and sends the NOTIFYs, others with
   a Core INSERT each. One NOTIFY per channel and transaction (``pg_notify`` is transactional: delivered at
   commit, discarded on rollback), so idle dispatchers/workers wake up within milliseconds. Jobs are
   inserted by the ORM; their NOTIFY rides here.

Steps 2–4 run in ``before_flush`` for the flush's plain events (one statement for 1,000 of them, which also
takes the locks of every event the flush holds). An event that cannot be written yet — built from an
aggregate the flush is about to insert (its key is not known: an ``AsyncSession`` cannot flush early), with
other columns set, or after such an event in the same table, or added by a later ``before_flush`` listener —
is taken out of the ORM's own INSERT (``listonly``) and written in ``after_flush``, when the ORM has inserted
everything else; the ORM then makes it persistent as if it had inserted it.

Events of a ``CdcOutboxMixin`` table (``sa_outbox_kind = "cdc"``: Debezium reads it from the WAL) take the
same steps with three differences (``_Shape``): the producer makes their ids (UUIDs, so it knows them in
write order) and their ``tracingspancontext`` at step 1, step 4 sends no NOTIFY for them (nobody polls the
table), and in insert-then-delete mode a DELETE of the rows follows their INSERT in the same flush — they
then end as the ORM's own deleted objects.

The other session paths keep the same guarantees: :func:`emit` (no ORM objects), ORM-enabled
``session.execute(insert(OutboxEvent), rows)`` (``do_orm_execute``: validated, locked, announced; rows given
inside the statement are refused), and :func:`lock_aggregate`. ``Session.bulk_save_objects`` and
``bulk_insert_mappings`` run no session event at all: like Core on a connection, they write without the
producer (call :func:`lock_aggregate` first).
"""

from __future__ import annotations

import datetime as dt
import functools
import importlib
import json
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast, overload

from sqlalchemy import (
    ARRAY,
    Connection,
    Table,
    Text,
    Uuid,
    any_,
    bindparam,
    column,
    delete,
    event,
    func,
    insert,
    select,
    text,
    tuple_,
)
from sqlalchemy import cast as sa_cast
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import (
    MANYTOONE,
    ONETOMANY,
    Mapper,
    ORMExecuteState,
    Session,
    SessionTransaction,
    object_mapper,
    object_session,
)
from sqlalchemy.orm.base import instance_state
from sqlalchemy.orm.exc import UnmappedInstanceError
from sqlalchemy.sql.elements import ClauseElement

from . import _enqueue
from ._durations import Duration, to_timedelta
from ._enqueue import NOTIFY_SQL, Enqueued, OnConflict
from ._execute import run
from ._names import channel_for
from ._payload import (
    check_concurrency_key,
    check_headers,
    check_index_entries,
    check_int,
    check_payload,
    index_safe_chars,
    require_text,
)
from ._tracing import trace_headers, with_trace
from .cdc import COLUMNS as _CDC_COLUMNS
from .cdc import check_event as check_cdc_event
from .cdc import span_context
from .errors import PayloadError

__all__ = [
    "LOCK_AGGREGATES",
    "EmitEvent",
    "JobItem",
    "emit",
    "enqueue",
    "enqueue_many",
    "event_for",
    "install",
    "lock_aggregate",
]

#: ``session.info[LOCK_AGGREGATES] = False`` switches the aggregate lock off for that session (tests that show
#: why it exists use this; production code should not).
LOCK_AGGREGATES = "sa_outbox.lock_aggregates"

_AGGREGATE_ATTR = "_sa_outbox_aggregate"
_TX_KEY = "sa_outbox.tx_state"
_FLUSH_KEY = "sa_outbox.flush"
_INT4 = (-(2**31), 2**31 - 1)

if TYPE_CHECKING:  # the mixins import this module (to install the hook), never the other way round
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    from ._schema import CdcOutboxMixin, JobMixin, OutboxMixin

#: An event of either kind: the producer writes both through the same steps.
_Event: TypeAlias = "OutboxMixin | CdcOutboxMixin"

J = TypeVar("J", bound="JobMixin")
E = TypeVar("E", bound="OutboxMixin | CdcOutboxMixin")

#: The model kinds (``sa_outbox_kind``) whose rows are events: ``outbox`` (polled by dispatchers) and ``cdc``
#: (an insert-only table read from the WAL by Debezium's outbox event router).
_EVENT_KINDS = frozenset({"outbox", "cdc"})

#: An event for :func:`emit`: ``(aggregate_type, aggregate_id, event_type, payload)``, optionally with the
#: event's own headers as a fifth element.
EmitEvent = tuple[str, str, str, Any] | tuple[str, str, str, Any, Mapping[str, str] | None]
#: A job for :func:`enqueue_many`: ``(task, payload)``, or a mapping of ``enqueue``'s options with ``task`` and
#: ``payload`` (``queue``, ``priority``, ``run_at``, ``max_attempts``, ``headers``, ``concurrency_key``,
#: ``unique_key``, ``on_conflict``, ``debounce``, ``max_delay``).
JobItem = tuple[str, Any] | Mapping[str, Any]


# --- the statements (constant SQL, values only as bound parameters) ---------------------------------------

# The two halves of every producer statement, written once: the advisory locks of the (type, id) pairs —
# de-duplicated and taken in sorted order, so producers locking the same set in another order cannot
# deadlock; the ORDER BY runs before the volatile lock function — and the transaction's NOTIFYs. Both are
# uncorrelated scalar subqueries: evaluated once per statement.
_LOCKS_SQL = """(SELECT count(*) FROM (
      SELECT pg_advisory_xact_lock(k) FROM (
          SELECT DISTINCT hashtextextended(t || ':' || i, 0) AS k
            FROM unnest(CAST(:types AS text[]), CAST(:ids AS text[])) AS u(t, i)) AS keys
       ORDER BY k) AS locked)"""
_NOTIFY_SQL = NOTIFY_SQL  # shared with the jobs' one-statement insert (``_enqueue``)

#: Locks and NOTIFYs on their own (before inserts that cannot carry them, and :func:`lock_aggregate`).
_LOCK_AND_NOTIFY = text(f"SELECT {_LOCKS_SQL} AS locks, {_NOTIFY_SQL} AS notifies")
_NO_GATE: dict[str, list[str]] = {"types": [], "ids": [], "channels": [], "payloads": []}


_FAST_COLUMNS = frozenset(
    {"id", "aggregate_type", "aggregate_id", "event_type", "payload", "created_at", "status", "available_at",
     "attempts", "lease_owner", "lease_until", "lease_version", "last_error", "done_at", "headers"}
)  # fmt: skip
_FAST_SET = frozenset({"aggregate_type", "aggregate_id", "event_type", "payload", "headers"})


@dataclass(frozen=True)
class _Shape:
    """How the producer writes one event table.

    ``cdc``: a ``CdcOutboxMixin`` table — ids are UUIDs the producer makes (so it knows them in write order),
    ``tracingspancontext`` is filled from the headers, and no NOTIFY is sent (nobody polls the table: the WAL
    is read). ``delete``: each row is deleted again in the transaction that inserted it (the WAL keeps the
    insert for Debezium; the table stays empty)."""

    columns: frozenset[str]  # exactly the mixin's columns: the table can take the one-statement insert
    fast_set: frozenset[str]  # the attributes an event on the one-statement path may have set
    cdc: bool = False
    delete: bool = False


@functools.cache
def _shape(table: Table) -> _Shape:
    if table.info.get("sa_outbox_kind") == "cdc":
        delete = bool(table.info.get("sa_outbox_delete_after_insert", True))
        return _Shape(_CDC_COLUMNS, _FAST_SET | {"id", "tracingspancontext"}, cdc=True, delete=delete)
    return _Shape(_FAST_COLUMNS, _FAST_SET)


@functools.cache
def _fast_insert(table: Table) -> Any:
    """Locks, NOTIFYs and plain events in one statement (one round trip).

    ``INSERT … SELECT`` from ``unnest`` of the column arrays in their given order; the WHERE holds the lock and
    NOTIFY subqueries (evaluated once, before the first row is inserted). Used for events that set only the
    four event columns and ``headers`` (JSON text, NULL for none) on a table with exactly the mixin's columns;
    anything else gets :func:`_row_insert`. A CDC table also takes the producer's UUIDs (``f_uuids``) and
    ``tracingspancontext`` (``f_spans``), and returns ``created_at`` with the id: its rows may be deleted
    before anyone could load it.
    """
    cdc = _shape(table).cdc
    arrays = [
        "f_types",
        "f_ids",
        "f_events",
        "f_payloads",
        "f_headers",
        *(["f_uuids", "f_spans"] if cdc else []),
    ]
    rows = (
        func.unnest(*[bindparam(name, type_=ARRAY(Text)) for name in arrays])
        .table_valued(*[column(n, Text) for n in "tiephus"[: len(arrays)]], with_ordinality="ord")
        .render_derived(name="ev")
    )
    gate = text(f"{_LOCKS_SQL} >= 0 AND {_NOTIFY_SQL} >= 0")
    values: list[Any] = [rows.c.t, rows.c.i, rows.c.e, sa_cast(rows.c.p, JSONB), sa_cast(rows.c.h, JSONB)]
    c = table.c
    targets = [c.aggregate_type, c.aggregate_id, c.event_type, c.payload, c.headers]
    if cdc:
        values += [sa_cast(rows.c.u, Uuid), rows.c.s]
        targets += [c.id, c.tracingspancontext]
    source = select(*values).where(gate).order_by(rows.c.ord)
    stmt = insert(table).from_select(targets, source)
    return stmt.returning(c.id, c.created_at) if cdc else stmt.returning(c.id)


@functools.cache
def _delete_events(table: Table) -> Any:
    """Insert then delete (a CDC table in its default mode): the rows this transaction just inserted go again;
    the WAL keeps the inserts, which is what Debezium's outbox event router reads (it drops the deletes)."""
    ids = sa_cast(bindparam("d_ids", type_=ARRAY(Text)), ARRAY(Uuid))
    return delete(table).where(table.c.id == any_(ids))


@functools.cache
def _row_insert(table: Table) -> Any:
    """One event with any columns set (the values are bound per row; SQL expressions via ``.values()``)."""
    return insert(table).returning(table.c.id)


@functools.cache
def _row_insert_all(table: Table) -> Any:
    """The same for a CDC table, returning every column (the row may be gone before anything loads it)."""
    return insert(table).returning(*table.c)


def _table_of(obj: Any) -> Table:
    """The table of a mapped event or job (the mixins map one table)."""
    return cast(Table, type(obj).__table__)


@functools.cache
def _plain_table(table: Table) -> bool:
    """The table has exactly the mixin's columns (no user columns whose defaults the ORM would apply)."""
    return set(table.c.keys()) == _shape(table).columns


_FAST_KEYS = _FAST_SET | {"_sa_instance_state", _AGGREGATE_ATTR}


def _fast_eligible(ev: _Event) -> bool:
    """Only the four event columns are set (private attributes aside), on a table with the mixin's columns."""
    table = _table_of(ev)
    if not _plain_table(table):
        return False
    keys = instance_state(ev).dict.keys()
    allowed = _shape(table).fast_set
    return keys <= _FAST_KEYS or all(k in allowed or k[0] == "_" for k in keys)


@functools.cache
def _server_defaulted(table: Table) -> tuple[str, ...]:
    """The columns the database fills in when a plain event is inserted (the key comes back from it)."""
    return tuple(
        c.key
        for c in table.c
        if c.server_default is not None and not c.primary_key and c.key not in _FAST_SET
    )


# --- what a transaction already locked and announced ------------------------------------------------------


@dataclass
class _TxState:
    advisory: set[tuple[str, str]] = field(default_factory=set)
    rows: set[tuple[Any, ...]] = field(default_factory=set)
    notified: set[tuple[str, str]] = field(default_factory=set)


class _Seen:
    """What the current transaction and its parents already locked and notified (locks and NOTIFYs of a
    parent hold inside a savepoint); ``current`` is where a step records its own."""

    __slots__ = ("chain", "current")

    def __init__(self, session: Session) -> None:
        states: dict[SessionTransaction, _TxState] = session.info.setdefault(_TX_KEY, {})
        tx = session.get_nested_transaction() or session.get_transaction()
        chain: list[_TxState] = []
        while tx is not None:
            if tx in states or not chain:
                chain.append(states.setdefault(tx, _TxState()))
            tx = tx.parent
        self.current, self.chain = chain[0], chain

    def __call__(self, attr: str, key: Any) -> bool:
        return any(key in getattr(st, attr) for st in self.chain)


# --- aggregates -------------------------------------------------------------------------------------------


def _in_flush(session: Session) -> bool:
    return bool(session._flushing)  # set by Session.flush() around the whole flush, listeners included


def _aggregate_identity(aggregate: Any) -> tuple[Mapper[Any], tuple[Any, ...]]:
    """The aggregate's mapper and primary key, without I/O (``None`` in the key: not inserted yet)."""
    try:
        mapper = object_mapper(aggregate)
    except UnmappedInstanceError:
        raise PayloadError(
            f"an aggregate must be a mapped instance, got {type(aggregate).__name__}; "
            "pass aggregate_type= and aggregate_id= strings instead"
        ) from None
    state = instance_state(aggregate)
    if state.key is not None:  # persistent or detached: the identity key (an expired row needs no load)
        return mapper, tuple(state.key[1])
    return mapper, tuple(state.dict.get(mapper.get_property_by_column(c).key) for c in mapper.primary_key)


def _in_greenlet() -> bool:
    """Inside SQLAlchemy's asyncio bridge (``AsyncSession.run_sync``, a flush): sync I/O is possible."""
    try:
        greenlet: Any = importlib.import_module("greenlet")  # (no type stubs)
    except ImportError:  # pragma: no cover - greenlet comes with sqlalchemy[asyncio]
        return False
    # the marker SQLAlchemy's greenlet_spawn sets (2.0 and 2.1): sync code in it may await the driver
    return bool(getattr(greenlet.getcurrent(), "__sqlalchemy_greenlet_provider__", False))


def _can_flush_now(session: Session, mapper: Mapper[Any]) -> bool:
    """A flush can run here: not inside one, and not on an asyncio driver outside its greenlet bridge."""
    if _in_flush(session):
        return False
    return not getattr(session.get_bind(mapper=mapper).dialect, "is_async", False) or _in_greenlet()


def event_for(
    model: type[E],
    aggregate: Any,
    event_type: str,
    payload: Any,
    *,
    aggregate_type: str | None = None,
) -> E:
    """Build an outbox event for a mapped aggregate instance (not added to any session).

    ``aggregate_type`` defaults to the aggregate class's ``__outbox_aggregate_type__`` attribute, else its class
    name; ``aggregate_id`` is its primary key (composite keys joined with ``:``). An aggregate that is pending
    in a ``Session`` without its key yet makes this call flush the session, so the key is known at once (and
    the rows added before it are written first). Where a flush cannot run — in an ``AsyncSession`` (no I/O
    outside ``await``) or inside a flush (a ``before_flush`` listener) — nothing is done here: the event gets
    the key when the flush inserts the aggregate, and is written after it. At flush the producer locks the
    aggregate's row with ``FOR NO KEY UPDATE`` (an aggregate inserted by this transaction needs no lock).
    """
    mapper, pk = _aggregate_identity(aggregate)
    if any(v is None for v in pk):
        session = object_session(aggregate)
        if session is None:
            raise PayloadError(
                f"{type(aggregate).__name__} has no primary key yet and is in no session: add it to the "
                "session (or give it its key) before building its event"
            )
        if _can_flush_now(session, mapper):
            session.flush()
            mapper, pk = _aggregate_identity(aggregate)
    atype = (
        aggregate_type or getattr(mapper.class_, "__outbox_aggregate_type__", None) or mapper.class_.__name__
    )
    ev: E = cast(Any, model)(
        aggregate_type=atype,
        aggregate_id=None if any(v is None for v in pk) else ":".join(str(v) for v in pk),
        event_type=event_type,
        payload=payload,
    )
    setattr(ev, _AGGREGATE_ATTR, aggregate)
    return ev


def _resolve_aggregate_id(ev: _Event) -> None:
    """Give an event built from a then-new aggregate the key the flush gave that aggregate."""
    aggregate = ev.__dict__.get(_AGGREGATE_ATTR)
    if aggregate is None or ev.aggregate_id is not None:
        return
    _, pk = _aggregate_identity(aggregate)
    if any(v is None for v in pk):
        raise PayloadError(
            f"outbox event {ev.event_type!r} for a {type(aggregate).__name__}: the aggregate still has no "
            "primary key after the flush; add it to the same session as its event (or give it its key)"
        )
    ev.aggregate_id = ":".join(str(v) for v in pk)
    _check_event_text(_table_of(ev), ev.aggregate_type, ev.aggregate_id, ev.event_type)


# --- step 1: validate -------------------------------------------------------------------------------------


def _what_event(event_type: Any, aggregate_type: Any, aggregate_id: Any) -> str:
    return f"outbox event {event_type!r:.80} for {aggregate_type!r:.80}/{aggregate_id!r:.80}"


def _check_event_text(table: Table, atype: str, aid: str, etype: str) -> None:
    values = {"aggregate_type": atype, "aggregate_id": aid, "event_type": etype}
    check_index_entries(table, values, what=functools.partial(_what_event, etype, atype, aid))


def _event_values(
    table: Table, max_bytes: int, atype: Any, aid: Any, etype: Any, payload: Any, *, resolved: bool = True
) -> tuple[str, str | None, str, Any, str]:
    """The event's checked text, its payload as plain JSON values and as JSON text, or PayloadError."""
    what = functools.partial(_what_event, etype, atype, aid)  # names the event as given; built on error only
    atype = require_text(atype, what, "aggregate_type")
    aid = require_text(aid, what, "aggregate_id") if resolved else None
    etype = require_text(etype, what, "event_type")
    if resolved and len(atype) + len(cast(str, aid)) + len(etype) > index_safe_chars(table):
        _check_event_text(table, atype, cast(str, aid), etype)
    normalized, encoded = check_payload(payload, what=what, max_bytes=max_bytes)
    if table.info.get("sa_outbox_kind") == "cdc":
        check_cdc_event(atype, normalized, encoded, max_bytes, what)
    return atype, aid, etype, normalized, encoded


def _headers_of(
    what: str | Callable[[], str], given: Any, max_bytes: int, context: Mapping[str, str]
) -> tuple[dict[str, str] | None, str | None]:
    """Headers checked (:func:`check_headers`), plus the trace ``context`` the application did not set; their
    JSON text (``None`` for no headers)."""
    plain, encoded = check_headers(given, what=what, max_bytes=max_bytes)
    if context:
        plain = with_trace(plain, context)
        encoded = json.dumps(plain, separators=(",", ":"))
    return plain, encoded


def _merge_headers(common: Mapping[str, str] | None, own: Any) -> Any:
    """``emit(headers=…)`` under an event's own headers (the event's win, whatever the case of the name)."""
    if not common or own is None:
        return own if own is not None else common
    if not isinstance(own, Mapping):
        return own  # refused by check_headers
    mine = {k.lower() for k in own if isinstance(k, str)}
    return {**{k: v for k, v in common.items() if not (isinstance(k, str) and k.lower() in mine)}, **own}


def _validate_event(ev: _Event, context: Mapping[str, str]) -> tuple[str, str | None]:
    """Validate (and normalise) an event in place; returns its payload and its headers as JSON text
    (``context``: the trace headers to add, see :func:`_tracing.trace_headers`)."""
    model, d = type(ev), instance_state(ev).dict
    given_headers = d.get("headers")
    headers_text = None
    if given_headers is not None or context:
        what_h = functools.partial(
            _what_event, d.get("event_type"), d.get("aggregate_type"), d.get("aggregate_id")
        )
        headers, headers_text = _headers_of(what_h, given_headers, model.sa_outbox_max_headers_bytes, context)
        if headers != given_headers or type(given_headers) is not dict:
            ev.headers = headers
    table = _table_of(ev)
    atype, aid, etype, given = (
        d.get("aggregate_type"),
        d.get("aggregate_id"),
        d.get("event_type"),
        d.get("payload"),
    )
    if (  # the common case, decided without a call per check: short non-blank text without NUL
        type(atype) is str and type(aid) is str and type(etype) is str
        and 0 < len(atype) + len(aid) + len(etype) <= index_safe_chars(table)
        and atype and aid and etype and not (atype.isspace() or aid.isspace() or etype.isspace())
        and "\x00" not in atype and "\x00" not in aid and "\x00" not in etype
        and atype.isascii() and aid.isascii() and etype.isascii()  # (other text: require_text checks it is UTF-8)
    ):  # fmt: skip
        what = functools.partial(_what_event, etype, atype, aid)
        payload, encoded = check_payload(given, what=what, max_bytes=model.sa_outbox_max_payload_bytes)
        if table.info.get("sa_outbox_kind") == "cdc":
            check_cdc_event(atype, payload, encoded, model.sa_outbox_max_payload_bytes, what)
        if payload is not given:
            ev.payload = payload
        return encoded, headers_text
    unresolved = aid is None and _AGGREGATE_ATTR in d
    atype, aid, etype, payload, encoded = _event_values(
        table, model.sa_outbox_max_payload_bytes, atype, aid, etype, given, resolved=not unresolved
    )
    for name, old, new in (("aggregate_type", ev.aggregate_type, atype), ("aggregate_id", ev.aggregate_id, aid),
                           ("event_type", ev.event_type, etype), ("payload", given, payload)):  # fmt: skip
        if new is not old:
            setattr(ev, name, new)
    return encoded, headers_text


def _cdc_id(given: Any, what: str | Callable[[], str]) -> uuid.UUID:
    """A CDC event's id: a new UUID, or the one given (a ``UUID`` or its text)."""
    if given is None:
        return uuid.uuid4()
    if isinstance(given, uuid.UUID):
        return given
    try:
        return uuid.UUID(str(given))
    except ValueError:
        where = what() if callable(what) else what
        raise PayloadError(
            f"{where}: id must be a UUID (or left out: the producer makes one), got {given!r:.80}"
        ) from None


#: Where an event keeps the ``tracingspancontext`` the producer derived for it (not a column): a value the
#: application set is different from it, and kept.
_DERIVED_SPAN = "_sa_outbox_derived_span"


def _cdc_columns(ev: CdcOutboxMixin) -> None:
    """The CDC columns of a validated event: its id, and Debezium's ``tracingspancontext`` from its headers
    (unless the application set it)."""
    d = instance_state(ev).dict
    new_id = _cdc_id(
        d.get("id"), functools.partial(_what_event, ev.event_type, ev.aggregate_type, ev.aggregate_id)
    )
    if new_id is not d.get("id"):
        ev.id = new_id
    current = d.get("tracingspancontext")
    if current is None or current == d.get(_DERIVED_SPAN):
        # derived again at every flush that writes it: an event added again after a rollback with other
        # headers carried its first traceparent's span before
        span = span_context(d.get("headers"))
        if span != current:
            ev.tracingspancontext = span
        d[_DERIVED_SPAN] = span


def _job_values(
    table: Table, max_bytes: int, values: Mapping[str, Any], *, max_headers: int = 8 * 1024,
    context: Mapping[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A job's values checked and normalised (``queue`` defaults to ``"default"``; ``headers`` plus the trace
    ``context``), or PayloadError."""
    return _checked_job(table, max_bytes, values, max_headers=max_headers, context=context)[0]


def _checked_job(
    table: Table, max_bytes: int, values: Mapping[str, Any], *, max_headers: int = 8 * 1024,
    context: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], str, str | None]:  # fmt: skip
    """:func:`_job_values`, plus the payload and the headers as JSON text (``None``: no headers)."""
    out = dict(values)
    task, queue = values.get("task"), values.get("queue")
    what = f"job {task!r:.80} on queue {queue!r:.80}"
    out["task"] = require_text(task, what, "task")
    out["queue"] = require_text("default" if queue is None else queue, what, "queue")
    check_concurrency_key(values.get("concurrency_key"), what)
    if sum(len(v) for v in out.values() if type(v) is str) > index_safe_chars(table):  # else: fits, surely
        check_index_entries(table, out, what=what)
    for name, low in (("priority", _INT4[0]), ("max_attempts", 1)):
        if values.get(name) is not None:
            check_int(values[name], what=what, name=name, low=low, high=_INT4[1])
    out["payload"], encoded = check_payload(values.get("payload"), what=what, max_bytes=max_bytes)
    headers_text = None
    if values.get("headers") is not None or context:
        out["headers"], headers_text = _headers_of(what, values.get("headers"), max_headers, context or {})
    return out, encoded, headers_text


def _validate_job(job: JobMixin, context: Mapping[str, str]) -> tuple[str, str | None]:
    """Validate (and normalise) a job in place; ``context``: the trace headers to add. Returns its payload and
    its headers as JSON text."""
    model, d = type(job), instance_state(job).dict
    given = {k: d.get(k) for k in ("task", "queue", "payload", "priority", "max_attempts", "headers",
                                   "concurrency_key")}  # fmt: skip
    checked, encoded, headers_text = _checked_job(
        _table_of(job), model.sa_outbox_max_payload_bytes, given, max_headers=model.sa_outbox_max_headers_bytes,
        context=context,
    )  # fmt: skip
    for name in ("task", "queue", "payload"):
        if checked[name] is not given[name]:
            setattr(job, name, checked[name])
    if "headers" in checked and checked["headers"] != given["headers"]:
        job.headers = checked["headers"]
    if given["max_attempts"] is None:
        job.max_attempts = model.sa_outbox_default_max_attempts
    return encoded, headers_text


#: The columns of a jobs table that :func:`_insert_jobs` can write for the ORM (exactly JobMixin's: a table
#: with columns of its own, whose Python-side defaults only the ORM applies, keeps the ORM's INSERT).
_JOB_COLUMNS = frozenset(
    {"id", "queue", "task", "payload", "status", "priority", "run_at", "attempts", "max_attempts", "locked_by",
     "locked_at", "lease_version", "last_error", "created_at", "finished_at", "headers", "cancel_requested_at",
     "result", "concurrency_key", "unique_key"}
)  # fmt: skip
_JOB_SET = frozenset(
    {"task", "queue", "payload", "priority", "max_attempts", "run_at", "headers", "concurrency_key"}
)
#: ``enqueue``'s mark on a job whose ``run_at`` is ``now() + delay`` (an SQL expression): the delay in seconds.
_DELAY_ATTR = "_sa_outbox_delay"


@functools.cache
def _plain_job_table(table: Table) -> bool:
    return set(table.c.keys()) == _JOB_COLUMNS


@functools.cache
def _job_attributes(mapper: Mapper[Any]) -> tuple[tuple[str, bool], ...]:
    """(attribute, has a server default) of a jobs mapper's columns, the primary key aside."""
    return tuple(
        (prop.key, prop.columns[0].server_default is not None)
        for prop in mapper.column_attrs
        if not prop.columns[0].primary_key
    )


def _job_fast_eligible(job: JobMixin) -> bool:
    """Only enqueue's columns are set (``run_at`` a datetime or enqueue's delay), on a table with JobMixin's
    columns: the one-statement insert can write it (anything else — a unique key set by hand, a status — keeps
    the ORM's INSERT)."""
    if not _plain_job_table(_table_of(job)):
        return False
    d = instance_state(job).dict
    for key, value in d.items():
        if key in _JOB_SET:
            if key == "run_at" and isinstance(value, ClauseElement) and _DELAY_ATTR not in d:
                return False
        elif key[0] != "_":
            return False
    return True


# --- step 2: plan the locks -------------------------------------------------------------------------------


@dataclass
class _Plan:
    advisory: list[tuple[str, str]]
    rows: dict[Mapper[Any], list[tuple[Any, ...]]]
    notifies: list[tuple[str, str]]

    def gate(self) -> dict[str, list[str]]:
        """Parameters of the lock-and-notify subqueries."""
        return {
            "types": [t for t, _ in self.advisory],
            "ids": [i for _, i in self.advisory],
            "channels": [c for c, _ in self.notifies],
            "payloads": [p for _, p in self.notifies],
        }

    def record(self, seen: _Seen) -> None:
        seen.current.advisory.update(self.advisory)
        seen.current.rows.update((m, pk) for m, pks in self.rows.items() for pk in pks)
        seen.current.notified.update(self.notifies)


def _plan(
    session: Session,
    seen: _Seen,
    *,
    strings: Iterable[tuple[str, str]] = (),
    aggregates: Iterable[Any] = (),
    notifies: Iterable[tuple[str, str]] = (),
) -> _Plan:
    """What to lock and announce that this transaction has not yet: advisory locks for string aggregates, row
    locks for mapped aggregates already in the database (one inserted by this transaction needs none)."""
    locking = session.info.get(LOCK_AGGREGATES, True)
    advisory = {key for key in strings if not seen("advisory", key)} if locking else set()
    rows: dict[Mapper[Any], set[tuple[Any, ...]]] = {}
    for aggregate in aggregates if locking else ():
        if instance_state(aggregate).key is None:
            continue  # inserted by this flush: nobody else can lock or see it before we commit
        mapper, pk = _aggregate_identity(aggregate)
        if not seen("rows", (mapper, pk)):
            rows.setdefault(mapper, set()).add(pk)
    return _Plan(
        sorted(advisory),
        {m: sorted(pks) for m, pks in sorted(rows.items(), key=lambda item: item[0].local_table.fullname)},  # type: ignore[attr-defined]
        sorted({n for n in notifies if not seen("notified", n)}),
    )


# --- step 3: lock -----------------------------------------------------------------------------------------


def _lock_rows(conn: Connection, rows: Mapping[Mapper[Any], list[tuple[Any, ...]]]) -> None:
    """Row locks on mapped aggregates, one statement per aggregate table, in primary-key order."""
    for mapper, pks in rows.items():
        cols = list(mapper.primary_key)
        target = tuple_(*cols) if len(cols) > 1 else cols[0]
        values: list[Any] = pks if len(cols) > 1 else [pk[0] for pk in pks]
        lock = (
            select(*cols)
            .where(target.in_(values))
            .order_by(*cols)
            # FOR NO KEY UPDATE: serialises producers of this aggregate, lets FK inserts into children through.
            .with_for_update(key_share=True)
        )
        conn.execute(lock)


def _lock_and_notify(conn: Connection, gate: dict[str, list[str]]) -> dict[str, list[str]]:
    """Send the advisory locks and NOTIFYs on their own if there are any; returns the empty gate."""
    if gate["types"] or gate["channels"]:
        conn.execute(_LOCK_AND_NOTIFY, gate)
    return _NO_GATE


# --- step 4: insert and notify ----------------------------------------------------------------------------


def _insert_events(
    conn: Connection,
    events: list[_Event],
    encoded: Mapping[int, tuple[str, str | None]],
    gate: dict[str, list[str]],
    *,
    all_plain: bool = False,
) -> dict[int, Sequence[str]]:
    """Insert ``events`` in their order (runs of plain events as one statement that first takes the locks and
    sends the NOTIFYs of ``gate``; the gate goes alone before any other insert) and set their ids; then delete
    the rows of CDC tables in insert-then-delete mode (one statement per table).

    Returns, per event (``id()``), the attributes the database filled in, to expire once they are persistent.
    """
    expire: dict[int, Sequence[str]] = {}
    gone: dict[Table, list[str]] = {}
    i = 0
    while i < len(events):
        table = _table_of(events[i])
        plain = all_plain or _fast_eligible(events[i])
        j = i + 1
        while (
            j < len(events)
            and _table_of(events[j]) is table
            and (all_plain or _fast_eligible(events[j]) == plain)
        ):
            j += 1
        group = events[i:j]
        shape = _shape(table)
        if plain:
            params = {
                **gate,
                "f_types": [ev.aggregate_type for ev in group],
                "f_ids": [ev.aggregate_id for ev in group],
                "f_events": [ev.event_type for ev in group],
                "f_payloads": [encoded[id(ev)][0] for ev in group],
                "f_headers": [encoded[id(ev)][1] for ev in group],
            }
            if shape.cdc:
                params["f_uuids"] = [str(ev.id) for ev in group]
                params["f_spans"] = [instance_state(ev).dict.get("tracingspancontext") for ev in group]
            rows = run(conn, _fast_insert(table), params)
            gate = _NO_GATE
            if shape.cdc:  # ids made here, known in write order; created_at came back with them
                created = dict(rows)
                for ev in group:
                    instance_state(ev).dict["created_at"] = created[ev.id]
                    expire[id(ev)] = ()
            else:
                defaulted = _server_defaulted(table)
                for ev, new_id in zip(group, sorted(r[0] for r in rows), strict=True):
                    _set_id(ev, new_id)
                    expire[id(ev)] = defaulted
        else:
            gate = _lock_and_notify(conn, gate)
            for ev in group:
                expire[id(ev)] = _insert_one(conn, table, ev)
        if shape.delete:
            gone.setdefault(table, []).extend(str(ev.id) for ev in group)
        i = j
    _lock_and_notify(conn, gate)
    for table, ids in gone.items():
        conn.execute(_delete_events(table), {"d_ids": ids})
    return expire


#: The id the producer gave an event (beside ``id`` itself): an event whose transaction or savepoint was rolled
#: back keeps it, and added again (a retry loop) it is written anew, not refused as an id given by hand.
_WRITTEN_ID = "_sa_outbox_written_id"


def _set_id(ev: _Event, new_id: int) -> None:
    """Give an inserted event its id, as the unit of work sets a fetched key."""
    d = instance_state(ev).dict
    d["id"] = ev.__dict__[_WRITTEN_ID] = new_id


def _given_id(obj: Any) -> Any:
    """The ``id`` a new event carries that the producer did not give it (after a rollback, its own is dropped)."""
    d = instance_state(obj).dict
    given = d.get("id")
    if given is not None and given == obj.__dict__.get(_WRITTEN_ID):
        del d["id"]  # written by a transaction or savepoint that rolled back: written anew
        return None
    return given


def _insert_one(conn: Connection, table: Table, ev: _Event) -> list[str]:
    """Insert an event with other columns set: its set attributes as bound values (SQL expressions inline),
    column defaults by Core and the database. Returns the attributes to load from the database later (none
    for a CDC event: its row may be deleted at once, so every column comes back with the insert)."""
    state = instance_state(ev)
    values: dict[str, Any] = {}
    inline: dict[str, Any] = {}
    known: set[str] = set()  # attributes whose value the insert was given as is
    cdc = _shape(table).cdc
    for prop in state.mapper.column_attrs:
        col = prop.columns[0]
        # (the id is the database's — refused when given, in step 1 —; created_at, the partitioned layout's
        # other key column, is written as given)
        if (
            getattr(col, "table", None) is not table
            or prop.key not in state.dict
            or (col.name == "id" and not cdc)
        ):
            continue
        value = state.dict[prop.key]
        if value is None and col.server_default is not None:
            continue  # (the ORM's own INSERT leaves such a column to its default too)
        if isinstance(value, ClauseElement):  # e.g. available_at=func.now() + …: evaluated by the database
            inline[col.key] = value
        else:
            values[col.key] = value
            known.add(prop.key)
    if cdc:
        stmt = _row_insert_all(table)
        row = conn.execute(stmt.values(inline) if inline else stmt, values).mappings().one()
        for prop in state.mapper.column_attrs:
            if prop.key not in known and prop.columns[0] in row:
                state.dict[prop.key] = row[prop.columns[0]]
        return []
    stmt = _row_insert(table)
    _set_id(ev, conn.execute(stmt.values(inline) if inline else stmt, values).scalar_one())
    return [p.key for p in state.mapper.column_attrs if p.key not in known and not p.columns[0].primary_key]


# --- the flush: session listeners -------------------------------------------------------------------------


def _event_notifies(tables: Iterable[Table]) -> set[tuple[str, str]]:
    """The NOTIFY of each outbox table written (one per table and transaction: it wakes idle dispatchers). A
    CDC table has none: nobody polls it, its events leave through the WAL."""
    return {(channel_for(t.name), "") for t in tables if not _shape(t).cdc}


def _write(
    session: Session,
    anchor: Mapper[Any],
    encoded: Mapping[int, tuple[str, str | None]],
    *,
    lock: list[_Event],
    insert: list[_Event],
    notifies: Iterable[tuple[str, str]],
    all_plain: bool = False,
) -> dict[int, Sequence[str]]:
    """Steps 2–4 for events: plan the locks of ``lock`` and the NOTIFYs (what this transaction has not taken
    yet), take the row locks, then insert ``insert`` in order with the advisory locks and NOTIFYs riding on the
    first statement. Returns what :func:`_insert_events` returns."""
    conn = session.connection(bind_arguments={"mapper": anchor})
    seen = _Seen(session)
    strings = [(ev.aggregate_type, ev.aggregate_id) for ev in lock if _AGGREGATE_ATTR not in ev.__dict__]
    aggregates = [a for ev in lock if (a := ev.__dict__.get(_AGGREGATE_ATTR)) is not None]
    plan = _plan(session, seen, strings=strings, aggregates=aggregates, notifies=notifies)  # step 2
    _lock_rows(conn, plan.rows)  # step 3 (the advisory locks ride with step 4)
    expire = _insert_events(conn, insert, encoded, plan.gate(), all_plain=all_plain)  # step 4
    plan.record(seen)
    return expire


def _now_persistent(session: Session, written: list[_Event], expire: Mapping[int, Sequence[str]]) -> None:
    """Make events inserted in ``before_flush`` (ids set) what the ORM makes of the rows it inserts itself.

    ``Session._register_persistent`` is the step the unit of work runs after its own INSERTs: identity key and
    identity map, ``pending_to_persistent`` events, and — because it records them in the transaction — the
    same rollback behaviour (a rolled back transaction or savepoint takes them out of the session, as
    ``persistent_to_transient``). It is not public API; ``tests/test_producer.py`` pins the behaviour for
    every SQLAlchemy version the package allows. The columns the database filled in are then expired, so they
    load on first access (what the ORM does without eager defaults). The flush then has nothing left to do
    for them.
    """
    session._register_persistent({instance_state(ev) for ev in written})
    for ev in written:
        if expire[id(ev)]:
            session.expire(ev, expire[id(ev)])
    _now_deleted(session, written)


def _now_deleted(session: Session, written: Iterable[_Event]) -> None:
    """CDC events of an insert-then-delete table are deleted rows now: what the ORM makes of a row it deleted
    itself (``Session._remove_newly_deleted``, the unit of work's step after its DELETEs; not public API, pinned
    by ``tests/test_cdc.py``): out of the session, detached at commit with their values still readable, transient
    again if the transaction or savepoint rolls back."""
    gone = [instance_state(ev) for ev in written if _shape(_table_of(ev)).delete]
    if gone:
        session._remove_newly_deleted(gone)


class _Flush:
    """One flush, from ``before_flush`` to ``after_flush_postexec`` (``session.info[_FLUSH_KEY]``)."""

    __slots__ = ("anchor", "collecting", "context", "encoded", "expire", "jobs", "later", "trace")

    def __init__(self, context: Any) -> None:
        self.context = context  # the flush's UOWTransaction
        self.encoded: dict[int, tuple[str, str | None]] = {}  # id(event) -> payload, headers JSON text
        self.trace: dict[str, str] | None = None  # the trace context at this flush, read once when needed
        self.later: list[_Event] = []  # events written by after_flush, in write order
        self.jobs: set[tuple[str, str]] = set()  # NOTIFYs (table channel, queue) not sent yet
        self.anchor: Any = None  # a mapper of the flush's rows: the bind to write on
        self.collecting = True  # session.add() now is a before_flush listener adding to this flush
        self.expire: dict[int, Sequence[str]] = {}


def _take(fl: _Flush, obj: Any) -> str | None:
    """Step 1 for one new object of the flush: validate it; returns its kind."""
    kind: str | None = getattr(type(obj), "sa_outbox_kind", None)
    if kind is not None and fl.trace is None:
        fl.trace = trace_headers()  # once per flush: every row of the flush is written in the same span
    if kind in _EVENT_KINDS:
        if kind != "cdc" and (given := _given_id(obj)) is not None:
            raise PayloadError(
                f"outbox event {getattr(obj, 'event_type', None)!r:.80}: its id is given ({given!r:.40}), but the "
                "database assigns ids, in write order (the claim order); leave it unset"
            )
        fl.encoded[id(obj)] = _validate_event(obj, cast(dict[str, str], fl.trace))
        if kind == "cdc":
            _cdc_columns(obj)
    elif kind == "jobs":
        fl.encoded[id(obj)] = _validate_job(obj, cast(dict[str, str], fl.trace))
        fl.jobs.add((channel_for(_table_of(obj).name), obj.queue))
    if kind is not None and fl.anchor is None:
        fl.anchor = object_mapper(obj)
    return kind


class _Pinned(dict[Any, tuple[bool, bool]]):
    """A flush's ``UOWTransaction.states`` (state -> (isdelete, listonly)) in which the deferred events stay
    ``listonly`` (registered, never inserted by the ORM) when a relationship registers them again.

    A parent's one-to-many step registers the children it saves with ``cancel_delete=True``, and the unit of
    work then turns a ``listonly`` save into the ORM's own insert: an event appended to an aggregate's
    collection (or given its related object, through the backref) was inserted by the ORM and again by
    :func:`_after_flush` — two rows, two message ids (a hostile review; ``tests/test_producer_relationships.py``
    pins it for every SQLAlchemy version the package allows). A delete still registers as one."""

    __slots__ = ("events",)

    def __init__(self, states: dict[Any, tuple[bool, bool]]) -> None:
        super().__init__(states)
        self.events: set[Any] = set()

    def __setitem__(self, state: Any, value: tuple[bool, bool]) -> None:
        if not value[0] and state in self.events:
            value = (False, True)
        super().__setitem__(state, value)


def _defer(fl: _Flush, ev: _Event) -> None:
    """Take ``ev`` out of the ORM's own INSERT (``listonly``): :func:`_after_flush` writes it, after the rows the
    ORM inserts (a new aggregate's key is known then); the ORM makes it persistent as if it had."""
    states = fl.context.states
    if not isinstance(states, _Pinned):
        states = fl.context.states = _Pinned(states)
    state = instance_state(ev)
    states.events.add(state)
    fl.context.register_object(state, listonly=True)
    fl.later.append(ev)


def _check_references(flush_context: Any, later: list[_Event]) -> None:
    """Refuse a flush in which something needs a deferred event's id: the event's own one-to-many or
    many-to-many collection, or another object's many-to-one (or many-to-many) naming it. The producer writes
    a deferred event after the ORM's rows, so the ORM wrote those links without the id — a NULL key, a missing
    association row, silently (a hostile review). Raised in ``after_flush``: the transaction is rolled back
    whole. A reference to an event flushed earlier (``session.flush()`` first) is fine."""
    deferred = {instance_state(ev) for ev in later}

    def refused(ev_state: Any, where: str) -> PayloadError:
        ev = ev_state.obj()
        return PayloadError(
            f"outbox event {getattr(ev, 'event_type', None)!r:.80} ({type(ev).__name__}) is referenced by "
            f"{where} in the flush that writes it: the producer writes this event after the ORM's own rows (it "
            "has columns of its own, or a new aggregate), so the reference would get no id. Flush the event "
            "first (session.flush()), then add what refers to it"
        )

    for state in deferred:
        for prop in state.mapper.relationships:
            if prop.direction is not MANYTOONE and not prop.viewonly and state.attrs[prop.key].history.added:
                raise refused(state, f"its own {prop} collection")
    for state in flush_context.states:
        for prop in _links_to_events(state.mapper):
            if prop.key not in state.dict:
                continue
            for other in state.attrs[prop.key].history.added:
                if other is not None and instance_state(other) in deferred:
                    raise refused(instance_state(other), f"{prop} of a {type(state.obj()).__name__}")


@functools.cache
def _links_to_events(mapper: Mapper[Any]) -> tuple[Any, ...]:
    """The relationships of ``mapper`` through which a row of it needs an event's id: many-to-one and
    many-to-many ones to an outbox model (a parent's one-to-many sets the event's own key: supported). Most
    mappers have none, and :func:`_check_references` passes their rows by."""
    return tuple(
        prop
        for prop in mapper.relationships
        if prop.direction is not ONETOMANY
        and not prop.viewonly
        and getattr(prop.mapper.class_, "sa_outbox_kind", None) in _EVENT_KINDS
    )


def _sync_many_to_one(ev: _Event) -> None:
    """Copy into ``ev``'s foreign key columns the keys of the objects its many-to-one relationships name, as
    the unit of work does for the objects it inserts — it skips a ``listonly`` one (a deferred event: its key
    was left NULL). A relationship set to None clears its columns, as the ORM's step does."""
    state = instance_state(ev)
    for prop in state.mapper.relationships:
        if prop.direction is not MANYTOONE or prop.key not in state.dict or prop.viewonly:
            continue
        related = state.dict[prop.key]
        for source, dest in prop.synchronize_pairs:
            key = state.mapper.get_property_by_column(dest).key
            if related is None:
                state.dict[key] = None
            else:
                state.dict[key] = getattr(related, prop.mapper.get_property_by_column(source).key)


def _before_flush(session: Session, flush_context: Any, instances: Iterable[Any] | None) -> None:
    """Validate the flush's events and jobs; write what can be written now in one statement.

    Written now: per table, the plain events (the four event columns, aggregate known) ahead of the first one
    that is not — in one statement that also takes the flush's advisory locks and sends its NOTIFYs. The rest
    keeps its place in the write order and is written by :func:`_after_flush`. The locks of every event known
    here are taken here, sorted, whichever of the two writes it. Jobs with only enqueue's columns set are
    written by one statement too (:func:`_insert_jobs`, which carries the NOTIFYs when no event does); other
    jobs are inserted by the ORM."""
    fl = _Flush(flush_context)
    session.info[_FLUSH_KEY] = fl
    try:
        # session.new iterates in the order the objects were added (the ORM keeps pending objects in a dict)
        candidates = session.new if instances is None else [o for o in instances if o in session.new]
        events: list[_Event] = []
        jobs: list[JobMixin] = []
        for o in candidates:
            if getattr(type(o), "sa_outbox_kind", None) is None:
                continue
            kind = _take(fl, o)  # step 1, before any SQL
            if kind in _EVENT_KINDS:
                events.append(o)
            elif kind == "jobs" and _job_fast_eligible(o):
                jobs.append(o)
        if not events and not fl.jobs:
            return
        if events or not jobs:
            now: list[_Event] = []
            tables: set[Table] = set()
            blocked: set[Table] = set()
            for ev in events:
                table = _table_of(ev)
                tables.add(table)
                if table not in blocked and ev.aggregate_id is not None and _fast_eligible(ev):
                    now.append(ev)
                else:  # the table's events after this one wait with it, so that ids follow the write order
                    blocked.add(table)
                    _defer(fl, ev)
            notifies = _event_notifies(tables)
            expire = _write(session, fl.anchor, fl.encoded, lock=[ev for ev in events if ev.aggregate_id is not None],
                            insert=now, notifies=notifies | fl.jobs, all_plain=True)  # fmt: skip
            fl.jobs.clear()
            if now:
                _now_persistent(session, now, expire)
        if jobs:
            _insert_jobs(session, fl, jobs)
    except BaseException:
        session.info.pop(_FLUSH_KEY, None)
        raise


def _insert_jobs(session: Session, fl: _Flush, jobs: list[JobMixin]) -> None:
    """Write jobs that only have enqueue's columns set with ``_enqueue``'s one-statement insert (per table, in
    the order they were added; the first statement also sends the NOTIFYs the flush has not sent), then make
    them persistent as the ORM would have (ids set, the columns the database filled in load on access)."""
    conn = session.connection(bind_arguments={"mapper": object_mapper(jobs[0])})
    seen = _Seen(session)
    plan = _plan(session, seen, notifies=fl.jobs)
    gate = plan.gate()
    by_table: dict[Table, list[JobMixin]] = {}
    for job in jobs:
        by_table.setdefault(_table_of(job), []).append(job)
    expire: dict[int, Sequence[str]] = {}
    for table, group in by_table.items():
        batch = _enqueue.Batch(default_max_attempts=type(group[0]).sa_outbox_default_max_attempts)
        known: list[set[str]] = []
        for job in group:
            d = instance_state(job).dict
            payload_text, headers_text = fl.encoded[id(job)]
            run_at, delay = d.get("run_at"), None
            if isinstance(run_at, ClauseElement):
                run_at, delay = None, d[_DELAY_ATTR]
            batch.append(d["task"], d["queue"], payload_text, d.get("priority"), d.get("max_attempts"), run_at,
                         delay, headers_text, d.get("concurrency_key"))  # fmt: skip
            given = {"task", "queue", "payload", "headers"}
            given |= {k for k in ("priority", "max_attempts", "concurrency_key") if d.get(k) is not None}
            if run_at is not None:
                given.add("run_at")
            known.append(given)
        written = _enqueue.write(conn, table, batch, channels=gate["channels"], payloads=gate["payloads"])
        gate = {"channels": [], "payloads": []}
        columns = _job_attributes(object_mapper(group[0]))
        for job, got, given in zip(group, written, known, strict=True):
            d = instance_state(job).dict
            d["id"] = got.id  # as the unit of work sets a fetched key
            # as after the ORM's INSERT: a column without a server default is NULL (known), the others load
            # from the database on first access
            loads: list[str] = []
            for key, defaulted in columns:
                if key in given:
                    continue
                if defaulted:
                    loads.append(key)
                else:
                    d.setdefault(key, None)
            expire[id(job)] = loads
    plan.record(seen)
    fl.jobs.clear()
    _now_persistent(session, cast(list[Any], jobs), expire)


def _on_add(session: Session, instance: Any) -> None:
    """An event or job added while the flush's ``before_flush`` listeners run (the application's own, after
    ours) belongs to this flush: validated now (before any of its SQL), written by :func:`_after_flush`."""
    if not _in_flush(session):  # the common case: an add outside a flush (before_flush will see it)
        return
    fl: _Flush | None = session.info.get(_FLUSH_KEY)
    if fl is None or not fl.collecting or getattr(type(instance), "sa_outbox_kind", None) is None:
        return
    if _take(fl, instance) in _EVENT_KINDS:
        _defer(fl, instance)


def _after_flush(session: Session, flush_context: Any) -> None:
    """Write the events that had to wait: new aggregates now have their keys; locks, inserts, NOTIFYs."""
    fl: _Flush | None = session.info.get(_FLUSH_KEY)
    if fl is None or fl.context is not flush_context:
        return
    fl.collecting = False
    mine = session.hash_key
    for gone in [ev for ev in fl.later if instance_state(ev).session_id != mine]:  # expunged meanwhile
        flush_context.states.pop(instance_state(gone), None)  # (nothing for the ORM to make persistent)
        fl.later.remove(gone)
    if not fl.later and not fl.jobs:
        return
    _check_references(flush_context, fl.later)
    for ev in fl.later:
        _sync_many_to_one(ev)
        _resolve_aggregate_id(ev)
    notifies = _event_notifies({_table_of(ev) for ev in fl.later})
    fl.expire = _write(
        session, fl.anchor, fl.encoded, lock=fl.later, insert=fl.later, notifies=notifies | fl.jobs
    )


def _after_flush_postexec(session: Session, flush_context: Any) -> None:
    """The events written by :func:`_after_flush` are persistent now: the columns the database filled in load
    on first access."""
    fl: _Flush | None = session.info.get(_FLUSH_KEY)
    if fl is None or fl.context is not flush_context:
        return
    del session.info[_FLUSH_KEY]
    for ev in fl.later:
        keys = fl.expire.get(id(ev))
        if keys:
            session.expire(ev, keys)
    _now_deleted(session, fl.later)


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    """Forget what a finished transaction or savepoint locked and notified (a rolled back savepoint gave its
    locks and NOTIFYs back; after a released one the parent may take them again, which is harmless), and a
    flush that failed."""
    states = session.info.get(_TX_KEY)
    if states:
        states.pop(transaction, None)
    fl: _Flush | None = session.info.get(_FLUSH_KEY)
    if fl is not None and getattr(fl.context, "transaction", None) is transaction:
        del session.info[_FLUSH_KEY]


def _flush_pending_events(session: Session, what: str) -> None:
    """Write pending ORM events before rows written another way, so that id order is write order."""
    if _in_flush(session):
        raise PayloadError(
            f"{what} cannot run inside a flush (a flush listener): its rows would be written before the "
            "flush's own events; add OutboxEvent/Job objects to the session instead"
        )
    if any(getattr(type(o), "sa_outbox_kind", None) in _EVENT_KINDS for o in session.new):
        session.flush()


def _do_orm_execute(orm_state: ORMExecuteState) -> Any:
    """``session.execute(insert(OutboxEvent | Job), rows)``: the rows are validated and normalised, the
    aggregates locked and the table announced before the statement runs, as for ``session.add``. Rows of a CDC
    table get their ids and ``tracingspancontext`` here, and in insert-then-delete mode the statement is run
    here so that its rows can be deleted right after it (its result is returned)."""
    if not (orm_state.is_insert or orm_state.is_update):
        return
    stmt: Any = orm_state.statement
    table = getattr(stmt, "table", None)
    if not isinstance(table, Table) or table.info.get("sa_outbox_kind") is None:
        return
    kind = table.info["sa_outbox_kind"]
    if orm_state.is_update:
        if kind == "cdc":  # the router streams INSERTs only: the change would never reach the broker
            raise PayloadError(
                f"UPDATE of {table.name}: CDC events are insert-only (Debezium's outbox router drops UPDATEs, and "
                "the change would never reach the broker) — write a new event instead"
            )
        return
    if stmt._values or stmt._multi_values or stmt.select is not None:
        raise PayloadError(
            f"INSERT into {table.name} with its rows inside the statement (.values() or from_select) cannot be "
            "validated and locked before it runs: pass the rows as parameters — "
            f"session.execute(insert(Model), [{{...}}, …]) — or use session.add() / emit()"
        )
    params = orm_state.parameters
    rows: list[Mapping[str, Any]] = [params] if isinstance(params, Mapping) else list(params or ())
    if not rows:
        return
    session = orm_state.session
    mapper = orm_state.bind_mapper
    model: Any = mapper.class_ if mapper is not None else None
    max_bytes = getattr(model, "sa_outbox_max_payload_bytes", 1024 * 1024)
    max_headers = getattr(model, "sa_outbox_max_headers_bytes", 8 * 1024)
    context = trace_headers()
    if kind in _EVENT_KINDS:
        checked = []
        for row in rows:
            atype, aid, etype, payload, _ = _event_values(
                table, max_bytes, row.get("aggregate_type"), row.get("aggregate_id"), row.get("event_type"),
                row.get("payload"),
            )  # fmt: skip
            values = {
                **row,
                "aggregate_type": atype,
                "aggregate_id": aid,
                "event_type": etype,
                "payload": payload,
            }
            what = functools.partial(_what_event, etype, atype, aid)
            if row.get("headers") is not None or context:
                values["headers"] = _headers_of(what, row.get("headers"), max_headers, context)[0]
            if kind == "cdc":
                values["id"] = _cdc_id(row.get("id"), what)
                if row.get("tracingspancontext") is None:
                    values["tracingspancontext"] = span_context(values.get("headers"))
            checked.append(values)
        strings = [(r["aggregate_type"], r["aggregate_id"]) for r in checked]
        notifies = list(_event_notifies([table]))
    else:
        checked = [
            _job_values(table, max_bytes, row, max_headers=max_headers, context=context) for row in rows
        ]
        strings, notifies = [], [(channel_for(table.name), r["queue"]) for r in checked]
    _flush_pending_events(session, f"INSERT into {table.name}")
    conn = session.connection(bind_arguments={"clause": stmt})
    seen = _Seen(session)
    plan = _plan(session, seen, strings=strings, notifies=notifies)
    _lock_and_notify(conn, plan.gate())
    plan.record(seen)
    orm_state.parameters = checked[0] if isinstance(params, Mapping) else checked
    own = (
        cast(Table, model.__table__) if model is not None else table
    )  # (the statement's is an annotated copy)
    if kind == "cdc" and _shape(own).delete:
        result = orm_state.invoke_statement()
        frozen = result.freeze() if stmt.returning_column_descriptions else None  # RETURNING rows, read first
        conn.execute(_delete_events(own), {"d_ids": [str(r["id"]) for r in checked]})
        return frozen() if frozen is not None else result
    return None


_LISTENERS: tuple[tuple[str, Callable[..., Any]], ...] = (
    ("before_flush", _before_flush),
    ("transient_to_pending", _on_add),
    ("after_flush", _after_flush),
    ("after_flush_postexec", _after_flush_postexec),
    ("after_transaction_end", _after_transaction_end),
    ("do_orm_execute", _do_orm_execute),
)


def _before_orm_insert(mapper: Mapper[Any], connection: Connection, target: Any) -> None:
    """Refuse the ORM's own INSERT of an event the producer deferred (it writes it in ``after_flush``): with a
    cycle in the mapper graph the unit of work saves the children of a one-to-many row by row, whatever their
    ``listonly`` flag (:class:`_Pinned`), and the event was written twice — two message ids (a hostile review).
    Raised before that INSERT; the transaction is rolled back whole."""
    if getattr(type(target), "sa_outbox_kind", None) not in _EVENT_KINDS:
        return
    session = object_session(target)
    fl: _Flush | None = None if session is None else session.info.get(_FLUSH_KEY)
    pinned = None if fl is None else fl.context.states
    if isinstance(pinned, _Pinned) and instance_state(target) in pinned.events:
        raise PayloadError(
            f"outbox event {getattr(target, 'event_type', None)!r:.80} ({type(target).__name__}) is in a cycle of "
            "relationships (the unit of work saves such rows one by one and would insert it itself, besides the "
            "producer): flush what it refers to first (session.flush()), or give its foreign key as a column"
        )


def _refuse_change_of_a_written_cdc_event(target: Any, value: Any, old: Any, initiator: Any) -> Any:
    """A CDC event is insert-only: Debezium streams the INSERT (and, insert-then-delete, the DELETE right
    behind it in the same flush), so a value set on an event already written would never reach Kafka — lost
    silently when the row was deleted at its flush, or streamed as an UPDATE the outbox router drops. Refused
    where it is set (a review found both). Not during a flush: that is the ORM's own work — nulling the
    foreign key of a kept event whose aggregate is deleted, as it does for any child row. The same refusal
    covers a change marked with ``flag_modified`` and a ``Mutable`` column's change in place
    (:func:`_refuse_mark_of_a_written_cdc_event`); a plain dict changed in place is invisible to SQLAlchemy."""
    _refuse_if_written(target, initiator.key, "setting")
    return value


def _refuse_mark_of_a_written_cdc_event(target: Any, initiator: Any) -> None:
    """``flag_modified(ev, "payload")``, or a ``MutableDict``/``MutableList`` column changed in place (it calls
    ``flag_modified`` itself): the same change as a set, refused the same way (before, a kept event's row was
    UPDATEd at the next flush and a deleted one's change was dropped, both unseen by the broker)."""
    _refuse_if_written(target, initiator.key, "changing")


def _refuse_if_written(target: Any, key: str, doing: str) -> None:
    state = instance_state(target)
    if state.key is not None and not getattr(state.session, "_flushing", False):
        raise PayloadError(
            f"CDC event {getattr(target, 'event_type', None)!r:.80} ({type(target).__name__}) was already written "
            f"(flushed): {doing} {key!r} now would never reach the broker — CDC events are insert-only; "
            "set every value before the flush, or write a new event"
        )


def _guard_cdc_columns(mapper: Mapper[Any], cls: type[Any]) -> None:
    """Once a CDC model is configured: every column attribute refuses a change after the event was written."""
    if getattr(cls, "sa_outbox_kind", None) != "cdc":
        return
    for prop in mapper.column_attrs:
        attr = getattr(cls, prop.key)
        if not event.contains(attr, "set", _refuse_change_of_a_written_cdc_event):
            event.listen(attr, "set", _refuse_change_of_a_written_cdc_event, retval=True)
        if not event.contains(attr, "modified", _refuse_mark_of_a_written_cdc_event):
            event.listen(attr, "modified", _refuse_mark_of_a_written_cdc_event)


def install() -> None:
    """Register the producer's session listeners on every ``Session`` (idempotent). The mixins call it when a
    model class that uses them is defined, so ``session.add(OutboxEvent(...))`` needs no setup call."""
    for name, fn in _LISTENERS:
        if not event.contains(Session, name, fn):
            event.listen(Session, name, fn)
    if not event.contains(Mapper, "before_insert", _before_orm_insert):
        event.listen(Mapper, "before_insert", _before_orm_insert)
    if not event.contains(Mapper, "mapper_configured", _guard_cdc_columns):
        event.listen(Mapper, "mapper_configured", _guard_cdc_columns)


# --- public functions -------------------------------------------------------------------------------------


def _sync(bind: Any) -> bool:
    return isinstance(bind, Session | Connection)


@overload
def emit(
    session: Session, model: type[OutboxMixin], events: Iterable[EmitEvent], *,
    headers: Mapping[str, str] | None = None,
) -> list[int]: ...  # fmt: skip
@overload
def emit(
    session: Session, model: type[CdcOutboxMixin], events: Iterable[EmitEvent], *,
    headers: Mapping[str, str] | None = None,
) -> list[uuid.UUID]: ...  # fmt: skip
@overload
def emit(
    session: AsyncSession, model: type[OutboxMixin], events: Iterable[EmitEvent], *,
    headers: Mapping[str, str] | None = None,
) -> Awaitable[list[int]]: ...  # fmt: skip
@overload
def emit(
    session: AsyncSession, model: type[CdcOutboxMixin], events: Iterable[EmitEvent], *,
    headers: Mapping[str, str] | None = None,
) -> Awaitable[list[uuid.UUID]]: ...  # fmt: skip
def emit(
    session: Session | AsyncSession, model: type[OutboxMixin] | type[CdcOutboxMixin], events: Iterable[EmitEvent], *,
    headers: Mapping[str, str] | None = None,
) -> list[int] | list[uuid.UUID] | Awaitable[list[int]] | Awaitable[list[uuid.UUID]]:  # fmt: skip
    """Write events ``(aggregate_type, aggregate_id, event_type, payload)`` in the session's transaction with
    one statement — no ORM objects — and return their ids in the given order (``await`` it with an
    ``AsyncSession``).

    Headers: ``headers=`` applies to every event of the call; an event may carry its own as a fifth tuple
    element ``(…, payload, {"x-tenant": "acme"})``, which win over the call's (name by name, any case). A span
    active now adds its ``traceparent``/``tracestate`` where the headers carry none.

    The same guarantees as ``session.add(OutboxEvent(...))``: validated first (:class:`PayloadError`, nothing
    written), each string aggregate's advisory lock taken once per transaction in key order, one NOTIFY per
    table and transaction, rolled back with the transaction. Events added to the session and not yet flushed
    are written first, so ids follow the order the code wrote the events. For producers that write many events
    per second.

    With a ``CdcOutboxMixin`` model the ids are the events' UUIDs, in the given order; no NOTIFY is sent, and
    in insert-then-delete mode the rows are deleted again by a second statement.
    """
    context = trace_headers()  # the span active at the call, read once for every event
    if not _sync(session):
        given = list(events)
        return cast("AsyncSession", session).run_sync(lambda s: _emit(s, model, given, headers, context))
    return _emit(cast(Session, session), model, events, headers, context)


def _emit(
    session: Session, model: type[OutboxMixin] | type[CdcOutboxMixin], events: Iterable[EmitEvent],
    common: Mapping[str, str] | None, context: Mapping[str, str],
) -> list[Any]:  # fmt: skip
    table: Table = model.__table__  # type: ignore[union-attr]
    if not _plain_table(table):
        raise PayloadError(
            f"emit() needs a table with exactly the columns of its mixin ({model.__name__}'s "
            f"OutboxMixin/CdcOutboxMixin); {table.name} has others: add the events with session.add()"
        )
    shape = _shape(table)
    spans: list[str | None] = []
    max_bytes, max_headers = model.sa_outbox_max_payload_bytes, model.sa_outbox_max_headers_bytes
    rows = []
    encoded_headers: list[str | None] = []
    for given in events:
        if not isinstance(given, tuple) or len(given) not in (4, 5):
            raise PayloadError(
                "emit() takes (aggregate_type, aggregate_id, event_type, payload[, headers]) tuples, "
                f"got {given!r:.120}"
            )
        row = _event_values(table, max_bytes, *given[:4])
        own = given[4] if len(given) == 5 else None
        merged = _merge_headers(common, own)
        plain: dict[str, str] | None = None
        if merged is not None or context:
            what = functools.partial(_what_event, row[2], row[0], row[1])
            plain, encoded = _headers_of(what, merged, max_headers, context)
            encoded_headers.append(encoded)
        else:
            encoded_headers.append(None)
        spans.append(span_context(plain) if shape.cdc else None)
        rows.append(row)
    if not rows:
        return []
    _flush_pending_events(session, "emit()")
    conn = session.connection(bind_arguments={"mapper": _mapper_of(model)})
    seen = _Seen(session)
    plan = _plan(session, seen, strings=[(r[0], cast(str, r[1])) for r in rows],
                 notifies=_event_notifies([table]))  # fmt: skip
    params: dict[str, Any] = {
        **plan.gate(),
        "f_types": [r[0] for r in rows], "f_ids": [r[1] for r in rows],
        "f_events": [r[2] for r in rows], "f_payloads": [r[4] for r in rows], "f_headers": encoded_headers,
    }  # fmt: skip
    if shape.cdc:  # the ids are made here, in the given order
        new_ids = [uuid.uuid4() for _ in rows]
        params["f_uuids"], params["f_spans"] = [str(i) for i in new_ids], spans
        run(conn, _fast_insert(table), params)
        if shape.delete:
            conn.execute(_delete_events(table), {"d_ids": params["f_uuids"]})
        plan.record(seen)
        return new_ids
    ids = sorted(r[0] for r in run(conn, _fast_insert(table), params))
    plan.record(seen)
    return ids


def _mapper_of(model: type[Any]) -> Mapper[Any]:
    from sqlalchemy import inspect as sa_inspect

    mapper: Mapper[Any] = sa_inspect(model)
    return mapper


@overload
def lock_aggregate(
    bind: Session | Connection, aggregate: Any, aggregate_id: str | int | None = None
) -> None: ...
@overload
def lock_aggregate(
    bind: AsyncSession | AsyncConnection, aggregate: Any, aggregate_id: str | int | None = None
) -> Awaitable[None]: ...
def lock_aggregate(
    bind: Session | Connection | AsyncSession | AsyncConnection,
    aggregate: Any,
    aggregate_id: str | int | None = None,
) -> Awaitable[None] | None:
    """Take, in ``bind``'s transaction, the lock the producer takes for an aggregate's events: the row lock
    (``FOR NO KEY UPDATE``) for a mapped instance — ``lock_aggregate(session, order)`` — or the advisory lock
    for a string aggregate — ``lock_aggregate(conn, "order", "7")`` (``await`` it with an async session or
    connection).

    For code that writes outbox rows another way (Core on a connection, ``bulk_save_objects``): call it first,
    in the same transaction, so that it serialises with every producer of that aggregate. Through a session,
    the lock counts as taken for the rest of the transaction. An instance the database does not hold yet
    (no key) needs no lock: nobody else can see it before this transaction commits.
    """
    if not _sync(bind):
        locked: Awaitable[None] = cast(Any, bind).run_sync(
            lambda b: lock_aggregate(b, aggregate, aggregate_id)
        )
        return locked
    sync = cast("Session | Connection", bind)
    if isinstance(aggregate, str):
        what = f"lock_aggregate({aggregate!r}, {aggregate_id!r})"
        if aggregate_id is None:
            raise PayloadError(
                f"{what}: give the aggregate_id with the aggregate_type (or a mapped instance)"
            )
        key = (
            require_text(aggregate, what, "aggregate_type"),
            require_text(aggregate_id, what, "aggregate_id"),
        )
        conn = sync.connection() if isinstance(sync, Session) else sync
        seen = _Seen(sync) if isinstance(sync, Session) else None
        if seen is None or not seen("advisory", key):
            _lock_and_notify(conn, {**_NO_GATE, "types": [key[0]], "ids": [key[1]]})
        if seen is not None:
            seen.current.advisory.add(key)
        return None
    if aggregate_id is not None:
        raise PayloadError(
            "lock_aggregate(bind, instance): the aggregate_id comes from the instance; pass none"
        )
    mapper, pk = _aggregate_identity(aggregate)
    if any(v is None for v in pk):
        return None
    conn = sync.connection(bind_arguments={"mapper": mapper}) if isinstance(sync, Session) else sync
    seen = _Seen(sync) if isinstance(sync, Session) else None
    if seen is None or not seen("rows", (mapper, pk)):
        _lock_rows(conn, {mapper: [pk]})
    if seen is not None:
        seen.current.rows.add((mapper, pk))
    return None


@overload
def enqueue(
    session: Session | AsyncSession, job_model: type[J], task: str, payload: Any, *,
    queue: str = "default", priority: int = 0, run_at: dt.datetime | Duration | None = None,
    max_attempts: int | None = None, registry: Collection[str] | None = None,
    headers: Mapping[str, str] | None = None, concurrency_key: str | None = None, unique_key: None = None,
) -> J: ...  # fmt: skip
@overload
def enqueue(
    session: Session, job_model: type[J], task: str, payload: Any, *,
    queue: str = "default", priority: int = 0, run_at: dt.datetime | Duration | None = None,
    max_attempts: int | None = None, registry: Collection[str] | None = None,
    headers: Mapping[str, str] | None = None, concurrency_key: str | None = None, unique_key: str,
    on_conflict: OnConflict = "skip",
    debounce: Duration | None = None, max_delay: Duration | None = None,
) -> Enqueued: ...  # fmt: skip
@overload
def enqueue(
    session: AsyncSession, job_model: type[J], task: str, payload: Any, *,
    queue: str = "default", priority: int = 0, run_at: dt.datetime | Duration | None = None,
    max_attempts: int | None = None, registry: Collection[str] | None = None,
    headers: Mapping[str, str] | None = None, concurrency_key: str | None = None, unique_key: str,
    on_conflict: OnConflict = "skip",
    debounce: Duration | None = None, max_delay: Duration | None = None,
) -> Awaitable[Enqueued]: ...  # fmt: skip
def enqueue(
    session: Session | AsyncSession,
    job_model: type[J],
    task: str,
    payload: Any,
    *,
    queue: str = "default",
    priority: int = 0,
    run_at: dt.datetime | Duration | None = None,
    max_attempts: int | None = None,
    registry: Collection[str] | None = None,
    headers: Mapping[str, str] | None = None,
    concurrency_key: str | None = None,
    unique_key: str | None = None,
    on_conflict: OnConflict = "skip",
    debounce: Duration | None = None,
    max_delay: Duration | None = None,
) -> J | Enqueued | Awaitable[Enqueued]:
    """Add a job to the caller's transaction: it exists only if that transaction commits.

    **Without** ``unique_key``: the job is added to ``session`` (a ``Session`` or an ``AsyncSession``; no I/O
    here) and written by the caller's next flush; the return value is that ORM object (``.id`` once flushed).

    **With** ``unique_key``: at most one job per key waits to start. The job is written at once, in the
    session's transaction, by one ``INSERT … ON CONFLICT`` (``await`` it with an ``AsyncSession``), and the
    return value is an :class:`~sa_outbox.Enqueued` with the ``id`` of the key's job and whether this call
    ``inserted`` it. When the key already has a job that has not started (queued, never claimed):

    * ``on_conflict="skip"`` (the default): nothing is written; ``.id`` is that job's;
    * ``"replace"``: its task, queue, payload, run_at, priority, max_attempts and headers become this call's;
    * ``"debounce"``: the same, and ``run_at`` becomes ``now() + debounce`` — but never later than
      ``created_at + max_delay`` (default: ten debounces), so a key under constant traffic still runs at
      least every ``max_delay``. A first call runs ``debounce`` after it.

    A running or retried job holds no key: the next enqueue of the key adds a new job (see
    ``Worker(…, unique_running=True)`` to keep them from running at the same time). Race-free across
    processes (a partial unique index decides); the key's row is locked until commit by replace/debounce.

    ``run_at`` is an aware ``datetime``, or a delay (``timedelta``/seconds) counted from the database's
    ``now()`` at insert. ``registry`` (e.g. the worker's handler mapping) refuses unknown task names here
    rather than at run time. ``headers`` (string names and values, see ``_payload.check_headers``) reach the
    handler as ``job.headers``; a span active now adds its ``traceparent``/``tracestate``.
    ``concurrency_key`` groups the job for a per-key limit (``Worker(limits={queue: Limit(n, per_key=True)})``).
    Invalid values raise :class:`PayloadError` before anything is written.
    """
    if unique_key is not None or on_conflict != "skip" or debounce is not None or max_delay is not None:
        options = {"task": task, "payload": payload, "queue": queue, "priority": priority, "run_at": run_at,
                   "max_attempts": max_attempts, "headers": headers, "concurrency_key": concurrency_key,
                   "unique_key": unique_key, "on_conflict": on_conflict, "debounce": debounce,
                   "max_delay": max_delay}  # fmt: skip
        batch = _enqueue.prepare(
            job_model, [options], context=trace_headers(), registry=registry, single=True
        )
        if not _sync(session):
            return cast("AsyncSession", session).run_sync(lambda s: _write_jobs(s, job_model, batch)[0])
        return _write_jobs(cast(Session, session), job_model, batch)[0]
    if registry is not None and task not in registry:
        raise PayloadError(
            f"job task {task!r} is not in the task registry; known tasks: {sorted(registry)!r}"
        )
    values: dict[str, Any] = {"task": task, "payload": payload, "queue": queue, "priority": priority}
    if max_attempts is not None:
        values["max_attempts"] = max_attempts
    if headers is not None:
        values["headers"] = headers
    if concurrency_key is not None:
        values["concurrency_key"] = concurrency_key  # (checked with the rest: _validate_job)
    if run_at is not None:
        if isinstance(run_at, dt.datetime):
            if run_at.tzinfo is None:
                raise PayloadError("run_at must be timezone-aware (a naive datetime is ambiguous)")
            values["run_at"] = run_at
        else:
            delay = to_timedelta(run_at, name="run_at delay")
            values["run_at"] = func.now() + delay
    job: J = cast(Any, job_model)(**values)
    if "run_at" in values and not isinstance(run_at, dt.datetime):
        setattr(job, _DELAY_ATTR, delay.total_seconds())  # the flush's one-statement insert writes it so
    _validate_job(job, trace_headers())
    session.add(job)
    return job


@overload
def enqueue_many(
    session: Session, job_model: type[JobMixin], jobs: Iterable[JobItem], *,
    registry: Collection[str] | None = None,
) -> list[int]: ...  # fmt: skip
@overload
def enqueue_many(
    session: AsyncSession, job_model: type[JobMixin], jobs: Iterable[JobItem], *,
    registry: Collection[str] | None = None,
) -> Awaitable[list[int]]: ...  # fmt: skip
def enqueue_many(
    session: Session | AsyncSession, job_model: type[JobMixin], jobs: Iterable[JobItem], *,
    registry: Collection[str] | None = None,
) -> list[int] | Awaitable[list[int]]:  # fmt: skip
    """Write many jobs in the session's transaction with one statement and return their ids in the given
    order (``await`` it with an ``AsyncSession``).

    ``jobs`` are ``(task, payload)`` tuples or mappings with ``task``, ``payload`` and any of
    :func:`enqueue`'s options (``queue``, ``priority``, ``run_at``, ``max_attempts``, ``headers``,
    ``concurrency_key``, ``unique_key``, ``on_conflict``, ``debounce``, ``max_delay``). Every item is validated before any SQL:
    one bad item raises :class:`PayloadError` naming it (``jobs[i]``) and nothing is written. Items with a
    unique key follow :func:`enqueue`'s rules and get the key's job's id (items of one key in one call share
    it; one key may not have two ``on_conflict`` rules in a call). One NOTIFY per queue and transaction; a
    span active now adds its trace context to every job's headers. Jobs added to the session and not yet
    flushed are written first, so ids follow the order the code enqueued.
    """
    batch = _enqueue.prepare(job_model, jobs, context=trace_headers(), registry=registry)
    if not _sync(session):
        return cast("AsyncSession", session).run_sync(
            lambda s: [r.id for r in _write_jobs(s, job_model, batch)]
        )
    return [r.id for r in _write_jobs(cast(Session, session), job_model, batch)]


def _write_jobs(session: Session, job_model: type[Any], batch: _enqueue.Batch) -> list[Enqueued]:
    """Write a prepared batch on the session's connection, with the NOTIFYs of its queues that this
    transaction has not sent yet."""
    if not len(batch):
        return []
    if not _in_flush(session) and any(
        getattr(type(o), "sa_outbox_kind", None) is not None for o in session.new
    ):
        session.flush()  # pending jobs/events first: ids follow the order the code wrote them
    table: Table = job_model.__table__
    conn = session.connection(bind_arguments={"mapper": _mapper_of(job_model)})
    seen = _Seen(session)
    channel = channel_for(table.name)
    plan = _plan(session, seen, notifies=[(channel, q) for q in dict.fromkeys(batch.queues)])
    gate = plan.gate()
    results = _enqueue.write(conn, table, batch, channels=gate["channels"], payloads=gate["payloads"])
    plan.record(seen)
    return results
