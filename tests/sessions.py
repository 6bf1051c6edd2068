"""Sessions the operations tests hold open on purpose (each on its own connection, ended by the caller)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import URL


def open_snapshot(conn: Connection, application_name: str, *statements: str) -> int:
    """Start a REPEATABLE READ transaction named ``application_name`` on ``conn`` and run ``statements`` in
    it (the first takes the snapshot); it stays open until the caller ends it. Returns the backend pid."""
    conn.execute(text("SELECT set_config('application_name', :name, false)"), {"name": application_name})
    conn.commit()
    conn.execution_options(isolation_level="REPEATABLE READ")
    conn.begin()
    for statement in statements or ("SELECT 1",):
        conn.execute(text(statement))
    return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


@contextmanager
def throwaway_database(server_url: URL, prefix: str, *setup: str) -> Iterator[URL]:
    """A database of its own on the same server (``setup`` statements run as the admin after it is created,
    ``{name}`` replaced by its name); dropped, with any session still in it, when the block ends."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
            for statement in setup:
                conn.execute(text(statement.format(name=name)))
        yield server_url.set(database=name)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
