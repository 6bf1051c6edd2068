"""What the dispatcher and the worker loops share: options, owner names, run/stop, signals, DB faults."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from types import FrameType
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import ProgrammingError
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_random_exponential

from . import _steps as eng
from ._dbfaults import is_connection_error
from ._durations import Duration, to_seconds
from ._sql import QueueSpec, spec_for
from ._wakeup import Waker
from .errors import ConfigurationError, Defer, PermanentError, RetryableError, SchemaError

T = TypeVar("T")

__all__ = ["LoopBase", "LoopStats"]


def default_owner(prefix: str) -> str:
    return f"{prefix}:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def is_async_callable(fn: Any) -> bool:
    """``async def`` functions and objects whose ``__call__`` is one: what only the async loops can await."""
    call = type(fn).__call__ if callable(fn) and not inspect.isroutine(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be an integer >= 1, got {value!r}")
    return value


@dataclass
class LoopStats:
    """Counters of one loop since it was created (read them from tests, logs or a metrics exporter)."""

    batches: int = 0
    claimed: int = 0
    done: int = 0
    retried: int = 0
    deferred: int = 0
    dead: int = 0
    released: int = 0
    lost_leases: int = 0
    rescued: int = 0
    unclassified: int = 0
    db_errors: int = 0
    wakeups: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class LoopBase:
    """Run/stop, signals, database-fault retries and wake-ups; subclasses implement :meth:`_step`."""

    _log: logging.Logger
    _owner_prefix = "loop"

    def __init__(
        self,
        engine: Engine,
        model: type[Any],
        *,
        owner: str | None,
        batch: int,
        poll_interval: Duration,
        listen: bool,
        listen_url: str | None,
        channels: list[str],
    ) -> None:
        if not isinstance(engine, Engine):
            raise ConfigurationError(f"engine must be a sqlalchemy Engine, got {type(engine).__name__}")
        self.engine = engine
        self.model = model
        self.spec: QueueSpec = spec_for(model)
        self.owner = owner or default_owner(self._owner_prefix)
        self.batch = positive_int(batch, "batch")
        self.poll_interval = to_seconds(poll_interval, name="poll_interval", allow_zero=False)
        self.stats = LoopStats()
        self._stop = threading.Event()
        self._waker = Waker(listen_url or engine.url, channels) if listen else Waker(None, channels)
        self._rescue_every = 1.0
        self._last_rescue = 0.0
        self._conn: Connection | None = None
        self._running = False
        # Outcomes of the last batch, finalized together with the next claim (one round trip) while run()
        # loops; flushed on their own when the loop stops, goes idle or run_once() returns.
        self._pending: list[eng.Outcome] = []
        #: Optional callback ``observer(what, seconds)`` with what in claim | handle | age (metrics).
        self.observer: Callable[[str, float], None] | None = None

    # -- database access -------------------------------------------------------------------------------

    @contextmanager
    def _connection(self) -> Iterator[Connection]:
        """The loop's own connection, in autocommit: each engine step (rescue, claim, finalize) is one
        statement, atomic by itself, committed as it runs — one round trip, no BEGIN/COMMIT. Kept open
        between batches (no pool checkout per step); dropped after a connection fault and reopened on the
        next use. Only the loop's thread uses it."""
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated:
            conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            self._conn = conn
        try:
            yield conn
        except ProgrammingError as exc:
            self._drop_connection()
            if "does not exist" in str(exc.orig):
                raise SchemaError(
                    f"table {self.spec.table.name!r} is missing or incomplete ({exc.orig}); "
                    "run the migration (alembic upgrade head) first"
                ) from exc
            raise
        except BaseException:
            self._drop_connection()
            raise

    @contextmanager
    def _side_connection(self) -> Iterator[Connection]:
        """A pooled autocommit connection for helper threads (heartbeats)."""
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            yield conn

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _retry_policy(self, window: float) -> dict[str, Any]:
        """Capped exponential backoff with jitter for connection faults (never a hot loop); tenacity keyword
        arguments shared by the sync ``Retrying`` and the async loops' ``AsyncRetrying``."""
        return dict(
            retry=retry_if_exception(is_connection_error),
            wait=wait_random_exponential(multiplier=0.05, max=5.0),
            stop=stop_after_delay(window),
            reraise=True,
            before_sleep=lambda rs: self._log.warning(
                "database error, retrying: %s", rs.outcome.exception() if rs.outcome else "?",
                extra={"attempt": rs.attempt_number},
            ),
        )  # fmt: skip

    def _retrying(self, window: float) -> Retrying:
        return Retrying(**self._retry_policy(window))

    def _with_retries(self, window: float, fn: Callable[[], T]) -> T:
        for attempt in self._retrying(window):
            with attempt:
                return fn()
        raise AssertionError("unreachable")  # pragma: no cover

    # -- claim and finalize, shared by both loops -------------------------------------------------------

    def _claim_params(self) -> list[dict[str, Any]]:
        """Keyword arguments of one claim call each (the worker makes one per queue)."""
        raise NotImplementedError

    def _rescue_params(self) -> dict[str, Any]:
        raise NotImplementedError

    def _claim_rows(self, *, rescue: bool) -> list[Any]:
        """Rescue (when due), then claim up to ``batch`` rows — finalizing the pending outcomes of the previous
        batch in the same statement when there are any."""
        with self._connection() as conn:
            rows = self._claim_rows_on(conn, rescue=rescue)
        if self._pending:  # nothing to claim with (no claim parameters): finalize on its own
            self._flush_pending()
        return rows

    def _claim_rows_on(self, conn: Connection, *, rescue: bool) -> list[Any]:
        """The database half of :meth:`_claim_rows` on a given connection (the async loops run it through
        ``AsyncConnection.run_sync``)."""
        rows: list[Any] = []
        started = time.perf_counter()
        if rescue:
            self.stats.rescued += len(eng.rescue(conn, self.spec, **self._rescue_params()))
        for params in self._claim_params():
            want = self.batch - len(rows)
            if want <= 0:
                break
            if self._pending:
                pending = self._pending
                applied, got = eng.finalize_and_claim(
                    conn, self.spec, pending, owner=self.owner, batch=want, fixed_batch=want == self.batch,
                    **params,
                )  # fmt: skip
                self._pending = []
                self._report(pending, applied)
            else:
                got = eng.claim(
                    conn, self.spec, owner=self.owner, batch=want, fixed_batch=want == self.batch, **params
                )
            rows += got
        if rows:
            self.stats.batches += 1
            self.stats.claimed += len(rows)
        if self.observer is not None:
            self.observer("claim", time.perf_counter() - started)
        return rows

    def _observe_handled(self, started: float, created_at: Any) -> None:
        """Publish/handler latency and end-to-end age, for the metrics exporter (sync and async loops)."""
        if self.observer is not None:
            self.observer("handle", time.perf_counter() - started)
            self.observer("age", max(0.0, time.time() - created_at.timestamp()))

    @staticmethod
    def _outage_delay(failures: int) -> float:
        """Capped exponential backoff with jitter between attempts to reach a database that is down."""
        return float(min(30.0, 0.1 * 2 ** min(failures, 10)) * random.uniform(0.5, 1.0))

    def _settle(self, outcomes: list[eng.Outcome]) -> None:
        """Record a batch's outcomes: with the next claim while run() loops on, right now otherwise."""
        if self._running and not self._stop.is_set():
            self._pending = outcomes
        else:
            self._finalize(outcomes)

    def _flush_pending(self) -> None:
        pending, self._pending = self._pending, []
        if pending:
            self._finalize(pending)

    def _finalize(self, outcomes: list[eng.Outcome]) -> None:
        """Finalize now, retrying connection faults for up to the lease (after that the fence would refuse)."""

        def attempt() -> set[int]:
            with self._connection() as conn:
                return eng.finalize(conn, self.spec, outcomes)

        self._report(outcomes, self._with_retries(self._finalize_window(), attempt))

    def _finalize_window(self) -> float:
        raise NotImplementedError

    def _report(self, outcomes: list[eng.Outcome], applied: set[int]) -> None:
        """Count and log each outcome (one line per state change); unapplied ones are lost leases."""
        debug = self._log.isEnabledFor(logging.DEBUG)
        kind = self.spec.kind
        for o in outcomes:
            if o.kind == "done" and o.id in applied:
                self.stats.done += 1
                if debug:
                    self._log.debug(
                        "%s %s done", kind, o.id, extra={"row_id": o.id, "lease_version": o.lease_version}
                    )
                continue
            extra = {"table": self.spec.table.name, "row_id": o.id, "lease_version": o.lease_version,
                     "status": o.status, "outcome": o.kind}  # fmt: skip
            if o.id not in applied:
                self.stats.lost_leases += 1
                self._log.warning(
                    "lost lease: %s %s version %s was rescued or re-claimed; its %s was not recorded",
                    kind, o.id, o.lease_version, o.kind, extra=extra,
                )  # fmt: skip
            elif o.kind == "retry":
                self.stats.retried += 1
                self._log.info(
                    "%s %s -> %s, retry in %.2fs: %s", kind, o.id, o.status, o.delay, o.error, extra=extra
                )
            elif o.kind == "defer":
                self.stats.deferred += 1
                self._log.info("%s %s deferred %.2fs: %s", kind, o.id, o.delay, o.error, extra=extra)
            elif o.kind == "dead":
                self.stats.dead += 1
                self._log.error("%s %s -> %s: %s", kind, o.id, o.status, o.error, extra=extra)
            else:
                self.stats.released += 1
                self._log.info("%s %s released: %s", kind, o.id, o.error, extra=extra)

    def _outcome(
        self, *, id: int, lease_version: int, attempts: int, max_attempts: int, error: BaseException | None,
        backoff: Any, label: str, stop_on_unclassified: bool,
    ) -> tuple[eng.Outcome, BaseException | None]:  # fmt: skip
        """Classify one result; an unclassified exception is logged with its traceback and counted. Returns the
        outcome and, when the loop must stop on it, the exception."""
        fatal = None
        if error is not None and not isinstance(error, (RetryableError, PermanentError, Defer)):
            self.stats.unclassified += 1
            self._log.error(
                "%s raised an unclassified exception (treated as retryable)", label, exc_info=error,
                extra={"table": self.spec.table.name, "row_id": id, "lease_version": lease_version},
            )  # fmt: skip
            fatal = error if stop_on_unclassified else None
        outcome = eng.decide(
            self.spec, id=id, lease_version=lease_version, attempts=attempts, max_attempts=max_attempts,
            error=error, backoff=backoff,
        )  # fmt: skip
        return outcome, fatal

    # -- the loop --------------------------------------------------------------------------------------

    def _step(self, *, rescue: bool) -> int:
        raise NotImplementedError

    def run_once(self) -> int:
        """One rescue step plus one claimed batch, handled and finalized; returns how many rows it claimed."""
        self._last_rescue = time.monotonic()
        try:
            return self._step(rescue=True)
        finally:
            if not self._running:
                self._drop_connection()  # back to the pool; run() keeps its connection between batches

    def stop(self) -> None:
        """Ask :meth:`run` to finish: no new claims; the batch in hand is finished and finalized."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(
        self,
        *,
        install_signal_handlers: bool = True,
        max_batches: int | None = None,
        until_idle: bool = False,
        startup_timeout: Duration | None = None,
    ) -> None:
        """Loop until :meth:`stop`, SIGTERM or SIGINT (or, with ``until_idle``, until a claim comes back empty).
        Expired leases are rescued at most once a second. Database connection faults are logged and retried
        with capped exponential backoff; the loop never spins hot on an empty queue or a dead server.

        ``startup_timeout``: when the database has not been reached once within this long after start, raise
        :class:`~sa_outbox.errors.ConfigurationError` naming the last error (default: keep retrying). Once it has
        been reached, outages are always ridden out."""
        restore = self._install_signals() if install_signal_handlers else None
        self._running = True
        failures = 0
        batches = 0
        started = time.monotonic()
        reached = False
        limit = None if startup_timeout is None else to_seconds(startup_timeout, name="startup_timeout")
        self._log.info("started", extra={"owner": self.owner, "table": self.spec.table.name})
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                rescue = now - self._last_rescue >= self._rescue_every
                if rescue:
                    self._last_rescue = now
                try:
                    claimed = self._step(rescue=rescue)
                    failures = 0
                    reached = True
                except Exception as exc:
                    if not is_connection_error(exc):
                        raise
                    failures += 1
                    self.stats.db_errors += 1
                    if not reached and limit is not None and time.monotonic() - started > limit:
                        raise ConfigurationError(
                            f"database unreachable for {limit:g}s since start ({type(exc).__name__}: "
                            f"{getattr(exc, 'orig', exc)}); check the URL (--url / DATABASE_URL) and that the server runs"
                        ) from exc
                    delay = self._outage_delay(failures)
                    self._log.warning(
                        "database unavailable (%s), retrying in %.2fs", type(exc).__name__, delay,
                        extra={"owner": self.owner, "failures": failures},
                    )  # fmt: skip
                    self._stop.wait(delay)
                    continue
                batches += 1
                if max_batches is not None and batches >= max_batches:
                    break
                if claimed == 0 and until_idle:
                    break
                if claimed == 0 and self._waker.wait(self.poll_interval, self._stop):
                    self.stats.wakeups += 1
        finally:
            self._running = False
            try:
                self._flush_pending()
            except Exception:
                self._log.exception(
                    "could not finalize the last batch; its leases will expire and be rescued"
                )
            self._waker.close()
            self._drop_connection()
            if restore:
                restore()
            self._log.info("stopped", extra={"owner": self.owner, **self.stats.as_dict()})

    def _install_signals(self) -> Callable[[], None] | None:
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum: int, frame: FrameType | None) -> None:
            self._log.info("signal %s: finishing the batch in hand, then stopping", signum)
            self.stop()

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for s, h in previous.items():
                signal.signal(s, h)

        return restore

    def close(self) -> None:
        self._waker.close()
        self._drop_connection()
