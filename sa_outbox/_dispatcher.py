"""The outbox dispatcher: claim with a lease, publish outside any transaction, finalize fenced.

One batch: (1) a short transaction rescues expired leases and claims up to ``batch`` due rows, writing
status/owner/lease/``lease_version + 1``/``attempts + 1``, and commits; (2) every message is published with
no transaction or row lock open; (3) one fenced statement finalizes the whole batch, each row matched by its
own ``lease_version``. A row whose lease was rescued or re-claimed meanwhile is not touched (a *lost lease*:
logged, counted, never raised) — the message may then be published twice, which is why downstream must
de-duplicate by ``message_id``.

**Long batches.** Messages are published in id order; before each one the dispatcher checks that its lease
still has at least ``publish_timeout`` left (measured from the claim). When it does not, the rest of the batch
is *released* (back to pending, attempt refunded) instead of published on a lease that may already be gone.
The same happens on :meth:`stop`: the message being published finishes, the rest is released.

**Unclassified exceptions** from a publisher are logged at ERROR with their traceback, recorded in
``last_error`` and retried like :class:`~sa_outbox.RetryableError` (so they end ``dead`` after
``max_attempts``); with ``stop_on_unclassified=True`` the batch is finalized and the exception re-raised out of
``run_once``/``run`` instead (the outbox document's choice).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from sqlalchemy import Engine

from . import _steps as eng
from ._backoff import OUTBOX_BACKOFF, Backoff
from ._durations import Duration, to_timedelta
from ._loop import LoopBase, is_async_callable, positive_int
from ._messages import BatchPublisher, Message, Publisher
from ._names import channel_for
from .errors import ConfigurationError, RetryableError

__all__ = ["Dispatcher"]

log = logging.getLogger("sa_outbox.dispatcher")


def publisher_is_async(publisher: Any) -> bool:
    """Whether the method a dispatcher calls — ``publish_many`` when there is one, else ``publish`` — must be
    awaited (AsyncDispatcher awaits it; Dispatcher refuses it)."""
    return is_async_callable(getattr(publisher, "publish_many", None) or publisher.publish)


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


class Dispatcher(LoopBase):
    """Delivers outbox rows to a :class:`~sa_outbox.Publisher`; run as many side by side as you like.

    Options (durations take a ``timedelta`` or seconds):

    * ``batch`` — rows claimed per transaction (default 50);
    * ``lease`` — how long a claim is owned (default 60 s); ``publish_timeout`` — the longest one publish may
      take (default 10 s; the publisher must enforce it). The constructor refuses ``lease <= publish_timeout``;
    * ``max_attempts`` — claims before a message is dead (default 12, counting crashes);
    * ``ordered`` — ``True`` for per-aggregate order on every event type, or a collection of event types
      that are ordered (others are claimed freely);
    * ``backoff`` — retry policy (default full jitter, base 1 s, cap 300 s);
    * ``poll_interval`` — longest idle wait (default 1 s); ``listen`` — LISTEN/NOTIFY wake-ups (default on),
      on ``listen_url`` if given (use the server's direct address behind PgBouncer).
    """

    _owner_prefix = "dispatcher"
    _log = log

    #: The asyncio dispatcher's core awaits async publishers on its event loop; this class never does.
    _awaits_publisher = False

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
        listen_url: str | None = None,
        stop_on_unclassified: bool = False,
        rescue_limit: int = 1000,
        enforce_publish_timeout: bool = False,
    ) -> None:
        super().__init__(
            engine, model, owner=owner, batch=batch, poll_interval=poll_interval, listen=listen,
            listen_url=listen_url, channels=[channel_for(model.__table__.name)],
        )  # fmt: skip
        if self.spec.kind != "outbox":
            raise ConfigurationError(
                f"Dispatcher needs an OutboxMixin model, got {model.__name__} (use Worker)"
            )
        if not callable(getattr(publisher, "publish", None)):
            raise ConfigurationError(f"publisher {publisher!r} has no publish(message) method")
        if not self._awaits_publisher and publisher_is_async(publisher):
            raise ConfigurationError(
                f"publisher {publisher!r} is async: Dispatcher would never await it; run it with AsyncDispatcher"
            )
        self.publisher = publisher
        self.lease = to_timedelta(lease, name="lease", allow_zero=False)
        self.publish_timeout = to_timedelta(publish_timeout, name="publish_timeout", allow_zero=False)
        if self.lease <= self.publish_timeout:
            raise ConfigurationError(
                f"lease ({self.lease.total_seconds():g}s) must be longer than publish_timeout "
                f"({self.publish_timeout.total_seconds():g}s): a publish could outlive its lease and be "
                "delivered twice. Raise lease or lower publish_timeout"
            )
        self.max_attempts = positive_int(max_attempts, "max_attempts")
        self.rescue_limit = positive_int(rescue_limit, "rescue_limit")
        if isinstance(ordered, bool):
            self.ordered, self.ordered_types = ordered, None
        elif isinstance(ordered, str) or not all(isinstance(t, str) and t for t in ordered):
            raise ConfigurationError("ordered must be True/False or a collection of event type names")
        else:
            self.ordered, self.ordered_types = True, sorted(set(ordered))
        self.backoff = backoff or OUTBOX_BACKOFF
        self.stop_on_unclassified = stop_on_unclassified
        self._batch_publish = isinstance(publisher, BatchPublisher)
        # With enforce_publish_timeout, each publish runs on a helper thread and the loop waits at most
        # publish_timeout for it: a hung publisher becomes a retryable failure (its thread is abandoned and a
        # fresh one used). Off by default: the shipped publishers bound their own I/O, and the hand-off costs
        # a thread switch per message.
        self.enforce_publish_timeout = enforce_publish_timeout
        self._publish_pool: ThreadPoolExecutor | None = None

    # -- one batch -------------------------------------------------------------------------------------

    def _rescue_params(self) -> dict[str, Any]:
        return {"max_attempts": self.max_attempts, "limit": self.rescue_limit}

    def _claim_params(self) -> list[dict[str, Any]]:
        return [{"lease": self.lease, "ordered": self.ordered, "ordered_types": self.ordered_types}]

    def _finalize_window(self) -> float:
        return max(self.lease.total_seconds(), 1.0)

    def _step(self, *, rescue: bool) -> int:
        messages = [Message.from_row(r) for r in self._claim_rows(rescue=rescue)]
        if not messages:
            return 0
        claimed_at = time.monotonic()
        outcomes, fatal = self._publish(messages, claimed_at)
        if fatal is not None:
            self._finalize(outcomes)
            raise fatal
        self._settle(outcomes)
        return len(messages)

    def _publish(
        self, messages: list[Message], claimed_at: float
    ) -> tuple[list[eng.Outcome], BaseException | None]:
        # Publishing must not start on a lease with less than publish_timeout left.
        budget_end = claimed_at + (self.lease - self.publish_timeout).total_seconds()
        results: list[tuple[Message, BaseException | None]] = []
        outcomes: list[eng.Outcome] = []
        if self._batch_publish and not self._stop.is_set():
            try:
                errors = check_batch(self.publisher.publish_many(messages), len(messages))  # type: ignore[attr-defined]
            except Exception as exc:
                errors = [exc] * len(messages)
            results = list(zip(messages, errors, strict=True))
        else:
            for i, msg in enumerate(messages):
                if self._stop.is_set() or time.monotonic() > budget_end:
                    reason = (
                        "released: dispatcher stopping"
                        if self._stop.is_set()
                        else "released: lease budget spent"
                    )
                    outcomes += [eng.release(self.spec, m.id, m.lease_version, reason) for m in messages[i:]]
                    break
                started = time.perf_counter()
                try:
                    result: Any = self._call_publish(msg)
                    error = check_result(result)
                except Exception as exc:
                    error = exc
                results.append((msg, error))
                self._observe_handled(started, msg.created_at)
        more, fatal = self._outcomes(results)
        return outcomes + more, fatal

    def _call_publish(self, msg: Message) -> Any:
        if not self.enforce_publish_timeout:
            return self.publisher.publish(msg)
        if self._publish_pool is None:
            self._publish_pool = ThreadPoolExecutor(1, thread_name_prefix="sa_outbox-publish")
        future = self._publish_pool.submit(self.publisher.publish, msg)
        try:
            return future.result(timeout=self.publish_timeout.total_seconds())
        except FutureTimeout:
            self._publish_pool.shutdown(wait=False)  # its thread is stuck in the publisher: abandon it
            self._publish_pool = None
            raise self._timed_out() from None

    def _timed_out(self) -> RetryableError:
        """A publish that overran publish_timeout (sync and async dispatchers): retried like any transient fault."""
        return RetryableError(f"publish exceeded publish_timeout ({self.publish_timeout.total_seconds():g}s)")

    def _outcomes(
        self, results: list[tuple[Message, BaseException | None]]
    ) -> tuple[list[eng.Outcome], BaseException | None]:
        """Classify publish results (shared by the sync and the async dispatcher)."""
        outcomes: list[eng.Outcome] = []
        fatal: BaseException | None = None
        for msg, error in results:
            outcome, stop = self._outcome(
                id=msg.id, lease_version=msg.lease_version, attempts=msg.attempts, max_attempts=self.max_attempts,
                error=error, backoff=self.backoff, label=f"the publisher (outbox {msg.id})",
                stop_on_unclassified=self.stop_on_unclassified,
            )  # fmt: skip
            outcomes.append(outcome)
            fatal = fatal or stop
        return outcomes, fatal
