"""Wake-ups: an idle loop starts within milliseconds of a commit, or of one of its own handlers finishing.

A waker waits for whichever comes first: a NOTIFY on the table's channel (LISTEN on a dedicated connection), a
*poke* from the loop itself (a handler finished, ``stop()`` was called), or a timeout. Notifications only wake
the loop; the claim is always the SKIP LOCKED statement, and polling stays the correctness path (a
notification can be lost: a LISTEN connection that drops, a producer that does not send one). The LISTEN
connection is a direct psycopg connection, separate from the engine's pool — through PgBouncer in
transaction mode LISTEN receives nothing, so point ``listen_url`` at the server itself, or turn wake-ups off
(poll only). Each new LISTEN connection checks itself: it NOTIFYs a private channel from a second connection
and waits for it (up to ``PROBE_TIMEOUT``); a connection that does not hear it (a pooler) is closed with a
warning naming ``listen_url``, and the loop polls, trying again after ``PROBE_RETRY``.

:class:`Waker` (threads) and :class:`AsyncWaker` (asyncio) implement the same protocol: ``wait(timeout)``
returns ``"notify"``, ``"poke"`` or ``None`` (timeout; the async one's also at a lost LISTEN connection);
``poke()`` may be called from any thread;
``wait_out(timeout)`` is a wait that a notification does not end (run()'s wait after a database fault).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import psycopg
from psycopg import sql as psql
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.engine import URL, make_url

from ._backoff import LISTEN_RECONNECT

__all__ = ["AsyncWaker", "Wake", "Waker", "libpq_url"]

log = logging.getLogger("sa_outbox.wakeup")

Wake = Literal["notify", "poke"] | None

#: How long a new LISTEN connection waits for its own probe notification before it counts as deaf.
PROBE_TIMEOUT = 2.0
#: After a deaf LISTEN connection (a pooler in transaction mode), how long the loop polls before trying again.
PROBE_RETRY = 300.0
#: Longest a LISTEN connection may take to connect (unless the URL sets ``connect_timeout``): the connect runs
#: beside the loop, but an endpoint that accepts TCP but never answers (a stuck pooler, a half-open load
#: balancer) would otherwise hold the connecting thread or task — and LISTEN off — for good.
CONNECT_TIMEOUT = 3
#: Repeated LISTEN failures wait LISTEN_RECONNECT, twice that, … up to this long before the next try.
RECONNECT_CAP = 60.0


def libpq_url(url: str | URL) -> str:
    """A SQLAlchemy URL (any postgresql driver) as a libpq connection URI."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class _Listen:
    """What both wakers share: where to LISTEN, on which channels, and when to try again after a failure."""

    def __init__(self, url: str | URL | None, channels: Sequence[str]) -> None:
        self.url = libpq_url(url) if url is not None else None
        self.channels = list(channels)
        self.next_try = 0.0
        self.failures = 0
        given = conninfo_to_dict(self.url) if self.url is not None else {}
        #: what every LISTEN-side connect passes: the application name, and a connect timeout
        self.connect_kwargs: dict[str, Any] = {"autocommit": True, "application_name": "sa_outbox.listen"}
        if "connect_timeout" not in given:
            self.connect_kwargs["connect_timeout"] = CONNECT_TIMEOUT
        self.notifications = 0

    def may_connect(self) -> bool:
        return self.url is not None and time.monotonic() >= self.next_try

    def failed(self, exc: BaseException, what: str) -> None:
        self.failures += 1
        delay = min(RECONNECT_CAP, LISTEN_RECONNECT * 2 ** (self.failures - 1))
        self.next_try = time.monotonic() + delay
        log.warning(
            "%s, polling only for now (next try in %.0fs): %s", what, delay, exc,
            extra={"error": str(exc), "retry_in": delay},
        )  # fmt: skip

    def statements(self) -> list[psql.Composed]:
        return [psql.SQL("LISTEN {}").format(psql.Identifier(ch)) for ch in self.channels]

    def probe(self) -> tuple[str, psql.Composed, psql.Composed]:
        """A private channel, and the statements to LISTEN on it and to NOTIFY it (the LISTEN stays: nothing
        notifies that channel again)."""
        channel = f"sa_outbox_probe_{uuid.uuid4().hex}"
        ident = psql.Identifier(channel)
        return channel, psql.SQL("LISTEN {}").format(ident), psql.SQL("NOTIFY {}").format(ident)

    def woke(self, poked: bool, heard: bool) -> Wake:
        """What the self-signals taken at once mean: a poke (``poked``: stop, a handler done …) wins over a
        notification on our channels that a new connection heard during its probe (``heard``, counted as one);
        either ends a :meth:`Waker.wait`, only a poke a :meth:`Waker.wait_out`. They are told apart, not one
        carrying the other: a stop that came with such a notification was read as one, and a wait_out went
        on to its timeout, up to 30 s (a hostile review: 2-5 s in a sync loop's stop() at a new LISTEN
        connection's probe)."""
        if heard:
            self.notifications += 1
        return "poke" if poked else "notify"

    def deaf(self) -> None:
        """The new LISTEN connection did not hear its own probe: poll, and say why and what to do."""
        self.next_try = time.monotonic() + PROBE_RETRY
        shown = make_url(self.url or "").render_as_string(hide_password=True)
        log.warning(
            "the LISTEN connection to %s did not receive its own test notification within %.0fs: it is most "
            "likely a pooler in transaction mode (PgBouncer), where LISTEN receives nothing. Polling only; "
            "pass listen_url= the database server itself (or listen=False to silence this); trying again in "
            "%.0fs", shown, PROBE_TIMEOUT, PROBE_RETRY, extra={"listen_url": shown},
        )  # fmt: skip


#: What the connecting thread writes to the self-pipe when a LISTEN connection is ready: it ends the wait in
#: progress (which then watches the new connection) without counting as a poke.
_READY = b"c"
#: What the probe writes to the self-pipe for a notification on our channels it took off the new connection.
_HEARD = b"n"
#: What poke() writes.
_POKE = b"!"


class Waker:
    """The threaded waker: ``select()`` on the LISTEN socket and a self-pipe that :meth:`poke` writes to.

    The LISTEN connection is made (connected, probed) on a thread of its own, never in :meth:`wait`: a slow,
    flapping or silent ``listen_url`` costs the loop nothing — it polls meanwhile."""

    def __init__(self, url: str | URL | None, channels: Sequence[str]) -> None:
        self._listen = _Listen(url, channels)
        self._conn: psycopg.Connection[Any] | None = None
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._lock = threading.Lock()
        self._connecting: threading.Thread | None = None
        self._generation = 0  # bumped by close(): a connection made for an older generation is closed

    @property
    def notifications(self) -> int:
        return self._listen.notifications

    def _connect(self) -> psycopg.Connection[Any] | None:
        """The LISTEN connection when there is one; else start making it on a thread (when it is time)."""
        with self._lock:
            if self._conn is not None or self._connecting is not None or not self._listen.may_connect():
                return self._conn
            generation = self._generation
            self._connecting = threading.Thread(
                target=self._connect_in_background, args=(generation,), name="sa_outbox-listen", daemon=True
            )
            self._connecting.start()
        return None

    def _connect_in_background(self, generation: int) -> None:
        conn = None
        try:
            conn = self._make_connection()
        except Exception as exc:  # not psycopg's: logged, and tried again later like any failure
            self._listen.failed(exc, "LISTEN connection failed")
        finally:
            with self._lock:
                self._connecting = None
                if conn is not None and generation == self._generation:
                    self._conn, conn = conn, None
            if conn is not None:  # closed meanwhile: not wanted any more
                with contextlib.suppress(psycopg.Error):
                    conn.close()
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._write, _READY)

    def _make_connection(self) -> psycopg.Connection[Any] | None:
        assert self._listen.url is not None
        conn: psycopg.Connection[Any] | None = None
        try:
            conn = psycopg.connect(self._listen.url, **self._listen.connect_kwargs)
            for statement in self._listen.statements():
                conn.execute(statement)
            heard = self._probe(conn)
        except psycopg.Error as exc:
            if conn is not None:
                with contextlib.suppress(psycopg.Error):
                    conn.close()
            self._listen.failed(exc, "LISTEN connection failed")
            return None
        except BaseException:
            if conn is not None:  # e.g. interrupted during the probe: no connection left open behind
                with contextlib.suppress(psycopg.Error):
                    conn.close()
            raise
        if not heard:
            conn.close()
            self._listen.deaf()
            return None
        self._listen.failures = 0
        return conn

    def _probe(self, conn: psycopg.Connection[Any]) -> bool:
        """NOTIFY a private channel from a second connection; whether ``conn`` hears it. Notifications on the
        table's channels that arrive meanwhile are not lost: they wake the next wait (as a "notify")."""
        assert self._listen.url is not None
        channel, listen, notify = self._listen.probe()
        conn.execute(listen)
        with psycopg.connect(self._listen.url, **self._listen.connect_kwargs) as other:
            other.execute(notify)
        heard = False
        deadline = time.monotonic() + PROBE_TIMEOUT
        # batch by batch, never breaking out of one: psycopg takes a whole packet's notifications off the
        # socket at once, and those after the probe's (a commit right behind it) would go with the iterator
        while not heard and (remaining := deadline - time.monotonic()) > 0:
            for n in conn.notifies(timeout=remaining, stop_after=1):
                if n.channel == channel:
                    heard = True
                else:  # one of ours: not swallowed, it wakes the wait as a notification
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.write(self._write, _HEARD)
        return heard

    def poke(self) -> None:
        """Wake a :meth:`wait` in progress (or the next one) — safe from any thread."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._write, _POKE)

    def _drain_pokes(self) -> Wake:
        """The self-pipe emptied: what it says (:meth:`_Listen.woke`), or None (nothing, or only _READY)."""
        poked = heard = False
        with contextlib.suppress(BlockingIOError):
            while data := os.read(self._read, 512):
                poked = poked or _POKE in data
                heard = heard or _HEARD in data
        return self._listen.woke(poked, heard) if poked or heard else None

    def wait(self, timeout: float, *, listen: bool = True) -> Wake:
        """Block up to ``timeout`` seconds; say what woke the loop (``None``: the timeout). ``listen=False``
        waits for pokes only (no LISTEN connection is opened for it)."""
        deadline = time.monotonic() + timeout
        while True:
            if (woke := self._drain_pokes()) is not None:
                return woke
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            conn = self._connect() if listen else None
            fds = [self._read] if conn is None else [self._read, conn.fileno()]
            if conn is None and listen and self._listen.url is not None and self._connecting is None:
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

    def wait_out(self, timeout: float) -> Wake:
        """:meth:`wait`, except that a notification does not end it (it is taken off the connection and
        counted): only a poke or the timeout does. run()'s wait after a database fault: the claim it would
        wake for is the very step that failed, so a producer's every commit would retry it at once — behind a
        fault the producers do not share (a refused statement, a server out of connections for the loop
        alone) a review's 100 commits a second made 370 failed turns in 4 s, a WARNING each, against a
        backoff that said "retrying in 0.70s". The work they announce is claimed when the wait ends."""
        deadline = time.monotonic() + timeout
        while True:
            woke = self.wait(max(0.0, deadline - time.monotonic()))
            if woke == "poke" or time.monotonic() >= deadline:
                return woke if woke == "poke" else None

    def _close_listen(self) -> None:
        with self._lock:
            self._generation += 1
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
    """The asyncio waker: a LISTEN task on an async psycopg connection raced with a poke event. The LISTEN
    connection is made (connected, probed) by a task of its own that a wait races too, never awaited by the
    wait itself: a slow, flapping or silent ``listen_url`` costs the loop nothing — it polls meanwhile."""

    def __init__(self, url: str | URL | None, channels: Sequence[str]) -> None:
        self._listen = _Listen(url, channels)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._connecting: asyncio.Task[psycopg.AsyncConnection[Any] | None] | None = None
        self._poked = asyncio.Event()  # set with either flag below
        self._poke_flag = False  # poke() was called
        self._heard_flag = False  # the probe took a notification on our channels off a new connection
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def notifications(self) -> int:
        return self._listen.notifications

    def poke(self) -> None:
        """Wake a :meth:`wait` in progress (or the next one) — safe from any thread."""
        loop = self._loop
        if loop is None:
            self._set_poked()
            return
        if loop.is_closed():  # the next wait is another loop's (it takes the flag); this event's waiters died
            self._poke_flag = True  # with the closed one, and setting it would call that loop
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._set_poked()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._set_poked)

    def _set_poked(self) -> None:
        self._poke_flag = True
        self._poked.set()

    def _take_wake(self) -> Wake:
        """The signals behind a set ``_poked`` taken (:meth:`_Listen.woke`)."""
        self._poked.clear()
        poked, heard = self._poke_flag, self._heard_flag
        self._poke_flag = self._heard_flag = False
        return self._listen.woke(poked or not heard, heard)

    async def _connect(self) -> psycopg.AsyncConnection[Any] | None:
        if self._conn is not None or not self._listen.may_connect():
            return self._conn
        assert self._listen.url is not None
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            conn = await psycopg.AsyncConnection.connect(self._listen.url, **self._listen.connect_kwargs)
            for statement in self._listen.statements():
                await conn.execute(statement)
            heard = await self._probe(conn)
        except Exception as exc:  # psycopg's, or anything else: tried again later
            if conn is not None:
                with contextlib.suppress(psycopg.Error):
                    await conn.close()
            self._listen.failed(exc, "LISTEN connection failed")
            return None
        except BaseException:
            if conn is not None:  # e.g. cancelled during the probe: no connection left open behind
                with contextlib.suppress(psycopg.Error):
                    await conn.close()
            raise
        if not heard:
            await conn.close()
            self._listen.deaf()
            return None
        self._conn = conn
        self._listen.failures = 0
        return conn

    async def _probe(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """As :meth:`Waker._probe`."""
        assert self._listen.url is not None
        channel, listen, notify = self._listen.probe()
        await conn.execute(listen)
        other = await psycopg.AsyncConnection.connect(self._listen.url, **self._listen.connect_kwargs)
        try:
            await other.execute(notify)
        finally:
            await other.close()
        heard = False
        deadline = time.monotonic() + PROBE_TIMEOUT
        while not heard and (remaining := deadline - time.monotonic()) > 0:  # (see Waker._probe)
            async for n in conn.notifies(timeout=remaining, stop_after=1):
                if n.channel == channel:
                    heard = True
                else:  # one of ours: not swallowed, it wakes the wait as a notification
                    self._heard_flag = True
                    self._poked.set()
        return heard

    def _start_connecting(self) -> None:
        if self._conn is None and self._connecting is None and self._listen.may_connect():
            self._connecting = asyncio.ensure_future(self._connect())

    def _connected(self) -> None:
        """Take in what the connecting task made (once it is done)."""
        task, self._connecting = self._connecting, None
        if task is not None and not task.cancelled() and task.exception() is None:
            self._conn = task.result()

    async def wait(self, timeout: float) -> Wake:
        """Wait up to ``timeout`` seconds; say what woke the loop (``None``: the timeout — or, sooner, the LISTEN
        connection lost, which this wait does not make again before its end, unlike :meth:`Waker.wait`: the
        loop's next turn claims, and its next wait connects again)."""
        loop = asyncio.get_running_loop()
        if self._loop is not None and loop is not self._loop:
            self._moved_to_another_loop()
        self._loop = loop
        deadline = time.monotonic() + timeout
        while True:
            if self._poked.is_set():
                return self._take_wake()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._start_connecting()
            conn = self._conn
            poked = asyncio.ensure_future(self._poked.wait())
            waiters: set[asyncio.Future[Any]] = {poked}
            listener = None
            if conn is not None:
                listener = asyncio.ensure_future(self._one(conn, remaining))
                waiters.add(listener)
            connecting = self._connecting
            if connecting is not None:
                waiters.add(connecting)
            try:
                done, pending = await asyncio.wait(
                    waiters, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
            except BaseException:  # cancelled: leave no waiter task behind (the connecting one goes on)
                for left in (poked, listener):
                    if left is not None:
                        with contextlib.suppress(RuntimeError):  # (its loop closed under the wait)
                            left.cancel()
                raise
            losers = [task for task in pending if task is not connecting]  # (that one goes on: raced again)
            for task in losers:  # all of them first: a cancel of this task below leaves none running
                task.cancel()
            for task in losers:
                try:
                    await task
                except asyncio.CancelledError:
                    # the waiter's own end — unless this task was cancelled meanwhile: that one is not ours to
                    # swallow (a hostile review: run() went on after its cancel() in 3 of 150 tries)
                    current = asyncio.current_task()
                    if current is not None and current.cancelling():
                        raise
                except psycopg.Error:
                    pass
            if connecting is not None and connecting in done:
                self._connected()
            if poked in done:
                return self._take_wake()
            if listener is not None and listener in done:
                try:
                    if listener.result():
                        self._listen.notifications += 1
                        return "notify"
                except psycopg.Error as exc:
                    self._listen.failed(exc, "LISTEN connection lost")
                    await self.close()
            if connecting is None or connecting not in done:
                return None  # the timeout (or the LISTEN connection ended quietly)

    def _moved_to_another_loop(self) -> None:
        """The loop object runs again in another event loop (a second ``asyncio.run()``): what was bound to the
        first is made again — the poke event (bound to its loop at its first wait: in the second loop every
        wait on it failed at once and counted as a poke, a hot spin of thousands of claims a second), and the
        LISTEN connection and its connecting task, which belong to the first loop's selector (the connection's
        socket is closed here, without that loop)."""
        poked = self._poked.is_set() or self._poke_flag
        self._poked = asyncio.Event()
        if poked:
            self._poked.set()
        self._connecting = None
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.pgconn.finish()

    async def wait_out(self, timeout: float) -> Wake:
        """:meth:`wait`, except that a notification does not end it, nor a LISTEN connection lost meanwhile (which
        ends a wait early here): see :meth:`Waker.wait_out`."""
        deadline = time.monotonic() + timeout
        while True:
            woke = await self.wait(max(0.0, deadline - time.monotonic()))
            if woke == "poke" or time.monotonic() >= deadline:
                return woke if woke == "poke" else None

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
        connecting, self._connecting = self._connecting, None
        if connecting is not None:
            connecting.cancel()  # (it closes what it had opened)
            with contextlib.suppress(BaseException):
                await connecting
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.close()
