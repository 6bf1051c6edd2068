"""Database fault classification against a real server: a connection that can never succeed is told apart
from an outage (so that it fails fast, naming the cause) and from an error of one statement."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL

from sa_outbox._dbfaults import (
    connection_error_cause,
    is_connection_error,
    is_lost_connection,
    is_permanent_connection_error,
)

from .sessions import throwaway_database


def connect_error(url: URL) -> Exception:
    engine = create_engine(url)
    try:
        with engine.connect():
            pass
    except Exception as exc:
        return exc
    finally:
        engine.dispose()
    raise AssertionError(f"connecting to {url!r} succeeded")


@pytest.fixture
def locked_database(server_url: URL) -> Iterator[tuple[URL, str]]:
    """A throwaway database without CONNECT for PUBLIC and throwaway roles (one may log in, one may not)."""
    role = f"sa_outbox_visitor_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE ROLE "{role}" LOGIN'))
        conn.execute(text(f'CREATE ROLE "{role}_nologin" NOLOGIN'))
    try:
        with throwaway_database(
            server_url, "sa_outbox_locked", 'REVOKE CONNECT ON DATABASE "{name}" FROM PUBLIC'
        ) as url:
            yield url.set(username=role), role
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP ROLE IF EXISTS "{role}"'))
            conn.execute(text(f'DROP ROLE IF EXISTS "{role}_nologin"'))
        admin.dispose()


def test_a_missing_database_is_permanent_and_named(server_url: URL) -> None:
    exc = connect_error(server_url.set(database="no_such_database_q7"))
    assert is_connection_error(exc) and is_permanent_connection_error(exc)
    assert connection_error_cause(exc) == 'database "no_such_database_q7" does not exist'


def test_refused_logins_are_permanent(server_url: URL, locked_database: tuple[URL, str]) -> None:
    url, role = locked_database
    for bad, cause in (
        (server_url.set(username="no_such_role_q7"), 'role "no_such_role_q7" does not exist'),
        (server_url.set(username=f"{role}_nologin"), f'role "{role}_nologin" is not permitted to log in'),
        (url, f'permission denied for database "{url.database}"'),
    ):
        exc = connect_error(bad)
        assert is_permanent_connection_error(exc), exc
        assert connection_error_cause(exc).startswith(cause), connection_error_cause(exc)


def over_tcp(url: URL, host: str, port: int | None = None) -> URL:
    """``url`` to ``host`` over TCP: without the ``?host=`` of a unix socket (the embedded server's), which
    libpq would prefer to the URL's host."""
    query = {k: v for k, v in url.query.items() if k != "host"}
    return url.set(host=host, port=port if port is not None else url.port, query=query)


def test_a_host_that_does_not_exist_is_permanent(server_url: URL) -> None:
    exc = connect_error(over_tcp(server_url, "no-such-host.invalid"))
    assert is_permanent_connection_error(exc)
    assert "no-such-host.invalid" in connection_error_cause(exc)


def test_a_server_that_refuses_the_connection_is_an_outage_not_permanent(server_url: URL) -> None:
    exc = connect_error(over_tcp(server_url, "127.0.0.1", 1))
    assert is_connection_error(exc) and not is_permanent_connection_error(exc)
    assert connection_error_cause(exc).endswith("failed: Connection refused")


def test_an_error_of_one_statement_is_not_a_connection_fault(engine: Engine) -> None:
    with engine.connect() as conn, pytest.raises(Exception) as info:
        conn.execute(text("SELECT * FROM no_such_table_q7"))
    assert 'relation "no_such_table_q7" does not exist' in str(info.value)
    assert not is_permanent_connection_error(info.value)
    assert not is_permanent_connection_error(ValueError("database does not exist"))  # not a driver error


def test_an_internal_error_the_server_sends_is_not_a_lost_connection(engine: Engine) -> None:
    """psycopg's own ``InternalError`` (no SQLSTATE: the protocol lost on a pooled connection) is a lost
    connection (tests/test_pgbouncer.py shows it through PgBouncer); the server's internal errors, which carry a
    SQLSTATE of class XX, are one statement's error on a live connection."""
    with engine.connect() as conn, pytest.raises(Exception) as info:
        conn.execute(text("DO $$ BEGIN RAISE EXCEPTION 'corrupt' USING ERRCODE = 'XX001'; END $$"))
    assert type(info.value.orig).__name__ == "DataCorrupted"  # type: ignore[attr-defined]
    assert not is_connection_error(info.value) and not is_lost_connection(info.value)
