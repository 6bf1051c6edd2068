"""A loop's own database connection: autocommit, kept between statements, dropped after a fault.

Each engine step (rescue, claim, finalize, heartbeat) is one statement, atomic by itself and committed as it
runs — one round trip, no BEGIN/COMMIT. The connection is kept open between batches (no pool checkout per
step) and reopened on the next use after a fault. A missing table surfaces as :class:`SchemaError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar, cast

from sqlalchemy import Connection, Engine, literal, select
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.pool import Pool, QueuePool

from ._execute import forget_cursor, in_autocommit, keep_cursor
from .errors import SchemaError

__all__ = ["AsyncLoopConnection", "LoopConnection", "pool_has_room", "schema_checked", "schema_errors"]

T = TypeVar("T")
P = ParamSpec("P")

_PING = select(literal(1))


#: undefined_table, undefined_column: what a missing or older table raises (by SQLSTATE, not by message text:
#: "prepared statement … does not exist" is not a schema problem).
_SCHEMA_SQLSTATES = frozenset({"42P01", "42703"})


def is_schema_error(exc: ProgrammingError) -> bool:
    """Whether ``exc`` says a table or column is missing (not, say, that permission was denied)."""
    return getattr(exc.orig, "sqlstate", None) in _SCHEMA_SQLSTATES


def _schema_error(exc: ProgrammingError, table: str) -> SchemaError | None:
    if is_schema_error(exc):
        cause = str(exc.orig).strip().splitlines()[0]
        return SchemaError(
            f"table {table!r} is missing or incomplete ({cause}); run the migration (alembic upgrade head) first "
            "(`sa-outbox doctor` names every missing column and index)"
        )
    return None


@contextmanager
def schema_errors(table: str) -> Iterator[None]:
    """A missing or older table (undefined table or column) inside raises :class:`SchemaError` naming
    ``table`` and the migration; any other ``ProgrammingError`` passes through. The one place the loops and
    the operator calls turn the driver's error into sa_outbox's."""
    try:
        yield
    except ProgrammingError as exc:
        missing = _schema_error(exc, table)
        if missing is not None:
            raise missing from exc
        raise


def schema_checked(fn: Callable[P, T]) -> Callable[P, T]:
    """For an operator call ``fn(bind, model, …)``: a table that is missing or behind this version of sa_outbox
    raises :class:`SchemaError` (:func:`schema_errors`) — the same error the loops raise — with a sync bind at
    the call, with an async one at the caller's ``await``. Nothing was changed: the statement failed."""

    @functools.wraps(fn)
    def checked(*args: P.args, **kwargs: P.kwargs) -> T:
        model: Any = args[1] if len(args) > 1 else kwargs.get("model")
        table = str(
            getattr(getattr(model, "__table__", None), "fullname", None) or getattr(model, "__name__", "?")
        )
        with schema_errors(table):
            result = fn(*args, **kwargs)
        if inspect.isawaitable(result):  # an async bind: the statement runs at the caller's await
            return cast(T, _awaited(result, table))
        return result

    return checked


async def _awaited(awaitable: Awaitable[T], table: str) -> T:
    with schema_errors(table):
        return await awaitable


def pool_has_room(pool: Pool) -> bool:
    """Whether a checkout from ``pool`` would not wait now: a pooled connection is free or one may be opened
    (pools without a limit always have room). A snapshot: another thread may take the room meanwhile."""
    if not isinstance(pool, QueuePool):
        return True
    max_overflow: int = getattr(pool, "_max_overflow", -1)  # not public; -1 (unlimited) when unknown
    return max_overflow < 0 or pool.checkedout() < pool.size() + max_overflow


def _in_autocommit(conn: Connection) -> bool:
    """Whether a loop's (valid) connection is still the autocommit one it set up. SQLAlchemy replaces the DBAPI
    connection of an invalidated ``Connection`` when it is next used outside a SQLAlchemy transaction, without
    the AUTOCOMMIT option: the library's own statements refuse that (``_execute._pooled``), and a step that got
    one by another way is not followed by a step on it — statements there would run in an implicit transaction
    that nothing commits (docs/design.md, the claim)."""
    return in_autocommit(conn.connection)


def with_options_of(built: T, engine: Any) -> T:
    """``built`` — an engine made beside ``engine`` (a sync twin of an async one, a direct route around a
    pooler) — with ``engine``'s execution options (a tenant's ``schema_translate_map``)."""
    options = engine.get_execution_options()
    return cast(T, cast(Any, built).execution_options(**options)) if options else built


class LoopConnection:
    """One autocommit connection used by one thread."""

    def __init__(self, engine: Engine, table: str) -> None:
        self.engine = engine
        self.table = table
        self._conn: Connection | None = None

    @contextmanager
    def use(self) -> Iterator[Connection]:
        conn = self._conn
        if conn is not None and not (conn.closed or conn.invalidated) and not _in_autocommit(conn):
            self.drop()  # (its implicit transaction rolls back with it)
            conn = None
        if conn is None or conn.closed or conn.invalidated:
            self._conn = conn = self.engine.connect()  # held at once (see AsyncLoopConnection.run)
            try:
                conn.execution_options(isolation_level="AUTOCOMMIT")
            except BaseException:
                self.drop()
                raise
            keep_cursor(conn)
        try:
            with schema_errors(self.table):
                yield conn
        except BaseException:
            self.drop()
            raise

    def run(self, fn: Callable[[Connection], T]) -> T:
        with self.use() as conn:
            return fn(conn)

    def can_run_now(self) -> bool:
        """Whether :meth:`run` would not wait for the pool: the connection is open, or the pool has room."""
        conn = self._conn
        live = conn is not None and not conn.closed and not conn.invalidated
        return live or pool_has_room(self.engine.pool)

    def result_ready(self) -> bool:
        """Whether the result of a statement sent ahead on this connection has arrived (reading it would not
        wait). False when that cannot be told — reading it then says what is wrong."""
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated:
            return False
        pgconn = getattr(getattr(conn.connection, "driver_connection", None), "pgconn", None)
        if pgconn is None:
            return False
        try:
            pgconn.consume_input()
            return not pgconn.is_busy()
        except Exception:
            return False

    def connect(self) -> None:
        """Open the connection now and check it with one round trip, so that the first step neither pays for
        the connection nor meets a pooled one the server has dropped (a failure drops it, as any step's does)."""
        with self.use() as conn:
            conn.execute(_PING)

    def drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            forget_cursor(conn)
            with contextlib.suppress(Exception):
                conn.close()


class AsyncLoopConnection:
    """The same for an asyncio loop: steps are plain functions on a sync ``Connection``, run through
    ``AsyncConnection.run_sync`` (statements still go straight to psycopg's async driver)."""

    def __init__(self, engine: AsyncEngine, table: str) -> None:
        self.engine = engine
        self.table = table
        self._conn: AsyncConnection | None = None

    async def run(self, fn: Callable[[Connection], T]) -> T:
        conn = self._conn
        sync = None if conn is None or conn.closed or conn.invalidated else conn.sync_connection
        if sync is not None and not _in_autocommit(sync):
            await self.drop()  # (its implicit transaction rolls back with it)
            conn = None
        if conn is None or conn.closed or conn.invalidated:
            # Held from the moment it is checked out: psycopg's autocommit switch awaits, and a cancellation
            # there (a run's teardown cancelling a beat that was connecting) left the connection to the
            # garbage collector — open, outside its pool, until the process ended (the model suite's "connections
            # left open"; 11 of 83 cancelled connects in a loop).
            self._conn = conn = await self.engine.connect()
            try:
                await conn.execution_options(isolation_level="AUTOCOMMIT")
            except BaseException:
                await self.drop()
                raise
            assert conn.sync_connection is not None
            keep_cursor(conn.sync_connection)
        try:
            with schema_errors(self.table):
                return await conn.run_sync(fn)
        except BaseException:
            await self.drop()
            raise

    def can_run_now(self) -> bool:
        """Whether :meth:`run` would not wait for the pool: the connection is open, or the pool has room."""
        conn = self._conn
        live = conn is not None and not conn.closed and not conn.invalidated
        return live or pool_has_room(self.engine.sync_engine.pool)

    async def drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            if conn.sync_connection is not None:
                forget_cursor(conn.sync_connection)
            # Shielded: a cancellation that arrives meanwhile (a second one, anyio's at every await) comes out
            # here, and the close still completes instead of leaving the connection open.
            closing = asyncio.ensure_future(conn.close())
            closing.add_done_callback(_ignore_result)
            with contextlib.suppress(Exception):
                await asyncio.shield(closing)


def _ignore_result(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a close that failed is not logged as "never retrieved"
