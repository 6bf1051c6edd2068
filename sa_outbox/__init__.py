"""sa_outbox: a transactional outbox and job queue for SQLAlchemy 2.x on PostgreSQL.

Events and jobs are written in the caller's own transaction (they exist if and only if it commits) and are
delivered by dispatcher/worker processes that claim rows in short transactions with a lease and a fencing
token (``lease_version``): at least once, never for a rolled-back transaction, in per-aggregate order when
asked. See README.md for the guarantees in plain words.

Public names are imported lazily (PEP 562), so ``python -m sa_outbox`` can install its signal handlers
before anything heavy is imported. Importing a mixin registers the producer's flush hook.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from .aio import AsyncDispatcher, AsyncWorker
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
    from .inbox import InboxMixin, Receipt, receive
    from .messages import BatchPublisher, ClaimedJob, Message, Publisher
    from .migration import set_queue_storage_parameters
    from .producer import LOCK_AGGREGATES, channel_for, emit, enqueue, event_for, lock_aggregate
    from .schema import JOB_STATUSES, OUTBOX_STATUSES, JobMixin, OutboxMixin
    from .worker import TaskRegistry, Worker

_EXPORTS: dict[str, str] = {
    "AsyncDispatcher": "aio",
    "AsyncWorker": "aio",
    "Backoff": "backoff",
    "BatchPublisher": "messages",
    "ClaimedJob": "messages",
    "ConfigurationError": "errors",
    "Defer": "errors",
    "Dispatcher": "dispatcher",
    "InboxMixin": "inbox",
    "Receipt": "inbox",
    "receive": "inbox",
    "Duration": "durations",
    "JOB_STATUSES": "schema",
    "JobMixin": "schema",
    "LOCK_AGGREGATES": "producer",
    "Message": "messages",
    "OUTBOX_STATUSES": "schema",
    "OutboxError": "errors",
    "OutboxMixin": "schema",
    "PayloadError": "errors",
    "PermanentError": "errors",
    "Publisher": "messages",
    "RetryableError": "errors",
    "SchemaError": "errors",
    "TaskRegistry": "worker",
    "Worker": "worker",
    "channel_for": "producer",
    "emit": "producer",
    "enqueue": "producer",
    "event_for": "producer",
    "lock_aggregate": "producer",
    "set_queue_storage_parameters": "migration",
}

__all__ = [
    "JOB_STATUSES",
    "LOCK_AGGREGATES",
    "OUTBOX_STATUSES",
    "AsyncDispatcher",
    "AsyncWorker",
    "Backoff",
    "BatchPublisher",
    "ClaimedJob",
    "ConfigurationError",
    "Defer",
    "Dispatcher",
    "Duration",
    "InboxMixin",
    "JobMixin",
    "Message",
    "OutboxError",
    "OutboxMixin",
    "PayloadError",
    "PermanentError",
    "Publisher",
    "Receipt",
    "RetryableError",
    "SchemaError",
    "TaskRegistry",
    "Worker",
    "__version__",
    "channel_for",
    "emit",
    "enqueue",
    "event_for",
    "lock_aggregate",
    "receive",
    "set_queue_storage_parameters",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sa_outbox' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
