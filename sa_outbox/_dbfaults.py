"""Which database errors are an outage to ride out, and which name a cause no retry will fix.

One place for the question every loop, command and retry policy asks about a database exception.
"""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

__all__ = ["is_connection_error"]


def is_connection_error(exc: BaseException) -> bool:
    """A fault worth retrying: the server went away, restarted, or refused the connection."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, OperationalError | InterfaceError)
