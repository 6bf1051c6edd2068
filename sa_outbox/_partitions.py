"""The partitioned layout's upkeep: partitions created ahead, finished partitions retired (docs/partitioning.md).

A model opts in with ``sa_outbox_partitioned = "day" | "week" | "month"``: its table is ``PARTITION BY RANGE
(created_at)`` with one partition per period (UTC), named ``<table>_p<YYYYMMDD>`` after the period's first day.

* There is **no default partition**: a row whose ``created_at`` has no partition is refused by PostgreSQL
  (the producer's transaction fails loudly) instead of landing in a catch-all that is never retired.
  :func:`maintain_partitions` keeps ``ahead`` periods created beyond the current one, and ``doctor`` fails
  when the current period has no partition and warns when the next one has none.
* A partition is **retired** (``DETACH PARTITION … CONCURRENTLY``, then ``DROP TABLE``, or kept detached with
  ``archive=True``) once its period has ended and no row in it is unfinished (ready or leased) — nor dead,
  unless ``keep_dead=False``: a dead row is an operator's to-do. Otherwise it is kept, and reported with its
  counts (``status`` shows such partitions too).

Why a retired partition cannot lose a row, nor hide one: ``created_at`` defaults to ``now()``, the
*transaction's* start on the database clock (no client clock, so no skew between hosts), so only a
transaction that began before the period ended — or one that gives ``created_at`` — can still write into it.
Before the detach, the partition is *closed*: a ``CHECK (false) NOT VALID`` constraint, added in a transaction
that then counts the unfinished rows again (:func:`_close`). Its lock waits for every transaction that wrote
into the partition, so the count sees all they committed; found any, the transaction rolls back and the
partition is kept. Committed, every later insert into the partition, or update of a row in it, fails loudly.
So the rows a ``DETACH … CONCURRENTLY`` hides from new snapshots while it runs are all finished (an ordered
aggregate's earlier event is never among them), and none can arrive afterwards — not even from a REPEATABLE
READ transaction whose snapshot still sees the partition attached. The rows are counted once more on the
detached table (attached again, and opened, should any be unfinished), then it is dropped.

:class:`PartitionMaintainer` runs this from the loops (``maintain_partitions=`` on a Dispatcher/Worker): due at
start, then every interval, on a thread (sync) or a task (async) with its own connection — never the loop's
claim connection — and never waited for when the loop stops.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

from sqlalchemy import BigInteger, Connection, Engine, Table, any_, bindparam, column, func, select, text
from sqlalchemy import table as sql_table
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.exc import DBAPIError, ProgrammingError

from . import _sql
from ._durations import Duration, to_seconds
from .errors import ConfigurationError, PartitionClosedError, SchemaError

__all__ = [
    "PARTITION_PERIODS",
    "PartitionInfo",
    "PartitionMaintainer",
    "PartitionReport",
    "list_partitions",
    "maintain_partitions",
    "partition_period",
]

log = logging.getLogger("sa_outbox.partitions")

#: The periods of the partitioned layout (UTC; a week starts on Monday).
PARTITION_PERIODS: tuple[str, ...] = ("day", "week", "month")
#: Periods created beyond the current one by default.
DEFAULT_AHEAD = 3
#: Longest wait for the lock that closes an ended partition to writes (:func:`_close`): claims queue behind it.
CLOSE_LOCK_TIMEOUT = "1s"


def partition_period(model: Any) -> str | None:
    """The model's ``sa_outbox_partitioned`` setting, checked: ``None`` or one of :data:`PARTITION_PERIODS`."""
    value = getattr(model, "sa_outbox_partitioned", None)
    if value is None:
        return None
    if value not in PARTITION_PERIODS:
        name = getattr(model, "__name__", model)
        raise ConfigurationError(
            f"{name}.sa_outbox_partitioned = {value!r}: use one of {', '.join(map(repr, PARTITION_PERIODS))} "
            "(or None for a plain table)"
        )
    return str(value)


def period_start(moment: datetime, period: str) -> datetime:
    """The start (UTC midnight) of the period that contains ``moment``."""
    day = moment.astimezone(UTC).date()
    if period == "week":
        day -= timedelta(days=day.weekday())
    elif period == "month":
        day = day.replace(day=1)
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


def next_start(start: datetime, period: str) -> datetime:
    if period == "day":
        return start + timedelta(days=1)
    if period == "week":
        return start + timedelta(days=7)
    first = date(start.year + start.month // 12, start.month % 12 + 1, 1)
    return datetime(first.year, first.month, 1, tzinfo=UTC)


def partition_name(table: str, start: datetime) -> str:
    name = f"{table}_p{start:%Y%m%d}"
    if len(name.encode()) > 63:
        raise ConfigurationError(
            f"partition name {name!r} is longer than PostgreSQL's 63 bytes: use a shorter table name"
        )
    return name


@dataclass(frozen=True)
class PartitionInfo:
    """One partition of a partitioned outbox/jobs table. ``lower``/``upper`` are ``None`` for a DEFAULT
    partition (or unbounded ones), which sa_outbox never creates nor retires."""

    name: str
    schema: str
    lower: datetime | None
    upper: datetime | None
    is_default: bool
    detach_pending: bool
    #: Rows not finished yet (ready or leased), and dead/failed rows: what keeps a past partition alive.
    unfinished: int
    dead: int
    #: Closed to writes by a retire (a check no row passes): one in progress, or one whose run stopped before the
    #: detach — the next :func:`maintain_partitions` retires it or opens it again. Its rows cannot be changed
    #: meanwhile (retrying a dead row in it is refused).
    closed: bool = False

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("lower", "upper"):
            if data[key] is not None:
                data[key] = data[key].isoformat()
        return data


@dataclass(frozen=True)
class PartitionReport:
    """What one :func:`maintain_partitions` did: partitions created, retired (dropped) or archived (detached
    and kept as plain tables), kept because rows in them are unfinished (name → ``{"unfinished": n,
    "dead": n}``), and errors (one line each; maintenance goes on with the next partition)."""

    table: str
    created: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    archived: list[str] = field(default_factory=list)
    kept: dict[str, dict[str, int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _table_of(conn: Connection, model: Any) -> tuple[_sql.QueueSpec, Table]:
    """The model's spec and table, in the schema the connection's ``schema_translate_map`` puts it (the DDL
    and catalog lookups here name the table in text, beyond the map's reach)."""
    spec = _sql.translated_spec(conn, _sql.spec_for(model))
    return spec, spec.table


def regclass_name(conn: Connection, table: Table) -> str:
    """The table's name quoted as ``CAST(:name AS regclass)`` needs it (schema-qualified, case kept) — in the
    schema the connection's ``schema_translate_map`` (a tenant's) moves it to: a name in text is beyond the
    map's reach."""
    moved, schema = _sql.translated_schema(conn, table.schema)
    prep = _sql.text_preparer(conn.dialect)
    if not moved:
        return str(prep.format_table(table))
    return f"{prep.quote_schema(schema)}.{prep.quote(table.name)}" if schema else prep.quote(table.name)


def is_partitioned(conn: Connection, table: Table) -> bool:
    """Whether the database's table is range-partitioned (whatever the model says)."""
    return conn.execute(_sql.PARTITION_STRATEGY, {"t": regclass_name(conn, table)}).scalar() == "r"


def _partitions(
    conn: Connection, table: Table, spec: _sql.QueueSpec | None = None, *, counts: bool
) -> list[PartitionInfo]:
    out = []
    for r in conn.execute(_sql.PARTITIONS, {"t": regclass_name(conn, table)}):
        ready = active = dead = 0
        if counts and spec is not None and not r.detach_pending:
            part = _sql.partition_table(r.name, r.schema)
            ready, active, dead = conn.execute(_sql.partition_counts(spec, part)).one()
        out.append(
            PartitionInfo(
                r.name, r.schema, r.lower, r.upper, bool(r.is_default), bool(r.detach_pending),
                int(ready) + int(active), int(dead), bool(r.closed),
            )
        )  # fmt: skip
    return out


def list_partitions(
    bind: Engine | Connection, model: type[Any], *, counts: bool = True
) -> list[PartitionInfo]:
    """The partitions of ``model``'s table, oldest first, with their unfinished and dead rows (each counted
    through the partition's partial indexes; ``counts=False`` skips them). Empty for a plain table."""
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            return list_partitions(conn, model, counts=counts)
    spec, table = _table_of(bind, model)
    if not is_partitioned(bind, table):
        return []
    return _partitions(bind, table, spec, counts=counts)


def infer_period(parts: list[PartitionInfo]) -> str | None:
    """The period of existing partitions (for a table known only by name, as the CLI's)."""
    for p in reversed(parts):
        if p.lower is not None and p.upper is not None:
            days = (p.upper - p.lower).days
            return "day" if days == 1 else "week" if days == 7 else "month" if 28 <= days <= 31 else None
    return None


def table_period(conn: Connection, table: str, schema: str | None = None) -> str | None:
    """The partition period of an existing table known by name (None: not partitioned), from its partitions'
    bounds ("day" when it has no bounded partition yet)."""
    from sqlalchemy import MetaData

    bare = Table(table, MetaData(), schema=schema)
    if not is_partitioned(conn, bare):
        return None
    return infer_period(_partitions(conn, bare, counts=False)) or "day"


def held_partitions(conn: Connection, model: type[Any]) -> list[PartitionInfo]:
    """Partitions whose period has ended and that unfinished or dead rows keep alive (``status``)."""
    spec, table = _table_of(conn, model)
    if not is_partitioned(conn, table):
        return []
    now = conn.execute(text("SELECT now()")).scalar_one()
    return [
        p
        for p in _partitions(conn, table, spec, counts=True)
        if p.upper is not None and p.upper <= now and (p.unfinished or p.dead)
    ]


def closed_holding(conn: Connection, model: type[Any], ids: list[int]) -> dict[str, int]:
    """The closed partitions (:attr:`PartitionInfo.closed`) of ``model``'s table that hold any of ``ids``: name
    → how many of them. Empty for a plain table, and when no partition is closed (two catalog queries). Logs a
    WARNING for each partition whose detach is pending: its rows are hidden from every selection."""
    spec, table = _table_of(conn, model)
    if not is_partitioned(conn, table):
        return {}
    found: dict[str, int] = {}
    for p in _partitions(conn, table, counts=False):
        if p.detach_pending:  # PostgreSQL hides its rows from every new snapshot: none can be selected
            log.warning(
                "the rows of partition %s of %s are hidden from this selection: a retire's detach of it has not "
                "finished (`%s` finishes it, and attaches it again if rows hold it)", p.name, table.fullname,
                partitions_command(spec),
                extra={"table": table.fullname, "partition": p.name},
            )  # fmt: skip
        if p.closed and ids:
            part = sql_table(p.name, column("id", BigInteger), schema=p.schema)
            held = conn.execute(
                select(func.count())
                .select_from(part)
                .where(part.c.id == any_(bindparam("ids", ids, type_=ARRAY(BigInteger))))
            ).scalar_one()
            if held:
                found[p.name] = int(held)
    return found


def refuse_closed(conn: Connection, model: type[Any], ids: list[int], action: str) -> None:
    """Raise :class:`PartitionClosedError` naming them when some of ``ids`` are in closed partitions: their rows
    cannot be changed (each UPDATE would fail on the closing check, batches after others had committed)."""
    found = closed_holding(conn, model, ids)
    if found:
        spec, _ = _table_of(conn, model)
        raise PartitionClosedError(
            f"{closed_message(spec, found, action)}. Nothing was changed", changed=[], partitions=found
        )


def closed_message(spec: _sql.QueueSpec, found: dict[str, int], action: str) -> str:
    """Why rows in closed partitions (``found``: name → how many) cannot be changed, and what to run
    (``spec``: as the connection's schema_translate_map places the table)."""
    held = ", ".join(f"{name} ({n})" for name, n in found.items())
    return (
        f"cannot {action} {sum(found.values())} of the selected row(s): they are in partition(s) that a retire "
        f"has closed to writes, {held}. A retire drops a past partition once every row in it is finished "
        f"({spec.dead} rows too, with --retire-dead), and closes it first; a run that stopped before dropping "
        f"it leaves it closed. `{partitions_command(spec)}` without --retire-dead opens such a partition again "
        f"when {spec.dead} rows hold it, and drops it otherwise (copy what you need from it first)"
    )


def partitions_command(spec: _sql.QueueSpec) -> str:
    """The command that maintains this table's partitions (the table option when needed)."""
    name = spec.table.fullname
    return "sa-outbox partitions maintain" + (
        "" if name in ("outbox", "jobs") else f" --{spec.kind}-table {name}"
    )


def is_closed_error(exc: BaseException) -> bool:
    """Whether a database error is a write refused by a closed partition's check."""
    diag = getattr(getattr(exc, "orig", None), "diag", None)
    return getattr(diag, "constraint_name", None) == _sql.RETIRING_CONSTRAINT


def missing_periods(conn: Connection, model: type[Any], *, ahead: int = 1) -> list[datetime]:
    """Starts of the current and the next ``ahead`` periods that have no partition (``doctor``)."""
    spec, table = _table_of(conn, model)
    if not is_partitioned(conn, table):
        return []
    parts = _partitions(conn, table, counts=False)
    period = spec.period or infer_period(parts) or "day"
    now = conn.execute(text("SELECT now()")).scalar_one()
    start, missing = period_start(now, period), []
    for _ in range(ahead + 1):
        end = next_start(start, period)
        covered = any(
            p.is_default
            or (p.lower is not None and p.upper is not None and p.lower <= start and end <= p.upper)
            for p in parts
        )
        if not covered:
            missing.append(start)
        start = end
    return missing


def maintain_partitions(
    bind: Engine | Connection,
    model: type[Any],
    *,
    ahead: int = DEFAULT_AHEAD,
    archive: bool = False,
    keep_dead: bool = True,
    period: str | None = None,
) -> PartitionReport:
    """Create the partitions of the current period and ``ahead`` more, and retire every past partition in
    which no row is unfinished (nor dead, with ``keep_dead``): ``DETACH … CONCURRENTLY``, a second count on
    the detached table, then ``DROP TABLE`` (``archive=True``: keep it detached, as a plain table).

    ``bind`` is an Engine (a connection of its pool is used in autocommit) or a Connection that is not in a
    transaction (switched to autocommit: ``DETACH … CONCURRENTLY`` cannot run inside one). ``period``
    defaults to the model's ``sa_outbox_partitioned``, then to that of the existing partitions. Raises
    :class:`SchemaError` when the table is not partitioned; per-partition failures go to ``errors``."""
    if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
        raise ConfigurationError(f"ahead must be an integer >= 0, got {ahead!r}")
    if period is not None and period not in PARTITION_PERIODS:
        raise ConfigurationError(f"period must be one of {', '.join(PARTITION_PERIODS)}, got {period!r}")
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            return maintain_partitions(
                conn, model, ahead=ahead, archive=archive, keep_dead=keep_dead, period=period
            )
    conn = bind
    if conn.in_transaction():
        raise ConfigurationError(
            "maintain_partitions needs a connection outside any transaction (DETACH … CONCURRENTLY cannot "
            "run inside one): pass the Engine, or a Connection before its first statement"
        )
    conn.execution_options(isolation_level="AUTOCOMMIT")
    spec, table = _table_of(conn, model)
    if not is_partitioned(conn, table):
        raise SchemaError(
            f"{table.fullname} is not a partitioned table: create it with sa_outbox_partitioned set on the model "
            "(docs/partitioning.md)"
        )
    report = PartitionReport(table.fullname)
    parts = _partitions(conn, table, counts=False)
    period = period or spec.period or infer_period(parts)
    if period is None:
        raise SchemaError(
            f"{table.fullname}: cannot tell its partition period (no bounded partition): pass period="
        )
    _finalize_interrupted(conn, table, parts, report)
    _resume_retiring(conn, spec, keep_dead=keep_dead, report=report)
    _create_ahead(conn, table, parts, period, ahead, report)
    _retire(conn, spec, parts, archive=archive, keep_dead=keep_dead, report=report)
    return report


def create_partitions(
    bind: Connection, table: Table, period: str, *, ahead: int = DEFAULT_AHEAD, since: datetime | None = None
) -> list[str]:
    """Create the current period's partition and ``ahead`` more (idempotent) — from the period of ``since``
    on when it is given (converting a table whose unfinished rows are older); the names created. Used by the
    migration helper and the ``create_all`` hook (in the caller's transaction)."""
    if period not in PARTITION_PERIODS:
        raise ConfigurationError(f"period must be one of {', '.join(PARTITION_PERIODS)}, got {period!r}")
    report = PartitionReport(table.fullname)
    parts = _partitions(bind, table, counts=False) if is_partitioned(bind, table) else []
    _create_ahead(bind, table, parts, period, ahead, report, in_transaction=True, since=since)
    if report.errors:
        raise SchemaError("; ".join(report.errors))
    return report.created


def _finalize_interrupted(
    conn: Connection, table: Table, parts: list[PartitionInfo], report: PartitionReport
) -> None:
    """A ``DETACH … CONCURRENTLY`` that was interrupted (the process died) leaves the partition "detach
    pending": finish it, then the partition is retired like any other on the next run."""
    prep = _sql.text_preparer(conn.dialect)
    for p in parts:
        if p.detach_pending:
            try:
                if not _detach(conn, table, p.name, mode="finalize"):
                    continue
                if p.lower is not None and p.upper is not None:  # attach again: the retire step decides
                    if p.closed:
                        _reopen(conn, p.name, p.schema)
                    conn.execute(text(_sql.attach_partition_ddl(prep, table, p.name, p.lower, p.upper)))
            except DBAPIError as exc:
                report.errors.append(f"{p.name}: could not finish an interrupted detach: {_one_line(exc)}")


def _detach(conn: Connection, table: Table, name: str, *, mode: str) -> bool:
    """``DETACH PARTITION … CONCURRENTLY`` / ``… FINALIZE``: True when this run did it; False when it failed
    because another maintainer got there first — the partition is no longer "detach pending" (every loop runs
    the partition step, and a detach that only waits for older transactions reads "detach pending" just as
    one whose maintainer died, so a second maintainer's FINALIZE may finish it, and the first's DETACH then
    fails: "… is not a partition of …"). The other maintainer attaches it again (or, should it die first, the
    next run finds the detached table by its retiring mark); a later run decides. Any other failure is
    raised."""
    try:
        conn.execute(
            text(_sql.detach_partition_ddl(_sql.text_preparer(conn.dialect), table, name, mode=mode))
        )
        return True
    except DBAPIError as exc:
        found = _partition_named(conn, table, name)
        sqlstate = getattr(exc.orig, "sqlstate", None)
        if found is not None and found.detach_pending:
            if mode == "concurrently" and sqlstate == "55000":
                # "already pending detach": another maintainer's DETACH marked it after this run listed and
                # closed it, and waits for older transactions — that one settles it (or, should it die, the next
                # run's FINALIZE). A step of this run that failed past its own mark raises something else (a
                # lock or statement timeout, a cancel)
                return False
            raise
        # (a FINALIZE that failed for a reason of its own leaves the detach pending; a DETACH … CONCURRENTLY
        # refused before it marked the partition, e.g. for want of a privilege, leaves it attached: told apart
        # from the race by its SQLSTATE — the race's "is not a partition of" is undefined_table. When the other
        # maintainer's FINALIZE and its attach-again both land while this DETACH waits, its second step finds
        # the partition attached with no detach pending: object_not_in_prerequisite_state, told apart from
        # other refusals of that state by its detail, "There's no pending concurrent detach." — on a server
        # whose messages are not in English that case stays a reported error, and a later run decides)
        diag = getattr(exc.orig, "diag", None)
        no_pending = sqlstate == "55000" and "no pending concurrent detach" in (
            getattr(diag, "message_detail", None) or ""
        )
        if mode == "finalize" or sqlstate == "42P01" or no_pending:
            return False
        raise


def _partition_named(conn: Connection, table: Table, name: str) -> PartitionInfo | None:
    """Partition ``name`` of ``table`` as the catalog has it now (None: not a partition of it any more) — read
    again after a step failed, to tell another maintainer's work from a failure of this run's."""
    return next((p for p in _partitions(conn, table, counts=False) if p.name == name), None)


def _create_ahead(
    conn: Connection,
    table: Table,
    parts: list[PartitionInfo],
    period: str,
    ahead: int,
    report: PartitionReport,
    *,
    in_transaction: bool = False,
    since: datetime | None = None,
) -> None:
    from .migration import storage_parameters_sql

    prep = _sql.text_preparer(conn.dialect)
    now = conn.execute(text("SELECT now()")).scalar_one()
    start = period_start(min(now, since) if since is not None else now, period)
    last = period_start(now, period)
    for _ in range(ahead):
        last = next_start(last, period)
    while start <= last:
        end = next_start(start, period)
        overlaps = any(
            p.lower is not None and p.upper is not None and p.lower < end and start < p.upper for p in parts
        )
        if not overlaps:
            name = partition_name(table.name, start)
            ddl = _sql.create_partition_ddl(prep, table, name, start, end, storage_parameters_sql())
            try:
                if in_transaction:
                    conn.execute(text(ddl))
                else:
                    _with_lock_timeout(conn, ddl)
                report.created.append(name)
                log.info("created partition %s of %s", name, table.fullname,
                         extra={"table": table.fullname, "partition": name})  # fmt: skip
            except DBAPIError as exc:
                if in_transaction:
                    raise
                report.errors.append(f"{name}: could not create it: {_one_line(exc)}")
        start = end


@contextmanager
def _short_lock_wait(conn: Connection, timeout: str) -> Iterator[dict[str, bool]]:
    """A READ COMMITTED transaction block of its own with a short lock wait, on an autocommit connection: DDL
    that takes an ACCESS EXCLUSIVE lock (on the parent to create a partition, on a partition to close or
    reopen it) queued behind a long transaction would stall every claim — and insert — behind it. Committed at
    the end unless the block sets ``["commit"]`` false; rolled back on an exception. (An explicit BEGIN:
    SQLAlchemy's ``begin()`` sends none in autocommit, and ``SET LOCAL`` needs one. READ COMMITTED whatever the
    session's default: a statement after the lock must see what committed during the wait.)"""
    conn.exec_driver_sql("BEGIN ISOLATION LEVEL READ COMMITTED")
    outcome = {"commit": True}
    try:
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{timeout}'")
        yield outcome
    except BaseException:
        conn.exec_driver_sql("ROLLBACK")
        raise
    conn.exec_driver_sql("COMMIT" if outcome["commit"] else "ROLLBACK")


def _with_lock_timeout(conn: Connection, ddl: str, timeout: str = "5s") -> None:
    """Run ``ddl`` alone in a :func:`_short_lock_wait` block."""
    with _short_lock_wait(conn, timeout):
        conn.execute(text(ddl))


def _retire(
    conn: Connection,
    spec: _sql.QueueSpec,
    parts: list[PartitionInfo],
    *,
    archive: bool,
    keep_dead: bool,
    report: PartitionReport,
) -> None:
    table = spec.table
    prep = _sql.text_preparer(conn.dialect)
    now = conn.execute(text("SELECT now()")).scalar_one()
    for p in parts:
        if p.is_default or p.detach_pending or p.lower is None or p.upper is None or p.upper > now:
            continue  # only ended periods, bounded, attached
        part = _sql.partition_table(p.name, p.schema)
        try:
            counts = _held(conn, spec, part, keep_dead)
            if counts is None:
                try:
                    counts = _close(conn, spec, part, keep_dead)
                except DBAPIError:
                    # another maintainer is retiring it ("detach pending", or gone): its DETACH … CONCURRENTLY
                    # holds a lock on the partition while it waits for older transactions — it settles it
                    found = _partition_named(conn, table, p.name)
                    if found is None or found.detach_pending:
                        continue
                    raise
            if counts is not None:
                report.kept[p.name] = counts
                if p.closed:  # (by a run that died before detaching it; a close just made was rolled back)
                    _reopen(conn, p.name, p.schema)
                continue
            # Marked first: should this process die once the detach has completed on the server, the next
            # run finds the detached table by its comment, counts again and attaches or finishes it.
            mode = "archive" if archive else "drop"
            marker = f"{_sql.RETIRING}{mode}|{p.lower.isoformat()}|{p.upper.isoformat()}|{table.fullname}"
            conn.execute(text(_sql.comment_table_ddl(prep, p.name, p.schema, marker)))
            if not _detach(conn, table, p.name, mode="concurrently"):
                continue
            # Detached: every transaction that could still write into it has ended. Count again.
            _settle_detached(conn, spec, p.name, p.lower, p.upper, archive=archive, keep_dead=keep_dead,
                             report=report)  # fmt: skip
        except DBAPIError as exc:
            report.errors.append(f"{p.name}: could not retire it: {_one_line(exc)}")


def _close(conn: Connection, spec: _sql.QueueSpec, part: Table, keep_dead: bool) -> dict[str, int] | None:
    """Close an ended partition to writes and count it again: None when it is closed and may go, else the
    counts that keep it (and it is left open).

    Both in one transaction: the constraint's ACCESS EXCLUSIVE lock waits for every transaction that wrote
    into the partition, so the count — a new snapshot, after the lock — sees each row they committed, and no
    row can be added or made unfinished afterwards: a late write fails loudly instead. Without it a late
    producer's row could commit while the partition was "detach pending", which new snapshots do not see:
    an ordered aggregate's next event, written into today's partition, was delivered first; and a REPEATABLE
    READ producer whose snapshot predated the detach inserted into the table after the detach had returned,
    and the drop took its committed row (a hostile review: ``test_partitions.py``). The lock blocks the
    claims (they lock every partition) while it waits, so it waits ``CLOSE_LOCK_TIMEOUT`` at most; a run that
    cannot close the partition reports it, and a later run tries again."""
    # (READ COMMITTED, as every such block: under REPEATABLE READ the count's snapshot was the transaction's
    # first, older than a late producer's commit during the wait — a hostile review)
    with _short_lock_wait(conn, CLOSE_LOCK_TIMEOUT) as outcome:
        conn.execute(text(_sql.close_partition_ddl(_sql.text_preparer(conn.dialect), part.name, part.schema)))
        counts = _held(conn, spec, part, keep_dead)
        outcome["commit"] = counts is None
    return counts


def _reopen(conn: Connection, name: str, schema: str | None) -> None:
    """Drop the retiring constraint from a closed partition that is kept (or a detached table that is attached
    again or archived) — waiting ``CLOSE_LOCK_TIMEOUT`` at most for its lock, as the close does: claims queue
    behind it (a hostile review: a claim stalled for the whole 8 s of a reader's transaction). The callers know
    it is closed (:attr:`PartitionInfo.closed`; a table marked as retiring was closed before its detach)."""
    _with_lock_timeout(
        conn, _sql.reopen_partition_ddl(_sql.text_preparer(conn.dialect), name, schema), CLOSE_LOCK_TIMEOUT
    )


def _settle_detached(
    conn: Connection, spec: _sql.QueueSpec, name: str, lower: datetime, upper: datetime, *, archive: bool,
    keep_dead: bool, report: PartitionReport,
) -> None:  # fmt: skip
    """The second half of a retire, on a partition detached from ``spec``'s table: attach it again if rows in it
    are unfinished (or dead, with ``keep_dead``), else drop it (or keep it as a table, ``archive``). A failure
    is no failure of this run when the table meanwhile stopped being a marked, detached table — another
    maintainer settled it (the one whose detach had just completed, or a second run resuming it too: both
    count the same rows, as nothing writes into a detached table, so both decide the same)."""
    try:
        _settle_detached_now(
            conn, spec, name, lower, upper, archive=archive, keep_dead=keep_dead, report=report
        )
    except DBAPIError:
        if name in _retiring(conn, spec.table):
            raise


def _settle_detached_now(
    conn: Connection, spec: _sql.QueueSpec, name: str, lower: datetime, upper: datetime, *, archive: bool,
    keep_dead: bool, report: PartitionReport,
) -> None:  # fmt: skip
    table = spec.table
    prep = _sql.text_preparer(conn.dialect)
    counts = _held(conn, spec, _sql.partition_table(name, table.schema), keep_dead)
    if counts is not None or archive:
        _reopen(conn, name, table.schema)
    if counts is not None:
        conn.execute(text(_sql.attach_partition_ddl(prep, table, name, lower, upper)))
        conn.execute(text(_sql.comment_table_ddl(prep, name, table.schema, None)))
        report.kept[name] = counts
        log.warning(
            "partition %s of %s holds rows that keep it (%d unfinished, %d %s) after its detach: attached again",
            name, table.fullname, counts["unfinished"], counts["dead"], spec.dead,
            extra={"table": table.fullname, "partition": name, **counts},
        )  # fmt: skip
        return
    if archive:
        conn.execute(
            text(_sql.comment_table_ddl(prep, name, table.schema, f"sa_outbox:archived:{table.fullname}"))
        )
        report.archived.append(name)
        log.info("archived partition %s of %s (detached, kept as a table)", name, table.fullname,
                 extra={"table": table.fullname, "partition": name})  # fmt: skip
    else:
        conn.execute(text(_sql.drop_partition_ddl(prep, name, table.schema)))
        report.retired.append(name)
        log.info("retired partition %s of %s", name, table.fullname,
                 extra={"table": table.fullname, "partition": name})  # fmt: skip


def _resume_retiring(
    conn: Connection, spec: _sql.QueueSpec, *, keep_dead: bool, report: PartitionReport
) -> None:
    """Finish the retires a process left half done: a partition detached (``DETACH … CONCURRENTLY`` completes
    on the server even when its client is gone) but neither counted again nor dropped. Its rows may include a
    late producer's unfinished ones, which only an attached partition lets the loops see."""
    for name, (mode, lower_text, upper_text) in _retiring(conn, spec.table).items():
        try:
            _settle_detached(
                conn, spec, name, datetime.fromisoformat(lower_text), datetime.fromisoformat(upper_text),
                archive=mode == "archive", keep_dead=keep_dead, report=report,
            )  # fmt: skip
        except (DBAPIError, ValueError) as exc:
            report.errors.append(f"{name}: could not finish its interrupted retire: {_one_line(exc)}")


def interrupted_retires(conn: Connection, model: type[Any]) -> list[str]:
    """The tables detached from ``model``'s table by a retire that has not settled them yet (in progress, or
    its run stopped): the next :func:`maintain_partitions` finishes each."""
    _, table = _table_of(conn, model)
    return sorted(_retiring(conn, table))


def _retiring(conn: Connection, table: Table) -> dict[str, tuple[str, str, str]]:
    """The detached tables of ``table`` that carry the retiring mark: name -> (mode, lower, upper) as marked."""
    found: dict[str, tuple[str, str, str]] = {}
    rows = conn.execute(
        _sql.RETIRING_TABLES, {"schema": table.schema or "public", "prefix": _sql.RETIRING}
    ).all()
    for name, comment in rows:
        fields = comment[len(_sql.RETIRING) :].split("|", 3)
        if len(fields) == 4 and fields[3] == table.fullname:  # (not another table's)
            found[name] = (fields[0], fields[1], fields[2])
    return found


def _held(conn: Connection, spec: _sql.QueueSpec, part: Table, keep_dead: bool) -> dict[str, int] | None:
    """The counts that keep a partition alive, or None when it may go."""
    ready, active, dead = conn.execute(_sql.partition_counts(spec, part)).one()
    if ready or active or (dead and keep_dead):
        return {"unfinished": int(ready) + int(active), "dead": int(dead)}
    return None


def _one_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    return str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__


class PartitionMaintainer:
    """The loops' partition step (``maintain_partitions=INTERVAL`` on a Dispatcher/Worker): due at the first
    turn, then every ``interval``; runs :func:`maintain_partitions` off the loop — a daemon thread with a
    pooled connection of the loop's engine (sync) or a task on an ``AsyncConnection`` (async) — so a claim
    never waits for it and stopping never waits for it. A table that is not partitioned (or missing:
    SchemaError/ProgrammingError) is reported at WARNING once and the step turns itself off; other errors are
    logged at WARNING and tried again at the next interval; created/retired partitions are logged at INFO."""

    def __init__(self, model: type[Any], interval: Duration, owner: str) -> None:
        self.model = model
        self.interval = to_seconds(interval, name="maintain_partitions", allow_zero=False)
        self.owner = owner
        self.enabled = True
        self.next_at = 0.0  # due at once
        self.thread: threading.Thread | None = None
        self.task: asyncio.Task[None] | None = None
        self.last: PartitionReport | None = None

    def due(self, now: float) -> bool:
        return self.enabled and now >= self.next_at and not self.busy()

    def busy(self) -> bool:
        return (self.thread is not None and self.thread.is_alive()) or (
            self.task is not None and not self.task.done()
        )

    def start_thread(self, engine: Engine) -> None:
        self.next_at = time.monotonic() + self.interval
        self.thread = threading.Thread(
            target=self._run, args=(engine,), name="sa_outbox-partitions", daemon=True
        )
        self.thread.start()

    def start_task(self, engine: Any) -> None:
        """``engine`` is an AsyncEngine: the step runs on one of its connections through ``run_sync``."""
        self.next_at = time.monotonic() + self.interval

        async def run() -> None:
            try:
                async with engine.connect() as conn:
                    report = await conn.run_sync(lambda c: maintain_partitions(c, self.model))
                self._done(report)
            except Exception as exc:
                self._failed(exc)

        self.task = asyncio.get_running_loop().create_task(run(), name="sa_outbox-partitions")

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the running sync step (tests)."""
        if self.thread is not None:
            self.thread.join(timeout)

    def _run(self, engine: Engine) -> None:
        try:
            report = maintain_partitions(engine, self.model)
        except Exception as exc:
            self._failed(exc)
        else:
            self._done(report)

    def _done(self, report: PartitionReport) -> None:
        self.last = report
        for line in report.errors:
            log.warning("partition maintenance of %s: %s", report.table, line,
                        extra={"owner": self.owner, "table": report.table})  # fmt: skip
        if report.kept:
            log.info("partitions of %s kept by unfinished rows: %s", report.table, report.kept,
                     extra={"owner": self.owner, "table": report.table})  # fmt: skip

    def _failed(self, exc: Exception) -> None:
        if isinstance(exc, SchemaError | ProgrammingError):
            self.enabled = False
            log.warning("partition maintenance turned off: %s", _one_line(exc), extra={"owner": self.owner})
        else:
            log.warning("partition maintenance failed (tried again in %gs): %s", self.interval,
                        _one_line(exc), extra={"owner": self.owner})  # fmt: skip
