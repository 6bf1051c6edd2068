"""Declarative mixins for the outbox and jobs tables.

``class OutboxEvent(OutboxMixin, Base): __tablename__ = "outbox"`` gives the outbox schema of
docs/design.md "The tables": identity ``id``, the event columns, and the dispatcher columns (``status``,
``available_at``, ``attempts``, ``lease_owner``, ``lease_until``, ``lease_version``, ``last_error``,
``done_at``), with database-side defaults and the partial indexes the claims need.

``class Job(JobMixin, Base): __tablename__ = "jobs"`` gives the jobs schema (docs/design.md "The tables") plus
``task`` (routes a job to its handler) and ``lease_version`` (the fencing token: a worker whose job was
reaped and re-claimed cannot finalize it).

Status columns are ``text`` + ``CHECK`` (not a native enum: enum changes need ``ALTER TYPE`` migrations and
block downgrades while a partial index depends on the type). Every index and constraint name is built from
the table name and marked final with :func:`sqlalchemy.sql.elements.conv`, so two outbox tables live side by
side in one database and a user's own ``naming_convention`` does not rename them.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, ClassVar, Self

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Identity,
    Index,
    Integer,
    PrimaryKeyConstraint,
    Table,
    Text,
    Uuid,
    desc,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, declared_attr, mapped_column
from sqlalchemy.sql.elements import conv

from . import _producer, migration
from ._enqueue import UNIQUE_ACTIVE, UNIQUE_WAITING
from ._partitions import partition_period
from ._sql import queue_table, starts_table

__all__ = [
    "CATCH_UP_POLICIES",
    "JOB_STATUSES",
    "OUTBOX_STATUSES",
    "CdcOutboxMixin",
    "JobMixin",
    "OutboxMixin",
    "ScheduleMixin",
]

OUTBOX_STATUSES: tuple[str, ...] = ("pending", "processing", "done", "dead")
JOB_STATUSES: tuple[str, ...] = ("queued", "running", "done", "failed", "cancelled")
#: The catch-up policies of a schedule (see ``sa_outbox._schedules``).
CATCH_UP_POLICIES: tuple[str, ...] = ("latest", "all", "none")

_NOW = text("now()")


def _status_check(column: str, statuses: tuple[str, ...]) -> str:
    quoted = ", ".join(f"'{s}'" for s in statuses)  # constants of this module, never user input
    return f"{column} IN ({quoted})"


def _primary_key(t: str, period: str | None) -> PrimaryKeyConstraint:
    """``(id)``, or ``(id, created_at)`` for the partitioned layout: a partitioned table's primary key must
    contain its partition key. ``id`` stays unique (an identity), and the ORM keeps it as the identity."""
    if period is None:
        return PrimaryKeyConstraint("id", name=conv(f"pk_{t}"))
    return PrimaryKeyConstraint("id", "created_at", name=conv(f"pk_{t}"))


def _table_options(kind: str, period: str | None) -> dict[str, Any]:
    if period is None:
        return {"info": {"sa_outbox_kind": kind}}
    # Native declarative range partitioning on created_at (no pg_partman): metadata.create_all() and
    # alembic autogenerate render PARTITION BY; the partitions are created by sa_outbox.migration /
    # maintain_partitions (docs/partitioning.md).
    return {
        "info": {"sa_outbox_kind": kind, "sa_outbox_partitioned": period},
        "postgresql_partition_by": "RANGE (created_at)",
    }


def _partitioned_layout(cls: Any) -> None:
    """``sa_outbox_partitioned = "day" | "week" | "month"`` on a model: ``created_at`` joins the primary key
    (declared on the class itself, so the mixin's column flags and the table's primary key agree), and the
    mapper keeps ``id`` alone as the identity (``session.get(Model, id)`` works as on the plain layout)."""
    if "__tablename__" not in cls.__dict__ or partition_period(cls) is None:
        return
    if "created_at" not in cls.__dict__:
        cls.created_at = mapped_column(
            DateTime(timezone=True), nullable=False, server_default=_NOW, primary_key=True
        )
    cls.__mapper_args__ = {**getattr(cls, "__mapper_args__", {}), "primary_key": ["id"]}


class OutboxMixin:
    """Columns, constraints and partial indexes of an outbox table (docs/design.md "The tables").

    ``sa_outbox_partitioned = "day" | "week" | "month"`` on the model selects the partitioned layout:
    ``PARTITION BY RANGE (created_at)``, primary key ``(id, created_at)`` (docs/partitioning.md).

    Subclasses may set ``sa_outbox_max_payload_bytes`` (default 1 MiB of encoded JSON) to change the size
    limit the producer enforces at flush, and ``sa_outbox_max_headers_bytes`` (default 8 KiB of header names
    and values, UTF-8) for the headers.
    """

    sa_outbox_kind: ClassVar[str] = "outbox"
    #: ``None`` (a plain table) or the partition period: ``"day"``, ``"week"`` or ``"month"``.
    sa_outbox_partitioned: ClassVar[str | None] = None
    #: Server defaults are not fetched back after INSERT (RETURNING only the id): a producer role needs
    #: nothing beyond ``INSERT, SELECT (id)``; the other columns load on first access.
    __mapper_args__: ClassVar[dict[str, Any]] = {"eager_defaults": False}
    sa_outbox_max_payload_bytes: ClassVar[int] = 1024 * 1024
    sa_outbox_max_headers_bytes: ClassVar[int] = 8 * 1024

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    aggregate_type: Mapped[str] = mapped_column(Text, nullable=False)
    aggregate_id: Mapped[str] = mapped_column(Text, nullable=False)
    event_type: Mapped[str] = mapped_column(Text, nullable=False)
    payload: Mapped[Any] = mapped_column(JSONB(none_as_null=True), nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=_NOW)

    # Dispatcher columns.
    status: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("'pending'"))
    #: The earliest time the row may be claimed (backoff and Defer push it forward).
    available_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=_NOW
    )
    #: Claims so far, counted at claim time so that a message that crashes its worker still runs out.
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    #: For people only; correctness rests on lease_version.
    lease_owner: Mapped[str | None] = mapped_column(Text)
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: The fencing token: +1 at every claim; every finalize matches it.
    lease_version: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    last_error: Mapped[str | None] = mapped_column(Text)
    done_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: String name/value pairs that travel with the event to the broker's own header slot (trace context,
    #: tenant, correlation ids); NULL when there are none. Validated by the producer (``_payload.check_headers``).
    headers: Mapped[dict[str, str] | None] = mapped_column(JSONB(none_as_null=True))

    @declared_attr.directive
    @classmethod
    def __table_args__(cls) -> tuple[Any, ...]:
        t: str = cls.__tablename__  # type: ignore[attr-defined]
        period = partition_period(cls)
        return (
            _primary_key(t, period),
            CheckConstraint(_status_check("status", OUTBOX_STATUSES), name=conv(f"ck_{t}_status")),
            CheckConstraint("attempts >= 0", name=conv(f"ck_{t}_attempts")),
            # The plain claim: ready rows in (available_at, id) order — the claim orders by exactly these
            # columns so the scan stops after `batch` rows (ordering by id alone walked the primary key).
            Index(conv(f"ix_{t}_ready"), "available_at", "id", postgresql_where=text("status = 'pending'")),
            # The rescue step: processing rows by lease expiry.
            Index(conv(f"ix_{t}_leased"), "lease_until", postgresql_where=text("status = 'processing'")),
            # The ordered claim's NOT EXISTS: unfinished or dead predecessors of an aggregate.
            Index(
                conv(f"ix_{t}_aggregate"),
                "aggregate_id",
                "id",
                postgresql_where=text("status IN ('pending', 'processing', 'dead')"),
            ),
            # Retention (purge of done rows).
            Index(conv(f"ix_{t}_done"), "done_at", postgresql_where=text("status = 'done'")),
            # Dead letters: `dead list`/`retry`, the dashboard's dead page and `status` find them without
            # reading the done rows (a backlog of 1M rows made the dead page 150–190 ms without it).
            Index(conv(f"ix_{t}_dead"), "id", postgresql_where=text("status = 'dead'")),
            _table_options("outbox", period),
        )

    @classmethod
    def for_aggregate(
        cls, aggregate: Any, event_type: str, payload: Any, *, aggregate_type: str | None = None
    ) -> Self:
        """An event of this model for a mapped aggregate instance (type and id derived from its mapper and
        primary key); the producer hook locks that aggregate's row at flush. See ``sa_outbox._producer.event_for``."""
        return _producer.event_for(cls, aggregate, event_type, payload, aggregate_type=aggregate_type)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A model that uses this mixin needs the producer's flush hook and the storage-parameter hook.
        _producer.install()
        migration.install()
        _partitioned_layout(cls)
        super().__init_subclass__(**kwargs)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} id={self.id} {self.aggregate_type}/{self.aggregate_id} "
            f"{self.event_type} status={self.status}>"
        )


class JobMixin:
    """Columns, constraints and partial indexes of a jobs table (docs/design.md "The tables": the queue columns, task, fencing).

    ``sa_outbox_partitioned = "day" | "week" | "month"`` selects the partitioned layout, as for
    :class:`OutboxMixin`; a partitioned jobs table has no unique-key index (``enqueue(…, unique_key=…)`` and
    cron schedules are refused on it: docs/partitioning.md).
    """

    sa_outbox_kind: ClassVar[str] = "jobs"
    #: ``None`` (a plain table) or the partition period: ``"day"``, ``"week"`` or ``"month"``.
    sa_outbox_partitioned: ClassVar[str | None] = None
    #: Server defaults are not fetched back after INSERT (RETURNING only the id): a producer role needs
    #: nothing beyond ``INSERT, SELECT (id)``; the other columns load on first access.
    __mapper_args__: ClassVar[dict[str, Any]] = {"eager_defaults": False}
    sa_outbox_max_payload_bytes: ClassVar[int] = 1024 * 1024
    sa_outbox_max_headers_bytes: ClassVar[int] = 8 * 1024
    #: Used by ``enqueue`` and ``Job(...)`` when max_attempts is not given: with the default backoff
    #: (``min(300 s, 2**attempts s)``) a job rides out about 13.5 minutes of a failing downstream before it
    #: fails (2 + 4 + … + 256 + 300 s). The jobs design's own default was 3 (about 6 s).
    sa_outbox_default_max_attempts: ClassVar[int] = 10

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    queue: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("'default'"))
    #: Routes the job to its handler.
    task: Mapped[str] = mapped_column(Text, nullable=False)
    payload: Mapped[Any] = mapped_column(JSONB(none_as_null=True), nullable=False)
    status: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("'queued'"))
    priority: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    #: The job may run at or after this time (retry backoff and Defer push it forward).
    run_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=_NOW)
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    max_attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("10"))
    locked_by: Mapped[str | None] = mapped_column(Text)
    #: Claim time, refreshed by heartbeats; a running job whose locked_at is older than stale_after is reaped.
    locked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: The fencing token: +1 at every claim; every finalize matches it.
    lease_version: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=_NOW)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: String name/value pairs handed to the handler with the job (trace context, correlation ids); NULL when
    #: there are none.
    headers: Mapped[dict[str, str] | None] = mapped_column(JSONB(none_as_null=True))
    #: Set by :func:`sa_outbox.cancel_jobs` on a running job; its worker learns it with its next heartbeat.
    cancel_requested_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: What the handler returned (a JSON value), written with the fenced completion.
    result: Mapped[Any | None] = mapped_column(JSONB(none_as_null=True), nullable=True)
    #: Groups jobs for a per-key concurrency or rate limit (``Limit(per_key=True)``); '' when not given.
    concurrency_key: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
    #: ``enqueue(…, unique_key=…)``: at most one job per key waits to start (``ux_<t>_unique``), and with
    #: ``Worker(…, unique_running=True)`` at most one per key runs. NULL: an ordinary job.
    unique_key: Mapped[str | None] = mapped_column(Text)

    @declared_attr.directive
    @classmethod
    def __table_args__(cls) -> tuple[Any, ...]:
        t: str = cls.__tablename__  # type: ignore[attr-defined]
        period = partition_period(cls)
        # A unique index of a partitioned table must contain the partition key (created_at): one per key
        # across the whole table cannot exist, so a partitioned jobs table has no ux_<t>_unique and refuses
        # unique_key enqueues (and cron schedules, whose slots are unique keys): docs/partitioning.md.
        unique: tuple[Any, ...] = (
            ()
            if period is not None
            else (
                Index(
                    conv(f"ux_{t}_unique"), "unique_key", unique=True, postgresql_where=text(UNIQUE_WAITING)
                ),
            )
        )
        return (
            _primary_key(t, period),
            CheckConstraint(_status_check("status", JOB_STATUSES), name=conv(f"ck_{t}_status")),
            CheckConstraint("attempts >= 0", name=conv(f"ck_{t}_attempts")),
            CheckConstraint("max_attempts >= 1", name=conv(f"ck_{t}_max_attempts")),
            # The dequeue index: WHERE and ORDER BY of the claim, in that order.
            Index(
                conv(f"ix_{t}_dequeue"),
                "queue",
                desc("priority"),
                "run_at",
                "id",
                postgresql_where=text("status = 'queued'"),
            ),
            # Running jobs, one index for both readers: a limited queue's claim counts its running jobs (per
            # concurrency key) by the leading columns; the reaper reads every entry, comparing locked_at in the
            # index (running jobs are few: the fleet's concurrency). Each claim inserts one entry per job, not
            # two: with a second index on (queue, concurrency_key), whose every entry shares one key in an
            # unlimited queue, the drain ran 5-13 % slower.
            Index(
                conv(f"ix_{t}_running"),
                "queue",
                "concurrency_key",
                "locked_at",
                postgresql_where=text("status = 'running'"),
            ),
            # Retention: finished rows (done or cancelled) by finish time.
            Index(
                conv(f"ix_{t}_finished"),
                "finished_at",
                postgresql_where=text("status IN ('done', 'cancelled')"),
            ),
            # Dead letters: `dead list`, `status` and `check` count them without reading done rows.
            Index(conv(f"ix_{t}_failed"), "id", postgresql_where=text("status = 'failed'")),
            # A unique key belongs to the key's job that has not started yet: queued and never claimed
            # (lease_version 0). The arbiter of enqueue's INSERT … ON CONFLICT; a claimed job leaves it, so a
            # retried job going back to queued never conflicts with the key's next job.
            *unique,
            # unique_running's claim: is a job of this key running, or an older one still queued? (each one
            # index condition: key and status, key and status and id below the candidate's)
            Index(
                conv(f"ix_{t}_unique_active"),
                "unique_key",
                "status",
                "id",
                postgresql_where=text(UNIQUE_ACTIVE),
            ),
            _table_options("jobs", period),
        )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A model that uses this mixin needs the producer's flush hook and the storage-parameter hook, and
        # (once mapped) its queue table.
        _producer.install()
        migration.install()
        _partitioned_layout(cls)
        super().__init_subclass__(**kwargs)
        _add_queue_table(cls)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} id={self.id} {self.queue}/{self.task} status={self.status}>"


def _add_queue_table(cls: Any) -> None:
    """A jobs model's companion tables ``<jobs>_queues`` and ``<jobs>_starts`` on the same metadata (so
    autogenerate sees them)."""
    table = getattr(cls, "__table__", None)
    if isinstance(table, Table) and table.info.get("sa_outbox_kind") == "jobs":
        queue_table(table)
        starts_table(table)


class CdcOutboxMixin:
    """An insert-only outbox table for change data capture: Debezium's outbox event router reads its rows
    from the WAL (see docs/cdc.md; ``sa-outbox cdc debezium-config`` prints the connector configuration).

    Written by the same producer paths as :class:`OutboxMixin` (``session.add`` and the flush hook,
    :meth:`for_aggregate`, :func:`~sa_outbox.emit`, ORM-enabled ``INSERT``): validated, locked per aggregate,
    with headers and the trace context. No dispatcher ever touches it (the router refuses UPDATEs, and a
    ``Dispatcher`` refuses this model), so it has no status or lease columns:

    * ``id`` — a UUID made by the producer (``gen_random_uuid()`` for rows written another way): the event id
      the router puts in the ``id`` header, the consumers' de-duplication key;
    * ``aggregate_type``, ``aggregate_id``, ``event_type``, ``payload`` (``jsonb``), ``headers`` (``jsonb``,
      NULL for none), ``created_at`` — as in :class:`OutboxMixin`;
    * ``tracingspancontext`` — the trace context of the ``traceparent``/``tracestate`` headers as the text of
      a ``java.util.Properties`` (``traceparent=…``), the column the event router's tracing reads; NULL
      without a ``traceparent``.

    ``sa_outbox_delete_after_insert`` (default ``True``): the producer deletes each row again in the
    transaction that inserted it — "insert then delete", as Debezium's own Quarkus outbox extension does by
    default (``remove-after-insert``): the table stays empty, the WAL keeps the insert (the router drops the
    delete). ``False`` keeps the rows (retention is then yours).

    What Kafka would refuse is refused as it is written (:func:`sa_outbox.cdc.check_event`; in the WAL nothing
    turns an event into a dead letter: the connector stops on it): an ``aggregate_type`` that makes no legal
    topic name, and a payload over ``sa_outbox_max_payload_bytes`` as the record value carries it (PostgreSQL's
    text of the jsonb) — 1,000 KiB by default, leaving room in Kafka's 1 MiB record for the key and the headers
    (``sa_outbox_max_headers_bytes``, 8 KiB, as for :class:`OutboxMixin`).
    """

    sa_outbox_kind: ClassVar[str] = "cdc"
    sa_outbox_delete_after_insert: ClassVar[bool] = True
    sa_outbox_max_payload_bytes: ClassVar[int] = 1000 * 1024
    sa_outbox_max_headers_bytes: ClassVar[int] = 8 * 1024
    __mapper_args__: ClassVar[dict[str, Any]] = {"eager_defaults": False}

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, server_default=text("gen_random_uuid()"))
    aggregate_type: Mapped[str] = mapped_column(Text, nullable=False)
    aggregate_id: Mapped[str] = mapped_column(Text, nullable=False)
    event_type: Mapped[str] = mapped_column(Text, nullable=False)
    payload: Mapped[Any] = mapped_column(JSONB(none_as_null=True), nullable=False)
    headers: Mapped[dict[str, str] | None] = mapped_column(JSONB(none_as_null=True))
    #: Set by the producer from the ``traceparent``/``tracestate`` headers (Debezium's ``tracingspancontext``).
    tracingspancontext: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=_NOW)

    @declared_attr.directive
    @classmethod
    def __table_args__(cls) -> tuple[Any, ...]:
        t: str = cls.__tablename__  # type: ignore[attr-defined]
        info = {
            "sa_outbox_kind": "cdc",
            "sa_outbox_delete_after_insert": bool(cls.sa_outbox_delete_after_insert),
        }
        # No secondary index: nothing reads the table (the WAL is read), and every index costs each insert.
        return (PrimaryKeyConstraint("id", name=conv(f"pk_{t}")), {"info": info})

    @classmethod
    def for_aggregate(
        cls, aggregate: Any, event_type: str, payload: Any, *, aggregate_type: str | None = None
    ) -> Self:
        """An event of this model for a mapped aggregate instance, as :meth:`OutboxMixin.for_aggregate`."""
        return _producer.event_for(cls, aggregate, event_type, payload, aggregate_type=aggregate_type)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        _producer.install()  # the producer's flush hook writes (and deletes) this model's rows
        super().__init_subclass__(**kwargs)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} id={self.id} {self.aggregate_type}/{self.aggregate_id} {self.event_type}>"


class ScheduleMixin:
    """Columns, constraints and index of a schedules table: one row per cron schedule.

    ``class Schedules(ScheduleMixin, Base): __tablename__ = "schedules"``. Rows are written by
    :func:`sa_outbox.sync_schedules` from :class:`sa_outbox.Schedule` values declared in code (or at run time),
    and fired by :func:`sa_outbox.fire_due_schedules`: each slot becomes one job with the unique key
    ``schedule:<name>:<slot>``, and ``next_run_at`` moves on in the same statement. ``paused`` is run-time
    state (``sa-outbox schedules pause``): a sync never changes it.
    """

    sa_outbox_kind: ClassVar[str] = "schedules"
    __mapper_args__: ClassVar[dict[str, Any]] = {"eager_defaults": False}

    name: Mapped[str] = mapped_column(Text, nullable=False)
    #: Five fields (minute hour day-of-month month day-of-week), or six with a leading seconds field.
    cron: Mapped[str] = mapped_column(Text, nullable=False)
    #: An IANA time zone: the cron expression is read in it, daylight saving included.
    timezone: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("'UTC'"))
    task: Mapped[str] = mapped_column(Text, nullable=False)
    payload: Mapped[Any] = mapped_column(
        JSONB(none_as_null=True), nullable=False, server_default=text("'{}'::jsonb")
    )
    queue: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("'default'"))
    priority: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    #: NULL: the jobs table's default.
    max_attempts: Mapped[int | None] = mapped_column(Integer)
    #: What a firing does with slots missed while nothing fired: latest, all (bounded) or none.
    catch_up: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("'latest'"))
    paused: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    #: The next slot to fire (UTC instant); the firing step compares and sets it.
    next_run_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    #: The newest slot fired so far.
    last_run_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=_NOW)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, server_default=_NOW)

    @declared_attr.directive
    @classmethod
    def __table_args__(cls) -> tuple[Any, ...]:
        t: str = cls.__tablename__  # type: ignore[attr-defined]
        return (
            PrimaryKeyConstraint("name", name=conv(f"pk_{t}")),
            CheckConstraint(_status_check("catch_up", CATCH_UP_POLICIES), name=conv(f"ck_{t}_catch_up")),
            # The firing step: active schedules by their next slot.
            Index(conv(f"ix_{t}_due"), "next_run_at", postgresql_where=text("NOT paused")),
            {"info": {"sa_outbox_kind": "schedules"}},
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.cron!r} next={self.next_run_at}>"
