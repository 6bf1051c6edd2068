"""Fleet-wide limits on a queue: how many of its jobs may run at once (per queue, or per concurrency key) and
how many may start per time window — enforced from the rows at claim time.

A limited queue is claimed in one short transaction of two statements: the first picks candidate jobs in claim
order (``FOR NO KEY UPDATE SKIP LOCKED``), skipping keys that are already saturated, and takes a
transaction-scoped advisory lock per key (``pg_try_advisory_xact_lock``: a key another worker is claiming right
now is skipped, never waited for); the second, whose snapshot is taken after those locks, counts the key's
running jobs (and its starts in the rate window) and claims only what fits. The running rows are the count —
there is no counter to drift and no slot a crashed worker could keep: its jobs stop counting the moment they
are rescued. The starts of a rate-limited queue are logged in ``<jobs>_starts`` in the same transaction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ._durations import parse_duration, positive_int
from .errors import ConfigurationError

__all__ = ["Limit"]

_RATE = re.compile(r"^\s*(\d+)\s*/\s*(.+?)\s*$")
_WORDS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0, "h": 3600.0,
          "hour": 3600.0, "d": 86400.0, "day": 86400.0}  # fmt: skip


@dataclass(frozen=True)
class Limit:
    """Limits for one queue, across every worker on every host: ``Worker(…, limits={"reports": Limit(5)})``.

    * ``concurrency`` — at most this many of the queue's jobs run at once; with ``per_key=True``, at most this
      many per ``concurrency_key`` (``enqueue(…, concurrency_key="customer:42")``; jobs without a key share the
      empty key). A saturated key never holds up the others.
    * ``rate`` — at most this many job starts per sliding window, e.g. ``"100/min"``, ``"5/s"``, ``"1000/h"``,
      ``"30/10s"`` (per key with ``per_key=True``). A job that must wait for the rate stays queued and spends
      no attempt.
    """

    concurrency: int | None
    per_key: bool
    rate: str | None
    rate_count: int | None
    rate_window: float | None

    def __init__(
        self, concurrency: int | None = None, *, per_key: bool = False, rate: str | None = None
    ) -> None:
        if concurrency is not None:
            positive_int(concurrency, "Limit concurrency")
        if concurrency is None and rate is None:
            raise ConfigurationError("a Limit needs a concurrency, a rate, or both")
        count: int | None = None
        window: float | None = None
        if rate is not None:
            count, window = parse_rate(rate)
        object.__setattr__(self, "concurrency", concurrency)
        object.__setattr__(self, "per_key", bool(per_key))
        object.__setattr__(self, "rate", rate)
        object.__setattr__(self, "rate_count", count)
        object.__setattr__(self, "rate_window", window)


def parse_rate(text: str) -> tuple[int, float]:
    """``"100/min"`` → (100, 60.0); also ``5/s``, ``1000/h``, ``1/day``, ``30/10s`` (a number with a unit)."""
    match = _RATE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ConfigurationError(
            f"invalid rate {text!r}: use a count per window, e.g. '100/min', '5/s', '30/10s'"
        )
    count = int(match.group(1))
    if count < 1:
        raise ConfigurationError(f"invalid rate {text!r}: the count must be >= 1")
    unit = match.group(2).lower()
    window = _WORDS.get(unit.rstrip("s") if unit.endswith("s") and unit not in _WORDS else unit)
    if window is None:
        try:
            window = parse_duration(unit).total_seconds()
        except ConfigurationError:
            raise ConfigurationError(
                f"invalid rate {text!r}: the window must be a unit (s, min, h, day) or a duration (10s, 5m)"
            ) from None
    if window <= 0:
        raise ConfigurationError(f"invalid rate {text!r}: the window must be longer than 0")
    return count, window
