"""The one error vocabulary of sa_outbox.

Two families live here:

* the *failure classes* a publisher or a job handler raises to tell the loop what to do with a message
  (``RetryableError``, ``PermanentError``, ``Defer``), exactly the classification of the outbox document §4;
* errors sa_outbox raises to its caller (bad payload, bad configuration, missing table), all rooted at
  :class:`OutboxError`, each with a message that says what to do.
"""

from __future__ import annotations

from datetime import timedelta

from .durations import Duration, to_timedelta

__all__ = [
    "ConfigurationError",
    "Defer",
    "OutboxError",
    "PayloadError",
    "PermanentError",
    "RetryableError",
    "SchemaError",
]


class OutboxError(Exception):
    """Root of every exception sa_outbox defines."""


class RetryableError(OutboxError):
    """A transient failure (timeout, 5xx, 429, connection refused).

    The message goes back to the ready state with backoff and consumes the attempt; once attempts are
    exhausted it ends ``dead`` (outbox) or ``failed`` (jobs).
    """


class PermanentError(OutboxError):
    """A failure that retrying will not fix (validation error, unknown destination).

    The message goes straight to ``dead`` / ``failed`` for a person to look at.
    """


class Defer(OutboxError):
    """Not a failure: the message cannot be handled *yet* (a business precondition is missing).

    The message goes back to the ready state at ``now() + delay`` (database clock) and the attempt the
    claim consumed is refunded, so deferring never exhausts ``max_attempts``.
    """

    def __init__(self, delay: Duration, reason: str = "deferred") -> None:
        super().__init__(reason)
        self.delay: timedelta = to_timedelta(delay, name="Defer.delay")
        self.reason = reason


class PayloadError(OutboxError, ValueError):
    """An event or job cannot be written: its payload or a required field is invalid.

    Raised at flush, before anything reaches the database; the flush writes nothing.
    """


class ConfigurationError(OutboxError, ValueError):
    """An option given to a Dispatcher, Worker, publisher or CLI command is invalid."""


class SchemaError(OutboxError):
    """The outbox/jobs table is missing or does not have the expected shape (run the migration)."""
