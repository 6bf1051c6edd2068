"""Reference models: ``OutboxEvent`` on table ``outbox``, ``Job`` on table ``jobs``, ``Inbox`` on ``inbox`` and
``JobSchedule`` (cron schedules) on ``schedules``.

The project's alembic environment, the demo and the tests use them; applications usually declare their own
classes with the mixins on their own ``Base`` (see docs/getting-started.md).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import MetaData
from sqlalchemy.orm import DeclarativeBase

from ._schema import JobMixin, OutboxMixin, ScheduleMixin
from .errors import ConfigurationError
from .inbox import InboxMixin

__all__ = ["Base", "Inbox", "Job", "JobSchedule", "OutboxEvent", "model_for"]


class Base(DeclarativeBase):
    metadata = MetaData()


class OutboxEvent(OutboxMixin, Base):
    __tablename__ = "outbox"


class Job(JobMixin, Base):
    __tablename__ = "jobs"


class Inbox(InboxMixin, Base):
    __tablename__ = "inbox"


class JobSchedule(ScheduleMixin, Base):
    __tablename__ = "schedules"


_DYNAMIC: dict[tuple[str, str, str | None, str | None], type[Any]] = {}
_BASES: dict[tuple[str | None, str | None], type[DeclarativeBase]] = {}


def _base_for(schema: str | None, partitioned: str | None = None) -> type[DeclarativeBase]:
    """A private declarative base per schema (and layout: a plain and a partitioned model of one table name
    need two metadatas) whose metadata puts its tables in that schema (the mixins' own ``__table_args__`` —
    constraints and partial indexes — stay intact)."""
    key = (schema, partitioned)
    if key not in _BASES:
        suffix = f"{schema or 'default'}{'_' + partitioned if partitioned else ''}"
        _BASES[key] = type(
            f"_DynamicBase_{suffix}", (DeclarativeBase,), {"metadata": MetaData(schema=schema)}
        )
    return _BASES[key]


def model_for(
    kind: str, table: str, schema: str | None = None, *, partitioned: str | None = None
) -> type[Any]:
    """A mapped class for an existing outbox/jobs/schedules table known only by name (the CLI's
    ``--outbox-table``, ``schema.table`` split into ``schema`` and ``table``); ``partitioned``: the table's
    partition period (docs/partitioning.md).

    The reference models are returned for the default names; other names get a class of their own on a
    private metadata (cached), never touching the application's metadata.
    """
    if kind not in ("outbox", "jobs", "schedules"):
        raise ConfigurationError(f"kind must be 'outbox', 'jobs' or 'schedules', got {kind!r}")
    for reference in (OutboxEvent, Job, JobSchedule):
        if (
            schema is None
            and partitioned is None
            and (kind, table) == (reference.sa_outbox_kind, reference.__tablename__)
        ):
            return reference
    key = (kind, table, schema, partitioned)
    if key not in _DYNAMIC:
        mixin: type[Any] = {"outbox": OutboxMixin, "jobs": JobMixin, "schedules": ScheduleMixin}[kind]
        name = "".join(part.capitalize() for part in f"{schema or ''}_{kind}_{table}".split("_") if part)
        attrs: dict[str, Any] = {"__tablename__": table}
        if partitioned is not None:
            attrs["sa_outbox_partitioned"] = partitioned
        _DYNAMIC[key] = type(name, (mixin, _base_for(schema, partitioned)), attrs)
    return _DYNAMIC[key]
