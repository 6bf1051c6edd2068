"""Option values: every lease, timeout, delay and interval option takes a ``timedelta`` or seconds; counts are
integers >= 1."""

from __future__ import annotations

import math
import re
from datetime import timedelta

from .errors import ConfigurationError

Duration = timedelta | int | float

__all__ = ["Duration", "parse_duration", "positive_int", "to_seconds", "to_timedelta"]

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

#: The longest duration any option takes: about 1,000 years. A time this far from now is still a timestamp
#: Python can read back (a delay of 300,000,000 days made a job whose row no query could load), and any
#: interval PostgreSQL can add to now().
MAX_DAYS = 365_000
_MAX_SECONDS = MAX_DAYS * 86400.0
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")


def to_timedelta(value: Duration, *, name: str = "duration", allow_zero: bool = True) -> timedelta:
    """Normalise a duration option; refuse negatives, NaN, infinities and non-numbers with a clear error."""
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise ConfigurationError(
            f"{name} must be a datetime.timedelta or a number of seconds, got {type(value).__name__} {value!r}"
        )
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if math.isnan(seconds) or math.isinf(seconds):
        raise ConfigurationError(f"{name} must be a finite duration, got {value!r}")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise ConfigurationError(f"{name} must be {'>= 0' if allow_zero else '> 0'} seconds, got {seconds:g}")
    if seconds > _MAX_SECONDS:
        raise ConfigurationError(
            f"{name} must be at most {MAX_DAYS:,} days (about 1,000 years), got {seconds:g} seconds"
        )
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


def to_seconds(value: Duration, *, name: str = "duration", allow_zero: bool = True) -> float:
    return to_timedelta(value, name=name, allow_zero=allow_zero).total_seconds()


def parse_duration(text: str) -> timedelta:
    """Parse a CLI duration: ``90`` (seconds), ``30s``, ``500ms``, ``5m``, ``3h``, ``7d``."""
    match = _DURATION_RE.match(text)
    if not match:
        raise ConfigurationError(
            f"invalid duration {text!r}: use seconds or a number with a unit (90, 30s, 5m, 3h, 7d)"
        )
    number, unit = match.groups()
    seconds = float(number) * _UNITS[unit or "s"]
    if seconds > _MAX_SECONDS:
        raise ConfigurationError(f"invalid duration {text!r}: at most {MAX_DAYS:,} days (about 1,000 years)")
    return timedelta(seconds=seconds)


def positive_int(value: object, name: str) -> int:
    """An integer option that must be >= 1 (a batch size, a count); bool and other types are refused."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be an integer >= 1, got {value!r}")
    return value
