"""The claim / lease / finalize engine shared by the dispatcher and the worker.

Database steps are plain functions taking a SQLAlchemy ``Connection`` (the async classes call them through
``AsyncConnection.run_sync``); the decision of what a publisher's or handler's result means is
:func:`decide`. Only the loops (sleeping, waiting for NOTIFY, calling publishers/handlers) live elsewhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from operator import itemgetter
from typing import Any

from sqlalchemy import Connection

from . import _sql
from ._backoff import Backoff
from ._execute import compile_ahead, control, in_block, run, send, transaction
from ._limits import Limit
from ._messages import slot_setters
from ._partitions import regclass_name
from ._sql import QueueSpec
from .errors import Defer, NoAnswer, PermanentError

__all__ = [
    "RELEASED_UNAVAILABLE",
    "UNAVAILABLE_PREFIX",
    "Outcome",
    "cancelled",
    "claim",
    "claim_limited",
    "decide",
    "describe_error",
    "extend",
    "finalize",
    "finalize_and_claim",
    "forget_starts",
    "guard",
    "leased",
    "passed_over",
    "release",
    "rescue",
    "run",
    "unavailable",
    "unguard",
]

log = logging.getLogger("sa_outbox.engine")


@dataclass(frozen=True, slots=True)
class Outcome:
    """What to write for one claimed row; applied fenced by (id, lease_version)."""

    id: int
    lease_version: int
    status: str
    delay: float | None = None  # seconds from the database's now(); None keeps the due time
    error: str | None = None
    refund: int = 0  # 1 gives the claim's attempt back (Defer, release)
    kind: str = (
        "done"  # done | retry | defer | dead | release | unavailable | cancelled — for logs and metrics
    )
    result: str | None = None  # jobs: the handler's result as JSON text, stored with done


_OUTCOME_SETTERS = slot_setters(
    Outcome, ("id", "lease_version", "status", "delay", "error", "refund", "kind", "result")
)


def done_outcome(id: int, lease_version: int, status: str, result: str | None = None) -> Outcome:
    """``Outcome(id, lease_version, status, result=result)`` — a success, the one made for every row a loop
    finishes — built through the slot setters rather than the frozen ``__init__`` (~0.7 µs less per row)."""
    s_id, s_version, s_status, s_delay, s_error, s_refund, s_kind, s_result = _OUTCOME_SETTERS
    o = object.__new__(Outcome)
    s_id(o, id)
    s_version(o, lease_version)
    s_status(o, status)
    s_delay(o, None)
    s_error(o, None)
    s_refund(o, 0)
    s_kind(o, "done")
    s_result(o, result)
    return o


def describe_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text[: _sql.LAST_ERROR_MAX]


def decide(
    spec: QueueSpec,
    *,
    id: int,
    lease_version: int,
    attempts: int,
    max_attempts: int,
    error: BaseException | None,
    backoff: Backoff,
) -> Outcome:
    """The failure classes (docs/design.md "The failure classes"), for both tables.

    * success → done;
    * :class:`Defer` → back to ready at ``now() + delay``, the attempt refunded (deferring never exhausts
      attempts);
    * :class:`PermanentError` → dead/failed;
    * :class:`RetryableError` *and any unclassified exception* → back to ready after ``backoff.delay(attempts)``,
      or dead/failed once ``attempts >= max_attempts`` — except :class:`NoAnswer`, whose last attempt is
      refunded instead (tried again after the backoff, never dead for it).
    """
    if error is None:
        return done_outcome(id, lease_version, spec.done)
    if isinstance(error, Defer):
        return Outcome(
            id, lease_version, spec.ready, delay=error.delay.total_seconds(),
            error=f"deferred: {error.reason}"[: _sql.LAST_ERROR_MAX], refund=1, kind="defer",
        )  # fmt: skip
    if isinstance(error, PermanentError):
        return Outcome(id, lease_version, spec.dead, error=describe_error(error), kind="dead")
    if attempts >= max_attempts and isinstance(error, NoAnswer):
        # no answer is no verdict on the message: its last attempt is given back, and it is tried again later
        return Outcome(
            id, lease_version, spec.ready, delay=backoff.delay(attempts),
            error=f"{_sql.NO_ANSWER_PREFIX} ({attempts}/{max_attempts}), tried again later: "
                  f"{describe_error(error)}"[: _sql.LAST_ERROR_MAX],
            refund=1, kind="retry",
        )  # fmt: skip
    if attempts >= max_attempts:
        text = f"retries exhausted ({attempts}/{max_attempts}): {describe_error(error)}"
        return Outcome(id, lease_version, spec.dead, error=text[: _sql.LAST_ERROR_MAX], kind="dead")
    return Outcome(
        id,
        lease_version,
        spec.ready,
        delay=backoff.delay(attempts),
        error=describe_error(error),
        kind="retry",
    )


def gave_up(
    spec: QueueSpec, id: int, lease_version: int, error: BaseException, *, age: float, limit: float
) -> Outcome:
    """A row written ``age`` seconds ago, over the loop's ``give_up_after`` (``limit``), that failed again:
    dead/failed, whatever the failure was — an outage, a Defer, a NoAnswer's refund included."""
    text = f"gave up: written {age:.0f}s ago, over give_up_after ({limit:g}s); last error: {describe_error(error)}"
    return Outcome(id, lease_version, spec.dead, error=text[: _sql.LAST_ERROR_MAX], kind="dead")


#: How ``last_error`` starts on a row given back because its destination was unavailable (``status``,
#: ``doctor`` and the rescue look for these), and on the rest of the batch released with it.
UNAVAILABLE_PREFIX = _sql.UNAVAILABLE_PREFIX
RELEASED_UNAVAILABLE = _sql.RELEASED_UNAVAILABLE


def release(spec: QueueSpec, id: int, lease_version: int, reason: str) -> Outcome:
    """Give a claimed row back untouched (shutdown, lease budget spent, destination down): ready, attempt
    refunded, its due time kept — so it keeps its place in the claim order (NULL delay keeps the due time)."""
    return Outcome(id, lease_version, spec.ready, delay=None, error=reason, refund=1, kind="release")


def cancelled(spec: QueueSpec, id: int, lease_version: int, reason: str) -> Outcome:
    """A job whose cancellation was requested and that stopped (or never started): ``cancelled``, final."""
    return Outcome(
        id, lease_version, "cancelled", error=f"cancelled: {reason}"[: _sql.LAST_ERROR_MAX], kind="cancelled"
    )


def unavailable(spec: QueueSpec, id: int, lease_version: int, error: BaseException) -> Outcome:
    """The destination as a whole was down (:class:`~sa_outbox.DestinationUnavailable`): not this message's
    fault, so the attempt is refunded and the row stays where it was in the claim order (its due time is
    kept); the dispatcher's circuit breaker, not the row, decides when to try the destination again.
    ``last_error`` starts with :data:`UNAVAILABLE_PREFIX`."""
    text = describe_error(error)
    if not text.startswith(UNAVAILABLE_PREFIX):  # a subclass of DestinationUnavailable
        text = (UNAVAILABLE_PREFIX + text)[: _sql.LAST_ERROR_MAX]
    return Outcome(id, lease_version, spec.ready, delay=None, error=text, refund=1, kind="unavailable")


def check_columns(conn: Connection, spec: QueueSpec) -> None:
    """Fail (undefined column or table: the loop's connection turns it into a SchemaError) unless the table
    has every column of the model (:func:`_sql.columns_statement`)."""
    run(conn, _sql.columns_statement(spec), {})


def table_identity(conn: Connection, spec: QueueSpec) -> tuple[str, int | None]:
    """(database, oid) of the table ``spec`` names as ``conn`` resolves it — its ``schema_translate_map`` and
    its ``search_path`` applied (:func:`_sql.table_identity_statement`)."""
    row = conn.execute(_sql.table_identity_statement(), {"name": regclass_name(conn, spec.table)}).one()
    return str(row[0]), row[1]


def rescue(
    conn: Connection,
    spec: QueueSpec,
    *,
    max_attempts: int | None = None,
    stale_after: timedelta | None = None,
    limit: int = 1000,
    kept: Sequence[tuple[int, int]] = (),
    expired_for: float = 0.0,
) -> list[Any]:
    """Run the rescue statement; returns (id, status, lease_version) of every row it moved (not logged: the
    caller logs them with :func:`log_rescued` once the rescue committed). ``kept``: the
    leases (id, lease_version) the loop running it holds, left alone; ``expired_for``: only leases expired for
    longer than that many seconds (see :func:`_sql.rescue_statement`). Sent unprepared: the loops run it in a
    transaction block (``LoopBase._rescue_on``), where psycopg's cursor would prepare it under psycopg's own
    names, which another client of a pooler's server connection may hold — once a second, its planning is
    nothing."""
    params: dict[str, Any] = {
        "limit": limit,
        "kept_ids": [row_id for row_id, _ in kept],
        "kept_versions": [version for _, version in kept],
        "expired_for": timedelta(seconds=expired_for),
    }
    if spec.kind == "outbox":
        params["max_attempts"] = max_attempts
    else:
        params["stale_after"] = stale_after
    return run(conn, _sql.rescue_statement(spec), params, prepare=False)


def log_rescued(spec: QueueSpec, rows: Sequence[Any]) -> None:
    """Log each row a rescue moved ((id, status, lease_version), :func:`rescue`), once its transaction
    committed: a dead row at WARNING, the others at INFO."""
    for row_id, status, version in rows:
        level = logging.WARNING if status == spec.dead else logging.INFO
        log.log(
            level, "%s %s rescued from an expired lease -> %s", spec.kind, row_id, status,
            extra={"table": spec.table.name, "row_id": row_id, "lease_version": version, "status": status},
        )  # fmt: skip


#: A claim's queue: one name, or two or more in strict priority (one statement, see :func:`_sql.claim_statement`).
Queues = str | Sequence[str] | None


def _queue_count(queue: Queues, rooms: Sequence[int] | None) -> int:
    if queue is None or isinstance(queue, str):
        if rooms is not None:
            raise ValueError("rooms go with two or more queues (one queue's room is its batch)")
        return 1
    if len(queue) < 2 or (rooms is not None and len(rooms) != len(queue)):
        raise ValueError(
            f"a claim of several queues needs two or more, and one room each: {queue!r}, {rooms!r}"
        )
    return len(queue)


def _claim_params(
    spec: QueueSpec, owner: str, batch: int, lease: timedelta | None, queue: Queues,
    ordered_types: Sequence[str] | None, rooms: Sequence[int] | None = None,
) -> dict[str, Any]:  # fmt: skip
    params: dict[str, Any] = {"owner": owner, "batch": batch}
    if spec.kind == "outbox":
        params["lease"] = lease
    elif queue is None or isinstance(queue, str):
        params["queue_name"] = queue
    else:
        for i, name in enumerate(queue):
            params[f"queue_name_{i}"] = name
        for i, room in enumerate(rooms or ()):
            params[f"batch_{i}"] = room
    if ordered_types is not None:
        params["ordered_types"] = list(ordered_types)
    return params


def _claim_shape(
    batch: int,
    ordered: bool,
    ordered_types: Sequence[str] | None,
    fixed_batch: bool,
    unique_running: bool = False,
    heads: bool = False,
    queue: Queues = None,
    rooms: Sequence[int] | None = None,
    settle: bool = True,
    levels: bool = False,
) -> dict[str, Any]:
    """Which cached claim statement a call needs (the values go in as parameters, see ``_claim_params``)."""
    return {
        "settle": settle,
        "levels": levels,
        "ordered": ordered,
        "heads": heads,
        "ordered_types": ordered_types is not None,
        "limit": batch if fixed_batch else None,
        "unique_running": unique_running,
        "queues": _queue_count(queue, rooms),
        "rooms": rooms is not None,
    }


_QUEUE, _PRIORITY, _RUN_AT = 5, 7, 10  # a jobs claim row's queue, priority and run_at (_sql.claim_returning)


_PASSED_OVER = 9  # an outbox claim row's passed_over (_sql.claim_returning): the same on every row


def passed_over(rows: Sequence[Any]) -> bool:
    """Whether the outbox claim that returned ``rows`` took a row the settled form passes over (the locking
    form's mark, see ``_sql.claim_statement``)."""
    return bool(rows) and bool(rows[0][_PASSED_OVER])


def _job_order(row: Any) -> tuple[int, Any, int]:
    return -row[_PRIORITY], row[_RUN_AT], row[0]


def _in_claim_order(rows: list[Any], spec: QueueSpec, queue: Queues) -> list[Any]:
    """Claimed rows in the order a loop hands them over: outbox rows by id; jobs in the claim's order —
    priority (higher first), then run_at, then id — and, claimed from several queues, the first queue's before
    the next's (strict priority, as separate claims would have handed them over). The statement returns them
    in the order it updated them (by id): a worker running a batch one job at a time ran a priority-0 job
    before the priority-20 job claimed with it."""
    if spec.kind != "jobs":
        rows.sort(key=_first)
        return rows
    rows.sort(key=_job_order)
    if not (queue is None or isinstance(queue, str)):
        rank = {name: i for i, name in enumerate(queue)}
        rows.sort(key=lambda row: rank[row[_QUEUE]])
    return rows


def _outcome_params(spec: QueueSpec, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The outcome arrays of the finalize statement (one element per row, unnested in the database); for
    exactly one outcome, its values as plain parameters (the statement's ``single`` form, see
    :func:`_single`)."""
    if _single(outcomes):
        (o,) = outcomes
        params: dict[str, Any] = {
            "o_id": o.id,
            "o_version": o.lease_version,
            "o_status": o.status,
            "o_delay": o.delay,
            "o_error": _storable(o.error),
            "o_refund": o.refund,
        }
        if spec.kind == "jobs":
            params["o_result"] = o.result
        return params
    params = {
        "ids": [o.id for o in outcomes],
        "versions": [o.lease_version for o in outcomes],
        "statuses": [o.status for o in outcomes],
        "delays": [o.delay for o in outcomes],
        "errors": [_storable(o.error) for o in outcomes],
        "refunds": [o.refund for o in outcomes],
    }
    if spec.kind == "jobs":
        params["results"] = [o.result for o in outcomes]
    return params


def _single(outcomes: Sequence[Outcome]) -> bool:
    """Whether the finalize takes the one-outcome form (:func:`_sql.finalize_statement`): a worker at batch 1,
    and any loop whose statement carries one outcome."""
    return len(outcomes) == 1


def _storable(error: str | None) -> str | None:
    """An error text PostgreSQL can store: a NUL (which no text column holds, and which would fail the whole
    finalize, the batch's other outcomes with it) written as the four characters ``\\x00``."""
    if error is None or "\x00" not in error:
        return error
    return error.replace("\x00", "\\x00")


def claim(
    conn: Connection,
    spec: QueueSpec,
    *,
    owner: str,
    batch: int,
    lease: timedelta | None = None,
    queue: Queues = None,
    ordered: bool = False,
    ordered_types: Sequence[str] | None = None,
    fixed_batch: bool = False,
    unique_running: bool = False,
    heads: bool = False,
    rooms: Sequence[int] | None = None,
    settle: bool = True,
    levels: bool = False,
) -> list[Any]:
    """Run the claim statement; rows (tuples in :func:`_sql.claim_returning` order) in :func:`_in_claim_order`.
    ``fixed_batch``: ``batch`` is the caller's usual size, written into the statement (see
    :func:`_sql.claim_statement`); other sizes are a parameter. ``unique_running``: at most one running job
    per unique key (jobs). ``heads``: the ordered claim's aggregate-by-aggregate form (``_sql._heads_pick``).
    ``queue``: a list claims those queues in strict priority, in one statement (rows: the first queue's
    first); ``rooms``: at most that many of each."""
    stmt, params = _claim_call(
        spec, (), owner=owner, batch=batch, lease=lease, queue=queue, ordered=ordered,
        ordered_types=ordered_types, fixed_batch=fixed_batch, unique_running=unique_running, heads=heads,
        rooms=rooms, settle=settle, levels=levels,
    )  # fmt: skip
    return _in_claim_order(run(conn, stmt, params), spec, queue)


def claim_limited(
    conn: Connection, spec: QueueSpec, *, owner: str, batch: int, queue: str, limit: Limit
) -> tuple[list[Any], float]:
    """Claim up to ``batch`` jobs of a limited queue (see :mod:`sa_outbox._limits`): in one short transaction,
    pick and lock candidates and the advisory locks of their keys, then — with a snapshot taken after those
    locks — claim per key only what the running jobs and the rate window leave room for. Returns the rows as
    :func:`claim` returns them, and when (``time.monotonic()``) the claim statement was sent: after the pick's
    lock waits, and before the leases it writes begin."""
    per_key, rate = limit.per_key, limit.rate_count is not None
    pick = _sql.limited_pick_statement(spec, per_key=per_key)
    claim_stmt = _sql.limited_claim_statement(spec, per_key=per_key, rate=rate)
    compile_ahead(conn, pick, claim_stmt)  # the starts' now() and the key locks: not a first compile's time
    with transaction(conn):
        picked = run(conn, pick, {"queue_name": queue, "batch": batch, "n": limit.concurrency})
        if not picked:
            return [], time.monotonic()
        params: dict[str, Any] = {
            "queue_name": queue, "owner": owner, "n": limit.concurrency,
            "ids": [p[0] for p in picked], "keys": [p[1] for p in picked],
        }  # fmt: skip
        if rate:
            params.update(rate_count=limit.rate_count, rate_window=limit.rate_window)
        sent = time.monotonic()
        rows = run(conn, claim_stmt, params)
    return _in_claim_order(rows, spec, queue), sent


def forget_starts(conn: Connection, spec: QueueSpec, queue: str, window: float) -> None:
    """Delete the starts of ``queue`` older than its rate window."""
    run(conn, _sql.forget_starts_statement(spec), {"queue_name": queue, "rate_window": window})


def finalize(conn: Connection, spec: QueueSpec, outcomes: Iterable[Outcome]) -> set[int]:
    """Apply outcomes in one fenced statement; returns the ids that were applied (the rest lost their lease)."""
    items = list(outcomes)
    if not items:
        return set()
    stmt = _sql.finalize_statement(spec, single=_single(items))
    return {r[0] for r in run(conn, stmt, _outcome_params(spec, items))}


def finalize_and_claim(
    conn: Connection,
    spec: QueueSpec,
    outcomes: Sequence[Outcome],
    *,
    owner: str,
    batch: int,
    lease: timedelta | None = None,
    queue: Queues = None,
    ordered: bool = False,
    ordered_types: Sequence[str] | None = None,
    fixed_batch: bool = False,
    unique_running: bool = False,
    heads: bool = False,
    rooms: Sequence[int] | None = None,
    settle: bool = True,
    levels: bool = False,
) -> tuple[set[int], list[Any]]:
    """Finalize ``outcomes`` and claim the next batch in one statement: (applied ids, claimed rows as
    :func:`claim` orders them)."""
    stmt, params = _claim_call(
        spec, outcomes, owner=owner, batch=batch, lease=lease, queue=queue, ordered=ordered,
        ordered_types=ordered_types, fixed_batch=fixed_batch, unique_running=unique_running, heads=heads,
        rooms=rooms, settle=settle, levels=levels,
    )  # fmt: skip
    rows = run(conn, stmt, params)
    return _tagged(rows, spec, queue) if outcomes else (set(), _in_claim_order(rows, spec, queue))


def send_claim(
    conn: Connection,
    spec: QueueSpec,
    outcomes: Sequence[Outcome],
    *,
    owner: str,
    batch: int,
    lease: timedelta | None = None,
    queue: Queues = None,
    ordered: bool = False,
    ordered_types: Sequence[str] | None = None,
    fixed_batch: bool = False,
    unique_running: bool = False,
    heads: bool = False,
    rooms: Sequence[int] | None = None,
    settle: bool = True,
    levels: bool = False,
) -> Callable[[], tuple[set[int], list[Any]]] | None:
    """Send the claim of the next batch — with ``outcomes`` finalized in the same statement when there are
    any — without waiting for it: the returned call waits and gives what :func:`finalize_and_claim` (or, with
    no outcomes, :func:`claim`) would have returned. None, with nothing sent, where the connection cannot send
    ahead (see :func:`sa_outbox._execute.send`)."""
    stmt, params = _claim_call(
        spec, outcomes, owner=owner, batch=batch, lease=lease, queue=queue, ordered=ordered,
        ordered_types=ordered_types, fixed_batch=fixed_batch, unique_running=unique_running, heads=heads,
        rooms=rooms, settle=settle, levels=levels,
    )  # fmt: skip
    receive = send(conn, stmt, params)
    if receive is None:
        return None
    if outcomes:
        return lambda: _tagged(receive(), spec, queue)

    def claimed() -> tuple[set[int], list[Any]]:
        return set(), _in_claim_order(receive(), spec, queue)

    return claimed


def _claim_call(
    spec: QueueSpec, outcomes: Sequence[Outcome], *, owner: str, batch: int, lease: timedelta | None,
    queue: Queues, ordered: bool, ordered_types: Sequence[str] | None, fixed_batch: bool,
    unique_running: bool, heads: bool, rooms: Sequence[int] | None, settle: bool, levels: bool,
) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """A claim's statement and parameters: :func:`_sql.claim_statement`, or with ``outcomes``
    :func:`_sql.finalize_and_claim_statement` (the outcomes written in the same statement)."""
    shape = _claim_shape(
        batch, ordered, ordered_types, fixed_batch, unique_running, heads, queue, rooms, settle, levels
    )
    params = _claim_params(spec, owner, batch, lease, queue, ordered_types, rooms)
    if not outcomes:
        return _sql.claim_statement(spec, **shape), params
    stmt = _sql.finalize_and_claim_statement(spec, **shape, single=_single(outcomes))
    return stmt, {**params, **_outcome_params(spec, outcomes)}


def _tagged(rows: list[Any], spec: QueueSpec, queue: Queues = None) -> tuple[set[int], list[Any]]:
    """The rows of :func:`_sql.finalize_and_claim_statement`, apart: (applied ids, claimed rows in the order
    of :func:`_in_claim_order`)."""
    applied: set[int] = set()
    claimed: list[Any] = []
    for row in rows:
        if row[0] == "f":
            applied.add(row[1])
        else:
            claimed.append(row[1:])
    return applied, _in_claim_order(claimed, spec, queue)


_first = itemgetter(0)


def ensure_statistics(conn: Connection, spec: QueueSpec) -> bool:
    """Give a table without planner statistics its first ``ANALYZE`` — a new table that took rows before
    autovacuum reached it (up to a minute, and never with autovacuum off). Without statistics the ordered
    claim's plan reads and sorts every ready row and probes each one's aggregate: 155 ms and 113,000 buffers per
    claim over 4,000 events, against 0.2 ms once analyzed. A loop calls it once, after its claims found rows (so
    an idle loop over an empty table asks nothing); a partitioned table is left to autovacuum, which analyzes
    its partitions. Returns False when it should be asked again (another session held the table's lock)."""
    if spec.period is not None:
        return True
    name = regclass_name(conn, spec.table)
    if conn.execute(_sql.STATISTICS_PRESENT, {"t": name}).scalar() is not False:
        return True  # present, or no such table
    conn.execute(_sql.analyze_statement(name))
    if conn.execute(_sql.STATISTICS_PRESENT, {"t": name}).scalar():
        log.info(
            "analyzed %s: it held rows but no planner statistics yet (autovacuum had not reached it)", name,
            extra={"table": spec.table.name},
        )  # fmt: skip
        return True
    why = conn.execute(_sql.ANALYZE_SKIPPED, {"t": name}).one()
    if why.may and why.locked:
        # SKIP_LOCKED: another session holds a conflicting lock — another loop's or autovacuum's ANALYZE, most
        # likely (several loops start at once), or a DDL. Not a privilege to warn about: asked again.
        log.debug(
            "ANALYZE of %s skipped: another session holds a lock on it (another ANALYZE, most likely)", name,
            extra={"table": spec.table.name},
        )  # fmt: skip
        return False
    if not why.may:  # not the owner (nor MAINTAIN): autovacuum will do it
        log.warning(
            "%s has no planner statistics yet and this role could not ANALYZE it: until autovacuum does, "
            "ordered and unique_running claims read every ready row (run ANALYZE %s, or grant MAINTAIN on "
            "PostgreSQL 17+)", name, name, extra={"table": spec.table.name},
        )  # fmt: skip
    # (else analyzed with no rows to sample: the table was emptied since the claims found rows — not asked
    # again; autovacuum analyzes it once it fills)
    return True


def extend(
    conn: Connection, spec: QueueSpec, held: Iterable[tuple[int, int]], *, lease: timedelta | None = None
) -> tuple[set[int], set[int]]:
    """Renew leases of (id, lease_version) pairs still held; returns (the ids renewed, those of them whose
    cancellation was requested)."""
    pairs = list(held)
    if not pairs:
        return set(), set()
    params: dict[str, Any] = {"ids": [p[0] for p in pairs], "versions": [p[1] for p in pairs]}
    if spec.kind == "outbox":
        params["lease"] = lease
    rows = run(conn, _sql.extend_statement(spec), params)
    return {r[0] for r in rows}, {r[0] for r in rows if r[1]}


def refund(conn: Connection, spec: QueueSpec, claims: Iterable[tuple[int, int, int]]) -> set[int]:
    """Give back the attempt of each claim (id, lease_version, attempts as claimed) whose row is still leased
    under that version — claims that will not run (:func:`_sql.refund_statement`: sent again, it changes
    nothing); returns the ids it applied to."""
    rows = list(claims)
    if not rows:
        return set()
    params = {"ids": [r[0] for r in rows], "versions": [r[1] for r in rows], "attempts": [r[2] for r in rows]}
    return {r[0] for r in run(conn, _sql.refund_statement(spec), params)}


def guard(conn: Connection, spec: QueueSpec, ids: Sequence[int], *, frozen_after: float) -> set[int]:
    """Take the lease guards of ``ids`` in the guard connection's transaction (opened here if ``conn`` has
    none; :func:`unguard` ends it): from now on no rescue takes those jobs back (``_sql``'s lease guard).
    Returns the ids guarded; a guard someone else holds is not taken, never waited for."""
    if not in_block(conn):
        control(conn, "BEGIN")
        run(conn, _sql.guard_timeout_statement(), {"timeout": f"{max(1, round(frozen_after * 1000))}ms"})
    return {row_id for row_id, taken in run(conn, _sql.guard_statement(spec), {"ids": list(ids)}) if taken}


def unguard(conn: Connection) -> None:
    """Release every lease guard the guard connection holds (its transaction commits)."""
    if in_block(conn):
        control(conn, "COMMIT")


def leased(conn: Connection, spec: QueueSpec, pairs: Iterable[tuple[int, int]]) -> set[tuple[int, int]]:
    """Which of these (id, lease_version) pairs are still leased under that version (a plain read)."""
    wanted = dict(pairs)
    rows = run(conn, _sql.leases_statement(spec), {"ids": list(wanted)})
    return {(row_id, version) for row_id, version, active in rows if active and wanted.get(row_id) == version}
