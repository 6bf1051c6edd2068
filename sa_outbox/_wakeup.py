"""Wake-ups: LISTEN on a dedicated connection so an idle loop starts within milliseconds of a commit.

Notifications only wake the loop; the claim is always the SKIP LOCKED statement, and polling stays the
correctness path (a notification can be lost: a LISTEN connection that drops, a producer that does not send
one). The LISTEN connection is a direct psycopg connection, separate from the engine's pool — through
PgBouncer in transaction mode LISTEN receives nothing, so point ``listen_url`` at the server itself, or turn
wake-ups off (poll only).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql as psql
from sqlalchemy.engine import URL, make_url

__all__ = ["Waker", "libpq_url"]

log = logging.getLogger("sa_outbox.wakeup")

_RECONNECT_EVERY = 5.0
_SLICE = 0.2  # longest uninterrupted block, so stop() is seen quickly


def libpq_url(url: str | URL) -> str:
    """A SQLAlchemy URL (any postgresql driver) as a libpq connection URI."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class Waker:
    """Waits for a NOTIFY on any of ``channels`` (or a timeout, or stop)."""

    def __init__(self, url: str | URL | None, channels: Sequence[str]) -> None:
        self._url = libpq_url(url) if url is not None else None
        self._channels = list(channels)
        self._conn: psycopg.Connection[Any] | None = None
        self._next_try = 0.0
        self.notifications = 0

    @property
    def enabled(self) -> bool:
        return self._url is not None

    def _connect(self) -> psycopg.Connection[Any] | None:
        if self._conn is not None or self._url is None or time.monotonic() < self._next_try:
            return self._conn
        try:
            conn = psycopg.connect(self._url, autocommit=True, application_name="sa_outbox.listen")
            for channel in self._channels:
                conn.execute(psql.SQL("LISTEN {}").format(psql.Identifier(channel)))
        except psycopg.Error as exc:
            self._next_try = time.monotonic() + _RECONNECT_EVERY
            log.warning("LISTEN connection failed, polling only for now: %s", exc, extra={"error": str(exc)})
            return None
        self._conn = conn
        return conn

    def wait(self, timeout: float, stop: threading.Event) -> bool:
        """Block up to ``timeout`` seconds; True when woken by a notification."""
        deadline = time.monotonic() + timeout
        while not stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            conn = self._connect()
            if conn is None:
                stop.wait(min(remaining, _SLICE))
                continue
            try:
                got = False
                for _ in conn.notifies(timeout=min(remaining, _SLICE), stop_after=1):
                    got = True
                if got:
                    for _ in conn.notifies(timeout=0):  # coalesce what else is queued
                        pass
                    self.notifications += 1
                    return True
            except psycopg.Error as exc:
                log.warning("LISTEN connection lost, reconnecting: %s", exc, extra={"error": str(exc)})
                self.close()
                self._next_try = time.monotonic() + min(1.0, remaining)
        return False

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()
