"""Every statement of the claim / lease / finalize engine, in one place, for both tables.

The outbox and the jobs table differ only in data — column names, status words, claim order, how a lease is
recorded — described by a :class:`QueueSpec`. The statements are SQLAlchemy Core expressions built once per
spec and cached (SQLAlchemy's compiled cache then reuses their SQL); values only ever travel as bound
parameters. Each statement carries a comment naming the guarantee it gives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Identity,
    Index,
    Integer,
    Interval,
    PrimaryKeyConstraint,
    Table,
    Text,
    all_,
    and_,
    any_,
    bindparam,
    case,
    column,
    exists,
    false,
    func,
    insert,
    literal,
    literal_column,
    not_,
    null,
    or_,
    select,
    table,
    text,
    true,
    tuple_,
    union_all,
    update,
)
from sqlalchemy import cast as sa_cast
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import ColumnElement, Select, Update
from sqlalchemy.sql.compiler import IdentifierPreparer
from sqlalchemy.sql.elements import ColumnClause, TextClause, conv

from .errors import SchemaError

__all__ = ["QueueSpec", "queue_table", "spec_for", "starts_table"]

# Error texts stored in last_error are cut to this many characters.
LAST_ERROR_MAX = 2000

#: How ``last_error`` starts when a NoAnswer on a row's last attempt gave that attempt back (``_steps.decide``;
#: the rescue reads it).
NO_ANSWER_PREFIX = "no answer on its last attempt"
#: How ``last_error`` starts on a row given back because its destination was unavailable, and on the rest of
#: the batch released with it (``_steps.unavailable``; ``status``, ``doctor`` and the rescue read them).
UNAVAILABLE_PREFIX = "DestinationUnavailable: "
RELEASED_UNAVAILABLE = "released: destination unavailable"


@dataclass(frozen=True, eq=False)
class QueueSpec:
    """What differs between the outbox and the jobs table; everything else is one mechanism."""

    kind: str  # "outbox" | "jobs"
    table: Table
    ready: str  # claimable state: pending | queued
    active: str  # leased state: processing | running
    done: str
    dead: str  # dead | failed
    due: Column[Any]  # available_at | run_at
    owner: Column[Any]  # lease_owner | locked_by
    finished: Column[Any]  # done_at | finished_at
    #: The outbox stores the lease's end (lease_until); jobs store its start (locked_at) and compare it with
    #: ``stale_after``. Exactly one of the two is set.
    lease_until: Column[Any] | None
    locked_at: Column[Any] | None
    finish_on_dead: bool  # jobs stamp finished_at on failed; the outbox leaves done_at for done rows only
    clear_error_on_done: bool  # the outbox clears last_error on done; jobs keep the history
    key_share: bool  # FOR NO KEY UPDATE (jobs: child tables may reference jobs) vs FOR UPDATE (outbox)
    #: The partitioned layout's period (``"day" | "week" | "month"``), or None for a plain table.
    period: str | None = None

    @property
    def c(self) -> Any:
        return self.table.c

    def claim_order(self) -> list[ColumnElement[Any]]:
        c = self.c
        if self.kind == "jobs":
            return [c.priority.desc(), c.run_at, c.id]
        # (available_at, id): exactly the ready index, so the scan stops after `batch` rows. Ordering by id
        # alone made the planner walk the primary key past every done row (129 ms vs 1.75 ms at 1M rows).
        return [c.available_at, c.id]

    def max_attempts(self) -> ColumnElement[Any]:
        """The jobs table carries max_attempts per row; the outbox takes the dispatcher's option."""
        if self.kind == "jobs":
            return self.c.max_attempts  # type: ignore[no-any-return]
        return bindparam("max_attempts", type_=Integer)

    def lease_expired(self, longer_than: ColumnElement[Any] | None = None) -> ColumnElement[bool]:
        """Leased rows whose lease ran out — ``longer_than`` (an interval) ago, when given."""
        since: ColumnElement[Any] = func.now()
        if longer_than is not None:
            since = since - longer_than
        if self.lease_until is not None:
            return and_(self.c.status == const(self.active), self.lease_until < since)
        assert self.locked_at is not None
        return and_(
            self.c.status == const(self.active),
            self.locked_at < since - sa_cast(bindparam("stale_after", type_=Interval), Interval),
        )

    def lease_values(self) -> dict[str, Any]:
        """What a claim or a heartbeat writes to record the lease (database clock only), from the moment each
        row is written — ``clock_timestamp()``, not the transaction's ``now()``: a finalize-and-claim whose
        finalize waited on a row lock (a user's transaction holding a job row) claims its rows after the wait,
        and a lease counted from the transaction's start (the statement's, in autocommit) would be short by
        the wait — born expired past stale_after, and rescued while its worker runs the job."""
        if self.lease_until is not None:
            return {
                self.lease_until.name: func.clock_timestamp()
                + sa_cast(bindparam("lease", type_=Interval), Interval)
            }
        assert self.locked_at is not None
        return {self.locked_at.name: func.clock_timestamp()}

    def lease_cleared(self) -> dict[str, Any]:
        lease_col = self.lease_until if self.lease_until is not None else self.locked_at
        assert lease_col is not None
        return {self.owner.name: None, lease_col.name: None}


_STATUS_WORDS = frozenset(
    ("pending", "processing", "done", "dead", "queued", "running", "failed", "cancelled")
)


def const(status: str) -> ColumnElement[str]:
    """A status word inlined as a SQL literal, never a bound parameter: the planner can then prove a partial
    index's ``WHERE status = '…'`` predicate even for a generic (prepared) plan. Only this module's own
    constants are accepted."""
    if status not in _STATUS_WORDS:
        raise ValueError(f"not a status word: {status!r}")
    return literal_column(f"'{status}'", Text)


_SPECS: dict[Table, QueueSpec] = {}


def spec_for(model: type[Any]) -> QueueSpec:
    """The spec of a mapped class that uses OutboxMixin or JobMixin."""
    table = getattr(model, "__table__", None)
    if not isinstance(table, Table):
        raise SchemaError(f"{model!r} is not a mapped class with a table")
    spec = _SPECS.get(table)
    if spec is not None:
        return spec
    c = table.c
    kind = getattr(model, "sa_outbox_kind", None) if isinstance(model, type) else None
    if kind == "outbox":
        spec = QueueSpec(
            kind="outbox", table=table, ready="pending", active="processing", done="done", dead="dead",
            due=c.available_at, owner=c.lease_owner, finished=c.done_at, lease_until=c.lease_until,
            locked_at=None, finish_on_dead=False, clear_error_on_done=True, key_share=False,
        )  # fmt: skip
    elif kind == "jobs":
        spec = QueueSpec(
            kind="jobs", table=table, ready="queued", active="running", done="done", dead="failed",
            due=c.run_at, owner=c.locked_by, finished=c.finished_at, lease_until=None, locked_at=c.locked_at,
            finish_on_dead=True, clear_error_on_done=False, key_share=True,
        )  # fmt: skip
    else:
        raise SchemaError(f"{getattr(model, '__name__', model)!r} does not use OutboxMixin or JobMixin")
    period = table.info.get("sa_outbox_partitioned")
    if period is not None:
        spec = replace(spec, period=str(period))
    _SPECS[table] = spec
    return spec


_TRANSLATED: dict[tuple[Table, str | None], QueueSpec] = {}


def translated_schema(conn: Any, schema: str | None) -> tuple[bool, str | None]:
    """Whether the connection's ``schema_translate_map`` (a tenant's) moves ``schema``, and where to — for
    what names a table in text (DDL, catalog lookups), which the map does not reach."""
    translate = conn.get_execution_options().get("schema_translate_map") or {}
    return (True, translate[schema]) if schema in translate else (False, schema)


def text_preparer(dialect: Dialect) -> IdentifierPreparer:
    """The dialect's identifier quoting for a name written into SQL text: DDL run through ``text()``, a name
    bound as a ``regclass``, a fix printed for a person. The connection's own preparer doubles ``%`` for the
    driver's ``format`` paramstyle and ``text()`` doubles it again, so a table named ``out%box`` reached the
    server as ``"out%%box"`` (``create_all`` failed on it); this one, of the same dialect class in the
    ``named`` paramstyle, leaves ``%`` as it is."""
    found = _TEXT_PREPARERS.get(type(dialect))
    if found is None:
        dialect_class: Any = type(dialect)
        found = _TEXT_PREPARERS[type(dialect)] = dialect_class(paramstyle="named").identifier_preparer
    return found


_TEXT_PREPARERS: dict[type[Dialect], IdentifierPreparer] = {}


def translated_spec(conn: Any, spec: QueueSpec) -> QueueSpec:
    """``spec`` with its table in the schema the connection's ``schema_translate_map`` moves it to (see
    :func:`translated_schema`); the same spec when no map applies."""
    translated, schema = translated_schema(conn, spec.table.schema)
    if not translated:
        return spec
    key = (spec.table, schema)
    found = _TRANSLATED.get(key)
    if found is None:
        from sqlalchemy import MetaData

        moved = spec.table.to_metadata(MetaData(), schema=schema)  # type: ignore[arg-type]  # None: no schema
        c = moved.c

        def col(column: Column[Any] | None) -> Any:
            return None if column is None else c[column.name]

        found = _TRANSLATED[key] = replace(
            spec, table=moved, due=col(spec.due), owner=col(spec.owner), finished=col(spec.finished),
            lease_until=col(spec.lease_until), locked_at=col(spec.locked_at),
        )  # fmt: skip
    return found


# --- claim ----------------------------------------------------------------------------------------------


def claim_returning(spec: QueueSpec, passed_over: ColumnElement[bool] | None = None) -> list[Any]:
    """What a claim hands back per row, in the order ``Message.from_row`` / ``ClaimedJob.from_row`` unpack
    (``headers`` last: NULL reads back as an empty mapping); for jobs then ``run_at`` (with ``priority`` and
    ``id``, the claim order the rows are handed over in: ``_steps._in_claim_order``); then ``age``: seconds
    since the row was written, by the database's clock at the claim (the loops' time-based decisions —
    ``give_up_after``, the grace of a task no handler knows yet — use it, never the worker's clock). An outbox
    claim hands back ``passed_over`` before ``age``: the same on every row, whether the claim took a row the
    settled form would have passed over (``passed_over``, see :func:`claim_statement`; false when not given)."""
    c = spec.c
    if spec.kind == "outbox":
        names = ["id", "lease_version", "attempts", "aggregate_type", "aggregate_id", "event_type", "payload",
                 "created_at", "headers"]  # fmt: skip
    else:
        names = ["id", "lease_version", "attempts", "max_attempts", "task", "queue", "payload", "priority",
                 "created_at", "headers"]  # fmt: skip
    age = sa_cast(func.extract("epoch", func.now() - c.created_at), Float).label("age")
    # the payload as its JSON text, decoded by ``from_row``: the driver's text decoding is C, its jsonb loader
    # Python (~1 µs less client CPU per row); the same value either way
    if spec.kind == "jobs":
        extra: list[Any] = [c.run_at]
    else:
        extra = [(false() if passed_over is None else passed_over).label("passed_over")]
    return [*(sa_cast(c[n], Text).label(n) if n == "payload" else c[n] for n in names), *extra, age]


def _keyed_probe(
    other: Any,
    equal: list[tuple[Any, Any]],
    *,
    where: list[ColumnElement[bool]],
    below: tuple[Any, Any] | None = None,
) -> Any:
    """``EXISTS`` a row of ``other`` whose leading index columns equal the candidate's values (``equal``, in the
    index's column order) and whose next column is below the candidate's (``below``), with ``where`` on top —
    written so that the one index on those columns is the only way PostgreSQL can answer it, whatever its
    statistics say.

    Planned plainly, the probes of the claims went wrong three ways, each measured (tests/test_stale_statistics.py):
    pulled up into an anti-join, a burst the statistics never saw (ANALYZE ran on a table of finished rows) made
    the inner side a read of the whole index for every candidate (3.3 s for one ordered claim of 50); as a
    subplan (``OFFSET 0``), EXISTS is planned for its first row, and when the statistics promised many matches
    (few aggregates, a backlog at ANALYZE time) it walked the primary key from id 1 (``id < candidate``) or the
    table for every candidate (23.7 s); and an equality on ``status`` let the planner prove the predicate of
    another partial index (the dequeue or running index) and walk that. So:

    * the equalities are written as two row comparisons, ``(cols) >= (values)`` and ``(cols, below) <
      (values, candidate)`` (or ``(cols) <= (values)``): the same rows, an index condition on the index's leading
      columns, but no equality for the planner to prove another index's predicate with or to answer from the
      primary key;
    * ``ORDER BY`` the index's columns: every other path must read and sort all matches, so the ordered index
      scan — which stops at the first match — is the cheapest, even for a planner that expects a match at once;
    * ``OFFSET 0`` keeps the ``ORDER BY`` (PostgreSQL drops the ORDER BY of a plain EXISTS) and keeps the probe a
      subplan, never an anti-join.
    * With ``below``, the scan runs downward from the candidate: PostgreSQL 15 ends an index scan only on a row
      comparison's first column, so upward from the key's start it read on through every later entry of the
      key (heads of 50 aggregates of 20,000 pending events: the lookups read 3,977 buffers per claim, 198 downward). Down
      from (key, candidate) it meets the nearest older row first and stops where the key ends. Without
      ``below`` (the running job of a key: the last status in the index) the scan runs upward, for the same
      reason.
    """
    cols = [col for col, _ in equal]
    values = [value for _, value in equal]
    conditions = [tuple_(*cols) >= tuple_(*values)]
    if below is not None:
        conditions.append(tuple_(*cols, below[0]) < tuple_(*values, below[1]))
        order = [col.desc() for col in (*cols, below[0])]
    else:
        conditions.append(tuple_(*cols) <= tuple_(*values))
        order = list(cols)
    return exists(
        select(literal(1))
        .select_from(other)
        .where(*conditions, *where)
        .order_by(*order)
        .offset(literal_column("0", Integer))
        # every other FROM it names is the query's around it, at any depth (the finished ids' relation is
        # several levels up: see _claim_statement)
        .correlate_except(other)
    )


#: The range of PostgreSQL's bigint: ids and positions outside it match no row, and sent, fail the statement.
BIGINT_RANGE = (-(2**63), 2**63 - 1)

_XIDS = 1 << 32  # the 32-bit xid of a row's xmax, against the 64-bit ids of pg_snapshot

#: How far past the snapshot's next xid an xmax still reads as "began after it": far more transactions than
#: any cluster starts during one claim. (A MultiXact id just ahead of the xid counter reads as live until that
#: counter passes it, which on a quiet database may be never: see :func:`_live_xmax`.)
_BEGAN_AFTER_WINDOW = 1 << 20


def _live_xmax(t: Table) -> ColumnElement[bool]:
    """Whether a row's ``xmax`` is another transaction in progress for the statement's snapshot — one listed in
    it as running, or one that began after it (another claim at work, most likely: at most
    ``_BEGAN_AFTER_WINDOW`` xids after it) — compared on 32 bits, as the column stores it.

    A MultiXact id (several lockers) is read as a plain xid, so the answer may be wrong either way. Wrong, it
    only moves a jobs claim's probe before or after the row lock, and makes an outbox claim in the settled
    form lock a row it could have passed over or pass over a row it could have taken — for as long as the id
    lies within the window ahead of the xid counter, which on a quiet database may be for good: so a
    dispatcher's claims are not all settled (:class:`sa_outbox._services.ClaimForms`, see
    :func:`claim_statement`).

    The first two tests compare ``xid`` values as they are (``xid <> 0``, ``xid = ANY(xid[])``, the snapshot's
    64-bit ids cut to 32 by ``xid(xid8)``); only a row that passes both untested reaches the one test that needs
    arithmetic, and so the text casts. Written with the casts first, a row with an xmax paid three: the test took
    190–211 ns a row against 119–125 over 200,000 rows, two of three locked by another transaction (as a claim
    with three others at work sees them)."""
    space = literal_column(str(_XIDS), BigInteger)

    def low32(xid: Any) -> Any:
        return sa_cast(sa_cast(xid, Text), BigInteger) % space

    xmax: ColumnClause[Any] = column("xmax", _selectable=t)
    snapshot = func.pg_current_snapshot()
    running = select(func.xid(func.pg_snapshot_xip(snapshot).column_valued("xip"))).scalar_subquery()
    next_xid = select(low32(func.pg_snapshot_xmax(snapshot))).scalar_subquery()
    began_after = (sa_cast(sa_cast(xmax, Text), BigInteger) - next_xid + space) % space < literal_column(
        str(_BEGAN_AFTER_WINDOW), BigInteger
    )
    # (this transaction's own xid — a row it rescued or locked before this statement — is never one: it may lie
    # past the snapshot's next xid too)
    own = select(func.xid(func.pg_current_xact_id_if_assigned())).scalar_subquery()
    return and_(
        xmax != literal_column("0", Integer),
        xmax.is_distinct_from(own),
        or_(xmax == any_(func.array(running)), began_after),
    )


def _heads_pick(
    spec: QueueSpec,
    ready: list[ColumnElement[bool]],
    limit_clause: Any,
    not_finished: Callable[[Any], list[ColumnElement[bool]]],
    marks: Sequence[Any] = (),
) -> Select[Any]:
    """The ordered claim's other form: the heads found aggregate by aggregate, not by walking the ready rows.

    The walk (the usual form) reads the ready rows in claim order and probes each one's aggregate until it has
    ``batch`` heads. When fewer heads than that exist, it reads every ready row: a backlog of 20,000 events
    of one aggregate cost ~220 ms per claim, one event each (4 events/s). This form reads, through
    ``ix_<outbox>_aggregate``, the first unfinished row (pending, processing or dead) of each aggregate id in
    turn — a recursive CTE, one index descent per aggregate — and claims those that are ready, in claim
    order. A first unfinished row is the head of its aggregate: no earlier row of its id is unfinished,
    whatever its type (of two types sharing an id, the later one's head waits for the earlier's row — order
    kept, fairness a little less). Its cost is one descent per aggregate with unfinished rows, so a dispatcher
    uses it only after a claim that found fewer heads than it asked for, and goes back to the walk after one
    that filled its batch (:class:`sa_outbox._services.ClaimForms`)."""
    t, c = spec.table, spec.c
    unfinished = [const(spec.ready), const(spec.active), const(spec.dead)]
    one = literal_column("1", Integer)
    seed = t.alias("first_unfinished")
    cols = ("aggregate_id", "id", "aggregate_type", "status")
    firsts = (
        select(*[seed.c[n] for n in cols])
        .where(seed.c.status.in_(unfinished), *not_finished(seed))
        .order_by(seed.c.aggregate_id, seed.c.id)
        .limit(one)
        .cte("firsts", recursive=True)
    )
    after = t.alias("next_unfinished")
    following = (
        select(*[after.c[n] for n in cols])
        .where(
            after.c.status.in_(unfinished), after.c.aggregate_id > firsts.c.aggregate_id, *not_finished(after)
        )
        .order_by(after.c.aggregate_id, after.c.id)
        .limit(one)
        .lateral("following")
    )
    firsts = firsts.union_all(
        select(*[following.c[n] for n in cols]).select_from(firsts.join(following, true()))
    )
    # An id whose first unfinished row is dead blocks that row's type for good, not another type sharing the
    # id: the first row of another type among the next HEADS_WINDOW unfinished rows of the id is that type's
    # head (only the dead type's rows lie between them). Beyond the window the dispatcher's walks find it.
    behind = t.alias("behind_dead")
    window = (
        select(behind.c.id, behind.c.aggregate_type)
        .where(
            behind.c.status.in_(unfinished),
            *not_finished(behind),
            tuple_(behind.c.aggregate_id) >= tuple_(firsts.c.aggregate_id),
            tuple_(behind.c.aggregate_id, behind.c.id) > tuple_(firsts.c.aggregate_id, firsts.c.id),
            tuple_(behind.c.aggregate_id) <= tuple_(firsts.c.aggregate_id),
        )
        .order_by(behind.c.aggregate_id, behind.c.id)
        .limit(literal_column(str(HEADS_WINDOW), Integer))
        .lateral("window")
    )
    other_type = (
        select(func.min(window.c.id))
        .select_from(firsts.join(window, true()))
        .where(firsts.c.status == const(spec.dead), window.c.aggregate_type != firsts.c.aggregate_type)
        .group_by(firsts.c.aggregate_id)
    )
    heads = select(firsts.c.id).union_all(other_type)
    return (
        select(c.id, *marks)
        .where(*ready, c.id == any_(func.array(heads.scalar_subquery())))
        .order_by(*spec.claim_order())
        .limit(limit_clause)
        .with_for_update(skip_locked=True, key_share=spec.key_share)
    )


def _priority_levels(spec: QueueSpec, queue: Any, suffix: str) -> Any:
    """The priorities of a queue's queued jobs, highest first: a recursive CTE, one descent of the dequeue
    index per level (``max(priority) … < previous``), computed only as far as the claim asks.

    The levels form of a jobs claim (``levels=True``) reads one level at a time, ``priority = level AND
    run_at <= now()``: an index condition on (queue, priority, run_at) that ends where the level's due jobs
    end. Read in the index's order across all levels (the usual form), ``run_at <= now()`` is a filter: a claim
    that finds fewer due jobs than its batch reads every job scheduled for later — 3.7 ms and 640 buffers per
    claim with 100,000 of them, 0.12 ms and 67 buffers level by level (PostgreSQL 15; 18's skip scan does the
    same on its own). When the due jobs fill the batch the usual form is cheaper (the levels form cost a
    quarter of a drain's speed used for every claim), so a worker takes this form only after a claim that came
    back short (:class:`sa_outbox._services.ClaimForms`-like, in ``WorkerBase``).

    Each level costs two descents, one to find it and one to read its due jobs: over a queue whose every job
    has a priority of its own, 100,000 jobs for later and three due cost 541 ms a claim read level by level,
    against 10 ms walked. So the CTE stops after ``PRIORITY_LEVELS`` levels, and the claim reads the queue's
    lower priorities as the usual form does, in the index's order (only when the levels left its batch short;
    it finds nothing when there were fewer levels)."""
    c = spec.c
    top = select(func.max(c.priority).label("priority"), literal_column("1", Integer).label("depth")).where(
        c.status == const(spec.ready), c.queue == queue
    )
    levels = top.cte(f"levels{suffix}", recursive=True)
    lower = spec.table.alias(f"lower_level{suffix}")
    below = (
        select(func.max(lower.c.priority))
        .where(
            lower.c.status == const(spec.ready), lower.c.queue == queue, lower.c.priority < levels.c.priority
        )
        .scalar_subquery()
    )
    deeper = levels.c.depth < literal_column(str(PRIORITY_LEVELS), Integer)
    return levels.union_all(
        select(below, levels.c.depth + literal_column("1", Integer)).where(
            levels.c.priority.is_not(None), deeper
        )
    )


#: How many priority levels of a queue the levels form reads one at a time (:func:`_priority_levels`) before
#: it reads the rest of the queue in the index's order.
PRIORITY_LEVELS = 16

#: How many unfinished rows behind an id's dead first row the heads form looks at for another type's head.
HEADS_WINDOW = 50

#: The columns the claim's probes read from a candidate row (see the lock-first form in :func:`claim_statement`).
_PROBED_COLUMNS = frozenset({"aggregate_type", "aggregate_id", "event_type", "unique_key"})


@cache
def claim_statement(
    spec: QueueSpec,
    *,
    ordered: bool = False,
    ordered_types: bool = False,
    limit: int | None = None,
    unique_running: bool = False,
    heads: bool = False,
    queues: int = 1,
    rooms: bool = False,
    settle: bool = True,
    levels: bool = False,
) -> Update:
    """Claim up to ``:batch`` ready rows that are due — or up to ``limit``, written into the statement: one
    statement, committed before any publish.

    * ``FOR UPDATE SKIP LOCKED`` (``FOR NO KEY UPDATE`` for jobs) inside a MATERIALIZED CTE with the LIMIT:
      concurrent claimers take disjoint rows, and the planner cannot lock more than the batch.
    * Only one state is read, through its partial index, in the index's order (no ``OR`` of two states,
      which fell to a sequential scan): expired leases are rescued by :func:`rescue_statement`.
    * The row's ownership outlives the transaction: status, owner, lease and ``lease_version + 1`` (the
      fencing token) are written; ``attempts + 1`` is counted at claim time so that a message that kills its
      worker still runs out of attempts.
    * Ordered mode (outbox): only the head of each aggregate is eligible — no earlier row of the same
      aggregate may be pending, processing or dead (dead blocks the aggregate until an operator acts). The
      test runs before the row lock; a row whose ``xmax`` is a transaction in progress for the claim's
      snapshot is passed over unlocked and untested (``settle=False`` and ``unique_running``: locked first
      and tested above the lock), so no claimer tests the rows another is taking, and none locks a blocked
      row to test it.
    * The outbox passes over, unlocked, every row whose ``xmax`` is a transaction in progress for the claim's
      snapshot: one another dispatcher is claiming or claimed after the snapshot. Locking it would lock its
      newest version (READ COMMITTED's recheck) and hold that until the claim commits, while its owner waits
      to finalize it. ``settle=False`` locks such rows as a jobs claim does (SKIP LOCKED): a MultiXact id in
      ``xmax`` can read as a transaction that began after the snapshot until the xid counter passes it, and
      only a locking claim takes such a row then (a dispatcher sends one after a claim that came back short,
      and at least once a second: :class:`sa_outbox._services.ClaimForms`).
    * A loop claims its configured batch with ``limit`` written in: the plan's estimates then match the
      real batch and PostgreSQL keeps the prepared statement's generic plan instead of planning every claim
      (planning was half of the server's CPU per claim at batch 1).
    * ``unique_running`` (jobs): a job with a unique key is eligible only while no job of its key is running
      and no older job of its key is still queued — the ordered claim's rule, per key. Both halves are
      needed: "none running" alone lets two claimers that see two queued jobs of one key in their snapshots
      take one each; the older queued job blocks the younger in every snapshot until it has run. Read
      through ``ix_<jobs>_unique_active``. Every worker of those queues must claim this way.
    * Jobs: one queue (``:queue_name``), or ``queues`` of them in strict priority (``:queue_name_0`` …): each
      queue's pick as the one-queue claim makes it, appended in that order under the batch's LIMIT, so a
      queue is read only while the queues before it left the batch short (EXPLAIN: "never executed"), and no
      row is locked beyond the batch. ``rooms``: each queue's pick also stops at ``:batch_<i>`` (a worker's
      ``shares``). One statement, one round trip, for a worker of many queues as for one.
    * ``levels`` (jobs): each queue read one priority level at a time, so that ``run_at <= now()`` bounds the
      read and jobs scheduled for later are never walked (:func:`_priority_levels`); the same rows in the same
      order. A worker takes it after a claim that came back short.
    """
    return _claim_statement(
        spec, ordered=ordered, ordered_types=ordered_types, limit=limit, unique_running=unique_running,
        heads=heads, finished=None, queues=queues, rooms=rooms, settle=settle, levels=levels,
    )  # fmt: skip


def _claim_statement(
    spec: QueueSpec,
    *,
    ordered: bool,
    ordered_types: bool,
    limit: int | None,
    unique_running: bool,
    heads: bool,
    finished: ColumnElement[Any] | None,
    queues: int = 1,
    rooms: bool = False,
    settle: bool = True,
    levels: bool = False,
) -> Update:
    """:func:`claim_statement`; ``finished``: the ids of rows this statement's own finalize has just finished
    (an array, see :func:`finalize_and_claim_statement`), which the probes then no longer count as blocking."""
    if levels and spec.kind != "jobs":
        raise ValueError("levels is a form of the jobs claim")
    if unique_running and spec.kind != "jobs":
        raise ValueError("unique_running is a jobs claim option (the outbox has ordered=True)")
    if heads and not (ordered and not ordered_types and spec.kind == "outbox" and spec.period is None):
        raise ValueError("heads is a form of the ordered outbox claim (every type ordered, not partitioned)")
    if (queues != 1 or rooms) and (spec.kind != "jobs" or queues < 1 or (rooms and queues < 2)):
        raise ValueError("queues/rooms: a jobs claim of two or more queues")
    t, c = spec.table, spec.c
    partitioned = spec.period is not None
    due: list[ColumnElement[bool]] = [c.status == const(spec.ready), spec.due <= func.now()]
    limit_clause: Any = (
        bindparam("batch", type_=Integer) if limit is None else literal_column(str(int(limit)), Integer)
    )

    # ``finished`` (an ARRAY(SELECT …) of the finalize's RETURNING) is read through a one-row relation the pick
    # is LATERAL to, not where the probes need it: written there, each probe's subplan had an InitPlan of its
    # own, evaluated on its first use. A row lock that meets a row updated since the snapshot (a producer's ON
    # CONFLICT "replace" of a queued job) rechecks the row in an EvalPlanQual copy of the executor, and
    # PostgreSQL (15.x at least) gives that copy only the parameter values already computed: had that probe not
    # run yet, the recheck read an unset parameter and the backend died of SIGSEGV, and the whole cluster
    # restarted (a hostile review: unique_running workers beside bulk "replace" enqueues, 11-21 crashes a
    # minute). A LATERAL reference is a parameter the join sets before the pick runs.
    # (OFFSET 0: not pulled up, which would put the expression back into each probe)
    fin = (
        None
        if finished is None
        else select(finished.label("ids")).offset(literal_column("0", Integer)).subquery("finished_ids")
    )

    def not_finished(other: Any) -> list[ColumnElement[bool]]:
        # A row this statement's finalize has just finished is still unfinished in the statement's snapshot.
        return [] if fin is None else [other.c.id != all_(fin.c.ids)]

    def eligible(cand: Any) -> list[ColumnElement[bool]]:
        """The probes' conditions on a candidate row (``cand``: the table's columns or the locked subquery's)."""
        found: list[ColumnElement[bool]] = []
        if ordered:
            prev = t.alias("prev")
            # The aggregate's type through texteq(), not `=` (a filter: the index has no such column). A function
            # has a fixed estimate (1/3); the planner estimates `=` with an outer value from the column's
            # distinct count, and ANALYZE of a nearly empty table (two rows, one type) stores that as a ratio
            # of the rows: on a table grown since, every type looked unique, each probe was expected to find
            # nothing, and the probes became bitmap scans of the whole aggregate, sorted
            # (tests/test_stale_statistics.py, the "emptied" shape: 33-44 ms per claim of 50 against 0.9 ms).
            # A range of one value (`>=` and `<=`, 0.5 %) fixed that but priced each probe as a long walk: the
            # claim's cost ran to 20,000, drifted with the table's size by more than PostgreSQL's planning
            # charge, and the prepared statement never kept its generic plan — every ordered claim planned
            # anew, 0.76x the plain claim's drain (tests/test_generic_plans.py). The partitioned layout's
            # plain NOT EXISTS keeps `=`, one of its anti-join's keys.
            same_type = (
                [prev.c.aggregate_type == cand.aggregate_type]
                if partitioned
                else [func.texteq(prev.c.aggregate_type, cand.aggregate_type, type_=Boolean)]
            )
            before_it = [
                *same_type,
                prev.c.status.in_([const(spec.ready), const(spec.active), const(spec.dead)]),
                *not_finished(prev),
                *(
                    [prev.c.event_type == any_(bindparam("ordered_types", type_=ARRAY(Text)))]
                    if ordered_types
                    else []
                ),
            ]
            if not partitioned:
                blocked = _keyed_probe(
                    prev,
                    [(prev.c.aggregate_id, cand.aggregate_id)],
                    below=(prev.c.id, cand.id),
                    where=before_it,
                )
            else:
                # A partitioned outbox keeps the plain NOT EXISTS (an anti-join above the merge of the
                # partitions' ready indexes): as a subplan the test sits under that merge, in every partition's
                # scan, and a partition holding only blocked rows is walked whole before the merge can return its
                # first row, each probe descending every partition's aggregate index — 2,574,218 buffers per
                # claim against 6,536 (64 day partitions, 1,000 aggregates × 20 pending). Its plan still depends
                # on the statistics.
                blocked = exists(
                    select(literal(1))
                    .select_from(prev)
                    .where(prev.c.aggregate_id == cand.aggregate_id, prev.c.id < cand.id, *before_it)
                    .correlate_except(prev)
                )
            if ordered_types:
                in_scope = cand.event_type == any_(bindparam("ordered_types", type_=ARRAY(Text)))
                found.append(or_(not_(in_scope), not_(blocked)))
            else:
                found.append(not_(blocked))
        if unique_running:
            # Two lookups of ix_<jobs>_unique_active (unique_key, status, id), each answered by its index
            # condition alone: a job of the key running (another job: without that the planner may read every
            # running job once and hash their keys), or an older one queued. One EXISTS with "running OR
            # older" let the planner OR in ix_<jobs>_running and read every running job of every key for each
            # candidate (0.18× the plain claim with 40 jobs running), and a key's blocked candidates each walked
            # all of the key's jobs.
            def unfinished(other: Any) -> list[ColumnElement[bool]]:
                # (ix_<jobs>_unique_active's predicate, for the planner to prove)
                return [
                    other.c.unique_key.is_not(None),
                    other.c.status.in_([const(spec.ready), const(spec.active)]),
                ]

            mine, older = t.alias("running_same_key"), t.alias("older_same_key")
            running = _keyed_probe(
                mine,
                [(mine.c.unique_key, cand.unique_key), (mine.c.status, const(spec.active))],
                where=[*unfinished(mine), mine.c.id != cand.id, *not_finished(mine)],
            )
            waiting = _keyed_probe(
                older,
                [(older.c.unique_key, cand.unique_key), (older.c.status, const(spec.ready))],
                below=(older.c.id, cand.id),
                where=unfinished(older),
            )
            found.append(or_(cand.unique_key.is_(None), and_(not_(running), not_(waiting))))
        return found

    # The outbox claims only rows whose xmax is no transaction in progress for its snapshot (`_live_xmax`): such a
    # row is being claimed by another dispatcher, or was claimed by one that committed after this statement's
    # snapshot. SKIP LOCKED passes over the first kind, but on the second the row lock follows the update to
    # the row's newest version, locks it and only then finds it no longer pending (READ COMMITTED's recheck):
    # skipped, but held until this claim commits — and the dispatcher that owns it waits on that lock to
    # finalize it. Four dispatchers draining 20,000 events spent 28 % of their backends' active time in that
    # wait (pg_stat_activity sampled every 2 ms: Lock transactionid, a finalize blocked by another's claim),
    # plain and ordered alike; none with this test. Jobs keep locking such
    # rows: FOR NO KEY UPDATE shares a row with the KEY SHARE of a transaction inserting a row that references
    # the job, which this test would hold the job back for, and the workers measured no such wait.
    # Written as "CASE WHEN live THEN NULL ELSE 1 END IS NOT NULL" for the planner's sake: it has no statistics
    # on xmax and took NOT live for a third of the rows (the negated window test, a default inequality), and
    # with such an estimate and a nearly empty table's statistics it chose to sort the rows of another index
    # (doctor's "claim plan" check failed); a test for NULL on an expression counts as 99.5 %.
    settled = (
        [case((_live_xmax(t), null()), else_=literal_column("1", Integer)).is_not(None)]
        if spec.kind == "outbox" and settle
        else []
    )
    # The locking form marks each row it picks whose xmax the settled form would have passed over, read at the
    # scan; the claim hands back whether it took any (`passed_over`). A dispatcher then locks on its next claim
    # too: rows with a MultiXact xmax that reads as live are all taken at the claims' pace, not a batch of them
    # per `walk_every` (a hostile review: 300 such rows behind newer ones waited up to 27.6 s, batch 10).
    marks: list[Any] = [_live_xmax(t).label("passed_over")] if spec.kind == "outbox" and not settle else []

    def pick(queue: Any, limit_clause: Any, suffix: str = "") -> Select[Any]:
        """The rows of one queue (``queue``: its name's parameter; None for the outbox) to claim, locked, in the
        claim order, up to ``limit_clause``; with ``levels``, the queue's first priority levels one at a time,
        then the rest of it (:func:`_priority_levels`)."""
        if queue is None:
            return locked(due, None, limit_clause, suffix)
        if not levels:
            return locked([*due, c.queue == queue], None, limit_clause, suffix)
        level = _priority_levels(spec, queue, suffix)
        by_level = locked(
            [*due, c.queue == queue, c.priority == level.c.priority], level, limit_clause, suffix
        )
        floor = select(func.min(level.c.priority)).scalar_subquery()
        rest = locked([*due, c.queue == queue, c.priority < floor], None, limit_clause, f"{suffix}_rest")
        first, then = by_level.subquery(f"by_level{suffix}"), rest.subquery(f"below_levels{suffix}")
        both = union_all(select(*first.c), select(*then.c)).subquery(f"levels_then_rest{suffix}")
        return select(*both.c).limit(limit_clause)

    def locked(ready: list[ColumnElement[bool]], level: Any, limit_clause: Any, suffix: str) -> Select[Any]:
        """The pick of the rows ``ready`` selects, locked, in the claim order, up to ``limit_clause``; for each
        row of ``level`` (a lateral pick per priority level) when it is given."""
        if heads:
            return _heads_pick(spec, [*ready, *settled], limit_clause, not_finished, marks)
        if (ordered or unique_running) and not partitioned:
            # The probes run before the row lock on a row whose xmax is no transaction in progress for the claim's
            # snapshot, after the lock on any other. Run before the lock (the plain form), every claimer probed the
            # rows the others were claiming and those claimed since its snapshot, only to skip them at the lock:
            # 68,530 probes for 20,000 events with 4 dispatchers, 20,000 with one. Run after the lock on every row,
            # the claim locked each blocked row it walked past — a heap write and a WAL record each, for every claim
            # walking a backlog (10,000 per claim of 10 heads over 10 aggregates). Run after the lock on every row
            # with an xmax, it did so for each blocked row some transaction had ever locked or updated (a foreign
            # key's KEY SHARE; a jobs row an ON CONFLICT "replace" wrote, whose new version carries the updater's
            # xid), and left its own xid there, for the next claim to lock again: 2,040 WAL records per claim
            # against 40 with 2,000 replaced jobs waiting behind their keys' running jobs. A row with a live xmax is
            # locked first (SKIP LOCKED) and probed above the lock, in the subquery's caller; a row locked and then
            # turned down stays locked until the claim commits, and is not counted in the batch (the LIMIT is
            # above the probes). The outbox passes over such a row instead (`settled`): nothing but a claim
            # locks its rows, and a row another claim holds or has just taken is not the next head anyway.
            #
            # The filter skips the probe when it reads a live xmax; the caller skips it when "untouched" — xmax = 0,
            # read again when the row is projected — is true. xmax is not part of the row version: a locker writes
            # it in place, on the page the scan has pinned, between the two reads (a second KEY SHARE turns a live
            # xid into a MultiXact id, which reads as not live). So "untouched" is not the filter's test read again
            # — that let a row through untested (a reviewer's script: 123 jobs of running keys claimed in 60 s) —
            # but xmax = 0, which holds at the second read only if it held at the first: a locker sets xmax in
            # place, only freezing clears it (VACUUM's, also for a MultiXact whose lockers have all finished), and
            # freezing needs the page with no other pin — the scan holds one from the filter to the projection. A
            # row the filter probed may be probed again above the lock (a head whose xmax a finished transaction
            # left); no row is returned unprobed. (A MultiXact id compares as an xid: see `_live_xmax`.)
            untouched = column("xmax", _selectable=t) == literal_column("0", Integer)
            unlocked = [*settled, *eligible(c)] if settled else [or_(_live_xmax(t), and_(*eligible(c)))]
            walked = (
                select(
                    c.id,
                    untouched.label("untouched"),
                    *marks,
                    *[col for col in c if col.name in _PROBED_COLUMNS],
                )
                .where(*ready, *unlocked)
                .order_by(*spec.claim_order())
                # (a subquery with OFFSET is never merged into the query around it, nor given its conditions)
                .offset(literal_column("0", Integer))
                .with_for_update(skip_locked=True, key_share=spec.key_share)
            )
            # (per level, the level's priority comes from the levels the lateral pick around it is joined to)
            candidate = (
                walked.subquery(f"candidate{suffix}")
                if level is None
                else walked.correlate(level).lateral(f"candidate{suffix}")
            )
            # No ORDER BY here: the locked rows come up in the claim order, and an ORDER BY at this level would make
            # PostgreSQL plan the subquery for reading every ready row (it passes the LIMIT down only to a query
            # with nothing to sort, join or group). Per priority level, the same query is the lateral pick of each
            # level, so that its LIMIT is right above the candidates (joined to the levels, the candidates were
            # planned for every ready row of a level: a sort of them all, a bitmap scan).
            above = (
                select(candidate.c.id, *[candidate.c[m.name] for m in marks])
                .where(or_(candidate.c.untouched, and_(*eligible(candidate.c))))
                .limit(limit_clause)
            )
            return per_level(above, level, limit_clause, suffix)
        # The partitioned layout also picks each row's created_at: the UPDATE below then prunes, at run time,
        # to the partitions between the oldest and the newest picked row (EXPLAIN ANALYZE: "Subplans
        # Removed"), instead of probing the primary key of every partition for every id.
        plain = (
            select(c.id, *([c.created_at] if partitioned else []), *marks)
            .where(*ready, *eligible(c), *settled)
            .order_by(*spec.claim_order())
            .limit(limit_clause)
            .with_for_update(skip_locked=True, key_share=spec.key_share)
        )
        return per_level(plain, level, limit_clause, suffix)

    def per_level(one: Select[Any], level: Any, limit_clause: Any, suffix: str) -> Select[Any]:
        """``one`` as it is, or — given the priority levels — as the lateral pick of each level, in their order."""
        if level is None:
            return one
        each = one.lateral(f"level_pick{suffix}")
        return select(*each.c).select_from(level.join(each, true())).limit(limit_clause)

    picked: Select[Any]
    if queues == 1:
        picked = pick(bindparam("queue_name", type_=Text) if spec.kind == "jobs" else None, limit_clause)
    else:
        # Strict priority in one statement: the queues' picks appended in order under the batch's LIMIT. A pick
        # is a subquery (FOR UPDATE is not allowed in a UNION's own branches); the Append asks a queue's pick
        # for rows only while those before it left the batch short, and a locking pick locks only the rows
        # it is asked for.
        branches = []
        for i in range(queues):
            queue_limit = bindparam(f"batch_{i}", type_=Integer) if rooms else limit_clause
            one = pick(bindparam(f"queue_name_{i}", type_=Text), queue_limit, f"_{i}")
            branch = one.subquery(f"queue_{i}")
            branches.append(select(*branch.c))
        appended = union_all(*branches).subquery("queues")
        picked = select(*appended.c).limit(limit_clause)
    if fin is not None:
        after_finish = picked.lateral("after_finish")
        picked = select(*after_finish.c).select_from(fin.join(after_finish, true()))
    cte = picked.cte("picked").prefix_with("MATERIALIZED")
    values: dict[str, Any] = {
        "status": const(spec.active),
        spec.owner.name: bindparam("owner", type_=Text),
        "lease_version": c.lease_version + 1,
        "attempts": c.attempts + 1,
        **spec.lease_values(),
    }
    # id = ANY(ARRAY(SELECT id FROM picked)): an InitPlan run once, then primary-key lookups. Joining the CTE
    # instead (UPDATE … FROM picked) lets a generic plan — the prepared statement's, after five runs — hash
    # the whole table when it cannot see :batch (tests/test_generic_plans.py).
    where = [c.id == any_(func.array(select(cte.c.id).scalar_subquery()))]
    if partitioned:
        # The picked rows' created_at range, two InitPlans: PostgreSQL prunes partitions at run time on a
        # comparison with a parameter (not on "= ANY(array)"). Only a bound: id picks the rows.
        where += [
            c.created_at >= select(func.min(cte.c.created_at)).scalar_subquery(),
            c.created_at <= select(func.max(cte.c.created_at)).scalar_subquery(),
        ]
    passed_over = (
        select(func.coalesce(func.bool_or(cte.c.passed_over), false())).scalar_subquery() if marks else None
    )
    return update(t).where(*where).values(values).returning(*claim_returning(spec, passed_over))


# --- rescue (reap) --------------------------------------------------------------------------------------


@cache
def columns_statement(spec: QueueSpec) -> Select[Any]:
    """Every column of the model's table, no row: a loop's first step runs it, so that a table behind the code
    (a column the finalize or a later step needs, the claim not) stops the loop before its first claim — a
    review: a worker on an older table claimed a job, then failed on its finalize, and each restart left one
    more job running, its attempt spent, until its lease ran out."""
    return select(*spec.table.c).where(false())


def table_identity_statement() -> TextClause:
    """The database, and the table ``:name`` (a qualified or bare name) resolves to there (its oid, NULL for
    none): two connections that agree reach the same table — a worker's direct heartbeat connection checks
    itself against the loop's pooled one with it."""
    return text("SELECT current_database(), to_regclass(:name)::oid::bigint")


@cache
def rescue_statement(spec: QueueSpec) -> Update:
    """Rescue up to ``:limit`` leased rows whose lease expired (their worker crashed or hung).

    With attempts left they go back to the ready state, immediately claimable (their ``lease_version`` is
    kept; the next claim increments it, so the crashed worker's late finalize matches nothing). Rows that
    have used up their attempts become dead/failed — the poison-message rule: a message that kills every
    worker never reaches a finalize, so it must be stopped here. A job whose cancellation was requested
    becomes ``cancelled`` (its worker died before it could stop it: it must not run again). The reason is
    appended to ``last_error``. Many workers may run this at once: SKIP LOCKED gives each its own rows.
    A job whose heartbeat holds its lease guard (:func:`guard_statement`) is left alone, expired or not.
    The leases the loop running the statement holds (``:kept_ids``, ``:kept_versions``) are left alone too:
    its own expired lease on a batch published and not yet finalized (the database was out of reach for longer than the lease), or on
    a job it runs whose renewals fail — rescued, the very loop holding it would publish or run it again (a
    test: three of six messages twice after a 4 s outage with a 2 s lease). A row leased in its name that it
    does not know of (a claim whose answer was lost with its connection), or a newer lease of a row it holds
    (another loop's, who took the row over and died), is rescued as any other. ``:expired_for``: only leases
    expired for longer than that (after a database fault or run()'s start, see
    ``LoopBase._rescue_margin``; else zero).
    """
    t, c = spec.table, spec.c
    order_col = spec.lease_until if spec.lease_until is not None else spec.locked_at
    assert order_col is not None
    kept = _unnested("kept", ("kept_ids", "id", BigInteger), ("kept_versions", "version", BigInteger))
    expired = [
        spec.lease_expired(longer_than=sa_cast(bindparam("expired_for", type_=Interval), Interval)),
        ~exists().where(kept.c.id == c.id, kept.c.version == c.lease_version),
    ]
    if spec.kind == "jobs":  # (only workers beat; a dispatcher's lease is a budget, never guarded)
        expired.append(tuple_(_tableoid, c.id % _GUARD_IDS).not_in(_guarded_keys()))
    victims = (
        select(c.id)
        .where(*expired)
        .order_by(order_col)
        .limit(bindparam("limit", type_=Integer))
        .with_for_update(skip_locked=True, key_share=spec.key_share)
        .scalar_subquery()
    )
    # A row whose last outcome gave its last attempt back for want of an answer (NoAnswer: see
    # ``_steps.decide``) sits at its last attempt at every claim while the stall lasts: a crash then is not
    # the poison rule's "kills every worker" (a hostile review: kill -9 during a write pause sent such a row,
    # already on the broker six times, to dead and blocked its aggregate). So does a row whose last outcome
    # was an outage's refund (DestinationUnavailable, or its batch released for one): a stall's refund, then
    # the outage's, then a kill -9 during the circuit's probe sent it to dead (a hostile review, stop 60). It
    # goes back once; a second crash in a row — the rescue's reason is appended to last_error — is the poison
    # rule again.
    refunded = and_(
        or_(
            *(
                c.last_error.startswith(marker, autoescape=True)
                for marker in (NO_ANSWER_PREFIX, UNAVAILABLE_PREFIX, RELEASED_UNAVAILABLE)
            )
        ),
        c.last_error.not_like("%lease expired (owner %"),
    )
    exhausted = and_(c.attempts >= spec.max_attempts(), not_(func.coalesce(refunded, false())))
    reason = func.concat(
        "lease expired (owner ",
        func.coalesce(spec.owner, "?"),
        ", lease_version ",
        c.lease_version,
        ")",
        case((exhausted, " after max attempts (worker crash?)"), else_=""),
    )
    status = case((exhausted, const(spec.dead)), else_=const(spec.ready))
    if spec.kind == "jobs":
        cancel = c.cancel_requested_at.is_not(None)
        status = case((cancel, const("cancelled")), (exhausted, const(spec.dead)), else_=const(spec.ready))
        reason = func.concat(reason, case((cancel, "; its cancellation was requested"), else_=""))
    values: dict[str, Any] = {
        "status": status,
        "last_error": func.right(func.concat_ws("\n", c.last_error, reason), LAST_ERROR_MAX),
        **spec.lease_cleared(),
    }
    if spec.finish_on_dead:
        values[spec.finished.name] = case(
            (status.in_([const(spec.dead), const("cancelled")]), func.now()), else_=None
        )
    return (
        update(t)
        .where(c.id == any_(func.array(victims)))  # see claim_statement: safe under a generic plan
        .values(values)
        .returning(c.id, c.status, c.lease_version)
    )


# --- finalize -------------------------------------------------------------------------------------------


def _unnested(name: str, *columns: tuple[str, str, Any], ordinality: str | None = None) -> Any:
    """Array parameters unnested together into rows: ``columns`` are (parameter, column, type) — one bound
    array per column, element ``i`` of each making row ``i`` (``ordinality``: a column of the row numbers)."""
    return (
        func.unnest(*[bindparam(param, type_=ARRAY(kind)) for param, _, kind in columns])
        .table_valued(*[column(col, kind) for _, col, kind in columns], with_ordinality=ordinality)
        .render_derived(name=name)
    )


def _outcome_rows(spec: QueueSpec, *, single: bool = False) -> Any:
    """The batch's outcomes as rows (one array per column, unnested together); jobs also carry each
    handler's result as JSON text. ``single``: one outcome, each column a plain parameter (``o_id``,
    ``o_version``, …), which PostgreSQL folds into the statement — no function scan, no join: a finalize of
    one row cost 275 µs of server CPU per job instead of 337 (one worker's statement at batch 1, pgbench,
    4 clients, commit included), and finds its row by ``id = $1``."""
    names = ["id", "version", "status", "delay", "error", "refund"]
    types: list[Any] = [BigInteger, BigInteger, Text, Float, Text, Integer]
    if spec.kind == "jobs":
        names.append("result")
        types.append(Text)
    if single:
        # (cast: a NULL sent untyped would otherwise be text in the subquery's output)
        return select(
            *[
                sa_cast(bindparam(f"o_{name}", type_=kind), kind).label(name)
                for name, kind in zip(names, types, strict=True)
            ]
        ).subquery("outcome")
    return _unnested(
        "outcome", *[(_ARRAY_NAMES[name], name, kind) for name, kind in zip(names, types, strict=True)]
    )


#: The array parameter of each outcome column (:func:`_outcome_rows`).
_ARRAY_NAMES = {
    "id": "ids",
    "version": "versions",
    "status": "statuses",
    "delay": "delays",
    "error": "errors",
    "refund": "refunds",
    "result": "results",
}


def _ids_initplan() -> Any:
    """``:ids`` through an InitPlan, a value the planner cannot see (why: :func:`_fenced`)."""
    return sa_cast(select(bindparam("ids", type_=ARRAY(BigInteger))).scalar_subquery(), ARRAY(BigInteger))


def _fenced(
    spec: QueueSpec, ids: ColumnElement[Any], versions: ColumnElement[Any], *, single: bool = False
) -> list[ColumnElement[bool]]:
    """The rows a finalize/heartbeat may touch: still leased, with the caller's lease version.

    Written for the plan the loops actually run — the prepared statement's generic plan:

    * found by primary key, ``id = ANY(:ids)``, the only restriction an index can serve. The leased state is
      compared with a value the planner cannot see (an InitPlan), so it never walks the leased-rows index
      and matches every leased row against every outcome: with statistics taken while few rows were leased,
      a generic plan did that — 10,000 comparisons for a batch of 50 beside 150 other leased rows;
    * ``:ids`` also goes through an InitPlan, so a custom plan cannot see the array's length either: the
      generic and the custom plan then cost the same and PostgreSQL keeps the generic one. A custom plan that
      saw one id looked cheaper than the generic plan's default guess of ten, and every claim at batch 1 was
      planned again (half of the server's CPU per job).
    * ``single`` (one outcome, ``ids`` a parameter): ``id = $1`` alone, one row by the primary key in every
      plan, generic or custom.
    """
    c = spec.c
    found_by_id = [c.id == ids] if single else [c.id == any_(_ids_initplan()), c.id == ids]
    return [
        *found_by_id,
        c.lease_version == versions,
        c.status == select(const(spec.active)).scalar_subquery(),
    ]


@cache
def finalize_statement(spec: QueueSpec, *, single: bool = False, with_status: bool = False) -> Update:
    """Apply a whole batch of outcomes in one statement, each row fenced by its own lease version
    (``single``: exactly one outcome, its columns as plain parameters — see :func:`_outcome_rows`).

    ``WHERE id = outcome.id AND status = <active> AND lease_version = outcome.version``: lease_version is the
    fencing token — a worker whose lease was rescued/re-claimed updates 0 rows for that message (RETURNING
    tells which ids were applied; the others are lost leases). A lease that expired but that nobody rescued
    or re-claimed still finalizes: correctness rests on the version, not on the clock.

    Outcome columns: new status; delay in seconds from the database's now() for the next attempt (NULL keeps
    the due time); error text (NULL keeps the previous one; done clears it on the outbox); refund (1 gives the claim's
    attempt back: Defer and release); for jobs, the handler's result (JSON text, stored with ``done``).
    Returns each applied row's id (``with_status``: and its new status).
    """
    t, c = spec.table, spec.c
    o = _outcome_rows(spec, single=single)
    finished_when = [(o.c.status == spec.done, func.now())]
    if spec.finish_on_dead:
        finished_when.append((o.c.status == spec.dead, func.now()))
    status: ColumnElement[Any] = o.c.status
    if spec.kind == "jobs":
        # A job whose cancellation was requested while it ran is not run again: a retry — and a failure,
        # whether its worker had learned of the request or not — becomes cancelled.
        status = case(
            (
                and_(
                    or_(o.c.status == spec.ready, o.c.status == spec.dead), c.cancel_requested_at.is_not(None)
                ),
                literal("cancelled"),
            ),
            else_=o.c.status,
        )
        finished_when.append((status == "cancelled", func.now()))
    values: dict[str, Any] = {
        "status": status,
        spec.due.name: case(
            (o.c.delay.is_(None), spec.due),
            else_=func.now() + func.make_interval(0, 0, 0, 0, 0, 0, o.c.delay),
        ),
        "attempts": c.attempts - o.c.refund,
        "last_error": case(
            (o.c.status == spec.done, None if spec.clear_error_on_done else c.last_error),
            else_=func.coalesce(func.left(o.c.error, LAST_ERROR_MAX), c.last_error),
        ),
        spec.finished.name: case(*finished_when, else_=None),
        **spec.lease_cleared(),
    }
    if spec.kind == "jobs":
        values["result"] = case((o.c.status == spec.done, sa_cast(o.c.result, JSONB)), else_=c.result)
    returned = [c.id, *([c.status] if with_status else [])]
    return (
        update(t)
        .where(*_fenced(spec, o.c.id, o.c.version, single=single))
        .values(values)
        .returning(*returned)
    )


# --- the lease guard ---------------------------------------------------------------------------------
#
# A transaction that holds a running job's row (FOR UPDATE, an UPDATE of it) past stale_after lets its lease
# run out: every beat skips the locked row. The moment it commits, a rescue that comes before the next beat
# would take the job back from a worker that is running it — and another worker would run it too. So at its
# first skip the heartbeat takes the row's *lease guard*, a transaction-scoped advisory lock on the worker's
# guard connection, and keeps it until a beat has renewed the row: the rescue leaves alone every row whose
# guard someone holds. It reads the held guards from pg_locks (once per rescue statement, a hashed subplan),
# so a rescue takes no locks of its own and never waits. The guard dies with its worker's connection (and with
# a worker frozen longer than its idle-in-transaction timeout): a dead worker's jobs are rescued.
# Keys: (the table's oid, the id modulo 2**31) — the two-int4 form of the lock, which pg_locks shows as
# (classid, objid, objsubid = 2): the same for every service whatever its model calls the table, distinct per
# tenant schema. Two ids 2**31 apart share a key; a guard then also delays the other's rescue while held.

_GUARD_IDS = 2**31
_tableoid: ColumnElement[Any] = literal_column(
    "tableoid"
)  # (the statements below read one table: unambiguous)

_pg_locks = table(
    "pg_locks", column("locktype"), column("database"), column("classid"), column("objid"),
    column("objsubid"), column("granted"),
)  # fmt: skip
_pg_database = table("pg_database", column("oid"), column("datname"))


def _guarded_keys() -> Select[Any]:
    """The (classid, objid) of the two-key advisory locks held right now in this database."""
    here = select(_pg_database.c.oid).where(_pg_database.c.datname == func.current_database())
    return select(_pg_locks.c.classid, sa_cast(_pg_locks.c.objid, BigInteger)).where(
        _pg_locks.c.locktype == "advisory",
        _pg_locks.c.database == here.scalar_subquery(),
        _pg_locks.c.objsubid == 2,
        _pg_locks.c.granted,
    )


@cache
def guard_statement(spec: QueueSpec) -> Select[Any]:
    """Take the lease guards of jobs ``:ids`` for the rest of the transaction; returns (id, taken) per job
    found. Never waits: a guard someone else holds — another worker's, whose job it now is — is not taken."""
    c = spec.c
    key = sa_cast(c.id % _GUARD_IDS, Integer)
    taken = func.pg_try_advisory_xact_lock(sa_cast(_tableoid, Integer), key)
    return select(c.id, taken).where(c.id == any_(bindparam("ids", type_=ARRAY(BigInteger))))


@cache
def guard_timeout_statement() -> Select[Any]:
    """``idle_in_transaction_session_timeout`` for the guard's transaction: a worker frozen longer (SIGSTOP, a
    paused VM) loses its guards as a dead one does, instead of pinning its jobs until TCP gives up."""
    return select(
        func.set_config("idle_in_transaction_session_timeout", bindparam("timeout", type_=Text), True)
    )


@cache
def leases_statement(spec: QueueSpec) -> Select[Any]:
    """(id, lease_version, leased) of jobs ``:ids`` — a plain read, which no row lock delays."""
    c = spec.c
    return select(c.id, c.lease_version, c.status == const(spec.active)).where(
        c.id == any_(bindparam("ids", type_=ARRAY(BigInteger)))
    )


@cache
def extend_statement(spec: QueueSpec) -> Update:
    """Heartbeat: renew the lease of rows this worker still holds (fenced like a finalize). For jobs it also
    returns whether each job's cancellation was requested, so workers learn it with no extra statement."""
    t, c = spec.table, spec.c
    pairs = _unnested("held", ("ids", "id", BigInteger), ("versions", "version", BigInteger))
    # Rows locked right now are left for the next beat, never waited for: the worker's own finalize may be
    # writing the same rows in another order, and the two deadlocked (PostgreSQL aborted one of them; seen in
    # the 1M-job memory run). A row skipped twice in a row is reported as lost (WorkerBase._beat_result).
    mine = t.alias("mine")
    free = (
        select(mine.c.id)
        .where(mine.c.id == any_(_ids_initplan()))
        .with_for_update(skip_locked=True, key_share=True)
        .scalar_subquery()
    )
    return (
        update(t)
        .where(*_fenced(spec, pairs.c.id, pairs.c.version), c.id == any_(func.array(free)))
        .values(spec.lease_values())
        .returning(c.id, c.cancel_requested_at.is_not(None) if spec.kind == "jobs" else literal(False))
    )


@cache
def refund_statement(spec: QueueSpec) -> Update:
    """Give back one attempt of each row still leased under the given lease version (fenced like a finalize),
    returning the ids it applied to: a worker's claim of a job it is running already (the lease ran out
    unrenewed and another worker's rescue put the job back), which it holds back and never starts — no
    attempt. Counted until the run ended, such claims used up a job's attempts while its worker's renewals kept
    failing, and a rescue failed the job "after max attempts (worker crash?)" as its one run succeeded.

    ``:ids``, ``:versions`` and ``:attempts`` (each claim's attempts as claimed) go together: the row is set to
    one less than its claim's count, so the statement sent again — its answer lost after it committed — changes
    nothing and still reports the row (subtracting again gave an attempt back twice: a review, 5 of 5)."""
    t, c = spec.table, spec.c
    claims = _unnested(
        "held_back",
        ("ids", "id", BigInteger),
        ("versions", "version", BigInteger),
        ("attempts", "attempts", Integer),
    )
    return (
        update(t)
        .where(
            *_fenced(spec, claims.c.id, claims.c.version),
            claims.c.attempts > 0,
            c.attempts.in_([claims.c.attempts, claims.c.attempts - 1]),
        )
        .values(attempts=claims.c.attempts - 1)
        .returning(c.id)
    )


# --- operator actions on dead letters -------------------------------------------------------------------
#
# A bulk action selects its rows ONCE (dead_selection, one statement: the snapshot of ids it acts on), then
# changes them in batches by id. A row that a running dispatcher dead-letters again after the action
# requeued it is therefore never picked up a second time, and the action ends after len(ids) / batch
# statements whatever the dispatchers do. The dry run reports exactly that snapshot.


def dead_selection(spec: QueueSpec, filters: dict[str, Any]) -> Select[Any]:
    """Ids of dead/failed rows matching the operator's filters, in id order (values are bound, never
    formatted). The filters are checked against the table by ``sa_outbox.admin`` before they get here."""
    c = spec.c
    where: list[ColumnElement[bool]] = [c.status == const(spec.dead)]
    if filters.get("ids") is not None:
        where.append(c.id == any_(bindparam("ids", value=list(filters["ids"]), type_=ARRAY(BigInteger))))
    for name in ("event_type", "aggregate_type", "aggregate_id", "task", "queue"):
        if filters.get(name) is not None:
            where.append(c[name] == filters[name])
    if filters.get("error_contains") is not None:
        where.append(c.last_error.contains(filters["error_contains"], autoescape=True))
    if filters.get("older_than") is not None:
        where.append(
            c.created_at < func.now() - bindparam("older_than", value=filters["older_than"], type_=Interval)
        )
    return select(c.id).where(*where).order_by(c.id)


def _still_dead(spec: QueueSpec) -> list[ColumnElement[bool]]:
    """The rows of ``:ids`` (one batch of the snapshot) that are still dead: a row requeued or skipped by
    someone else meanwhile is left alone, and RETURNING reports exactly the rows this statement changed."""
    c = spec.c
    return [c.id == any_(bindparam("ids", type_=ARRAY(BigInteger))), c.status == const(spec.dead)]


@cache
def requeue_statement(spec: QueueSpec) -> Update:
    """Back to the ready state, attempts reset, due now; the action is appended to last_error."""
    c = spec.c
    values: dict[str, Any] = {
        "status": const(spec.ready),
        "attempts": 0,
        spec.due.name: func.now(),
        spec.finished.name: None,
        "last_error": func.right(func.concat_ws("\n", c.last_error, "requeued by operator"), LAST_ERROR_MAX),
    }
    if spec.kind == "jobs":
        # (a job cancelled while it ran that then failed kept its request: the rerun would be cancelled at once)
        values["cancel_requested_at"] = None
    return update(spec.table).where(*_still_dead(spec)).values(values).returning(c.id)


@cache
def skip_statement(spec: QueueSpec) -> Update:
    """Mark dead outbox rows done without delivering them (so an ordered aggregate can move on); failed jobs
    cancelled — discarded: final, never run again, purged with the finished ones. Recorded in ``last_error``."""
    c = spec.c
    outbox = spec.kind == "outbox"
    values: dict[str, Any] = {
        "status": const(spec.done if outbox else "cancelled"),
        spec.finished.name: func.now(),
        "last_error": func.right(
            func.concat_ws(
                "\n", c.last_error,
                "skipped by operator (not delivered)" if outbox else "discarded by operator (not run again)",
            ),
            LAST_ERROR_MAX,
        ),
    }  # fmt: skip
    return update(spec.table).where(*_still_dead(spec)).values(values).returning(c.id)


# --- retention ------------------------------------------------------------------------------------------
#
# A purge fixes its cutoff once, from the database clock, when it starts (:cutoff = now() - older_than):
# rows finished while it runs are not chased, so it ends under any load, and its dry run counts the same rows.


def purge_selection(spec: QueueSpec) -> Select[Any]:
    """Ids of finished rows (done; for jobs also cancelled) finished before ``:cutoff``, read through the
    finished rows' partial index."""
    c = spec.c
    finished = (
        c.status == const(spec.done)
        if spec.kind == "outbox"
        else c.status.in_([const(spec.done), const("cancelled")])
    )
    return select(c.id).where(finished, spec.finished < bindparam("cutoff", type_=spec.finished.type))


@cache
def purge_statement(spec: QueueSpec) -> Any:
    """Delete up to ``:batch`` done rows finished before ``:cutoff``, oldest first (SKIP LOCKED: a row someone
    holds is left for the next purge)."""
    from sqlalchemy import delete

    c = spec.c
    picked = (
        purge_selection(spec)
        .order_by(spec.finished)
        .limit(bindparam("batch", type_=Integer))
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    return delete(spec.table).where(c.id.in_(picked))


# --- finalize + claim in one round trip --------------------------------------------------------------------


@cache
def finalize_and_claim_statement(
    spec: QueueSpec,
    *,
    ordered: bool = False,
    ordered_types: bool = False,
    limit: int | None = None,
    unique_running: bool = False,
    single: bool = False,
    heads: bool = False,
    queues: int = 1,
    rooms: bool = False,
    settle: bool = True,
    levels: bool = False,
) -> Any:
    """The previous batch's fenced finalize and the next batch's claim, as one statement (one round trip);
    ``single``: the finalize of exactly one outcome (:func:`finalize_statement`).

    Both are data-modifying CTEs over disjoint rows (finalize touches leased rows, the claim ready ones) and
    keep every guarantee of :func:`finalize_statement` and :func:`claim_statement`. They share one snapshot: a
    row finalized here (retried, released) is claimable from the next statement on; but an ordered aggregate's
    next event behind a row finalized ``done`` here — a unique key's next job behind its running job finished
    here — is claimable in this one (the claim's probes read the finalize's RETURNING). Rows come back
    tagged: ``('f', id, NULL…)`` for each applied outcome, ``('c', <claim row>)`` for each claimed row.
    """
    finished: ColumnElement[Any] | None = None
    if ordered or unique_running:
        # The rows this finalize finishes for good (done; for jobs also failed or cancelled): the claim's
        # snapshot still sees them leased, so without this an ordered aggregate's next event (a key's next job)
        # became claimable only from the next statement on, and a dispatcher claimed a second time after each
        # turn: two statements per event of a hot aggregate. A dead event still blocks its aggregate; a retried
        # one is pending again; an outcome fenced out (a lost lease) is not returned at all.
        finalized = finalize_statement(spec, single=single, with_status=True).cte("finalized")
        blocking = [
            const(spec.ready),
            const(spec.active),
            *([const(spec.dead)] if spec.kind == "outbox" else []),
        ]
        finished = func.array(
            select(finalized.c.id).where(finalized.c.status.not_in(blocking)).scalar_subquery(),
            type_=ARRAY(BigInteger),
        )
    else:
        finalized = finalize_statement(spec, single=single).cte("finalized")
    claimed = _claim_statement(
        spec,
        ordered=ordered,
        ordered_types=ordered_types,
        limit=limit,
        unique_running=unique_running,
        heads=heads,
        finished=finished,
        queues=queues,
        rooms=rooms,
        settle=settle,
        levels=levels,
    ).cte("claimed")
    cols = claim_returning(spec)
    applied = select(
        literal_column("'f'", Text).label("k"),
        finalized.c.id,
        *[null().cast(col.type).label(col.name) for col in cols[1:]],
    )
    taken = select(literal_column("'c'", Text).label("k"), *[claimed.c[col.name] for col in cols])
    return union_all(applied, taken)


# --- operator actions on jobs: cancel, retry, update; pausing queues ------------------------------------


def job_filters(spec: QueueSpec, filters: dict[str, Any]) -> list[ColumnElement[bool]]:
    """The operator's job filters (ids, task, queue) as conditions; values bound, never formatted."""
    c = spec.c
    where: list[ColumnElement[bool]] = []
    if filters.get("ids") is not None:
        where.append(c.id == any_(bindparam("ids", value=list(filters["ids"]), type_=ARRAY(BigInteger))))
    for name in ("task", "queue"):
        if filters.get(name) is not None:
            where.append(c[name] == bindparam(f"f_{name}", value=filters[name], type_=Text))
    return where


def cancel_statement(spec: QueueSpec, where: list[ColumnElement[bool]]) -> Update:
    """Cancel matching jobs in one statement: a queued job becomes ``cancelled`` (final); a running one gets
    a cancel request (``cancel_requested_at``) its worker learns with its next heartbeat. One statement, so a
    job a worker claims meanwhile is re-checked on its new version and gets the request instead."""
    c = spec.c
    queued = c.status == const("queued")
    return (
        update(spec.table)
        .where(c.status.in_([const("queued"), const("running")]), *where)
        .values(
            status=case((queued, const("cancelled")), else_=c.status),
            finished_at=case((queued, func.now()), else_=c.finished_at),
            cancel_requested_at=func.coalesce(c.cancel_requested_at, func.now()),
            last_error=case(
                (
                    queued,
                    func.right(func.concat_ws("\n", c.last_error, "cancelled by operator"), LAST_ERROR_MAX),
                ),
                else_=c.last_error,
            ),
        )
        .returning(c.id, c.status)
    )


def job_selection(spec: QueueSpec, statuses: list[str], where: list[ColumnElement[bool]]) -> Select[Any]:
    c = spec.c
    return select(c.id).where(c.status.in_([const(s) for s in statuses]), *where).order_by(c.id)


def retry_jobs_statement(spec: QueueSpec, statuses: list[str]) -> Update:
    """Back to queued, attempts reset, due now, the cancel request cleared — for the rows of ``:ids`` still in
    one of ``statuses`` (a row someone else changed meanwhile is left alone); recorded in last_error.

    A job that never started (``lease_version`` 0: cancelled while queued) and has a unique key would be a
    waiting job of its key again (``ux_<jobs>_unique``): it is left alone when its key already has one, and of
    several such jobs of one key in ``:ids`` only the first is requeued — at most one job per key waits, as at
    enqueue (the caller reports the rest)."""
    c = spec.c
    wanted = [const(s) for s in statuses]
    waiting, sibling = spec.table.alias("waiting_same_key"), spec.table.alias("retried_same_key")
    # The first such job of each key among :ids, found once (an InitPlan): asked per row instead ("no such job
    # of its key with a smaller id among :ids"), each row read the primary key for every id — a batch of 4,000
    # never-started keyed jobs took 1.9 s, twice the ids four times the time (a review).
    firsts = (
        select(func.min(sibling.c.id))
        .where(
            sibling.c.id == any_(bindparam("ids", type_=ARRAY(BigInteger))),
            sibling.c.unique_key.is_not(None),
            sibling.c.lease_version == literal_column("0", Integer),
            sibling.c.status.in_(wanted),
        )
        .group_by(sibling.c.unique_key)
    )
    key_free = or_(
        c.lease_version != literal_column("0", Integer),
        c.unique_key.is_(None),
        and_(
            ~exists().where(
                waiting.c.unique_key == c.unique_key,
                waiting.c.status == const("queued"),
                waiting.c.lease_version == literal_column("0", Integer),
            ),
            c.id == any_(func.array(firsts.scalar_subquery())),
        ),
    )
    return (
        update(spec.table)
        .where(
            c.id == any_(bindparam("ids", type_=ARRAY(BigInteger))),
            c.status.in_(wanted),
            key_free,
        )
        .values(
            status=const("queued"),
            attempts=0,
            run_at=func.now(),
            finished_at=None,
            cancel_requested_at=None,
            last_error=func.right(func.concat_ws("\n", c.last_error, "requeued by operator"), LAST_ERROR_MAX),
        )
        .returning(c.id)
    )


def update_jobs_statement(spec: QueueSpec, statuses: list[str], values: dict[str, Any]) -> Update:
    """Change priority / run_at / max_attempts of the rows of ``:ids`` still in one of ``statuses``."""
    c = spec.c
    return (
        update(spec.table)
        .where(
            c.id == any_(bindparam("ids", type_=ARRAY(BigInteger))),
            c.status.in_([const(s) for s in statuses]),
        )
        .values(values)
        .returning(c.id)
    )


def _sibling(jobs: Table, suffix: str, kind: str, *items: Any) -> Table:
    """A table that belongs to ``jobs`` (``<jobs>_<suffix>``) on the same metadata, made once."""
    name = f"{jobs.name}_{suffix}"
    key = f"{jobs.schema}.{name}" if jobs.schema else name
    existing = jobs.metadata.tables.get(key)
    if existing is not None:
        return existing
    return Table(
        name,
        jobs.metadata,
        *items,
        schema=jobs.schema,
        info={"sa_outbox_kind": kind, "sa_outbox_jobs": jobs.name},
    )


def queue_table(jobs: Table) -> Table:
    """The table that holds the state of each queue of ``jobs`` (paused or not): ``<jobs>_queues``. It lives in
    the database so that a pause survives restarts and reaches every worker on every host (behind PgBouncer
    too); workers read it at most once a second."""
    name = f"{jobs.name}_queues"
    return _sibling(
        jobs, "queues", "queues",
        Column("queue", Text, nullable=False),
        Column("paused_at", DateTime(timezone=True)),
        Column("paused_by", Text),
        PrimaryKeyConstraint("queue", name=conv(f"pk_{name}")),
    )  # fmt: skip


def starts_table(jobs: Table) -> Table:
    """``<jobs>_starts``: when each job of a rate-limited queue started (one row per claim, per concurrency key
    when the limit is per key). The claim of a rate-limited queue counts the rows of its window and adds its
    own in the same transaction; the maintenance step deletes rows older than the window."""
    name = f"{jobs.name}_starts"
    return _sibling(
        jobs, "starts", "starts",
        Column("id", BigInteger, Identity(always=True), nullable=False),
        Column("queue", Text, nullable=False),
        Column("key", Text, nullable=False),
        Column("at", DateTime(timezone=True), nullable=False, server_default=func.now()),
        PrimaryKeyConstraint("id", name=conv(f"pk_{name}")),
        Index(conv(f"ix_{name}_window"), "queue", "key", "at"),
    )  # fmt: skip


# --- limited queues: concurrency and rate limits enforced from the rows -------------------------------------


def _limit_key(spec: QueueSpec, per_key: bool, table: Any = None) -> Any:
    c = (table if table is not None else spec.table).c
    return c.concurrency_key if per_key else literal("", Text)


def _limit_lock(key: Any) -> Any:
    """The advisory lock id of a limited queue's key (``''`` for a limit on the whole queue)."""
    return func.hashtextextended(
        func.concat("sa_outbox.limit:", bindparam("queue_name", type_=Text), ":", key), 0
    )


@cache
def limited_pick_statement(spec: QueueSpec, *, per_key: bool) -> Select[Any]:
    """First statement of a limited queue's claim transaction: up to ``:batch`` due jobs of ``:queue_name`` in
    claim order, locked (``FOR NO KEY UPDATE SKIP LOCKED``), skipping keys whose running jobs already reach
    ``:n`` (a snapshot-old filter that only saves work: the second statement counts again). Returns
    (id, key) of the picked jobs whose key this transaction could lock — ``pg_try_advisory_xact_lock`` on the
    queue and key, never waited for: a key another worker is claiming right now is left to it.

    Walks the dequeue index like the plain claim; jobs of a saturated key are skipped, so their number is what
    a claim costs extra (the ordered outbox claim has the same shape)."""
    t, c = spec.table, spec.c
    running = t.alias("running")
    key = _limit_key(spec, per_key)
    busy = (
        select(func.count())
        .select_from(running)
        .where(
            running.c.status == const("running"),
            running.c.queue == c.queue,
            *([running.c.concurrency_key == c.concurrency_key] if per_key else []),
        )
        .scalar_subquery()
    )
    n = bindparam("n", type_=Integer)
    picked = (
        select(c.id, key.label("key"), c.priority, c.run_at)
        .where(
            c.status == const(spec.ready),
            spec.due <= func.now(),
            c.queue == bindparam("queue_name", type_=Text),
            or_(n.is_(None), busy < n),
        )
        .order_by(*spec.claim_order())
        .limit(bindparam("batch", type_=Integer))
        .with_for_update(skip_locked=True, key_share=True)
        .cte("picked")
        .prefix_with("MATERIALIZED")
    )
    keys = select(picked.c.key).distinct().order_by(picked.c.key).subquery("keys")
    if per_key:
        locked = select(keys.c.key).where(func.pg_try_advisory_xact_lock(_limit_lock(keys.c.key)))
    else:
        # A queue limited as a whole has one key: its claimers wait for its lock, taking turns for a moment,
        # instead of finding it taken, claiming nothing and sleeping a poll interval (a never-binding
        # Limit(1000) drained at 0.21x the unlimited rate with four workers). Only when there is something to
        # claim: an idle poll takes no lock. The lock function is volatile, so the column is always evaluated.
        waited = select(keys.c.key, func.pg_advisory_xact_lock(_limit_lock(keys.c.key)).label("w")).subquery(
            "w"
        )
        locked = select(waited.c.key)
    return (
        select(picked.c.id, picked.c.key)
        .where(picked.c.key == any_(func.array(locked.scalar_subquery())))
        .order_by(picked.c.priority.desc(), picked.c.run_at, picked.c.id)
    )


@cache
def limited_claim_statement(spec: QueueSpec, *, per_key: bool, rate: bool) -> Any:
    """Second statement of a limited queue's claim transaction, with a snapshot taken after the advisory locks
    of the first: of the picked jobs (``:ids``/``:keys`` in claim order, still row-locked by this transaction),
    claim per key only what fits — ``:n`` minus the key's running jobs (when there is a concurrency limit) and
    ``:rate_count`` minus the key's starts in the last ``:rate_window`` (when there is a rate) — and log the
    starts. Returns the claimed rows as the plain claim does. Every claimer of a key holds its lock while it
    counts and claims, so no two can both see room for the same slot: from the rows, across every host."""
    t, c = spec.table, spec.c
    cand = _unnested("cand", ("ids", "id", BigInteger), ("keys", "key", Text), ordinality="ord")
    running = t.alias("running")
    distinct_keys = select(cand.c.key).distinct().subquery("k")
    busy = (
        select(func.count())
        .select_from(running)
        .where(
            running.c.status == const("running"),
            running.c.queue == bindparam("queue_name", type_=Text),
            *([running.c.concurrency_key == distinct_keys.c.key] if per_key else []),
        )
        .scalar_subquery()
    )
    big = literal(2**31 - 1, Integer)
    n = bindparam("n", type_=Integer)
    room: Any = case((n.is_(None), big), else_=n - busy)
    if rate:
        starts = starts_table(t)
        # At most rate_count index entries are read: past that the key has no room, however many there are.
        in_window = (
            select(literal(1, Integer).label("one"))
            .select_from(starts)
            .where(
                starts.c.queue == bindparam("queue_name", type_=Text),
                starts.c.key == distinct_keys.c.key,
                # statement_timestamp(): this statement's start, after the pick took the keys' locks — not the
                # transaction's now(), which precedes the lock waits and a first statement's planning
                starts.c.at
                > func.statement_timestamp()
                - func.make_interval(0, 0, 0, 0, 0, 0, bindparam("rate_window", type_=Float)),
            )
            .limit(bindparam("rate_count", type_=Integer))
            .subquery("in_window")
        )
        recent = select(func.count()).select_from(in_window).scalar_subquery()
        room = func.least(room, bindparam("rate_count", type_=Integer) - recent)
    allow = select(distinct_keys.c.key, room.label("room")).cte("allow")
    ranked = select(
        cand.c.id,
        cand.c.key,
        func.row_number().over(partition_by=cand.c.key, order_by=cand.c.ord).label("rn"),
    ).subquery("ranked")
    chosen = select(ranked.c.id).join(allow, allow.c.key == ranked.c.key).where(ranked.c.rn <= allow.c.room)
    values: dict[str, Any] = {
        "status": const(spec.active),
        spec.owner.name: bindparam("owner", type_=Text),
        "lease_version": c.lease_version + 1,
        "attempts": c.attempts + 1,
        **spec.lease_values(),
    }
    claimed = (
        update(t)
        .where(c.id == any_(func.array(chosen.scalar_subquery())), c.status == const(spec.ready))
        .values(values)
        .returning(*claim_returning(spec), c.concurrency_key.label("limit_key"))
        .cte("claimed")
    )
    if not rate:
        return select(*[claimed.c[col.name] for col in claim_returning(spec)])
    starts = starts_table(t)
    logged = (
        insert(starts)
        .from_select(
            ["queue", "key", "at"],
            # clock_timestamp(): when the row is written, after this statement's planning and claim — with
            # the window counted from the statement's start, a start is never counted short in either direction
            select(
                claimed.c.queue, claimed.c.limit_key if per_key else literal("", Text), func.clock_timestamp()
            ),
        )
        .returning(starts.c.id)
        .cte("logged")
    )
    return select(*[claimed.c[col.name] for col in claim_returning(spec)]).where(
        select(func.count()).select_from(logged).scalar_subquery() >= 0
    )


@cache
def forget_starts_statement(spec: QueueSpec) -> Any:
    """Delete starts of ``:queue_name`` older than ``:rate_window`` (the once-a-second maintenance)."""
    from sqlalchemy import delete

    starts = starts_table(spec.table)
    return delete(starts).where(
        starts.c.queue == bindparam("queue_name", type_=Text),
        starts.c.at
        < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, bindparam("rate_window", type_=Float)),
    )


# --- planner statistics --------------------------------------------------------------------------------------

#: Whether ``:t`` has planner statistics on its ``status`` column (``pg_stats``: what the role may read); NULL
#: when there is no such table. A table that autovacuum has not analyzed yet has none, and without them the
#: ordered claim's plan reads and sorts every ready row, probing each (155 ms per claim over 4,000 events).
STATISTICS_PRESENT = text(
    """
    SELECT EXISTS (SELECT FROM pg_stats s
                    WHERE s.schemaname = n.nspname AND s.tablename = c.relname AND s.attname = 'status')
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = to_regclass(:t)
    """
)


#: Why an ``ANALYZE (SKIP_LOCKED)`` of ``:t`` may have left no statistics: whether the current role may analyze it
#: as its owner (a member of the owning role) or a superuser (``may``), and whether another session holds a lock
#: ANALYZE (SHARE UPDATE EXCLUSIVE) conflicts with (``locked``, what SKIP_LOCKED skips for). Neither: the
#: ANALYZE ran and found no rows to sample.
ANALYZE_SKIPPED = text(
    """
    SELECT pg_has_role(c.relowner, 'USAGE') OR r.rolsuper AS may,
           EXISTS (SELECT FROM pg_locks l
                    WHERE l.relation = c.oid AND l.pid <> pg_backend_pid() AND l.granted
                      AND l.mode IN ('ShareUpdateExclusiveLock', 'ShareLock', 'ShareRowExclusiveLock',
                                     'ExclusiveLock', 'AccessExclusiveLock')) AS locked
      FROM pg_class c, pg_roles r
     WHERE c.oid = to_regclass(:t) AND r.rolname = current_user
    """
)


def analyze_statement(name: str) -> TextClause:
    """``ANALYZE (SKIP_LOCKED)`` of the table ``name`` (quoted, as :func:`_partitions.regclass_name` gives
    it): never waits for a lock someone else holds (autovacuum's ANALYZE, a DDL), and only warns when the
    role may not analyze the table."""
    return text(f"ANALYZE (SKIP_LOCKED) {name}")


# --- partitions (the partitioned layout: docs/partitioning.md) ------------------------------------------------
#
# Catalog reads bind the parent's name as a regclass; DDL names are quoted by the dialect's preparer and the
# bounds are timestamps computed by sa_outbox (never user text).

#: The constraint that closes a partition being retired to writes: no row can be inserted into it, nor changed
#: in it (an UPDATE's new version is checked too), from the moment it commits. ``NOT VALID``: the rows already
#: there are not read.
RETIRING_CONSTRAINT = "sa_outbox_retiring"

#: Every partition of ``:t`` with its bounds (NULL for DEFAULT and MINVALUE/MAXVALUE bounds, which are never
#: retired), whether a ``DETACH … CONCURRENTLY`` of it was interrupted (PostgreSQL 14+) and whether it is
#: closed to writes (``RETIRING_CONSTRAINT``: a retire is in progress, or a run that closed it stopped before
#: detaching it).
PARTITIONS = text(
    r"""
    SELECT c.relname AS name, n.nspname AS schema,
           CAST(b.m[1] AS timestamptz) AS lower, CAST(b.m[2] AS timestamptz) AS upper,
           pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT' AS is_default,
           i.inhdetachpending AS detach_pending,
           EXISTS (SELECT 1 FROM pg_constraint k WHERE k.conrelid = c.oid AND k.conname = :constraint) AS closed
      FROM pg_inherits i
      JOIN pg_class c ON c.oid = i.inhrelid
      JOIN pg_namespace n ON n.oid = c.relnamespace
      LEFT JOIN LATERAL (
           SELECT regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']+)''\) TO \(''([^'']+)''\)') AS m
      ) b ON true
     WHERE i.inhparent = CAST(:t AS regclass)
     ORDER BY 3 NULLS LAST, 1
    """
).bindparams(constraint=RETIRING_CONSTRAINT)

#: Whether ``:t`` is a partitioned table (``r`` for range), NULL when it is not (or does not exist).
PARTITION_STRATEGY = text(
    "SELECT p.partstrat FROM pg_partitioned_table p WHERE p.partrelid = to_regclass(:t)"
)


def partition_table(name: str, schema: str | None) -> Table:
    """A partition (or a detached one) as a bare table with the one column its checks read."""
    from sqlalchemy import MetaData

    return Table(name, MetaData(), Column("status", Text), schema=schema)


def partition_counts(spec: QueueSpec, part: Table) -> Select[Any, Any, Any]:
    """Unfinished (ready, leased) and dead rows of one partition: an OR of single states, each read through
    its partial index (ready, leased/running, aggregate/failed) — never the partition's done rows."""
    st = part.c.status
    states = [const(spec.ready), const(spec.active), const(spec.dead)]
    return select(
        func.count().filter(st == states[0]),
        func.count().filter(st == states[1]),
        func.count().filter(st == states[2]),
    ).where(or_(*(st == s for s in states)))


def create_partition_ddl(
    preparer: Any, parent: Table, name: str, lower: Any, upper: Any, storage: str
) -> str:
    """``CREATE TABLE IF NOT EXISTS <name> PARTITION OF <parent> FOR VALUES FROM … TO … WITH (…)``: the
    partition inherits the parent's columns, constraints and partial indexes; the queue's autovacuum settings
    are set on it (a partitioned parent takes none)."""
    return (
        f"CREATE TABLE IF NOT EXISTS {qualified_name(preparer, name, parent.schema)} PARTITION OF "
        f"{preparer.format_table(parent)} FOR VALUES FROM ('{lower.isoformat()}') TO ('{upper.isoformat()}')"
        f" WITH ({storage})"
    )


def qualified_name(preparer: Any, name: str, schema: str | None) -> str:
    quoted: str = preparer.quote(name)
    return f"{preparer.quote_schema(schema)}.{quoted}" if schema else quoted


def detach_partition_ddl(preparer: Any, parent: Table, name: str, *, mode: str) -> str:
    """``DETACH PARTITION … CONCURRENTLY`` (mode ``concurrently``: outside any transaction; it waits for
    every transaction that uses the parent — but a transaction whose snapshot is older may still write into
    the partition afterwards: it is closed first, ``close_partition_ddl``) or ``… FINALIZE`` (mode
    ``finalize``: completes a detach that was interrupted)."""
    suffix = {"concurrently": "CONCURRENTLY", "finalize": "FINALIZE"}[mode]
    return (
        f"ALTER TABLE {preparer.format_table(parent)} DETACH PARTITION "
        f"{qualified_name(preparer, name, parent.schema)} {suffix}"
    )


def attach_partition_ddl(preparer: Any, parent: Table, name: str, lower: Any, upper: Any) -> str:
    return (
        f"ALTER TABLE {preparer.format_table(parent)} ATTACH PARTITION "
        f"{qualified_name(preparer, name, parent.schema)} "
        f"FOR VALUES FROM ('{lower.isoformat()}') TO ('{upper.isoformat()}')"
    )


def drop_partition_ddl(preparer: Any, name: str, schema: str | None) -> str:
    return f"DROP TABLE {qualified_name(preparer, name, schema)}"


def close_partition_ddl(preparer: Any, name: str, schema: str | None) -> str:
    """Close a partition to writes (``RETIRING_CONSTRAINT``; idempotent). Takes an ACCESS EXCLUSIVE lock on the
    partition: it waits for every transaction that has written into it or read it."""
    return (
        f"{reopen_partition_ddl(preparer, name, schema)}, "
        f"ADD CONSTRAINT {preparer.quote(RETIRING_CONSTRAINT)} CHECK (false) NOT VALID"
    )


def reopen_partition_ddl(preparer: Any, name: str, schema: str | None) -> str:
    """Open a closed partition to writes again (a retire that keeps it, or archives it)."""
    return (
        f"ALTER TABLE {qualified_name(preparer, name, schema)} DROP CONSTRAINT IF EXISTS "
        f"{preparer.quote(RETIRING_CONSTRAINT)}"
    )


#: The comment a partition carries while it is being retired (``sa_outbox:retiring:<mode>|<lower>|<upper>|<parent>``):
#: should the retiring process die after ``DETACH … CONCURRENTLY`` completed on the server (a SIGTERM'd loop
#: does not wait for its maintenance thread), the next run finds the detached table by it and finishes the job.
RETIRING = "sa_outbox:retiring:"


def comment_table_ddl(preparer: Any, name: str, schema: str | None, comment: str | None) -> str:
    """``COMMENT ON TABLE`` (the comment rendered as a string literal by the dialect; None removes it)."""
    if comment is None:
        value = "NULL"
    else:
        value = str(
            literal(comment, Text).compile(dialect=preparer.dialect, compile_kwargs={"literal_binds": True})
        )
    return f"COMMENT ON TABLE {qualified_name(preparer, name, schema)} IS {value}"


#: Detached tables (not partitions of anything) whose comment says they were being retired from ``:parent``.
RETIRING_TABLES = text(
    """
    SELECT c.relname, d.description
      FROM pg_class c
      JOIN pg_namespace n ON n.oid = c.relnamespace
      JOIN pg_description d ON d.objoid = c.oid AND d.classoid = 'pg_class'::regclass AND d.objsubid = 0
     WHERE c.relkind = 'r' AND NOT c.relispartition AND n.nspname = :schema
       AND starts_with(d.description, :prefix)
     ORDER BY c.relname
    """
)
