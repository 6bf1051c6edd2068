"""Jobs written by one statement: ``INSERT … SELECT … FROM unnest(…)``, with the unique-key conflict rules.

Used by :func:`sa_outbox.enqueue` with a ``unique_key`` (one row), :func:`sa_outbox.enqueue_many` (any number
of rows) and the scheduler (``_schedules``, its slot keys). Two steps, as in the producer:

1. **Prepare** (:func:`prepare`): every row is validated and encoded into column arrays before any SQL — a
   :class:`~sa_outbox.errors.PayloadError` names the row (``jobs[i]``) and nothing is written. Rows of one
   unique key given twice in a call become one row (the first's values for ``skip``, the last's for
   ``replace``/``debounce``); every item still gets the key's id.
2. **Write** (:func:`write`): one statement, built once per table and shape (which conflict rules and which
   optional columns the call uses) and cached, that also sends the call's NOTIFYs. It returns, per item,
   an :class:`Enqueued`: the id, and whether this call inserted the job or found the key's waiting job.

The unique key belongs to the key's job that **has not started yet** — queued and never claimed
(``lease_version = 0``): the partial unique index ``ux_<jobs>_unique`` (:data:`UNIQUE_WAITING`) is the arbiter
of ``ON CONFLICT``. A claim takes the job out of it, so a running job never blocks the key's next job, and a
retried, deferred, released or rescued job going back to ``queued`` (``lease_version ≥ 1``) never meets a
conflict: the statements that do that (finalize, rescue, operator retry) need no change and cannot fail on
the key. (River forces ``running`` into its unique states; procrastinate's lock covers only waiting jobs, so
its duplicates run at the same time — here ``Worker(…, unique_running=True)`` is the claim's own rule.)

The three rules, race-free across processes because the index decides:

* ``skip``: ``ON CONFLICT DO NOTHING`` — the waiting job's row is neither written nor locked (in a call that
  also has replace or debounce rows: locked, see :func:`statement`); its id is read
  in the same statement. When the conflicting row committed after the statement's snapshot was taken (a
  concurrent enqueue of the same key) the statement cannot see it: :func:`write` then runs again for those
  rows only (a new snapshot in READ COMMITTED).
* ``replace``: ``ON CONFLICT DO UPDATE`` of task, queue, payload, run_at, priority, max_attempts and headers.
* ``debounce``: the same, with ``run_at = least(now() + debounce, created_at + max_delay)`` — pushed by every
  call but never past the cap, so a key under constant traffic still runs at least every ``max_delay``
  (graphile-worker's debounce never fires under constant traffic). A job already past its cap stays due.

Within one statement the keyed rows are written in key order, in one ``INSERT`` (:func:`statement`), so
concurrent batches take their keys in the same order and cannot deadlock on each other.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    Connection,
    DateTime,
    Float,
    Integer,
    Table,
    Text,
    and_,
    any_,
    bindparam,
    case,
    column,
    func,
    literal_column,
    not_,
    null,
    select,
    text,
    type_coerce,
    union_all,
)
from sqlalchemy import cast as sa_cast
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql import ColumnElement

from ._durations import to_timedelta
from ._execute import run
from ._payload import (
    check_concurrency_key,
    check_headers,
    check_index_entries,
    check_int,
    check_payload,
    index_safe_chars,
    require_text,
)
from ._tracing import with_trace
from .errors import ConfigurationError, OutboxError, PayloadError

__all__ = [
    "NOTIFY_SQL",
    "ON_CONFLICT",
    "UNIQUE_ACTIVE",
    "UNIQUE_WAITING",
    "Batch",
    "Enqueued",
    "OnConflict",
    "prepare",
    "unique_waiting",
    "write",
]

#: The partial unique index's predicate: a key's job that waits for its first run (``ux_<jobs>_unique``).
UNIQUE_WAITING = "status = 'queued' AND lease_version = 0 AND unique_key IS NOT NULL"
#: The ``unique_running`` claim's index predicate (``ix_<jobs>_unique_active``): keyed jobs not finished.
UNIQUE_ACTIVE = "status IN ('queued', 'running') AND unique_key IS NOT NULL"

OnConflict = Literal["skip", "replace", "debounce"]
ON_CONFLICT: tuple[str, ...] = ("skip", "replace", "debounce")

#: The NOTIFYs of a statement, as an uncorrelated scalar subquery (evaluated once): one per (channel, payload)
#: pair the transaction has not sent yet. ``pg_notify`` is transactional — delivered at commit, dropped on
#: rollback — and PostgreSQL delivers a pair sent twice in one transaction once.
NOTIFY_SQL = """(SELECT count(*) FROM (
      SELECT pg_notify(c, p)
        FROM unnest(CAST(:channels AS text[]), CAST(:payloads AS text[])) AS n(c, p)) AS sent)"""

#: The same for a statement that writes one job: at most one NOTIFY, as two scalar parameters (NULL: none).
NOTIFY_ONE_SQL = """(SELECT count(*) FROM (
      SELECT pg_notify(CAST(:channel AS text), CAST(:payload AS text))
       WHERE CAST(:channel AS text) IS NOT NULL) AS sent)"""

_INT4 = (-(2**31), 2**31 - 1)
#: ``debounce`` without ``max_delay``: the cap is this many debounces (a key under constant traffic must
#: still run).
DEFAULT_MAX_DELAY_FACTOR = 10
_OPTIONS = frozenset(
    {"task", "payload", "queue", "priority", "run_at", "max_attempts", "headers", "concurrency_key",
     "unique_key", "on_conflict", "debounce", "max_delay"}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Enqueued:
    """What ``enqueue(…, unique_key=…)`` did: the job's ``id``, and whether this call ``inserted`` it or found
    the key's job that had not started yet (``skip``: left as it was; ``replace``/``debounce``: updated)."""

    id: int
    inserted: bool

    @property
    def found(self) -> bool:
        """The key's waiting job was there already (the opposite of :attr:`inserted`)."""
        return not self.inserted


@dataclass
class Batch:
    """Prepared rows as column arrays (one element per row to write), and where each given item went."""

    tasks: list[str] = field(default_factory=list)
    queues: list[str] = field(default_factory=list)
    payloads: list[str] = field(default_factory=list)  # JSON text
    priorities: list[int] = field(default_factory=list)
    max_attempts: list[int | None] = field(default_factory=list)
    run_ats: list[dt.datetime | None] = field(default_factory=list)
    delays: list[float | None] = field(default_factory=list)  # seconds from the database's now()
    headers: list[str | None] = field(default_factory=list)  # JSON text
    keys: list[str | None] = field(default_factory=list)
    modes: list[str] = field(default_factory=list)  # plain | skip | replace | debounce
    max_delays: list[float | None] = field(default_factory=list)  # debounce rows: seconds after created_at
    concurrency_keys: list[str | None] = field(default_factory=list)  # None: the column's default ('')
    #: For each given item, the row it was written as (items of one key share a row).
    rows_of_items: list[int] = field(default_factory=list)
    default_max_attempts: int = 10

    def __len__(self) -> int:
        return len(self.tasks)

    def append(
        self, task: str, queue: str, payload: str, priority: int | None, max_attempts: int | None,
        run_at: dt.datetime | None, delay: float | None, headers: str | None, concurrency_key: str | None = None,
    ) -> None:  # fmt: skip
        """One plain job, already validated (the flush's jobs: ``_producer._insert_jobs``)."""
        row = (task, queue, payload, priority or 0, max_attempts, run_at, delay, headers, None, "plain", None,
               concurrency_key)  # fmt: skip
        for name, value in zip(_ARRAYS, row, strict=True):
            getattr(self, name).append(value)
        self.rows_of_items.append(len(self.tasks) - 1)

    def subset(self, rows: Sequence[int]) -> Batch:
        """The given rows only (a retry of skip rows whose waiting job the first statement could not see)."""
        part = Batch(default_max_attempts=self.default_max_attempts)
        for name in _ARRAYS:
            values = getattr(self, name)
            setattr(part, name, [values[r] for r in rows])
        part.rows_of_items = list(range(len(rows)))
        return part


_ARRAYS = ("tasks", "queues", "payloads", "priorities", "max_attempts", "run_ats", "delays", "headers", "keys",
           "modes", "max_delays", "concurrency_keys")  # fmt: skip


# --- step 1: prepare ------------------------------------------------------------------------------------


def _what(index: int | None, task: Any, queue: Any) -> str:
    job = f"job {task!r:.80} on queue {queue!r:.80}"
    return job if index is None else f"jobs[{index}] ({job})"


def _seconds(value: Any, what: functools.partial[str], name: str, *, allow_zero: bool = True) -> float:
    try:
        return to_timedelta(value, name=name, allow_zero=allow_zero).total_seconds()
    except ConfigurationError as exc:
        raise PayloadError(f"{what()}: {exc}") from None


def _add(
    batch: Batch,
    table: Table,
    model: Any,
    index: int | None,
    values: Mapping[str, Any],
    context: Mapping[str, str],
    registry: Collection[str] | None,
    by_key: dict[str, tuple[int, str, int]],
) -> None:
    """Validate one job and append it to ``batch`` (or merge it into the row of its key)."""
    task, queue = values.get("task"), values.get("queue", "default")
    what = functools.partial(_what, index, task, queue)
    task = require_text(task, what, "task")
    queue = require_text("default" if queue is None else queue, what, "queue")
    if registry is not None and task not in registry:
        raise PayloadError(
            f"{what()}: job task {task!r} is not in the task registry; known tasks: {sorted(registry)!r}"
        )
    key = values.get("unique_key")
    mode = values.get("on_conflict", "skip")
    debounce, max_delay = values.get("debounce"), values.get("max_delay")
    if key is not None:
        key = require_text(key, what, "unique_key")
    if mode not in ON_CONFLICT:
        raise PayloadError(
            f"{what()}: on_conflict must be one of {', '.join(map(repr, ON_CONFLICT))}, got {mode!r}"
        )
    if key is None and (mode != "skip" or debounce is not None or max_delay is not None):
        given = (
            f"on_conflict={mode!r}"
            if mode != "skip"
            else ("debounce=" if debounce is not None else "max_delay=")
        )
        raise PayloadError(f"{what()}: {given} needs a unique_key (the key whose waiting job it acts on)")
    if mode != "debounce" and (debounce is not None or max_delay is not None):
        given = "debounce=" if debounce is not None else "max_delay="
        raise PayloadError(f"{what()}: {given} is for on_conflict='debounce', not {mode!r}")
    group = check_concurrency_key(values.get("concurrency_key"), what)
    if len(queue) + len(key or "") + len(group or "") > index_safe_chars(table):
        texts = {"task": task, "queue": queue, "unique_key": key, "concurrency_key": group}
        check_index_entries(table, {k: v for k, v in texts.items() if k in table.c}, what=what)
    priority = values.get("priority", 0)
    if priority is None:
        priority = 0
    elif type(priority) is not int or not _INT4[0] <= priority <= _INT4[1]:
        check_int(priority, what=what, name="priority", low=_INT4[0], high=_INT4[1])
    attempts = values.get("max_attempts")
    if attempts is not None:
        check_int(attempts, what=what, name="max_attempts", low=1, high=_INT4[1])
    else:
        attempts = batch.default_max_attempts  # the model's default, as Job(...) gets at flush
    run_at, delay = values.get("run_at"), None
    if mode == "debounce":
        if debounce is None:
            raise PayloadError(
                f"{what()}: on_conflict='debounce' needs debounce= (how long each call pushes run_at)"
            )
        if run_at is not None:
            raise PayloadError(
                f"{what()}: with on_conflict='debounce' the debounce decides run_at; give no run_at"
            )
        delay = _seconds(debounce, what, "debounce", allow_zero=False)
        cap = (
            delay * DEFAULT_MAX_DELAY_FACTOR if max_delay is None else _seconds(max_delay, what, "max_delay")
        )
        if cap < delay:
            raise PayloadError(f"{what()}: max_delay ({cap:g}s) must be at least the debounce ({delay:g}s)")
    else:
        cap = None
        if run_at is not None and not isinstance(run_at, dt.datetime):
            delay, run_at = _seconds(run_at, what, "run_at delay"), None
        elif run_at is not None and run_at.tzinfo is None:
            raise PayloadError(f"{what()}: run_at must be timezone-aware (a naive datetime is ambiguous)")
    _, payload = check_payload(values.get("payload"), what=what, max_bytes=model.sa_outbox_max_payload_bytes)
    given_headers = values.get("headers")
    headers_text = None
    if given_headers is not None or context:
        plain, headers_text = check_headers(
            given_headers, what=what, max_bytes=model.sa_outbox_max_headers_bytes
        )
        if context:
            merged = with_trace(plain, context)
            headers_text = json.dumps(merged, separators=(",", ":"))
    row = len(batch.tasks)
    if key is not None:
        found = by_key.get(key)
        if found is not None:
            first_row, first_mode, first_index = found
            if first_mode != mode:
                raise PayloadError(
                    f"{what()}: unique_key {key!r} is given twice with different on_conflict rules "
                    f"({first_mode!r} at jobs[{first_index}], {mode!r} here)"
                )
            batch.rows_of_items.append(first_row)
            if mode == "skip":
                return  # the first one's values are the ones a skip keeps
            row = first_row  # replace/debounce: the latest values win
        else:
            by_key[key] = (row, mode, index or 0)
    values_of_row = (task, queue, payload, priority, attempts, run_at, delay, headers_text, key,
                     mode if key is not None else "plain", cap, group)  # fmt: skip
    if row == len(batch.tasks):
        for name, value in zip(_ARRAYS, values_of_row, strict=True):
            getattr(batch, name).append(value)
        batch.rows_of_items.append(row)
    else:
        for name, value in zip(_ARRAYS, values_of_row, strict=True):
            getattr(batch, name)[row] = value


def prepare(
    model: Any,
    items: Iterable[Any],
    *,
    context: Mapping[str, str],
    registry: Collection[str] | None = None,
    single: bool = False,
) -> Batch:
    """Validate ``items`` — ``(task, payload)`` tuples or mappings of ``enqueue``'s options — into a
    :class:`Batch`, or raise :class:`PayloadError` naming the item; no I/O. ``single``: one item given as a
    mapping, named without an index (``enqueue``)."""
    table: Table = model.__table__
    batch = Batch(default_max_attempts=getattr(model, "sa_outbox_default_max_attempts", 10))
    by_key: dict[str, tuple[int, str, int]] = {}
    for i, item in enumerate(items):
        index = None if single else i
        if type(item) is tuple and len(item) == 2:
            values: Mapping[str, Any] = {"task": item[0], "payload": item[1]}
        elif isinstance(item, Mapping):
            unknown = set(item) - _OPTIONS
            if unknown:
                raise PayloadError(
                    f"jobs[{i}]: unknown option {sorted(unknown)[0]!r} (an item takes {', '.join(sorted(_OPTIONS))})"
                )
            values = item
        else:
            raise PayloadError(
                f"jobs[{i}]: enqueue_many takes (task, payload) tuples or dicts of enqueue's options, "
                f"got {item!r:.120}"
            )
        _add(batch, table, model, index, values, context, registry, by_key)
    if by_key and table.info.get("sa_outbox_partitioned") is not None:
        raise ConfigurationError(
            f"{table.fullname} is partitioned by created_at: PostgreSQL cannot keep a unique index across "
            "partitions, so unique_key (and cron schedules, whose slots are unique keys) cannot be enforced on it; "
            "enqueue without unique_key, or keep a plain jobs table for unique jobs (docs/partitioning.md)"
        )
    return batch


# --- step 2: write --------------------------------------------------------------------------------------


def unique_waiting(table: Table) -> ColumnElement[bool]:
    """:data:`UNIQUE_WAITING` as an expression on ``table`` (literal values: a generic plan still proves the
    partial index's predicate)."""
    c = table.c
    return and_(
        c.status == literal_column("'queued'", Text),
        c.lease_version == literal_column("0", BigInteger),
        c.unique_key.is_not(None),
    )


def _word(value: str) -> ColumnElement[str]:
    """A rule name inlined as a literal (the rows' mode column is compared with constants of this module)."""
    assert value in ("plain", *ON_CONFLICT)
    return literal_column(f"'{value}'", Text)


def _columns(parts: frozenset[str], optional: frozenset[str]) -> list[tuple[str, Any]]:
    names: list[tuple[str, Any]] = [("task", Text), ("queue", Text), ("payload", Text)]
    names += [(n, t) for n, t in (("priority", Integer), ("max_attempts", Integer)) if n in optional]
    if "run_at" in optional:
        names += [("run_at", DateTime(timezone=True)), ("delay", Float)]
    if "headers" in optional:
        names.append(("headers", Text))
    if "concurrency_key" in optional:
        names.append(("concurrency_key", Text))
    if parts != {"plain"}:
        names += [("unique_key", Text), ("mode", Text)]
    return names


def _source(parts: frozenset[str], optional: frozenset[str]) -> Any:
    """The rows as a table: one array parameter per column, unnested together with their order."""
    names = _columns(parts, optional)
    arrays = [bindparam(f"j_{n}", type_=ARRAY(t)) for n, t in names]
    return (
        func.unnest(*arrays)
        .table_valued(*[column(n, t) for n, t in names], with_ordinality="ord")
        .render_derived(name="u")
    )


def _one_row(optional: frozenset[str]) -> Any:
    """One plain row as a table of scalar parameters (arrays of one element cost more to send than the
    row itself: the flush of one enqueued job is the commonest write)."""
    names = _columns(frozenset({"plain"}), optional)
    # explicit casts: a parameter sent as NULL carries no type, and an untyped one here would be text
    return select(
        *[sa_cast(bindparam(f"j_{n}", type_=t), t).label(n) for n, t in names],
        literal_column("1", Integer).label("ord"),
    ).subquery("u")


def _insert(
    table: Table,
    u: Any,
    optional: frozenset[str],
    where: list[Any],
    order: list[Any],
    notify: str = NOTIFY_SQL,
) -> Any:
    """``INSERT INTO jobs (…) SELECT … FROM u WHERE … ORDER BY …`` (the NOTIFYs ride in the WHERE)."""
    c = table.c
    targets: list[Any] = [c.task, c.queue, c.payload]
    values: list[Any] = [u.c.task, u.c.queue, sa_cast(u.c.payload, JSONB)]
    if "priority" in optional:
        targets.append(c.priority)
        values.append(u.c.priority)
    if "max_attempts" in optional:
        targets.append(c.max_attempts)
        values.append(func.coalesce(u.c.max_attempts, bindparam("j_default_max_attempts", type_=Integer)))
    if "run_at" in optional:
        targets.append(c.run_at)
        later = func.now() + func.make_interval(0, 0, 0, 0, 0, 0, u.c.delay)
        values.append(func.coalesce(u.c.run_at, later, func.now()))
    if "headers" in optional:
        targets.append(c.headers)
        values.append(sa_cast(u.c.headers, JSONB))
    if "concurrency_key" in optional:
        targets.append(c.concurrency_key)
        values.append(func.coalesce(u.c.concurrency_key, literal_column("''", Text)))
    if "unique_key" in u.c:
        targets.append(c.unique_key)
        values.append(u.c.unique_key)
    gate = text(f"{notify} >= 0")
    source = select(*values).where(*where, gate).order_by(*order)
    return pg_insert(table).from_select(targets, source)


#: The key column of a plain row's RETURNING (it has none): selecting the column itself would need
#: ``SELECT (unique_key)`` of a producer that never uses unique keys (docs/production.md, least privilege).
_NO_KEY = null().cast(Text)


@functools.cache
def statement(table: Table, parts: frozenset[str], optional: frozenset[str]) -> Any:
    """The insert for one shape: which rules the rows use (``plain``, ``skip``, ``replace``, ``debounce``) and
    which optional columns they set (``priority``, ``max_attempts``, ``run_at``, ``headers``; the others take
    the column defaults). Rows come back as ``(id, unique_key, inserted)``.

    * plain rows only: one ``INSERT … RETURNING`` (ids in the given order, no ``ON CONFLICT``);
    * otherwise a data-modifying CTE for the plain and skip rows (``DO NOTHING``) and one for the replace and
      debounce rows (``DO UPDATE``) — plus, for skip rows, the waiting jobs they met, read through the unique
      index. A shape with skip rows **and** replace or debounce rows writes every keyed row in the one
      ``DO UPDATE`` (whose ``WHERE`` leaves a skip row's waiting job unwritten, though locked): each CTE takes
      its keys in key order, but two of them would take a call's keys in two runs, and two calls meeting on
      two keys deadlocked (a hostile review: 11 in 600 calls of skip/replace against replace/replace).
    """
    c = table.c
    u = _source(parts, optional)
    if parts == {"plain"}:
        # NULL, not the column: plain rows have no key, and a producer granted only SELECT (id) can run it
        return _insert(table, u, optional, [], [u.c.ord]).returning(
            c.id, _NO_KEY, literal_column("true", Boolean)
        )
    target = {"index_elements": [c.unique_key], "index_where": unique_waiting(table)}
    branches: list[Any] = []
    updates = parts & {"replace", "debounce"}
    one_pass = bool(updates) and "skip" in parts  # every keyed row in the DO UPDATE, in key order
    if parts & {"plain", "skip"} and not (one_pass and "plain" not in parts):
        mine = u.c.mode.in_([_word("plain")] if one_pass else [_word("plain"), _word("skip")])
        rows = _insert(table, u, optional, [mine], [u.c.unique_key.nulls_first(), u.c.ord])
        if "skip" in parts and not one_pass:
            rows = rows.on_conflict_do_nothing(**target)
        kept = rows.returning(c.id, c.unique_key).cte("kept")
        branches.append(select(kept.c.id, kept.c.unique_key, literal_column("true", Boolean)))
    # xmax = 0: the row version was made by this INSERT, not by its ON CONFLICT update (PostgreSQL keeps the
    # updater's lock in a new version's xmax) — the known way to tell the two apart before RETURNING OLD (PG 18);
    # tests/test_unique.py pins it, in the same transaction and across them.
    inserted = literal_column("xmax = 0", Boolean)
    if updates:
        # One upsert for the replace and the debounce rows together, in key order: two (one per rule) each
        # locked their keys in order but not together, and two calls giving two keys opposite rules took them
        # in opposite orders and deadlocked (a hostile review: 20 deadlocks in 473 calls).
        keyed = [_word("replace"), _word("debounce"), *([_word("skip")] if one_pass else [])]
        ins = _insert(table, u, optional, [u.c.mode.in_(keyed)], [u.c.unique_key])
        new = ins.excluded
        # The task and the queue too: the waiting job becomes the job this call describes (a key reused for
        # another task kept the old task with the new payload: one task's payload run by another's handler).
        values: dict[str, Any] = {"task": new.task, "queue": new.queue, "payload": new.payload,
                                  "priority": new.priority, "run_at": new.run_at, "max_attempts": new.max_attempts,
                                  "headers": new.headers}  # fmt: skip
        if "concurrency_key" in optional:
            values["concurrency_key"] = new.concurrency_key
        if "debounce" in parts:
            # Each debounce key's cap (max_delay, seconds) in one JSON object, looked up by key: a binary search
            # of the object's keys per conflicting row. Unnested and searched instead, the lookup read every
            # cap for every row: 20,000 debounce items that all met a waiting job took 41.7 s (a review).
            # (JSON text: the parameters go in plain)
            caps = _once(sa_cast(bindparam("j_caps", type_=Text), JSONB))
            key = literal_column("excluded.unique_key", Text)
            cap = func.make_interval(0, 0, 0, 0, 0, 0, sa_cast(caps[key].astext, Float))
            # A push never moves run_at earlier than the waiting job's (only the cap does): now() is the calling
            # transaction's start, and a call from a transaction that began before the previous call's pulled a
            # job due in 4.99 s to 2.97 s, inside the quiet period it was meant to wait out (a review). A replace
            # row (its key not among the caps) takes its own run_at.
            debounced = caps.has_key(key)
            values["run_at"] = case(
                (debounced, func.least(func.greatest(c.run_at, new.run_at), c.created_at + cap)),
                else_=new.run_at,
            )
        # (a skip row that met its key's waiting job: locked, not written, not returned — the waiting branch
        # below reads it, as after DO NOTHING)
        # (one binary search of a JSON object's keys per conflicting row, as the caps above: `<> ALL` of the skip
        # keys compared each row with every one of them — 20,000 mixed items that all met a waiting job, half of
        # them skip, took 4.2 s, 5,000 took 0.1 s)
        # (the skip keys' object is built in the statement from the skip keys' array the waiting branch reads)
        skip_keys = (
            func.unnest(bindparam("j_skip_keys", type_=ARRAY(Text)))
            .table_valued("key")
            .render_derived("skip_keys")
        )
        skip_set = type_coerce(
            select(func.jsonb_object_agg(skip_keys.c.key, literal_column("1", Integer))).scalar_subquery(),
            JSONB,
        )
        not_skip = not_(skip_set.has_key(literal_column("excluded.unique_key", Text))) if one_pass else None
        done = (
            ins.on_conflict_do_update(**target, set_=values, where=not_skip)
            .returning(c.id, c.unique_key, inserted.label("inserted"))
            .cte("updated")
        )
        branches.append(select(done.c.id, done.c.unique_key, done.c.inserted))
    if "skip" in parts:
        waiting = select(c.id, c.unique_key, literal_column("false", Boolean)).where(
            c.unique_key == any_(bindparam("j_skip_keys", type_=ARRAY(Text))), unique_waiting(table)
        )
        branches.append(waiting)
    return union_all(*branches) if len(branches) > 1 else branches[0]


#: From this many items a call's statement is not server-side prepared: PostgreSQL plans it for the call's own
#: arrays. A prepared statement may switch to a generic plan after five runs, which cannot see how long the
#: arrays are and compares a row with a parameter array's elements one by one (a literal array is hashed):
#: 20,000 mixed items, half of them skip, that all met a waiting job took 2.2 s a call on a generic plan
#: (the waiting jobs read through the dequeue index, each tested against 10,000 skip keys), 0.4 s planned alone.
#: Planning costs well under a millisecond against the writing of that many rows.
PLANNED_ALONE_FROM = 64


def _once(value: ColumnElement[Any]) -> Any:
    """``value`` — a cast of a parameter — computed once per statement, as an InitPlan, not per row. A prepared
    statement's generic plan (psycopg prepares a statement at its sixth run; PostgreSQL then plans it once for
    any parameter values) evaluates a cast of a parameter for every row it is used on: 4,000 debounce items
    that all met a waiting job took 5.0 s a call from then on against 0.11 s for the first five, each row
    parsing the whole JSON object of caps again."""
    return type_coerce(select(value).scalar_subquery(), value.type)


@functools.cache
def one_statement(table: Table, optional: frozenset[str]) -> Any:
    """:func:`statement` for one plain row, with scalar parameters and at most one NOTIFY."""
    c = table.c
    return _insert(table, _one_row(optional), optional, [], [], notify=NOTIFY_ONE_SQL).returning(
        c.id, _NO_KEY, literal_column("true", Boolean)
    )


def _shape(batch: Batch) -> tuple[frozenset[str], frozenset[str]]:
    parts = frozenset(batch.modes)
    optional = set()
    if any(batch.priorities):
        optional.add("priority")
    if any(a is not None for a in batch.max_attempts):
        optional.add("max_attempts")
    if any(r is not None for r in batch.run_ats) or any(d is not None for d in batch.delays):
        optional.add("run_at")
    if any(h is not None for h in batch.headers):
        optional.add("headers")
    if any(g is not None for g in batch.concurrency_keys):
        optional.add("concurrency_key")
    if parts & {"replace", "debounce"}:
        optional |= {"priority", "max_attempts", "run_at", "headers"}  # the update sets them all
    return parts, frozenset(optional)


def _params(batch: Batch, parts: frozenset[str], optional: frozenset[str]) -> dict[str, Any]:
    params: dict[str, Any] = {"j_task": batch.tasks, "j_queue": batch.queues, "j_payload": batch.payloads}
    if "priority" in optional:
        params["j_priority"] = batch.priorities
    if "max_attempts" in optional:
        params["j_max_attempts"] = batch.max_attempts
        params["j_default_max_attempts"] = batch.default_max_attempts
    if "run_at" in optional:
        params["j_run_at"] = batch.run_ats
        params["j_delay"] = batch.delays
    if "headers" in optional:
        params["j_headers"] = batch.headers
    if "concurrency_key" in optional:
        params["j_concurrency_key"] = batch.concurrency_keys
    if parts != {"plain"}:
        params["j_unique_key"] = batch.keys
        params["j_mode"] = batch.modes
    if "skip" in parts:
        params["j_skip_keys"] = [k for k, m in zip(batch.keys, batch.modes, strict=True) if m == "skip"]
    if "debounce" in parts:
        params["j_caps"] = _keys_json(
            {
                k: s
                for k, s, m in zip(batch.keys, batch.max_delays, batch.modes, strict=True)
                if m == "debounce"
            }
        )
    return params


def _keys_json(by_key: Mapping[str | None, Any]) -> str:
    """A JSON object keyed by unique keys, their characters as they are: a database that is not UTF8 refuses a
    ``\\uXXXX`` escape of a non-ASCII character in jsonb (a review: a skip key "é" beside a replace row failed
    in a SQL_ASCII database), where the key itself, sent as text, is taken."""
    return json.dumps(by_key, ensure_ascii=False, separators=(",", ":"))


#: How many times a statement runs again for skip rows whose waiting job it could not see (each time a
#: concurrent enqueue of the same key committed after the statement's snapshot); more means a hot key that
#: is being claimed as fast as it is enqueued.
_MAX_ROUNDS = 10


def write(
    conn: Connection, table: Table, batch: Batch, *, channels: Sequence[str], payloads: Sequence[str]
) -> list[Enqueued]:
    """Write ``batch`` in one statement (plus, rarely, a retry for skip rows, see the module docstring) that
    also sends the NOTIFYs ``(channels[i], payloads[i])``; per given item, what happened."""
    results: list[Enqueued | None] = [None] * len(batch)
    todo = list(range(len(batch)))
    notify = {"channels": list(channels), "payloads": list(payloads)}
    for _ in range(_MAX_ROUNDS):
        part = batch if len(todo) == len(batch) else batch.subset(todo)
        parts, optional = _shape(part)
        params = _params(part, parts, optional)
        if len(part) == 1 and parts == {"plain"} and len(notify["channels"]) <= 1:
            one = {k: v[0] for k, v in params.items() if k.startswith("j_") and isinstance(v, list)}
            one["j_default_max_attempts"] = part.default_max_attempts
            one["channel"] = notify["channels"][0] if notify["channels"] else None
            one["payload"] = notify["payloads"][0] if notify["payloads"] else None
            rows = run(conn, one_statement(table, optional), one)
        else:
            # A call of many items is planned for its own values, never by the prepared statement's generic
            # plan (see :data:`PLANNED_ALONE_FROM`).
            rows = run(
                conn,
                statement(table, parts, optional),
                {**params, **notify},
                prepare=len(part) < PLANNED_ALONE_FROM,
            )
        notify = {"channels": [], "payloads": []}
        plain_ids = sorted(r[0] for r in rows if r[1] is None)
        by_key: dict[str, Enqueued] = {}
        for row_id, key, inserted in rows:
            if key is not None and (key not in by_key or inserted):
                by_key[key] = Enqueued(int(row_id), bool(inserted))
        plain = iter(plain_ids)
        missing = []
        for local, row in enumerate(todo):
            key = part.keys[local]
            got = Enqueued(int(next(plain)), True) if key is None else by_key.get(key)
            if got is None:
                missing.append(row)
            results[row] = got
        if not missing:
            return [results[r] for r in batch.rows_of_items]  # type: ignore[misc]
        todo = missing
    raise OutboxError(
        f"enqueue: the waiting job of unique key {batch.keys[todo[0]]!r} kept being claimed before this "
        f"statement could read it ({_MAX_ROUNDS} tries); try again"
    )
