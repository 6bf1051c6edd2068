"""The jobs worker: the jobs design's queue, on the same claim / lease / finalize engine as the outbox.

A worker keeps ``concurrency`` handlers busy. It claims only as many jobs as it has free slots, plus as many as
it expects to start within a tenth of a second (measured from the handlers it has run), so long jobs spread
over every worker instead of waiting behind one; each claim statement also writes the outcomes that finished
since the last one (one round trip). A job is *in hand* from its claim until its outcome is written —
waiting to start, running, or finished — and the heartbeat keeps the lease of every job in hand, so the
rescue step never reaps a job whose worker is alive.

``lease_version`` is the fencing token: a worker whose job was reaped and claimed again cannot mark it done or
failed (``status = 'running'`` alone would let it, since the job is running again — for someone else).

**Handlers.** ``concurrency=1`` runs handlers in the loop's own thread; more, or a ``handler_timeout``, run
them on threads of their own. Each job's ``handler_timeout`` counts from its own start; a handler still
running then is abandoned — its thread is never given another job and a fresh thread takes its place — and
the job is retried (attempt spent). Python cannot kill a thread: the abandoned call may still finish later,
outside any lease, so handlers must be idempotent. :class:`AsyncWorker` awaits ``async def`` handlers
(cancelled on timeout) and runs sync handlers on the same kind of threads.

**Stopping.** On :meth:`stop` (SIGTERM/SIGINT under ``run()``) running handlers finish and are recorded, jobs
that have not started are released (back to ``queued``, attempt refunded). A handler that raises
``SystemExit``/``KeyboardInterrupt`` spends its job's attempt; what else finished is recorded, then the
exception leaves the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, ClassVar, TypeVar, cast

from sqlalchemy import BigInteger, Connection, Engine, Table, create_engine, event, literal_column, select
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, ProgrammingError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from tenacity import AsyncRetrying, Retrying

from . import _steps, _tracing
from ._backoff import BEAT_ENDS_FAULT_WAIT_AFTER, JOBS_BACKOFF, Backoff
from ._base import (
    ABANDON_AFTER_CANCEL,
    CLAIM_GRACE,
    LoopBase,
    _loop_running,
    held_task,
    install_async_signals,
    is_async_callable,
    one_async_run_at_a_time,
    one_run_at_a_time,
    one_statement,
    run_to_end,
    stray_cancellation,
    through_cancellation,
)
from ._db import AsyncLoopConnection, LoopConnection, is_schema_error, with_options_of
from ._dbfaults import connection_error_cause, is_connection_error, is_permanent_connection_error
from ._durations import Duration, positive_int, to_seconds, to_timedelta
from ._limits import Limit
from ._messages import CancelToken, ClaimedJob
from ._payload import encode_payload
from ._schedules import check_schedules_model, fire_due_schedules
from ._sql import QueueSpec, queue_table
from ._steps import Outcome
from ._threads import CallThreads
from ._wakeup import AsyncWaker, Wake, Waker
from .errors import ConfigurationError, Defer, JobCancelled, PayloadError, PermanentError, RetryableError

__all__ = ["AsyncWorker", "Handler", "TaskRegistry", "Worker"]

#: Seconds before a worker looks again for a missing schedules or queue-pause table (a migration may add it).
MISSING_TABLE_RETRY = 60.0

log = logging.getLogger("sa_outbox.worker")

#: ``last_error`` of a job given back unstarted because its queue was paused after it was claimed.
PAUSED_RELEASE = "released: queue paused"
#: A job in hand starts only while the pauses were read less than this many seconds ago (the maintenance step
#: reads them every second); older, the loop reads them again first — see :meth:`WorkerBase._pauses_fresh`.
PAUSES_STALE_AFTER = 1.5
#: ``last_error`` of a job given back unstarted because its lease was not renewed for most of ``stale_after``.
UNCONFIRMED_RELEASE = "released: lease not renewed in time (not started)"

Handler = Callable[[ClaimedJob], Any]
H = TypeVar("H", bound=Handler)

#: A worker claims ahead of its free slots as many jobs as it expects to start within this many seconds.
PREFETCH_WINDOW = 0.1
#: An inline worker (concurrency 1) sends its next claim beside the jobs in hand only when they take at least
#: this long in all: a claim's round trip (a commit) is ~1-5 ms, the hand-off to the claim thread 0.14-0.35 ms
#: of CPU per claim, and the claim thread only gets the GIL to send its statement while a handler releases it
#: (I/O, sleep). A batch of pure-Python handlers shorter than this runs before the claim is even sent: the
#: thread then only costs (one worker, no-op jobs, batch 10 / 50: 7,350 / 17,570 jobs/s with it, 9,440 / 22,140
#: inline; 55 / 22 µs vs 33 / 15 µs of client CPU per job).
OVERLAP_MIN = 0.001
#: A claim's round trip assumed before one was measured.
TRIP_GUESS = 0.002
#: How often the heartbeat tries to renew the rows it guards (seconds): the guard keeps their jobs from being
#: rescued meanwhile, so this only bounds how soon after a row is free its lease is fresh again.
GUARD_POLL = 0.1
#: The heartbeat thread looks this often for a stop signal the main thread took while it runs a job inline,
#: and logs it: the main thread writes that line only after the job (an operator saw nothing for the length
#: of a long job and reached for kill -9 — a review).
NOTICE_POLL = 1.0
_WRONG_ROUTE = (
    "the direct server of this worker's engine (pgbouncer_engine's direct_url) resolves table %s to %s, the "
    "engine to %s (a search_path set by an event on the pooled engine does not reach it — use "
    "schema_translate_map or connect_args): the heartbeat and the lease guard go through the engine instead"
)
#: The guard connection's transaction is ended and begun again once it holds this many guards (rows long
#: renewed keep theirs until it ends), so that guards cannot pile up in the server's lock table.
GUARD_ROTATE = 256


class TaskRegistry(dict[str, Handler]):
    """Task name → handler, with a decorator form::

    tasks = TaskRegistry()

    @tasks.task("send_email")
    def send_email(job: ClaimedJob) -> None: ...
    """

    def task(self, name: str | None = None) -> Callable[[H], H]:
        def register(fn: H) -> H:
            key = name or getattr(fn, "__name__", None)
            if not key:
                raise ConfigurationError("a task needs a name")
            if key in self:
                raise ConfigurationError(f"task {key!r} is already registered")
            self[key] = fn
            return fn

        return register


class _NoHandlerYet(Defer):
    """The deferral of a job whose task this worker has no handler for, while it is younger than
    ``unknown_task_grace``: workers that know the task take it meanwhile, and ``give_up_after`` does not fail
    it (a hostile review: it failed such jobs before any worker with the handler could run them)."""


class _Pace:
    """How many jobs to claim ahead of the free slots: as many as the worker expects to start within
    ``PREFETCH_WINDOW``, from a moving average of its handlers' durations — none before one has finished; and,
    from a moving average of its claims' round trips, when an inline worker sends the next claim."""

    def __init__(self) -> None:
        self.average: float | None = None
        self.trip = TRIP_GUESS

    def observe(self, seconds: float) -> None:
        self.average = seconds if self.average is None else 0.8 * self.average + 0.2 * seconds

    def observe_trip(self, seconds: float) -> None:
        self.trip = 0.8 * self.trip + 0.2 * seconds

    def ahead(self, concurrency: int, cap: int) -> int:
        if self.average is None:
            return 0
        return min(cap, int(concurrency * PREFETCH_WINDOW / max(self.average, 1e-6)))

    def claim_beside(self, queued: int) -> str | None:
        """Whether and how an inline worker sends its next claim now, beside the job it is about to run with
        ``queued`` more in hand: once those ``queued`` will be done within about one claim's round trip (so the
        claim's jobs land as the last one ends). ``"thread"`` when the jobs left, this one included, take
        ``OVERLAP_MIN`` or more in all: the claim thread sends it while a handler waits (I/O, sleep), off the
        loop's path. ``"ahead"`` when they take less — a hand-off would cost more than it overlaps, and the
        claim thread would not get the GIL before they end: the loop's thread sends it itself and reads it
        after them. None: not now."""
        if self.average is None or queued * self.average > self.trip:
            return None
        return "thread" if (queued + 1) * self.average >= OVERLAP_MIN else "ahead"


class _SentAhead:
    """A claim the loop's thread sent ahead on its own connection, to be read once the jobs in hand are done:
    the part of a ``Future`` the loop uses. Its result may be read at any time (reading waits for the server),
    so it is always ``done()``; until it has been read, the connection is the claim's (``read`` is False).
    Read once, by whichever thread asks first: the loop's, or the heartbeat's when a job in hand runs long and
    the result has arrived (the claimed rows are then renewed from that beat on, as a claim thread's are when
    they land)."""

    __slots__ = ("_error", "_lock", "_reader", "_value", "read")

    def __init__(
        self,
        reader: Callable[[], tuple[set[int], list[Any]]] | None,
        error: BaseException | None = None,
    ) -> None:
        self._reader = reader
        self._error = error
        self._value: tuple[set[int], list[Any]] = (set(), [])
        self._lock = threading.Lock()
        self.read = reader is None

    def done(self) -> bool:
        return True

    def _read(self) -> None:
        with self._lock:
            self._read_locked()

    def _read_locked(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            try:
                self._value = reader()
            except BaseException as exc:
                self._error = exc
        self.read = True

    def read_if_ready(self, ready: Callable[[], bool]) -> None:
        """Read now if no one else is reading and ``ready()`` says the result has arrived: never waits, for the
        server or for the other reader (the heartbeat's call — a claim waiting on a lock must not hold back the
        renewal of the jobs in hand). ``ready`` runs under the lock, so only one thread touches the connection."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._reader is not None and ready():
                self._read_locked()
        finally:
            self._lock.release()

    def result(self) -> tuple[set[int], list[Any]]:
        self._read()
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self) -> BaseException | None:
        self._read()
        return self._error


@dataclass(slots=True)
class _Inflight:
    """A claim sent ahead — on the claim thread, or by the loop's thread itself (:class:`_SentAhead`): its
    future, the outcomes it writes, how many jobs it asked for."""

    future: Future[tuple[set[int], list[Any]]] | _SentAhead
    outcomes: list[Outcome]
    wanted: int

    def holds_connection(self) -> bool:
        """Whether the claim still uses the loop's connection (nothing else may use it meanwhile)."""
        future = self.future
        return not future.read if isinstance(future, _SentAhead) else not future.done()


@dataclass(slots=True)
class _Running:
    job: ClaimedJob
    started: float  # monotonic
    deadline: float | None


@dataclass(slots=True)
class _Ran:
    """What running one handler gave: its error (any BaseException, as a value) or the value it returned, how
    long it took, and for a handler run in its own transaction whether its completion was committed with it
    (``committed``) or its lease was lost and everything rolled back (``lost``)."""

    error: BaseException | None
    seconds: float
    value: Any = None
    committed: bool = False
    lost: bool = False


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Canceller:
    """A job's cancellation request, turned into a cancel of the task running its ``async def`` handler — the
    task that also runs the rest of :meth:`AsyncWorker._execute`, so ``fired`` tells that cancel apart from
    any other (one task per job, not a second one for the handler: a task costs its job two turns of the
    event loop)."""

    __slots__ = ("fired", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.fired = False

    def __call__(self) -> None:
        self.fired = True
        self.task.cancel()


class _WrongSyncEngine(Exception):
    """AsyncWorker's sync engine reaches another table than its own: the loop must stop."""

    def __init__(self, error: ConfigurationError) -> None:
        super().__init__(str(error))
        self.error = error


class _LeaseLost(Exception):
    """The fenced completion matched no row: roll the handler's transaction back."""


#: How long a job waits when the transaction for its handler could not get a connection (:class:`_NoSession`).
NO_SESSION_DELAY = 1.0


class _NoSession(Exception):
    """The transaction for a handler that takes a session could not get a connection, before the handler was
    called: a server or pooler at its connection limit (``too many clients``, PgBouncer's ``max_client_conn``),
    or one gone while the loop's own connection still works. Nothing ran, so no attempt is spent: the job is
    deferred (:attr:`defer`) — before, each claim spent one at once and a saturated pooler failed every
    transactional job in seconds while the loop, connected, saw no fault (a hostile review: 3 jobs of 3
    attempts ``failed`` in 6 s)."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.defer = Defer(
            NO_SESSION_DELAY,
            "not run: the transaction for its handler could not get a database connection "
            f"({connection_error_cause(exc)})",
        )


def _no_session(exc: Exception) -> bool:
    """Whether a session's failed checkout is a :class:`_NoSession`: a connection error that waiting may cure.
    One that cannot (authentication failed, no such database: the private sync engine of an AsyncWorker built
    without what the URL lacks) stays the handler's failure, so that it ends the job with its cause rather than
    deferring it for good."""
    return is_connection_error(exc) and not is_permanent_connection_error(exc)


def _session_can_connect(engine: Engine) -> None:
    """Before a handler that takes a session is called: a connection of the session's engine can be had (one is
    checked out of the pool and given back — no round trip), else :class:`_NoSession` (nothing ran). Not the
    session's own connection: procured now, it would ignore the ``execution_options`` a handler may give its
    first ``session.connection()`` (an isolation level), with a mere warning."""
    try:
        with engine.connect():
            pass
    except Exception as exc:
        if _no_session(exc):
            raise _NoSession(exc) from exc
        raise


async def _async_session_can_connect(engine: AsyncEngine) -> None:
    """:func:`_session_can_connect` for an ``AsyncEngine``."""
    try:
        async with engine.connect():
            pass
    except Exception as exc:
        if _no_session(exc):
            raise _NoSession(exc) from exc
        raise


def _close_on_checkin(dbapi_connection: Any, record: Any) -> None:
    """The ``checkin`` listener of a disposed engine's pool: what comes back is closed (nothing will use it)."""
    if dbapi_connection is not None:
        record.invalidate()


def takes_session(handler: Any) -> bool:
    """A handler that accepts a second positional parameter is called as ``handler(job, session)`` inside a
    transaction that also writes its fenced completion."""
    try:
        params = inspect.signature(handler).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def _awaitable_returned(job: ClaimedJob, result: Any) -> TypeError | None:
    if result is None:
        return None
    if inspect.isawaitable(result):  # e.g. a lambda around an async function: never marked done
        if inspect.iscoroutine(result):
            result.close()
        return TypeError(
            f"handler for task {job.task!r} returned an awaitable; async handlers run with AsyncWorker"
        )
    return None


def _invoke(handler: Handler, job: ClaimedJob, no_provider: bool | None = None) -> _Ran:
    """Call a sync handler in its ``process`` span; its error (any BaseException) as a value, and how long it
    took. ``no_provider``: see :func:`_tracing.process_inert`."""
    started = time.perf_counter()
    if _tracing.process_inert(job, no_provider):  # no span: ~3 µs less per job than an empty context manager
        value, error = _call_handler(handler, job)
    else:
        with _tracing.process_span(job) as span:
            value, error = _call_handler(handler, job)
            span.outcome(error)
    return _Ran(error, time.perf_counter() - started, value)


def _call_handler(handler: Handler, job: ClaimedJob) -> tuple[Any, BaseException | None]:
    try:
        value = handler(job)
    except BaseException as exc:
        return None, exc
    return value, _awaitable_returned(job, value)


def _encode_result(job: ClaimedJob, value: Any, max_bytes: int) -> str | None:
    """A handler's return value as JSON text to store (None stores nothing). A value that is not JSON (or too
    big) is not stored: the job still succeeded, so it is done — logged, never retried for it."""
    if value is None:
        return None
    try:
        return encode_payload(value, what=f"result of job {job.id} ({job.task})", max_bytes=max_bytes)
    except PayloadError as exc:
        log.warning("%s; the job is done, its result is not stored", exc, extra={"job_id": job.id})
        return None


def _invoke_in_transaction(
    engine: Engine, spec: QueueSpec, handler: Any, job: ClaimedJob, max_result_bytes: int, refund: int = 0
) -> _Ran:
    """Call ``handler(job, session)`` in a transaction that also writes the job's fenced completion: both
    commit together, or — the handler raised, or the fence matched no row because the lease was lost — both
    roll back. ``refund``: attempts the completion gives back (−1 counts the attempt of a claim whose attempt
    was given back when it was held back, :meth:`WorkerBase._refund_held_back_on`)."""
    started = time.perf_counter()
    try:
        _session_can_connect(engine)
        with _tracing.process_span(job) as span, Session(engine) as session, session.begin():
            value = handler(job, session)
            error = _awaitable_returned(job, value)
            if error is not None:
                raise error
            done = Outcome(
                job.id, job.lease_version, spec.done, refund=refund,
                result=_encode_result(job, value, max_result_bytes),
            )  # fmt: skip
            if job.id not in _steps.finalize(session.connection(), spec, [done]):
                span.outcome(_LeaseLost("lost lease: the job was reaped and re-claimed; rolled back"))
                raise _LeaseLost
    except _LeaseLost:
        return _Ran(None, time.perf_counter() - started, lost=True)
    except _NoSession as exc:
        return _Ran(exc.defer, time.perf_counter() - started)
    except BaseException as exc:
        return _Ran(exc, time.perf_counter() - started)
    return _Ran(None, time.perf_counter() - started, value, committed=True)


class WorkerBase(LoopBase):
    """Options, validation and decisions of :class:`Worker` and :class:`AsyncWorker` (no loop of its own).

    Options (durations take a ``timedelta`` or seconds): ``queues`` (claimed in the given order — strict
    priority — by one statement, default ``("default",)``); ``batch`` (most jobs per claim statement,
    default 10); ``stale_after`` (a running job whose ``locked_at`` is older is reaped, default 60 s); ``heartbeat`` (default ``stale_after / 4``; ``0``
    disables); ``concurrency`` (handlers at once, default 1, or the shares' sum); ``handler_timeout`` (default none; must be
    shorter than ``stale_after``); ``backoff`` (default ``min(300 s, 2**attempts s)``); ``poll_interval``,
    ``listen``, ``listen_url`` (wake-ups), ``stop_on_unclassified``, ``rescue_limit``, ``owner``;
    ``queues`` may map each queue to its share — ``{"mail": 4, "reports": 1}``: at most that many of its
    jobs in hand at once (the shares add up to ``concurrency`` unless it is given), and the queues take turns
    being claimed first. ``unique_running``: a job with a ``unique_key`` is claimed only while no job of its
    key runs and no older one waits (every worker of those queues must set it; not with ``limits``).
    ``schedules``: a :class:`~sa_outbox.ScheduleMixin` model whose due cron schedules this worker fires in its
    once-a-second maintenance (each slot exactly once, however many workers fire). ``limits`` maps a queue
    to a :class:`~sa_outbox.Limit` — fleet-wide
    concurrency (per queue or per ``concurrency_key``) and rate, enforced from the rows at claim time;
    ``unknown_task_grace`` (default 1 h): a job whose task this worker has no handler for — producers often
    deploy before workers — is deferred (attempt refunded, 30 s at a time, so workers that know the task take
    it meanwhile) until it is that old (database clock), then fails with a clear error.
    ``give_up_after`` (default: never): a job written longer ago than this (``created_at``, database clock)
    that fails again ends ``failed``, whatever the failure — a NoAnswer's or a Defer's refund included, which
    would otherwise bring it back forever.
    ``maintain_partitions``: for a partitioned table (docs/partitioning.md), run
    :func:`~sa_outbox.maintain_partitions` at start and then every this often, off the loop (default: never).
    """

    _kind = "jobs"
    _owner_prefix = "worker"
    _log = log
    #: Whether this flavour can await ``async def`` handlers.
    _awaits_handlers: ClassVar[bool] = False

    def __init__(
        self,
        engine: Any,
        model: type[Any],
        handlers: Mapping[str, Handler] | None = None,
        *,
        queues: Iterable[str] | Mapping[str, int] = ("default",),
        batch: int = 10,
        stale_after: Duration = 60.0,
        heartbeat: Duration | None = None,
        concurrency: int | None = None,
        backoff: Backoff | None = None,
        owner: str | None = None,
        poll_interval: Duration = 1.0,
        listen: bool = True,
        listen_url: str | URL | None = None,
        stop_on_unclassified: bool = False,
        rescue_limit: int = 1000,
        handler_timeout: Duration | None = None,
        unknown_task_grace: Duration = 3600.0,
        limits: Mapping[str, Limit] | None = None,
        unique_running: bool = False,
        schedules: type[Any] | None = None,
        maintain_partitions: Duration | None = None,
        give_up_after: Duration | None = None,
    ) -> None:
        super().__init__(
            engine, model, owner=owner, batch=batch, poll_interval=poll_interval, listen=listen,
            listen_url=listen_url, stop_on_unclassified=stop_on_unclassified, rescue_limit=rescue_limit,
            backoff=backoff or JOBS_BACKOFF, maintain_partitions=maintain_partitions,
            give_up_after=give_up_after,
        )  # fmt: skip
        if isinstance(queues, str):
            raise ConfigurationError("queues must be a collection of queue names, e.g. ('default',)")
        #: The mapping form's shares: at most this many of each queue's jobs in hand at once (fair queues).
        self.shares: dict[str, int] | None = None
        if isinstance(queues, Mapping):
            self.shares = {q: positive_int(n, f"the share of queue {q!r}") for q, n in queues.items()}
        self.queues = list(dict.fromkeys(queues))
        if not self.queues or not all(isinstance(q, str) and q for q in self.queues):
            raise ConfigurationError(f"queues must be non-empty queue names, got {self.queues!r}")
        self.limits: dict[str, Limit] = dict(limits or {})
        for name, limit in self.limits.items():
            if name not in self.queues:
                raise ConfigurationError(f"limits name queue {name!r}, which this worker does not serve")
            if not isinstance(limit, Limit):
                raise ConfigurationError(
                    f"the limit of queue {name!r} must be a sa_outbox.Limit, got {limit!r}"
                )
        self.unique_running = bool(unique_running)
        if self.unique_running and self.limits:
            raise ConfigurationError(
                f"unique_running cannot be combined with limits (queues {sorted(self.limits)!r}): a limited "
                "queue gets the same guarantee from Limit(1, per_key=True) with the unique key as the job's "
                "concurrency_key"
            )
        #: A ScheduleMixin model whose due schedules this worker fires in its once-a-second maintenance.
        self.schedules = schedules
        if schedules is not None:
            check_schedules_model(schedules)
            if self.spec.period is not None:
                raise ConfigurationError(
                    f"schedules cannot fire into {self.spec.table.fullname}: it is partitioned, and a schedule's "
                    "slots are unique keys, which a partitioned jobs table cannot enforce (docs/partitioning.md)"
                )
        self._turn_of = 0
        #: The job a sync inline loop is running now (in hand, but in neither the queue nor the running table).
        self._inline_job: ClaimedJob | None = None
        self.handlers: TaskRegistry = TaskRegistry()
        for name, fn in (handlers or {}).items():
            self._check_handler(name, fn)
            self.handlers[name] = fn
        self.stale_after: timedelta = to_timedelta(stale_after, name="stale_after", allow_zero=False)
        beat = self.stale_after / 4 if heartbeat is None else to_timedelta(heartbeat, name="heartbeat")
        if beat >= self.stale_after:
            raise ConfigurationError("heartbeat must be shorter than stale_after, or the job would be reaped")
        self.heartbeat: float | None = beat.total_seconds() or None
        stale, every = self.stale_after.total_seconds(), self.heartbeat or 0.0
        #: A job in hand starts only while its lease was confirmed (claimed or renewed) less than this many
        #: seconds ago: past it, beats have failed (the database out of reach, a frozen process) and another
        #: worker's rescue may have taken the row and run the job — see :meth:`_next_to_start`. Beats that
        #: succeed keep every lease younger than ``heartbeat`` (plus a round trip), well inside it.
        self._start_within = max(0.8 * stale, every + (stale - every) / 2)
        if concurrency is None:  # (the shares' sum; a concurrency of 1 given with shares is kept)
            concurrency = 1 if self.shares is None else sum(self.shares.values())
        self.concurrency = positive_int(concurrency, "concurrency")
        self.handler_timeout: float | None = (
            None
            if handler_timeout is None
            else to_seconds(handler_timeout, name="handler_timeout", allow_zero=False)
        )
        if self.handler_timeout is not None and self.handler_timeout >= self.stale_after.total_seconds():
            raise ConfigurationError("handler_timeout must be shorter than stale_after")
        self.unknown_task_grace = to_seconds(unknown_task_grace, name="unknown_task_grace")
        self._unknown_seen: set[str] = set()
        self._pace = _Pace()
        #: Claimed jobs that have not started yet.
        self._queue: deque[ClaimedJob] = deque()
        #: run()'s wait after a database fault, as a beat sees it (:meth:`_beat_result`): None (no such wait),
        #: "noting" (its first BEAT_ENDS_FAULT_WAIT_AFTER: a beat is noted) or "poking" (a beat ends it).
        self._fault_wait: str | None = None
        #: Whether a beat got through during the first part of the wait.
        self._beat_in_fault_wait = False
        #: The cancel flag of every job in hand (set when the heartbeat learns of a cancellation request).
        self._tokens: dict[int, CancelToken] = {}
        #: Jobs claimed again while a run of theirs goes on here (another worker's rescue took the row back), id ->
        #: the newer claim (:meth:`_accept`).
        self._parked: dict[int, ClaimedJob] = {}
        #: Ids whose claim in ``_parked`` does not follow on from this worker's own lease (:meth:`_continues`):
        #: another worker claimed the row in between — and ran it — or an operator reset its attempts. Such a
        #: claim never takes the run's result: it runs after that run.
        self._parked_apart: set[int] = set()
        #: Runs that ended while a claim was in flight, id -> (the job, its run's result): that claim may hold a
        #: newer lease of the job (committed, its rows not yet here), which the run's result is then decided
        #: with, as for a claim that waited for the run (:meth:`_landed_after_its_run`); recorded as they are
        #: when it lands without one.
        self._ended_meanwhile: dict[int, tuple[ClaimedJob, _Ran]] = {}
        #: Leases of claims :meth:`_accept` held back whose attempt is still to be given back
        #: (:meth:`_refund_held_back_on`).
        self._to_refund: list[tuple[int, int]] = []
        self._session_handlers: dict[Any, bool] = {}
        self._async_handlers: dict[Any, bool] = {}
        #: Queues paused in ``<jobs>_queues`` (read with the rescue step, at most once a second).
        self._paused: set[str] = set()
        #: Whether this run has read the pauses yet: its first claim waits for that. And when it last read them
        #: (monotonic, when the read was sent).
        self._pauses_read = False
        self._pauses_read_at = float("-inf")
        self._warned: dict[str, str] = {}  # maintenance step -> the last failure logged (_warn_once)
        self._missed: set[tuple[int, int]] = set()  # (id, version) reported lost by the last heartbeat
        #: Jobs whose row the heartbeat had to skip, id -> lease version: their lease guards are held on the
        #: guard connection until each row is free and renewed (:meth:`_guard_settle`, ``_sql``'s lease guard).
        self._guarding: dict[int, int] = {}
        self._guarding_lock = threading.Lock()
        #: Ids whose guard the guard connection's transaction holds.
        self._guard_taken: set[int] = set()
        #: (id, version) found no longer ours while guarded: not guarded again (the beats report them lost).
        self._unguardable: set[tuple[int, int]] = set()
        self._guard_logged: set[int] = set()
        self._pause_table: Table | None = queue_table(self.spec.table)
        self._absent: dict[str, float] = {}  # a table found missing → when to look for it again (monotonic)
        self._threads = CallThreads("sa_outbox-handler")
        #: A SystemExit/KeyboardInterrupt from a handler, or an unclassified error with stop_on_unclassified.
        self._fatal: BaseException | None = None

    def task(self, name: str | None = None) -> Callable[[H], H]:
        """Decorator registering a handler on this worker."""

        def register(fn: H) -> H:
            self._check_handler(str(name or getattr(fn, "__name__", "?")), fn)
            return self.handlers.task(name)(fn)

        return register

    def _check_handler(self, name: str, fn: Any) -> None:
        if not callable(fn):
            raise ConfigurationError(f"handler for task {name!r} is not callable: {fn!r}")
        if is_async_callable(fn) and not self._awaits_handlers:
            raise ConfigurationError(
                f"handler for task {name!r} is async: Worker would never await it; run it with AsyncWorker"
            )

    # -- decisions -------------------------------------------------------------------------------------

    def _claim_params(self) -> list[dict[str, Any]]:
        """The claims of a turn, over the queues that are not paused: one statement for each run of queues
        without a Limit (``queue``: one name or a list of them), one per limited queue; with the mapping form
        each queue's room (its share minus its jobs in hand). A list is claimed in its order (strict priority);
        with the mapping form the queues take turns being first, so a flood in one starves no other. After a
        claim that came back short, the runs are claimed in the levels form (``_sql._priority_levels``)."""
        queues = [q for q in self.queues if q not in self._paused]
        if self.shares is not None and len(queues) > 1:
            self._turn_of = (self._turn_of + 1) % len(queues)
            queues = queues[self._turn_of :] + queues[: self._turn_of]
        in_hand: dict[str, int] = {}
        if self.shares is not None:
            running = [r.job for r in self._running_jobs()]
            if self._inline_job is not None:  # (the one an inline loop runs: in hand, in neither list)
                running.append(self._inline_job)
            for job in list(self._queue) + running:
                in_hand[job.queue] = in_hand.get(job.queue, 0) + 1
        params: list[dict[str, Any]] = []
        run: list[str] = []  # consecutive queues without a Limit: claimed by one statement
        rooms: list[int] = []

        def end_run() -> None:
            if not run:
                return
            p: dict[str, Any] = {"queue": run[0] if len(run) == 1 else list(run)}
            if self.unique_running:
                p["unique_running"] = True
            if self._claimed_short:
                # The due jobs did not fill the last claim: the queues may hold jobs scheduled for later,
                # which the usual claim reads through to the end (_sql._priority_levels); read level by level
                # until a claim comes back full again.
                p["levels"] = True
            if self.shares is not None:
                p.update({"room": rooms[0]} if len(run) == 1 else {"rooms": list(rooms)})
            params.append(p)
            run.clear()
            rooms.clear()

        for q in queues:
            room = None if self.shares is None else self.shares[q] - in_hand.get(q, 0)
            if room is not None and room <= 0:
                continue
            if q in self.limits:
                end_run()
                params.append(
                    {"queue": q, "limit": self.limits[q], **({} if room is None else {"room": room})}
                )
            else:
                run.append(q)
                if room is not None:
                    rooms.append(room)
        end_run()
        return params

    def _running_jobs(self) -> list[_Running]:
        """The handlers running now (each flavour keeps its own table of them)."""
        return list(getattr(self, "_running", {}).values())

    def _in_hand_note(self) -> str:
        running = [r.job for r in self._running_jobs()]
        if self._inline_job is not None:
            running.append(self._inline_job)
        if not running:
            return ""
        oldest = min(running, key=lambda job: job.id)
        more = f" and {len(running) - 1} more" if len(running) > 1 else ""
        return f" (running: job {oldest.id} {oldest.task!r}{more})"

    def _lease_route(self, engine: Any, make: Callable[[URL, dict[str, Any]], Any]) -> Any:
        """Where the heartbeat and the lease guard connect: ``engine``, or — for an engine of
        :func:`~sa_outbox.pgbouncer_engine` made with ``direct_url`` — a small engine of their own on that server
        (``make(url, connect_args)``, kept in ``_lease_base``) with ``engine``'s execution options: a beat
        through the pooler waits for a free server connection like any client, and past ``stale_after`` other
        workers rescue this one's jobs (:func:`sa_outbox._pgbouncer.direct_server`). The route is checked once,
        before its first renewal (:meth:`_route_disagrees`)."""
        from ._pgbouncer import direct_server

        found = direct_server(engine)
        if found is None:
            return engine
        built = self._lease_base = make(*found)
        self._want_identity = True
        return with_options_of(built, engine)

    def _route_disagrees(self, theirs: tuple[str, int | None]) -> bool:
        """Whether the direct route resolves the table (``theirs``: database, oid) elsewhere than the loop's own
        connection — a ``search_path`` set by an event on the pooled engine does not reach it: then it is not
        used (the caller goes back to the engine), and that is logged. Once: the route is checked after this."""
        mine, self._table_identity = self._table_identity, None
        if theirs == mine:
            return False
        log.error(_WRONG_ROUTE, self.spec.table.name, theirs, mine)
        return True

    def _lease_seconds(self) -> float:
        return self.stale_after.total_seconds()

    def _rescue_params(self) -> dict[str, Any]:
        # (the jobs it holds: a running one whose renewals fail is not taken back and run a second time beside
        # itself; one in hand whose lease ran out is given back when its turn comes, see _next_to_start)
        return {"stale_after": self.stale_after, "limit": self.rescue_limit, "kept": self._held.pairs()}

    def _rescue_on(self, conn: Connection) -> None:
        """The once-a-second maintenance: rescue expired leases, forget starts older than each rate window, fire
        the due cron schedules, and learn which of our queues are paused."""
        super()._rescue_on(conn)
        for name, limit in self.limits.items():
            if limit.rate_window is not None:
                _steps.forget_starts(conn, self.spec, name, limit.rate_window)
        if self.schedules is not None and self._present("schedules"):
            try:
                fired = fire_due_schedules(conn, self.schedules, self.model, limit=100)
            except ProgrammingError as exc:
                # no schedules table (yet): looked for again every MISSING_TABLE_RETRY seconds
                if is_schema_error(exc):
                    self._missing("schedules", f"schedules table of {self.schedules.__name__} is missing "
                                  f"({getattr(exc, 'orig', exc)}): not firing schedules until it is created (run "
                                  "the migration; this worker looks again every minute)")  # fmt: skip
                else:  # e.g. permission denied: named, and tried again at the next step
                    self._warn_once("schedules", f"cannot fire the schedules of {self.schedules.__name__}: "
                                    f"{getattr(exc, 'orig', exc)} (see docs/production.md for the grants)")  # fmt: skip
            else:
                if fired:
                    log.info("fired %d scheduled job(s)", fired, extra={"jobs": fired})
        self._read_pauses(conn)

    def _read_pauses(self, conn: Connection) -> None:
        """Learn which of our queues are paused; give back the unstarted jobs in hand of the paused ones. A run
        does this before its first claim, then with every maintenance step."""
        self._check_columns_on(conn)
        table = self._pause_table
        read_at = time.monotonic()
        if table is None or not self._present("queues"):
            self._pauses_read, self._pauses_read_at = True, read_at
            return
        try:
            paused = set(
                conn.execute(
                    select(table.c.queue).where(
                        table.c.paused_at.is_not(None), table.c.queue.in_(self.queues)
                    )
                ).scalars()
            )
        except ProgrammingError as exc:
            # no <jobs>_queues table (yet): looked for again every MISSING_TABLE_RETRY seconds
            if is_schema_error(exc):
                self._missing("queues", f"queue table {table.fullname} is missing ({getattr(exc, 'orig', exc)}): "
                              "pausing queues is unavailable until it is created (run the migration; this worker "
                              "looks again every minute)")  # fmt: skip
            else:  # e.g. permission denied: named, and tried again at the next step
                self._warn_once("queues", f"cannot read which queues are paused from {table.fullname}: "
                                f"{getattr(exc, 'orig', exc)} (see docs/production.md for the grants)")  # fmt: skip
            # claiming goes on with the pauses last read (none on a fresh worker)
            self._pauses_read, self._pauses_read_at = True, read_at
            return
        self._pauses_read, self._pauses_read_at = True, read_at
        for name in paused - self._paused:
            log.info("queue %r paused: not claiming it", name, extra={"queue": name})
        for name in self._paused - paused:
            log.info("queue %r resumed", name, extra={"queue": name})
        self._paused = paused
        if paused:  # claimed before the pause was seen, not started: given back rather than started late
            self._release_unstarted(PAUSED_RELEASE, paused)

    def _missing(self, what: str, message: str) -> None:
        """``what``'s table is missing: warned once, looked for again after MISSING_TABLE_RETRY seconds — a
        migration run while this worker runs turns the feature on without a restart (a review: a worker started
        before the migration never fired schedules, and would never have read a pause)."""
        self._warn_once(what, message)
        self._absent[what] = time.monotonic() + MISSING_TABLE_RETRY

    def _present(self, what: str) -> bool:
        """Whether to use ``what``'s table at this step: not known missing, or due to be looked for again."""
        retry_at = self._absent.get(what)
        if retry_at is None:
            return True
        if time.monotonic() < retry_at:
            return False
        del self._absent[what]
        return True

    def _warn_once(self, what: str, message: str) -> None:
        """A WARNING the first time ``what`` fails with ``message`` (the maintenance step runs every second)."""
        if self._warned.get(what) != message:
            self._warned[what] = message
            log.warning("%s", message, extra={"step": what})

    def _finalize_window(self) -> float:
        return max(self.stale_after.total_seconds(), 1.0)

    def _want(self, running: int, *, inline: bool) -> int:
        """How many jobs to claim now: the free slots plus what the worker expects to start soon; nothing
        while enough claimed jobs still wait (in the loop's own thread: until they are all done)."""
        ahead = self._pace.ahead(self.concurrency, self.batch)
        refill_at = 0 if inline else ahead // 2
        if len(self._queue) > refill_at:
            return 0
        free = max(0, self.concurrency - running)
        return max(0, min(self.batch, free + ahead - len(self._queue)))

    def _in_hand_now(self, rows: Sequence[Any], finalized: Sequence[tuple[int, int]], sent: float) -> None:
        self._held.drop_leases(finalized)
        self._held.hold(((row[0], row[1]) for row in rows), sent)

    def _accept(self, rows: Sequence[Any]) -> int:
        """Claimed rows join the jobs in hand. A job claimed again while a run of it goes on here (its lease ran
        out unrenewed — the database out of reach — and another worker's rescue put it back) is not started
        beside that run: it waits for it (:meth:`_run_ended`), sharing its cancel flag. A job whose run ended
        while this claim was in flight is decided the same way (:meth:`_landed_after_its_run`)."""
        jobs = []
        running = self._running_jobs()  # (a loop running one job at a time claims only between jobs)
        in_run = {r.job.id: r.job for r in running} if running else None
        for row in rows:
            if self._ended_meanwhile and row[0] in self._ended_meanwhile:
                self._landed_after_its_run(row)
                continue
            if in_run and row[0] in in_run:
                older = self._parked.get(row[0])
                newer = self._park(row, in_run[row[0]] if older is None else older)
                if older is not None:  # its lease was taken back too: nothing will be written on it
                    self._done.given_back((older.id, older.lease_version), forget=True)
                self._to_refund.append((newer.id, newer.lease_version))
                log.warning(
                    "job %s (%s) was claimed again (lease %s) while its run on lease %s goes on here: not started "
                    "beside it", newer.id, newer.task, newer.lease_version, in_run[row[0]].lease_version,
                    extra={"table": self.spec.table.name, "row_id": newer.id, "lease_version": newer.lease_version},
                )  # fmt: skip
                continue
            token = self._tokens[row[0]] = CancelToken()
            self._ages[row[0]] = row[-1]
            jobs.append(ClaimedJob.from_row(row, token, self._loads))
        # (held already, from when the claim was sent: every claim path holds its rows as they land — and a row
        # the loop's own rescue has taken back since is not held again here)
        self._queue.extend(jobs)
        self._record_ended_meanwhile()
        return len(jobs)

    def _continues(self, base: ClaimedJob, newer: ClaimedJob) -> bool:
        """Whether ``newer`` is the very next claim of the row after ``base``, a lease of this worker's: no claim
        in between (each moves ``lease_version`` on by one) and the attempts counted on from ``base``'s (its
        own attempt less one given back). Only then may it take the result of the run on ``base``'s lease: a
        review had another worker's rescue take the row, that worker claim and run it (a failure), then this
        worker's claim take it again — the run's result written on the newest lease gave that other run's
        attempt back too, and a job of three attempts ran four times; and an operator's ``retry_jobs`` between
        the two claims (attempts back to 0) was used up by the run that began before it, never run."""
        lease = (base.id, base.lease_version)
        counted = base.attempts - (1 if self._done.gave_back(lease) else 0)
        # a refund whose answer was lost may not have been applied: then the attempt is still counted (a review:
        # the run's success thrown away as a lost lease, and the job run again)
        either = (counted + 1, base.attempts + 1) if self._done.in_doubt(lease) else (counted + 1,)
        return newer.lease_version == base.lease_version + 1 and newer.attempts in either

    def _park(self, row: Any, base: ClaimedJob) -> ClaimedJob:
        """Hold the claimed ``row`` as a newer claim of ``base``'s job that waits for the run on ``base``'s lease
        (in ``_parked``, sharing the job's cancel flag), marked apart when it may not take that run's result
        (:meth:`_continues`); the one place both ways a claim meets its job's run (:meth:`_accept`,
        :meth:`_landed_after_its_run`) park it."""
        self._ages[row[0]] = row[-1]
        newer = ClaimedJob.from_row(row, self._tokens.get(row[0]) or CancelToken(), self._loads)
        if row[0] in self._parked_apart or not self._continues(base, newer):
            self._parked_apart.add(row[0])
        self._parked[row[0]] = newer
        return newer

    def _landed_after_its_run(self, row: Any) -> None:
        """A claimed row of a job whose run ended here while this claim was in flight (:meth:`_finish`): another
        worker's rescue put the row back during the run and this claim took it again, committed before the run
        ended, its rows reaching the loop after. Written on the old lease, the run's outcome was refused as a
        lost lease and the row then ran a second time with its attempt counted (clean-clone CI, stop 58:
        "retries exhausted (2/2)" after one run that failed). The claim is put in ``_parked`` as one that waited
        for the run, and the run's result decided at once by :meth:`_run_ended` — the same rule, on the newer
        claim's row (its ``max_attempts`` included): taken by the claim, or a lost lease and the claim runs
        next. Its attempt needs no refund statement: the outcome gives it back."""
        job, ran = self._ended_meanwhile.pop(row[0])
        self._park(row, job)
        self._record_run(job, ran)

    def _record_ended_meanwhile(self) -> None:
        """The claim in flight has landed (or failed): the runs that ended meanwhile without a newer claim of
        their job in it are recorded as they are."""
        if self._ended_meanwhile:
            ended, self._ended_meanwhile = self._ended_meanwhile, {}
            for job, ran in ended.values():
                self._record_run(job, ran)

    def _refund_held_back_on(self, conn: Connection) -> None:
        """Give back at once the attempt of each claim :meth:`_accept` held back that still waits: such a claim
        never runs as such (the run in progress's result is written on it, or it runs after that run). A
        worker whose renewals keep failing claims the job it runs again after each rescue; counted, those
        claims used up the job's attempts, and a rescue failed it "after max attempts (worker crash?)" while its
        one run succeeded (a review: 3 of 3; a kill -9 meanwhile, the same after one run of a job of two
        attempts). The outcome written on that lease later gives one attempt fewer back (``Completer``)."""
        waiting = {
            i: p
            for i, v in self._to_refund
            if (p := self._parked.get(i)) is not None and p.lease_version == v
        }
        if waiting:
            claims = [(p.id, p.lease_version, p.attempts) for p in waiting.values()]
            try:
                refunded = _steps.refund(conn, self.spec, claims)
            except DBAPIError as exc:
                if is_connection_error(exc):
                    # In doubt: it may have committed with its answer lost. Counted as given back — an
                    # outcome written on the lease before it is sent again (with the next claim; it then
                    # changes nothing if it had) gives no attempt back twice: at worst the attempt stays
                    # counted, as before this statement existed, never one run past max_attempts (a review:
                    # a job of two attempts ran three times when the outcome gave it back again).
                    for p in waiting.values():
                        self._done.given_back((p.id, p.lease_version), in_doubt=True)
                    raise
                # Refused (a user's trigger, a row-level security check): the attempt stays counted until the
                # run ends, as before there was this statement — never a reason to end the loop (a review: the
                # worker exited).
                self._log.warning(
                    "could not give back the attempt of the claim of %s held back (%s): it is given back when "
                    "the run it waits for ends", ", ".join(f"job {i}" for i in waiting), getattr(exc, "orig", exc),
                    extra={"table": self.spec.table.name},
                )  # fmt: skip
                refunded = set()
            for i in refunded:
                self._done.given_back((i, waiting[i].lease_version))
        self._to_refund.clear()

    def _counted_again(self, job: ClaimedJob) -> int:
        """The refund of a completion a handler's transaction writes: −1 when the job's claim had its attempt
        given back as it was held back (it runs now, after the run it waited for: its attempt counts)."""
        return -1 if self._done.gave_back((job.id, job.lease_version)) else 0

    def _in_transaction(self, handler: Any) -> bool:
        known = self._session_handlers.get(handler)
        if known is None:
            known = self._session_handlers[handler] = takes_session(handler)
        return known

    def _is_async(self, handler: Any) -> bool:
        known = self._async_handlers.get(handler)
        if known is None:
            known = self._async_handlers[handler] = is_async_callable(handler)
        return known

    def _max_result_bytes(self) -> int:
        return int(getattr(self.model, "sa_outbox_max_payload_bytes", 1024 * 1024))

    def _report(self, outcomes: Sequence[Outcome], applied: set[int]) -> None:
        super()._report(outcomes, applied)
        for o in outcomes:
            if o.id not in applied and self._held.version(o.id) not in (None, o.lease_version):
                continue  # a lost lease of a job in hand again under a newer one: its flag and age are that one's
            self._tokens.pop(o.id, None)
            self._ages.pop(o.id, None)

    def _handler_for(self, job: ClaimedJob) -> Handler | PermanentError | Defer:
        """The job's handler; for a task this worker does not know, a deferral while the job is younger than
        ``unknown_task_grace`` (a rolling deploy: producers first, workers later), then a permanent failure."""
        handler = self.handlers.get(job.task)
        if handler is not None:
            return handler
        known = ", ".join(sorted(self.handlers)) or "none"
        age = self._ages.get(job.id, float("inf"))
        if age < self.unknown_task_grace:
            if job.task not in self._unknown_seen:
                self._unknown_seen.add(job.task)
                log.warning(
                    "no handler for task %r here (known: %s): deferring its jobs for up to %gs after they were "
                    "written (a deploy in progress?), then failing them", job.task, known, self.unknown_task_grace,
                    extra={"task": job.task},
                )  # fmt: skip
            wait = min(30.0, max(1.0, self.unknown_task_grace - age))
            return _NoHandlerYet(
                wait, f"no handler for task {job.task!r} on this worker yet (known: {known})"
            )
        return PermanentError(
            f"no handler registered for task {job.task!r} (known: {known}); it waited unknown_task_grace "
            f"({self.unknown_task_grace:g}s)"
        )

    def _timed_out(self) -> RetryableError:
        return RetryableError(f"handler exceeded handler_timeout ({self.handler_timeout:g}s)")

    def _run_ended(self, job: ClaimedJob, ran: _Ran | None) -> tuple[ClaimedJob, bool, int]:
        """A run started here ended (``ran``: its result; None: it was cancelled). Returns the job its outcome is
        written for, whether that outcome is to be written at all, and how many attempts it gives back. Without
        a newer claim of it: ``job``, written, none. With one that waited for this run (:meth:`_accept`): the
        newer claim takes this run's result when that result is still the job's — the run wrote nothing of its
        own (a handler in a transaction commits its work with its completion, fenced by the old lease: refused,
        rolled back), the job was not changed meanwhile (an operator's update; compared as the handler saw
        it) and no other claim came between (:meth:`_continues`) — decided on the attempts of the run that
        happened, the attempts the newer claims counted given back (they never ran). Else this run's outcome
        is a lost lease, never written (the newer claim holds the row), and the newer claim runs now, after
        it — or is given back if the loop is ending."""
        newer = self._parked.pop(job.id, None) if self._parked else None
        if newer is None:
            return job, True, 0
        apart = job.id in self._parked_apart
        self._parked_apart.discard(job.id)
        if (
            ran is not None
            and not apart
            and not (ran.committed or ran.lost)
            and (newer.task, newer.payload, newer.headers) == (job.task, job.payload, job.headers)
        ):
            log.info(
                "job %s (%s): the result of its run on lease %s is written on lease %s", job.id, job.task,
                job.lease_version, newer.lease_version,
                extra={"table": self.spec.table.name, "row_id": job.id, "lease_version": newer.lease_version},
            )  # fmt: skip
            return replace(newer, attempts=job.attempts), True, max(0, newer.attempts - job.attempts)
        self._queue.appendleft(newer)  # (given back with the jobs in hand if the loop is ending)
        return job, False, 0

    def _release_after_runs(self) -> None:
        """The loop ends with every run over: jobs in hand that are still to start are given back — a newer claim
        a run ended by putting back among them (:meth:`_run_ended`), or one still waiting for a run that ended
        by a path that did not report it."""
        self._release_unstarted()
        for newer in self._parked.values():
            self._done.add([self._not_started(newer, "released: worker stopping")])
        self._parked.clear()
        self._parked_apart.clear()

    def _ended_unfinished(self, job: ClaimedJob, reason: str) -> None:
        """A job whose run was cancelled (not by a cancellation request, which is a result) is given back."""
        _, write, _ = self._run_ended(job, None)
        if write:
            self._done.add([self._not_started(job, reason)])

    def _refunded(self, refund: int, outcomes: Iterable[Outcome]) -> None:
        """Outcomes written with ``refund`` more attempts given back (claims that never ran)."""
        self._done.add([replace(o, refund=o.refund + refund) for o in outcomes])

    def _superseded(self, outcomes: Iterable[Outcome]) -> None:
        """Outcomes of a run whose lease a newer claim of the job in hand replaced: lost, not written."""
        self._report(list(outcomes), set())

    def _finish(self, job: ClaimedJob, ran: _Ran) -> None:
        """Record a job's result: timing, the outcome to write, and whether the loop must stop on it. While a
        claim is in flight that may hold a newer lease of the job, the result waits for it to land
        (:meth:`_landed_after_its_run`; nothing is written meanwhile anyway: an outcome goes with the next
        statement, sent after that claim lands) — unless the run's transaction wrote its own completion, or its
        error stops the loop, which must be known at once."""
        self._pace.observe(ran.seconds)
        self._observe_handled(ran.seconds, job.created_at)
        if (
            self._claim_in_flight()
            and job.id not in self._parked
            and not (ran.committed or ran.lost)
            and not self._stops_loop(ran.error)
        ):
            self._ended_meanwhile[job.id] = (job, ran)
            return
        self._record_run(job, ran)

    def _record_run(self, job: ClaimedJob, ran: _Ran) -> None:
        """The outcome of a run's result, for the job or for a newer claim of it that takes it
        (:meth:`_run_ended`), and whether the loop must stop on it."""
        job, write, refund = self._run_ended(job, ran)
        record: Callable[[Iterable[Outcome]], None] = self._done.add if write else self._superseded
        if refund:
            record = functools.partial(self._refunded, refund)
        if ran.error is None and not (ran.committed or ran.lost):  # done (what decide() says, without asking)
            result = None if ran.value is None else _encode_result(job, ran.value, self._max_result_bytes())
            record((_steps.done_outcome(job.id, job.lease_version, self.spec.done, result),))
            return
        if ran.committed or ran.lost:  # a transactional handler: its completion is written (or rolled back)
            self._done.given_back((job.id, job.lease_version), forget=True)
            self._report(
                [Outcome(job.id, job.lease_version, self.spec.done)], {job.id} if ran.committed else set()
            )
            return
        error = ran.error
        if error is not None and job.cancel_requested and isinstance(error, Exception):
            record([_steps.cancelled(self.spec, job.id, job.lease_version, f"handler stopped ({error!r})")])
            return
        outcome, fatal = self._outcome(
            id=job.id, lease_version=job.lease_version, attempts=job.attempts, max_attempts=job.max_attempts,
            error=error, label=f"job {job.id} ({job.task})", may_give_up=not isinstance(error, _NoHandlerYet),
        )  # fmt: skip
        if outcome.kind == "done" and ran.value is not None:
            outcome = replace(outcome, result=_encode_result(job, ran.value, self._max_result_bytes()))
        record([outcome])
        if fatal is not None and self._fatal is None:
            self._fatal = fatal  # no new job starts; what is in hand is recorded, then it is raised

    def _not_started(self, job: ClaimedJob, reason: str) -> Outcome:
        """The outcome of a job that will not run here: cancelled if that was asked, else released."""
        if job.cancel_requested:
            return _steps.cancelled(self.spec, job.id, job.lease_version, "requested before it started")
        return self._release(job.id, job.lease_version, reason)

    def _release_unstarted(
        self, reason: str = "released: worker stopping", queues: set[str] | None = None
    ) -> None:
        """Give back the claimed jobs not started — all of them, or those of ``queues``."""
        given = [j for j in self._queue if queues is None or j.queue in queues]
        if not given:
            return
        kept = [] if queues is None else [j for j in self._queue if j.queue not in queues]
        self._queue.clear()
        self._queue.extend(kept)
        self._done.add([self._not_started(j, reason) for j in given])

    def _rescued(self, ids: set[int]) -> None:
        """Rows this worker's own rescue step has just taken back: their leases expired while nothing renewed
        them (the database out of reach longer than ``stale_after``). No longer held, so a job among them that
        has not started never starts on the old lease (a review: started anyway, then claimed again and run a
        second time); :meth:`_next_to_start` drops it, without an outcome — the rescue wrote its own."""
        self._held.drop(ids)

    def _pauses_fresh(self) -> bool:
        """Whether what the worker knows of the pauses is recent enough to start a job on: read, and less than
        ``PAUSES_STALE_AFTER`` ago. Older — a claim that waited on a lock or a queueing pooler, a turn held up,
        an outage — they are marked unread, and the loop's next turn reads them before anything more starts
        (a review: a threaded worker whose claim waited 8 s started jobs of a queue paused meanwhile)."""
        if self._pauses_read and time.monotonic() - self._pauses_read_at > PAUSES_STALE_AFTER:
            self._pauses_read = False
        return self._pauses_read

    def _lease_fresh(self, job: ClaimedJob) -> bool:
        """Whether ``job`` may start on its lease: still held, and confirmed within ``_start_within``."""
        confirmed = self._held.confirmed(job.id, job.lease_version)
        return confirmed is not None and time.monotonic() - confirmed <= self._start_within

    def _next_to_start(self) -> ClaimedJob | None:
        """The next claimed job to run; jobs cancelled while they waited are recorded and skipped, and jobs of
        a queue paused since they were claimed are given back (every way a job starts passes here). None while
        the pauses are to be read again — a maintenance step failed, so what the worker knows of them may be
        older than a second (a long inline job before it): the loop's next turn reads them first.

        A job is started only on a lease the worker knows is alive: one its own rescue took back is dropped,
        and one whose last claim or renewal was sent longer than ``_start_within`` ago (its beats failed: the
        database out of reach, a frozen process) is given back with a fenced release — if another worker's
        rescue took it meanwhile the release changes nothing, and the job is not run a second time here."""
        while self._queue and self._may_start() and self._pauses_fresh():
            job = self._queue.popleft()
            confirmed = self._held.confirmed(job.id, job.lease_version)
            if confirmed is None:  # see _rescued
                log.warning(
                    "job %s (%s) was taken back by the rescue before it started (its lease expired unrenewed): "
                    "not started", job.id, job.task,
                    extra={"table": self.spec.table.name, "row_id": job.id, "lease_version": job.lease_version},
                )  # fmt: skip
            elif time.monotonic() - confirmed > self._start_within:
                log.warning(
                    "job %s (%s): its lease was last renewed %.1f s ago (stale_after %s s), so another worker may "
                    "have rescued and run it: given back, not started", job.id, job.task,
                    time.monotonic() - confirmed, self.stale_after.total_seconds(),
                    extra={"table": self.spec.table.name, "row_id": job.id, "lease_version": job.lease_version},
                )  # fmt: skip
                self._done.add([self._not_started(job, UNCONFIRMED_RELEASE)])
            elif job.cancel_requested:
                self._done.add([self._not_started(job, "")])
            elif job.queue in self._paused:
                # landed after the pause was read (a claim in flight), or waited behind a running job
                self._done.add([self._not_started(job, PAUSED_RELEASE)])
            else:
                return job
        return None

    def _db_fault(self) -> None:
        """A turn of run() or a maintenance step met a database fault (the outage is ridden out with backoff):
        what the worker knows of the pauses may be as old as the outage, so no job in hand starts and no claim
        is sent until the next turn has read them again — a queue paused meanwhile is neither claimed nor started with the pause
        unseen (a review: a threaded worker started jobs of a queue paused during an outage, 1.6–17 s after;
        its failures were the claim thread's, so nothing marked the pauses unread). Each failed turn then
        meets the outage at that read, and its backoff grows. Its rescue waits too (:meth:`_fault_grace`)."""
        self._pauses_read = False
        super()._db_fault()

    def _fault_grace(self) -> float:
        """After a database fault the rescue waits 1.5 heartbeats (without a heartbeat, ``stale_after / 4``
        and a half): the live workers' beats, which keep their schedule through an outage, renew every lease
        they hold — their finished jobs' among them, whose outcomes wait to be written — before this worker's
        rescue may take one."""
        return 1.5 * (self.heartbeat or self.stale_after.total_seconds() / 4)

    def _maintenance_failed(self, exc: Exception) -> None:
        """A maintenance step run between two inline jobs failed: the jobs in hand wait for the loop's next
        turn, which reads the pauses before it starts one (and handles a database that is down); the step
        itself runs again when it is next due."""
        self.stats.db_errors += 1
        log.warning("maintenance between jobs failed: %s", exc, extra={"error": str(exc)})

    def _may_start(self) -> bool:
        return not self._stopped() and self._fatal is None

    def _settled_by_its_run(self, job: ClaimedJob, ran: _Ran) -> _Ran:
        """A run in a transaction that wrote the job's completion (``committed``), or was refused it (``lost``):
        the lease is over from that moment, not from when the loop takes the result in — which it does when next
        free, and a statement of its own may wait meanwhile (a pooler's queue, a lock, a slow server). Called
        where the run ends: the handler's thread (Worker), the job's task (AsyncWorker). Held
        until then, the heartbeat found the row done, not renewable, and warned that job N "is no longer ours
        (reaped and re-claimed?)" for a job this worker had just finished (a test: the rescue step held 3 s)."""
        if ran.committed or ran.lost:
            self._held.drop_leases([(job.id, job.lease_version)])
        return ran

    def _beat_pairs(self) -> list[tuple[int, int]]:
        return self._held.pairs()

    def _fault_wait_steps(self, delay: float) -> tuple[float, float]:
        """run()'s wait of ``delay`` after a database fault, in two parts: the first (at most
        ``BEAT_ENDS_FAULT_WAIT_AFTER``) ends only at a stop or a handler done (never at a notification:
        :meth:`sa_outbox._wakeup.Waker.wait_out`); the second also at a heartbeat that gets through — and none
        is waited if one got through in the first (a beat noted in an earlier wait is forgotten here).

        A beat that gets through shows the database answers, and the jobs the worker holds — finished with
        their outcomes unwritten, or claimed and not started — are renewed by it for nobody else until the
        loop's next turn. The wait grows to 30 s while faults go on: after a flapping connection (workers cut
        off every 20 ms for 2.9 s at a time) a worker held a claimed job for 38 s, asleep in an 18 s wait, its
        heartbeat renewing the job all along. The backoff is not reset, and a fault that keeps coming (a
        refused statement: a review's trigger refused every finalize) is tried again no more often than once
        the first part has passed — not at the pace of a short heartbeat (before: every 0.05 s)."""
        self._beat_in_fault_wait = False
        first = min(delay, BEAT_ENDS_FAULT_WAIT_AFTER)
        return first, delay - first

    def _beat_ends_fault_wait(self) -> str:
        """What the log of run()'s wait after a fault says may end it sooner: a heartbeat, if one will beat."""
        if self.heartbeat is None or not self._held.pairs():
            return ""
        return f", or once a heartbeat gets through (after {BEAT_ENDS_FAULT_WAIT_AFTER:g} s at the earliest)"

    def _beat_result(
        self, pairs: Sequence[tuple[int, int]], renewed: tuple[set[int], set[int]], sent: float
    ) -> None:
        """A beat sent at ``sent`` renewed the leases of ``renewed[0]`` among ``pairs``; a beat that got through
        during run()'s wait after a database fault ends that wait (:meth:`_fault_wait_steps`)."""
        wait = self._fault_wait
        if wait is not None:
            self._beat_in_fault_wait = True
            if wait == "poking":
                self._poke()
        ids, cancel = renewed
        self._held.confirm(((job_id, version) for job_id, version in pairs if job_id in ids), sent)
        took, stale = time.monotonic() - sent, self.stale_after.total_seconds()
        if took > stale / 2:  # (what decides: the leases stay alive only while beats get through in time)
            log.warning(
                "heartbeat: renewing %d lease(s) took %.1f s (stale_after %g s): its statement waited — a pooler "
                "with no free server connection, a lock, an overloaded server; a beat later than stale_after lets "
                "another worker rescue and run these jobs again", len(pairs), took, stale,
                extra={"seconds": round(took, 3), "stale_after": stale},
            )  # fmt: skip
        still_held = dict(self._held.pairs())
        with self._guarding_lock:
            guarded = set(self._guarding.items())
            self._unguardable = {p for p in self._unguardable if still_held.get(p[0]) == p[1]}
            unguardable = set(self._unguardable)
        # A job the beat could not renew is not lost yet: its finalize may have committed before the beat's
        # UPDATE and released it from _held only after this check (a memory run of 1M jobs logged ten false
        # alarms when that was called lost), or another transaction holds its row (the beat skips locked
        # rows). A guard looks at each: it renews a held row once it is free, and finds out whether the row is
        # still ours. A job the guard found not ours and that the next beat still holds is reported, once.
        refused = self._refused_renewals
        missed = {(job_id, version) for job_id, version in pairs
                  if job_id not in ids and job_id not in refused and still_held.get(job_id) == version} - guarded  # fmt: skip
        if missed - unguardable:
            with self._guarding_lock:
                self._guarding.update(missed - unguardable)
            self._wake_heartbeat()
        for job_id, version in sorted(missed & unguardable - self._missed):
            log.warning(
                "heartbeat: job %s version %s is no longer ours (reaped and re-claimed?)", job_id, version,
                extra={"job_id": job_id, "lease_version": version},
            )  # fmt: skip
        self._missed = missed & unguardable
        self._cancel_requested(cancel)

    def _cancel_requested(self, ids: Iterable[int]) -> None:
        """Set the cancel flags of these jobs in hand (the heartbeat learnt their cancellation was requested)."""
        told = False
        for job_id in ids:
            token = self._tokens.get(job_id)
            if token is not None and not token.is_set():
                log.info("job %s: cancellation requested", job_id, extra={"job_id": job_id})
                token.set()
            told = True
        if told:
            self._poke()

    def _guard_wanted(self) -> tuple[list[tuple[int, int]], list[int]]:
        """The pairs to guard now, and the ids among them whose guard is not held yet."""
        with self._guarding_lock:
            want = sorted(self._guarding.items())
        return want, [job_id for job_id, _ in want if job_id not in self._guard_taken]

    def _guard_settle(
        self,
        want: Sequence[tuple[int, int]],
        renewed: tuple[set[int], set[int]],
        ours: set[tuple[int, int]],
        sent: float,
    ) -> bool:
        """One guard round's result (its renewal sent at ``sent``): rows renewed are done; rows no longer ours
        are done and reported by the beats; the rest stay guarded. Returns whether the guard connection should
        let go of its guards now."""
        ids, cancel = renewed
        self._held.confirm(((job_id, version) for job_id, version in want if job_id in ids), sent)
        gone = {p for p in want if p[0] not in ids and p not in ours}
        with self._guarding_lock:
            for job_id, version in want:
                if (job_id in ids or (job_id, version) in gone) and self._guarding.get(job_id) == version:
                    del self._guarding[job_id]
            self._unguardable |= gone
            wanted = len(self._guarding)
            # guards of rows done (renewed, or no longer ours) stay taken until the transaction ends
            stale = len(self._guard_taken - self._guarding.keys())
        for job_id, version in sorted(p for p in ours if p[0] not in ids and p[0] in self._guard_taken):
            if job_id not in self._guard_logged:
                self._guard_logged.add(job_id)
                log.info(
                    "heartbeat: job %s's row is held by another transaction; its lease is guarded until it is free",
                    job_id, extra={"job_id": job_id, "lease_version": version},
                )  # fmt: skip
        self._guard_logged &= set(self._guarding)
        self._cancel_requested(cancel)
        return bool(self._guard_taken) and (wanted == 0 or stale > GUARD_ROTATE)

    def _guard_room(self, connected: bool) -> bool:
        """Whether this round may take guards: the guard connection is open, or the pool has a connection for
        it now. A full pool is not waited for (the wait, ``pool_timeout``, would hold up every lease's beat):
        the round renews what it can without guards, warned once, and tries again next round."""
        if connected:
            self._warned.pop("lease guard", None)
            return True
        self._warn_once(
            "lease guard",
            "lease guard skipped: the engine's pool has no free connection for the guard connection (the "
            "worker needs concurrency + 3: its loop, heartbeat and guard, and one per handler that connects); "
            "a job whose row another transaction holds past stale_after may be rescued once it is free",
        )
        return False

    def _wake_heartbeat(self) -> None:
        """Rows to guard: the heartbeat now wakes every GUARD_POLL (the flavour's hook)."""

    def _drop_guards(self) -> None:
        """The loop ends: its guards go with the guard connection, dropped next."""
        with self._guarding_lock:
            self._guarding.clear()
        self._guard_taken = set()
        self._guard_logged = set()

    def _guard_failed(self, exc: Exception) -> None:
        self._guard_taken = set()
        log.warning("lease guard failed (taken again at once): %s", exc, extra={"error": str(exc)})

    def _raise_fatal(self) -> None:
        fatal, self._fatal = self._fatal, None
        if fatal is not None:
            raise fatal


class _HeartbeatThread:
    """Renews the leases of the jobs in hand every ``interval`` seconds, on its own connection — and, while it
    guards rows another transaction holds, tries to renew those every ``GUARD_POLL`` seconds."""

    def __init__(
        self,
        beat: Callable[[], None],
        connect: Callable[[], None],
        interval: float,
        guarding: Callable[[], bool],
        guard: Callable[[], None],
        notice: Callable[[], None],
    ) -> None:
        self.interval = interval
        self.beat = beat
        self.connect = connect
        self.guarding = guarding
        self.guard = guard
        self.notice = notice
        self.stopped = threading.Event()
        self.woken = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self, *, connect: bool) -> None:
        if self.thread is None:
            self.stopped.clear()
            self.thread = threading.Thread(
                target=self._run, args=(connect,), name="sa_outbox-heartbeat", daemon=True
            )
            self.thread.start()

    def _run(self, connect: bool) -> None:
        # run(): connect before the first interval ends, not inside the first beat — a new backend (a fork,
        # auth) takes tens of milliseconds, hundreds on a loaded box, and that beat renews fresh claims.
        # run_once() does not: a cron-style caller would pay a connection per call even when nothing is claimed.
        if connect:
            try:
                self.connect()
            except Exception as exc:  # the first beat connects again
                log.warning("heartbeat could not connect yet: %s", exc, extra={"error": str(exc)})
        next_beat = time.monotonic() + self.interval
        while not self.stopped.is_set():
            wait = min(next_beat - time.monotonic(), NOTICE_POLL)
            self.woken.wait(max(0.0, min(wait, GUARD_POLL) if self.guarding() else wait))
            self.woken.clear()
            if self.stopped.is_set():
                break
            try:
                self.notice()
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.interval
                    self.beat()
                elif self.guarding():
                    self.guard()
            except Exception as exc:  # a missed beat is retried next interval; never kill the handlers
                log.warning("heartbeat failed: %s", exc, extra={"error": str(exc)})

    def stop(self) -> None:
        self.stopped.set()
        self.woken.set()
        thread, self.thread = self.thread, None
        if thread is not None:
            thread.join()


class Worker(WorkerBase):
    """Runs jobs from a :class:`~sa_outbox.JobMixin` table with the handlers registered for their task; run as
    many side by side as you like (processes, hosts). See the module docs for what it guarantees and
    :class:`WorkerBase` for the options."""

    _engine_types = (Engine,)

    def __init__(
        self,
        engine: Engine,
        model: type[Any],
        handlers: Mapping[str, Handler] | None = None,
        *,
        queues: Iterable[str] | Mapping[str, int] = ("default",),
        batch: int = 10,
        stale_after: Duration = 60.0,
        heartbeat: Duration | None = None,
        concurrency: int | None = None,
        backoff: Backoff | None = None,
        owner: str | None = None,
        poll_interval: Duration = 1.0,
        listen: bool = True,
        listen_url: str | URL | None = None,
        stop_on_unclassified: bool = False,
        rescue_limit: int = 1000,
        handler_timeout: Duration | None = None,
        unknown_task_grace: Duration = 3600.0,
        limits: Mapping[str, Limit] | None = None,
        unique_running: bool = False,
        schedules: type[Any] | None = None,
        maintain_partitions: Duration | None = None,
        give_up_after: Duration | None = None,
    ) -> None:
        super().__init__(
            engine, model, handlers, queues=queues, batch=batch, stale_after=stale_after, heartbeat=heartbeat,
            concurrency=concurrency, backoff=backoff, owner=owner, poll_interval=poll_interval, listen=listen,
            listen_url=listen_url, stop_on_unclassified=stop_on_unclassified, rescue_limit=rescue_limit,
            handler_timeout=handler_timeout, unknown_task_grace=unknown_task_grace, limits=limits,
            unique_running=unique_running, schedules=schedules, maintain_partitions=maintain_partitions,
            give_up_after=give_up_after,
        )  # fmt: skip
        self.engine: Engine = engine
        #: concurrency 1 without a timeout: handlers run in the loop's own thread (no hand-off per job).
        self._inline = self.concurrency == 1 and self.handler_timeout is None
        self._db = LoopConnection(engine, self.spec.table.name)
        self._lease_base: Engine | None = None
        lease = self._direct_lease_engine(engine)
        self._beat_db = LoopConnection(lease, self.spec.table.name)
        self._waker = Waker(self.listen_url, self.channels)
        self._running: dict[Future[Any], _Running] = {}
        self._finished: queue.SimpleQueue[Future[Any]] = queue.SimpleQueue()
        self._beat = (
            None
            if self.heartbeat is None
            else _HeartbeatThread(
                self.beat_once,
                self._connect_beat,
                self.heartbeat,
                lambda: bool(self._guarding),
                self.guard_once,
                self._notice_stop,
            )
        )
        #: The heartbeat's connection serves one caller at a time: the heartbeat thread, or whoever calls
        #: beat_once() meanwhile.
        self._beat_lock = threading.Lock()
        #: With handler threads, run() sends its claims from this thread: the loop keeps starting claimed
        #: jobs in slots that free up during the claim's round trip (~1–3 ms, a commit) instead of leaving them
        #: idle. One claim at a time; the loop's connection is used by nobody else meanwhile.
        self._claimer = CallThreads("sa-outbox-claim")
        self._inflight: _Inflight | None = None
        self._prefetch = False  # run(): inline handlers overlap the next claim when jobs are short
        #: Whether the loop's connection can send a claim ahead itself (learnt at the first try of a run).
        self._sends_ahead = True
        #: Holds the lease guards (one transaction at a time; only the heartbeat's thread, under _beat_lock).
        self._guard_db = LoopConnection(lease, self.spec.table.name)

    def _direct_lease_engine(self, engine: Engine) -> Engine:
        """Where the heartbeat and the lease guard connect (:meth:`WorkerBase._lease_route`)."""
        return cast(Engine, self._lease_route(engine, lambda url, connect_args: create_engine(
            url.set(drivername="postgresql+psycopg"), pool_size=2, max_overflow=2, connect_args=connect_args
        )))  # fmt: skip

    def _check_lease_route(self) -> None:
        """Before the first renewal on the direct route: it must reach the very table the loop claims from (a
        ``search_path`` set by an event on the pooled engine does not reach it) — else the beats and guards go
        through the engine after all, and that is logged. Under ``_beat_lock``."""
        if self._lease_base is None or self._table_identity is None:
            return
        theirs = self._beat_db.run(lambda c: _steps.table_identity(c, self.spec))
        if self._route_disagrees(theirs):
            self._beat_db.drop()
            self._guard_db.drop()
            self._beat_db = LoopConnection(self.engine, self.spec.table.name)
            self._guard_db = LoopConnection(self.engine, self.spec.table.name)

    def _claim_in_flight(self) -> bool:
        return self._inflight is not None

    def _poke(self) -> None:
        self._waker.poke()

    def _notice_stop(self) -> None:
        """The heartbeat thread's look for a signal the main thread took (see :data:`NOTICE_POLL`)."""
        if self._stop_signals:
            self._stopped()

    def _wait_out_fault(self, delay: float) -> None:
        """run()'s wait after a database fault, in the two parts of :meth:`_fault_wait_steps`."""
        first, rest = self._fault_wait_steps(delay)
        self._fault_wait = "noting"
        try:
            if self._wait_for_a_reason(first) is None and rest > 0 and not self._beat_in_fault_wait:
                self._fault_wait = "poking"
                if not self._beat_in_fault_wait:  # (one that noted a beat after the test above: no wait)
                    self._wait_for_a_reason(rest)
        finally:
            self._fault_wait = None

    def _wait_for_a_reason(self, timeout: float) -> Wake:
        """``wait_out(timeout)``, ended early only by a poke that brings a reason: a stop, a handler done, a
        claim in flight that landed, a beat that got through. Any other is stale — the landing of a claim the
        loop had already read, its poke still in the pipe — and ended every wait after a failed landing at
        once: the claim was retried at the pace of its landings, whatever the backoff said (62 times in 3 s
        against a backoff at 20 s)."""
        deadline = time.monotonic() + timeout
        while True:
            woke = self._waker.wait_out(max(0.0, deadline - time.monotonic()))
            landed = self._inflight is not None and self._inflight.future.done()
            if (
                woke is None
                or self._stopped()
                or landed
                or not self._finished.empty()
                or self._beat_in_fault_wait
            ):
                return woke

    # -- public ----------------------------------------------------------------------------------------

    @one_run_at_a_time
    def run_once(self) -> int:
        """One rescue step plus one claimed batch (up to ``batch`` jobs), handled and finalized; returns how
        many jobs it claimed. With concurrency 1 a batch that runs longer than a second also runs the step
        between two jobs (a pause then gives back the jobs not started). Raises what a handler's
        SystemExit/KeyboardInterrupt (or, with ``stop_on_unclassified``, an unclassified error) raised, after
        recording every outcome."""
        self._begin()
        try:
            self._rescue(force=True)
            claimed = self._claim(self.batch) if self._may_start() else 0  # a stopped loop claims nothing
            self._handle_all()
            self._flush()
            return claimed
        finally:
            self._end()
            self._raise_fatal()

    @one_run_at_a_time
    def run(
        self,
        *,
        install_signal_handlers: bool = True,
        max_batches: int | None = None,
        until_idle: bool = False,
        startup_timeout: Duration | None = None,
    ) -> None:
        """Loop until :meth:`stop`, SIGTERM or SIGINT (or, with ``until_idle``, until nothing is left to claim
        or run; with ``max_batches``, after that many claims). Expired leases are rescued at most once a
        second. Database connection faults are logged and retried with capped exponential backoff; the loop
        never spins hot on an empty queue or a dead server. ``startup_timeout``: a database never reached
        within this long after start raises :class:`~sa_outbox.ConfigurationError` naming the last error."""
        restore = self._install_signals() if install_signal_handlers else None
        batches = 0
        self._begin(long_run=True)
        policy = self._start_run(startup_timeout, drain=until_idle)
        try:
            while not self._stopped() and self._fatal is None:
                # no claim ahead of the last batch max_batches allows
                self._prefetch = max_batches is None or batches + 1 < max_batches
                try:
                    claimed, wanted = self._turn()
                    self._turn_went_through(policy)
                except Exception as exc:
                    delay = policy.failed(exc, self._beat_ends_fault_wait())
                    self.stats.db_errors += 1
                    self._db_fault()
                    self._wait_out_fault(delay)
                    continue
                if wanted:
                    batches += 1
                    if max_batches is not None and batches >= max_batches:
                        break
                idle = not claimed and not self._queue and not self._running
                if until_idle and idle and wanted and not len(self._done) and not self._put_back_due():
                    break
                self._wait(claimed, wanted)
        finally:
            self._prefetch = False
            try:
                self._end()
            finally:
                if restore:
                    restore()
                self._lifecycle("stopped")
        self._raise_fatal()

    def _read_landed_ahead(self) -> None:
        """Read a claim sent ahead on the loop's connection once its result has arrived — from the heartbeat or
        between two inline jobs, whichever asks first — instead of after the jobs in hand, however long one of
        them runs: its rows are held (renewed) from then on, its error is kept for :meth:`_landed`, and the
        connection is free again. Never waits: a claim still at the server (on a lock) is left to be read later."""
        inflight = self._inflight
        if inflight is not None and isinstance(inflight.future, _SentAhead):
            inflight.future.read_if_ready(self._db.result_ready)

    def beat_once(self) -> None:
        """Renew the leases of the jobs in hand now (the heartbeat thread calls this every ``heartbeat``)."""
        self._read_landed_ahead()  # (so a claim's rows that landed behind a long job are renewed from now on)
        pairs = self._beat_pairs()
        if pairs:
            with self._beat_lock:
                self._check_lease_route()
                sent = time.monotonic()
                try:
                    renewed = self._beat_db.run(lambda c: self._extend_on(c, pairs))
                except Exception as exc:
                    # (an outage only the beat met: the loop ran a long job; a statement refused — a user's
                    # trigger, say — is no outage: nobody else was cut off)
                    if is_connection_error(exc):
                        self._fault_noticed()
                    raise
                self._contact(sent)
            self._beat_result(pairs, renewed, sent)
        if self._guarding:
            self.guard_once()

    def _wake_heartbeat(self) -> None:
        if self._beat is not None:
            self._beat.woken.set()

    def guard_once(self) -> None:
        """One round of the lease guards: take the guards of rows the beats had to skip, try to renew the
        guarded rows, let go of the guards once none is needed (the heartbeat calls it every ``GUARD_POLL``
        while it guards rows). Never waits for a row lock."""
        frozen_after = self.stale_after.total_seconds()
        with self._beat_lock:
            want, new = self._guard_wanted()
            try:
                guarding = self._guard_room(self._guard_db.can_run_now())
                if new and guarding:
                    self._guard_taken |= self._guard_db.run(
                        lambda c: _steps.guard(c, self.spec, new, frozen_after=frozen_after)
                    )
                sent = time.monotonic()
                renewed = self._beat_db.run(lambda c: self._extend_on(c, want)) if want else (set(), set())
                rest = [p for p in want if p[0] not in renewed[0]]
                # (read on the guard connection: a round that guards rows also keeps its transaction from being
                # idle for longer than the idle-in-transaction timeout of a frozen worker)
                on = self._guard_db if guarding else self._beat_db
                ours = on.run(lambda c: _steps.leased(c, self.spec, rest)) if rest else set()
                if self._guard_settle(want, renewed, ours, sent):
                    self._guard_db.run(_steps.unguard)
                    self._guard_taken = set()
                    _, again = self._guard_wanted()  # rows still held: guarded again in a new transaction
                    if again:
                        self._guard_taken |= self._guard_db.run(
                            lambda c: _steps.guard(c, self.spec, again, frozen_after=frozen_after)
                        )
            except Exception as exc:
                self._guard_db.drop()
                self._guard_failed(exc)

    def _connect_beat(self) -> None:
        with self._beat_lock:
            self._beat_db.connect()

    def serve(self, *, install_signal_handlers: bool = True, startup_timeout: Duration | None = None) -> None:
        """Run until stopped, then close: the blocking entry point of a process (``sa-outbox dispatch|worker``
        calls it for every flavour). SIGTERM/SIGINT stop it gracefully when ``install_signal_handlers``."""
        try:
            self.run(install_signal_handlers=install_signal_handlers, startup_timeout=startup_timeout)
        finally:
            self.close()

    def close(self) -> None:
        """Release the loop's connections and threads (run()/run_once() reopen what they need)."""
        self._waker.close()
        self._db.drop()
        with self._beat_lock:
            self._beat_db.drop()
            self._guard_db.drop()
            if self._lease_base is not None:
                self._lease_base.dispose()
        self._threads.close()
        self._claimer.close()

    # -- one turn --------------------------------------------------------------------------------------

    def _turn(self) -> tuple[int, int]:
        """Collect finished handlers, claim (writing their outcomes) or write outcomes that are due, rescue
        when due, start jobs. Returns (jobs claimed, jobs asked for) — for a claim sent on the claim thread,
        in the turn where it lands ((0, 0) before)."""
        self._collect()
        # A fresh run learns which queues are paused before it claims any, and so does a run whose maintenance
        # step failed — once a claim sent ahead on the loop's connection has been read (_next_to_start holds
        # the jobs in hand meanwhile).
        if not self._pauses_read and not (self._inflight is not None and self._inflight.holds_connection()):
            self._db.run(self._read_pauses)
        if self._inflight is not None:
            if not self._inflight.future.done():
                if not self._inline:
                    self._start_jobs()
                return 0, 0
            claimed, wanted = self._landed()
        else:
            wanted = self._want(len(self._running), inline=self._inline) if self._may_start() else 0
            if wanted and not self._inline:
                self._send_claim(wanted)
                self._start_jobs()
                return 0, 0
            claimed = self._claim(wanted) if wanted else 0
        if not wanted and self._done.due(time.monotonic()):
            self._flush()
        if self._inline:
            self._rescue()
            self._run_queued_inline()
        else:
            self._start_jobs()  # first: the once-a-second maintenance must not delay what was just claimed
            self._rescue()
        return claimed, wanted

    def _wait(self, claimed: int, wanted: int) -> None:
        if claimed:
            return  # more may be waiting: claim again at once (writing these outcomes on the way)
        if self._queue and not self._pauses_read and self._inflight is None:
            return  # jobs in hand wait for the pauses, which the next turn reads (a failure there backs off)
        if self._inflight is not None:  # its landing pokes the waker; the loop's connection is its meanwhile
            if self._inflight.future.done():
                return
            timeout = self._next_deadline(poll=False)
        else:
            idle = not self._queue and not self._running
            if idle and len(self._done):
                if self._may_start():
                    return  # written by the next turn's claim, which also takes what they unblocked
                self._flush()
            timeout = self._next_deadline(poll=not self._queue and len(self._running) < self.concurrency)
        deadlines = [r.deadline for r in self._running.values() if r.deadline is not None]
        if deadlines:
            timeout = min(timeout, max(0.0, min(deadlines) - time.monotonic()))
        if self._waker.wait(timeout) == "notify":
            self.stats.wakeups += 1

    def _claim(self, want: int) -> int:
        outcomes = self._done.take()
        try:
            applied, rows = self._db.run(lambda c: self._claim_on(c, want, outcomes))
        except BaseException:
            self._done.add(outcomes)  # written with the next statement (the fence makes that safe)
            raise
        self._report(outcomes, applied)
        return self._accepted(rows)

    def _accepted(self, rows: Sequence[Any]) -> int:
        """:meth:`_accept`, then the attempts of the claims it held back given back (the claim is read: the
        loop's connection is free)."""
        claimed = self._accept(rows)
        if self._to_refund:
            self._db.run(self._refund_held_back_on)
        return claimed

    def _send_claim(self, want: int, *, on_thread: bool = True) -> None:
        """Send a claim (with the outcomes due) on the claim thread, whose result :meth:`_landed` takes; or, not
        ``on_thread``, from this thread on the loop's own connection, read by :meth:`_landed` after the inline
        jobs run meanwhile — when the connection cannot, nothing is sent (the loop claims after them)."""
        params = self._claim_params()  # here: it reads the jobs in hand, which this thread changes
        if not on_thread and not one_statement(params):
            return  # not one statement now (a limited queue's transaction; no room left): after the jobs in hand
        outcomes = self._done.take()
        sent = time.monotonic()
        if not on_thread:
            try:
                reader = self._db.run(lambda c: self._send_claim_on(c, want, outcomes, params))
            except Exception as exc:  # raised where the claim lands; its outcomes go with the next statement
                self._inflight = _Inflight(_SentAhead(None, exc), outcomes, want)
                return
            except BaseException:
                self._done.add(outcomes)
                raise
            if reader is not None:
                self._inflight = _Inflight(
                    _SentAhead(lambda: self._read_ahead(reader, outcomes, sent)), outcomes, want
                )
                return
            self._sends_ahead = False  # this connection cannot (a pooler without prepared statements, …)
            self._done.add(outcomes)
            return
        future = self._claimer.submit(self._db.run, lambda c: self._claim_on(c, want, outcomes, params))
        self._inflight = _Inflight(future, outcomes, want)

        def landed(f: Future[tuple[set[int], list[Any]]]) -> None:  # in the claim thread
            self._pace.observe_trip(time.monotonic() - sent)
            if f.exception() is None:
                # The heartbeat renews the claimed rows, and no longer the finished ones, from now on, not
                # when the loop's thread takes the result: an inline loop may first run jobs in hand for
                # longer than stale_after (its own rescue would then take the rows it holds).
                _applied, rows = f.result()
                self._held.drop_leases((o.id, o.lease_version) for o in outcomes)
                self._held.hold(((row[0], row[1]) for row in rows), sent)
            self._waker.poke()

        future.add_done_callback(landed)

    def _read_ahead(
        self, reader: Callable[[], tuple[set[int], list[Any]]], outcomes: list[Outcome], sent: float
    ) -> tuple[set[int], list[Any]]:
        """Read a claim sent ahead, on the loop's connection (a fault drops it, as any step's does)."""
        ready = self._db.result_ready()
        with self._db.use():
            applied, rows = reader()
        elapsed = time.monotonic() - sent
        if not ready or elapsed < self._pace.trip:  # (ready before it was read: its trip took at most that)
            self._pace.observe_trip(elapsed)
        self._held.drop_leases((o.id, o.lease_version) for o in outcomes)
        self._held.hold(((row[0], row[1]) for row in rows), sent)
        return applied, rows

    def _landed(self) -> tuple[int, int]:
        """The finished claim's rows joined to the jobs in hand, its outcomes reported: (claimed, wanted).
        If it failed, its outcomes go back to be written with the next statement, and its error is raised."""
        inflight, self._inflight = self._inflight, None
        assert inflight is not None
        try:
            applied, rows = inflight.future.result()
        except BaseException:
            self._done.add(inflight.outcomes)
            self._record_ended_meanwhile()
            raise
        self._report(inflight.outcomes, applied)
        return self._accepted(rows), inflight.wanted

    def _flush(self) -> None:
        outcomes = self._done.take()
        if not outcomes:
            return
        applied: set[int] = set()
        try:
            for attempt in Retrying(**self._statement_retry(self._finalize_window())):
                with attempt:
                    applied = self._db.run(lambda c: self._finalize_on(c, outcomes))
        except BaseException:
            self._done.add(outcomes)
            raise
        self._report(outcomes, applied)

    def _rescue(self, *, force: bool = False) -> None:
        now = time.monotonic()
        self._partition_step(now)
        if force or self._rescuer.due(now):
            self._rescuer.ran(now)
            try:  # (a job finished, its outcome not yet written, is still held: its rescue leaves it alone)
                self._db.run(self._rescue_on)
            except BaseException:
                # its pause read may not have run: no job starts and nothing is claimed until the pauses are
                # read again (a seed of the model suite started jobs of a queue paused 3.5 s before: a long
                # inline job, then this step failed on a terminated connection, then a second of claims)
                self._db_fault()
                raise

    def _call(self, handler: Handler, job: ClaimedJob, no_provider: bool | None = None) -> _Ran:
        """Run one handler in the calling thread — in its own transaction when it takes a session."""
        if self._in_transaction(handler):
            return self._settled_by_its_run(job, _invoke_in_transaction(
                self.engine, self.spec, handler, job, self._max_result_bytes(), self._counted_again(job)
            ))  # fmt: skip
        return _invoke(handler, job, no_provider)

    def _maintain_between_jobs(self) -> None:
        """The once-a-second maintenance, between two inline jobs when it is due: a batch of jobs in hand does
        not hold back a rescue or a pause (the jobs of a queue paused meanwhile are given back, not started).
        Not while a claim in flight uses the loop's connection — a claim sent ahead whose result has arrived is
        read first, which frees it. None once a stop was asked: the jobs in hand are only recorded now (a review:
        a rescue begun after the stop, on a server that stopped answering, held the stop for good)."""
        if self._stop_requested or not self._rescuer.due(time.monotonic()):
            return
        self._read_landed_ahead()  # (frees the connection: the step, and a pause, need not wait for the batch)
        if self._inflight is not None and self._inflight.holds_connection():
            return
        try:
            self._rescue()
        except Exception as exc:
            self._maintenance_failed(exc)

    def _run_queued_inline(self) -> None:
        no_provider = _tracing.provider_unset()  # once for the jobs in hand
        while True:
            self._maintain_between_jobs()
            if (job := self._next_to_start()) is None:
                break
            self._inline_job = job
            if self._prefetch and self._inflight is None:
                # the next jobs are claimed — with the outcomes due — while the jobs in hand run, instead of one
                # round trip after them (when handlers are short enough to claim ahead at all)
                how = self._pace.claim_beside(len(self._queue))
                if how is not None and (how == "thread" or self._sends_ahead):
                    ahead = self._pace.ahead(1, self.batch)
                    if ahead:
                        self._send_claim(ahead, on_thread=how == "thread")
            handler = self._handler_for(job)
            try:
                if isinstance(handler, PermanentError | Defer):
                    self._finish(job, _Ran(handler, 0.0))
                else:
                    self._finish(job, self._call(handler, job, no_provider))
            finally:
                self._inline_job = None

    def _start_jobs(self) -> None:
        while len(self._running) < self.concurrency and (job := self._next_to_start()) is not None:
            handler = self._handler_for(job)
            if isinstance(handler, PermanentError | Defer):
                self._finish(job, _Ran(handler, 0.0))
                continue
            now = time.monotonic()
            future = self._threads.submit(self._call, handler, job)
            deadline = None if self.handler_timeout is None else now + self.handler_timeout
            self._running[future] = _Running(job, now, deadline)
            future.add_done_callback(self._on_done)

    def _on_done(self, future: Future[Any]) -> None:  # runs in the handler's thread
        self._finished.put(future)
        self._waker.poke()

    def _collect(self) -> None:
        """Results of handlers that finished, and handlers that overran their timeout."""
        while True:
            try:
                future = self._finished.get_nowait()
            except queue.Empty:
                break
            running = self._running.pop(future, None)
            if running is None:
                continue  # abandoned after its timeout: its late result no longer counts
            self._finish(running.job, future.result())
        now = time.monotonic()
        for future, running in list(self._running.items()):
            if running.deadline is not None and now >= running.deadline:
                del self._running[future]
                self._threads.abandon(future)
                self.stats.timed_out += 1
                self._finish(running.job, _Ran(self._timed_out(), now - running.started))

    def _handle_all(self) -> None:
        """run_once: handle every claimed job (at most ``concurrency`` at once), then return."""
        while self._queue or self._running:
            if not self._pauses_read:  # a maintenance step between two jobs failed
                self._db.run(self._read_pauses)
            if not self._may_start():
                self._release_unstarted()
            if self._inline:
                self._run_queued_inline()
            else:
                self._start_jobs()
            if self._running:
                self._wait_running()
            self._collect()

    def _wait_running(self) -> None:
        deadlines = [r.deadline for r in self._running.values() if r.deadline is not None]
        timeout = 1.0 if not deadlines else max(0.0, min(deadlines) - time.monotonic())
        self._waker.wait(min(timeout, 1.0), listen=False)

    # -- start and end ---------------------------------------------------------------------------------

    def _begin(self, *, long_run: bool = False) -> None:
        self._pauses_read = False
        self._sends_ahead = True
        if self._beat is not None:
            self._beat.start(connect=long_run)

    def _end(self) -> None:
        """Release unstarted jobs, let running handlers finish, write every outcome, stop the helpers."""
        try:
            if self._inflight is not None:  # its rows are leased to us: they join the jobs in hand (released)
                try:
                    self._inflight.future.exception()  # waits for it
                    self._landed()
                except Exception as exc:
                    log.warning("the last claim failed while stopping: %s", exc, extra={"error": str(exc)})
            self._release_unstarted()
            while self._running:
                self._wait_running()
                self._collect()
            self._release_after_runs()
            self._flush()
        except Exception:
            self.ended_unrecorded = True
            log.exception("could not finalize the jobs in hand; their leases will expire and be rescued")
        finally:
            if self._beat is not None:
                self._beat.stop()
            self._waker.close()
            self._db.drop()
            with self._beat_lock:
                self._beat_db.drop()
                self._drop_guards()
                self._guard_db.drop()
                if self._lease_base is not None:  # (its pool would keep them open past the run)
                    self._lease_base.dispose()


class AsyncWorker(WorkerBase):
    """The :class:`Worker` under asyncio, with the same options and guarantees: ``async def`` handlers are
    awaited (at most ``concurrency`` at once, cancelled on ``handler_timeout``); sync handlers run on threads
    of their own, never on the event loop.

    ``sync_engine``: the engine a sync handler that takes a session (``handler(job, session)``) runs its
    transaction on — it runs on a thread, where the async engine cannot serve it. By default one is built from
    the async engine's URL with its execution options (a ``schema_translate_map`` included) and its prepared
    statement setting; its ``connect_args`` (TLS files, ``options``), pool settings and event listeners cannot
    be read back from an engine, so pass your own sync engine when those matter."""

    _engine_types = (AsyncEngine,)
    _awaits_handlers = True

    def __init__(
        self,
        engine: AsyncEngine,
        model: type[Any],
        handlers: Mapping[str, Handler] | None = None,
        *,
        queues: Iterable[str] | Mapping[str, int] = ("default",),
        batch: int = 10,
        stale_after: Duration = 60.0,
        heartbeat: Duration | None = None,
        concurrency: int | None = None,
        backoff: Backoff | None = None,
        owner: str | None = None,
        poll_interval: Duration = 1.0,
        listen: bool = True,
        listen_url: str | URL | None = None,
        stop_on_unclassified: bool = False,
        rescue_limit: int = 1000,
        handler_timeout: Duration | None = None,
        unknown_task_grace: Duration = 3600.0,
        limits: Mapping[str, Limit] | None = None,
        unique_running: bool = False,
        schedules: type[Any] | None = None,
        maintain_partitions: Duration | None = None,
        give_up_after: Duration | None = None,
        sync_engine: Engine | None = None,
    ) -> None:
        if sync_engine is not None and not isinstance(sync_engine, Engine):
            raise ConfigurationError(
                f"sync_engine must be a sync SQLAlchemy Engine (for sync handlers that take a session), "
                f"not {type(sync_engine).__name__}"
            )
        super().__init__(
            engine, model, handlers, queues=queues, batch=batch, stale_after=stale_after, heartbeat=heartbeat,
            concurrency=concurrency, backoff=backoff, owner=owner, poll_interval=poll_interval, listen=listen,
            listen_url=listen_url, stop_on_unclassified=stop_on_unclassified, rescue_limit=rescue_limit,
            handler_timeout=handler_timeout, unknown_task_grace=unknown_task_grace, limits=limits,
            unique_running=unique_running, schedules=schedules, maintain_partitions=maintain_partitions,
            give_up_after=give_up_after,
        )  # fmt: skip
        self.engine: AsyncEngine = engine
        self._db = AsyncLoopConnection(engine, self.spec.table.name)
        self._lease_base: AsyncEngine | None = None
        lease = self._direct_lease_engine(engine)
        self._beat_db = AsyncLoopConnection(lease, self.spec.table.name)
        self._beat_lock = asyncio.Lock()
        self._run_loop: asyncio.AbstractEventLoop | None = None
        self._waker = AsyncWaker(self.listen_url, self.channels)
        self._running: dict[asyncio.Task[_Ran], _Running] = {}
        #: When the loop saw a running handler overdue (:meth:`_collect`).
        self._overdue_seen: dict[asyncio.Task[_Ran], float] = {}
        #: concurrency 1 without a timeout: each handler is awaited by the loop itself, in turn (no task and
        #: no wake-up of the loop per job)
        self._inline = self.concurrency == 1 and self.handler_timeout is None
        self._beat_task: asyncio.Task[None] | None = None
        #: Holds the lease guards (one transaction at a time; used under _beat_lock).
        self._guard_db = AsyncLoopConnection(lease, self.spec.table.name)
        self._beat_woken = asyncio.Event()
        self._sync: Engine | None = sync_engine
        self._own_sync = sync_engine is None  # built here, disposed by close()
        self._sync_checked = False
        self._sync_closed = False  # close() disposed the own sync engine: a late job's task may not use it

    def _poke(self) -> None:
        self._waker.poke()

    async def _wait_out_fault(self, delay: float) -> None:
        """run()'s wait after a database fault, in the two parts of :meth:`_fault_wait_steps` (the beats run
        on this event loop: no beat comes between the test and the wait)."""
        first, rest = self._fault_wait_steps(delay)
        self._fault_wait = "noting"
        try:
            if await self._wait_for_a_reason(first) is None and rest > 0 and not self._beat_in_fault_wait:
                self._fault_wait = "poking"
                await self._wait_for_a_reason(rest)
        finally:
            self._fault_wait = None

    async def _wait_for_a_reason(self, timeout: float) -> Wake:
        """As :meth:`Worker._wait_for_a_reason`: a stop, a handler done or a beat that got through ends the wait,
        not a poke left over from a handler the loop has already collected."""
        deadline = time.monotonic() + timeout
        while True:
            woke = await self._waker.wait_out(max(0.0, deadline - time.monotonic()))
            done = any(task.done() for task in self._running)
            if woke is None or self._stopped() or done or self._beat_in_fault_wait:
                return woke

    # -- public ----------------------------------------------------------------------------------------

    @one_async_run_at_a_time
    async def run_once(self) -> int:
        """One rescue step plus one claimed batch, handled and finalized (see :meth:`Worker.run_once`)."""
        self._begin()
        try:
            await self._rescue(force=True)
            claimed = await self._claim(self.batch) if self._may_start() else 0
            await self._handle_all()
            await self._flush()
            return claimed
        finally:
            await self._end_through_cancellation()
            self._raise_fatal()

    @one_async_run_at_a_time
    async def run(
        self,
        *,
        install_signal_handlers: bool = True,
        max_batches: int | None = None,
        until_idle: bool = False,
        startup_timeout: Duration | None = None,
    ) -> None:
        """Loop until :meth:`stop`, SIGTERM/SIGINT (when installed), cancellation, ``until_idle`` or
        ``max_batches`` — the same contract as :meth:`Worker.run`."""
        restore = install_async_signals(self._stop_on_signal) if install_signal_handlers else None
        batches = 0
        self._begin()
        policy = self._start_run(startup_timeout, drain=until_idle)
        try:
            while not self._stopped() and self._fatal is None:
                try:
                    claimed, wanted = await self._turn()
                    self._turn_went_through(policy)
                except Exception as exc:
                    delay = policy.failed(exc, self._beat_ends_fault_wait())
                    self.stats.db_errors += 1
                    self._db_fault()
                    await self._wait_out_fault(delay)
                    continue
                if wanted:
                    batches += 1
                    if max_batches is not None and batches >= max_batches:
                        break
                idle = not claimed and not self._queue and not self._running
                if until_idle and idle and wanted and not len(self._done) and not self._put_back_due():
                    break
                await self._wait(claimed, wanted)
        finally:
            try:
                await self._end_through_cancellation()
            finally:
                if restore:
                    restore()
                self._lifecycle("stopped")
        self._raise_fatal()

    def _direct_lease_engine(self, engine: AsyncEngine) -> AsyncEngine:
        """As :meth:`Worker._direct_lease_engine`, with psycopg's async driver."""
        from sqlalchemy.ext.asyncio import create_async_engine

        return cast(AsyncEngine, self._lease_route(engine, lambda url, connect_args: create_async_engine(
            url.set(drivername="postgresql+psycopg_async"), pool_size=2, max_overflow=2,
            connect_args=connect_args,
        )))  # fmt: skip

    async def _check_lease_route(self) -> None:
        """As :meth:`Worker._check_lease_route`."""
        if self._lease_base is None or self._table_identity is None:
            return
        theirs = await self._beat_db.run(lambda c: _steps.table_identity(c, self.spec))
        if self._route_disagrees(theirs):
            await self._beat_db.drop()
            await self._guard_db.drop()
            self._beat_db = AsyncLoopConnection(self.engine, self.spec.table.name)
            self._guard_db = AsyncLoopConnection(self.engine, self.spec.table.name)

    async def beat_once(self) -> None:
        """Renew the leases of the jobs in hand now (the heartbeat task calls this every ``heartbeat``)."""
        pairs = self._beat_pairs()
        if pairs:
            async with self._beat_lock:  # the heartbeat task, or a caller's beat_once() meanwhile
                await self._check_lease_route()
                sent = time.monotonic()
                try:
                    renewed = await self._beat_db.run(lambda c: self._extend_on(c, pairs))
                except Exception as exc:
                    if is_connection_error(exc):  # (as Worker.beat_once)
                        self._fault_noticed()
                    raise
                self._contact(sent)
            self._beat_result(pairs, renewed, sent)
        if self._guarding:
            await self.guard_once()

    def serve(self, *, install_signal_handlers: bool = True, startup_timeout: Duration | None = None) -> None:
        """Run on a new event loop until stopped, then close: the blocking entry point of a process (the same
        call as the sync class's). SIGTERM/SIGINT stop it gracefully when ``install_signal_handlers``."""

        async def main() -> None:
            try:
                await self.run(
                    install_signal_handlers=install_signal_handlers, startup_timeout=startup_timeout
                )
            finally:
                await self.close()

        run_to_end(main())

    async def close(self) -> None:
        """Release the loop's connections and threads."""
        await self._waker.close()
        await self._db.drop()
        await self._beat_db.drop()
        await self._guard_db.drop()
        if self._lease_base is not None:
            await self._lease_base.dispose()
        self._threads.close()
        if self._own_sync:
            self._sync_closed = True
            sync, self._sync = self._sync, None
            if sync is not None:
                # A handler abandoned after handler_timeout (or the check of this engine, cut short by it) may
                # still hold one of its connections: given back after the dispose, it is closed, not left open
                # in the disposed pool until a garbage collection — however long that call still takes.
                event.listen(sync.pool, "checkin", _close_on_checkin)
                sync.dispose()

    # -- one turn --------------------------------------------------------------------------------------

    async def _turn(self) -> tuple[int, int]:
        self._collect()
        if not self._pauses_read:  # a fresh run learns which queues are paused before it claims any
            await self._db.run(self._read_pauses)
        wanted = self._want(len(self._running), inline=self._inline) if self._may_start() else 0
        claimed = await self._claim(wanted) if wanted else 0
        if not wanted and self._done.due(time.monotonic()):
            await self._flush()
        await self._rescue()
        if self._inline:
            await self._run_queued_inline()
        else:
            self._start_jobs()
        return claimed, wanted

    async def _wait(self, claimed: int, wanted: int) -> None:
        if claimed:
            return  # more may be waiting: claim again at once (writing these outcomes on the way)
        if self._queue and not self._pauses_read:
            return  # jobs in hand wait for the pauses, which the next turn reads (a failure there backs off)
        idle = not self._queue and not self._running
        if idle and len(self._done):
            if self._may_start():
                return  # written by the next turn's claim, which also takes what they unblocked
            await self._flush()
        poll = not self._queue and len(self._running) < self.concurrency
        timeout = self._next_deadline(poll=poll)
        abandon = self._running_wait()
        if await self._waker.wait(timeout if abandon is None else min(timeout, abandon)) == "notify":
            self.stats.wakeups += 1

    async def _claim(self, want: int) -> int:
        outcomes = self._done.take()
        try:
            (applied, rows), cancelled = await through_cancellation(
                self._db.run(lambda c: self._claim_on(c, want, outcomes)), grace=CLAIM_GRACE
            )
        except BaseException:
            self._done.add(outcomes)
            raise
        self._report(outcomes, applied)
        claimed = self._accept(rows)  # in hand: released by _end if the run is being cancelled
        if self._to_refund:
            # not cut off by a cancellation: committed, its refund must be recorded before a release gives the
            # attempt back again
            _, late = await through_cancellation(self._db.run(self._refund_held_back_on))
            cancelled = cancelled or late
        if cancelled is not None:
            raise cancelled
        return claimed

    async def _flush(self) -> None:
        outcomes = self._done.take()
        if not outcomes:
            return
        applied: set[int] = set()
        try:
            async for attempt in AsyncRetrying(**self._statement_retry(self._finalize_window())):
                with attempt:
                    applied = await self._db.run(lambda c: self._finalize_on(c, outcomes))
        except BaseException:
            self._done.add(outcomes)
            raise
        self._report(outcomes, applied)

    async def _rescue(self, *, force: bool = False) -> None:
        now = time.monotonic()
        self._partition_step(now)
        if force or self._rescuer.due(now):
            self._rescuer.ran(now)
            try:  # (as Worker._rescue)
                await self._db.run(self._rescue_on)
            except BaseException:
                self._db_fault()  # (as Worker._rescue)
                raise

    async def _maintain_between_jobs(self) -> None:
        """The once-a-second maintenance between two inline jobs, as the sync Worker runs it."""
        if not self._stop_requested and self._rescuer.due(time.monotonic()):
            try:
                await self._rescue()
            except Exception as exc:
                self._maintenance_failed(exc)

    async def _run_queued_inline(self) -> None:
        if self._running:  # left by a turn that failed while its handler ran: concurrency stays 1
            await asyncio.wait(list(self._running))
            self._collect()
        while True:
            await self._maintain_between_jobs()
            if (job := self._next_to_start()) is None:
                break
            handler = self._handler_for(job)
            if isinstance(handler, PermanentError | Defer):
                self._finish(job, _Ran(handler, 0.0))
            elif self._is_async(handler) or self._in_transaction(handler):
                ran = await self._execute_inline(handler, job)
                if ran is None:
                    self._ended_unfinished(job, "released: cancelled")
                else:
                    self._finish(job, ran)
            else:
                await self._run_sync_in_turn(job, handler)

    async def _execute_inline(self, handler: Handler, job: ClaimedJob) -> _Ran | None:
        """Run one job's handler in a task of its own and wait for it without cancelling it when the wait is
        cancelled (the handler goes on; its task is recorded in ``_running`` and its outcome collected when it
        ends), writing the outcomes of finished jobs when they fall due meanwhile (a long job must not hold
        them back: until written, a crash would run them again). None: the job's task was cancelled (not by
        a cancellation request, which is a result).

        The task wakes this wait itself as its last step, through a future of the wait's own: two turns of the
        event loop per job (``asyncio.wait`` on the task took three: the task's done callback, then the
        waiter's). A timer wakes it instead when outcomes fall due first."""
        loop = asyncio.get_running_loop()
        wake: list[asyncio.Future[None]] = [loop.create_future()]

        async def execute() -> _Ran:
            try:
                return await self._execute(handler, job)
            finally:  # in the task's last step: once the wait wakes, the task is done or still running
                _resolve(wake[0])

        # a sync handler's thread runs on whatever happens to the event loop: its task is held (a runner's
        # teardown must not release the job while the thread runs it); an async def handler's is the
        # application's code, cancelled by a teardown like the client tasks it may be waiting on
        task = asyncio.ensure_future(execute()) if self._is_async(handler) else held_task(execute())
        try:
            while not task.done():
                due = self._done.next_due()
                timer = (
                    None
                    if due is None
                    else loop.call_later(max(0.0, due - time.monotonic()), _resolve, wake[0])
                )
                try:
                    await wake[0]
                finally:
                    if timer is not None:
                        timer.cancel()
                if not task.done():  # the timer: outcomes fell due while the handler runs
                    wake[0] = loop.create_future()
                    if self._done.due(time.monotonic()):
                        await self._flush()
        except BaseException:  # cancelled, or the outcomes' statement failed: the handler goes on
            self._running[task] = _Running(job, time.monotonic(), None)  # recorded when it ends
            raise
        return None if task.cancelled() else task.result()

    async def _wait_writing_outcomes(self, future: asyncio.Future[Any], progress: Callable[[], None]) -> None:
        """Wait for a thread's group of sync handlers without cancelling it when the wait is cancelled, writing
        the outcomes of finished jobs when they fall due meanwhile (a long job must not hold them back: until
        written, a crash would run them again) and running the once-a-second maintenance when it is due (the
        group stops at a job of a queue it learns is paused). ``progress`` records what the group finished so
        far; it is called at least every ``flush_after``."""
        while not future.done():
            outcomes_due = self._done.next_due()
            if outcomes_due is None:
                outcomes_due = time.monotonic() + self._done.flush_after
            due = min(outcomes_due, self._rescuer.next_due())
            await asyncio.wait({future}, timeout=max(0.0, due - time.monotonic()))
            progress()
            if not future.done() and self._done.due(time.monotonic()):
                await self._flush()
            if not future.done():
                await self._maintain_between_jobs()

    def _plain_sync(self, job: ClaimedJob) -> Handler | None:
        handler = self.handlers.get(job.task)
        if handler is None or self._is_async(handler) or self._in_transaction(handler):
            return None
        return handler

    async def _run_sync_in_turn(self, first: ClaimedJob, handler: Handler) -> None:
        """Sync handlers of an inline AsyncWorker: ``first`` and the plain sync jobs in hand right behind it run
        on one thread call, in order — one hand-off for all of them rather than one per job, and never on the
        event loop. Between jobs the thread checks for a stop, a fatal result and a cancellation request, as
        the loop itself would; the loop records each result as it comes (and writes the outcomes when due);
        jobs the thread did not start go back to the front of the jobs in hand."""
        pairs = [(first, handler)]
        while self._queue and (plain := self._plain_sync(self._queue[0])) is not None:
            pairs.append((self._queue.popleft(), plain))
        halt = threading.Event()
        no_provider = _tracing.provider_unset()
        results: list[_Ran | None] = []  # appended by the thread, read by the loop
        recorded = 0

        def run_in_turn() -> None:  # on a handler thread
            for job, fn in pairs:
                if results and (
                    halt.is_set()
                    or not self._may_start()
                    or not self._pauses_fresh()
                    or job.queue in self._paused
                    or not self._lease_fresh(job)
                ):
                    break
                if results and job.cancel_requested:
                    results.append(None)  # recorded cancelled, never started
                    continue
                ran = _invoke(fn, job, no_provider)
                results.append(ran)
                if self._stops_loop(ran.error):
                    break

        def record() -> None:  # on the loop
            nonlocal recorded
            upto = len(results)
            for (job, _), ran in zip(pairs[recorded:upto], results[recorded:upto], strict=True):
                if ran is None:
                    self._done.add([self._not_started(job, "")])
                else:
                    self._finish(job, ran)
            recorded = upto

        wrapped = asyncio.wrap_future(self._threads.submit(run_in_turn))
        try:
            await self._wait_writing_outcomes(wrapped, record)
        except BaseException:
            halt.set()  # the job in progress cannot be interrupted: its result is recorded, the rest go back
            if _loop_running():  # (not in a coroutine closed by a garbage collection: nothing can be awaited)
                await through_cancellation(wrapped)  # (however often cancelled: it is in hand until it ends)
            raise
        finally:
            record()
            self._queue.extendleft(job for job, _ in reversed(pairs[len(results) :]))

    def _start_jobs(self) -> None:
        while len(self._running) < self.concurrency and (job := self._next_to_start()) is not None:
            handler = self._handler_for(job)
            if isinstance(handler, PermanentError | Defer):
                self._finish(job, _Ran(handler, 0.0))
                continue
            is_async = self._is_async(handler)  # (held or not: see _execute_inline)
            task = (
                asyncio.ensure_future(self._execute(handler, job))
                if is_async
                else held_task(self._execute(handler, job))
            )
            now = time.monotonic()
            # an async def handler is cancelled at its timeout; one that does not stop is abandoned (_collect)
            overdue_at = None if self.handler_timeout is None or not is_async else now + self.handler_timeout
            self._running[task] = _Running(job, now, overdue_at)
            task.add_done_callback(lambda _: self._waker.poke())

    async def _execute(self, handler: Handler, job: ClaimedJob) -> _Ran:
        """Run one handler — awaited, or on a thread of its own — bounded by handler_timeout; its error as
        a value (SystemExit/KeyboardInterrupt included, so they cannot tear through the event loop). An
        ``async def`` handler runs as a task of its own, cancelled when the job's cancellation is requested."""
        started = time.perf_counter()
        future: Future[Any] | None = None
        canceller: _Canceller | None = None
        token = self._tokens.get(job.id)
        timer = None if self.handler_timeout is None else asyncio.timeout(self.handler_timeout)
        try:
            async with timer or contextlib.nullcontext():
                if self._is_async(handler):
                    task = asyncio.current_task()
                    if token is not None and task is not None:
                        canceller = _Canceller(task)
                        if token.is_set():  # requested after the job was picked, before its task ran: a
                            # cancel now would land only at the handler's first await, or on a handler that
                            # never awaits, as a cancelled task for a job that ran
                            canceller.fired = True
                            raise asyncio.CancelledError
                        token.on_set(canceller)
                    # awaited here, in this task: no await between its return and the token's reset below,
                    # so a cancellation request can only interrupt the handler (or its transaction)
                    ran = await self._await_handler(handler, job)
                else:
                    if self._in_transaction(handler):
                        future = self._threads.submit(
                            _invoke_in_transaction, await self._sync_engine(job), self.spec, handler, job,
                            self._max_result_bytes(), self._counted_again(job),
                        )  # fmt: skip
                    else:
                        future = self._threads.submit(_invoke, handler, job)
                    ran = await asyncio.wrap_future(future)
        except TimeoutError as exc:
            if timer is None or not timer.expired():
                return _Ran(exc, time.perf_counter() - started)
            if future is not None:
                self._threads.abandon(future)
            self.stats.timed_out += 1
            return _Ran(self._timed_out(), time.perf_counter() - started)
        except asyncio.CancelledError as exc:
            if canceller is not None and canceller.fired:
                if canceller.task.cancelling():
                    canceller.task.uncancel()  # ours, answered here: the task goes on to return the outcome
                return _Ran(
                    JobCancelled(f"job {job.id} ({job.task}) was cancelled"), time.perf_counter() - started
                )
            if (stray := stray_cancellation(exc)) is not None:
                return _Ran(stray, time.perf_counter() - started)
            raise
        except _WrongSyncEngine as exc:  # no handler can run right here: the loop stops once it is recorded
            if self._fatal is None:
                self._fatal = exc.error
            return _Ran(exc.error, time.perf_counter() - started)
        except BaseException as exc:  # SystemExit/KeyboardInterrupt too: raised out of a task, asyncio
            # re-raises them through the event loop, which stops mid-batch with every other job cut short
            return _Ran(exc, time.perf_counter() - started)
        finally:
            if token is not None:
                token.on_set(None)
        ran.seconds = time.perf_counter() - started
        return self._settled_by_its_run(job, ran)

    async def _await_handler(self, handler: Any, job: ClaimedJob) -> _Ran:
        """Await an ``async def`` handler — in an ``AsyncSession`` transaction that also writes the job's fenced
        completion when it takes a session (both commit, or both roll back)."""
        if not self._in_transaction(handler):
            if _tracing.process_inert(job):
                return _Ran(None, 0.0, await handler(job))
            with _tracing.process_span(job):
                return _Ran(None, 0.0, await handler(job))
        try:
            await _async_session_can_connect(self.engine)
            with _tracing.process_span(job):
                async with AsyncSession(self.engine) as session, session.begin():
                    value = await handler(job, session)
                    done = Outcome(
                        job.id, job.lease_version, self.spec.done, refund=self._counted_again(job),
                        result=_encode_result(job, value, self._max_result_bytes()),
                    )  # fmt: skip
                    applied = await session.run_sync(
                        lambda s: _steps.finalize(s.connection(), self.spec, [done])
                    )
                    if job.id not in applied:
                        raise _LeaseLost
        except _LeaseLost:
            return _Ran(None, 0.0, lost=True)
        except _NoSession as exc:
            return _Ran(exc.defer, 0.0)
        return _Ran(None, 0.0, value, committed=True)

    async def _sync_engine(self, job: ClaimedJob) -> Engine:
        """A sync engine on the same database, for sync handlers that take a session (they run on threads of
        their own, where the async engine cannot serve them). Its connections prepare statements exactly when
        the async engine's do (behind PgBouncer in transaction mode, not at all), and it carries the async
        engine's execution options (a tenant's ``schema_translate_map``)."""
        if self._sync is None:
            async with self.engine.connect() as conn:
                threshold = await conn.run_sync(
                    lambda c: getattr(c.connection.driver_connection, "prepare_threshold", 5)
                )
            self._no_sync_after_close(job)
            if self._sync is None:  # another job's task may have made it meanwhile
                url = self.engine.url.set(drivername="postgresql+psycopg")
                built = create_engine(
                    url, pool_size=self.concurrency, max_overflow=self.concurrency,
                    connect_args={"prepare_threshold": threshold},
                )  # fmt: skip
                self._sync = with_options_of(built, self.engine)
        sync = self._sync
        if not self._sync_checked:
            self._sync_checked = await self._check_sync_engine(sync, job)
        self._no_sync_after_close(job)
        return sync

    def _no_sync_after_close(self, job: ClaimedJob) -> None:
        """A job's task that outlived close() (abandoned after its run was cancelled, still awaiting the pooler
        or the database) must not use the sync engine close() disposed: a disposed engine makes a new pool on
        its next use, whose connections nobody closes — they were collected open (the model-based suite, 2 of
        26 long scenarios once, behind a pooler's PAUSE). The job is not run: its worker has ended, nothing
        would record its outcome, and its lease runs out to the rescue."""
        if self._sync_closed:
            raise RuntimeError(f"job {job.id} ({job.task}) not run: its worker was closed before it started")

    async def _check_sync_engine(self, sync: Engine, job: ClaimedJob) -> bool:
        """The sync engine must reach the very table the loop claims from: a fenced completion on another
        schema's table (a ``search_path`` set in the async engine's ``connect_args``, which a URL does not
        carry) could mark another tenant's job of the same id and lease version done. Compared by the
        claimed row's ``tableoid`` as each engine sees it."""
        t = self.spec.table
        stmt = select(literal_column("tableoid").cast(BigInteger)).select_from(t).where(t.c.id == job.id)
        async with self.engine.connect() as conn:
            mine = (await conn.execute(stmt)).scalar()

        def theirs() -> Any:
            self._no_sync_after_close(job)
            with sync.connect() as conn:
                return conn.execute(stmt).scalar()

        found = await asyncio.to_thread(theirs)
        if found is None and mine is None:
            return False  # the row is gone (purged): nothing compared — the next job's check will tell
        if found != mine:
            raise _WrongSyncEngine(ConfigurationError(
                f"the sync engine for handlers that take a session does not reach the {t.name} table this "
                f"AsyncWorker claims from (another search_path or schema: job {job.id} is in table oid {mine} "
                f"for the async engine, {found} for the sync one). Pass sync_engine= an engine on the same "
                "schema (with the async engine's connect_args)"
            ))  # fmt: skip
        return True

    def _collect(self) -> None:
        """Results of handlers that finished, and ``async def`` handlers that did not stop when cancelled at
        their timeout: abandoned as a sync call is (the job retried, its attempt spent; the task may still run
        — handlers must be idempotent), so that a handler swallowing its cancellation no longer holds a slot,
        nor the loop's end, for good."""
        for task in [t for t in self._running if t.done()]:
            running = self._running.pop(task)
            self._overdue_seen.pop(task, None)
            if task.cancelled():
                self._ended_unfinished(running.job, "released: cancelled")
                continue
            self._finish(running.job, task.result())
        now = time.monotonic()
        for task, running in list(self._running.items()):
            if running.deadline is None or now < running.deadline:
                continue
            # the grace counts from when the loop saw it overdue — about when its cancellation was delivered,
            # however long another handler blocked the event loop before (a review: a handler that stopped at
            # once after a late cancellation was called deaf)
            seen = self._overdue_seen.setdefault(task, now)
            if now >= seen + ABANDON_AFTER_CANCEL:
                del self._running[task]
                self._overdue_seen.pop(task, None)
                self._abandon(task)
                self.stats.timed_out += 1
                log.warning(
                    "job %s (%s): its handler did not stop within %g s of its cancellation at handler_timeout: "
                    "abandoned (it may still run), the job retried", running.job.id, running.job.task,
                    ABANDON_AFTER_CANCEL,
                    extra={"table": self.spec.table.name, "row_id": running.job.id, "task": running.job.task},
                )  # fmt: skip
                self._finish(running.job, _Ran(self._timed_out(), now - running.started))

    def _running_wait(self) -> float | None:
        """Seconds until a running handler is seen overdue, or to be abandoned (:meth:`_collect`); None: no such
        deadline."""
        deadlines = [
            self._overdue_seen[t] + ABANDON_AFTER_CANCEL if t in self._overdue_seen else r.deadline
            for t, r in self._running.items()
            if r.deadline is not None
        ]
        return None if not deadlines else max(0.0, min(deadlines) - time.monotonic())

    async def _handle_all(self) -> None:
        while self._queue or self._running:
            if not self._pauses_read:  # a maintenance step between two jobs failed
                await self._db.run(self._read_pauses)
            if not self._may_start():
                self._release_unstarted()
            if self._inline:
                await self._run_queued_inline()
                continue
            self._start_jobs()
            if self._running:
                await asyncio.wait(
                    list(self._running), timeout=self._running_wait(), return_when=asyncio.FIRST_COMPLETED
                )
            self._collect()

    # -- start and end ---------------------------------------------------------------------------------

    def _begin(self) -> None:
        self._pauses_read = False
        loop = asyncio.get_running_loop()
        if loop is not self._run_loop:  # a lock that ever waited is bound to its first loop: one per loop
            if self._run_loop is not None and self._run_loop.is_closed():
                self._left_by_a_closed_loop()
            self._run_loop, self._beat_lock = loop, asyncio.Lock()
        if self.heartbeat is not None and (self._beat_task is None or self._beat_task.done()):
            self._beat_woken = (
                asyncio.Event()
            )  # (an Event is bound to the loop of its first wait: one per run)
            self._beat_task = held_task(self._heartbeat(self.heartbeat))

    def _left_by_a_closed_loop(self) -> None:
        """A run taken over from one whose event loop was closed under it (:meth:`LoopBase._enter_run`): its
        tasks died with that loop — the heartbeat, the handlers — so their jobs are no longer held (renewed by
        this run's heartbeat, they would never be rescued): they wait for their lease, as a crashed process's
        do; the jobs it had not started are given back."""
        self._beat_task = None
        dead = [r.job.id for r in self._running.values()]
        self._running.clear()
        self._overdue_seen.clear()
        self._abandoned.clear()
        self._held.drop(dead)
        self._release_unstarted()

    def _wake_heartbeat(self) -> None:
        self._beat_woken.set()

    async def guard_once(self) -> None:
        """One round of the lease guards (see :meth:`Worker.guard_once`)."""
        frozen_after = self.stale_after.total_seconds()
        async with self._beat_lock:
            want, new = self._guard_wanted()
            try:
                guarding = self._guard_room(self._guard_db.can_run_now())
                if new and guarding:
                    self._guard_taken |= await self._guard_db.run(
                        lambda c: _steps.guard(c, self.spec, new, frozen_after=frozen_after)
                    )
                sent = time.monotonic()
                renewed = (
                    await self._beat_db.run(lambda c: self._extend_on(c, want)) if want else (set(), set())
                )
                rest = [p for p in want if p[0] not in renewed[0]]
                on = self._guard_db if guarding else self._beat_db
                ours = await on.run(lambda c: _steps.leased(c, self.spec, rest)) if rest else set()
                if self._guard_settle(want, renewed, ours, sent):
                    await self._guard_db.run(_steps.unguard)
                    self._guard_taken = set()
                    _, again = self._guard_wanted()  # rows still held: guarded again in a new transaction
                    if again:
                        self._guard_taken |= await self._guard_db.run(
                            lambda c: _steps.guard(c, self.spec, again, frozen_after=frozen_after)
                        )
            except Exception as exc:
                await self._guard_db.drop()
                self._guard_failed(exc)

    async def _heartbeat(self, interval: float) -> None:
        loop = asyncio.get_running_loop()
        next_beat = loop.time() + interval
        while True:
            wait = next_beat - loop.time()
            with contextlib.suppress(TimeoutError):  # (no task of wait_for's: a teardown would cancel it)
                async with asyncio.timeout(max(0.0, min(wait, GUARD_POLL) if self._guarding else wait)):
                    await self._beat_woken.wait()
            self._beat_woken.clear()
            try:
                if loop.time() >= next_beat:
                    next_beat = loop.time() + interval
                    await self.beat_once()
                elif self._guarding:
                    await self.guard_once()
            except Exception as exc:  # a missed beat is retried next interval
                log.warning("heartbeat failed: %s", exc, extra={"error": str(exc)})

    async def _end_through_cancellation(self) -> None:
        """:meth:`_end` (it releases and writes what the loop holds), held against cancellations — anyio's
        cancel scopes deliver one at every await; one that arrived meanwhile is raised after it."""
        # the coroutine closed by a garbage collection after its event loop was closed under it: nothing can run
        # (its rows wait for their lease, as a crashed process's do)
        if not _loop_running():
            return
        _, cancelled = await through_cancellation(self._end())
        if cancelled is not None:
            raise cancelled

    async def _end(self) -> None:
        try:
            self._release_unstarted()
            while self._running:
                await asyncio.wait(list(self._running), timeout=self._running_wait())
                self._collect()
            self._release_after_runs()
            await self._flush()
        except Exception:
            self.ended_unrecorded = True
            log.exception("could not finalize the jobs in hand; their leases will expire and be rescued")
        finally:
            beat, self._beat_task = self._beat_task, None
            if beat is not None:
                beat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beat
            self._drop_guards()
            await self._guard_db.drop()
            await self._waker.close()
            await self._db.drop()
            await self._beat_db.drop()
            if self._lease_base is not None:  # (its pool would keep them open past the run)
                await self._lease_base.dispose()
