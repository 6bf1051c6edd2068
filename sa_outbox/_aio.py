"""asyncio parity: :class:`AsyncDispatcher` and :class:`AsyncWorker`.

Same constructors (an :class:`~sqlalchemy.ext.asyncio.AsyncEngine` instead of an ``Engine``), same options,
same methods awaited (``run_once``, ``run``) plus ``stop``. The statements, the claim/finalize steps and the
decision of what a result means are the sync classes' own: the database steps run through
``AsyncConnection.run_sync`` on the psycopg async driver, and the async classes keep a sync core object for
options, classification, counters and logs. Only the loop differs: awaiting publishers/handlers, sleeping
and waiting for NOTIFY on an async connection.

* Publishers may define ``async def publish`` (or ``publish_many``): a batch is published concurrently, at
  most ``publish_concurrency`` at a time. In ordered mode a batch holds at most one message per ordered
  aggregate (only heads are claimable), so concurrency never reorders one. A sync publisher never runs on
  the event loop: each batch goes through the sync dispatcher's own publishing step (id order, lease
  budget, ``enforce_publish_timeout``) in one thread.
* Handlers may be ``async def``; sync handlers run in threads. At most ``concurrency`` run at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg import sql as psql
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from tenacity import AsyncRetrying

from . import _steps as eng
from ._dbfaults import is_connection_error
from ._dispatcher import Dispatcher, check_batch, check_result, publisher_is_async
from ._loop import LoopBase, is_async_callable
from ._messages import ClaimedJob, Message
from ._wakeup import libpq_url
from ._worker import _NOT_STARTED, Worker
from .errors import ConfigurationError, RetryableError

__all__ = ["AsyncDispatcher", "AsyncWorker"]

T = TypeVar("T")
log = logging.getLogger("sa_outbox.aio")


class _AsyncWaker:
    """LISTEN on an async psycopg connection; wakes on a notification, a timeout or stop."""

    def __init__(self, url: str | None, channels: list[str]) -> None:
        self.url = url
        self.channels = channels
        self.conn: psycopg.AsyncConnection[Any] | None = None
        self.next_try = 0.0

    async def wait(self, timeout: float, stop: asyncio.Event) -> bool:
        if self.url is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout)
            return False
        if self.conn is None and time.monotonic() >= self.next_try:
            try:
                self.conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
                for ch in self.channels:
                    await self.conn.execute(psql.SQL("LISTEN {}").format(psql.Identifier(ch)))
            except psycopg.Error as exc:
                log.warning("LISTEN connection failed, polling only for now: %s", exc)
                self.conn, self.next_try = None, time.monotonic() + 5.0
        if self.conn is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout)
            return False
        listener = asyncio.ensure_future(self._one(self.conn, timeout))
        stopper = asyncio.ensure_future(stop.wait())
        done, pending = await asyncio.wait({listener, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, psycopg.Error):
                await task
        if listener in done:
            try:
                return bool(listener.result())
            except psycopg.Error:
                await self.close()
        return False

    async def _one(self, conn: psycopg.AsyncConnection[Any], timeout: float) -> bool:
        async for _ in conn.notifies(timeout=timeout, stop_after=1):
            return True
        return False

    async def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.close()


class _AsyncLoop:
    """The asyncio loop around a sync core (Dispatcher/Worker) that owns options, statements and decisions."""

    core: LoopBase

    def __init__(self, engine: AsyncEngine, listen: bool, listen_url: str | None) -> None:
        if not isinstance(engine, AsyncEngine):
            raise ConfigurationError(f"engine must be a sqlalchemy AsyncEngine, got {type(engine).__name__}")
        self.engine = engine
        self._stop = asyncio.Event()
        self._conn: AsyncConnection | None = None
        url = listen_url or engine.url
        self._waker = _AsyncWaker(libpq_url(url) if listen else None, self.core._waker._channels)
        self._running = False

    @property
    def stats(self) -> Any:
        return self.core.stats

    @property
    def owner(self) -> str:
        return self.core.owner

    async def _db(self, fn: Callable[[Connection], T]) -> T:
        if self._conn is None or self._conn.closed:
            self._conn = await self.engine.connect()
            await self._conn.execution_options(isolation_level="AUTOCOMMIT")
        try:
            return await self._conn.run_sync(fn)
        except BaseException:
            await self._drop()
            raise

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def _claim(self, rescue: bool) -> list[Any]:
        return await self._db(lambda c: self.core._claim_rows_on(c, rescue=rescue))

    async def _finalize(self, outcomes: list[eng.Outcome]) -> None:
        """Finalize now, with the sync loops' retry policy for connection faults."""
        applied: set[int] = set()
        async for attempt in AsyncRetrying(**self.core._retry_policy(self.core._finalize_window())):
            with attempt:
                applied = await self._db(lambda c: eng.finalize(c, self.core.spec, outcomes))
        self.core._report(outcomes, applied)

    async def _settle(self, outcomes: list[eng.Outcome]) -> None:
        if self._running and not self._stop.is_set():
            self.core._pending = outcomes
        else:
            await self._finalize(outcomes)

    async def _flush(self) -> None:
        pending, self.core._pending = self.core._pending, []
        if pending:
            await self._finalize(pending)

    async def _step(self, rescue: bool) -> int:
        raise NotImplementedError

    async def run_once(self) -> int:
        """One rescue step plus one claimed batch, handled and finalized; returns how many rows it claimed."""
        self.core._last_rescue = time.monotonic()
        try:
            n = await self._step(True)
            await self._flush()
            return n
        finally:
            if not self._running:
                await self._drop()

    def stop(self) -> None:
        """No new claims; the batch in hand is finished and finalized, then :meth:`run` returns."""
        self._stop.set()
        self.core.stop()

    async def run(self, *, install_signal_handlers: bool = True, until_idle: bool = False) -> None:
        """Loop until :meth:`stop`, SIGTERM/SIGINT (when installed) or cancellation; database connection faults
        are retried with capped exponential backoff."""
        loop = asyncio.get_running_loop()
        if install_signal_handlers:
            for s in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(s, self.stop)
        self._running = True
        self.core._running = True
        failures = 0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                rescue = now - self.core._last_rescue >= self.core._rescue_every
                if rescue:
                    self.core._last_rescue = now
                try:
                    claimed = await self._step(rescue)
                    failures = 0
                except Exception as exc:
                    if not is_connection_error(exc):
                        raise
                    failures += 1
                    self.stats.db_errors += 1
                    wait = self.core._outage_delay(failures)
                    log.warning("database unavailable (%s), retrying in %.2fs", type(exc).__name__, wait)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), wait)
                    continue
                if claimed == 0 and until_idle:
                    break
                if claimed == 0 and await self._waker.wait(self.core.poll_interval, self._stop):
                    self.stats.wakeups += 1
        finally:
            self._running = False
            self.core._running = False
            try:
                await self._flush()
            finally:
                await self._waker.close()
                await self._drop()
                if install_signal_handlers:
                    for s in (signal.SIGTERM, signal.SIGINT):
                        with contextlib.suppress(NotImplementedError, RuntimeError):
                            loop.remove_signal_handler(s)

    async def close(self) -> None:
        await self._waker.close()
        await self._drop()


class _DispatcherCore(Dispatcher):
    """The sync dispatcher an AsyncDispatcher keeps for options and decisions; async publishers allowed."""

    _awaits_publisher = True


class _WorkerCore(Worker):
    """The sync worker an AsyncWorker keeps for options, decisions and sync handlers; async handlers allowed."""

    _awaits_handlers = True


class AsyncDispatcher(_AsyncLoop):
    """The :class:`~sa_outbox.Dispatcher` under asyncio; same options, plus ``publish_concurrency``
    (messages of one batch published at once, default 16)."""

    def __init__(
        self,
        engine: AsyncEngine,
        model: type[Any],
        publisher: Any,
        *,
        publish_concurrency: int = 16,
        **options: Any,
    ) -> None:
        listen, listen_url = options.pop("listen", True), options.pop("listen_url", None)
        if not isinstance(engine, AsyncEngine):
            raise ConfigurationError(f"engine must be a sqlalchemy AsyncEngine, got {type(engine).__name__}")
        self.core: Dispatcher = _DispatcherCore(engine.sync_engine, model, publisher, listen=False, **options)
        if (
            isinstance(publish_concurrency, bool)
            or not isinstance(publish_concurrency, int)
            or publish_concurrency < 1
        ):
            raise ConfigurationError(
                f"publish_concurrency must be an integer >= 1, got {publish_concurrency!r}"
            )
        self.publish_concurrency = publish_concurrency
        self.publisher = publisher
        self._async_publisher = publisher_is_async(publisher)
        super().__init__(engine, listen, listen_url)

    async def _publish_one(self, msg: Message, gate: asyncio.Semaphore) -> BaseException | None:
        core = self.core
        async with gate:
            try:
                started = time.perf_counter()
                timeout = core.publish_timeout.total_seconds() if core.enforce_publish_timeout else None
                try:
                    result = await asyncio.wait_for(self.publisher.publish(msg), timeout)
                except TimeoutError as exc:  # ours only when a timeout was set; else the publisher's own
                    return core._timed_out() if timeout is not None else exc
                core._observe_handled(started, msg.created_at)
                return check_result(result)
            except Exception as exc:
                return exc

    async def _step(self, rescue: bool) -> int:
        core = self.core
        messages = [Message.from_row(r) for r in await self._claim(rescue)]
        if not messages:
            return 0
        if not self._async_publisher:
            # A sync publisher (pika, a blocking HTTP client) never runs on the event loop: the sync
            # dispatcher's own publishing step — id order, lease budget, publish_timeout, release on stop —
            # runs in one thread per batch.
            outcomes, fatal = await asyncio.to_thread(core._publish, messages, time.monotonic())
        else:
            outcomes, fatal = core._outcomes(
                list(zip(messages, await self._publish_async(messages), strict=True))
            )
        if fatal is not None:
            await self._finalize(outcomes)
            raise fatal
        await self._settle(outcomes)
        return len(messages)

    async def _publish_async(self, messages: list[Message]) -> list[BaseException | None]:
        """The batch's publish results; the whole batch is bounded by the lease budget (lease −
        publish_timeout): what is still running then is cancelled and retried, never finished on an expired
        lease."""
        core = self.core
        budget = (core.lease - core.publish_timeout).total_seconds()
        if hasattr(self.publisher, "publish_many"):
            batch: Any = self.publisher.publish_many(messages)
        else:
            # publish_concurrency at a time (in ordered mode a batch holds one message per aggregate).
            gate = asyncio.Semaphore(self.publish_concurrency)
            batch = asyncio.gather(*(self._publish_one(m, gate) for m in messages))
        try:
            return check_batch(await asyncio.wait_for(batch, budget), len(messages))
        except TimeoutError:
            return [RetryableError("publish batch exceeded the lease budget")] * len(messages)
        except Exception as exc:
            return [exc] * len(messages)


class AsyncWorker(_AsyncLoop):
    """The :class:`~sa_outbox.Worker` under asyncio; ``async def`` handlers are awaited, at most
    ``concurrency`` at once; sync handlers run in threads."""

    def __init__(self, engine: AsyncEngine, model: type[Any], handlers: Any = None, **options: Any) -> None:
        listen, listen_url = options.pop("listen", True), options.pop("listen_url", None)
        if not isinstance(engine, AsyncEngine):
            raise ConfigurationError(f"engine must be a sqlalchemy AsyncEngine, got {type(engine).__name__}")
        options.setdefault("heartbeat", 0)  # the async worker beats from its own loop
        self.core: Worker = _WorkerCore(engine.sync_engine, model, handlers, listen=False, **options)
        super().__init__(engine, listen, listen_url)

    def task(self, name: str | None = None) -> Any:
        return self.core.task(name)

    async def _call(self, job: ClaimedJob, handler: Any, gate: asyncio.Semaphore) -> object:
        async with gate:
            if self._stop.is_set():
                return _NOT_STARTED
            try:
                started = time.perf_counter()
                # A timed-out coroutine is cancelled (unlike a sync handler's thread, which is abandoned).
                await asyncio.wait_for(handler(job), self.core.handler_timeout)
                self.core._observe_handled(started, job.created_at)
                return None
            except TimeoutError as exc:  # ours only when handler_timeout is set; else the handler's own
                return self.core._timed_out() if self.core.handler_timeout is not None else exc
            except Exception as exc:
                return exc

    async def _handle(self, jobs: list[ClaimedJob]) -> list[object]:
        """``async def`` handlers are awaited here, at most ``concurrency`` at once; the batch's other jobs
        (sync handlers, unknown tasks) go through the sync worker's own step in one thread. A batch with both
        runs the two groups one after the other, so ``concurrency`` bounds each moment."""
        core = self.core
        handlers = [core._handler_for(j) for j in jobs]
        is_async = [is_async_callable(h) for h in handlers]
        results: list[object] = [None] * len(jobs)
        sync_at = [i for i, a in enumerate(is_async) if not a]
        if sync_at:
            done = await asyncio.to_thread(core._handle, [jobs[i] for i in sync_at])
            for i, result in zip(sync_at, done, strict=True):
                results[i] = result
        async_at = [i for i, a in enumerate(is_async) if a]
        if async_at:
            gate = asyncio.Semaphore(core.concurrency)
            done = await asyncio.gather(*(self._call(jobs[i], handlers[i], gate) for i in async_at))
            for i, result in zip(async_at, done, strict=True):
                results[i] = result
        return results

    async def _heartbeat(self, jobs: list[ClaimedJob], interval: float) -> None:
        pairs = [(j.id, j.lease_version) for j in jobs]
        while True:
            await asyncio.sleep(interval)
            try:
                async with self.engine.connect() as conn:
                    await conn.execution_options(isolation_level="AUTOCOMMIT")
                    await conn.run_sync(lambda c: eng.extend(c, self.core.spec, pairs))
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)

    async def _step(self, rescue: bool) -> int:
        core = self.core
        jobs = [ClaimedJob.from_row(r) for r in await self._claim(rescue)]
        if not jobs:
            return 0
        beat = asyncio.ensure_future(self._heartbeat(jobs, core.stale_after.total_seconds() / 4))
        try:
            results = await self._handle(jobs)
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
        outcomes, fatal = core._outcomes(jobs, results)
        if fatal is not None:
            await self._finalize(outcomes)
            raise fatal
        await self._settle(outcomes)
        return len(jobs)
