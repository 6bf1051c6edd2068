"""The one error vocabulary of sa_outbox.

Two families live here, all rooted at :class:`OutboxError`:

* the *failure classes* a publisher or a job handler raises to tell the loop what to do with a message
  (``RetryableError``, its special cases ``DestinationUnavailable`` and ``NoAnswer``, ``PermanentError``,
  ``Defer``);
* errors sa_outbox raises to its caller (bad payload, bad configuration, missing table), each with a message
  that says what to do.

This module imports nothing else from the package.
"""

from __future__ import annotations

import math
from datetime import timedelta

__all__ = [
    "ConfigurationError",
    "Defer",
    "DestinationUnavailable",
    "JobCancelled",
    "NoAnswer",
    "OutboxError",
    "PartitionClosedError",
    "PayloadError",
    "PermanentError",
    "RetryableError",
    "SchemaError",
]


class OutboxError(Exception):
    """Root of every exception sa_outbox defines."""


class RetryableError(OutboxError):
    """A transient failure of this message (timeout, 5xx, 429).

    The message goes back to the ready state with backoff and consumes the attempt; once attempts are
    exhausted it ends ``dead`` (outbox) or ``failed`` (jobs).
    """


class NoAnswer(RetryableError):
    """The destination did not answer in time: no confirm, acknowledgement or PUBACK within the publisher's
    timeout on a connection that was working, a hung connection — an outage (a stalled network, a frozen
    broker) as likely as a fault of this message, and whether the broker took the message is unknown.

    The attempt is spent and the message retried with backoff, as for ``RetryableError`` — but it never ends
    the message: on its last attempt the message goes back with that attempt refunded, at the backoff's delay,
    so that a stall an outage causes never sends a message to ``dead`` whatever attempt it meets (the
    dispatcher's ``give_up_after`` still bounds how long it is tried). Every shipped publisher raises it for a
    timeout it cannot tell from an outage.
    """


class DestinationUnavailable(RetryableError):
    """The destination as a whole is down (connection refused or lost, DNS failure, broker not ready) — as
    opposed to "this message failed".

    Every shipped publisher raises it for those faults. The attempt is refunded and the dispatcher pauses
    its claims (a circuit breaker) instead of spending the message's attempts on an outage.
    """


class PermanentError(OutboxError):
    """A failure that retrying will not fix (validation error, unknown destination).

    The message goes straight to ``dead`` / ``failed`` for a person to look at.
    """


class Defer(OutboxError):
    """Not a failure: the message cannot be handled *yet* (a business precondition is missing).

    The message goes back to the ready state at ``now() + delay`` (database clock) and the attempt the
    claim consumed is refunded, so deferring never exhausts ``max_attempts``. ``delay`` is a ``timedelta`` or
    a number of seconds.
    """

    def __init__(self, delay: timedelta | float, reason: str = "deferred") -> None:
        super().__init__(reason)
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else delay
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise ConfigurationError(
                f"Defer.delay must be a datetime.timedelta or a number of seconds, got {delay!r}"
            )
        if math.isnan(seconds) or math.isinf(seconds):
            raise ConfigurationError(f"Defer.delay must be a finite duration, got {delay!r}")
        if seconds < 0:
            raise ConfigurationError(f"Defer.delay must be >= 0 seconds, got {seconds:g}")
        self.delay: timedelta = delay if isinstance(delay, timedelta) else timedelta(seconds=seconds)
        self.reason = reason


class JobCancelled(OutboxError):
    """Raised by :meth:`ClaimedJob.raise_if_cancelled <sa_outbox.ClaimedJob.raise_if_cancelled>` when the job's
    cancellation was requested; a handler that stops with it (or with any exception after the request) is
    recorded ``cancelled``."""


class PayloadError(OutboxError, ValueError):
    """An event or job cannot be written: its payload or a required field is invalid.

    Raised before anything reaches the database; the flush or call writes nothing.
    """


class ConfigurationError(OutboxError, ValueError):
    """An option given to a Dispatcher, Worker, publisher or CLI command is invalid."""


class SchemaError(OutboxError):
    """The outbox/jobs table is missing or does not have the expected shape (run the migration)."""


class PartitionClosedError(SchemaError):
    """An operator action (``retry_dead``, ``skip_dead``, ``retry_jobs``, ``update_jobs``) selected rows in a
    partition that a retire has closed to writes (``sa_outbox_retiring``): their rows cannot be changed.

    Raised before anything is written, ``changed`` empty; or, when the partition was closed while the call ran
    its batches, at the batch that met it: ``changed`` holds every id the earlier batches changed (committed).
    ``partitions``: name → how many of the selected, unchanged rows each closed partition holds."""

    def __init__(self, message: str, *, changed: list[int], partitions: dict[str, int]) -> None:
        super().__init__(message)
        self.changed = changed
        self.partitions = partitions
