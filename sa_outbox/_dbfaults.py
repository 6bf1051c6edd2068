"""Which database errors are an outage to ride out, and which name a cause no retry will fix.

One place for the question every loop, command and retry policy asks about a database exception:

* :func:`is_connection_error` — the connection failed or was lost (worth retrying while the server restarts);
* :func:`is_permanent_connection_error` — a connection that can never succeed with this URL (no such
  database or role, authentication refused, unknown host, invalid options): fail fast and say why, do not
  ride it out as an outage. Such an error is also a connection error, so ask this question first;
* :func:`connection_error_cause` — the server's or libpq's own words for it, one line.
"""

from __future__ import annotations

import re

import psycopg
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

__all__ = [
    "connection_error_cause",
    "is_connect_failure",
    "is_connection_error",
    "is_permanent_connection_error",
]


def is_connection_error(exc: BaseException) -> bool:
    """A fault worth retrying: the server went away, restarted, or refused the connection."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, OperationalError | InterfaceError) or _protocol_lost(exc)


def _protocol_lost(exc: BaseException) -> bool:
    """psycopg lost the thread of the protocol on a connection: its own ``InternalError``, with no SQLSTATE
    (one the server sends has one, ``XX000``…). PgBouncer in transaction mode answers the ROLLBACK of a
    transaction whose server connection died with that server's error *and* the ROLLBACK's result — "received 2
    results from command 'ROLLBACK'" — and psycopg closes the connection. SQLAlchemy tells it a disconnect only
    where it holds the connection; in a new connection's connect event (its first-connect rollback) it cannot,
    and a loop took it for a fatal error and died (the model suite through PgBouncer)."""
    driver = _driver_error(exc)
    return isinstance(driver, psycopg.InternalError) and driver.sqlstate is None


# A URL or connection option libpq refuses before it even tries to connect.
_INVALID_OPTIONS = (
    "invalid connection option",
    "invalid dsn",
    'missing "=" after',
    "invalid sslmode value",
    "invalid integer value",
    "invalid port number",
)

# What libpq/psycopg say when a connection cannot be made at all (the connection phase, not a statement).
_CONNECT_PHASE = (
    "connection failed",
    "connection to server",
    "failed to resolve host",
    "could not translate host name",
    *_INVALID_OPTIONS,
)

# Connection-phase failures that the same URL will meet again however long one waits. (The server's FATAL
# messages are matched in English: psycopg exposes no SQLSTATE for a failed connection.)
_PERMANENT = (
    "does not exist",  # database "x" does not exist (3D000) / role "x" does not exist (28000)
    "authentication failed",  # password / ident / peer / GSS / SSPI / cert (28P01, 28000)
    "no pg_hba.conf entry",
    "pg_hba.conf rejects connection",
    "is not permitted to log in",
    "no password supplied",
    "permission denied for database",
    "server does not support ssl",
    "certificate verify failed",
    "name or service not known",  # DNS: no such host (EAI_NONAME); "temporary failure" stays retryable
    "nodename nor servname provided",
    "no address associated with hostname",
    *_INVALID_OPTIONS,
)

# SQLSTATEs of the same causes, for drivers that report one on a failed connection.
_PERMANENT_SQLSTATES = frozenset(("3D000", "28000", "28P01"))


def _driver_error(exc: BaseException) -> BaseException:
    orig = exc.orig if isinstance(exc, DBAPIError) else None
    return orig if isinstance(orig, BaseException) else exc


#: The server ending a session (admin shutdown, crash shutdown, cannot connect now): the connection is gone.
_SESSION_ENDED_SQLSTATES = frozenset(("57P01", "57P02", "57P03"))


def is_lost_connection(exc: BaseException) -> bool:
    """The connection itself is gone — the server ended the session, or the link broke (no SQLSTATE, or class
    08) — as opposed to a statement the server refused on a live one: a lock or statement timeout, a
    serialization failure or a deadlock are ``OperationalError`` too, and the loops invalidate their connection
    after any of them, so neither the class nor ``connection_invalidated`` tells the two apart."""
    driver = _driver_error(exc)
    if _protocol_lost(exc):
        return True
    if not isinstance(driver, psycopg.OperationalError):
        return False
    state = driver.sqlstate
    return state is None or state.startswith("08") or state in _SESSION_ENDED_SQLSTATES


def is_connect_failure(exc: BaseException) -> bool:
    """The error comes from opening a connection (as opposed to a statement on an open one)."""
    driver = _driver_error(exc)
    if not isinstance(driver, psycopg.Error):
        return False
    if isinstance(driver, psycopg.errors.ConnectionTimeout):  # connect_timeout ran out: a hung server, a
        return True  # network that drops packets — worth retrying (was "refused the command", exit 2)
    message = str(driver).lower()
    return any(marker in message for marker in _CONNECT_PHASE)


def is_permanent_connection_error(exc: BaseException) -> bool:
    """A connection that retrying the same URL cannot fix: the server answered and refused (no such
    database or role, authentication failed, no ``pg_hba.conf`` entry, no CONNECT privilege, SSL refused),
    the host name does not exist, or the URL's options are invalid. A server that is down, restarting,
    unreachable or out of connection slots is not permanent."""
    driver = _driver_error(exc)
    if not isinstance(driver, psycopg.Error):
        return False
    if (
        isinstance(driver, psycopg.OperationalError)
        and getattr(driver, "sqlstate", None) in _PERMANENT_SQLSTATES
    ):
        return True
    if not is_connect_failure(exc):
        return False
    message = str(driver).lower()
    return any(marker in message for marker in _PERMANENT)


def connection_error_cause(exc: BaseException) -> str:
    """The cause in one line, as the server or libpq put it (``database "x" does not exist``,
    ``Connection refused``), without the driver's prefixes."""
    text = " ".join(str(_driver_error(exc)).split())
    fatal = re.search(r"FATAL:\s*(.*)", text)
    if fatal:
        return fatal.group(1).strip()
    text = re.sub(r"^connection failed:\s*", "", text)
    return text.split(" Is the server running")[0].strip() or type(exc).__name__
