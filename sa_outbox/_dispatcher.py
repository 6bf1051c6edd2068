"""The outbox dispatcher: claim with a lease, publish outside any transaction, finalize fenced.

One turn: (1) one statement writes the previous batch's outcomes — each row fenced by its own
``lease_version`` — and claims up to ``batch`` due rows, writing status/owner/lease/``lease_version + 1``/
``attempts + 1``, committed at once; (2) every message is published with no transaction or row lock open. A
row whose lease was rescued or re-claimed meanwhile is not touched (a *lost lease*: logged, counted, never
raised) — the message may then be published twice, which is why downstream must de-duplicate by
``message_id``.

**The lease budget.** Messages are published in id order; before each one the dispatcher checks that its lease
still has at least ``publish_timeout`` left (measured from the claim). When it does not, the rest of the batch
is *released* (back to pending, attempt refunded) instead of published on a lease that may already be gone.
A publisher's ``publish_many`` (sync or async) is bounded by the same budget as a whole: what is unfinished
then is retried. The same release happens on :meth:`stop`.

**Ordered mode.** Only the head of each aggregate is claimable. The statement that writes a batch's outcomes
also claims the events that its ``done`` outcomes unblocked (its probes read the finalize's RETURNING: the
shared snapshot still shows those rows as ``processing``), so a hot aggregate is delivered at the publisher's
speed, one statement per batch, not one event per poll.

**Outages.** A :class:`~sa_outbox.DestinationUnavailable` (every shipped publisher raises it when its broker
cannot be reached) refunds the attempt, releases the rest of the batch untouched and opens the dispatcher's
circuit: no claims for an outage backoff, then one probe message; a probe that gets through closes it. An
outage therefore never spends attempts and never sends a message (or an ordered aggregate) to ``dead``.

**Unclassified exceptions** from a publisher are logged at ERROR with their traceback, recorded in
``last_error`` and retried like :class:`~sa_outbox.RetryableError`; with ``stop_on_unclassified=True`` the
batch is finalized and the exception re-raised out of ``run_once``/``run`` instead.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Collection, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, ClassVar

from sqlalchemy import Engine
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine
from tenacity import AsyncRetrying, Retrying

from . import _tracing
from ._backoff import DATABASE_OUTAGE, OUTBOX_BACKOFF, Backoff
from ._base import (
    ABANDON_AFTER_CANCEL,
    CLAIM_GRACE,
    LoopBase,
    _loop_running,
    install_async_signals,
    is_async_callable,
    one_async_run_at_a_time,
    one_run_at_a_time,
    run_to_end,
    stray_cancellation,
    through_cancellation,
)
from ._db import AsyncLoopConnection, LoopConnection
from ._durations import Duration, positive_int, to_timedelta
from ._messages import BatchPublisher, Message, Publisher
from ._names import RESERVED_ID_PREFIX
from ._services import Circuit, ClaimForms
from ._steps import RELEASED_UNAVAILABLE, Outcome, passed_over
from ._threads import CallThreads
from ._wakeup import AsyncWaker, Waker
from .errors import ConfigurationError, DestinationUnavailable, NoAnswer, RetryableError

__all__ = ["AsyncDispatcher", "Dispatcher"]

log = logging.getLogger("sa_outbox.dispatcher")

_STOPPING = "released: dispatcher stopping"
_BUDGET = "released: lease budget spent"
#: A publish cut short by a cancellation from outside the batch (an event loop's teardown): not an answer
#: overdue, so no attempt spent — as a worker gives back a job whose handler was cancelled.
_CUT_SHORT = "released: cancelled"
_UNAVAILABLE = RELEASED_UNAVAILABLE


def publisher_is_async(publisher: Any) -> bool:
    """Whether the method a dispatcher calls — ``publish_many`` when there is one, else ``publish`` — must be
    awaited (AsyncDispatcher awaits it; Dispatcher refuses it)."""
    return is_async_callable(getattr(publisher, "publish_many", None) or publisher.publish)


#: The longest ``message_id_prefix``: the id then fits every broker's id slot (an AMQP shortstr is 255 bytes).
MESSAGE_ID_PREFIX_MAX = 64


def check_message_id_prefix(prefix: Any) -> str:
    """``message_id_prefix``: printable ASCII without spaces (it travels in header values and AMQP's
    ``message_id``), at most :data:`MESSAGE_ID_PREFIX_MAX` characters; else a :class:`ConfigurationError`."""
    if not isinstance(prefix, str):
        raise ConfigurationError(f"message_id_prefix must be a string, got {prefix!r:.80}")
    if len(prefix) > MESSAGE_ID_PREFIX_MAX:
        raise ConfigurationError(
            f"message_id_prefix is {len(prefix)} characters, at most {MESSAGE_ID_PREFIX_MAX}: {prefix[:40]!r}…"
        )
    if prefix.startswith(RESERVED_ID_PREFIX):
        raise ConfigurationError(
            f"message_id_prefix {prefix!r:.80}: {RESERVED_ID_PREFIX!r} is reserved for the inbox's own rows"
        )
    if not all("!" <= ch <= "~" for ch in prefix):
        raise ConfigurationError(
            f"message_id_prefix {prefix!r:.80}: printable ASCII without spaces only (it travels in header values)"
        )
    return prefix


def check_batch(errors: Any, count: int) -> list[BaseException | None]:
    """A ``publish_many`` result: one entry per message, else a bug in the publisher (retryable for all)."""
    results = list(errors)
    if len(results) != count:
        raise TypeError(f"publish_many returned {len(results)} results for {count} messages")
    return results


def check_result(result: Any) -> BaseException | None:
    """A publisher returns None; anything else is a bug in it, handled as a retryable failure."""
    if result is None:
        return None
    return TypeError(f"publisher returned {result!r}; publish() must return None or raise")


class DispatcherBase(LoopBase):
    """Options, validation and decisions of :class:`Dispatcher` and :class:`AsyncDispatcher` (no loop).

    Options (durations take a ``timedelta`` or seconds):

    * ``batch`` — rows claimed per statement (default 50);
    * ``lease`` — how long a claim is owned (default 60 s); ``publish_timeout`` — the longest one publish may
      take (default 10 s; the publisher bounds its own I/O, or set ``enforce_publish_timeout``). The
      constructor refuses ``lease <= publish_timeout``;
    * ``max_attempts`` — claims before a message is dead (default 12, counting crashes; outages refund);
    * ``ordered`` — ``True`` for per-aggregate order on every event type, or a collection of event types
      that are ordered (others are claimed freely);
    * ``backoff`` — retry policy (default full jitter, base 1 s, cap 300 s);
    * ``poll_interval`` — longest idle wait (default 1 s); ``listen`` — LISTEN/NOTIFY wake-ups (default on),
      on ``listen_url`` if given (use the server's direct address behind PgBouncer);
    * ``stop_on_unclassified``, ``rescue_limit``, ``owner``, ``enforce_publish_timeout`` (run each publish on
      a helper thread and treat one that outlives ``publish_timeout`` as retryable);
    * ``give_up_after`` — a message written longer ago than this (database clock) that still cannot be
      delivered goes to ``dead`` at its next failure, whatever the reason — outages and deferrals included
      (default: never);
    * ``maintain_partitions`` — for a partitioned table (docs/partitioning.md): run
      :func:`~sa_outbox.maintain_partitions` at start and then every this often (e.g. ``3600``), off the loop
      on a connection of its own (default: never);
    * ``message_id_prefix`` — put before each message's id in ``message_id`` (default none: ``"42"``). An
      outbox table numbers its events from 1, so the ids of two services' outboxes (or two tables) meet: give
      each its own prefix (``"orders:"``) when they publish into one stream with broker-side de-duplication
      (NATS JetStream's ``Nats-Msg-Id``) or feed one consumer's inbox. Printable ASCII without spaces, at most
      64 characters; keep it for the table's lifetime (a changed prefix makes every message a new one).
    """

    _kind = "outbox"
    _owner_prefix = "dispatcher"
    _log = log
    #: Whether this flavour can await an async publisher.
    _awaits_publisher: ClassVar[bool] = False

    def __init__(
        self,
        engine: Any,
        model: type[Any],
        publisher: Publisher,
        *,
        owner: str | None = None,
        batch: int = 50,
        lease: Duration = 60.0,
        publish_timeout: Duration = 10.0,
        max_attempts: int = 12,
        ordered: bool | Collection[str] = False,
        backoff: Backoff | None = None,
        poll_interval: Duration = 1.0,
        listen: bool = True,
        listen_url: str | URL | None = None,
        stop_on_unclassified: bool = False,
        rescue_limit: int = 1000,
        enforce_publish_timeout: bool = False,
        give_up_after: Duration | None = None,
        maintain_partitions: Duration | None = None,
        message_id_prefix: str = "",
    ) -> None:
        super().__init__(
            engine, model, owner=owner, batch=batch, poll_interval=poll_interval, listen=listen,
            listen_url=listen_url, stop_on_unclassified=stop_on_unclassified, rescue_limit=rescue_limit,
            backoff=backoff or OUTBOX_BACKOFF, maintain_partitions=maintain_partitions,
            give_up_after=give_up_after,
        )  # fmt: skip
        if not callable(getattr(publisher, "publish", None)):
            raise ConfigurationError(f"publisher {publisher!r} has no publish(message) method")
        if publisher_is_async(publisher) and not self._awaits_publisher:
            raise ConfigurationError(
                f"publisher {publisher!r} is async: Dispatcher would never await it; run it with AsyncDispatcher"
            )
        self.publisher = publisher
        self.lease: timedelta = to_timedelta(lease, name="lease", allow_zero=False)
        self.publish_timeout: timedelta = to_timedelta(
            publish_timeout, name="publish_timeout", allow_zero=False
        )
        if self.lease <= self.publish_timeout:
            raise ConfigurationError(
                f"lease ({self.lease.total_seconds():g}s) must be longer than publish_timeout "
                f"({self.publish_timeout.total_seconds():g}s): a publish could outlive its lease and be "
                "delivered twice. Raise lease or lower publish_timeout"
            )
        self.max_attempts = positive_int(max_attempts, "max_attempts")
        if isinstance(ordered, bool):
            self.ordered, self.ordered_types = ordered, None
        elif isinstance(ordered, str) or not all(isinstance(t, str) and t for t in ordered):
            raise ConfigurationError("ordered must be True/False or a collection of event type names")
        else:
            self.ordered, self.ordered_types = True, sorted(set(ordered))
        #: The next claim's form: the ordered claim's walk or heads (only with every type ordered, not
        #: partitioned); passing over or locking the rows other transactions hold.
        self._forms = ClaimForms(
            self.ordered and self.ordered_types is None and self.spec.period is None, settle=True
        )
        self.enforce_publish_timeout = bool(enforce_publish_timeout)
        self.message_id_prefix = check_message_id_prefix(message_id_prefix)
        self._batch_publish = isinstance(publisher, BatchPublisher)
        self._calls = CallThreads("sa_outbox-publish")
        self._circuit = Circuit()
        self._fatal: BaseException | None = None

    @property
    def circuit_open(self) -> bool:
        """True while the destination is considered unavailable (no claims but probes)."""
        return self._circuit.open

    # -- decisions -------------------------------------------------------------------------------------

    def _claim_params(self) -> list[dict[str, Any]]:
        return [
            {
                "lease": self.lease,
                "ordered": self.ordered,
                "ordered_types": self.ordered_types,
                "heads": self._forms.next(),
                "settle": self._forms.settle(self._claimed_short),
            }
        ]

    def _rescue_params(self) -> dict[str, Any]:
        return {"max_attempts": self.max_attempts, "limit": self.rescue_limit, "kept": self._done.leases()}

    def _lease_seconds(self) -> float:
        return self.lease.total_seconds()

    def _outage_retry_cap(self) -> float:
        """A dispatcher out of reach of the database tries again at least this often (``lease / 4``, at most
        the 30 s of every loop): it may hold outcomes of a published batch whose leases are running out, and
        writes them as soon as it is back — within the other dispatchers' :meth:`_fault_grace`."""
        return min(DATABASE_OUTAGE.cap, self.lease.total_seconds() / 4)

    def _fault_grace(self) -> float:
        """After a database fault (and, for recent leases, when run() starts) the rescue waits 1.5 ×
        :meth:`_outage_retry_cap`: the other dispatchers, cut off too, are back meanwhile and write the
        outcomes of what they published before this one's rescue could take those rows and publish them
        again."""
        return 1.5 * self._outage_retry_cap()

    def _finalize_window(self) -> float:
        return max(self.lease.total_seconds(), 1.0)

    def _budget_end(self, claimed_at: float) -> float:
        """Monotonic time after which no publish may start: the lease minus one publish_timeout."""
        return claimed_at + (self.lease - self.publish_timeout).total_seconds()

    def _want(self, *, one_shot: bool) -> int:
        if self._stopped() or self._fatal is not None:
            return 0
        return self.batch if one_shot else self._circuit.want(self.batch, time.monotonic())

    def _timed_out(self) -> RetryableError:
        """A publish that overran publish_timeout: no answer in time, retried like any transient fault but
        never dead for it (:class:`NoAnswer`; it may have reached the broker: counted in ``stats.timed_out``)."""
        self.stats.timed_out += 1
        return NoAnswer(f"publish exceeded publish_timeout ({self.publish_timeout.total_seconds():g}s)")

    def _over_budget(self) -> RetryableError:
        # a batch that ran out of its lease budget was slow to be answered, not refused: no verdict (NoAnswer)
        return NoAnswer(
            f"publishing the batch exceeded the lease budget (lease {self.lease.total_seconds():g}s "
            f"- publish_timeout {self.publish_timeout.total_seconds():g}s); the unfinished messages are retried"
        )

    def _released(self, messages: Sequence[Message], reason: str) -> list[Outcome]:
        return [self._release(m.id, m.lease_version, reason) for m in messages]

    def _messages(self, rows: Sequence[Any]) -> list[Message]:
        """Claimed rows as messages; each one's age at the claim is kept for ``give_up_after``."""
        self._ages = {r[0]: r[-1] for r in rows}
        prefix = self.message_id_prefix
        return [Message.from_row(r, self._loads, prefix) for r in rows]

    def _classify(self, results: Sequence[tuple[Message, BaseException | None]]) -> list[Outcome]:
        """Publish results → outcomes (the first fatal error is kept to be raised after finalizing)."""
        outcomes: list[Outcome] = []
        for msg, error in results:
            outcome, fatal = self._outcome(
                id=msg.id, lease_version=msg.lease_version, attempts=msg.attempts, max_attempts=self.max_attempts,
                error=error, label=f"the publisher (outbox {msg.id})",
            )  # fmt: skip
            outcomes.append(outcome)
            if fatal is not None and self._fatal is None:
                self._fatal = fatal
        return outcomes

    def _probed_nothing(self) -> None:
        """A probe claimed no row (another dispatcher delivered the backlog): nothing shows the destination is
        still down, so the circuit closes."""
        if self._circuit.nothing_to_probe():
            outage = time.monotonic() - self._circuit.opened_at
            log.info(
                "destination considered available again after %.1fs (nothing left to probe)", outage,
                extra={"table": self.spec.table.name, "owner": self.owner, "outage_seconds": round(outage, 3)},
            )  # fmt: skip

    def _settle(self, outcomes: list[Outcome]) -> None:
        """Queue a batch's outcomes for writing and let the circuit breaker learn from them."""
        self._done.add(outcomes)
        now = time.monotonic()
        change = self._circuit.record(outcomes, now)
        if change == "opened":
            cause = next((o.error for o in outcomes if o.kind == "unavailable"), "?")
            log.warning(
                "destination unavailable: not claiming for a while, then one probe message (%s)", cause,
                extra={"table": self.spec.table.name, "owner": self.owner, "cause": cause},
            )  # fmt: skip
        elif change == "closed":
            outage = now - self._circuit.opened_at
            log.info(
                "destination available again after %.1fs", outage,
                extra={"table": self.spec.table.name, "owner": self.owner, "outage_seconds": round(outage, 3)},
            )  # fmt: skip

    # -- publishing with a blocking publisher (the sync loop, and the async loop in a thread) -------------

    def _publish_blocking(self, messages: list[Message], claimed_at: float) -> list[Outcome]:
        """Publish a claimed batch with a blocking publisher; one outcome per message. Never raises."""
        if self._stopped():
            return self._released(messages, _STOPPING)
        budget_end = self._budget_end(claimed_at)
        if self._batch_publish:
            remaining = budget_end - time.monotonic()
            if remaining <= 0:
                return self._released(messages, _BUDGET)
            started = time.perf_counter()
            future = self._calls.submit(self._publish_many_blocking, messages)
            try:
                errors = future.result(timeout=remaining)
            except FutureTimeout:
                self._calls.abandon(future)  # its thread is stuck in the publisher: never used again
                errors = [self._over_budget()] * len(messages)
            except BaseException as exc:  # Ctrl-C (KeyboardInterrupt) while this thread waits: the batch is
                # recorded as failed with it — then raised — and its thread left to finish on its own
                self._calls.abandon(future)
                errors = [exc] * len(messages)
            seconds = time.perf_counter() - started
            for m in messages:
                self._observe_handled(seconds, m.created_at)
            return self._classify(list(zip(messages, errors, strict=True)))
        results: list[tuple[Message, BaseException | None]] = []
        rest: list[Outcome] = []
        # No tracer provider: no span to open around each publish — asked once per batch, not per message (the
        # span's context manager and the provider's lookup cost several µs a message, as much as the rest of
        # a no-op publish's client work); a provider set meanwhile is seen from the next batch.
        quiet = _tracing.provider_unset()
        for i, msg in enumerate(messages):
            if self._stopped() or time.monotonic() > budget_end:
                rest = self._released(messages[i:], _STOPPING if self._stopped() else _BUDGET)
                break
            started = time.perf_counter()
            error = self._call_publish(msg) if quiet else self._publish_one_blocking(msg)
            self._observe_handled(time.perf_counter() - started, msg.created_at)
            results.append((msg, error))
            if isinstance(error, DestinationUnavailable):
                rest = self._released(messages[i + 1 :], _UNAVAILABLE)
                break
            if isinstance(error, SystemExit | KeyboardInterrupt):
                # the process is leaving: nothing more is published; the batch's outcomes are written, then
                # the loop raises it
                rest = self._released(messages[i + 1 :], _STOPPING)
                break
        return self._classify(results) + rest

    def _publish_many_blocking(self, messages: list[Message]) -> list[BaseException | None]:
        with _tracing.publish_spans(messages, publisher=self.publisher) as spans:
            try:
                errors = check_batch(self.publisher.publish_many(messages), len(messages))  # type: ignore[attr-defined]
            except BaseException as exc:
                errors = [exc] * len(messages)  # SystemExit/KeyboardInterrupt too: recorded, then raised
            spans.outcomes(errors)
        return errors

    def _publish_one_blocking(self, msg: Message) -> BaseException | None:
        with _tracing.publish_span(msg, publisher=self.publisher) as span:
            error = self._call_publish(msg)
            span.outcome(error)
        return error

    def _call_publish(self, msg: Message) -> BaseException | None:
        try:
            publisher: Any = self.publisher
            if not self.enforce_publish_timeout:
                return check_result(publisher.publish(msg))
            # the publish span stays current in the helper thread (for the publisher's own instrumentation)
            future = self._calls.submit(contextvars.copy_context().run, publisher.publish, msg)
            try:
                return check_result(future.result(timeout=self.publish_timeout.total_seconds()))
            except FutureTimeout:
                self._calls.abandon(future)  # its thread is stuck in the publisher: never used again
                return self._timed_out()
            except (KeyboardInterrupt, SystemExit):
                if not future.done():  # delivered to this thread while it waited: leave the call behind
                    self._calls.abandon(future)
                raise
        except BaseException as exc:
            return exc  # SystemExit/KeyboardInterrupt too: recorded with what finished, then raised

    def _raise_fatal(self) -> None:
        fatal, self._fatal = self._fatal, None
        if fatal is not None:
            raise fatal


class Dispatcher(DispatcherBase):
    """Delivers outbox rows to a :class:`~sa_outbox.Publisher`; run as many side by side as you like
    (processes, hosts). See the module docs for what it guarantees and :class:`DispatcherBase` for options."""

    _engine_types = (Engine,)

    def __init__(
        self,
        engine: Engine,
        model: type[Any],
        publisher: Publisher,
        *,
        owner: str | None = None,
        batch: int = 50,
        lease: Duration = 60.0,
        publish_timeout: Duration = 10.0,
        max_attempts: int = 12,
        ordered: bool | Collection[str] = False,
        backoff: Backoff | None = None,
        poll_interval: Duration = 1.0,
        listen: bool = True,
        listen_url: str | URL | None = None,
        stop_on_unclassified: bool = False,
        rescue_limit: int = 1000,
        enforce_publish_timeout: bool = False,
        give_up_after: Duration | None = None,
        maintain_partitions: Duration | None = None,
        message_id_prefix: str = "",
    ) -> None:
        super().__init__(
            engine, model, publisher, owner=owner, batch=batch, lease=lease, publish_timeout=publish_timeout,
            max_attempts=max_attempts, ordered=ordered, backoff=backoff, poll_interval=poll_interval,
            listen=listen, listen_url=listen_url, stop_on_unclassified=stop_on_unclassified,
            rescue_limit=rescue_limit, enforce_publish_timeout=enforce_publish_timeout,
            give_up_after=give_up_after, maintain_partitions=maintain_partitions,
            message_id_prefix=message_id_prefix,
        )  # fmt: skip
        self.engine: Engine = engine
        self._db = LoopConnection(engine, self.spec.table.name)
        self._waker = Waker(self.listen_url, self.channels)

    def _poke(self) -> None:
        self._waker.poke()

    # -- public ----------------------------------------------------------------------------------------

    @one_run_at_a_time
    def run_once(self) -> int:
        """One rescue step plus one claimed batch, published and finalized; returns how many messages this
        call claimed (rescued rows not counted). An explicit call claims even while the circuit is open."""
        try:
            self._rescue(force=True)
            claimed = self._turn(one_shot=True)[0]
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
        """Loop until :meth:`stop`, SIGTERM or SIGINT (or, with ``until_idle``, until a claim comes back empty;
        with ``max_batches``, after that many claims). Expired leases are rescued at most once a second.
        Database connection faults are logged and retried with capped exponential backoff; the loop never
        spins hot on an empty queue, a dead server or a dead broker. ``startup_timeout``: a database never
        reached within this long after start raises :class:`~sa_outbox.ConfigurationError`."""
        restore = self._install_signals() if install_signal_handlers else None
        policy = self._start_run(startup_timeout, drain=until_idle)
        batches = 0
        try:
            while not self._stopped() and self._fatal is None:
                try:
                    claimed, wanted = self._turn(one_shot=False)
                    self._turn_went_through(policy)
                except Exception as exc:
                    delay = policy.failed(exc)
                    self.stats.db_errors += 1
                    self._db_fault()
                    self._waker.wait_out(delay)  # (not ended by a notification: the turn it wakes failed)
                    continue
                if wanted:
                    batches += 1
                    if max_batches is not None and batches >= max_batches:
                        break
                if until_idle and wanted and not claimed and not len(self._done) and not self._put_back_due():
                    break
                self._wait(claimed, wanted)
        finally:
            try:
                self._end()
            finally:
                if restore:
                    restore()
                self._lifecycle("stopped")
        self._raise_fatal()

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
        self._calls.close()

    # -- one turn --------------------------------------------------------------------------------------

    def _turn(self, *, one_shot: bool) -> tuple[int, int]:
        # the rescue step first: nothing may fail between a claim and the publish of what it claimed (the
        # rows would sit leased to this loop, unknown to it, until their lease ran out)
        self._rescue()
        wanted = self._want(one_shot=one_shot)
        claimed_at = time.monotonic()
        rows = self._claim(wanted) if wanted else []
        if not wanted and len(self._done):
            self._flush()
        if rows:
            self._settle(self._publish_blocking(self._messages(rows), claimed_at))
        elif wanted:
            self._probed_nothing()
        return len(rows), wanted

    def _wait(self, claimed: int, wanted: int) -> None:
        if claimed or len(self._done):
            return  # more may be waiting, or outcomes ride on the next claim (which may find new rows)
        timeout = self._next_deadline(poll=not self._circuit.open)
        reopen = self._circuit.next_due()
        if reopen is not None:
            timeout = min(timeout, max(0.0, reopen - time.monotonic()))
        if self._waker.wait(timeout) == "notify":
            self.stats.wakeups += 1

    def _claim(self, want: int) -> list[Any]:
        outcomes = self._done.take()
        started = time.perf_counter()
        try:
            applied, rows = self._db.run(lambda c: self._claim_on(c, want, outcomes))
        except BaseException:
            self._done.add(outcomes)
            raise
        self._forms.took(time.perf_counter() - started)
        self._report(outcomes, applied)
        if not rows and self._forms.walk_before_nothing():
            rows = self._db.run(lambda c: self._claim_on(c, want, []))[1]
        self._forms.claimed(len(rows), want, passed_over(rows))
        return rows

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
            self._db.run(self._rescue_on)

    def _end(self) -> None:
        try:
            self._flush()
        except Exception:
            self.ended_unrecorded = True
            log.exception("could not finalize the last batch; its leases will expire and be rescued")
        finally:
            self._waker.close()
            self._db.drop()


class AsyncDispatcher(DispatcherBase):
    """The :class:`Dispatcher` under asyncio, with the same options and guarantees, plus
    ``publish_concurrency`` (messages of one batch published at once by an async publisher, default 16; in
    ordered mode a batch holds at most one message per ordered aggregate, so this never reorders one). A
    sync publisher never runs on the event loop: each batch goes through the Dispatcher's own publishing
    step (id order, lease budget, ``enforce_publish_timeout``) in one thread."""

    _engine_types = (AsyncEngine,)
    _awaits_publisher = True

    def __init__(
        self,
        engine: AsyncEngine,
        model: type[Any],
        publisher: Any,
        *,
        owner: str | None = None,
        batch: int = 50,
        lease: Duration = 60.0,
        publish_timeout: Duration = 10.0,
        max_attempts: int = 12,
        ordered: bool | Collection[str] = False,
        backoff: Backoff | None = None,
        poll_interval: Duration = 1.0,
        listen: bool = True,
        listen_url: str | URL | None = None,
        stop_on_unclassified: bool = False,
        rescue_limit: int = 1000,
        enforce_publish_timeout: bool = False,
        give_up_after: Duration | None = None,
        publish_concurrency: int = 16,
        maintain_partitions: Duration | None = None,
        message_id_prefix: str = "",
    ) -> None:
        super().__init__(
            engine, model, publisher, owner=owner, batch=batch, lease=lease, publish_timeout=publish_timeout,
            max_attempts=max_attempts, ordered=ordered, backoff=backoff, poll_interval=poll_interval,
            listen=listen, listen_url=listen_url, stop_on_unclassified=stop_on_unclassified,
            rescue_limit=rescue_limit, enforce_publish_timeout=enforce_publish_timeout,
            give_up_after=give_up_after, maintain_partitions=maintain_partitions,
            message_id_prefix=message_id_prefix,
        )  # fmt: skip
        self.engine: AsyncEngine = engine
        self.publish_concurrency = positive_int(publish_concurrency, "publish_concurrency")
        self._async_publisher = publisher_is_async(publisher)
        self._db = AsyncLoopConnection(engine, self.spec.table.name)
        self._waker = AsyncWaker(self.listen_url, self.channels)

    def _poke(self) -> None:
        self._waker.poke()

    # -- public ----------------------------------------------------------------------------------------

    @one_async_run_at_a_time
    async def run_once(self) -> int:
        """One rescue step plus one claimed batch, published and finalized (see :meth:`Dispatcher.run_once`)."""
        try:
            await self._rescue(force=True)
            claimed = (await self._turn(one_shot=True))[0]
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
        ``max_batches`` — the same contract as :meth:`Dispatcher.run`."""
        restore = install_async_signals(self._stop_on_signal) if install_signal_handlers else None
        policy = self._start_run(startup_timeout, drain=until_idle)
        batches = 0
        try:
            while not self._stopped() and self._fatal is None:
                try:
                    claimed, wanted = await self._turn(one_shot=False)
                    self._turn_went_through(policy)
                except Exception as exc:
                    delay = policy.failed(exc)
                    self.stats.db_errors += 1
                    self._db_fault()
                    await self._waker.wait_out(delay)  # (not ended by a notification: see Dispatcher.run)
                    continue
                if wanted:
                    batches += 1
                    if max_batches is not None and batches >= max_batches:
                        break
                if until_idle and wanted and not claimed and not len(self._done) and not self._put_back_due():
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
        self._calls.close()

    # -- one turn --------------------------------------------------------------------------------------

    async def _turn(self, *, one_shot: bool) -> tuple[int, int]:
        await self._rescue()  # first: nothing may fail between a claim and its publish (see Dispatcher._turn)
        wanted = self._want(one_shot=one_shot)
        claimed_at = time.monotonic()
        rows, cancelled = (
            await through_cancellation(self._claim(wanted), grace=CLAIM_GRACE) if wanted else ([], None)
        )
        if cancelled is not None:  # what was claimed goes back at once, not when its lease runs out
            self._settle(self._released(self._messages(rows), _STOPPING))
            raise cancelled
        if not wanted and len(self._done):
            await self._flush()
        if rows:
            messages = self._messages(rows)
            if self._async_publisher:
                publishing = self._publish_async(messages, claimed_at)
            else:
                publishing = asyncio.to_thread(self._publish_blocking, messages, claimed_at)
            # a cancelled run lets the batch finish (as a worker lets its handlers finish) and records it
            outcomes, cancelled = await through_cancellation(publishing)
            self._settle(outcomes)
            if cancelled is not None:
                raise cancelled
        elif wanted:
            self._probed_nothing()
        return len(rows), wanted

    async def _wait(self, claimed: int, wanted: int) -> None:
        if claimed or len(self._done):
            return
        timeout = self._next_deadline(poll=not self._circuit.open)
        reopen = self._circuit.next_due()
        if reopen is not None:
            timeout = min(timeout, max(0.0, reopen - time.monotonic()))
        if await self._waker.wait(timeout) == "notify":
            self.stats.wakeups += 1

    async def _claim(self, want: int) -> list[Any]:
        outcomes = self._done.take()
        started = time.perf_counter()
        try:
            applied, rows = await self._db.run(lambda c: self._claim_on(c, want, outcomes))
        except BaseException:
            self._done.add(outcomes)
            raise
        self._forms.took(time.perf_counter() - started)
        self._report(outcomes, applied)
        if not rows and self._forms.walk_before_nothing():
            rows = (await self._db.run(lambda c: self._claim_on(c, want, [])))[1]
        self._forms.claimed(len(rows), want, passed_over(rows))
        return rows

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
            await self._db.run(self._rescue_on)

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
            await self._flush()
        except Exception:
            self.ended_unrecorded = True
            log.exception("could not finalize the last batch; its leases will expire and be rescued")
        finally:
            await self._waker.close()
            await self._db.drop()

    # -- publishing with an async publisher ---------------------------------------------------------------

    async def _publish_async(self, messages: list[Message], claimed_at: float) -> list[Outcome]:
        """Publish a batch with an async publisher, ``publish_concurrency`` at a time; the whole batch is bounded
        by the lease budget (what is still running then is cancelled and retried, what has not started is
        released). One outcome per message; never raises."""
        if self._stopped():
            return self._released(messages, _STOPPING)
        remaining = self._budget_end(claimed_at) - time.monotonic()
        if remaining <= 0:
            return self._released(messages, _BUDGET)
        n = len(messages)
        if hasattr(self.publisher, "publish_many"):
            started = time.perf_counter()
            with _tracing.publish_spans(messages, publisher=self.publisher) as spans:
                try:
                    async with asyncio.timeout(remaining):
                        publisher: Any = self.publisher
                        errors = check_batch(await publisher.publish_many(messages), n)
                except TimeoutError:
                    errors = [self._over_budget()] * n
                except asyncio.CancelledError as exc:
                    if (stray := stray_cancellation(exc)) is None:
                        raise
                    errors = [stray] * n
                except BaseException as exc:  # SystemExit/KeyboardInterrupt too: recorded, then raised
                    errors = [exc] * n
                spans.outcomes(errors)
            seconds = time.perf_counter() - started
            for m in messages:
                self._observe_handled(seconds, m.created_at)
            return self._classify(list(zip(messages, errors, strict=True)))
        results: list[BaseException | str | None] = ["unstarted"] * n
        gate = asyncio.Semaphore(self.publish_concurrency)
        unavailable = False

        async def one(i: int, msg: Message) -> None:
            nonlocal unavailable
            async with gate:
                if unavailable or self._stopped():
                    return
                results[i] = "running"
                started = time.perf_counter()
                timeout = self.publish_timeout.total_seconds() if self.enforce_publish_timeout else None
                timer = asyncio.timeout(timeout)
                with _tracing.publish_span(msg, publisher=self.publisher) as span:
                    try:
                        async with timer:
                            publisher: Any = self.publisher
                            error = check_result(await publisher.publish(msg))
                    except TimeoutError as exc:  # ours only when a timeout was set; else the publisher's own
                        error = self._timed_out() if timer.expired() else exc
                    except asyncio.CancelledError as exc:
                        if (stray := stray_cancellation(exc)) is None:
                            raise
                        error = stray
                    except BaseException as exc:  # SystemExit too: out of a task it would stop the event loop
                        error = exc
                    span.outcome(error)
                self._observe_handled(time.perf_counter() - started, msg.created_at)
                results[i] = error
                if isinstance(error, DestinationUnavailable):
                    unavailable = True

        # (plain tasks: an async publisher's await is the application's code — a runner's teardown cancels it as
        # it cancels the client tasks it may be waiting on; the batch around it is held and records what ended)
        tasks = [asyncio.ensure_future(one(i, m)) for i, m in enumerate(messages)]
        _, late = await asyncio.wait(tasks, timeout=remaining)
        for task in late:  # (the budget's own cancellations; any other one came from outside the batch)
            task.cancel()
        if late:
            _, deaf = await asyncio.wait(late, timeout=ABANDON_AFTER_CANCEL)
            for task in deaf:  # swallowed its cancellation: abandoned (its message retried), not waited for
                self._abandon(task)
            if deaf:
                self._log.warning(
                    "%d publish call(s) did not stop within %g s of their cancellation (the batch's time "
                    "budget ran out): abandoned (they may still publish), their messages retried", len(deaf),
                    ABANDON_AFTER_CANCEL, extra={"table": self.spec.table.name},
                )  # fmt: skip
        outcomes: list[Outcome] = []
        published: list[tuple[Message, BaseException | None]] = []
        for msg, result, task in zip(messages, results, tasks, strict=True):
            if result == "unstarted":
                reason = _UNAVAILABLE if unavailable else (_STOPPING if self._stopped() else _BUDGET)
                outcomes.append(self._release(msg.id, msg.lease_version, reason))
            elif result == "running" and task not in late and task.cancelled():
                outcomes.append(self._release(msg.id, msg.lease_version, _CUT_SHORT))
            elif result == "running":
                published.append((msg, self._over_budget()))
            else:
                assert not isinstance(result, str)
                published.append((msg, result))
        return self._classify(published) + outcomes
