"""Cron schedules: declared in code, kept in a table, fired by any number of processes — each slot once.

A :class:`Schedule` is a value declared in code; :func:`sync_schedules` writes the declared ones to a table
with :class:`~sa_outbox.ScheduleMixin` (at start-up; also at run time to add one), keeping each schedule's
``next_run_at`` — its next slot — and its run-time ``paused`` flag. :func:`fire_due_schedules` is the
firing step, meant to run about once a second in every worker (it rides on the loops' maintenance step):

1. **Read** the due schedules: ``SELECT … WHERE NOT paused AND next_run_at <= now() … FOR UPDATE SKIP
   LOCKED`` (in a transaction the row locks keep other firers off those schedules until it ends).
2. **Plan** in Python, with the cron library, in the schedule's time zone: which slots to fire (the catch-up
   policy) and the next slot after ``now()`` — every time is the database's.
3. **Fire** in *one* statement: a compare-and-set of each schedule (``UPDATE … SET next_run_at = <next>
   WHERE name = … AND next_run_at = <the value read> AND NOT paused``) whose ``RETURNING`` feeds the
   ``INSERT`` of the slots' jobs (unique key ``schedule:<name>:<slot UTC>``, ``ON CONFLICT DO NOTHING``).
   A job exists if and only if its schedule moved past its slot.

A slot is therefore never fired twice and never lost, whatever is killed where: a process that dies after
step 1 wrote nothing (its row locks go with its connection) and the slot is still due for the next firer; step
3 is atomic; a second firer that read the same row (on an autocommit connection, like a worker's loop
connection, nothing is locked between the statements) fails the compare-and-set and inserts nothing.
(``tests/test_schedules.py`` kills firers with SIGKILL between the two statements and anywhere else.)

Catch-up, for slots missed while nothing fired (downtime): ``latest`` (default) fires the most recent missed
slot once; ``all`` fires every missed slot, oldest first, at most :data:`CATCH_UP_LIMIT` (the newest ones);
``none`` fires a slot only when it is less than :data:`ON_TIME` late. Daylight saving follows the time zone,
as Debian's cron does (cronsim's rules): a time that does not exist (spring forward) runs right after the
jump, once; a time that happens twice (fall back) runs once — unless the hour field is ``*`` (an hourly job
runs in both hours). croniter fires a daily 02:30 job twice on the fall-back day, which is why the cron
library here is cronsim.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass, field
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from sqlalchemy import (
    ARRAY,
    Connection,
    DateTime,
    Engine,
    Integer,
    Table,
    Text,
    bindparam,
    case,
    column,
    func,
    literal_column,
    not_,
    select,
    text,
    tuple_,
    union_all,
    update,
)
from sqlalchemy import cast as sa_cast
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from . import _enqueue
from ._execute import run
from ._names import channel_for
from ._payload import check_int, check_payload, require_text
from .errors import ConfigurationError, PayloadError

__all__ = [
    "CATCH_UP_LIMIT",
    "ON_TIME",
    "Due",
    "Schedule",
    "fire",
    "fire_due_schedules",
    "pause_schedule",
    "read_due",
    "resume_schedule",
    "run_schedule_now",
    "slot_key",
    "sync_schedules",
]

log = logging.getLogger("sa_outbox.schedules")

#: ``catch_up="all"`` fires at most this many missed slots of one schedule (the newest), in one firing.
CATCH_UP_LIMIT = 100
#: ``catch_up="none"`` fires a slot only when it is at most this late (otherwise it was missed: skipped).
ON_TIME = dt.timedelta(minutes=1)
#: The longest schedule name (the name goes into every job's unique key, in a btree index entry).
NAME_MAX = 200
CATCH_UP = ("latest", "all", "none")
_INT4 = (-(2**31), 2**31 - 1)

Bind = Engine | Connection | Session


def _zone(tz: str) -> dt.tzinfo:
    return dt.UTC if tz == "UTC" else ZoneInfo(tz)


def _config(check: Any, *args: Any, **kwargs: Any) -> Any:
    """Run one of the payload module's checks, as a ConfigurationError (a schedule is configuration)."""
    try:
        return check(*args, **kwargs)
    except PayloadError as exc:
        raise ConfigurationError(str(exc)) from None


@dataclass(frozen=True)
class Schedule:
    """A cron schedule declared in code: every slot of ``cron`` (read in time zone ``tz``) enqueues one job of
    ``task`` with ``payload`` on ``queue``.

    ``cron`` has five fields (minute, hour, day of month, month, day of week; ``@daily`` and friends are
    not accepted), or six with a leading seconds field. ``catch_up`` says what a firing does with slots missed
    while nothing fired: ``"latest"`` (the most recent once), ``"all"`` (every one, at most
    :data:`CATCH_UP_LIMIT`), ``"none"`` (skip them). Checked here: a bad expression, time zone, policy, name
    or value raises :class:`~sa_outbox.ConfigurationError` (a bad payload :class:`~sa_outbox.PayloadError`)
    when the schedule is declared, not when it first fires.
    """

    name: str
    cron: str
    _: KW_ONLY
    task: str
    payload: Any = field(default_factory=dict, hash=False)
    queue: str = "default"
    tz: str = "UTC"
    catch_up: str = "latest"
    priority: int = 0
    max_attempts: int | None = None

    def __post_init__(self) -> None:
        what = f"schedule {self.name!r:.80}"
        _config(require_text, self.name, what, "name")
        if len(self.name) > NAME_MAX:
            raise ConfigurationError(f"{what}: name is {len(self.name)} characters, at most {NAME_MAX}")
        _config(require_text, self.task, what, "task")
        _config(require_text, self.queue, what, "queue")
        try:
            zone = _zone(self.tz)
        except (ZoneInfoNotFoundError, ValueError, TypeError):
            raise ConfigurationError(
                f"{what}: unknown time zone {self.tz!r} (an IANA name: 'Europe/Berlin')"
            ) from None
        if not isinstance(self.cron, str):
            raise ConfigurationError(f"{what}: cron must be a string, got {self.cron!r}")
        try:
            next(CronSim(self.cron, dt.datetime.now(zone)))
        except (CronSimError, ValueError, StopIteration) as exc:
            raise ConfigurationError(
                f"{what}: invalid cron expression {self.cron!r}: {exc} (five fields: minute hour day-of-month "
                "month day-of-week, optionally a leading seconds field)"
            ) from None
        if self.catch_up not in CATCH_UP:
            raise ConfigurationError(
                f"{what}: catch_up must be one of {', '.join(map(repr, CATCH_UP))}, got {self.catch_up!r}"
            )
        _config(check_int, self.priority, what=what, name="priority", low=_INT4[0], high=_INT4[1])
        if self.max_attempts is not None:
            _config(check_int, self.max_attempts, what=what, name="max_attempts", low=1, high=_INT4[1])
        normalized, _ = check_payload(self.payload, what=what)
        object.__setattr__(self, "payload", normalized)


def slot_key(name: str, slot: dt.datetime) -> str:
    """The unique key of the job of a slot: ``schedule:<name>:<slot in UTC, ISO 8601, to the second>``."""
    return f"schedule:{name}:{slot.astimezone(dt.UTC):%Y-%m-%dT%H:%M:%SZ}"


def _repeated(local: dt.datetime) -> bool:
    """Whether ``local``'s wall time happens twice (a fall-back's repeated period, either pass)."""
    return local.replace(fold=0).utcoffset() != local.replace(fold=1).utcoffset()


def _repetition_end(local: dt.datetime) -> dt.datetime:
    """The first wall time after ``local``'s repeated period (``local`` in it), which happens once again."""
    wall = local.replace(fold=0, second=0, microsecond=0)
    for _ in range(48 * 60):  # transitions fall on whole minutes; no repetition is longer than a few hours
        wall += dt.timedelta(minutes=1)  # wall-clock arithmetic: tzinfo kept, offsets not applied
        if not _repeated(wall):
            return wall
    raise ConfigurationError(
        f"the time zone of {local.isoformat()} repeats wall times for more than two days"
    )


# A schedule's slots are cronsim's forward sequence: in a fall-back's repeated period a fixed time ("30 2 * *
# *") is a slot at its first pass only, a time from a wildcard or step in the hour or minute field ("*/30 2 *
# * *", "0,30 * * * *") at both passes, as cron has it. cronsim keeps to that sequence when it starts outside
# such a period; started inside one, it reads the start's wall time at the first pass, so a start in the second
# pass gave a "next" slot an hour in the past, due again at every tick (a hostile review: a daily job at 02:45
# Europe/Berlin ran once a second for an hour when a firer first planned it at 02:10 of the second pass), and
# a backwards walk from there skipped the first pass's later slots. Both walks therefore start where the
# sequence is unambiguous — forward from the first pass of the start's wall time, backwards from the end of
# the repetition — and pass over the slots on the wrong side of the instant (at most one repetition's worth).


def _next_after(cron: str, tz: str, instant: dt.datetime) -> dt.datetime:
    """The first slot strictly after ``instant``."""
    local = instant.astimezone(_zone(tz))
    start = local.replace(fold=0) if _repeated(local) else local
    for n, nxt in enumerate(CronSim(cron, start)):
        utc: dt.datetime = nxt.astimezone(dt.UTC)
        if utc > instant:
            return utc
        if n > 100_000:  # a repetition of a few hours holds fewer slots than that, even at one a second
            break
    raise ConfigurationError(f"cron expression {cron!r} has no slot after {instant.isoformat()}")


def _due_slots(cron: str, tz: str, first: dt.datetime, now: dt.datetime, limit: int) -> list[dt.datetime]:
    """The slots from ``first`` (the schedule's next_run_at, a slot) to ``now``, newest first, at most
    ``limit`` — walked backwards from ``now``, so a long downtime costs ``limit`` steps, not one per slot."""
    # cronsim walks backwards from strictly before its start: start at the next whole second (in UTC, where a
    # second is a second) so that ``now``'s own second — a slot at ``now`` — is included.
    start = (now.replace(microsecond=0) + dt.timedelta(seconds=1)).astimezone(_zone(tz))
    if _repeated(start):
        start = _repetition_end(start)
    slots: list[dt.datetime] = []
    for slot in CronSim(cron, start, reverse=True):
        utc = slot.astimezone(dt.UTC)
        if utc > now:
            continue
        if utc < first or len(slots) >= limit:
            break
        slots.append(utc)
    return slots or [first]


# --- the statements -------------------------------------------------------------------------------------


def _check_model(model: Any, kind: str) -> Table:
    table = getattr(model, "__table__", None)
    if not isinstance(table, Table) or table.info.get("sa_outbox_kind") != kind:
        mixin = {"schedules": "ScheduleMixin", "jobs": "JobMixin"}[kind]
        raise ConfigurationError(f"{getattr(model, '__name__', model)!r} is not a mapped class with {mixin}")
    if kind == "jobs" and table.info.get("sa_outbox_partitioned") is not None:
        raise ConfigurationError(
            f"{table.fullname} is partitioned by created_at: cron schedules fire each slot once through a unique "
            "key, which a partitioned jobs table cannot enforce; fire schedules into a plain jobs table "
            "(docs/partitioning.md)"
        )
    return table


def check_schedules_model(model: Any) -> None:
    """ConfigurationError unless ``model`` is a mapped class with :class:`~sa_outbox.ScheduleMixin`."""
    _check_model(model, "schedules")


_CLOCK = func.coalesce(bindparam("now", type_=DateTime(timezone=True)), func.now())


@functools.cache
def _due_statement(schedules: Table) -> Any:
    """Due schedules, oldest slot first, locked (SKIP LOCKED: concurrent firers take other schedules), with
    the clock every decision of this firing uses."""
    c = schedules.c
    return (
        select(c.name, c.cron, c.timezone, c.catch_up, c.next_run_at, c.queue, _CLOCK.label("now"))
        .where(not_(c.paused), c.next_run_at <= _CLOCK)
        .order_by(c.next_run_at)
        .limit(bindparam("limit", type_=Integer))
        .with_for_update(skip_locked=True)
    )


@functools.cache
def _fire_statement(schedules: Table, jobs: Table) -> Any:
    """Move each schedule on (compare-and-set of ``next_run_at``) and insert the jobs of its slots — only of
    the schedules that moved — in one statement. Rows: ``('s', name, NULL)`` per schedule moved, ``('j',
    unique_key, id)`` per job inserted."""
    s = schedules.c
    moves = (
        func.unnest(
            bindparam("names", type_=ARRAY(Text)),
            bindparam("expected", type_=ARRAY(DateTime(timezone=True))),
            bindparam("nexts", type_=ARRAY(DateTime(timezone=True))),
            bindparam("lasts", type_=ARRAY(DateTime(timezone=True))),
            bindparam("crons", type_=ARRAY(Text)),
            bindparam("zones", type_=ARRAY(Text)),
        )
        .table_valued(
            column("name", Text),
            column("expected", DateTime(timezone=True)),
            column("next", DateTime(timezone=True)),
            column("last", DateTime(timezone=True)),
            column("cron", Text),
            column("zone", Text),
        )
        .render_derived(name="m")
    )
    # The compare-and-set: a schedule moves only from the next_run_at, cron and time zone this firing read. A
    # firer that read the same row and lost the race (or a pause, or a sync that changed the cron, in between)
    # matches nothing — also when the new cron's next slot happens to be the same instant (a review: */10 to
    # */30 at 12:00 fired 12:10, a slot of the old expression, and moved on by it).
    moved = (
        update(schedules)
        .where(
            s.name == moves.c.name,
            s.next_run_at == moves.c.expected,
            s.cron == moves.c.cron,
            s.timezone == moves.c.zone,
            not_(s.paused),
        )
        .values(
            next_run_at=moves.c.next,
            last_run_at=func.coalesce(moves.c.last, s.last_run_at),
            updated_at=func.now(),
        )
        .returning(s.name, s.task, s.payload, s.queue, s.priority, s.max_attempts)
        .cte("moved")
    )
    slots = (
        func.unnest(
            bindparam("slot_names", type_=ARRAY(Text)),
            bindparam("slots", type_=ARRAY(DateTime(timezone=True))),
            bindparam("slot_keys", type_=ARRAY(Text)),
            bindparam("slot_headers", type_=ARRAY(Text)),
        )
        .table_valued(
            column("name", Text),
            column("slot", DateTime(timezone=True)),
            column("key", Text),
            column("headers", Text),
        )
        .render_derived(name="f")
    )
    j = jobs.c
    source = (
        select(
            moved.c.task,
            moved.c.queue,
            moved.c.payload,
            moved.c.priority,
            func.coalesce(moved.c.max_attempts, bindparam("default_max_attempts", type_=Integer)),
            slots.c.slot,
            slots.c.key,
            sa_cast(slots.c.headers, JSONB),
        )
        .select_from(moved.join(slots, slots.c.name == moved.c.name))
        .where(text(f"{_enqueue.NOTIFY_SQL} >= 0"))
        .order_by(slots.c.key)
    )
    fired = (
        pg_insert(jobs)
        .from_select(
            [j.task, j.queue, j.payload, j.priority, j.max_attempts, j.run_at, j.unique_key, j.headers],
            source,
        )
        .on_conflict_do_nothing(index_elements=[j.unique_key], index_where=_enqueue.unique_waiting(jobs))
        .returning(j.id, j.unique_key)
        .cte("fired")
    )
    return union_all(
        select(literal_column("'s'", Text), moved.c.name, literal_column("NULL::bigint")),
        select(literal_column("'j'", Text), fired.c.unique_key, fired.c.id),
    )


@functools.cache
def _sync_statement(schedules: Table) -> Any:
    """Upsert declared schedules by name. A schedule whose cron or time zone changed gets the new next slot;
    otherwise its next_run_at stays (a restart neither skips nor repeats a slot) and ``paused`` is never
    touched. Unchanged rows are not written; RETURNING names the rows inserted or changed."""
    s = schedules.c
    names = ["name", "cron", "timezone", "task", "payload", "queue", "priority", "max_attempts", "catch_up",
             "next_run_at"]  # fmt: skip
    types: dict[str, Any] = {
        "priority": Integer,
        "max_attempts": Integer,
        "next_run_at": DateTime(timezone=True),
    }
    rows = (
        func.unnest(*[bindparam(f"s_{n}", type_=ARRAY(types.get(n, Text))) for n in names])
        .table_valued(*[column(n, types.get(n, Text)) for n in names])
        .render_derived(name="d")
    )
    values = [sa_cast(rows.c[n], JSONB) if n == "payload" else rows.c[n] for n in names]
    ins = pg_insert(schedules).from_select([s[n] for n in names], select(*values))
    new = ins.excluded
    definition = ["cron", "timezone", "task", "payload", "queue", "priority", "max_attempts", "catch_up"]
    moved = tuple_(s.cron, s.timezone).is_distinct_from(tuple_(new.cron, new.timezone))
    return ins.on_conflict_do_update(
        index_elements=[s.name],
        set_={
            **{n: new[n] for n in definition},
            "next_run_at": case((moved, new.next_run_at), else_=s.next_run_at),
            "updated_at": func.now(),
        },
        where=tuple_(*[s[n] for n in definition]).is_distinct_from(tuple_(*[new[n] for n in definition])),
    ).returning(s.name)


# --- binds ----------------------------------------------------------------------------------------------


@contextmanager
def _connection(bind: Bind, model: Any) -> Iterator[Connection]:
    """An Engine: its own transaction, committed. A Connection or a Session: theirs (the caller commits;
    on an autocommit connection every statement commits by itself)."""
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            yield conn
    elif isinstance(bind, Session):
        yield bind.connection(bind_arguments={"mapper": model.__mapper__})
    elif isinstance(bind, Connection):
        yield _begun(bind)
    else:
        raise ConfigurationError(f"expected an Engine, a Connection or a Session, got {type(bind).__name__}")


def _begun(conn: Connection) -> Connection:
    """``conn`` with its transaction begun, as any ``conn.execute()`` would (the statements here go straight
    to the driver, which SQLAlchemy's autobegin does not see: the caller's ``commit()`` would commit nothing).
    On an autocommit connection every statement still commits by itself."""
    if not conn.in_transaction():
        conn.begin()
    return conn


# --- firing ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Due:
    """A due schedule as step 1 read it (``now``: the database clock of that read)."""

    name: str
    cron: str
    timezone: str
    catch_up: str
    next_run_at: dt.datetime
    queue: str
    now: dt.datetime


def read_due(conn: Connection, model: Any, *, limit: int = 100, now: dt.datetime | None = None) -> list[Due]:
    """Step 1: up to ``limit`` due schedules, locked FOR UPDATE SKIP LOCKED for the rest of the
    transaction."""
    table = _check_model(model, "schedules")
    return [Due(*r) for r in run(_begun(conn), _due_statement(table), {"limit": limit, "now": now})]


def _plan(due: Due) -> tuple[list[dt.datetime], dt.datetime, bool]:
    """Step 2: the slots to fire (oldest first), the next slot, and whether older missed slots were left."""
    limit = CATCH_UP_LIMIT if due.catch_up == "all" else 1
    slots = _due_slots(due.cron, due.timezone, due.next_run_at, due.now, limit)
    if due.catch_up == "all":
        fire = slots[::-1]
        left = len(slots) == limit and fire[0] > due.next_run_at
    elif due.catch_up == "latest":
        fire, left = slots, slots[0] > due.next_run_at
    else:  # none: only a slot that is on time
        fire = [slot for slot in slots if due.now - slot <= ON_TIME]
        left = slots[0] > due.next_run_at or not fire
    return fire, _next_after(due.cron, due.timezone, due.now), left


def fire(conn: Connection, model: Any, job_model: Any, due: Sequence[Due]) -> int:
    """Steps 2 and 3 for schedules read by :func:`read_due`: plan their slots, then move them on and insert
    their jobs in one statement. Returns how many jobs it inserted."""
    if not due:
        return 0
    schedules, jobs = _check_model(model, "schedules"), _check_model(job_model, "jobs")
    moves: dict[str, list[Any]] = {
        "names": [],
        "expected": [],
        "nexts": [],
        "lasts": [],
        "crons": [],
        "zones": [],
    }
    slots: dict[str, list[Any]] = {"slot_names": [], "slots": [], "slot_keys": [], "slot_headers": []}
    queues: list[str] = []
    skipped: dict[str, bool] = {}
    for d in due:
        fired, nxt, left = _plan(d)
        moves["names"].append(d.name)
        moves["expected"].append(d.next_run_at)
        moves["nexts"].append(nxt)
        moves["lasts"].append(fired[-1] if fired else None)
        moves["crons"].append(d.cron)
        moves["zones"].append(d.timezone)
        skipped[d.name] = left
        for slot in fired:
            key = slot_key(d.name, slot)
            slots["slot_names"].append(d.name)
            slots["slots"].append(slot)
            slots["slot_keys"].append(key)
            slots["slot_headers"].append(
                json.dumps({"x-schedule": d.name, "x-schedule-slot": f"{slot:%Y-%m-%dT%H:%M:%SZ}"})
            )
        if fired:
            queues.append(d.queue)
    channel = channel_for(jobs.name)
    queues = list(dict.fromkeys(queues))
    params = {
        **moves, **slots, "default_max_attempts": getattr(job_model, "sa_outbox_default_max_attempts", 10),
        "channels": [channel] * len(queues), "payloads": queues,
    }  # fmt: skip
    rows = run(_begun(conn), _fire_statement(schedules, jobs), params)
    moved = {r[1] for r in rows if r[0] == "s"}
    inserted = {r[1]: r[2] for r in rows if r[0] == "j"}
    for d in due:
        if d.name not in moved:
            continue
        keys = [k for n, k in zip(slots["slot_names"], slots["slot_keys"], strict=True) if n == d.name]
        log.info(
            "schedule %r fired %d slot(s)", d.name, len(keys),
            extra={"schedule": d.name, "jobs": [inserted.get(k) for k in keys], "slots": keys,
                   "missed_slots_skipped": skipped[d.name]},
        )  # fmt: skip
    return len(inserted)


def fire_due_schedules(
    bind: Bind, model: Any, job_model: Any, *, limit: int = 100, now: dt.datetime | None = None
) -> int:
    """Fire every due schedule of ``model`` (a :class:`~sa_outbox.ScheduleMixin` table) into ``job_model``'s
    table: each due slot (by the catch-up policy) becomes one job, and the schedule moves to its next slot in
    the same statement. Returns the number of jobs inserted.

    Any number of processes may call it at once, on any kind of bind: an ``Engine`` (its own transaction:
    concurrent callers take disjoint schedules), a ``Connection`` — the worker's autocommit loop connection
    included — or a ``Session`` (the caller's transaction; gone with its rollback). Each slot fires exactly
    once: a compare-and-set of ``next_run_at`` decides, in the statement that inserts the jobs. ``limit``
    bounds the schedules handled per call; ``now`` overrides the database clock (tests).
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigurationError(f"limit must be an integer >= 1, got {limit!r}")
    _check_model(model, "schedules")
    _check_model(job_model, "jobs")
    with _connection(bind, model) as conn:
        return fire(conn, model, job_model, read_due(conn, model, limit=limit, now=now))


# --- declaring and operating -----------------------------------------------------------------------------


def sync_schedules(
    bind: Bind,
    model: Any,
    schedules: Iterable[Schedule],
    *,
    prune: bool = False,
    now: dt.datetime | None = None,
) -> list[str]:
    """Write the schedules declared in code to ``model``'s table (call it at start-up; again at run time to
    add or change one). A new schedule is due at its first slot after now; an existing one keeps its next
    slot unless its cron or time zone changed, and keeps its ``paused`` state. ``prune=True`` also deletes
    the rows of schedules not given (leave it off while processes with older code still run, and for
    schedules added at run time). Returns the names of the schedules inserted or changed, in the given order.
    Idempotent; safe for many processes at once."""
    table = _check_model(model, "schedules")
    given = list(schedules)
    seen: set[str] = set()
    for s in given:
        if not isinstance(s, Schedule):
            raise ConfigurationError(f"sync_schedules takes Schedule values, got {s!r:.120}")
        if s.name in seen:
            raise ConfigurationError(f"schedule {s.name!r} is given twice: schedule names are unique")
        seen.add(s.name)
    with _connection(bind, model) as conn:
        clock = conn.execute(select(_CLOCK), {"now": now}).scalar_one()
        changed: set[str] = set()
        if given:
            # A changed cron moves the schedule to its first slot after the clock — and after the last slot
            # fired, which a worker may have fired after this transaction's now() (a deploy's transaction open
            # across a slot): that slot would fire again. The rows are locked first, in name order (the upsert
            # below locks them anyway), so that no slot fires between this read and the upsert.
            c = table.c
            lasts = dict(
                conn.execute(
                    select(c.name, c.last_run_at)
                    .where(c.name.in_([s.name for s in given]))
                    .order_by(c.name)
                    .with_for_update()
                ).all()
            )
            after = {s.name: max(clock, lasts.get(s.name) or clock) for s in given}
            params = {
                "s_name": [s.name for s in given], "s_cron": [s.cron for s in given],
                "s_timezone": [s.tz for s in given], "s_task": [s.task for s in given],
                "s_payload": [json.dumps(s.payload, separators=(",", ":")) for s in given],
                "s_queue": [s.queue for s in given], "s_priority": [s.priority for s in given],
                "s_max_attempts": [s.max_attempts for s in given], "s_catch_up": [s.catch_up for s in given],
                "s_next_run_at": [_next_after(s.cron, s.tz, after[s.name]) for s in given],
            }  # fmt: skip
            changed = {r[0] for r in conn.execute(_sync_statement(table), params)}
        if prune:
            c = table.c
            gone = (
                conn.execute(table.delete().where(c.name.not_in([s.name for s in given])).returning(c.name))
                .scalars()
                .all()
            )
            if gone:
                log.info("schedules removed: %s", ", ".join(sorted(gone)), extra={"schedules": sorted(gone)})
    names = [s.name for s in given if s.name in changed]
    if names:
        log.info("schedules written: %s", ", ".join(names), extra={"schedules": names})
    return names


def _one(conn: Connection, table: Table, name: str, *columns: Any, lock: bool = False) -> Any:
    stmt = select(*columns, func.now()).where(table.c.name == name)
    row = conn.execute(stmt.with_for_update() if lock else stmt).one_or_none()
    if row is None:
        raise ConfigurationError(f"no schedule named {name!r} in {table.fullname} (sa-outbox schedules list)")
    return row


def pause_schedule(bind: Bind, model: Any, name: str) -> None:
    """Stop firing schedule ``name`` until :func:`resume_schedule` (a run-time state: syncs keep it)."""
    table = _check_model(model, "schedules")
    with _connection(bind, model) as conn:
        _one(conn, table, name, table.c.name, lock=True)
        conn.execute(table.update().where(table.c.name == name).values(paused=True, updated_at=func.now()))
    log.info("schedule %r paused", name, extra={"schedule": name})


def resume_schedule(bind: Bind, model: Any, name: str, *, now: dt.datetime | None = None) -> bool:
    """Fire schedule ``name`` again from its next slot after now: the slots of the pause are skipped, not
    caught up. Returns True, or False for a schedule that was not paused (left as it is, nothing logged)."""
    table = _check_model(model, "schedules")
    c = table.c
    with _connection(bind, model) as conn:
        cron, tz, paused, _ = _one(conn, table, name, c.cron, c.timezone, c.paused, lock=True)
        if paused:
            clock = conn.execute(select(_CLOCK), {"now": now}).scalar_one()
            conn.execute(
                table.update().where(c.name == name)
                .values(paused=False, next_run_at=_next_after(cron, tz, clock), updated_at=func.now())
            )  # fmt: skip
    if paused:
        log.info("schedule %r resumed", name, extra={"schedule": name})
    return bool(paused)


def run_schedule_now(bind: Bind, model: Any, job_model: Any, name: str) -> int:
    """Enqueue one job of schedule ``name`` now, outside its slots (its next slot is left as it is, paused
    or not); returns the job's id. Its unique key is ``schedule:<name>:run-now:<now>``."""
    table = _check_model(model, "schedules")
    jobs = _check_model(job_model, "jobs")
    c = table.c
    with _connection(bind, model) as conn:
        task, payload, queue, priority, max_attempts, clock = _one(
            conn, table, name, c.task, c.payload, c.queue, c.priority, c.max_attempts
        )
        key = f"schedule:{name}:run-now:{clock.astimezone(dt.UTC):%Y-%m-%dT%H:%M:%S.%fZ}"
        item = {"task": task, "payload": payload, "queue": queue, "priority": priority,
                "max_attempts": max_attempts, "unique_key": key, "headers": {"x-schedule": name}}  # fmt: skip
        batch = _enqueue.prepare(job_model, [item], context={}, single=True)
        [got] = _enqueue.write(conn, jobs, batch, channels=[channel_for(jobs.name)], payloads=[queue])
    log.info("schedule %r run now: job %s", name, got.id, extra={"schedule": name, "job": got.id})
    return got.id
