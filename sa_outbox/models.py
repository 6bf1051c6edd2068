"""Reference models: ``OutboxEvent`` on table ``outbox`` and ``Job`` on table ``jobs``.

The project's alembic environment, the demo and the tests use them; applications usually declare their own
classes with the mixins on their own ``Base`` (see README).
"""

from __future__ import annotations

from sqlalchemy import MetaData
from sqlalchemy.orm import DeclarativeBase

from .schema import JobMixin, OutboxMixin

__all__ = ["Base", "Job", "OutboxEvent"]


class Base(DeclarativeBase):
    metadata = MetaData()


class OutboxEvent(OutboxMixin, Base):
    __tablename__ = "outbox"


class Job(JobMixin, Base):
    __tablename__ = "jobs"
