"""Executing the library's own Core statements: compiled once, sent straight to psycopg when nobody watches.

Used by the claim/lease/finalize engine and by the producer's one-statement insert. No imports from the rest
of the package but the leaf module ``errors`` (the producer is imported by ``schema``, which the engine's
``sql`` module imports).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import abc, generators
from psycopg import sql as pgsql
from psycopg.adapt import PyFormat, Transformer
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.util import await_only

from .errors import ConfigurationError

__all__ = ["compile_ahead", "control", "forget_cursor", "in_block", "keep_cursor", "run", "transaction"]

_TUPLES_OK = psycopg.pq.ExecStatus.TUPLES_OK
_FATAL_ERROR = psycopg.pq.ExecStatus.FATAL_ERROR
_BINARY = psycopg.pq.Format.BINARY
_IDLE = psycopg.pq.TransactionStatus.IDLE
_SQLSTATE = psycopg.pq.DiagnosticField.SQLSTATE

#: invalid_sql_statement_name (``prepared statement "_pg3_3" does not exist``) and duplicate_prepared_statement
#: (``… already exists``): on a connection that prepares, a pooler moved it to another server connection.
_LOST_PREPARED = frozenset(("26000", "42P05"))


@dataclass(frozen=True, slots=True)
class _Compiled:
    sql: str
    static: dict[str, Any]  # values of the statement's own internal parameters that could not be written in
    arrays: frozenset[str]  # parameters the SQL casts to an array type: sent as one array literal
    numbered: bytes | None  # the SQL with $1, $2 … for the direct path (None: it takes psycopg's cursor)
    order: tuple[str, ...]  # the parameter behind each $n
    formats: tuple[PyFormat, ...]


#: The library's statements compiled, by (statement, dialect): a fixed set, kept for the process's life.
_COMPILED: dict[tuple[int, str], _Compiled] = {}

#: The same under a ``schema_translate_map``, by (statement, dialect, map): a tenant's statements — as many
#: as there are tenants, so the least recently used beyond ``TRANSLATED_MAX`` are dropped (compiled again if
#: their tenant comes back). Guarded by ``_TRANSLATED_LOCK`` (loops in threads share it).
_TRANSLATED: OrderedDict[tuple[int, str, frozenset[tuple[Any, Any]]], _Compiled] = OrderedDict()
_TRANSLATED_LOCK = threading.Lock()
TRANSLATED_MAX = 1000

#: A placeholder with an explicit array cast, as SQLAlchemy's psycopg dialect renders an ARRAY bind parameter.
_ARRAY_PLACEHOLDER = re.compile(r"%\((\w+)\)s::[A-Z][A-Z ]*(?:\(\d+(?:, ?\d+)?\))?\[\]")


def _compiled(stmt: Any, conn: Connection) -> _Compiled:
    """``stmt`` compiled for ``conn`` — once per statement and dialect, and per ``schema_translate_map`` (a
    tenant's schema, written into the SQL: each tenant's statement is a statement of its own, prepared under a
    name of its own; the least recently used tenants' beyond ``TRANSLATED_MAX`` are compiled again)."""
    translate = conn.get_execution_options().get("schema_translate_map")
    if translate:
        key = (id(stmt), conn.dialect.name, frozenset(translate.items()))
        with _TRANSLATED_LOCK:
            found = _TRANSLATED.get(key)
            if found is not None:
                _TRANSLATED.move_to_end(key)
                return found
        found = _with_schemas(stmt, conn, translate)
        with _TRANSLATED_LOCK:
            _TRANSLATED[key] = found
            while len(_TRANSLATED) > TRANSLATED_MAX:
                _TRANSLATED.popitem(last=False)
        return found
    plain = (id(stmt), conn.dialect.name)
    found = _COMPILED.get(plain)
    if found is None:
        found = _COMPILED[plain] = _compile(stmt.compile(dialect=conn.dialect))
    return found


#: Statements compiled once per (statement, dialect, the translate map's keys) with SQLAlchemy's schema tokens
#: in their text: each tenant's map is then written in by replacing the tokens (~20 µs) rather than compiling
#: the statement again (0.5–3 ms each), as SQLAlchemy's own execution does.
_TOKENED: dict[tuple[int, str, frozenset[Any]], Any] = {}


def _with_schemas(stmt: Any, conn: Connection, translate: dict[Any, Any]) -> _Compiled:
    """``stmt`` with ``translate``'s schemas written in (see ``_TOKENED``)."""
    key = (id(stmt), conn.dialect.name, frozenset(translate))
    tokened = _TOKENED.get(key)
    if tokened is None:
        tokened = _TOKENED[key] = stmt.compile(dialect=conn.dialect, schema_translate_map=translate)
    # (SQLAlchemy's own step at execution, in every version pyproject allows; it adds a key to the map it gets)
    return _compile(tokened, tokened.preparer._render_schema_translates(str(tokened), dict(translate)))


def _compile(c: Any, sql: str | None = None) -> _Compiled:
    """A compiled statement as the library sends it (``sql``: its text, when not ``str(c)``): its constants
    written in, its placeholders numbered."""
    sql, static = str(c) if sql is None else sql, {}
    for name, value in c.construct_params(_check=False).items():
        bind = c.binds.get(name)
        # a parameter the caller supplies (required: no value of its own) stays a placeholder
        literal = None if bind is None or bind.required else _sql_literal(value)
        if literal is None:
            static[name] = value
        else:  # a constant of the statement: written in, so it is not dumped again on every call
            sql = sql.replace(f"%({name})s", literal.replace("%", "%%"))
    numbered, order = _numbered(sql)
    return _Compiled(
        sql,
        static,
        frozenset(_ARRAY_PLACEHOLDER.findall(sql)),
        numbered,
        order,
        (PyFormat.AUTO,) * len(order),
    )


_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%|%")


def _numbered(sql: str) -> tuple[bytes | None, tuple[str, ...]]:
    """``sql`` with its ``%(name)s`` placeholders as ``$1``, ``$2`` … (a name used twice keeps its number) and
    ``%%`` as ``%``, and the parameter behind each number; (None, ()) if it holds any other ``%`` form."""
    order: list[str] = []
    odd = False

    def number(m: re.Match[str]) -> str:
        nonlocal odd
        name = m.group(1)
        if name is None:
            odd = odd or m.group(0) == "%"
            return "%"
        if name not in order:
            order.append(name)
        return f"${order.index(name) + 1}"

    text = _PLACEHOLDER.sub(number, sql)
    # (ASCII: the same bytes in every client encoding)
    return (None, ()) if odd or not text.isascii() else (text.encode(), tuple(order))


def _sql_literal(value: Any) -> str | None:
    """A statement's constant as SQL text, for the values that need no quoting rules of the server (NULL,
    booleans, finite numbers, strings without quote or backslash); None for anything else."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int | float) and math.isfinite(value):
        return f"({value!r})"
    if isinstance(value, str) and "'" not in value and "\\" not in value and "\x00" not in value:
        return f"'{value}'"
    return None


def _array_literal(values: Any) -> str | None:
    """A list of ints, finite floats, strings and None as one PostgreSQL array literal (the statement casts it
    to its array type); None when an element is of another kind (psycopg then dumps the list itself).

    Sent as one text value, a list costs a join instead of psycopg's per-call element-type search and per-element
    dump (with the constants written in at compile time: ~70–100 µs less client CPU per claim + finalize statement
    at batch 1, a third of what it cost)."""
    if type(values) is not list:
        return None
    parts = []
    for v in values:
        kind = type(v)
        if kind is int:
            parts.append(str(v))
        elif v is None:
            parts.append("NULL")
        elif kind is str:
            if "\x00" in v:
                return None  # psycopg refuses it with its own clear error
            parts.append('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"')
        elif kind is float and math.isfinite(v):
            parts.append(repr(v))
        else:
            return None
    return "{" + ",".join(parts) + "}"


def compile_ahead(conn: Connection, *stmts: Any) -> None:
    """Compile statements now (once per process) rather than at their first run: before a transaction whose
    locks and ``now()`` should not include a first compile (~0.1 s for a claim statement on a slow box)."""
    for stmt in stmts:
        _compiled(stmt, conn)


def _observed(conn: Connection) -> bool:
    if not (conn._has_events or conn.engine._has_events or conn.dialect._has_events):
        # SQLAlchemy sets these flags when a connection/engine/dialect listener is added: none, no one watches
        # (one attribute each, rather than ~3 µs of dispatch lookups per statement)
        return bool(conn._echo)
    d = conn.dispatch
    return bool(
        conn._echo
        or d.before_execute
        or d.after_execute
        or d.before_cursor_execute
        or d.after_cursor_execute
        or conn.dialect.dispatch.handle_error
    )


def in_autocommit(pooled: Any) -> bool:
    """Whether a pooled connection's driver is in autocommit (drivers without the notion count as in it): the
    one test of a loop's connection still being the one it set up (:func:`_pooled`, ``_db``'s steps)."""
    return bool(getattr(pooled.driver_connection, "autocommit", True))


def _pooled(conn: Connection, sql: str | None = None) -> Any:
    """``conn.connection`` — but never a connection made again behind the loop's back. Read on a ``Connection``
    that a lost connection invalidated (outside a SQLAlchemy transaction, where the loops' statements run),
    SQLAlchemy quietly takes a fresh connection from the pool, without the AUTOCOMMIT the loop set on the old
    one: every statement after it then ran in psycopg's implicit transaction, which nothing commits. A limited
    queue's claim lost its connection inside its block, the block's ROLLBACK connected again, and the loop's
    later claims and finalizes were rolled back at the next fault — after their jobs had run: the same lease
    version handed out twice (found by the model-based suite; workers of a limited queue, sync or async, under
    backend terminations took 2-10 claims twice in 40 s). On such a connection this raises the loss instead (a
    connection fault: the loop drops it and connects again, in autocommit) — and on one that SQLAlchemy has
    already connected again by its own path (a statement through ``conn.execute`` after a lost connection in
    the same step: no longer invalidated, no longer in autocommit; a hostile review's script)."""
    if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
        return conn.connection  # (not a loop's connection: SQLAlchemy's rules, the caller's transaction)
    pooled = None if conn.invalidated else conn.connection
    if pooled is None or not in_autocommit(pooled):
        lost = psycopg.OperationalError("the connection was lost; a loop's connection is not made again here")
        raise OperationalError(sql, None, lost, connection_invalidated=True)
    return pooled


def run(conn: Connection, stmt: Any, params: dict[str, Any], *, prepare: bool = True) -> list[Any]:
    """Execute one of the library's statements and return its rows (tuples in RETURNING order).

    The statements are SQLAlchemy Core, built once per table (``_sql.py``, the producer's insert). On a
    psycopg 3 connection their compiled text is sent straight to the driver as a server-side prepared
    statement (unless the connection has ``prepare_threshold=None``): no per-call compile cache lookup,
    result processing or Row objects in the claim/finalize/produce hot paths. On a loop's own sync
    connection (:func:`keep_cursor`, autocommit) they go one level lower, below psycopg's cursor: prepared
    once per session under names unique to the process (:class:`_Direct`). Errors come out as
    SQLAlchemy's ``DBAPIError`` subclasses either way — except a prepared statement lost to a pooler in
    transaction mode (missing, taken, or another client's): a :class:`ConfigurationError` that says what to
    set, since no retry fixes it.
    The same holds for psycopg's async connection, reached through ``AsyncConnection.run_sync`` (the async
    loops) or an ``AsyncSession`` flush. Other drivers and a connection someone observes (``echo``, or
    listeners for ``before_execute``/``before_cursor_execute``/``after_*``/``handle_error``: SQL logging,
    tracing) take SQLAlchemy's regular execution path, so they see every statement. A connection with a
    ``schema_translate_map`` (a tenant's schema) takes the library's path with the map written into the
    statement's text (:func:`_compiled`).
    ``prepare=False``: not server-side prepared — planned at each call, for these parameters' values (unless
    ``plan_cache_mode`` forces a generic plan even then).
    """
    pooled = _pooled(conn)
    driver = getattr(pooled, "driver_connection", None)
    if isinstance(driver, psycopg.Connection | psycopg.AsyncConnection) and _ours(conn):
        compiled, full = _bound(stmt, conn, params)
        # Server-side prepared at once — unless prepared statements are switched off on the connection
        # (``connect_args={"prepare_threshold": None}``, e.g. behind PgBouncer in transaction mode). Results in
        # binary format: ~20 µs less client CPU per claim than parsing text (the statements return only
        # built-in types).
        prepared: bool | None = None if driver.prepare_threshold is None else prepare
        try:
            if prepared and (found := _direct(pooled, driver, compiled)) is not None:
                direct, tx = found
                return direct.run(tx, compiled, full)
            cur = pooled.info.get(_CURSOR)  # a loop's connection keeps one (keep_cursor)
            if cur is None:
                cur = driver.cursor()
            elif cur.connection is not driver or cur.closed:  # the kept one outlived its driver connection
                cur = pooled.info[_CURSOR] = driver.cursor()
            if isinstance(cur, psycopg.AsyncCursor):
                # Called through AsyncConnection.run_sync: SQLAlchemy's greenlet bridge awaits the driver.
                await_only(cur.execute(compiled.sql, full, prepare=prepared, binary=True))
                result = cur.pgresult
                if result is not None and result.status == _TUPLES_OK:
                    return await_only(cur.fetchall())
                return []
            cur.execute(compiled.sql, full, prepare=prepared, binary=True)
            # (``pgresult.status`` rather than ``description``, which builds column objects on every access)
            result = cur.pgresult
            return cur.fetchall() if result is not None and result.status == _TUPLES_OK else []
        except psycopg.Error as exc:
            error = _translated(conn, driver, exc, compiled, full, prepared=bool(prepared))
            raise error from error.__cause__
    regular = conn.execute(stmt, params)
    return [tuple(r) for r in regular] if regular.returns_rows else []


def send(conn: Connection, stmt: Any, params: dict[str, Any]) -> Callable[[], list[Any]] | None:
    """Send one of the library's statements now and read its rows later: the returned call waits for them
    (the rows :func:`run` would return, the same errors), and nothing else may use ``conn`` until it has been
    called. None when the statement cannot go this way — only a loop's own sync connection on the direct path
    (:class:`_Direct`) can — and nothing was sent: the caller then runs it with :func:`run`."""
    pooled = _pooled(conn)
    driver = getattr(pooled, "driver_connection", None)
    if not isinstance(driver, psycopg.Connection) or driver.prepare_threshold is None or not _ours(conn):
        return None
    compiled, full = _bound(stmt, conn, params)
    found = _direct(pooled, driver, compiled)
    if found is None:
        return None
    direct, tx = found
    try:
        sent = direct.send(tx, compiled, full)
    except psycopg.Error as exc:
        error = _translated(conn, driver, exc, compiled, full, prepared=True)
        raise error from error.__cause__

    def receive() -> list[Any]:
        try:
            return direct.receive(tx, compiled, full, sent)
        except psycopg.Error as exc:
            error = _translated(conn, driver, exc, compiled, full, prepared=True)
            raise error from error.__cause__

    return receive


def _ours(conn: Connection) -> bool:
    """Whether the library's own execution applies to ``conn``: nobody observes it."""
    return not _observed(conn)


def _bound(stmt: Any, conn: Connection, params: dict[str, Any]) -> tuple[_Compiled, dict[str, Any]]:
    """The compiled statement and every parameter value it is sent with (arrays as one literal each)."""
    compiled = _compiled(stmt, conn)
    full = {**compiled.static, **params}
    for name in compiled.arrays:
        literal = _array_literal(full.get(name))
        if literal is not None:
            full[name] = literal
    return compiled, full


def _direct(
    pooled: Any, driver: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], compiled: _Compiled
) -> tuple[_Direct, abc.Transformer] | None:
    """The direct path of a loop's connection, when it may take ``compiled`` now: the loop holds the connection
    (:func:`keep_cursor`), and it is in autocommit, idle, outside a pipeline. psycopg sends DEALLOCATE ALL when
    it rolls back while it holds prepared statements of its own, and a statement found missing inside a
    transaction block cannot be prepared again and retried: the cursor takes those."""
    if compiled.numbered is None:
        return None
    direct: _Direct | None = pooled.info.get(_DIRECT)
    if (
        direct is not None
        and direct.driver is driver
        and (tx := direct.tx) is not None
        and driver.autocommit
        and driver.pgconn.transaction_status == _IDLE
        and not driver.pgconn.pipeline_status
    ):
        return direct, tx
    return None


def _translated(
    conn: Connection, driver: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], exc: psycopg.Error,
    compiled: _Compiled, full: dict[str, Any], *, prepared: bool,
) -> Exception:  # fmt: skip
    """psycopg's error in the library's vocabulary: a prepared statement lost to a pooler is a
    :class:`ConfigurationError` saying what to set (no retry fixes it); anything else SQLAlchemy's
    ``DBAPIError``, the connection invalidated when it is gone. Its ``__cause__`` is what to raise it from."""
    if prepared and _prepared_statement_mixup(exc):
        conn.invalidate(exc)  # its cache of prepared names no longer matches any server connection
        error = ConfigurationError(
            f"{exc.diag.message_primary or exc}: this connection's prepared statements are not where it "
            "left them — a pooler in transaction mode (PgBouncer before 1.21, or without "
            "max_prepared_statements) sends each transaction to another server connection. Build the "
            "engine with sa_outbox.pgbouncer_engine() (or connect_args={'prepare_threshold': None})"
        )
        error.__cause__ = DBAPIError.instance(compiled.sql, full, exc, psycopg.Error, dialect=conn.dialect)
        return error
    wrapped = _wrapped(conn, driver, exc, compiled.sql, full)
    wrapped.__cause__ = exc
    return wrapped


_CURSOR = "sa_outbox.cursor"
_DIRECT = "sa_outbox.direct"

#: Names of the direct path's prepared statements: a random token per process (drawn again in a forked child)
#: and a counter, so that a pooler handing this session's server connection to another client — another
#: process, container or host, whatever its pid — never shows it a name of ours, nor us one of theirs.
_NAMES = itertools.count(1)
_NAME_PREFIX = ""

#: The most statements the direct path keeps prepared on one session (psycopg's own ``prepared_max``
#: default): a loop's own statements are far fewer; tenants' beyond it take turns.
PREPARED_MAX = 100


def _new_prefix() -> None:
    global _NAMES, _NAME_PREFIX
    _NAMES = itertools.count(1)
    _NAME_PREFIX = f"_sao_{secrets.token_hex(8)}_"


_new_prefix()
os.register_at_fork(after_in_child=_new_prefix)


def _missing(result: psycopg.pq.abc.PGresult, name: bytes) -> bool:
    """The server's "prepared statement "<name>" does not exist" at Bind, for this very name — SQLSTATE 26000
    alone could also come from a function or trigger the statement ran. Told by the server function that
    raised it (not translated, unlike the message) or by the name in the message."""
    if result.error_field(_SQLSTATE) != b"26000":
        return False
    if result.error_field(psycopg.pq.DiagnosticField.SOURCE_FUNCTION) == b"FetchPreparedStatement":
        return True
    message = result.error_field(psycopg.pq.DiagnosticField.MESSAGE_PRIMARY) or b""
    return b'"' + name + b'"' in message


def _stale_plan(result: psycopg.pq.abc.PGresult) -> bool:
    """The server's "cached plan must not change result type" (raised before the statement runs)."""
    return (
        result.error_field(_SQLSTATE) == b"0A000"
        and result.error_field(psycopg.pq.DiagnosticField.SOURCE_FUNCTION) == b"RevalidateCachedQuery"
    )


@dataclass(frozen=True, slots=True)
class _Sent:
    """A statement :meth:`_Direct.send` sent: what sending it again takes."""

    key: tuple[bytes, tuple[int, ...]]
    name: bytes
    params: Any
    formats: Any


class _Direct:
    """A loop connection's statements sent below psycopg's cursor: the library's statements are prepared once
    per connection under names of their own (psycopg's cursor spends ~20–30 µs of client CPU per statement
    on its query cache, its own prepared-statement bookkeeping and result handling), their parameters dumped
    and their rows loaded by psycopg's own ``Transformer`` — the same adapters, types and binary results as
    the cursor path. Only on a sync psycopg connection of a loop (:func:`keep_cursor`), in autocommit mode
    and outside a transaction block and a pipeline."""

    __slots__ = ("driver", "names", "tx")

    def __init__(self, driver: psycopg.Connection[Any]) -> None:
        self.driver = driver
        # The names live as long as the server session; the Transformer only while a loop holds the connection
        # (:func:`keep_cursor` makes a fresh one: the client encoding and the adapters as they are now, and no
        # rows of a loop's last claim kept for whoever takes the connection from the pool next).
        self.tx: abc.Transformer | None = None
        self.names: dict[tuple[bytes, tuple[int, ...]], bytes] = {}

    def run(self, tx: abc.Transformer, compiled: _Compiled, full: dict[str, Any]) -> list[Any]:
        return self.receive(tx, compiled, full, self.send(tx, compiled, full))

    def send(self, tx: abc.Transformer, compiled: _Compiled, full: dict[str, Any]) -> _Sent:
        """Send the statement (prepared first if this session has not seen it) without waiting for its result:
        :meth:`receive` reads it. Nothing else may use the connection in between."""
        assert compiled.numbered is not None
        driver = self.driver
        pgconn = driver.pgconn
        try:
            values = [full[name] for name in compiled.order]
        except KeyError as exc:  # as psycopg's cursor says it
            raise psycopg.ProgrammingError(f"query parameter missing: {exc.args[0]}") from None
        params = tx.dump_sequence(values, compiled.formats)
        key = (compiled.numbered, tx.types or ())
        with driver.lock:
            name = self.names.pop(key, None)
            if name is None:
                name = self._prepare(key)
            else:
                self.names[key] = name  # (the most recently used last: the first is the one deallocated)
            pgconn.send_query_prepared(name, params, param_formats=tx.formats, result_format=_BINARY)
            driver.wait(generators.send(pgconn))
        return _Sent(key, name, params, tx.formats)

    def receive(
        self, tx: abc.Transformer, compiled: _Compiled, full: dict[str, Any], sent: _Sent
    ) -> list[Any]:
        """The rows of a statement :meth:`send` sent. A statement found missing or with a stale plan (refused
        before it ran) is prepared and sent again, once."""
        driver = self.driver
        pgconn = driver.pgconn
        for attempt in (1, 2):
            with driver.lock:
                if attempt == 2:
                    name = self._prepare(sent.key)
                    pgconn.send_query_prepared(
                        name, sent.params, param_formats=sent.formats, result_format=_BINARY
                    )
                    driver.wait(generators.send(pgconn))
                result = driver.wait(generators.fetch_many(pgconn))[-1]
            if result.status == _TUPLES_OK:
                tx.set_pgresult(result)
                rows: list[Any] = tx.load_rows(0, result.ntuples, tuple)
                return rows
            if result.status != _FATAL_ERROR:
                return []
            if attempt == 1 and _stale_plan(result):
                # A migration changed the type of a column the statement returns, since it was prepared:
                # refused before it ran. Deallocated and prepared again, once.
                del self.names[sent.key]
                driver.execute(
                    pgsql.SQL("DEALLOCATE {}").format(pgsql.Identifier(sent.name.decode())), prepare=False
                )
                continue
            if attempt == 1 and _missing(result, sent.name):
                # Not prepared on this session, and nothing ran: DEALLOCATE ALL sent by psycopg (a rollback, a
                # DROP or ALTER while it held prepared statements of its own), or DISCARD ALL by whoever had
                # the connection from the pool meanwhile. Prepared again, once; a second miss is a pooler
                # moving the connection (the caller says so).
                del self.names[sent.key]
                continue
            break
        raise psycopg.errors.error_from_result(result, encoding=driver.info.encoding)

    def _prepare(self, key: tuple[bytes, tuple[int, ...]]) -> bytes:
        """Prepare ``key``'s statement under a new name — first deallocating the least recently used while the
        session holds ``PREPARED_MAX`` of ours (each costs the server its plan's memory: a process serving
        hundreds of tenants through one pool would hold every tenant's statements on every connection)."""
        pgconn = self.driver.pgconn
        while len(self.names) >= PREPARED_MAX:
            old = self.names.pop(next(iter(self.names)))
            pgconn.send_query(b"DEALLOCATE " + old)
            for r in self.driver.wait(generators.execute(pgconn)):
                if r.status == _FATAL_ERROR and r.error_field(_SQLSTATE) != b"26000":  # (gone already: fine)
                    raise psycopg.errors.error_from_result(r, encoding=self.driver.info.encoding)
        name = f"{_NAME_PREFIX}{next(_NAMES)}".encode()
        pgconn.send_prepare(name, key[0], param_types=key[1])
        for r in self.driver.wait(generators.execute(pgconn)):
            if r.status == _FATAL_ERROR:
                raise psycopg.errors.error_from_result(r, encoding=self.driver.info.encoding)
        self.names[key] = name
        return name


def keep_cursor(conn: Connection) -> None:
    """Let the library's statements on ``conn`` — a loop's own connection — reuse one cursor, kept in the pooled
    connection's ``info`` until :func:`forget_cursor`: ``driver.execute`` makes a cursor (and its adapters map)
    per call, ~15–20 µs of client CPU per statement. The kept cursor holds the last statement's parameters and
    rows (a claim's batch), so it is for the loops' connections only, never for a connection the pool hands to
    application code afterwards."""
    driver = getattr(conn.connection, "driver_connection", None)
    if isinstance(driver, psycopg.Connection | psycopg.AsyncConnection):
        info = conn.connection.info
        info[_CURSOR] = driver.cursor()
        if isinstance(driver, psycopg.Connection):
            direct = info.get(_DIRECT)
            if direct is None or direct.driver is not driver:  # its names live as long as the connection
                direct = info[_DIRECT] = _Direct(driver)
            direct.tx = Transformer(driver)


def forget_cursor(conn: Connection) -> None:
    """Drop the cursor :func:`keep_cursor` kept (before the connection goes back to the pool). An invalidated
    connection's ``info`` is cleared by the pool when it connects again."""
    if conn.closed or conn.invalidated:
        return  # (``conn.connection`` would connect again)
    with contextlib.suppress(Exception):
        info = conn.connection.info
        info.pop(_CURSOR, None)
        direct = info.get(_DIRECT)
        if direct is not None:
            direct.tx = None  # the connection is application code's again: the cursor path only


def _wrapped(
    conn: Connection, driver: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], exc: psycopg.Error,
    sql: str, params: Any,
) -> Exception:  # fmt: skip
    """Same error vocabulary as SQLAlchemy's own path: the driver's error as a ``DBAPIError``; a connection
    that is gone is invalidated, so the pool never hands it out again."""
    lost = driver.closed or isinstance(exc, psycopg.OperationalError)
    if lost:
        conn.invalidate(exc)
    return DBAPIError.instance(
        sql, params, exc, psycopg.Error, connection_invalidated=lost, dialect=conn.dialect
    )


def control(conn: Connection, sql: str) -> None:
    """Send one transaction-control command (``BEGIN``, ``COMMIT``, ``ROLLBACK``) on one of the loops'
    autocommit connections, unprepared: a block that spans several steps — :func:`transaction`, or the
    heartbeat's lease guard, whose statements an async loop sends from separate ``run_sync`` calls."""
    driver = getattr(_pooled(conn, sql), "driver_connection", None)
    try:
        if isinstance(driver, psycopg.AsyncConnection) and not _observed(conn):
            await_only(driver.execute(sql, prepare=False))
        elif isinstance(driver, psycopg.Connection) and not _observed(conn):
            driver.execute(sql, prepare=False)
        else:
            conn.exec_driver_sql(sql)
    except psycopg.Error as exc:  # (the regular path raises DBAPIError already)
        assert driver is not None
        raise _wrapped(conn, driver, exc, sql, None) from exc


def in_block(conn: Connection) -> bool:
    """Whether one of the loops' autocommit connections is inside a block :func:`control` began."""
    driver = getattr(_pooled(conn), "driver_connection", None)
    if isinstance(driver, psycopg.Connection | psycopg.AsyncConnection):
        return driver.pgconn.transaction_status != _IDLE
    return False


@contextmanager
def transaction(conn: Connection) -> Iterator[None]:
    """An explicit transaction block on one of the loops' autocommit connections (``BEGIN`` … ``COMMIT``, or
    ``ROLLBACK`` on error): for the few steps that need it — the claim of a limited queue (two statements under
    the same locks), and the rescue (its ``BEGIN`` timed first: ``LoopBase._rescue_on``). Every other step is one
    autocommit statement."""
    control(conn, "BEGIN")
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # the connection may be gone: its owner drops it
            control(conn, "ROLLBACK")
        raise
    control(conn, "COMMIT")


def _prepared_statement_mixup(exc: psycopg.Error) -> bool:
    """A prepared statement of this connection missing, taken, or someone else's (a pooler in transaction
    mode): no retry fixes that, and a statement sent under another client's name may run that client's SQL."""
    if exc.sqlstate in _LOST_PREPARED:
        return True
    # protocol_violation: "bind message supplies 4 parameters, but prepared statement "_pg3_3" requires 12"
    return exc.sqlstate == "08P01" and "prepared statement" in str(exc)
