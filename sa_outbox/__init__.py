"""sa_outbox: a transactional outbox and job queue for SQLAlchemy 2.x on PostgreSQL.

Events and jobs are written in the caller's own transaction (they exist if and only if it commits) and are
delivered by dispatcher/worker processes that claim rows in short transactions with a lease and a fencing
token (``lease_version``): at least once, never for a rolled-back transaction, in per-aggregate order when
asked. See README.md for the guarantees in plain words.
"""

from __future__ import annotations

from ._version import __version__
from .backoff import Backoff
from .dispatcher import Dispatcher
from .durations import Duration
from .errors import (
    ConfigurationError,
    Defer,
    OutboxError,
    PayloadError,
    PermanentError,
    RetryableError,
    SchemaError,
)
from .messages import BatchPublisher, ClaimedJob, Message, Publisher
from .migration import set_queue_storage_parameters
from .producer import LOCK_AGGREGATES, channel_for, enqueue, event_for, lock_aggregate
from .schema import JOB_STATUSES, OUTBOX_STATUSES, JobMixin, OutboxMixin
from .worker import TaskRegistry, Worker

__all__ = [
    "JOB_STATUSES",
    "LOCK_AGGREGATES",
    "OUTBOX_STATUSES",
    "Backoff",
    "BatchPublisher",
    "ClaimedJob",
    "ConfigurationError",
    "Defer",
    "Dispatcher",
    "Duration",
    "JobMixin",
    "Message",
    "OutboxError",
    "OutboxMixin",
    "PayloadError",
    "PermanentError",
    "Publisher",
    "RetryableError",
    "SchemaError",
    "TaskRegistry",
    "Worker",
    "__version__",
    "channel_for",
    "enqueue",
    "event_for",
    "lock_aggregate",
    "set_queue_storage_parameters",
]
