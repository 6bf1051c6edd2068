"""Wake-ups: an idle loop starts within milliseconds of a commit, or of one of its own handlers finishing.

A waker waits for whichever comes first: a NOTIFY on the table's channel (LISTEN on a dedicated connection), a
*poke* from the loop itself (a handler finished, ``stop()`` was called), or a timeout. Notifications only wake
the loop; the claim is always the SKIP LOCKED statement, and polling stays the correctness path (a
notification can be lost: a LISTEN connection that drops, a producer that does not send one). The LISTEN
connection is a direct psycopg connection, separate from the engine's pool — through PgBouncer in
transaction mode LISTEN receives nothing, so point ``listen_url`` at the server itself, or turn wake-ups off
(poll only).

:class:`Waker` (threads) and :class:`AsyncWaker` (asyncio) implement the same protocol: ``wait(timeout)``
returns ``"notify"``, ``"poke"`` or ``None`` (timeout); ``poke()`` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import time
from collections.abc import Sequence
from typing import Any, Literal

import psycopg
from psycopg import sql as psql
from sqlalchemy.engine import URL, make_url

from ._backoff import LISTEN_RECONNECT

__all__ = ["AsyncWaker", "Wake", "Waker", "libpq_url"]

log = logging.getLogger("sa_outbox.wakeup")

Wake = Literal["notify", "poke"] | None


def libpq_url(url: str | URL) -> str:
    """A SQLAlchemy URL (any postgresql driver) as a libpq connection URI."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class _Listen:
    """What both wakers share: where to LISTEN, on which channels, and when to try again after a failure."""

    def __init__(self, url: str | URL | None, channels: Sequence[str]) -> None:
        self.url = libpq_url(url) if url is not None else None
        self.channels = list(channels)
        self.next_try = 0.0
        self.notifications = 0

    def may_connect(self) -> bool:
        return self.url is not None and time.monotonic() >= self.next_try

    def failed(self, exc: BaseException, what: str) -> None:
        self.next_try = time.monotonic() + LISTEN_RECONNECT
        log.warning("%s, polling only for now: %s", what, exc, extra={"error": str(exc)})

    def statements(self) -> list[psql.Composed]:
        return [psql.SQL("LISTEN {}").format(psql.Identifier(ch)) for ch in self.channels]


class Waker:
    """The threaded waker: ``select()`` on the LISTEN socket and a self-pipe that :meth:`poke` writes to."""

    def __init__(self, url: str | URL | None, channels: Sequence[str]) -> None:
        self._listen = _Listen(url, channels)
        self._conn: psycopg.Connection[Any] | None = None
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    @property
    def notifications(self) -> int:
        return self._listen.notifications

    def _connect(self) -> psycopg.Connection[Any] | None:
        if self._conn is not None or not self._listen.may_connect():
            return self._conn
        assert self._listen.url is not None
        try:
            conn = psycopg.connect(self._listen.url, autocommit=True, application_name="sa_outbox.listen")
            for statement in self._listen.statements():
                conn.execute(statement)
        except psycopg.Error as exc:
            self._listen.failed(exc, "LISTEN connection failed")
            return None
        self._conn = conn
        return conn

    def poke(self) -> None:
        """Wake a :meth:`wait` in progress (or the next one) — safe from any thread."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._write, b"!")

    def _drain_pokes(self) -> bool:
        poked = False
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 512):
                poked = True
        return poked

    def wait(self, timeout: float, *, listen: bool = True) -> Wake:
        """Block up to ``timeout`` seconds; say what woke the loop (``None``: the timeout). ``listen=False``
        waits for pokes only (no LISTEN connection is opened for it)."""
        deadline = time.monotonic() + timeout
        while True:
            if self._drain_pokes():
                return "poke"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            conn = self._connect() if listen else None
            fds = [self._read] if conn is None else [self._read, conn.fileno()]
            if conn is None and listen and self._listen.url is not None:
                remaining = min(remaining, max(0.0, self._listen.next_try - time.monotonic()) or remaining)
            try:
                ready, _, _ = select.select(fds, [], [], remaining)
                if conn is not None and conn.fileno() in ready:
                    got = sum(1 for _ in conn.notifies(timeout=0))
                    if got:
                        self._listen.notifications += 1
                        return "notify"
            except (psycopg.Error, OSError, ValueError) as exc:
                self._listen.failed(exc, "LISTEN connection lost")
                self._close_listen()

    def _close_listen(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def close(self) -> None:
        """Close the LISTEN connection (a later wait reconnects); the poke pipe stays usable."""
        self._close_listen()

    def __del__(self) -> None:
        for fd in (getattr(self, "_read", None), getattr(self, "_write", None)):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


class AsyncWaker:
    """The asyncio waker: a LISTEN task on an async psycopg connection raced with a poke event."""

    def __init__(self, url: str | URL | None, channels: Sequence[str]) -> None:
        self._listen = _Listen(url, channels)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._poked = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def notifications(self) -> int:
        return self._listen.notifications

    def poke(self) -> None:
        """Wake a :meth:`wait` in progress (or the next one) — safe from any thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self._poked.set()
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._poked.set()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._poked.set)

    async def _connect(self) -> psycopg.AsyncConnection[Any] | None:
        if self._conn is not None or not self._listen.may_connect():
            return self._conn
        assert self._listen.url is not None
        try:
            conn = await psycopg.AsyncConnection.connect(
                self._listen.url, autocommit=True, application_name="sa_outbox.listen"
            )
            for statement in self._listen.statements():
                await conn.execute(statement)
        except psycopg.Error as exc:
            self._listen.failed(exc, "LISTEN connection failed")
            return None
        self._conn = conn
        return conn

    async def wait(self, timeout: float) -> Wake:
        """Wait up to ``timeout`` seconds; say what woke the loop (``None``: the timeout)."""
        self._loop = asyncio.get_running_loop()
        if self._poked.is_set():
            self._poked.clear()
            return "poke"
        conn = await self._connect()
        poked = asyncio.ensure_future(self._poked.wait())
        waiters: set[asyncio.Future[Any]] = {poked}
        listener = None
        if conn is not None:
            listener = asyncio.ensure_future(self._one(conn, timeout))
            waiters.add(listener)
        done, pending = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, psycopg.Error):
                await task
        if poked in done:
            self._poked.clear()
            return "poke"
        if listener is not None and listener in done:
            try:
                if listener.result():
                    self._listen.notifications += 1
                    return "notify"
            except psycopg.Error as exc:
                self._listen.failed(exc, "LISTEN connection lost")
                await self.close()
        return None

    @staticmethod
    async def _one(conn: psycopg.AsyncConnection[Any], timeout: float) -> bool:
        got = False
        async for _ in conn.notifies(timeout=timeout, stop_after=1):
            got = True
        if got:
            async for _ in conn.notifies(timeout=0):  # coalesce what else is queued
                pass
        return got

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.close()
