"""What every loop shares, with no loop of its own: options, owner names, the database steps of one turn
(claim with the previous outcomes, finalize, rescue, heartbeat) as plain functions on a ``Connection``,
classification of results into outcomes, counters and log lines, the run policy (start-up timeout, outages)
and stopping.

``Dispatcher``/``AsyncDispatcher`` and ``Worker``/``AsyncWorker`` each own a complete, typed loop on top of it
(httpx's ``BaseClient``/``Client``/``AsyncClient`` pattern): the sync classes wait on threads and a self-pipe,
the async ones on the event loop, and both run the same steps (the async ones through
``AsyncConnection.run_sync``) and take the same decisions from here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, fields
from types import FrameType
from typing import Any, ClassVar, Concatenate, ParamSpec, TypeVar

from sqlalchemy import Connection
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from tenacity import retry_if_exception, stop_after_delay

from . import _steps
from ._backoff import DATABASE_OUTAGE, STATEMENT_RETRY, Backoff
from ._dbfaults import (
    connection_error_cause,
    is_connection_error,
    is_lost_connection,
    is_permanent_connection_error,
)
from ._durations import Duration, positive_int, to_seconds
from ._execute import transaction
from ._messages import json_loads_of
from ._names import channel_for
from ._partitions import PartitionMaintainer
from ._services import Completer, Held, Requeued, Rescuer
from ._sql import QueueSpec, spec_for
from ._steps import Outcome
from .errors import ConfigurationError, Defer, DestinationUnavailable, PermanentError, RetryableError

__all__ = [
    "ABANDON_AFTER_CANCEL",
    "CLAIM_GRACE",
    "LoopBase",
    "LoopStats",
    "RunPolicy",
    "held_task",
    "install_async_signals",
    "is_async_callable",
    "one_async_run_at_a_time",
    "one_run_at_a_time",
    "positive_int",
    "run_to_end",
    "stray_cancellation",
    "through_cancellation",
]

T = TypeVar("T")
log = logging.getLogger("sa_outbox.loop")


def default_owner(prefix: str) -> str:
    return f"{prefix}:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def is_async_callable(fn: Any) -> bool:
    """``async def`` functions and objects whose ``__call__`` is one: what only the async loops can await."""
    call = type(fn).__call__ if callable(fn) and not inspect.isroutine(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


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
    timed_out: int = 0
    unavailable: int = 0
    cancelled: int = 0
    db_errors: int = 0
    wakeups: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class RunPolicy:
    """How ``run()`` treats database faults, the same in every loop: connection faults are ridden out with
    capped exponential backoff and jitter (never a hot loop); a database never reached within
    ``startup_timeout`` of the start is a :class:`ConfigurationError` naming the last error."""

    def __init__(
        self,
        log: logging.Logger,
        owner: str,
        startup_timeout: Duration | None,
        cap: float = DATABASE_OUTAGE.cap,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.log = log
        self.stopping = stopping
        self.owner = owner
        self.cap = cap
        self.limit = None if startup_timeout is None else to_seconds(startup_timeout, name="startup_timeout")
        self.started = time.monotonic()
        self.reached = False
        self.failures = 0

    def succeeded(self) -> None:
        self.failures = 0
        self.reached = True

    def answered(self) -> None:
        """The database answered this run (no start-up error), but the turn did not see its claim through:
        the backoff goes on from where it is."""
        self.reached = True

    def failed(self, exc: BaseException, sooner: str = "") -> float:
        """The delay before the next try after ``exc``; re-raises what is not an outage, and names the cause
        of a connection that can never succeed (no such database or role, authentication failed, unknown
        host) at once instead of retrying it as an outage. ``sooner``: what may end the wait before the delay,
        said with it in the log."""
        if not is_connection_error(exc):
            raise exc
        if is_permanent_connection_error(exc):
            raise ConfigurationError(
                f"cannot connect to the database: {connection_error_cause(exc)}; check the URL "
                "(--url / DATABASE_URL), the role and the database name"
            ) from exc
        self.failures += 1
        # (not once a stop was asked: a signal during a start-up on a server that never answered exited 2,
        # "unreachable", when the connect that held it gave up — a review; the stop is what the caller asked)
        late = self.limit is not None and time.monotonic() - self.started > self.limit
        if late and not self.reached and not self.stopping():
            raise ConfigurationError(
                f"database unreachable for {self.limit:g}s since start ({type(exc).__name__}: "
                f"{getattr(exc, 'orig', exc)}); check the URL (--url / DATABASE_URL) and that the server runs"
            ) from exc
        delay = min(self.cap, DATABASE_OUTAGE.delay(self.failures))
        # the cause as the server put it: a deadlock or a serialization failure is retried the same way, and
        # read "database unavailable" alone (a review)
        self.log.warning(
            "database unavailable or the step was refused (%s: %.200s), retrying in %.2fs%s", type(exc).__name__,
            connection_error_cause(exc), delay, sooner, extra={"owner": self.owner, "failures": self.failures},
        )  # fmt: skip
        return delay


class LoopBase:
    """Options and shared steps of a Dispatcher/Worker of either flavour (see the module docs)."""

    _log: ClassVar[logging.Logger]
    _owner_prefix: ClassVar[str] = "loop"
    _kind: ClassVar[str] = "outbox"
    #: The engine classes a flavour accepts (``Engine`` or ``AsyncEngine``).
    _engine_types: ClassVar[tuple[type[Any], ...]] = ()
    #: Longest an outcome waits before it is written on its own (when no claim takes it along).
    _flush_after: ClassVar[float] = 0.05

    def __init__(
        self,
        engine: Any,
        model: type[Any],
        *,
        owner: str | None,
        batch: int,
        poll_interval: Duration,
        listen: bool,
        listen_url: str | URL | None,
        stop_on_unclassified: bool,
        rescue_limit: int,
        backoff: Backoff,
        maintain_partitions: Duration | None = None,
        give_up_after: Duration | None = None,
    ) -> None:
        if not isinstance(engine, self._engine_types):
            wanted = " or ".join(t.__name__ for t in self._engine_types)
            hint = " (use the Async class for an AsyncEngine)" if "Async" in type(engine).__name__ else ""
            raise ConfigurationError(
                f"{type(self).__name__} needs a sqlalchemy {wanted}, got {type(engine).__name__}{hint}"
            )
        self.engine = engine
        #: decodes claimed payloads as the engine decodes JSON (its ``json_deserializer``, if any)
        self._loads = json_loads_of(engine)
        self.model = model
        self.spec: QueueSpec = spec_for(model)
        if self.spec.kind != self._kind:
            other = "Worker" if self._kind == "outbox" else "Dispatcher"
            mixin = "an OutboxMixin" if self._kind == "outbox" else "a JobMixin"
            raise ConfigurationError(
                f"{type(self).__name__} needs {mixin} model, got {model.__name__} (use {other})"
            )
        self.owner = owner or default_owner(self._owner_prefix)
        self.batch = positive_int(batch, "batch")
        self.poll_interval = to_seconds(poll_interval, name="poll_interval", allow_zero=False)
        self.listen = bool(listen)
        self.listen_url: str | URL | None = (listen_url or engine.url) if listen else None
        self.channels = [channel_for(self.spec.table.name)]
        self.stop_on_unclassified = bool(stop_on_unclassified)
        self.rescue_limit = positive_int(rescue_limit, "rescue_limit")
        self.backoff = backoff
        self.give_up_after: float | None = (
            None
            if give_up_after is None
            else to_seconds(give_up_after, name="give_up_after", allow_zero=False)
        )
        #: Each claimed row's age (database clock) at its claim, for ``give_up_after`` (and a worker's
        #: ``unknown_task_grace``); the flavour fills it as rows are claimed and drops them as they finish.
        self._ages: dict[int, float] = {}
        self.stats = LoopStats()
        #: Optional callback ``observer(what, seconds)`` with what in claim | handle | age (metrics).
        self.observer: Callable[[str, float], None] | None = None
        # A plain attribute, not a threading.Event: stop() runs in signal handlers, and Event.set() takes a lock
        # that a handler interrupting another set() on the same thread (a second SIGTERM during the first's
        # handling: a supervisor's death sends two, PR_SET_PDEATHSIG's and the lifeline's) waited on forever.
        # Nothing waits on it: the loop's waiter is poked.
        self._stop_requested = False
        #: Whether the last run() ended without recording what it had in hand (the database out of reach as it
        #: stopped): those rows are rescued after their lease and run again. ``sa-outbox`` then exits 3.
        self.ended_unrecorded = False
        #: Signals the handler took, to be logged by _stopped() (append and popleft are atomic: no lock).
        self._stop_signals: collections.deque[int] = collections.deque()
        self._rescuer = Rescuer()
        self._requeued = Requeued()
        #: Whether the last claim came back short of what it could take (a limited queue's aside, which its
        #: Limit holds back): a worker's next claim then reads its queues level by level
        #: (``WorkerBase._claim_params``), a dispatcher's locks the rows it meets (``ClaimForms.settle``).
        self._claimed_short = False
        #: Whether the table's planner statistics were looked after (by the first maintenance step after a claim).
        self._statistics_settled = False
        self._held = Held()
        #: A database fault met since the last rescue step (set by any of the loop's threads, see :meth:`_db_fault`);
        #: when the stretch of faults it belongs to began (monotonic; None: no trouble), and when that stretch is
        #: over if no new fault comes (:meth:`_rescue_margin`).
        self._fault_seen = False
        self._trouble_since: float | None = None
        self._calm_from = float("-inf")
        #: A connection lost under a later queue's claim of a turn whose earlier claims committed: run() backs
        #: off after that turn as after a failed one (:meth:`_turn_went_through`).
        self._turn_fault: Exception | None = None
        #: When a statement last sent on one of the loop's connections succeeded (monotonic, at its sending), and
        #: when the current trouble was noticed (the cap of :meth:`_rescue_margin` counts from then).
        self._last_ok = float("-inf")
        #: The rows whose renewal the last beat's one-by-one renewal found refused (:meth:`_extend_on`): not
        #: missed, so no lease guard is taken for them (it would only be refused again, every guard round).
        self._refused_renewals: set[int] = set()
        self._noticed_at = float("-inf")
        self._done = Completer(flush_after=self._flush_after, limit=self.batch)
        #: An async loop's handler or publish tasks abandoned after their cancellation (:meth:`_abandon`).
        self._abandoned: set[asyncio.Task[Any]] = set()
        #: Whether the table was found to have every column of the model (:meth:`_check_columns_on`).
        self._columns_checked = False
        #: (database, oid) of the table as the loop's connection resolves it, read with the column check when
        #: a worker renews its leases on a connection of its own to the server (see Worker: a direct route).
        self._table_identity: tuple[str, int | None] | None = None
        self._want_identity = False
        #: Held while run() or run_once() runs (:func:`one_run_at_a_time`), by the event loop or thread below.
        self._run_lock = threading.Lock()
        self._run_owner: Any = None
        self._run_token: object | None = None
        #: The partition step (``maintain_partitions=``), or None.
        self.partitions: PartitionMaintainer | None = (
            None
            if maintain_partitions is None
            else PartitionMaintainer(model, maintain_partitions, self.owner)
        )

    def _enter_run(self, name: str) -> object:
        """Take the instance's run lock for ``run()``/``run_once()`` (``name``), or refuse a second run — unless
        the run holding it can never end: its event loop was closed under it (a harness's per-test loop closed
        with ``run()`` pending; its ``finally`` never runs), or its thread is gone. That run's rows wait for
        their lease, as a crashed process's do."""
        try:
            owner: Any = asyncio.get_running_loop()
        except RuntimeError:
            owner = threading.current_thread()
        if not self._run_lock.acquire(blocking=False):
            holder = self._run_owner
            gone = holder is not None and (  # (None: the holder is between its acquire and this line)
                holder.is_closed() if isinstance(holder, asyncio.AbstractEventLoop) else not holder.is_alive()
            )
            if not gone:
                raise ConfigurationError(
                    f"{type(self).__name__}.{name}() is already running on this instance: one run at a time — the "
                    "loop's connections, heartbeat and jobs in hand are the instance's own (a second run ending shut "
                    "them under the first: its leases went unrenewed and a job ran twice at once). Build another "
                    "instance for another thread or task"
                )
            self._log.warning(
                "%s.%s(): the run that held this loop ended without finishing (its event loop was closed under "
                "it, or its thread died): taken over; its rows wait for their lease", type(self).__name__, name,
            )  # fmt: skip
        self._run_owner = owner
        self._run_token = token = object()
        return token

    def _exit_run(self, token: object) -> None:
        """Give the run lock back — unless a later run took it over (:meth:`_enter_run`): the run that ended
        here, a dead run's coroutine closed at last by a garbage collection, must not free the lock of the
        live one (which a third run could then share)."""
        if self._run_token is token:
            self._run_token = self._run_owner = None
            self._run_lock.release()

    # -- stopping ----------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to finish: no new claims; what is in hand is finished and finalized, unstarted rows
        are released (back to ready, attempt refunded). Safe from any thread and from signal handlers.

        A stop is final for this loop object: one that lands before :meth:`run` begins (a signal during
        start-up) makes that ``run()`` return without claiming anything. To run again, build a new loop."""
        self._stop_requested = True
        self._poke()

    @property
    def stopping(self) -> bool:
        return self._stop_requested

    def _stop_on_signal(self, signum: int) -> None:
        """A stop asked by a signal, the one way every flavour takes it: the loop logs the signal when it next
        looks (:meth:`_stopped`) — the async loops, which called :meth:`stop` alone, never logged it (a
        review)."""
        self._stop_signals.append(signum)
        self.stop()

    def _stopped(self) -> bool:
        """Whether a stop was asked for — what the loops check — and a log line for each signal the handler took
        since the last look (written here, never in the signal handler)."""
        if not self._stop_requested:
            return False
        while True:  # (any thread may look: each signal is taken, and logged, once)
            try:
                signum = self._stop_signals.popleft()
            except IndexError:
                return True
            self._log.info(
                "signal %s: finishing what is in hand, then stopping%s", signum, self._in_hand_note()
            )

    def _in_hand_note(self) -> str:
        """What the stop waits for, for the signal's log line (each flavour says what it holds)."""
        return ""

    def _poke(self) -> None:
        """Wake the loop's waiter (each flavour has its own)."""
        raise NotImplementedError

    def _install_signals(self) -> Callable[[], None] | None:
        """SIGTERM/SIGINT call :meth:`stop` (sync loops in the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum: int, frame: FrameType | None) -> None:
            # Nothing here takes a lock: the handler runs at any bytecode of the main thread, also inside a
            # lock that thread holds. So it does not log either (a QueueHandler's queue.put holding its
            # mutex, interrupted, hung here on the same mutex): the loop logs the signal when it next looks
            # (_stopped), from its own code.
            self._stop_on_signal(signum)

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for s, h in previous.items():
                signal.signal(s, h)

        return restore

    def _lifecycle(self, what: str) -> None:
        if what == "started":
            self._log.info(
                "started",
                extra={"owner": self.owner, "table": self.spec.table.name, "flavour": self._flavour()},
            )
        else:
            self._log.info("stopped", extra={"owner": self.owner, **self.stats.as_dict()})

    def _flavour(self) -> str:
        return "async" if "Async" in type(self).__name__ else "sync"

    # -- the steps of one turn, on a Connection -----------------------------------------------------------

    def _claim_params(self) -> list[dict[str, Any]]:
        """Keyword arguments of one claim call each (a worker: one per run of queues without a Limit, one per
        limited queue)."""
        raise NotImplementedError

    def _rescue_params(self) -> dict[str, Any]:
        raise NotImplementedError

    def _claim_on(
        self, conn: Connection, want: int, outcomes: Sequence[Outcome],
        claim_params: list[dict[str, Any]] | None = None,
    ) -> tuple[set[int], list[Any]]:  # fmt: skip
        """Claim up to ``want`` rows, writing ``outcomes`` in the same statement (one round trip); returns
        (ids whose outcome was applied, claimed rows by id). ``claim_params``: :meth:`_claim_params` taken
        beforehand (by the loop's thread, when the claim itself runs on another)."""
        started = time.perf_counter()
        self._requeued.claiming(time.monotonic())
        applied: set[int] = set()
        rows: list[Any] = []
        pending = list(outcomes)
        short = False
        for call in self._claim_params() if claim_params is None else claim_params:
            params, left = sized_claim(call, want - len(rows))
            if left <= 0:
                continue
            limit = params.pop("limit", None)
            fixed = left == self.batch
            committed = bool(rows) or bool(applied)
            sent = time.monotonic()
            try:
                if limit is not None:  # a limited queue: its own short transaction, outcomes written first
                    if pending:
                        applied |= _steps.finalize(conn, self.spec, pending)
                        pending = []
                    got, sent = _steps.claim_limited(
                        conn, self.spec, owner=self.owner, batch=left, limit=limit, **params
                    )
                elif pending:
                    done, got = _steps.finalize_and_claim(
                        conn, self.spec, pending, owner=self.owner, batch=left, fixed_batch=fixed, **params
                    )
                    applied |= done
                    pending = []
                else:
                    got = _steps.claim(
                        conn, self.spec, owner=self.owner, batch=left, fixed_batch=fixed, **params
                    )
            except Exception as exc:
                if not (committed or applied):
                    raise  # nothing was written: the caller keeps the outcomes and retries the turn
                # Earlier queues' claims (and the outcomes) are committed: keep those rows rather than leave
                # them leased to nobody until rescued. A statement refused on one queue (a lock or statement
                # timeout, a trigger) meets the next turn again, the other queues going on at full pace (a
                # review: a lock timeout taken for a lost connection backed them off up to 30 s). A lost
                # connection is an outage: run() backs off after this turn as after a failed one, the backoff
                # not reset (before, the turn counted as a success and the next came at once, at a
                # notification: the model suite's I13, 59-80 failed turns in a 3 s outage where the backoff
                # allows about six).
                self._log.warning("claim of queue %r failed after other claims of this turn: %s",
                                  params.get("queue"), exc)  # fmt: skip
                if is_lost_connection(exc):
                    self._fault_noticed()
                    self._turn_fault = exc
                else:
                    self.stats.db_errors += 1
                break
            self._answered(sent, "claim")
            rows += got
            short = short or (limit is None and len(got) < asked(params, left))
            self._in_hand_now(got, [(o.id, o.lease_version) for o in outcomes if o.id in applied], sent)
        self._claimed_short = short
        if pending:  # no claim call at all: write the outcomes on their own
            applied |= _steps.finalize(conn, self.spec, pending)
        if rows:
            self.stats.batches += 1
            self.stats.claimed += len(rows)
        if self.observer is not None:
            self.observer("claim", time.perf_counter() - started)
        return applied, rows

    def _in_hand_now(self, rows: Sequence[Any], finalized: Sequence[tuple[int, int]], sent: float) -> None:
        """Rows one queue's claim committed, and outcomes written, while the turn may go on to claim the next
        queues (a limited queue's pick can wait on its limit lock): a worker's heartbeat renews the rows from
        now on and stops renewing the finalized leases ((id, lease_version) — a row an earlier queue's claim
        of the turn took again, a ``Defer(0)``'s, stays held under its new lease) — not from the turn's end, or,
        past stale_after, its own rescue would take back jobs it then runs. ``sent``: when the claim statement
        was sent (the leases' start, at the latest). The outbox has no heartbeat: nothing to do."""

    def _send_claim_on(
        self, conn: Connection, want: int, outcomes: Sequence[Outcome], claim_params: list[dict[str, Any]]
    ) -> Callable[[], tuple[set[int], list[Any]]] | None:
        """Send the claim :meth:`_claim_on` would make — when it is one statement (no limited queue)
        that ``conn`` can send ahead (:func:`_steps.send_claim`) — and return the call that reads it (counted
        and observed as a claim then). None: nothing was sent."""
        if not one_statement(claim_params):
            return None
        params, left = sized_claim(claim_params[0], want)
        if left <= 0:
            return None
        started = time.perf_counter()
        self._requeued.claiming(time.monotonic())
        receive = _steps.send_claim(
            conn, self.spec, outcomes, owner=self.owner, batch=left, fixed_batch=left == self.batch, **params
        )
        if receive is None:
            return None
        sending = time.perf_counter() - started

        def read() -> tuple[set[int], list[Any]]:
            reading = time.perf_counter()
            applied, rows = receive()
            self._claimed_short = len(rows) < asked(params, left)
            if rows:
                self.stats.batches += 1
                self.stats.claimed += len(rows)
            if self.observer is not None:  # the time the loop spent on it, not the jobs run meanwhile
                self.observer("claim", sending + time.perf_counter() - reading)
            return applied, rows

        return read

    def _finalize_on(self, conn: Connection, outcomes: Sequence[Outcome]) -> set[int]:
        sent = time.monotonic()
        applied = _steps.finalize(conn, self.spec, outcomes)
        self._answered(sent, "finalize")
        return applied

    def _partition_step(self, now: float) -> None:
        """Start the partition maintenance when it is due: on a daemon thread with a pooled connection of
        the engine (sync) or a task on the event loop (async); never on the loop's claim connection, and never
        waited for."""
        step = self.partitions
        if step is None or not step.due(now):
            return
        if self._flavour() == "async":
            step.start_task(self.engine)
        else:
            step.start_thread(self.engine)

    def _abandon(self, task: asyncio.Task[Any]) -> None:
        """No longer waited for (it did not stop within ``ABANDON_AFTER_CANCEL`` of its cancellation): referenced
        until it ends, so that the collector does not destroy it while it still runs."""
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)

    def _check_columns_on(self, conn: Connection) -> None:
        """Once per loop object, before its first claim (its first maintenance step or, for a worker's run, its
        first reading of the pauses): a table without every column of the model stops the loop, nothing claimed
        (:func:`_steps.check_columns`)."""
        if not self._columns_checked:
            _steps.check_columns(conn, self.spec)
            if self._want_identity:
                self._table_identity = _steps.table_identity(conn, self.spec)
            self._columns_checked = True

    def _rescue_on(self, conn: Connection) -> None:
        """Rescue expired leases (back to ready, or dead/failed once out of attempts: poison messages); and, once
        the loop's claims have found rows, see that the table has planner statistics (:func:`_steps.ensure_statistics`,
        once per loop)."""
        self._check_columns_on(conn)
        if not self._statistics_settled and self.stats.claimed:
            self._statistics_settled = True
            try:
                self._statistics_settled = _steps.ensure_statistics(conn, self.spec)
            except DBAPIError as exc:
                if is_connection_error(exc):
                    self._statistics_settled = False  # (asked again at the next step)
                    raise
                self._log.warning(
                    "could not check the planner statistics of %s: %s", self.spec.table.name, exc.orig
                )
        sent = time.monotonic()
        with transaction(conn):
            # BEGIN first: its answer says how long the step was held back before the server saw it (a pooler's
            # PAUSE holds every client's statement without an error) — the rescue itself then runs on the
            # server connection the block holds, with nothing more to wait for (see :meth:`_held_back`)
            self._answered(sent, "rescue step")
            rows = _steps.rescue(conn, self.spec, expired_for=self._rescue_margin(), **self._rescue_params())
        self._contact(sent)
        _steps.log_rescued(self.spec, rows)
        if rows:
            self._rescued({row_id for row_id, _, _ in rows})
        if any(status == self.spec.ready for _, status, _ in rows):
            # claimable at once, but a worker's turn claims before its rescue: the loop claims again now, and
            # run(until_idle=True) does not stop before it has (it stopped with the rescued rows still ready)
            self._requeued.put(None, time.monotonic())
        self.stats.rescued += len(rows)
        self.stats.dead += sum(1 for _, status, _ in rows if status == self.spec.dead)
        self.stats.cancelled += sum(1 for _, status, _ in rows if status == "cancelled")

    def _start_run(self, startup_timeout: Duration | None, *, drain: bool) -> RunPolicy:
        """What run() does first: log the start, and take it as the end of an outage the loop never saw — a loop
        that starts as one ends finds the others' leases run out meanwhile (a review: a job finished during
        the outage ran twice, 5 of 5, when a worker started as it ended) — so for :meth:`_fault_grace` its
        rescue takes only leases that ran out more than two leases before the start (:meth:`_rescue_margin`): a
        dead predecessor's old leases at once, so loops that each run for less than the wait still rescue (a
        review: with no margin, five 3–5 s runs rescued nothing). A ``drain`` (``until_idle``, a script's or a
        test's run, like run_once()) rescues at once. Returns the policy of run()'s retries through
        connection faults."""
        self._lifecycle("started")  # (first: the one line starting "started", which logs are read for)
        self._turn_fault = None  # (one a run_once() rode over is not this run's)
        grace = self._fault_grace()
        if not drain and grace > 0:
            now = time.monotonic()
            self._trouble_since, self._noticed_at, self._calm_from = now, now, now + grace
            self._log.info("leases expired less than %.0f s ago are rescued from %.1f s after the start, once the "
                           "other loops' heartbeats have renewed what they hold", 2 * self._lease_seconds(), grace)  # fmt: skip
        return RunPolicy(
            self._log,
            self.owner,
            startup_timeout,
            cap=self._outage_retry_cap(),
            stopping=lambda: self._stop_requested,
        )

    def _outage_retry_cap(self) -> float:
        """The longest run() waits between two tries to reach a database that is down."""
        return DATABASE_OUTAGE.cap

    def _turn_went_through(self, policy: RunPolicy) -> None:
        """What run() tells its policy after a turn that raised nothing. A lost connection the turn rode over is
        raised here — run() then counts it, backs off and waits as after a failed turn (the rows the turn
        claimed are in hand meanwhile). A turn that sent its claim ahead has not seen it through: the turn where
        it lands says whether the claim succeeded (counted a success, every claim that failed was retried after
        the first backoff step, 0.1-0.2 s, for as long as it failed — a lost connection 44 times in 3 s where
        the backoff allows about six: the model suite's I13 under load). Only a turn that saw its claim through
        resets the backoff."""
        fault, self._turn_fault = self._turn_fault, None
        if fault is not None:
            policy.answered()
            raise fault
        if self._claim_in_flight():
            policy.answered()
        else:
            policy.succeeded()

    def _claim_in_flight(self) -> bool:
        """Whether a claim has been sent whose rows have not been accepted yet (a loop that claims on a thread
        of its own, or sends its claim ahead — the threaded Worker; the others accept a claim's rows before they
        collect a run)."""
        return False

    def _db_fault(self) -> None:
        """A turn of run() met a database fault (the outage is ridden out with backoff)."""
        self._fault_noticed()

    def _fault_noticed(self) -> None:
        """One of the loop's connections met a database fault (any of its threads may call this): the rescue
        leaves alone the leases that may have run out because of it (:meth:`_rescue_margin`). A trouble that
        was over — calm for :meth:`_fault_grace` — but not yet cleared, no rescue step having run since (a loop
        held in its claim by a pooler's PAUSE), goes on with its cap counted from this fault: counted from the
        old one, the cap had run out by the time the held claim came back, and the rescue took the leases that
        ran out during the PAUSE (a test under load, every run: the trouble of the run's start, 9 s before)."""
        now = time.monotonic()
        self._fault_seen = True
        if self._trouble_since is None:
            self._begin_trouble(now)
        elif now >= self._calm_from:
            self._noticed_at = now

    def _begin_trouble(self, now: float) -> None:
        """A trouble began no later than the last statement that succeeded: a fault can surface long after the
        outage began (a statement hung on a network partition until TCP gave up — a review: a 20 s partition
        noticed when it ended made the outage's own expired leases look older than the trouble, and a job ran
        twice, 3 of 3)."""
        self._noticed_at = now
        self._trouble_since = min(now, self._last_ok) if self._last_ok > float("-inf") else now

    def _contact(self, sent: float) -> None:
        """A statement sent at ``sent`` on one of the loop's connections succeeded (any thread)."""
        if sent > self._last_ok:
            self._last_ok = sent

    def _held_back_after(self) -> float:
        """How long one of the loop's statements may take before the loop takes it as cut off meanwhile: an
        eighth of a lease, between 0.2 s and a second."""
        return max(0.2, min(1.0, self._lease_seconds() / 8))

    def _answered(self, sent: float, what: str) -> None:
        """A statement of the loop sent at ``sent`` was answered now (``what``: the rescue step's BEGIN, a claim,
        a finalize): held back longer than :meth:`_held_back_after`, the loop was cut off (:meth:`_held_back`)."""
        held = time.monotonic() - sent
        if held >= self._held_back_after():
            self._held_back(held, what)

    def _held_back(self, held: float, what: str) -> None:
        """A statement of the loop was answered ``held`` seconds after it was sent, with no error: the database
        was out of reach meanwhile — a pooler's PAUSE or its queue for a free server connection, a saturated
        server, a lock — likely for every loop, and the leases that ran out in that time may be live loops',
        whose statements waited in the same queue: a dispatcher's finalize of a batch it published, alone or
        with its next claim, a worker's outcomes. Without a fault to notice, the rescue took them the moment
        the queue moved, and they were published again (a review: 40 of 600 messages behind an 8 s PAUSE with
        a 3 s lease; a test: all six of a batch, the rescue held; a second review: a whole batch in 5 of 8 runs
        when the loop that rescued had been held in its claim, its next rescue's BEGIN answered at once). Taken
        as a database fault that began at the last statement of the loop that went through in time (its
        rescue, a beat): the rescue leaves those leases alone until the loops have had :meth:`_fault_grace`
        to write what they hold (:meth:`_rescue_margin`). Logged when it begins a trouble."""
        if self._trouble_since is None:
            self._log.warning(
                "a %s waited %.1f s for the database (a pooler's PAUSE or queue, a saturated server, a lock): "
                "leases that ran out meanwhile are left to their loops a while longer", what, held,
                extra={"held": held, "step": what},
            )  # fmt: skip
        self._fault_noticed()

    def _trouble_cap(self) -> float:
        """How long a trouble holds back the rescue of leases that ran out during it, however often faults keep
        coming: three leases. Past that, a flapping connection leaves the rescue free until its next fault —
        a loop whose worker died during an endless run of faults is rescued (a review: a fault every second
        held its job back for as long as they lasted, 28 s)."""
        return 3 * self._lease_seconds()

    def _fault_grace(self) -> float:
        """How long the rescue statement waits after the loop is back from a database fault (0: not at all)."""
        return 0.0

    def _lease_seconds(self) -> float:
        """How long a lease of this loop's table lasts (a worker's stale_after, a dispatcher's lease)."""
        raise NotImplementedError

    def _rescue_margin(self) -> float:
        """The rescue step takes only the leases that ran out longer ago than this many seconds.

        Zero, unless the loop is in trouble: from a database fault (or run()'s start) until :meth:`_fault_grace`
        has passed since the last fault it saw, for :meth:`_trouble_cap` at most. Meanwhile it is the time since
        the trouble began — the last statement that succeeded before it (:meth:`_begin_trouble`) — plus two
        leases: a lease that ran out before then is a dead loop's, taken at once — a loop whose connection keeps
        failing still rescues those — while one that ran out since may be a live loop's, cut off by the same
        outage, whose heartbeats renew it (and the outcomes it holds are written) once it is back. The two
        leases cover how far the last success may be from the outage's start (a step a second, a beat).

        The wait after a fault: the other loops were most likely cut off too (a server restart, a pooler or
        network outage): their leases ran out with nobody able to renew them, and the loop that reconnects
        first would take back jobs that live workers ran — finished, their outcomes not yet written — and run
        them again (a review: 1–2 jobs of 40 run twice in 10 of 20 runs of an 8 s outage). A database back for
        a moment between two faults does not end the trouble: the wait restarts from the last fault, and the
        margin still counts from the first (a review: the job ran twice in 3 of 3 runs when the wait was over
        in that moment)."""
        now = time.monotonic()
        if self._fault_seen:
            self._fault_seen = False
            grace = self._fault_grace()
            if grace > 0:
                if self._trouble_since is None:  # (noticed on another thread as the last trouble ended)
                    self._begin_trouble(now)
                if now >= self._calm_from:
                    self._log.info("back from a database fault: leases that ran out since it began are rescued once "
                                   "%.1f s pass without another, when the other loops' heartbeats have renewed what "
                                   "they hold", grace)  # fmt: skip
                self._calm_from = now + grace
            else:
                self._trouble_since = None
        since = self._trouble_since
        if since is None:
            return 0.0
        if now >= self._calm_from or now - self._noticed_at >= self._trouble_cap():
            self._trouble_since = None
            return 0.0
        return (now - since) + 2 * self._lease_seconds()

    def _rescued(self, ids: set[int]) -> None:
        """Rows this loop's rescue step has just taken back from expired leases (``ids``): a worker drops those it
        holds and has not started (see :meth:`sa_outbox._worker.WorkerBase._rescued`)."""

    def _extend_on(
        self, conn: Connection, pairs: Sequence[tuple[int, int]], **params: Any
    ) -> tuple[set[int], set[int]]:
        """Renew held leases: (ids renewed, ids whose cancellation was requested). A renewal refused for a row
        — a user's trigger raising, a row-level security check — fails the whole statement, and every lease the
        loop holds went unrenewed: another loop's rescue then took the healthy ones too and ran them a second
        time (a review, 2 of 2). The rows are then renewed one at a time: the refused ones run out (logged),
        the others go on. Refused for every row, the first error is raised."""
        try:
            renewed_all = _steps.extend(conn, self.spec, pairs, **params)
        except DBAPIError as exc:
            if is_connection_error(exc) or len(pairs) < 2:
                raise
            first = exc
        else:
            self._refused_renewals = set()
            return renewed_all
        renewed: set[int] = set()
        cancel: set[int] = set()
        refused: list[int] = []
        for pair in pairs:
            try:
                one, asked = _steps.extend(conn, self.spec, [pair], **params)
            except DBAPIError as exc:
                if is_connection_error(exc):
                    raise
                refused.append(pair[0])
                continue
            renewed |= one
            cancel |= asked
        if len(refused) == len(pairs):
            raise first
        if set(refused) != self._refused_renewals:  # (once per set of refused rows, not every beat)
            self._log.warning(
                "renewal refused for %s %s (%s); the other leases were renewed one by one", self.spec.kind,
                ", ".join(map(str, refused)), getattr(first, "orig", first),
                extra={"table": self.spec.table.name, "row_ids": refused},
            )  # fmt: skip
        self._refused_renewals = set(refused)
        return renewed, cancel

    def _statement_retry(self, window: float) -> dict[str, Any]:
        """tenacity keyword arguments for retrying one statement through connection faults for ``window``
        seconds (the sync ``Retrying`` and the async ``AsyncRetrying`` take the same)."""
        return dict(
            retry=retry_if_exception(lambda e: is_connection_error(e) and not is_permanent_connection_error(e)),
            wait=lambda state: STATEMENT_RETRY.delay(state.attempt_number),
            stop=stop_after_delay(window),
            reraise=True,
            before_sleep=lambda state: self._log.warning(
                "database error, retrying: %s", state.outcome.exception() if state.outcome else "?",
                extra={"attempt": state.attempt_number},
            ),
        )  # fmt: skip

    def _finalize_window(self) -> float:
        """How long a finalize is worth retrying: after that the fence would refuse it anyway."""
        raise NotImplementedError

    # -- results -> outcomes -> counters and log lines --------------------------------------------------

    def _stops_loop(self, error: BaseException | None) -> bool:
        """Whether a callable's ``error`` stops the loop once what finished is recorded: SystemExit and
        KeyboardInterrupt, and with ``stop_on_unclassified`` an exception none of the failure classes."""
        if error is None or isinstance(error, RetryableError | PermanentError | Defer):
            return False
        # (any other BaseException — a sync callable's own asyncio.CancelledError, say — is a failure like an
        # unclassified exception: it must not pass for a cancellation of the loop, or stop every loop)
        return isinstance(error, SystemExit | KeyboardInterrupt) or (
            isinstance(error, Exception) and self.stop_on_unclassified
        )

    def _outcome(
        self, *, id: int, lease_version: int, attempts: int, max_attempts: int, error: BaseException | None,
        label: str, may_give_up: bool = True,
    ) -> tuple[Outcome, BaseException | None]:  # fmt: skip
        """Classify one result; an unclassified exception is logged with its traceback and counted. Returns the
        outcome and, when the loop must stop on it, the exception (``stop_on_unclassified``, or a
        SystemExit/KeyboardInterrupt raised by the callable — what finished before it is still recorded).
        ``may_give_up=False``: ``give_up_after`` does not apply (a worker's deferral of a task it has no handler
        for yet: ``unknown_task_grace`` decides)."""
        fatal = error if self._stops_loop(error) else None
        if error is not None and not isinstance(error, RetryableError | PermanentError | Defer):
            if not isinstance(error, SystemExit | KeyboardInterrupt):
                self.stats.unclassified += 1
                self._log.error(
                    "%s raised an unclassified exception (treated as retryable)", label, exc_info=error,
                    extra={"table": self.spec.table.name, "row_id": id, "lease_version": lease_version},
                )  # fmt: skip
            else:
                self._log.error(
                    "%s raised %s: recording what finished, then leaving", label, type(error).__name__,
                    extra={"table": self.spec.table.name, "row_id": id, "lease_version": lease_version},
                )  # fmt: skip
        outcome = (
            _steps.unavailable(self.spec, id, lease_version, error)
            if isinstance(error, DestinationUnavailable)  # an outage: never this message's fault, never dead
            else _steps.decide(
                self.spec, id=id, lease_version=lease_version, attempts=attempts, max_attempts=max_attempts,
                error=error, backoff=self.backoff,
            )
        )  # fmt: skip
        age = self._ages.get(id)
        if (
            may_give_up
            and error is not None
            and outcome.status != self.spec.dead
            and self.give_up_after is not None
            and age is not None
            and age > self.give_up_after
        ):
            outcome = _steps.gave_up(self.spec, id, lease_version, error, age=age, limit=self.give_up_after)
        return outcome, fatal

    def _release(self, id: int, lease_version: int, reason: str) -> Outcome:
        return _steps.release(self.spec, id, lease_version, reason)

    def _report(self, outcomes: Sequence[Outcome], applied: set[int]) -> None:
        """Count and log each outcome (one line per state change); unapplied ones are lost leases. Their rows
        are no longer held either way (a row the same statement claimed again stays held, under its new lease)."""
        self._held.drop_leases((o.id, o.lease_version) for o in outcomes)
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
                self._requeued.put(o.delay, time.monotonic())
                self._log.info(
                    "%s %s -> %s, retry in %.2fs: %s", kind, o.id, o.status, o.delay, o.error, extra=extra
                )
            elif o.kind == "defer":
                self.stats.deferred += 1
                self._requeued.put(o.delay, time.monotonic())
                self._log.info("%s %s deferred %.2fs: %s", kind, o.id, o.delay, o.error, extra=extra)
            elif o.kind == "cancelled":
                self.stats.cancelled += 1
                self._log.info("%s %s cancelled: %s", kind, o.id, o.error, extra=extra)
            elif o.kind == "unavailable":
                self.stats.unavailable += 1
                self._log.info(
                    "%s %s released, destination unavailable: %s", kind, o.id, o.error, extra=extra
                )
            elif o.kind == "dead":
                self.stats.dead += 1
                self._log.error("%s %s -> %s: %s", kind, o.id, o.status, o.error, extra=extra)
            else:
                self.stats.released += 1
                self._requeued.put(o.delay, time.monotonic())
                said = o.error or ""  # (the library's reasons say "released: …" themselves)
                self._log.info("%s %s %s", kind, o.id, said if said.startswith("released") else f"released: {said}",
                               extra=extra)  # fmt: skip

    def _observe_handled(self, seconds: float, created_at: Any) -> None:
        """Publish/handler latency (successful or not) and end-to-end age, for the metrics exporter."""
        if self.observer is not None:
            self.observer("handle", seconds)
            self.observer("age", max(0.0, time.time() - created_at.timestamp()))

    # -- when the loop wakes up next -------------------------------------------------------------------------

    def _put_back_due(self) -> bool:
        """Whether a row this loop put back is due and no claim has looked since: not idle yet."""
        return self._requeued.due(time.monotonic())

    def _next_deadline(self, *, poll: bool) -> float:
        """Seconds the loop may wait: until outcomes must be written, the next rescue, or — when it would
        claim if work appeared (``poll``) — the next poll (NOTIFY usually comes first) or the moment a row it
        put back (retry, ``Defer``, release) becomes due."""
        now = time.monotonic()
        limits = [self._rescuer.next_due()]
        flush = self._done.next_due()
        if flush is not None:
            limits.append(flush)
        if poll:
            limits.append(now + self.poll_interval)
            requeued = self._requeued.next_due()
            if requeued is not None:
                limits.append(requeued)
        return max(0.0, min(limits) - now)


def one_statement(claim_params: Sequence[dict[str, Any]]) -> bool:
    """Whether a turn's claims (:meth:`LoopBase._claim_params`) are one statement — one call, no limited
    queue's transaction — which a loop can send ahead of the jobs in hand."""
    return len(claim_params) == 1 and "limit" not in claim_params[0]


def asked(params: dict[str, Any], left: int) -> int:
    """How many rows a sized claim call (:func:`sized_claim`) can take: ``left``, or fewer when its queues'
    rooms add up to less — a claim that took them all came back full, not short."""
    rooms = params.get("rooms")
    return left if rooms is None else min(left, sum(rooms))


def sized_claim(call: dict[str, Any], left: int) -> tuple[dict[str, Any], int]:
    """One claim call's keyword arguments and how many rows it may take: at most ``left``, and with shares at
    most its queue's room (``room``), each of its queues' picks at most its own (``rooms``)."""
    params = dict(call)
    room = params.pop("room", None)
    if room is not None:
        left = min(left, room)
    if "rooms" in params:
        params["rooms"] = [min(left, r) for r in params["rooms"]]
    return params, left


_L = TypeVar("_L", bound=LoopBase)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def one_run_at_a_time(method: Callable[Concatenate[_L, _P], _R]) -> Callable[Concatenate[_L, _P], _R]:
    """``run()``/``run_once()`` of a sync loop: a second call while one runs (another thread) is refused."""

    @functools.wraps(method)
    def guarded(self: _L, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        token = self._enter_run(method.__name__)
        try:
            return method(self, *args, **kwargs)
        finally:
            self._exit_run(token)

    return guarded


def one_async_run_at_a_time(
    method: Callable[Concatenate[_L, _P], Coroutine[Any, Any, _R]],
) -> Callable[Concatenate[_L, _P], Coroutine[Any, Any, _R]]:
    """The same for an async loop's ``run()``/``run_once()`` (another task, or another thread's event loop)."""

    @functools.wraps(method)
    async def guarded(self: _L, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        token = self._enter_run(method.__name__)
        try:
            return await method(self, *args, **kwargs)
        finally:
            self._exit_run(token)

    return guarded


class _HeldTask(asyncio.Task[_R]):
    """A task of the library's own holding work in flight — a claim, a batch's bookkeeping, the wait for a sync
    handler's thread, the loop's end, the heartbeat. Cancelled as any task while its event loop runs: by the
    library (a timeout, a claim's grace) or by a cancellation of ``run()`` passed on. But a runner's teardown —
    ``asyncio.run()`` returning with ``run()`` still going cancels every task left, with the loop stopped — is
    refused: the work goes on, and the runner waits for it, as it waits for ``run()`` finishing what it holds (a
    hostile review: a batch already published stayed ``processing`` until its lease ran out, then was published
    again; a sync handler's job was released while its thread still ran it — run twice at once). An ``async
    def`` handler or publisher is the application's code and runs in a plain task: it takes the teardown's
    cancellation like the client tasks it may be waiting on (held, it waited for them for good)."""

    def cancel(self, msg: Any | None = None) -> bool:
        if not self.get_loop().is_running():
            return False
        return super().cancel(msg)


def _loop_running() -> bool:
    """Whether this code may await: it runs in a running event loop, and not in a coroutine being closed — a
    task its closed event loop left pending, closed by a garbage collection (GeneratorExit), also while another
    event loop runs in this thread (a harness's next one: the loop test alone let that one await, and CI's
    model profile met "coroutine ignored GeneratorExit" from an AsyncWorker.run again)."""
    if isinstance(sys.exc_info()[1], GeneratorExit):
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def held_task(coro: Coroutine[Any, Any, _R]) -> asyncio.Task[_R]:
    """``coro`` as a :class:`_HeldTask` of the running loop."""
    return _HeldTask(coro, loop=asyncio.get_running_loop())


#: How long an ``async def`` handler or publisher cancelled at its timeout (a worker's ``handler_timeout``, a
#: dispatcher's batch budget) has to stop before it is abandoned (seconds), counted from when the loop saw it
#: overdue: its clean-up may await; one that swallows the cancellation would otherwise hold its slot, and the
#: loop's end, for good.
ABANDON_AFTER_CANCEL = 1.0


def run_to_end(main: Coroutine[Any, Any, None]) -> None:
    """``asyncio.run(main)`` for the async loops' ``serve()``, except at the end: the tasks still pending are
    cancelled as asyncio.run cancels them, and those that have not ended ``ABANDON_AFTER_CANCEL`` later are
    left, logged — asyncio.run waits for them for good. A handler or publisher that swallows every
    cancellation, already abandoned by the loop, held the process after "stopped": ``sa-outbox worker`` could
    be ended only by SIGKILL (a review), where the sync Worker, whose abandoned thread is a daemon, exits."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main)
    finally:
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                done, deaf = loop.run_until_complete(asyncio.wait(left, timeout=ABANDON_AFTER_CANCEL))
                for task in done:
                    if not task.cancelled() and task.exception() is not None:
                        log.error("a task failed as the event loop ended: %r", task.exception())
                if deaf:
                    log.warning(
                        "%d task(s) did not end within %.0f s of their cancellation as the event loop closed: "
                        "abandoned (an async handler or publisher that swallows cancellation?): %s", len(deaf),
                        ABANDON_AFTER_CANCEL, ", ".join(sorted(t.get_name() for t in deaf)),
                    )  # fmt: skip
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


#: How long a cancelled run waits for a claim statement in flight before cutting it off (then the server
#: cancels it and it commits nothing): a claim is quick unless it waits on a lock (a migration's, say).
CLAIM_GRACE = 2.0


async def through_cancellation(
    work: Awaitable[T], *, grace: float | None = None
) -> tuple[T, asyncio.CancelledError | None]:
    """Await ``work`` to its end even when the current task is cancelled meanwhile, once or again and again
    (anyio's cancel scopes deliver a cancellation at every await); its result and the first cancellation that
    arrived, if one did — the caller takes the result in, then raises that very exception (a cancel scope
    knows its own cancellation by it).

    For what must not be cut off by a cancelled ``run()``: a claim statement (autocommit: cut off after its
    commit, its rows would sit leased to a loop that never heard of them until the lease ran out, their
    attempt spent), a batch being published (its outcomes would be lost, delivered messages published again
    after the lease), a handler thread's group, and the loop's own end (releasing and writing what it holds).

    With ``grace``: once a cancellation arrived, ``work`` gets that long to finish, then is cancelled itself
    (a claim blocked on a lock is cancelled by the server and commits nothing). If ``work`` fails after a
    cancellation arrived, the cancellation is what propagates (a claim that failed meanwhile must not turn a
    cancelled run into one that retries a database fault forever)."""
    task = held_task(work) if asyncio.iscoroutine(work) else asyncio.ensure_future(work)
    cancelled: asyncio.CancelledError | None = None
    deadline: float | None = None
    while not task.done():
        try:
            await asyncio.wait(
                {task}, timeout=None if deadline is None else max(0.0, deadline - time.monotonic())
            )
        except asyncio.CancelledError as exc:
            cancelled = cancelled or exc
            if grace is not None and deadline is None:
                deadline = time.monotonic() + grace
            continue
        if not task.done():  # the grace ran out: cut it off, and wait until it has settled
            task.cancel()
            deadline = None
    if cancelled is not None and (task.cancelled() or task.exception() is not None):
        raise cancelled
    return task.result(), cancelled


def stray_cancellation(exc: asyncio.CancelledError) -> RuntimeError | None:
    """A ``CancelledError`` that a handler or publisher raised itself (it awaited something another task
    cancelled) while the current task is not being cancelled: the callable's error — unclassified, so retried
    with backoff and counted against its attempts — as a RuntimeError naming it. None when the current task
    is being cancelled: then the error is a real cancellation and must propagate."""
    task = asyncio.current_task()
    if task is None or task.cancelling():
        return None
    error = RuntimeError(f"raised CancelledError without being cancelled ({exc!r})")
    error.__cause__ = exc
    return error


def install_async_signals(stop: Callable[[int], None]) -> Callable[[], None] | None:
    """SIGTERM/SIGINT call ``stop(signum)`` from the running event loop (where the platform allows it). The returned
    ``restore`` puts back the handlers that were there before: ``loop.remove_signal_handler`` alone resets
    them to the defaults, which silently dropped a program's own SIGTERM handler after ``run()``."""
    loop = asyncio.get_running_loop()
    installed: dict[int, Any] = {}
    for s in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(s)
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(s, stop, int(s))
            installed[s] = previous

    def restore() -> None:
        for s, previous in installed.items():
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(s)
            if previous is not None:  # None: installed outside Python; nothing to put back
                with contextlib.suppress(ValueError, TypeError, OSError):
                    signal.signal(s, previous)

    return restore if installed else None
