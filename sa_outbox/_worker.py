"""The jobs worker: the jobs document's queue, on the same claim / lease / finalize engine as the outbox.

One batch: a short transaction reaps stale ``running`` jobs (their worker died: back to ``queued``, or
``failed`` when out of attempts) and claims up to ``batch`` due jobs per queue with
``FOR NO KEY UPDATE SKIP LOCKED`` (child tables with a foreign key to jobs are not blocked); the handlers run
with no transaction open; one fenced statement records every outcome. ``lease_version`` is the fencing token:
a worker whose job was reaped and claimed again cannot mark it done or failed (``status = 'running'`` alone
would let it, since the job is running again — for someone else).

**Concurrency.** ``concurrency=N`` runs up to N handlers of a batch at once in a thread pool inside the
process — right for I/O-bound and for blocking handlers alike (a blocking call holds one thread, not the
loop). For CPU-bound handlers run several processes (``sa-outbox worker --processes N``).

**Heartbeat.** While handlers run, a background thread refreshes ``locked_at`` of the jobs still in hand every
``heartbeat`` (default ``stale_after / 4``), fenced by lease version, so a long job is not reaped while its
worker lives. A worker that dies stops heart-beating and its jobs are reaped after ``stale_after``.

**Stopping.** On :meth:`stop` (SIGTERM/SIGINT under :meth:`run`) the jobs already running finish and are
recorded; claimed jobs that have not started are released (back to ``queued``, attempt refunded).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from sqlalchemy import Engine

from . import _steps as eng
from ._backoff import JOBS_BACKOFF, Backoff
from ._durations import Duration, to_seconds, to_timedelta
from ._loop import LoopBase, is_async_callable, positive_int
from ._messages import ClaimedJob
from ._names import channel_for
from .errors import ConfigurationError, PermanentError, RetryableError

__all__ = ["Handler", "TaskRegistry", "Worker"]

log = logging.getLogger("sa_outbox.worker")

Handler = Callable[[ClaimedJob], Any]
H = TypeVar("H", bound=Handler)

_NOT_STARTED = object()


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


class _Heartbeat:
    """One background thread per worker that refreshes the lease of the jobs in hand every ``interval``.

    Jobs are registered when their batch is claimed and released as each handler returns, so a batch costs two
    dict updates per job, not a thread start.
    """

    def __init__(self, worker: Worker, interval: float) -> None:
        self.worker = worker
        self.interval = interval
        self.held: dict[int, int] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def hold(self, jobs: Sequence[ClaimedJob]) -> None:
        with self.lock:
            self.held.update((j.id, j.lease_version) for j in jobs)
            if self.thread is None:
                self.stopped.clear()
                self.thread = threading.Thread(target=self._run, name="sa_outbox-heartbeat", daemon=True)
                self.thread.start()

    def release(self, job_id: int) -> None:
        with self.lock:
            self.held.pop(job_id, None)

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            with self.lock:
                pairs = list(self.held.items())
            if not pairs:
                continue
            try:
                with self.worker._side_connection() as conn:
                    renewed = eng.extend(conn, self.worker.spec, pairs)
                for job_id, version in pairs:
                    if job_id not in renewed:
                        log.warning(
                            "heartbeat: job %s version %s is no longer ours (reaped and re-claimed?)", job_id, version,
                            extra={"job_id": job_id, "lease_version": version},
                        )  # fmt: skip
            except Exception as exc:  # a missed beat is retried next interval; never kill the handler
                log.warning("heartbeat failed: %s", exc, extra={"error": str(exc)})

    def stop(self) -> None:
        self.stopped.set()
        thread, self.thread = self.thread, None
        if thread is not None:
            thread.join()


class _NoHeartbeat:
    def hold(self, jobs: Sequence[ClaimedJob]) -> None:
        pass

    def release(self, job_id: int) -> None:
        pass

    def stop(self) -> None:
        pass


class Worker(LoopBase):
    """Runs jobs from a :class:`~sa_outbox.JobMixin` table with the handlers registered for their task.

    Options (durations take a ``timedelta`` or seconds): ``queues`` (claimed in the given order, default
    ``("default",)``); ``batch`` (jobs claimed per transaction, default 10); ``stale_after`` (a running job whose
    ``locked_at`` is older is reaped, default 60 s); ``heartbeat`` (default ``stale_after / 4``; ``0`` disables);
    ``concurrency`` (handlers at once, threads, default 1); ``backoff`` (default ``min(300 s, 2**attempts s)``);
    ``poll_interval``, ``listen``, ``listen_url`` as for the Dispatcher.
    """

    _owner_prefix = "worker"
    _log = log

    def __init__(
        self,
        engine: Engine,
        model: type[Any],
        handlers: Mapping[str, Handler] | None = None,
        *,
        queues: Iterable[str] = ("default",),
        batch: int = 10,
        stale_after: Duration = 60.0,
        heartbeat: Duration | None = None,
        concurrency: int = 1,
        backoff: Backoff | None = None,
        owner: str | None = None,
        poll_interval: Duration = 1.0,
        listen: bool = True,
        listen_url: str | None = None,
        stop_on_unclassified: bool = False,
        rescue_limit: int = 1000,
        handler_timeout: Duration | None = None,
    ) -> None:
        super().__init__(
            engine, model, owner=owner, batch=batch, poll_interval=poll_interval, listen=listen,
            listen_url=listen_url, channels=[channel_for(model.__table__.name)],
        )  # fmt: skip
        if self.spec.kind != "jobs":
            raise ConfigurationError(f"Worker needs a JobMixin model, got {model.__name__} (use Dispatcher)")
        if isinstance(queues, str):
            raise ConfigurationError("queues must be a collection of queue names, e.g. ('default',)")
        self.queues = list(dict.fromkeys(queues))
        if not self.queues or not all(isinstance(q, str) and q for q in self.queues):
            raise ConfigurationError(f"queues must be non-empty queue names, got {self.queues!r}")
        self.handlers: TaskRegistry = TaskRegistry(handlers or {})
        for name, fn in self.handlers.items():
            self._check_handler(name, fn)
        self.stale_after = to_timedelta(stale_after, name="stale_after", allow_zero=False)
        beat = self.stale_after / 4 if heartbeat is None else to_timedelta(heartbeat, name="heartbeat")
        if beat >= self.stale_after:
            raise ConfigurationError("heartbeat must be shorter than stale_after, or the job would be reaped")
        self.heartbeat: float | None = beat.total_seconds() or None
        self.concurrency = positive_int(concurrency, "concurrency")
        self.backoff = backoff or JOBS_BACKOFF
        self.stop_on_unclassified = stop_on_unclassified
        self.rescue_limit = positive_int(rescue_limit, "rescue_limit")
        self.handler_timeout: float | None = (
            None
            if handler_timeout is None
            else to_seconds(handler_timeout, name="handler_timeout", allow_zero=False)
        )
        if self.handler_timeout is not None and self.handler_timeout >= self.stale_after.total_seconds():
            raise ConfigurationError("handler_timeout must be shorter than stale_after")
        self._pool: ThreadPoolExecutor | None = None
        self._beat: _Heartbeat | _NoHeartbeat = (
            _Heartbeat(self, self.heartbeat) if self.heartbeat is not None else _NoHeartbeat()
        )

    def task(self, name: str | None = None) -> Callable[[H], H]:
        """Decorator registering a handler on this worker."""

        def register(fn: H) -> H:
            self._check_handler(str(name or getattr(fn, "__name__", "?")), fn)
            return self.handlers.task(name)(fn)

        return register

    #: The asyncio worker's core runs coroutine handlers on its event loop; this class never awaits one.
    _awaits_handlers = False

    def _check_handler(self, name: str, fn: Any) -> None:
        if not callable(fn):
            raise ConfigurationError(f"handler for task {name!r} is not callable: {fn!r}")
        if is_async_callable(fn) and not self._awaits_handlers:
            raise ConfigurationError(
                f"handler for task {name!r} is async: Worker would never await it; run it with AsyncWorker"
            )

    # -- one batch -------------------------------------------------------------------------------------

    def _rescue_params(self) -> dict[str, Any]:
        return {"stale_after": self.stale_after, "limit": self.rescue_limit}

    def _claim_params(self) -> list[dict[str, Any]]:
        return [{"queue": q} for q in self.queues]

    def _finalize_window(self) -> float:
        return max(self.stale_after.total_seconds(), 1.0)

    def _handler_for(self, job: ClaimedJob) -> Handler | PermanentError:
        """The job's handler, or the permanent failure of a task nobody handles (sync and async workers)."""
        handler = self.handlers.get(job.task)
        if handler is None:
            known = ", ".join(sorted(self.handlers)) or "none"
            return PermanentError(f"no handler registered for task {job.task!r} (known: {known})")
        return handler

    def _call(self, job: ClaimedJob) -> BaseException | object | None:
        if self._stop.is_set():
            return _NOT_STARTED
        try:
            handler = self._handler_for(job)
            if isinstance(handler, PermanentError):
                return handler
            started = time.perf_counter()
            result = handler(job)
            if inspect.isawaitable(result):  # e.g. a lambda around an async function: never marked done
                if inspect.iscoroutine(result):
                    result.close()
                return TypeError(
                    f"handler for task {job.task!r} returned an awaitable; async handlers run with AsyncWorker"
                )
            self._observe_handled(started, job.created_at)
            return None
        except Exception as exc:
            return exc
        finally:
            self._beat.release(job.id)

    def _step(self, *, rescue: bool) -> int:
        jobs = [ClaimedJob.from_row(r) for r in self._claim_rows(rescue=rescue)]
        if not jobs:
            return 0
        self._beat.hold(jobs)
        outcomes, fatal = self._outcomes(jobs, self._handle(jobs))
        if fatal is not None:
            self._finalize(outcomes)
            raise fatal
        self._settle(outcomes)
        return len(jobs)

    def _handle(self, jobs: Sequence[ClaimedJob]) -> list[object]:
        """Run the jobs' (sync) handlers, at most ``concurrency`` at a time, each bounded by handler_timeout;
        one result per job, in order (also the async worker's step for sync handlers, in a thread)."""
        if self.handler_timeout is None and (self.concurrency == 1 or len(jobs) == 1):
            return [self._call(j) for j in jobs]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="sa_outbox-handler")
        futures = [self._pool.submit(self._call, j) for j in jobs]
        results: list[object] = []
        for job, future in zip(jobs, futures, strict=True):
            try:
                results.append(future.result(timeout=self.handler_timeout))
            except FutureTimeout:
                # The thread cannot be killed: it is abandoned (the job may still finish there), the job is
                # retried like any transient failure — handlers must be idempotent anyway.
                self._beat.release(job.id)
                results.append(self._timed_out())
        return results

    def _timed_out(self) -> RetryableError:
        return RetryableError(f"handler exceeded handler_timeout ({self.handler_timeout:g}s)")

    def _outcomes(
        self, jobs: Sequence[ClaimedJob], results: Sequence[object]
    ) -> tuple[list[eng.Outcome], BaseException | None]:
        """Classify handler results (shared by the sync and the async worker)."""
        outcomes: list[eng.Outcome] = []
        fatal: BaseException | None = None
        for job, result in zip(jobs, results, strict=True):
            if result is _NOT_STARTED:
                outcomes.append(
                    eng.release(self.spec, job.id, job.lease_version, "released: worker stopping")
                )
                continue
            outcome, stop = self._outcome(
                id=job.id, lease_version=job.lease_version, attempts=job.attempts, max_attempts=job.max_attempts,
                error=result if isinstance(result, BaseException) else None, backoff=self.backoff,
                label=f"job {job.id} ({job.task})", stop_on_unclassified=self.stop_on_unclassified,
            )  # fmt: skip
            outcomes.append(outcome)
            fatal = fatal or stop
        return outcomes, fatal

    def run(self, **kwargs: Any) -> None:
        """See :meth:`LoopBase.run`; also stops the heartbeat thread and the handler pool at the end."""
        try:
            super().run(**kwargs)
        finally:
            self._beat.stop()

    def close(self) -> None:
        super().close()
        self._beat.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
