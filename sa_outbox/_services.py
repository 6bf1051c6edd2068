"""Small services the loops compose, each with one job and no I/O of its own (after River's ``jobcompleter``
and ``job_rescuer``): the loops run their statements, these decide *what* and *when*.

* :class:`Completer` — outcomes decided but not yet written, and when they must be written;
* :class:`Held` — the rows this loop holds (claimed and not yet finalized), for the heartbeat;
* :class:`Rescuer` — when the next rescue of expired leases is due;
* :class:`Requeued` — when the rows this loop put back (retry, ``Defer``, release) become due;
* :class:`Circuit` — whether a dispatcher may claim while its destination is unavailable.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

from ._backoff import DESTINATION_OUTAGE
from ._steps import Outcome

__all__ = ["Circuit", "Completer", "Held", "Requeued", "Rescuer"]


class Completer:
    """Outcomes waiting to be written.

    They ride on the loop's next claim (one round trip for both), or are written on their own once the
    oldest has waited ``flush_after`` seconds or ``limit`` of them are waiting — so an outcome is never
    later than that, even when no claim is coming (all slots busy, prefetched jobs in hand). Until written,
    their rows stay in :class:`Held`: a finished job is still leased, and no rescue can take it.
    """

    def __init__(self, *, flush_after: float, limit: int) -> None:
        self.flush_after = flush_after
        self.limit = limit
        self._outcomes: list[Outcome] = []
        self._since = 0.0
        #: Leases (id, lease_version) whose claim's attempt was given back already (a worker's claim of a job it
        #: is running, held back): the outcome written on such a lease gives one attempt fewer back.
        self._given_back: set[tuple[int, int]] = set()
        #: Those of them whose refund's answer was lost: recorded as given back, but maybe not applied.
        self._in_doubt: set[tuple[int, int]] = set()

    def add(self, outcomes: Iterable[Outcome]) -> None:
        if not self._outcomes:
            self._since = time.monotonic()
        if self._given_back:
            outcomes = [self._counted(o) for o in outcomes]
        self._outcomes.extend(outcomes)

    def given_back(self, lease: tuple[int, int], forget: bool = False, in_doubt: bool = False) -> None:
        """Record that ``lease``'s claim has had its attempt given back — once, however often that is said (the
        refund is idempotent, and may be recorded before its answer is known) — or, ``forget``, drop that
        record: the lease is gone and no outcome will be written on it."""
        if forget:
            self._given_back.discard(lease)
            self._in_doubt.discard(lease)
        else:
            self._given_back.add(lease)
            if in_doubt:
                self._in_doubt.add(lease)

    def gave_back(self, lease: tuple[int, int]) -> bool:
        """Whether ``lease``'s claim had its attempt given back (an outcome written elsewhere — a handler's
        transaction — then gives one fewer back; :meth:`given_back` with ``forget`` once written)."""
        return lease in self._given_back

    def in_doubt(self, lease: tuple[int, int]) -> bool:
        """Whether ``lease``'s attempt was recorded as given back by a refund whose answer was lost (``in_doubt``
        of :meth:`given_back`): it may still be counted."""
        return lease in self._in_doubt

    def _counted(self, o: Outcome) -> Outcome:
        lease = (o.id, o.lease_version)
        if lease not in self._given_back:
            return o
        self._given_back.discard(lease)
        self._in_doubt.discard(lease)
        return replace(o, refund=o.refund - 1)

    def take(self) -> list[Outcome]:
        taken, self._outcomes = self._outcomes, []
        return taken

    def due(self, now: float) -> bool:
        return bool(self._outcomes) and (
            len(self._outcomes) >= self.limit or now - self._since >= self.flush_after
        )

    def next_due(self) -> float | None:
        """Monotonic time at which the waiting outcomes must be written (None: nothing waits)."""
        return self._since + self.flush_after if self._outcomes else None

    def leases(self) -> list[tuple[int, int]]:
        """The leases (id, lease_version) whose outcomes wait."""
        return [(o.id, o.lease_version) for o in self._outcomes]

    def __len__(self) -> int:
        return len(self._outcomes)


class Held:
    """(id → lease_version) of the rows a loop holds: claimed, and not yet finalized — with when each lease was
    last confirmed: the loop's monotonic clock when the statement that leased or renewed the row was sent (its
    ``locked_at`` is the server's clock at that statement or later, so the lease lasts at least ``stale_after``
    from then). Thread-safe (the heartbeat reads and renews it from its own thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, tuple[int, float]] = {}

    def hold(self, pairs: Iterable[tuple[int, int]], sent: float) -> None:
        """Rows a claim sent at ``sent`` leased (a row already held under the same lease keeps its time)."""
        with self._lock:
            for row_id, version in pairs:
                known = self._held.get(row_id)
                if known is None or known[0] != version:
                    self._held[row_id] = (version, sent)

    def confirm(self, pairs: Iterable[tuple[int, int]], sent: float) -> None:
        """Rows a renewal sent at ``sent`` extended (those still held under that lease)."""
        with self._lock:
            for row_id, version in pairs:
                known = self._held.get(row_id)
                if known is not None and known[0] == version and known[1] < sent:
                    self._held[row_id] = (version, sent)

    def drop(self, ids: Iterable[int]) -> None:
        """Rows no longer held, whatever their lease (its own rescue took them back)."""
        with self._lock:
            for row_id in ids:
                self._held.pop(row_id, None)

    def drop_leases(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Leases no longer held (their outcomes were written or refused) — a row held under another lease
        stays: the statement that wrote a refused outcome may have claimed the row again."""
        with self._lock:
            for row_id, version in pairs:
                known = self._held.get(row_id)
                if known is not None and known[0] == version:
                    del self._held[row_id]

    def pairs(self) -> list[tuple[int, int]]:
        with self._lock:
            return [(row_id, known[0]) for row_id, known in self._held.items()]

    def version(self, row_id: int) -> int | None:
        """The lease the row is held under; None: not held."""
        with self._lock:
            known = self._held.get(row_id)
            return None if known is None else known[0]

    def confirmed(self, row_id: int, lease_version: int) -> float | None:
        """When the row's lease was last confirmed (see the class); None: not held under this lease (finalized,
        or taken back by the loop's own rescue)."""
        with self._lock:
            known = self._held.get(row_id)
            return known[1] if known is not None and known[0] == lease_version else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


class Rescuer:
    """Expired leases are rescued at most once per ``every`` seconds by each loop (any number of loops may do
    it at once: the rescue statement uses SKIP LOCKED)."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self._last = float("-inf")

    def due(self, now: float) -> bool:
        return now - self._last >= self.every

    def ran(self, now: float) -> None:
        self._last = now

    def next_due(self) -> float:
        return self._last + self.every


class Requeued:
    """When the rows this loop put back become due again — at once (a ``Defer(0)``, a batch released when its
    lease budget ran short, a rescue) or after a retry's backoff or a ``Defer`` — so that the loop claims then,
    rather than at its next poll or maintenance step, and ``run(until_idle=True)`` does not stop before them.
    The statement that wrote such an outcome claimed in the finalize's snapshot and could not see the row; a
    claim sent at or after the row's due time can, and forgets it. Waking up for a row another loop has
    claimed meanwhile costs one claim that finds nothing. Thread-safe (a worker's claim thread sends claims
    too).

    Times in one ``resolution`` slot share an entry (the latest of them: never early) — a batch
    deferred for 30 s is one entry, not one per row — and only times within ``horizon`` seconds are kept (a
    poll comes before the others). At most ``limit`` entries: past that the later half is forgotten, never the
    soonest, which is the one the loop waits for (a forgotten row is claimed by the loop's next turn: a claim
    sent for an earlier row, its maintenance step within a second, or a poll)."""

    def __init__(self, horizon: float = 60.0, limit: int = 8192, resolution: float = 0.001) -> None:
        self.horizon = horizon
        self.limit = limit
        self.resolution = resolution
        self._due: list[int] = []  # a heap of slots: due times in units of ``resolution``, rounded down
        self._at: dict[int, float] = {}  # each slot's latest due time
        self._lock = threading.Lock()

    def put(self, delay: float | None, now: float) -> None:
        """A row written back, due ``delay`` seconds (None: at once) after ``now`` — the loop's clock when it
        learnt the outcome was applied, after the statement that wrote it was sent."""
        wait = max(0.0, delay or 0.0)
        if wait > self.horizon:
            return
        due = now + wait
        slot = math.floor(due / self.resolution)
        with self._lock:
            known = self._at.get(slot)
            if known is not None:
                self._at[slot] = max(known, due)
                return
            if len(self._due) >= self.limit:
                # (a sorted list is a heap; halving keeps a burst of puts at O(log n) each)
                self._due = heapq.nsmallest(self.limit // 2, self._due)
                self._at = {kept: self._at[kept] for kept in self._due}
            heapq.heappush(self._due, slot)
            self._at[slot] = due

    def claiming(self, sent: float) -> None:
        """A claim is sent at ``sent``: it sees every row due by then."""
        with self._lock:
            while self._due and self._at[self._due[0]] <= sent:
                del self._at[heapq.heappop(self._due)]

    def next_due(self) -> float | None:
        """The soonest due time no claim has been sent since (it may have passed: claim now)."""
        with self._lock:
            return self._at[self._due[0]] if self._due else None

    def due(self, now: float) -> bool:
        """Whether a row put back is due and no claim has been sent since."""
        soonest = self.next_due()
        return soonest is not None and soonest <= now


def lost(outcomes: Sequence[Outcome], applied: set[int]) -> list[Outcome]:
    """The outcomes the fence refused (their lease was rescued or re-claimed meanwhile)."""
    return [o for o in outcomes if o.id not in applied]


class ClaimForms:
    """Which form a dispatcher's next claim takes (:func:`sa_outbox._sql.claim_statement`).

    **Heads** (an ordered dispatcher, every type ordered, not partitioned): the walk of the ready rows, which
    stops at ``batch`` heads, or the heads found aggregate by aggregate (``heads=True``), which costs one
    index descent per aggregate with unfinished rows but never walks a backlog.

    * After a claim that found some heads but fewer than it asked for (the walk then read every ready row:
      ~220 ms per claim over one aggregate's 20,000 events) the heads form; after one that filled its batch
      or found nothing, the walk.
    * The heads form sees one head per aggregate id (and, behind a dead first row, one other type's): while
      it is in use a claim walks at least every ``walk_every`` seconds, and a turn whose claims in that form
      found nothing walks once more before it says so (what ``run(until_idle=True)`` stops on).
    * Its cost grows with the aggregates that have unfinished rows, dead letters nobody cleared included
      (100,000 of them: ~600 ms a claim against ~60 ms for the walk over a 5,000-event backlog): it is not
      taken while its last claim was slower than the walk's last, but tried again every ``retry_every``
      seconds.

    **Settled** (every outbox dispatcher, ``settle=True``): a claim that passes over the rows whose ``xmax`` is
    another transaction in progress for its snapshot (``settle=True`` in the statement) or one that locks them
    (SKIP LOCKED). Passing over spares the rows another dispatcher has just claimed a lock that would make its
    finalize wait; but a MultiXact id in ``xmax`` (two transactions share-locked the row, as foreign keys into
    the outbox do) can read as such a transaction until the xid counter passes it — on a quiet database, for
    good. So the first claim locks, a claim that came back short (or found nothing) is followed by a locking
    one, and one claim at least every ``walk_every`` seconds locks; a locking claim that took any row the
    settled form would have passed over is followed by another. Such rows wait at most ``walk_every`` while
    claims come back full, then are taken a batch per claim; a turn whose settled claim found nothing claims once
    more with a lock before it says so (what ``run(until_idle=True)`` stops on)."""

    def __init__(
        self, enabled: bool, *, settle: bool = False, walk_every: float = 1.0, retry_every: float = 10.0
    ) -> None:
        self.enabled = enabled
        self.settle_enabled = settle
        self.walk_every = walk_every
        self.retry_every = retry_every
        self.heads = False  # the form the next claim takes, before the periodic walk
        self.sent = False  # the form of the claim last sent
        self.cost: dict[bool, float] = {}  # seconds the last claim of each form took
        self._walk_at = 0.0
        self._retry_at = 0.0
        self._lock_at = 0.0  # a locking claim is due from then on (the first claim locks)
        self.sent_settled = False  # whether the claim last sent passed over rows

    def next(self) -> bool:
        """The form of the claim about to be sent (True: heads)."""
        heads = self.heads
        if heads:
            now = time.monotonic()
            if now >= self._walk_at:
                heads, self._walk_at = False, now + self.walk_every
        self.sent = heads
        return heads

    def settle(self, after_short: bool) -> bool:
        """Whether the claim about to be sent passes over rows another transaction holds (``settle``);
        ``after_short``: the loop's last claim came back short or empty (``LoopBase._claimed_short``)."""
        now = time.monotonic()
        settled = self.settle_enabled and not after_short and now < self._lock_at
        if not settled:  # (a locking claim: the next one is due walk_every from now)
            self._lock_at = now + self.walk_every
        self.sent_settled = settled
        return settled

    def took(self, seconds: float) -> None:
        """The claim last sent took ``seconds``."""
        self.cost[self.sent] = seconds

    def walk_before_nothing(self) -> bool:
        """Whether a turn whose claims found nothing must claim once more before it says so: in the walk after
        the heads form, with a lock after the settled form (which passes over rows it may have been wrong to)."""
        again = self.sent_settled
        if self.heads:
            self.heads, again = False, True
        return again

    def claimed(self, got: int, want: int, passed_over: bool = False) -> None:
        """A turn's claims found ``got`` of the ``want`` rows asked for, and (``passed_over``) took rows the
        settled form passes over: choose the next form."""
        if passed_over:  # more such rows may follow: the next claim locks too
            self._lock_at = 0.0
        if not self.enabled:
            return
        self.heads = 0 < got < want
        walk, heads = self.cost.get(False), self.cost.get(True)
        if self.heads and walk is not None and heads is not None and heads > walk:
            now = time.monotonic()
            if now < self._retry_at:
                self.heads = False
            else:  # try it again: the costs move as backlogs drain and dead letters are cleared
                self._retry_at = now + self.retry_every


class Circuit:
    """A dispatcher's view of its destination (a circuit breaker).

    *closed*: claim whole batches. A :class:`~sa_outbox.DestinationUnavailable` opens it: nothing is claimed
    for an outage backoff (capped exponential with jitter, ``_backoff.DESTINATION_OUTAGE``), then one message
    is claimed as a probe (*probing*); a probe that gets through closes it, one that meets the outage again
    re-opens it for longer. Each dispatcher keeps its own: others learn of an outage from their own probes.
    """

    def __init__(self) -> None:
        self.state = "closed"
        self.failures = 0
        self.until = 0.0
        self.opened_at = 0.0

    @property
    def open(self) -> bool:
        return self.state != "closed"

    def want(self, batch: int, now: float) -> int:
        """How many rows to claim now."""
        if self.state == "closed":
            return batch
        if now < self.until:
            return 0
        self.state = "probing"
        return 1

    def record(self, outcomes: Sequence[Outcome], now: float) -> str | None:
        """Update from a batch's outcomes; returns "opened" or "closed" when the state changed that way."""
        if any(o.kind == "unavailable" for o in outcomes):
            was = self.state
            self.failures += 1
            self.state = "open"
            self.until = now + DESTINATION_OUTAGE.delay(self.failures)
            if was == "closed":
                self.opened_at = now
                return "opened"
            return None
        # A delivery while not closed (the probe's, or an explicit run_once while open): the destination is back.
        if self.state != "closed" and any(o.kind != "release" for o in outcomes):
            self.state, self.failures = "closed", 0
            return "closed"
        return None

    def nothing_to_probe(self) -> bool:
        """A probe found no row to send (someone else delivered the backlog): close. True when it closed."""
        if self.state != "probing":
            return False
        self.state, self.failures = "closed", 0
        return True

    def next_due(self) -> float | None:
        return self.until if self.state == "open" else None
