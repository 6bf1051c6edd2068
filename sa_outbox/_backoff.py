"""Every delay the library waits, in one place.

* :class:`Backoff` — the retry policy of a failed message or job: ``delay(attempt) = min(cap, base · 2**attempt)``
  seconds, and with ``jitter=True`` (AWS "full jitter") a uniform random value in ``[0, that]``. The delay is
  added to the *database's* ``now()`` by the finalize statement; only its length is computed here. Defaults:
  the outbox uses full jitter (base 1 s, cap 300 s) so that a recovered broker is not hit by every retry at
  once; jobs use ``min(300 s, 2**attempts s)`` without jitter, as in the jobs design (2 s, 4 s, …).
* :data:`DATABASE_OUTAGE` — how long a loop waits before trying a database that is down again;
* :data:`STATEMENT_RETRY` — the waits between retries of one statement (a finalize) after a connection fault;
* :data:`LISTEN_RECONNECT` — how long a waker polls before it tries its LISTEN connection again;
* :data:`MIGRATION_LOCK_RETRY` — how long a migration revision that gave up waiting for a lock waits before
  it runs again (:func:`sa_outbox.migration.run_migrations_with_lock_retries`);
* :data:`DESTINATION_OUTAGE` — how long a dispatcher stops claiming after its destination was unavailable
  (the circuit breaker), before it sends one probe message.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ._durations import Duration, to_seconds

__all__ = [
    "DATABASE_OUTAGE",
    "DESTINATION_OUTAGE",
    "LISTEN_RECONNECT",
    "MIGRATION_LOCK_RETRY",
    "STATEMENT_RETRY",
    "Backoff",
]


@dataclass(frozen=True)
class Backoff:
    """``min(cap, base · 2**attempt)`` seconds, randomised in ``[0, that]`` with ``jitter``."""

    base: float = 1.0
    cap: float = 300.0
    jitter: bool = True

    def __init__(self, base: Duration = 1.0, cap: Duration = 300.0, jitter: bool = True) -> None:
        object.__setattr__(self, "base", to_seconds(base, name="backoff base", allow_zero=False))
        object.__setattr__(self, "cap", to_seconds(cap, name="backoff cap", allow_zero=False))
        object.__setattr__(self, "jitter", bool(jitter))

    def ceiling(self, attempt: int) -> float:
        """``min(cap, base · 2**attempt)`` without overflow for large attempt numbers."""
        if attempt >= 1024 or self.base * math.pow(2.0, attempt) > self.cap:
            return self.cap
        return self.base * math.pow(2.0, attempt)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before the next try, after the ``attempt``-th attempt failed."""
        ceiling = self.ceiling(attempt)
        return random.uniform(0.0, ceiling) if self.jitter else ceiling

    def give_up_window(self, max_attempts: int) -> tuple[float, float]:
        """Seconds from the first attempt to the last of ``max_attempts`` when every one fails (the waits
        between them; the attempts' own run time not counted): ``(shortest, longest)`` — equal without jitter,
        from 0 to the sum of the ceilings with it (half that on average)."""
        longest = sum(self.ceiling(k) for k in range(1, max_attempts))
        return (0.0 if self.jitter else longest), longest


@dataclass(frozen=True)
class _HalfJitter:
    """``min(cap, base · 2**n)`` scaled by a random factor in ``[0.5, 1]``: never a hot loop, never a herd."""

    base: float
    cap: float

    def delay(self, failures: int) -> float:
        ceiling = min(self.cap, self.base * 2 ** min(max(failures, 0), 30))
        return float(ceiling * random.uniform(0.5, 1.0))


OUTBOX_BACKOFF = Backoff(1.0, 300.0, jitter=True)
JOBS_BACKOFF = Backoff(1.0, 300.0, jitter=False)

#: Between attempts to reach a database that is down: 0.2 s, 0.4 s, … up to 30 s.
DATABASE_OUTAGE = _HalfJitter(0.1, 30.0)
#: A worker's wait after a database fault ends at a heartbeat that gets through (the database answers), but
#: not before it has lasted this long: a fault that keeps coming is tried at most once a second or so, not at
#: the pace of a short heartbeat (a review: every 0.05 s, with a WARNING each time).
BEAT_ENDS_FAULT_WAIT_AFTER = 1.0
#: Between retries of one statement after a connection fault (tenacity's ``wait``): 0.1 s … 5 s.
STATEMENT_RETRY = _HalfJitter(0.05, 5.0)
#: A waker whose LISTEN connection failed polls for this long before it tries again.
LISTEN_RECONNECT = 5.0
#: A dispatcher whose destination is unavailable claims nothing for this long (then sends one probe):
#: 1 s, 2 s, … up to 60 s.
DESTINATION_OUTAGE = _HalfJitter(0.5, 60.0)
#: A migration revision that gave up waiting for a lock (``lock_timeout``) runs again after 0.1 s … 5 s.
MIGRATION_LOCK_RETRY = _HalfJitter(0.1, 5.0)
