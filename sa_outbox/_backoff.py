"""Backoff: one policy type for both tables.

``delay(attempt) = min(cap, base · 2**attempt)`` seconds, and with ``jitter=True`` (AWS "full jitter") a uniform
random value in ``[0, that]``. The delay is added to the *database's* ``now()`` by the finalize statement;
only its length is computed here.

Defaults: the outbox uses full jitter (base 1 s, cap 300 s) so that a recovered broker is not hit by every
retry at once; jobs use ``min(300 s, 2**attempts s)`` without jitter, as in the jobs document (2 s, 4 s, …).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ._durations import Duration, to_seconds

__all__ = ["Backoff"]


@dataclass(frozen=True)
class Backoff:
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


OUTBOX_BACKOFF = Backoff(1.0, 300.0, jitter=True)
JOBS_BACKOFF = Backoff(1.0, 300.0, jitter=False)
