"""The write side: events and jobs exist if and only if the caller's transaction commits.

Nothing here opens a connection or commits: rows are ordinary ORM objects flushed by the caller's own
``Session``/``AsyncSession`` (``AsyncSession`` runs these same listeners inside the sync session it wraps).
A ``before_flush`` listener, registered on every ``Session`` when ``sa_outbox`` is imported, does three things
before the rows are inserted:

1. **Validates** every new event/job (payload encodable and under the size limit, required fields non-empty)
   and raises :class:`~sa_outbox.errors.PayloadError` *before any SQL runs*, so a bad flush writes nothing.
2. **Locks each aggregate once per transaction**, so that within one aggregate the outbox ``id`` order is the
   commit order (the precondition of the ordered claim, outbox document §5):

   * an event built with :meth:`OutboxMixin.for_aggregate` locks the aggregate's own row with
     ``SELECT … FOR NO KEY UPDATE`` (it does not block foreign-key inserts into child tables);
   * an event given only ``aggregate_type``/``aggregate_id`` strings takes the transaction-scoped advisory lock
     ``pg_advisory_xact_lock(hashtextextended(aggregate_type || ':' || aggregate_id, 0))``.

   **The rule:** every producer of one aggregate must serialise on the *same* lock — always build that
   aggregate's events the same way (from the instance, or from strings). Code outside this library that writes
   to the outbox takes the same lock with :func:`lock_aggregate` (or the SQL above) before its INSERT.
   Locks are taken in a sorted order within a flush, so two producers locking {A, B} cannot deadlock.
3. **Sends one NOTIFY per channel and transaction** (``pg_notify`` is transactional: it is delivered at
   commit and discarded on rollback), so idle dispatchers/workers wake up within milliseconds.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from sqlalchemy import (
    ARRAY,
    Connection,
    Table,
    Text,
    bindparam,
    column,
    event,
    func,
    insert,
    select,
    text,
    tuple_,
)
from sqlalchemy import cast as sa_cast
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapper, Session, SessionTransaction, object_mapper, object_session
from sqlalchemy.orm.base import instance_state
from sqlalchemy.orm.exc import UnmappedInstanceError

from ._durations import Duration, to_timedelta
from ._execute import run
from ._names import channel_for
from ._payload import check_payload, describe, normalize_payload
from .errors import PayloadError

__all__ = [
    "LOCK_AGGREGATES",
    "emit",
    "enqueue",
    "event_for",
    "install",
    "lock_aggregate",
]

#: ``session.info[LOCK_AGGREGATES] = False`` switches the aggregate lock off for that session (tests that show
#: why it exists use this; production code should not).
LOCK_AGGREGATES = "sa_outbox.lock_aggregates"

_AGGREGATE_ATTR = "_sa_outbox_aggregate"
_STATE_KEY = "sa_outbox.tx_state"

if TYPE_CHECKING:  # the mixins import this module (to install the hook), never the other way round
    from ._schema import JobMixin, OutboxMixin

J = TypeVar("J", bound="JobMixin")
E = TypeVar("E", bound="OutboxMixin")


# The two halves of every producer statement, written once (constant SQL, values only as bound parameters):
# the advisory locks of the flush's (type, id) pairs — de-duplicated and taken in sorted order, so producers
# locking the same set in another order cannot deadlock; the ORDER BY runs before the volatile lock function —
# and the transaction's NOTIFYs. Both are uncorrelated scalar subqueries: evaluated once per statement.
_LOCKS_SQL = """(SELECT count(*) FROM (
      SELECT pg_advisory_xact_lock(k) FROM (
          SELECT DISTINCT hashtextextended(t || ':' || i, 0) AS k
            FROM unnest(CAST(:types AS text[]), CAST(:ids AS text[])) AS u(t, i)) AS keys
       ORDER BY k) AS locked)"""
_NOTIFY_SQL = """(SELECT count(*) FROM (
      SELECT pg_notify(c, p)
        FROM unnest(CAST(:channels AS text[]), CAST(:payloads AS text[])) AS n(c, p)) AS sent)"""

#: Locks and NOTIFYs on their own (a flush with no plain events to insert, and :func:`lock_aggregate`).
_LOCK_AND_NOTIFY = text(f"SELECT {_LOCKS_SQL} AS locks, {_NOTIFY_SQL} AS notifies")


_FAST_COLUMNS = frozenset(
    {"id", "aggregate_type", "aggregate_id", "event_type", "payload", "created_at", "status", "available_at",
     "attempts", "lease_owner", "lease_until", "lease_version", "last_error", "done_at"}
)  # fmt: skip
_FAST_SET = frozenset({"aggregate_type", "aggregate_id", "event_type", "payload"})


@functools.cache
def _fast_insert(table: Table) -> Any:
    """Locks, NOTIFYs and the events of a flush in one statement (one round trip).

    ``INSERT … SELECT`` from ``unnest`` of the column arrays in their given order; the WHERE holds the lock and
    NOTIFY subqueries (evaluated once, before the first row is inserted). Used for events that set only the four event columns on a table with exactly the mixin's
    columns; anything else goes through the ORM's own INSERT.
    """
    rows = (
        func.unnest(
            bindparam("f_types", type_=ARRAY(Text)),
            bindparam("f_ids", type_=ARRAY(Text)),
            bindparam("f_events", type_=ARRAY(Text)),
            bindparam("f_payloads", type_=ARRAY(Text)),
        )
        .table_valued(
            column("t", Text), column("i", Text), column("e", Text), column("p", Text), with_ordinality="ord"
        )
        .render_derived(name="ev")
    )
    gate = text(f"{_LOCKS_SQL} >= 0 AND {_NOTIFY_SQL} >= 0")
    source = select(rows.c.t, rows.c.i, rows.c.e, sa_cast(rows.c.p, JSONB)).where(gate).order_by(rows.c.ord)
    c = table.c
    return (
        insert(table)
        .from_select([c.aggregate_type, c.aggregate_id, c.event_type, c.payload], source)
        .returning(c.id)
    )


@functools.cache
def _plain_table(table: Table) -> bool:
    """The table has exactly the mixin's columns (no user columns whose defaults the ORM would apply)."""
    return set(table.c.keys()) == _FAST_COLUMNS


def _fast_eligible(ev: OutboxMixin) -> bool:
    if not _plain_table(type(ev).__table__):  # type: ignore[attr-defined]
        return False
    return all(k in _FAST_SET or k[0] == "_" for k in instance_state(ev).dict)


def lock_aggregate(bind: Session | Connection, aggregate_type: str, aggregate_id: str) -> None:
    """Take the transaction-scoped advisory lock the producer hook takes for ``(aggregate_type, aggregate_id)``.

    For code that writes outbox rows without the ORM: call it in the same transaction before the INSERT.
    """
    params = {"types": [aggregate_type], "ids": [str(aggregate_id)], "channels": [], "payloads": []}
    bind.execute(_LOCK_AND_NOTIFY, params)


@dataclass
class _TxState:
    advisory: set[tuple[str, str]] = field(default_factory=set)
    rows: set[tuple[Any, ...]] = field(default_factory=set)
    notified: set[tuple[str, str]] = field(default_factory=set)


class _Seen:
    """What the current transaction and its parents already locked and notified (locks and NOTIFYs of a
    parent hold inside a savepoint); ``current`` is where this flush records its own."""

    __slots__ = ("chain", "current")

    def __init__(self, session: Session) -> None:
        states: dict[SessionTransaction, _TxState] = session.info.setdefault(_STATE_KEY, {})
        tx = session.get_nested_transaction() or session.get_transaction()
        chain: list[_TxState] = []
        while tx is not None:
            if tx in states or not chain:
                chain.append(states.setdefault(tx, _TxState()))
            tx = tx.parent
        self.current, self.chain = chain[0], chain

    def __call__(self, attr: str, key: Any) -> bool:
        return any(key in getattr(st, attr) for st in self.chain)


def _aggregate_identity(aggregate: Any) -> tuple[Mapper[Any], tuple[Any, ...]]:
    try:
        mapper = object_mapper(aggregate)
    except UnmappedInstanceError:
        raise PayloadError(
            f"for_aggregate() needs a mapped instance, got {type(aggregate).__name__}; "
            "pass aggregate_type= and aggregate_id= strings instead"
        ) from None
    return mapper, tuple(mapper.primary_key_from_instance(aggregate))


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
    in a session without its primary key yet makes this call flush the session first, so the id is known. At flush, the hook
    locks the aggregate's row with ``FOR NO KEY UPDATE`` (see the module docs).
    """
    mapper, pk = _aggregate_identity(aggregate)
    if any(v is None for v in pk):
        session = object_session(aggregate)
        if session is None:
            raise PayloadError(
                f"{type(aggregate).__name__} has no primary key yet and is in no session: add it to the "
                "session (or give it its key) before building its event"
            )
        session.flush()
        mapper, pk = _aggregate_identity(aggregate)
    atype = (
        aggregate_type or getattr(mapper.class_, "__outbox_aggregate_type__", None) or mapper.class_.__name__
    )
    ev: E = cast(Any, model)(
        aggregate_type=atype,
        aggregate_id=":".join(str(v) for v in pk),
        event_type=event_type,
        payload=payload,
    )
    setattr(ev, _AGGREGATE_ATTR, aggregate)
    return ev


def emit(
    session: Session,
    model: type[OutboxMixin],
    events: Iterable[tuple[str, str, str, Any]],
) -> list[int]:
    """Write events ``(aggregate_type, aggregate_id, event_type, payload)`` in the session's transaction with
    one statement — no ORM objects — and return their ids in the given order.

    The same guarantees as ``session.add(OutboxEvent(...))``: validated first (:class:`PayloadError`, nothing
    written), each string aggregate's advisory lock taken once per transaction in key order, one NOTIFY per
    table and transaction, rolled back with the transaction. For producers that write many events per second.
    """
    table: Table = model.__table__  # type: ignore[attr-defined]
    if not _plain_table(table):
        raise PayloadError(
            f"emit() needs a table with exactly the OutboxMixin columns; {table.name} has others"
        )
    rows = []
    for atype, aid, etype, payload in events:
        what = functools.partial(_what_event, etype, atype, aid)
        atype, aid, etype = (_require_text(v, what, n) for v, n in ((atype, "aggregate_type"),
                             (aid, "aggregate_id"), (etype, "event_type")))  # fmt: skip
        rows.append(
            (
                atype,
                aid,
                etype,
                check_payload(payload, what=what, max_bytes=model.sa_outbox_max_payload_bytes)[1],
            )
        )
    if not rows:
        return []
    conn = session.connection(bind_arguments={"mapper": _mapper_of(model)})
    seen = _Seen(session)
    locking = session.info.get(LOCK_AGGREGATES, True)
    adv = sorted({(r[0], r[1]) for r in rows if not seen("advisory", (r[0], r[1]))}) if locking else []
    note = (channel_for(table.name), "")
    nts = [] if seen("notified", note) else [note]
    params = {
        "types": [t for t, _ in adv], "ids": [i for _, i in adv],
        "channels": [c for c, _ in nts], "payloads": [p for _, p in nts],
        "f_types": [r[0] for r in rows], "f_ids": [r[1] for r in rows],
        "f_events": [r[2] for r in rows], "f_payloads": [r[3] for r in rows],
    }  # fmt: skip
    ids = sorted(r[0] for r in run(conn, _fast_insert(table), params))
    seen.current.advisory.update(adv)
    seen.current.notified.update(nts)
    return ids


def _mapper_of(model: type[Any]) -> Mapper[Any]:
    from sqlalchemy import inspect as sa_inspect

    mapper: Mapper[Any] = sa_inspect(model)
    return mapper


def enqueue(
    session: Session,
    job_model: type[J],
    task: str,
    payload: Any,
    *,
    queue: str = "default",
    priority: int = 0,
    run_at: dt.datetime | Duration | None = None,
    max_attempts: int | None = None,
    registry: Collection[str] | None = None,
) -> J:
    """Add a job to ``session``: it is written by the caller's next flush and exists only if that
    transaction commits.

    ``run_at`` is an aware ``datetime``, or a delay (``timedelta``/seconds) counted from the database's
    ``now()`` at insert. ``registry`` (e.g. the worker's handler mapping) refuses unknown task names here
    rather than at run time. Invalid values raise :class:`PayloadError` before anything is written.
    """
    if registry is not None and task not in registry:
        raise PayloadError(
            f"job task {task!r} is not in the task registry; known tasks: {sorted(registry)!r}"
        )
    values: dict[str, Any] = {"task": task, "payload": payload, "queue": queue, "priority": priority}
    if max_attempts is not None:
        values["max_attempts"] = max_attempts
    if run_at is not None:
        if isinstance(run_at, dt.datetime):
            if run_at.tzinfo is None:
                raise PayloadError("run_at must be timezone-aware (a naive datetime is ambiguous)")
            values["run_at"] = run_at
        else:
            values["run_at"] = func.now() + to_timedelta(run_at, name="run_at delay")
    job: J = cast(Any, job_model)(**values)
    _validate_job(job)
    session.add(job)
    return job


def _what_event(event_type: Any, aggregate_type: Any, aggregate_id: Any) -> str:
    return f"outbox event {event_type!r} for {aggregate_type!r}/{aggregate_id!r}"


def _require_text(value: Any, what: str | Callable[[], str], name: str) -> str:
    if type(value) is str and value and not value.isspace() and "\x00" not in value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise PayloadError(f"{describe(what)}: {name} must be a non-empty string, got {value!r}")
    if "\x00" in value:
        raise PayloadError(f"{describe(what)}: {name} contains a NUL character")
    return value


def _validate_event(ev: OutboxMixin) -> str:
    """Validate (and normalise) an event in place; returns its payload as JSON text."""
    # The message names the event as it was given; built only if something is wrong.
    what = functools.partial(_what_event, ev.event_type, ev.aggregate_type, ev.aggregate_id)
    for name in ("aggregate_type", "aggregate_id", "event_type"):
        value = getattr(ev, name)
        checked = _require_text(value, what, name)
        if checked is not value:
            setattr(ev, name, checked)
    payload, encoded = check_payload(ev.payload, what=what, max_bytes=type(ev).sa_outbox_max_payload_bytes)
    if payload is not ev.payload:
        ev.payload = payload
    return encoded


def _validate_job(job: JobMixin) -> None:
    what = f"job {job.task!r} on queue {job.queue!r}"
    job.task = _require_text(job.task, what, "task")
    if job.queue is None:
        job.queue = "default"
    job.queue = _require_text(job.queue, what, "queue")
    for name in ("priority", "max_attempts"):
        value = getattr(job, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise PayloadError(f"{what}: {name} must be an integer, got {value!r}")
    if job.max_attempts is not None and job.max_attempts < 1:
        raise PayloadError(f"{what}: max_attempts must be >= 1, got {job.max_attempts}")
    job.payload = normalize_payload(job.payload, what=what, max_bytes=type(job).sa_outbox_max_payload_bytes)


def _now_persistent(session: Session, table: Table, written: list[OutboxMixin], ids: list[int]) -> None:
    """Make events inserted by the one-statement path (with these ids) what the ORM makes of the rows it
    inserts itself.

    ``Session._register_persistent`` is the step the unit of work runs after its own INSERTs: identity key and
    identity map, ``pending_to_persistent`` events, and — because it records them in the transaction — the
    same rollback behaviour (a rolled back transaction or savepoint takes them out of the session, as
    ``persistent_to_transient``). It is not public API; ``tests/test_producer.py`` pins the behaviour for
    every SQLAlchemy version the package allows. The server-default columns are then expired, so they load
    from the database on first access (what the ORM does without eager defaults).
    """
    states = set()
    for ev, new_id in zip(written, ids, strict=True):
        state = instance_state(ev)
        state.dict["id"] = new_id  # as the unit of work sets a fetched key; committed just below
        states.add(state)
    session._register_persistent(states)
    defaulted = _server_defaulted(table)
    for ev in written:
        session.expire(ev, defaulted)


@functools.cache
def _server_defaulted(table: Table) -> list[str]:
    """The columns the database fills in (the key is known: it came back from the INSERT)."""
    return [
        c.name
        for c in table.c
        if c.server_default is not None and not c.primary_key and c.name not in _FAST_SET
    ]


def _table_name(obj: Any) -> str:
    name: str = object_mapper(obj).local_table.name  # type: ignore[attr-defined]
    return name


def _before_flush(session: Session, flush_context: Any, instances: Iterable[Any] | None) -> None:
    new = session.new
    events: list[OutboxMixin] = []
    jobs: list[JobMixin] = []
    for obj in new:
        kind = getattr(type(obj), "sa_outbox_kind", None)
        if kind == "outbox":
            events.append(obj)
        elif kind == "jobs":
            jobs.append(obj)
    if not events and not jobs:
        return
    # 1. Validate everything first: a refused flush has issued no SQL at all.
    encoded = {id(ev): _validate_event(ev) for ev in events}
    for job in jobs:
        _validate_job(job)

    anchor = events[0] if events else jobs[0]
    conn = session.connection(bind_arguments={"mapper": object_mapper(anchor)})  # begins the transaction
    seen = _Seen(session)
    locking = session.info.get(LOCK_AGGREGATES, True)
    advisory: set[tuple[str, str]] = set()
    rows: dict[Mapper[Any], set[tuple[Any, ...]]] = {}
    for ev in events:
        if not locking:
            break
        aggregate = getattr(ev, _AGGREGATE_ATTR, None)
        if aggregate is not None:
            mapper, pk = _aggregate_identity(aggregate)
            if aggregate in new or any(v is None for v in pk):
                continue  # not in the database yet: nobody else can lock or see it before we commit
            if not seen("rows", (mapper, pk)):
                rows.setdefault(mapper, set()).add(pk)
        else:
            key = (ev.aggregate_type, ev.aggregate_id)
            if not seen("advisory", key):
                advisory.add(key)

    notifies = {(channel_for(_table_name(ev)), "") for ev in {type(ev): ev for ev in events}.values()}
    notifies.update((channel_for(_table_name(job)), job.queue) for job in jobs)
    notifies = {n for n in notifies if not seen("notified", n)}
    fast = [ev for ev in events if _fast_eligible(ev)]
    if not advisory and not rows and not notifies and not fast:
        return

    state = seen.current
    # 2. Row locks on mapped aggregates, one statement per aggregate table, in primary-key order.
    for mapper, pks in rows.items():
        cols = list(mapper.primary_key)
        ordered = sorted(pks)
        target = tuple_(*cols) if len(cols) > 1 else cols[0]
        values: list[Any] = ordered if len(cols) > 1 else [pk[0] for pk in ordered]
        lock = (
            select(*cols)
            .where(target.in_(values))
            .order_by(*cols)
            # FOR NO KEY UPDATE: serialises producers of this aggregate, lets FK inserts into children through.
            .with_for_update(key_share=True)
        )
        conn.execute(lock)
        state.rows.update((mapper, pk) for pk in ordered)
    # 3. Advisory locks for string aggregates and the NOTIFYs — with the plain events' INSERT when there are
    # any (one round trip for the whole flush), else on their own.
    adv = sorted(advisory)
    nts = sorted(notifies)
    gate = {
        "types": [t for t, _ in adv],
        "ids": [i for _, i in adv],
        "channels": [c for c, _ in nts],
        "payloads": [p for _, p in nts],
    }
    by_table: dict[Any, list[OutboxMixin]] = {}
    for ev in fast:
        by_table.setdefault(type(ev).__table__, []).append(ev)  # type: ignore[attr-defined]
    for table, group in by_table.items():
        params = {
            **gate,
            "f_types": [ev.aggregate_type for ev in group],
            "f_ids": [ev.aggregate_id for ev in group],
            "f_events": [ev.event_type for ev in group],
            "f_payloads": [encoded[id(ev)] for ev in group],
        }
        ids = sorted(r[0] for r in run(conn, _fast_insert(table), params))
        gate = {"types": [], "ids": [], "channels": [], "payloads": []}
        _now_persistent(session, table, group, ids)
    if gate["types"] or gate["channels"]:
        conn.execute(_LOCK_AND_NOTIFY, gate)
    state.advisory.update(adv)
    state.notified.update(nts)


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    """Forget what a finished transaction or savepoint locked and notified (a rolled back savepoint gave its
    locks and NOTIFYs back; after a released one the parent may take them again, which is harmless)."""
    states = session.info.get(_STATE_KEY)
    if states:
        states.pop(transaction, None)


def install() -> None:
    """Register the flush hook on every ``Session`` (idempotent). The mixins call it when a model class that
    uses them is defined, so ``session.add(OutboxEvent(...))`` needs no setup call."""
    if not event.contains(Session, "before_flush", _before_flush):
        event.listen(Session, "before_flush", _before_flush)
        event.listen(Session, "after_transaction_end", _after_transaction_end)
