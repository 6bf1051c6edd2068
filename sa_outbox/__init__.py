"""sa_outbox: a transactional outbox and job queue for SQLAlchemy 2.x on PostgreSQL.

Events and jobs are written in the caller's own transaction (they exist if and only if it commits) and are
delivered by dispatcher/worker processes that claim rows in short transactions with a lease and a fencing
token (``lease_version``): at least once, never for a rolled-back transaction, in per-aggregate order when
asked. See README.md and docs/ for the guarantees in plain words.

This module is the whole public surface, with the documented modules ``errors``, ``admin``, ``monitoring``,
``doctor``, ``metrics``, ``migration``, ``inbox``, ``testing``, ``models``, ``embedded``, ``cdc`` and
``publishers.*``. Modules whose name starts with an underscore are implementation and may change.

Public names are imported lazily (PEP 562), so ``python -m sa_outbox`` can install its signal handlers
before anything heavy is imported. ``_EXPORTS`` is the one list of them; the ``TYPE_CHECKING`` block repeats
it for type checkers and ``tests/test_public_api.py`` checks that the two agree.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from ._backoff import Backoff as Backoff
    from ._dispatcher import AsyncDispatcher as AsyncDispatcher
    from ._dispatcher import Dispatcher as Dispatcher
    from ._durations import Duration as Duration
    from ._enqueue import Enqueued as Enqueued
    from ._limits import Limit as Limit
    from ._messages import BatchPublisher as BatchPublisher
    from ._messages import ClaimedJob as ClaimedJob
    from ._messages import Message as Message
    from ._messages import Publisher as Publisher
    from ._partitions import PartitionInfo as PartitionInfo
    from ._partitions import PartitionReport as PartitionReport
    from ._partitions import list_partitions as list_partitions
    from ._partitions import maintain_partitions as maintain_partitions
    from ._pgbouncer import pgbouncer_async_engine as pgbouncer_async_engine
    from ._pgbouncer import pgbouncer_engine as pgbouncer_engine
    from ._producer import emit as emit
    from ._producer import enqueue as enqueue
    from ._producer import enqueue_many as enqueue_many
    from ._producer import lock_aggregate as lock_aggregate
    from ._schedules import Schedule as Schedule
    from ._schedules import fire_due_schedules as fire_due_schedules
    from ._schedules import pause_schedule as pause_schedule
    from ._schedules import resume_schedule as resume_schedule
    from ._schedules import run_schedule_now as run_schedule_now
    from ._schedules import sync_schedules as sync_schedules
    from ._schema import JOB_STATUSES as JOB_STATUSES
    from ._schema import OUTBOX_STATUSES as OUTBOX_STATUSES
    from ._schema import CdcOutboxMixin as CdcOutboxMixin
    from ._schema import JobMixin as JobMixin
    from ._schema import OutboxMixin as OutboxMixin
    from ._schema import ScheduleMixin as ScheduleMixin
    from ._worker import AsyncWorker as AsyncWorker
    from ._worker import TaskRegistry as TaskRegistry
    from ._worker import Worker as Worker
    from .admin import cancel_jobs as cancel_jobs
    from .admin import job_result as job_result
    from .admin import list_dead as list_dead
    from .admin import retry_dead as retry_dead
    from .admin import skip_dead as skip_dead
    from .errors import ConfigurationError as ConfigurationError
    from .errors import Defer as Defer
    from .errors import DestinationUnavailable as DestinationUnavailable
    from .errors import NoAnswer as NoAnswer
    from .errors import OutboxError as OutboxError
    from .errors import PartitionClosedError as PartitionClosedError
    from .errors import PayloadError as PayloadError
    from .errors import PermanentError as PermanentError
    from .errors import RetryableError as RetryableError
    from .errors import SchemaError as SchemaError
    from .inbox import InboxMixin as InboxMixin
    from .inbox import Receipt as Receipt
    from .inbox import receive as receive
    from .migration import set_queue_storage_parameters as set_queue_storage_parameters
    from .monitoring import purge as purge
    from .monitoring import queue_status as queue_status

#: Public name -> the module that defines it (relative to this package).
_EXPORTS: dict[str, str] = {
    "AsyncDispatcher": "_dispatcher",
    "AsyncWorker": "_worker",
    "Backoff": "_backoff",
    "BatchPublisher": "_messages",
    "CdcOutboxMixin": "_schema",
    "ClaimedJob": "_messages",
    "ConfigurationError": "errors",
    "Defer": "errors",
    "DestinationUnavailable": "errors",
    "Dispatcher": "_dispatcher",
    "Duration": "_durations",
    "Enqueued": "_enqueue",
    "InboxMixin": "inbox",
    "JOB_STATUSES": "_schema",
    "JobMixin": "_schema",
    "Limit": "_limits",
    "Message": "_messages",
    "NoAnswer": "errors",
    "OUTBOX_STATUSES": "_schema",
    "OutboxError": "errors",
    "OutboxMixin": "_schema",
    "PartitionClosedError": "errors",
    "PartitionInfo": "_partitions",
    "PartitionReport": "_partitions",
    "PayloadError": "errors",
    "PermanentError": "errors",
    "Publisher": "_messages",
    "Receipt": "inbox",
    "RetryableError": "errors",
    "Schedule": "_schedules",
    "ScheduleMixin": "_schema",
    "SchemaError": "errors",
    "TaskRegistry": "_worker",
    "Worker": "_worker",
    "cancel_jobs": "admin",
    "emit": "_producer",
    "enqueue": "_producer",
    "enqueue_many": "_producer",
    "fire_due_schedules": "_schedules",
    "job_result": "admin",
    "list_dead": "admin",
    "list_partitions": "_partitions",
    "lock_aggregate": "_producer",
    "maintain_partitions": "_partitions",
    "pause_schedule": "_schedules",
    "pgbouncer_async_engine": "_pgbouncer",
    "pgbouncer_engine": "_pgbouncer",
    "purge": "monitoring",
    "queue_status": "monitoring",
    "receive": "inbox",
    "resume_schedule": "_schedules",
    "retry_dead": "admin",
    "run_schedule_now": "_schedules",
    "set_queue_storage_parameters": "migration",
    "skip_dead": "admin",
    "sync_schedules": "_schedules",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sa_outbox' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
