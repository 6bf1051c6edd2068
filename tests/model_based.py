"""A model-based test of producers and loops together: random rules, checked against a model after every step.

A seeded random driver (replay a failure with its printed seed) writes events and jobs through every
producer path, starts and stops sync and asyncio dispatchers and workers with random options, injects
failures, and compares what the loops did with what the model says must hold. Every action is real: the real
database, real threads with their own connections, real backend terminations. Rules:

* produce events: ``session.add`` (string aggregates), ``for_aggregate`` (mapped ``Order`` rows), ``emit``,
  an ``AsyncSession``, inside a savepoint that is rolled back; each transaction commits or rolls back;
* enqueue jobs;
* start a dispatcher or a worker (sync or async; random batch, concurrency, handler timeout, LISTEN on/off;
  often a sync inline worker with instant handlers on one or two queues, whose claims go out ahead of the
  jobs in hand; some sync workers' claims reach the loop 50-350 ms after they committed, so runs end while a
  claim is in flight — one that may hold a newer lease of the job a run had (``land_late``);
  a fifth of them stop by themselves after ``run(max_batches=N)``), stop one gracefully, cancel an async
  one's ``run()`` (once, or twice a few ms apart);
* terminate every backend of the loops (``pg_terminate_backend``);
* a broker outage begins or ends (the publisher raises ``DestinationUnavailable``);
* an operator skips a dead event (``skip_dead``) so its ordered aggregate moves on, or requeues it
  (``retry_dead``): a poison event dies again, its aggregate's later events still behind it;
* an operator cancels a job (``cancel_jobs``), pauses a queue or resumes it; requeues a failed or cancelled
  job (``retry_jobs``, ``retry_dead``) — it then runs again and ends as any other job — or changes waiting
  jobs' priority, due time or attempts (``update_jobs``);
* jobs of queue ``q3`` carry a concurrency key and every worker serves q3 under the scenario's
  :class:`~sa_outbox.Limit` (per key or per queue, sometimes with a rate) — or, in a quarter of the
  scenarios, a unique key, and every worker claims with ``unique_running`` instead; some workers serve the
  queues with fair shares (``queues={...}``) instead of a list;
* a burst of jobs in queue ``qb``, which only such fast workers serve (one is started when none runs);
* enqueue jobs in bulk (``enqueue_many``), and with a unique key (``on_conflict="skip"``: a key whose job
  has not started yet gets no second one), alone or in an ``enqueue_many`` call that mixes skip, replace
  (the waiting job takes the call's task, queue and payload: its old seq is gone) and debounce by key — the
  scenario's first such call and a tenth of the others of 65 items, sent unprepared (planned for their own
  arrays);
* in a quarter of the scenarios the outbox is day-partitioned, with a partition for yesterday that some
  events are written into; ``maintain_partitions`` (a rule, and some dispatchers' own step) retires it while
  the loops claim, once every row in it is finished — in some runs dropping its dead rows too (which then
  count as skipped from the call's start), in others only closing it, as a run killed before its detach
  leaves it; a write into it once it is closed or gone is refused whole, a producer's and an operator's skip;
* a user's transaction locks a few pending events (``FOR KEY SHARE``, as a foreign key check does, or ``FOR
  UPDATE``) for a moment while the loops run;
* the database goes out of the loops' reach for 1–3.5 s (their backends terminated every 20 ms), now and
  then after a step (a stream of its own), while the rules go on; in half of these outages (a stream of its
  own) their LISTEN connections are spared and a producer notifies every queue and the outbox every 10 ms
  throughout (the terminations then every 10 ms too), so the loops hear wake-ups while their statements fail;
* a trigger refuses every renewal of a running job for 1–4 s (a stream of its own), while the rules go on:
  beats fail and leases run out under running handlers;
* another worker's rescue takes a job or two back from under their handlers' runs (their leases moved an hour
  back, as a worker frozen mid-run past ``stale_after`` leaves them; a stream of its own; a job whose run
  lingers is enqueued for it): their workers may claim them again while the runs go on, and with late
  landings after the runs ended; when the draws never lined that up, a step at the end of the rules makes
  it happen (a worker of its own whose claim of the job again lands after the run: ``rule_hand_over``, H1);
* a job that runs longer than ``stale_after`` is enqueued, and once it runs a user's transaction holds its row
  (``FOR UPDATE``) for longer than ``stale_after``, in a thread of its own while the rules go on — no beat can
  renew that lease meanwhile — and another worker's rescue comes the moment the row is free;
* in half the scenarios a cron schedule (``* * * * * *``, a random catch-up policy) fires a job a second into
  q1 or q2, fired by the workers given the schedules model (about half of them, several at once), which an
  operator pauses and resumes now and then (``pause_schedule``, ``resume_schedule``) and a deploy re-syncs to
  every even second and back (``sync_schedules``);
* let time pass.

In a quarter of the scenarios (T1) the loops' engines carry a tenant's ``schema_translate_map`` (to ``public``,
where the tables are): every loop statement is then compiled and prepared as a tenant's, beside the producers'
and operators' untranslated statements in the same process.

Through PgBouncer (P1: ``tests/test_model_based.py``'s pooled tests, a private PgBouncer 1.18 in transaction
pooling mode with 8 server connections) every loop's engine is made by ``pgbouncer_engine`` /
``pgbouncer_async_engine``: statements unprepared and sharing server connections, LISTEN, heartbeats and lease
guards on the server itself; the terminations then cut the pooler's server connections under the loops (the
pooler's error reaches them, or its answer to a ROLLBACK on a lost server connection). The producers, the
operators and the checks stay on the server. Every invariant below holds unchanged. There (P2), now and then
after a step (a stream of its own), the pooler is paused (``PAUSE``) for 1–6 s while the rules go on: the
loops' statements wait in its queue, with no error, while leases run out; or (P3) it refuses new clients for
1–4 s (``max_client_conn`` lowered to the clients it has).

Some jobs' handlers take a session (transactional handlers): they write an effect row in the transaction
that also writes their fenced completion.

Each event and job carries a *plan* — what its publisher/handler does on its 1st, 2nd, … claim (``retry``,
``defer``, ``hang`` past the timeout, ``boom`` = an unclassified exception, ``exit`` = SystemExit for jobs,
else success) — and a few are *poison* (always permanent). The invariants:

After every step
    I1  nothing from a rolled-back transaction (or savepoint) is ever published or handled;
    I2  per-aggregate order: for ordered event types, an event's first successful delivery comes after the
        first successful delivery (or the operator's skip) of every earlier event of its aggregate;
    I3  one claim is handled at most once (no two executions with the same id and lease_version);
    I4  successful executions beyond the first, summed over all rows, never exceed the lost leases plus the
        timed-out calls the loops counted: a duplicate is always explained by a lease that was lost or by a
        call that overran its timeout (on a loaded machine even an instant handler can: its success was
        recorded, the loop gave up on it and retried — documented at-least-once behaviour);
    I5  no job of a paused queue starts once the workers had time to learn of the pause (a few seconds);
    I6  the limited queue never has more running jobs per key (per queue) than its limit, nor more starts in
        a rate window than its rate; with ``unique_running``, no unique key ever has two running jobs —
        sampled from the rows every 20 ms by a thread of its own;
    I7  a claimed payload decodes as the loops' engine decodes JSON: in half the scenarios that engine has a
        ``json_deserializer`` reading floats as ``Decimal``, and every publisher and handler sees one; in every
        scenario each payload comes back as produced (keys, types, and a text of escapes and non-ASCII); a
        message's ``message_id`` is its dispatcher's ``message_id_prefix`` (half of them have one) and its id;
    I8  an async loop whose run() was cancelled leaves no row leased to it once it has ended (unless its
        backends were terminated meanwhile: then its last write may fail, as documented);
    I9  a job whose row a transaction held past ``stale_after`` is not rescued from the worker that holds
        its lease, neither while the row is held nor the moment it is released (its lease guard), unless
        backends were terminated meanwhile (the guard dies with its connection, as a dead worker's must) or
        renewals were refused meanwhile (the beat fails as a whole, and the refusal's DROP TRIGGER waits for
        the hold to end: the lease runs out unrenewed, and no guard is taken);
    I10 a worker takes each claimed batch in the claim's order — a queue's jobs by priority, higher first,
        whatever form, queues, rooms or limit claimed them — and one that runs a job at a time starts the
        batch's jobs in that order;
    I11 no job starts on a lease older than one it has already started on: a worker starts a job in hand only
        on a lease it knows is alive (its own rescue did not take it back, a claim or beat confirmed it within
        most of ``stale_after``), so a rescue and a new claim can only come after its start;
    I12 no worker starts a job while it runs that job already (unless that run outlived the worker's
        handler_timeout, which gave up on it): a job claimed again while its first run goes on — another
        worker's rescue took it back — waits for that run, whose result it takes when no other claim came
        between (else it runs after it);
    I13 no hot loop through a fault: over an outage a loop fails at most ``FAILED_TURNS_PER_OUTAGE`` turns —
        its backoff's pace, notifications heard meanwhile or not (before, each one ended the wait: 100 a
        second made a loop fail 170-370 turns in 4 s);
    H1  (``rule_hand_over``) a claim that took a job again during its run and landed after the run ended takes
        the run's outcome: the job ran once and is done on the newer lease;
At the end (faults off, loops drained)
    F1  nothing lost: every committed event is delivered (a row missing from the table is one of yesterday's,
        retired with its partition, and was delivered or skipped), except poison ones and those behind a poison
        event of an ordered aggregate that no one skipped; every committed job is done, poison ones failed;
    F2  only poison rows are ``dead``/``failed`` (outages, crashes, timeouts, retries and a NoAnswer on a
        row's last attempt never kill it);
    F3  no aggregate is blocked except behind a dead row;
    F4  no row of a rolled-back transaction exists;
    F5  no hot loop: an idle loop sends at most a few statements per second;
    F6  a transactional handler's effect exists exactly once for a done job and never for any other;
    F7  a job cancelled while queued never runs afterwards and ends ``cancelled``; one cancelled while
        running ends ``cancelled`` or (it finished anyway) ``done`` — never ``failed``, a poison one included,
        whether its handler failed before or after its worker learned of the request (unless an operator
        requeued it since: then it ends as any other job);
    F8  in the half of the scenarios whose workers have ``give_up_after``, a job written longer ago than that
        ends ``failed`` "gave up" if a failure met it (a NoAnswer's or a Defer's refund included), else
        ``done``; no younger job ever gives up (F2 holds for them).
With a cron schedule (the C invariants, at the end)
    C1  one job per slot: no two jobs of the schedule share a slot's unique key;
    C2  no slot that falls in a pause (from the pause's return to the resume's call, database clock) fires;
    C3  the schedule resumed and a worker that fires it running, a new slot fires within 15 s (checked as the
        drain begins, which then pauses the schedule for good);
    C4  every job of the schedule is ``done``, its handler having run it, and none was written after that
        final pause;
    C5  a deploy's ``sync_schedules`` switches the expression between every second and every even second now
        and then (with the operator's pauses): from the moment after the sync's commit on, no slot of the old
        expression fires.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import os
import random
import re
import threading
import time
import traceback
import warnings
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
from sqlalchemy import Engine, create_engine, event, func, select, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import Pool

from sa_outbox import (
    AsyncDispatcher,
    AsyncWorker,
    Backoff,
    ClaimedJob,
    Defer,
    DestinationUnavailable,
    Dispatcher,
    Limit,
    Message,
    NoAnswer,
    PermanentError,
    RetryableError,
    Schedule,
    SchemaError,
    Worker,
    _execute,
    _partitions,
    _steps,
    cancel_jobs,
    emit,
    enqueue,
    enqueue_many,
    maintain_partitions,
    pause_schedule,
    pgbouncer_async_engine,
    pgbouncer_engine,
    resume_schedule,
    skip_dead,
    sync_schedules,
)
from sa_outbox._enqueue import PLANNED_ALONE_FROM
from sa_outbox._names import channel_for
from sa_outbox._sql import partition_table, spec_for
from sa_outbox._worker import WorkerBase
from sa_outbox.admin import pause_queue, resume_queue, retry_dead, retry_jobs, update_jobs
from sa_outbox.migration import create_partitions
from sa_outbox.models import Job, JobSchedule, OutboxEvent, model_for

from .models import Order

ORDERED = ("OrderPlaced", "OrderPaid")
EVENT_TYPES = (*ORDERED, "Noted")
STRING_AGGREGATES = [f"a{i}" for i in range(8)]
POISON_AGGREGATES = {"a0", "a1"}  # the only ones that may get a poison event
FAST = Backoff(0.01, 0.05, jitter=True)
PARTITIONED_TABLE = "model_outbox_p"
#: The loops' connections (and their LISTEN connections) are the ones the fault rule terminates.
LOOP_APP = {"application_name": "model-loop"}
HANG = 0.7  # longer than any publish_timeout / handler_timeout below
LONG = 4.5  # a "long" job's run: longer than stale_after and than rule_hold_job_row's hold of its row
LINGER = 1.2  # a "linger" job's run: a success that takes a while (rule_take_back_running's own job)
#: I12: how much later than its worker's clock a handler's run may start (the thread hand-off, on a loaded box)
HANDOFF_SLACK = 0.1
EVENT_ACTIONS = ("retry", "defer", "hang", "boom", "noanswer")
QUEUES = ("q1", "q2", "q3")
LIMITED = "q3"
#: The workers' give_up_after in the scenarios that set it; an "old" job is written twice as long ago.
GIVE_UP_AFTER = 3600.0
#: Only "fast" workers serve it (sync, inline, instant handlers, this one queue): a burst of jobs written there
#: is claimed by them, each claim sent ahead of the jobs in hand on the worker's own connection.
BURST = "qb"
#: The pooler's max_client_conn (tests/pooler.py), which rule_pooler_refuse_clients sets back.
POOLER_MAX_CLIENTS = 500
#: rule_hand_over's own queue, served by the one worker that step starts.
HANDOVER = "qh"
KEYS = ("k1", "k2", "k3")
UNIQUE_KEYS = ("u1", "u2", "u3")
#: The scenario picks one; every worker serves q3 with it (a limit is the fleet's, so all agree).
LIMITS = (Limit(1, per_key=True), Limit(2, per_key=True), Limit(2), Limit(1, per_key=True, rate="40/s"))
#: A worker learns of a pause with its once-a-second maintenance: starts later than this after a pause are
#: violations (generous: the machine is shared and loaded).
PAUSE_GRACE = 3.0
#: Terminates every backend of the loops (their engine's, and the wake-ups' LISTEN connections).
_TERMINATE_LOOPS = text(
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = current_database() "
    "AND application_name IN ('model-loop', 'sa_outbox.listen')"
)
#: Terminates the backends of the loops' engines only: their LISTEN connections go on hearing notifications.
_TERMINATE_LOOP_STATEMENTS = text(
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = current_database() "
    "AND application_name = 'model-loop'"
)
#: I13: a loop's failed turns over one outage (1-3.5 s). Its backoff allows about six (0.2 s doubling, scaled by
#: 0.5-1); a worker's wait also ends when a handler finishes or a beat gets through after a second, and a
#: turn that claims several queues may count a failure of each. The long profile's 67 outages: at most 27
#: (15 with the LISTEN connections spared); a wake-up per failure, before: 56-62 at a notification every 20 ms.
#: Met again under load (59 and 80): a threaded worker counted the turn that sent its claim ahead a success (the
#: backoff reset before each failed landing), and the landing's own poke ended the wait after it.
FAILED_TURNS_PER_OUTAGE = 50
#: rule_refuse_renewals' trigger: an UPDATE that moves a running job's locked_at on (a beat's or a guard's
#: renewal) fails — of every job, or of the odd ids only (``{which}``: the beats then renew the others one by
#: one); claims, finalizes, releases and rescues change its status and pass.
_REFUSE_RENEWALS = (
    "CREATE OR REPLACE FUNCTION model_no_renewal() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
    "IF OLD.status = 'running' AND NEW.status = 'running' AND NEW.locked_at > OLD.locked_at "
    "AND NEW.lease_version = OLD.lease_version {which} THEN RAISE EXCEPTION 'renewals refused'; END IF; "
    "RETURN NEW; END $$; "
    "CREATE OR REPLACE TRIGGER model_no_renewal BEFORE UPDATE ON jobs FOR EACH ROW "
    "EXECUTE FUNCTION model_no_renewal()"
)
#: rule_take_back_running's pick: the rows of handler calls going on (seq and lease version), locked so no beat
#: renews them meanwhile (a row another transaction holds is passed over).
_RUNNING_TO_TAKE = text(
    "SELECT id, queue, (payload ->> 'seq')::int AS seq FROM jobs "
    "JOIN unnest(CAST(:seqs AS int[]), CAST(:versions AS bigint[])) AS r(seq, version) "
    "ON (payload ->> 'seq')::int = r.seq AND lease_version = r.version "
    "WHERE status = 'running' AND task <> 'model_cron' "
    "ORDER BY random() LIMIT :n FOR UPDATE OF jobs SKIP LOCKED"
)
_WAKE_WORKERS = text("SELECT pg_notify(:channel, :queue)")
_LEASE_AN_HOUR_BACK = text("UPDATE jobs SET locked_at = locked_at - interval '1 hour' WHERE id = ANY(:ids)")
CRON = "model_cron"  # the schedule's name and its jobs' task
JOB_ACTIONS = ("retry", "defer", "hang", "boom", "exit", "noanswer")


#: T1's translate map, as the library's compiled statements are keyed by it.
PUBLIC_MAP = frozenset({(None, "public")})


def decimal_loads(text_: str) -> Any:
    """A json_deserializer some scenarios give the loops' engines: floats as Decimal."""
    return json.loads(text_, parse_float=Decimal)


@dataclass
class Profile:
    steps: int = 40
    max_dispatchers: int = 3
    max_workers: int = 3
    drain_seconds: float = 60.0
    #: Through a pooler, P2 and P3 (its PAUSE, its client limit): off in the default suite's short pooled run —
    #: twice in about 60 pooled scenarios the private PgBouncer stopped taking connections (TCP refused) for
    #: the rest of the scenario, cause not found yet (the failure now prints whether it still runs, and its log)
    pooler_faults: bool = True


@dataclass
class Planned:
    seq: int
    plan: list[str]
    poison: bool
    aggregate: tuple[str, str] | None = None  # (type, id) for events
    event_type: str = ""


#: Text every payload carries: escapes and non-ASCII that the claim's JSON decoding must give back unchanged (I7).
PAYLOAD_NOTE = 'ünï "quoted" \\ back\u2028slash \U0001f600 \x01'
CRON_PAYLOAD = {"cron": True, "note": PAYLOAD_NOTE}


class Record:
    """What the publishers and handlers did, in the order they did it (thread-safe); for handlers also when
    each started and on which queue."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, int, int, str]] = []  # (kind, seq, lease_version, action)
        self.starts: list[tuple[int, str, float]] = []  # (seq, queue, monotonic time)
        #: What the loops' engine decodes a JSON float as (the scenario's json_deserializer), and each payload
        #: a publisher or handler got that decoded otherwise.
        self.float_type: type = float
        self.bad_payloads: list[str] = []
        #: Each batch a worker took (I10): its concurrency and the batch's (seq, lease_version, queue, priority)
        #: in the order it took them.
        self.batches: list[tuple[int, list[tuple[int, int, str, int]]]] = []
        #: I12: the runs going on, (worker, seq) -> (when each started, its lease_version); and the starts beside
        #: one of them. (rule_take_back_running takes only the leases of runs going on.)
        self.in_run: dict[tuple[str, int], list[tuple[float, int]]] = {}
        self.beside_itself: list[str] = []
        #: I3's diagnosis: each time a worker's jobs in hand held one claim (id and lease) twice, and how it got
        #: there (:class:`CheckedQueue`)
        self.in_hand_twice: list[str] = []
        #: I3's diagnosis: which loop's claim handed over each (seq, lease_version), and when (``_accept``)
        self.accepted: dict[tuple[int, int], list[tuple[str, float]]] = defaultdict(list)
        self.runs: list[tuple[str, int, int, float]] = []  # (worker, seq, lease_version, start) of each run
        #: Runs that ended while a claim of their worker was in flight (their result waited for it to land),
        #: and claims that landed with a newer lease of a job whose run had ended meanwhile (land_late).
        self.ended_in_flight = 0
        self.landed_after_run = 0
        #: Claims of a job its worker was running (parked behind the run, or landed after it: WorkerBase._accept).
        self.claimed_while_running = 0

    def check_payload(self, payload: Any) -> None:
        """I7: a claimed payload decodes as the loops' engine decodes JSON, to the value produced (the loops'
        own decoding is a fast path beside json.loads: every key, type and the escaped text must match)."""
        price = payload.get("price")
        wrong = (
            set(payload) != {"seq", "plan", "poison", "price", "note"}
            or type(payload["seq"]) is not int
            or type(payload["poison"]) is not bool
            or not (type(payload["plan"]) is list and all(type(a) is str for a in payload["plan"]))
            or type(price) is not self.float_type
            or price != self.float_type("0.1")
            or payload["note"] != PAYLOAD_NOTE
        )
        if wrong:
            with self.lock:
                self.bad_payloads.append(f"seq {payload.get('seq')}: {payload!r}")

    @contextmanager
    def running(self, who: str, job: ClaimedJob, timeout: float | None) -> Iterator[None]:
        """I12: a handler's run on worker ``who``. A start while the same worker runs the job already is kept,
        unless that run has outlived ``timeout``, the worker's handler_timeout (the worker gave up on it and
        may run the job again while the abandoned call goes on: documented)."""
        key, now = (who, job.payload["seq"]), time.monotonic()
        with self.lock:
            runs = self.in_run.setdefault(key, [])
            # (the worker's timeout counts from the thread hand-off, this run from the handler's first line: a
            # hand-off that took a few ms on a loaded box left a run of 0.392 s "going on" at a restart after
            # a timeout of 0.4 — so a run counts as timed out from HANDOFF_SLACK before its timeout)
            if any(timeout is None or now - began < timeout - HANDOFF_SLACK for began, _ in runs):
                ages = ", ".join(f"{now - began:.3f}" for began, _ in runs)
                self.beside_itself.append(
                    f"{who} started job {key[1]} (lease {job.lease_version}) while running it (runs of {ages} s "
                    f"going on; handler_timeout {timeout})"
                )
            run = (now, job.lease_version)
            runs.append(run)
            self.runs.append((who, key[1], job.lease_version, now))
        try:
            yield
        finally:
            with self.lock:
                runs.remove(run)

    def leases_in_run(self) -> list[tuple[int, int]]:
        """The (seq, lease_version) of every handler call going on."""
        with self.lock:
            return sorted({(seq, lease) for (_, seq), runs in self.in_run.items() for _, lease in runs})

    def add(
        self, kind: str, seq: int, lease_version: int, action: str, queue: str | None = None,
        entered: float | None = None,
    ) -> int:  # fmt: skip
        """Record one call; returns its position (for :meth:`settle`). ``entered``: when the handler was called,
        if that was before now (I5's start: a transactional handler's first statement may wait in a pooler's
        queue — P2's PAUSE — before it comes here)."""
        with self.lock:
            self.events.append((kind, seq, lease_version, action))
            if queue is not None:
                self.starts.append((seq, queue, time.monotonic() if entered is None else entered))
            return len(self.events) - 1

    def settle(self, position: int, action: str) -> None:
        """What a recorded call came to once known (a transactional handler's success at its commit)."""
        with self.lock:
            kind, seq, lease_version, _ = self.events[position]
            self.events[position] = (kind, seq, lease_version, action)

    def snapshot(self) -> list[tuple[str, int, int, str]]:
        with self.lock:
            return list(self.events)

    @contextmanager
    def accepting(self) -> Iterator[None]:
        """Record every batch a worker takes into its hands (``WorkerBase._accept``, which every claim path
        ends in), in the order it takes them (I10)."""
        real = WorkerBase._accept
        real_finish, real_landed = WorkerBase._finish, WorkerBase._landed_after_its_run

        def finish(worker: Any, job: ClaimedJob, ran: Any) -> None:
            real_finish(worker, job, ran)
            if job.id in worker._ended_meanwhile:
                with self.lock:
                    self.ended_in_flight += 1

        def landed(worker: Any, row: Any) -> None:
            with self.lock:
                self.landed_after_run += 1
            real_landed(worker, row)

        def accept(worker: Any, rows: Any) -> int:
            if not isinstance(worker._queue, CheckedQueue):
                worker._queue = CheckedQueue(self, worker.owner, worker._queue)
            n = real(worker, rows)
            parked = sum(1 for r in rows if getattr(worker._parked.get(r[0]), "lease_version", None) == r[1])
            if parked:
                with self.lock:
                    self.claimed_while_running += parked
            taken = list(worker._queue)[len(worker._queue) - n :]
            batch = [(seq_of(j), j.lease_version, j.queue, j.priority) for j in taken]
            now = time.monotonic()
            with self.lock:
                self.batches.append((worker.concurrency, batch))
                for row in rows:
                    with contextlib.suppress(Exception):
                        self.accepted[(json.loads(row[6])["seq"], row[1])].append((worker.owner, now))
            return n

        WorkerBase._accept = accept  # type: ignore[method-assign]
        WorkerBase._finish = finish  # type: ignore[method-assign]
        WorkerBase._landed_after_its_run = landed  # type: ignore[method-assign]
        try:
            yield
        finally:
            WorkerBase._accept = real  # type: ignore[method-assign]
            WorkerBase._finish = real_finish  # type: ignore[method-assign]
            WorkerBase._landed_after_its_run = real_landed  # type: ignore[method-assign]


class CheckedQueue(deque[Any]):
    """A worker's jobs in hand (``WorkerBase._queue``) that notes, with the stack that did it, every time one
    claim (job id and lease version) is put in it while it is there already: a claim started twice (I3) is
    then told by the path that queued it again, not only by its two runs."""

    def __init__(self, record: Record, who: str, items: Any = ()) -> None:
        super().__init__(items)
        self.record, self.who = record, who

    def _check(self, how: str) -> None:
        twice = [k for k, n in Counter((j.id, j.lease_version) for j in self).items() if n > 1]
        if twice:
            stack = "".join(traceback.format_stack(limit=10)[:-2])
            with self.record.lock:
                self.record.in_hand_twice.append(f"{self.who}: {twice} in hand twice after {how}:\n{stack}")

    def append(self, x: Any) -> None:
        super().append(x)
        self._check("append")

    def appendleft(self, x: Any) -> None:
        super().appendleft(x)
        self._check("appendleft")

    def extend(self, xs: Any) -> None:
        super().extend(xs)
        self._check("extend")

    def extendleft(self, xs: Any) -> None:
        super().extendleft(xs)
        self._check("extendleft")


def land_late(worker: Worker, rng: random.Random) -> Worker:
    """A sync worker whose claims, sent on its claim thread, reach the loop 50-350 ms after they committed (two in
    three of them): a slow round trip's answer, a GIL the claim thread waits for. Runs end meanwhile — a job's
    result then waits for the claim to land, and when the claim took that job again (its lease ran out under
    the run: renewals refused, the database out of reach, and another worker's rescue put it back) the run
    is decided on the newer lease or as a lost lease (``WorkerBase._finish``, ``_landed_after_its_run``; I3,
    I4, I11, I12 check what came of it). ``rng`` is drawn from the loop's thread only."""
    submit = worker._claimer.submit

    def send(fn: Any, *args: Any) -> Any:
        delay = rng.choice((0.0, 0.05, 0.15, 0.35, 0.15, 0.0))

        def claim() -> Any:
            result = fn(*args)
            if delay:
                time.sleep(delay)
            return result

        return submit(claim)

    worker._claimer.submit = send  # type: ignore[method-assign]
    return worker


def land_after_the_run(worker: Worker, record: Record, who: str) -> Worker:
    """A sync worker whose claim that took a job again (lease 2 or later) reaches the loop only once the job's
    run on this worker has ended (and 50 ms more): the claim committed during the run, so the run ends with it
    in flight and its rows land after — the in-flight hand-over (``_landed_after_its_run``) every time, not by
    chance (:meth:`Scenario.rule_hand_over`). Other claims land as they come."""
    submit = worker._claimer.submit

    def send(fn: Any, *args: Any) -> Any:
        def claim() -> Any:
            result = fn(*args)
            again = [row for row in result[1] if row[1] >= 2]
            if again:
                seqs = {json.loads(row[6]).get("seq") for row in again}
                deadline = time.monotonic() + 2 * LINGER
                while time.monotonic() < deadline:
                    with record.lock:
                        if not any(record.in_run.get((who, seq)) for seq in seqs):
                            break
                    time.sleep(0.005)
                time.sleep(0.05)  # (from the handler's return to the loop's _finish)
            return result

        return submit(claim)

    worker._claimer.submit = send  # type: ignore[method-assign]
    return worker


def seq_of(job: ClaimedJob) -> int:
    """A job's seq in the record: its payload's, or for a cron job (no seq) minus its id."""
    return job.payload["seq"] if job.task != CRON else -job.id


def make_cron_handler(record: Record) -> Any:
    """The cron jobs' handler: records the call (kind "cron", minus the job's id) and checks the payload (I7)."""

    def handle(job: ClaimedJob) -> None:
        if job.payload != CRON_PAYLOAD or type(job.payload["cron"]) is not bool:
            with record.lock:
                record.bad_payloads.append(f"cron job {job.id}: {job.payload!r}")
        record.add("cron", -job.id, job.lease_version, "ok", queue=job.queue)

    return handle


def _action(plan: list[str], lease_version: int) -> str:
    return plan[lease_version - 1] if 0 < lease_version <= len(plan) else "ok"


class ModelPublisher:
    """Publishes by the message's plan; raises DestinationUnavailable while the outage lasts."""

    def __init__(self, record: Record, outage: threading.Event, prefix: str = "") -> None:
        self.record = record
        self.outage = outage
        self.prefix = prefix  # its dispatcher's message_id_prefix

    def _do(self, message: Message) -> str:
        if self.outage.is_set():
            raise DestinationUnavailable("model broker is down")
        payload = message.payload
        self.record.check_payload(payload)
        if message.message_id != f"{self.prefix}{message.id}":  # I7: the id every publisher's id slot carries
            with self.record.lock:
                self.record.bad_payloads.append(f"seq {payload['seq']}: message_id {message.message_id!r}")
        action = "permanent" if payload["poison"] else _action(payload["plan"], message.lease_version)
        self.record.add("publish", payload["seq"], message.lease_version, action)
        if action == "retry":
            raise RetryableError("planned retry")
        if action == "noanswer":
            raise NoAnswer("planned no answer")
        if action == "defer":
            raise Defer(0.02, "planned defer")
        if action == "boom":
            raise ValueError("planned unclassified error")
        if action == "permanent":
            raise PermanentError("poison event")
        return action

    def publish(self, message: Message) -> None:
        if self._do(message) == "hang":
            time.sleep(HANG)
            raise RetryableError("planned hang (the publish timeout should have fired first)")


class AsyncModelPublisher(ModelPublisher):
    async def publish(self, message: Message) -> None:  # type: ignore[override]
        if self._do(message) == "hang":
            await asyncio.sleep(HANG)
            raise RetryableError("planned hang")


def make_handler(
    record: Record, *, is_async: bool, in_transaction: bool = False, pace: float = 0.0, who: str = "",
    timeout: float | None = None,
) -> Any:  # fmt: skip
    """The model's handler: acts by the job's plan. ``in_transaction``: it takes a session and writes an effect
    row first, which must commit exactly when the job's completion does (and roll back otherwise). ``who``
    and ``timeout``: its worker's name and handler_timeout (I12, :meth:`Record.running`). ``pace``:
    a sync handler also takes this long. A concurrency-1 Worker then sends its next claim on the claim thread:
    beside the last job in hand at 2 ms, with jobs still queued at 0.4 ms and a batch of 4 or 10; with no pace
    its own thread sends the claim ahead of the jobs in hand and reads it after them."""

    def act(job: ClaimedJob, session: Session | None = None, entered: float | None = None) -> str:
        payload = job.payload
        record.check_payload(payload)
        action = "permanent" if payload["poison"] else _action(payload["plan"], job.lease_version)
        if action == "long":  # a success that takes LONG (see rule_hold_job_row)
            record.add("handle", payload["seq"], job.lease_version, "ok", queue=job.queue, entered=entered)
            return action
        if action == "linger":  # a success after LINGER (rule_take_back_running's): "ok" once it has returned
            at = record.add(
                "handle", payload["seq"], job.lease_version, "cut short", queue=job.queue, entered=entered
            )
            return f"linger {at}"
        if session is not None and action == "ok":
            # A transactional handler's success is one only if its transaction commits with the completion:
            # a completion that failed (a terminated connection) rolls the call back and the job runs again
            # — at least once, its effect still exactly once (model_effects). "ok" once it commits.
            at = record.add(
                "handle", payload["seq"], job.lease_version, "rolled back", queue=job.queue, entered=entered
            )
            event.listen(session, "after_commit", lambda _s: record.settle(at, "ok"), once=True)
            return action
        record.add("handle", payload["seq"], job.lease_version, action, queue=job.queue, entered=entered)
        if action == "retry":
            raise RetryableError("planned retry")
        if action == "noanswer":
            raise NoAnswer("planned no answer")
        if action == "defer":
            raise Defer(0.02, "planned defer")
        if action == "boom":
            raise ValueError("planned unclassified error")
        if action == "permanent":
            raise PermanentError("poison job")
        if action == "exit":
            raise SystemExit(3)
        return action

    effect = text("INSERT INTO model_effects (seq) VALUES (:s)")

    def linger(done: str) -> None:  # what a "long" or a "hang" plan does once act() has recorded the call
        if done == "long":
            time.sleep(LONG)
        elif done.startswith("linger "):
            time.sleep(LINGER)
            record.settle(int(done.split()[1]), "ok")
        elif done == "hang":
            time.sleep(HANG)
            raise RetryableError("planned hang")

    async def linger_async(done: str) -> None:
        if done == "long":
            await asyncio.sleep(LONG)
        elif done.startswith("linger "):
            await asyncio.sleep(LINGER)
            record.settle(int(done.split()[1]), "ok")
        elif done == "hang":
            await asyncio.sleep(HANG)
            raise RetryableError("planned hang")

    if is_async and in_transaction:

        async def handle_async_tx(job: ClaimedJob, session: AsyncSession) -> None:
            with record.running(who, job, timeout):
                entered = time.monotonic()
                await session.execute(effect, {"s": job.payload["seq"]})
                done = act(job, session.sync_session, entered)
                await linger_async(done)

        return handle_async_tx
    if is_async:

        async def handle_async(job: ClaimedJob) -> None:
            with record.running(who, job, timeout):
                done = act(job)
                await linger_async(done)

        return handle_async
    if in_transaction:

        def handle_tx(job: ClaimedJob, session: Session) -> None:
            with record.running(who, job, timeout):
                entered = time.monotonic()
                session.execute(effect, {"s": job.payload["seq"]})
                done = act(job, session, entered)
                linger(done)

        return handle_tx

    def handle(job: ClaimedJob) -> None:
        with record.running(who, job, timeout):
            if pace:
                time.sleep(pace)
            linger(act(job))

    return handle


class LimitSampler:
    """I6: reads the limited queue's rows every 20 ms on a connection of its own and keeps what broke the limit."""

    def __init__(self, engine: Engine, limit: Limit | None) -> None:
        self.engine, self.limit = engine, limit
        self.violations: list[str] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="limit-sampler", daemon=True)

    def _main(self) -> None:
        if self.limit is None:  # unique_running: no key twice at once, in any queue
            self._unique()
            return
        key = "concurrency_key" if self.limit.per_key else "''"
        running = text(
            f"SELECT {key} AS k, count(*) AS n FROM jobs WHERE queue = :q AND status = 'running' GROUP BY 1"
        )
        starts = text("SELECT key, count(*) FROM jobs_starts WHERE queue = :q "
                      "AND at > now() - make_interval(secs => :w) GROUP BY 1")  # fmt: skip
        with self.engine.connect() as conn:
            while not self._stop.wait(0.02):
                for k, n in conn.execute(running, {"q": LIMITED}):
                    if self.limit.concurrency is not None and n > self.limit.concurrency:
                        self.violations.append(f"{n} running jobs of key {k!r} (limit {self.limit})")
                if self.limit.rate_count is not None:
                    for k, n in conn.execute(starts, {"q": LIMITED, "w": self.limit.rate_window}):
                        if n > self.limit.rate_count:
                            self.violations.append(f"{n} starts of key {k!r} in one window ({self.limit})")
                conn.rollback()
                self.samples += 1

    def _unique(self) -> None:
        twice = text("SELECT unique_key, count(*) FROM jobs WHERE status = 'running' AND unique_key IS NOT NULL "
                     "GROUP BY 1 HAVING count(*) > 1")  # fmt: skip
        with self.engine.connect() as conn:
            while not self._stop.wait(0.02):
                for k, n in conn.execute(twice):
                    self.violations.append(f"{n} running jobs of unique key {k!r} (unique_running)")
                conn.rollback()
                self.samples += 1

    def start(self) -> LimitSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


class LoopThread:
    """One Dispatcher/Worker (sync, or async on its own event loop) running in a thread of its own."""

    def __init__(
        self, name: str, build: Callable[[Any], Any], *, is_async: bool, engine: Engine,
        async_engine: Callable[[], AsyncEngine], run_kwargs: dict[str, Any] | None = None,
        terminations_at_start: int = 0,
    ):  # fmt: skip
        self.name = name
        self.build = build
        self.is_async = is_async
        self.engine = engine
        #: the async flavour's engine, made on its own event loop (the scenario's: direct or through PgBouncer)
        self.async_engine = async_engine
        self.loop: Any = None
        self.aloop: asyncio.AbstractEventLoop | None = None  # the async flavour's event loop and main task
        self.task: asyncio.Task[Any] | None = None  # the async flavour's run() task
        self._leave: asyncio.Event | None = None
        #: After leave(): the loop and engine asyncio.run() left behind, closed by the thread afterwards.
        self.left: tuple[Any, Any] | None = None
        self.run_kwargs = run_kwargs or {}
        self.terminations_at_start = terminations_at_start  # backend terminations before it started
        self.exited: BaseException | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def _main(self) -> None:
        try:
            if self.is_async:
                self._run_async()
            else:
                self.loop = self.build(self.engine)
                self.ready.set()
                try:
                    self.loop.run(install_signal_handlers=False, **self.run_kwargs)
                finally:
                    self.loop.close()
        except BaseException as exc:  # SystemExit from a handler: the "process" leaves, as it would
            self.exited = exc
        finally:
            self.ready.set()

    def _run_async(self) -> None:
        """``asyncio.run(self._amain())``, written out: after a leave(), what the runner does once ``main()``
        returned — every task left cancelled with the loop stopped, then waited for — and then the loop and the
        engine closed on that same loop (closed from another one, the pool's connections were left to the
        collector: "connections left open")."""
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)  # (as the runner does: code that asks for the thread's loop finds it)
        try:
            loop.run_until_complete(self._amain())
        finally:
            try:
                for _ in range(5):  # however main() ended: as the runner's teardown — and again for tasks the
                    left = asyncio.all_tasks(loop)  # ones cancelled started meanwhile (closed with the loop,
                    if not left:  # a pending one would be closed by the collector instead)
                        break
                    for task in left:
                        task.cancel()  # (the loop is not running)
                    with contextlib.suppress(
                        BaseException
                    ):  # (a handler's SystemExit: recorded by the thread)
                        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
                if self.left is not None:
                    loop.run_until_complete(self._close(*self.left))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    async def _amain(self) -> None:
        aengine = self.async_engine()
        try:
            self.loop = self.build(aengine)
            self._leave = asyncio.Event()
            run = asyncio.ensure_future(self.loop.run(install_signal_handlers=False, **self.run_kwargs))
            self.aloop, self.task = asyncio.get_running_loop(), run
            self.ready.set()
            leave = asyncio.ensure_future(self._leave.wait())
            try:
                await asyncio.wait({run, leave}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                leave.cancel()
            if not run.done():  # leave(): main() returns with run() going, as an application's may
                self.left = (self.loop, aengine)
                return
            try:
                await run
            finally:
                await asyncio.shield(self.loop.close())
        except BaseException:
            await aengine.dispose()
            raise
        await aengine.dispose()

    @staticmethod
    async def _close(loop: Any, aengine: Any) -> None:
        await loop.close()
        await aengine.dispose()

    def start(self) -> LoopThread:
        self.thread.start()
        self.ready.wait(10)
        return self

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        if self.loop is not None:
            self.loop.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.name} did not stop within {timeout}s"

    def leave(self, timeout: float = 30.0) -> None:
        """The async flavour's ``main()`` returns with ``run()`` still going: ``asyncio.run()`` then cancels
        every task left — run()'s and the library's inner ones — with the event loop stopped, and waits for them.
        Wait for the thread to end."""
        assert self.aloop is not None and self._leave is not None
        with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
            self.aloop.call_soon_threadsafe(self._leave.set)
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.name} did not end within {timeout}s of asyncio.run()'s end"

    def cancel(self, times: int, timeout: float = 30.0) -> None:
        """Cancel the async flavour's run() (its main task) ``times`` times, a few ms apart — as a task group,
        ``asyncio.timeout`` or anyio's cancel scope would — and wait for the thread to end."""
        assert self.aloop is not None and self.task is not None
        for _ in range(times):
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                self.aloop.call_soon_threadsafe(self.task.cancel)
            time.sleep(0.003)
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.name} did not end within {timeout}s of its cancellation"


class StatementCounter:
    """Counts the loops' statements per thread (every engine step goes through ``_steps.run``, or, for a claim
    an inline worker sends ahead of its jobs in hand, ``_steps.send``), and how many claims were sent ahead."""

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()
        self.sent_ahead = 0
        self.lock = threading.Lock()
        self.real = _steps.run
        self.real_send = _steps.send

    def __call__(self, conn: Any, stmt: Any, params: dict[str, Any], **options: Any) -> list[Any]:
        with self.lock:
            self.counts[threading.get_ident()] += 1
        return self.real(conn, stmt, params, **options)

    def send(self, conn: Any, stmt: Any, params: dict[str, Any]) -> Any:
        receive = self.real_send(conn, stmt, params)
        if receive is not None:
            with self.lock:
                self.counts[threading.get_ident()] += 1
                self.sent_ahead += 1
        return receive

    @contextmanager
    def installed(self) -> Iterator[StatementCounter]:
        _steps.run = self  # type: ignore[assignment]
        _steps.send = self.send  # type: ignore[assignment]
        try:
            yield self
        finally:
            _steps.run = self.real
            _steps.send = self.real_send

    def snapshot(self) -> Counter[int]:
        with self.lock:
            return Counter(self.counts)


@dataclass
class Model:
    """What the database and the loops must agree with."""

    events: dict[int, Planned] = field(default_factory=dict)  # committed, by seq
    jobs: dict[int, Planned] = field(default_factory=dict)
    rolled_back_events: set[int] = field(default_factory=set)
    rolled_back_jobs: set[int] = field(default_factory=set)
    #: jobs that were never written (a unique key's waiting job skipped them) or whose row another call's
    #: replace/debounce took over before it started: none may ever run, nor be found in the table
    superseded_jobs: set[int] = field(default_factory=set)
    old_jobs: set[int] = field(default_factory=set)  # written past the workers' give_up_after (F8)
    taken_back: set[int] = field(default_factory=set)  # jobs rule_take_back_running took from under a run
    order: dict[tuple[str, str], list[int]] = field(default_factory=lambda: defaultdict(list))
    skipped: dict[int, int] = field(default_factory=dict)  # seq -> position in the record when skipped
    in_transaction: set[int] = field(default_factory=set)  # jobs whose handler writes an effect in its tx
    cancelled_queued: dict[int, int] = field(default_factory=dict)  # seq -> record position when cancelled
    cancel_requested: set[int] = field(default_factory=set)  # running when cancelled: see F7
    pauses: dict[str, list[list[float]]] = field(default_factory=lambda: defaultdict(list))  # [start, end]
    yesterday: set[int] = field(default_factory=set)  # committed events written into yesterday's partition

    def paused(self, queue: str) -> bool:
        """Whether ``queue`` is paused now (its last pause window has not ended)."""
        windows = self.pauses[queue]
        return bool(windows) and windows[-1][1] == float("inf")


#: rule_hold_job_row's pick: a running job's row, locked as a user's transaction would lock it.
_JOB_STATE = text(
    "SELECT status, queue, attempts, run_at > now() FROM jobs WHERE (payload->>'seq')::int = :seq"
)
_HOLD_RUNNING = text(
    "SELECT id, lease_version, locked_by FROM jobs WHERE status = 'running' AND (payload->>'seq')::int = :seq "
    "FOR UPDATE SKIP LOCKED"
)


@dataclass(frozen=True)
class Pooler:
    """PgBouncer in transaction pooling mode in front of the test database: ``url`` is the pooler, ``direct``
    the server (the loops' LISTEN connections and a worker's heartbeat and lease guard go there, as
    :func:`sa_outbox.pgbouncer_engine` routes them)."""

    url: URL
    direct: URL
    #: what the pooler says of its pools and server connections now (told with a failure)
    state: Callable[[], str] | None = None
    #: a command of the pooler's admin console (``PAUSE <alias>``, ``SET max_client_conn = 10``), on a given
    #: admin connection or one of its own: its rows
    admin: Callable[..., list[dict[str, Any]]] | None = None
    #: a connection to the pooler's admin console (kept while ``max_client_conn`` is lowered)
    admin_connection: Callable[[], Any] | None = None


class Scenario:
    def __init__(
        self, seed: int, engine: Engine, async_url: URL, profile: Profile, pooler: Pooler | None = None
    ) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.analyze_rng = random.Random(f"analyze {seed}")
        #: rule_db_outage's draws: a stream of its own, as analyze_rng.
        self.db_outage_rng = random.Random(f"db outage {seed}")
        #: Whether an outage spares the LISTEN connections and notifies throughout (a stream of its own).
        self.listen_spared_rng = random.Random(f"listen spared {seed}")
        #: rule_refuse_renewals' draws: a stream of its own, as analyze_rng.
        self.refusal_rng = random.Random(f"refused renewals {seed}")
        self.lock_rng = random.Random(f"lock {seed}")
        self.bulk_rng = random.Random(f"bulk unique {seed}")
        #: Half the scenarios give every worker give_up_after (GIVE_UP_AFTER); some jobs are then written "old"
        #: (created_at backdated past it): any failure fails them (F8). Its own stream, as above.
        self.old_rng = random.Random(f"give up {seed}")
        self.give_up = self.old_rng.random() < 0.5
        #: How rule_maintain_partitions retires (its own stream, as above): keeping dead rows or dropping them,
        #: and sometimes only closing yesterday's partition, as a run that died before its detach leaves it.
        self.retire_rng = random.Random(f"retire {seed}")
        #: The operator's jobs control and dead-event retries (its own stream, as above): rule_cancel and
        #: rule_skip_dead sometimes retry or update instead of, or after, what they did before.
        self.control_rng = random.Random(f"control {seed}")
        self.controlled: Counter[str] = Counter()  # what those calls changed, by action (coverage)
        #: Half the scenarios (a stream of their own) have a cron schedule firing a job every second into a
        #: queue of QUEUES, fired by the workers that are given the schedules (some of them), paused and
        #: resumed by an operator now and then: see the C invariants.
        self.cron_rng = random.Random(f"cron {seed}")
        #: which sync workers' claims land late (:func:`land_late`), and each such worker's own delays
        self.late_rng = random.Random(f"late landings {seed}")
        self.take_back_rng = random.Random(f"take back {seed}")
        #: rule_pooler_pause's draws (through a pooler only): a stream of its own, as analyze_rng.
        self.pooler_pause_rng = random.Random(f"pooler pause {seed}")
        self.cron = self.cron_rng.random() < 0.5
        #: The schedule's pauses, by the database clock: [after the pause returned, before the resume began].
        self.cron_pauses: list[list[datetime | None]] = []
        self.cron_jobs_at_pause: int | None = None  # cron jobs when the drain paused the schedule for good
        self.cron_workers: set[str] = set()  # the workers that fire it
        # In two seeds of three every event type is ordered (Dispatcher(ordered=True), whose claim takes the heads form
        # after a short claim); in the others only ORDERED (ordered=[…], always the walk). Not drawn: the seed's
        # draws stay what they were, and the fixed seeds cover both.
        self.all_ordered = seed % 3 != 0
        self.ordered_types = EVENT_TYPES if self.all_ordered else ORDERED
        # Its own engine: backends are terminated under it (pre-ping replaces a terminated pooled connection).
        self.engine = create_engine(engine.url, pool_pre_ping=True, pool_size=10, max_overflow=20)
        with self.engine.begin() as conn:
            conn.execute(text("CREATE TABLE IF NOT EXISTS model_effects (seq bigint)"))
            conn.execute(text("TRUNCATE model_effects"))
        # The sync loops' engine has no pre-ping: the loops must ride out terminated connections themselves.
        #: I7's rule: half the scenarios give the loops' engines a json_deserializer that reads floats as
        #: Decimal (drawn from its own stream, so a seed's other choices stay what they were).
        self.loop_engine_kwargs: dict[str, Any] = {}
        if random.Random(seed * 7919 + 1).random() < 0.5:
            self.loop_engine_kwargs["json_deserializer"] = decimal_loads
        #: T1: in a quarter of the scenarios (a stream of its own) the loops' engines carry a tenant's
        #: ``schema_translate_map`` — to ``public``, where the tables are, so the rows stay where the model reads
        #: them while every loop statement is compiled, prepared and run as a tenant's (its schema written in),
        #: beside the producers' and the operators' untranslated ones in the same process.
        self.translated = random.Random(f"tenant {seed}").random() < 0.25
        if self.translated:
            self.loop_engine_kwargs["execution_options"] = {"schema_translate_map": {None: "public"}}
        #: P1: the loops reach the database through PgBouncer (transaction pooling): their statements share
        #: and swap server connections, unprepared, their LISTEN, heartbeats and guards go to the server itself,
        #: and a termination cuts a server connection under the pooler (what its clients see: the pooler's
        #: error, their connection closed). The producers, operators and checks stay on the server.
        self.pooler = pooler
        #: what every loop is given for its wake-ups when it listens (through the pooler: LISTEN on the server)
        self.listen_to: dict[str, Any] = {}
        if pooler is None:
            self.loop_engine = create_engine(
                engine.url, pool_size=10, max_overflow=20, connect_args=LOOP_APP, **self.loop_engine_kwargs
            )
        else:
            self.loop_engine, wakeups = pgbouncer_engine(
                pooler.url, direct_url=pooler.direct, pool_size=10, max_overflow=20, connect_args=LOOP_APP,
                **self.loop_engine_kwargs,
            )  # fmt: skip
            self.listen_to = {"listen_url": wakeups["listen_url"]}
        self.async_url = async_url
        self.profile = profile
        #: C5: the cron expression in force from each moment on (a deploy's sync changes it while loops fire it);
        #: drawn from a generator of its own, so the other streams of a seed stay what they were
        self.resync_rng = random.Random(f"resync {seed}")
        self.cron_changes: list[tuple[datetime, str]] = []
        if self.cron:
            self.cron_schedule = Schedule(
                CRON, "* * * * * *", task=CRON, payload=CRON_PAYLOAD, queue=self.cron_rng.choice(("q1", "q2")),
                catch_up=self.cron_rng.choice(("latest", "all", "none")), priority=self.cron_rng.choice((0, 3)))  # fmt: skip
            sync_schedules(self.engine, JobSchedule, [self.cron_schedule])
            self.cron_changes.append((self._db_now(), self.cron_schedule.cron))
        self.model = Model()
        self.record = Record()
        if "json_deserializer" in self.loop_engine_kwargs:
            self.record.float_type = Decimal
        self.outage = threading.Event()
        self.seq = itertools.count(1)
        self.dispatchers: list[LoopThread] = []
        self.workers: list[LoopThread] = []
        self.finished: list[LoopThread] = []
        self.orders: list[int] = []
        self.log: list[str] = []
        self.names = itertools.count(1)
        self.terminations = 0
        self.sent_ahead = 0  # claims inline workers sent ahead of their jobs in hand (StatementCounter)
        self.every_queue: set[str] = set()  # the workers that serve every queue (drain() needs one)
        self.burst_workers: set[str] = set()  # the fast workers that serve BURST (drain() needs one)
        #: I9: (job id, lease version, owner, terminations when the hold began, terminations a second after
        #: it ended, whether the rescue sent as it ended took the job, whether renewals were refused meanwhile)
        #: of each job row a transaction held past stale_after (rule_hold_job_row).
        self.holds: list[tuple[int, int, str, int, int, bool, bool]] = []
        self.holder: threading.Thread | None = None
        self.cutter: threading.Thread | None = None  # rule_db_outage's
        self.fault_storms: list[str] = []  # I13's violations, found by rule_db_outage's thread
        self.refuser: threading.Thread | None = None  # rule_refuse_renewals'
        self.pauser: threading.Thread | None = None  # rule_pooler_pause's (or rule_pooler_refuse_clients')
        self.pooler_pauses = 0
        self.pooler_refusals = 0
        #: the jobs rule_hold_job_row holds (rule_take_back_running leaves them alone)
        self.hold_seqs: set[int] = set()
        self.taken_back = 0  # jobs rule_take_back_running took from under their runs
        self.left_running = (
            0  # async loops whose asyncio.run() ended with run() going (rule_cancel_async_loop)
        )
        self.handed_over = 0  # claims rule_hand_over saw land after their job's run ended (H1)
        self.lingering = False  # whether rule_take_back_running has enqueued its lingering job
        self.refusal_epochs = 0  # refusals begun plus refusals lifted (odd: renewals are refused now)
        self.db_outages = 0
        #: When the rules ended (the final drain begins).
        self.steps_over: float | None = None
        self.locked_pending = 0  # pending events a user's transaction locked (rule_lock_pending_events)
        self.analyzed = 0  # ANALYZE runs amid the loops (rule_analyze)
        #: enqueue_many calls of PLANNED_ALONE_FROM items or more (sent unprepared, planned for their arrays)
        self.planned_alone = 0
        #: q3's rule: a Limit for every worker, or (a quarter of the scenarios) unique keys and unique_running.
        self.limit: Limit | None = None if self.rng.random() < 0.25 else self.rng.choice(LIMITS)
        self.sampler = LimitSampler(self.engine, self.limit)
        #: A quarter of the scenarios run on a day-partitioned outbox with a partition for yesterday too: some
        #: events are written into it, and maintain_partitions (a rule, and the dispatchers' own step) retires
        #: it while the loops claim from the table, once none of its rows is unfinished or dead.
        self.partitioned = self.rng.random() < 0.25
        self.Outbox: Any = OutboxEvent
        self.yesterday_open = self.partitioned  # producers still write into yesterday's partition
        if self.partitioned:
            self.Outbox = model_for("outbox", PARTITIONED_TABLE, partitioned="day")
            with self.engine.begin() as conn:
                conn.execute(text(f"DROP TABLE IF EXISTS {PARTITIONED_TABLE} CASCADE"))
            self.Outbox.__table__.create(self.engine)
            with self.engine.begin() as conn:
                create_partitions(
                    conn, PARTITIONED_TABLE, period="day", since=datetime.now(UTC) - timedelta(days=1)
                )

    # -- rules: producers ----------------------------------------------------------------------------------

    def _event(self, aggregate: tuple[str, str]) -> Planned:
        poison = aggregate[1] in POISON_AGGREGATES and self.rng.random() < 0.3
        plan = [self.rng.choice(EVENT_ACTIONS) for _ in range(self.rng.randint(0, 2))]
        return Planned(next(self.seq), plan, poison, aggregate, self.rng.choice(EVENT_TYPES))

    def _payload(self, p: Planned) -> dict[str, Any]:
        return {"seq": p.seq, "plan": p.plan, "poison": p.poison, "price": 0.1, "note": PAYLOAD_NOTE}

    def _outbox_row(self, p: Planned, **extra: Any) -> Any:
        """The outbox row of a planned event (``extra``: created_at, available_at)."""
        assert p.aggregate is not None
        return self.Outbox(aggregate_type=p.aggregate[0], aggregate_id=p.aggregate[1], event_type=p.event_type,
                           payload=self._payload(p), **extra)  # fmt: skip

    def _commit_or_not(self) -> bool:
        return self.rng.random() < 0.85

    def _remember(self, planned: list[Planned], committed: bool) -> None:
        for p in planned:
            if committed:
                self.model.events[p.seq] = p
                assert p.aggregate is not None
                self.model.order[p.aggregate].append(p.seq)
            else:
                self.model.rolled_back_events.add(p.seq)

    def rule_produce_add(self) -> None:
        planned = [
            self._event(("acct", self.rng.choice(STRING_AGGREGATES))) for _ in range(self.rng.randint(1, 4))
        ]
        commit = self._commit_or_not()
        # On the partitioned outbox, some events are yesterday's (their created_at picks the partition).
        yesterday = self.yesterday_open and self.rng.random() < 0.4
        extra = {"created_at": datetime.now(UTC) - timedelta(days=1)} if yesterday else {}
        if yesterday:  # more poison there (its own stream): dead rows for a retire to keep, or drop
            for p in planned:
                assert p.aggregate is not None
                p.poison = p.poison or (
                    p.aggregate[1] in POISON_AGGREGATES and self.retire_rng.random() < 0.5
                )
        with Session(self.engine) as s:
            s.begin()
            s.add_all(self._outbox_row(p, **extra) for p in planned)
            try:
                s.flush()
            except DBAPIError as exc:
                # maintain_partitions closed or retired yesterday's partition (every row in it was finished):
                # a row for it is refused, the whole transaction with it — nothing half-written
                assert yesterday and (
                    "no partition of relation" in str(exc) or "sa_outbox_retiring" in str(exc)
                ), exc
                s.rollback()
                self.yesterday_open = False
                self.log.append(f"yesterday's partition is gone: {[p.seq for p in planned]} rolled back")
                self._remember(planned, False)
                return
            s.commit() if commit else s.rollback()
        if yesterday and commit:
            self.model.yesterday.update(p.seq for p in planned)
        self._remember(planned, commit)

    def rule_maintain_partitions(self) -> None:
        """Retire finished past partitions — in some runs dropping dead rows too (``keep_dead=False``, as
        ``partitions maintain --retire-dead``), or only closing yesterday's partition, as a run killed before
        its detach leaves it: then writes into it are refused (producers, an operator's skip) until a later
        run retires it or opens it again."""
        if not self.partitioned:
            return
        ahead = self.rng.randint(1, 3)
        keep_dead = self.retire_rng.random() < 0.6
        if self.retire_rng.random() < 0.3:
            self._close_yesterday(keep_dead)
            return
        position = len(self.record.snapshot())
        report = maintain_partitions(self.engine, self.Outbox, ahead=ahead, keep_dead=keep_dead)
        assert not report.errors, report.errors
        self.log.append(
            f"maintain_partitions(keep_dead={keep_dead}): retired {report.retired} kept {report.kept}"
        )
        if keep_dead or not report.retired:
            return
        # Dead rows go with their partition, as an operator's skip would: from before this call on, their
        # aggregates' next events may be delivered (a dead row holds them back until the detach hides it).
        delivered = {
            seq for kind, seq, _, action in self.record.snapshot() if kind == "publish" and action == "ok"
        }
        with self.engine.connect() as conn:
            present = {r["seq"] for r in conn.execute(select(self.Outbox.payload)).scalars()}
        for seq in sorted(self.model.yesterday - present - delivered - set(self.model.skipped)):
            if self.model.events[seq].poison:  # (any other would be lost: F1 says so)
                self.model.skipped[seq] = position
                self.log.append(f"dead event seq {seq} retired with its partition")

    def _close_yesterday(self, keep_dead: bool) -> None:
        """What a retire that died between its close and its detach leaves: yesterday's partition closed, when
        nothing unfinished (nor dead, with ``keep_dead``) is in it — the close counts again under its lock."""
        with self.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            spec, _ = _partitions._table_of(conn, self.Outbox)
            now = conn.execute(text("SELECT now()")).scalar_one()
            for p in _partitions.list_partitions(conn, self.Outbox, counts=False):
                if p.upper is not None and p.upper <= now and not (p.closed or p.detach_pending):
                    try:
                        held = _partitions._close(conn, spec, partition_table(p.name, p.schema), keep_dead)
                    except DBAPIError as exc:
                        # its lock not had within the close's bound (a dispatcher's own maintain step is
                        # detaching it, or a claim holds it), or that step dropped it meanwhile: no harm
                        assert "lock timeout" in str(exc) or "does not exist" in str(exc), exc
                        held = {"refused": 1}
                    self.log.append(f"closed {p.name} (keep_dead={keep_dead}) and stopped: held {held}")
                    if held is None:
                        self._skip_in_closed(conn, p.name)

    def _skip_in_closed(self, conn: Any, name: str) -> None:
        """An operator's skip of a dead row in a partition left closed is refused whole, naming it."""
        dead = (
            conn.execute(
                select(self.Outbox.id).where(
                    self.Outbox.status == "dead", text("tableoid = to_regclass(:p)").bindparams(p=name)
                )
            )
            .scalars()
            .first()
        )
        if dead is not None:
            try:
                skip_dead(self.engine, self.Outbox, ids=[dead])
            except SchemaError as exc:
                assert name in str(exc) and "Nothing was changed" in str(exc), exc
                self.log.append(f"skip of dead event id {dead} in closed {name} refused")
            else:
                raise AssertionError(f"a skip of dead event id {dead} in closed {name} was not refused")

    def rule_produce_emit(self) -> None:
        planned = [
            self._event(("acct", self.rng.choice(STRING_AGGREGATES))) for _ in range(self.rng.randint(1, 4))
        ]
        commit = self._commit_or_not()
        with Session(self.engine) as s:
            s.begin()
            emit(s, self.Outbox, [(p.aggregate[0], p.aggregate[1], p.event_type, self._payload(p))
                                  for p in planned if p.aggregate])  # fmt: skip
            s.commit() if commit else s.rollback()
        self._remember(planned, commit)

    def rule_produce_savepoint(self) -> None:
        """Events in a savepoint that is rolled back; the outer transaction's own events commit."""
        outer = [
            self._event(("acct", self.rng.choice(STRING_AGGREGATES))) for _ in range(self.rng.randint(1, 2))
        ]
        inner = [
            self._event(("acct", self.rng.choice(STRING_AGGREGATES))) for _ in range(self.rng.randint(1, 2))
        ]
        with Session(self.engine) as s, s.begin():
            s.add_all(self._outbox_row(p) for p in outer)
            s.flush()
            nested = s.begin_nested()
            s.add_all(self._outbox_row(p) for p in inner)
            s.flush()
            nested.rollback()
        self._remember(outer, True)
        self._remember(inner, False)

    def rule_produce_for_aggregate(self) -> None:
        with Session(self.engine) as s:
            s.begin()
            if not self.orders or self.rng.random() < 0.3:
                order = Order(status="new")
                s.add(order)
                s.flush()
            else:
                order = s.get(Order, self.rng.choice(self.orders))
            assert order is not None
            planned = [self._event(("order", str(order.id))) for _ in range(self.rng.randint(1, 3))]
            for p in planned:
                s.add(self.Outbox.for_aggregate(order, p.event_type, self._payload(p)))
            order.status = f"v{planned[-1].seq}"
            s.flush()
            commit = self._commit_or_not()
            if commit:
                s.commit()
                if order.id not in self.orders:
                    self.orders.append(order.id)
            else:
                s.rollback()
        self._remember(planned, commit)

    def rule_produce_async(self) -> None:
        planned = [
            self._event(("acct", self.rng.choice(STRING_AGGREGATES))) for _ in range(self.rng.randint(1, 3))
        ]
        commit = self._commit_or_not()

        async def write() -> None:
            aengine = create_async_engine(self.async_url)
            try:
                async with AsyncSession(aengine) as s:
                    await s.begin()
                    s.add_all(self._outbox_row(p) for p in planned)
                    await s.flush()
                    await (s.commit() if commit else s.rollback())
            finally:
                await aengine.dispose()

        asyncio.run(write())
        self._remember(planned, commit)

    def rule_enqueue(self) -> None:
        planned = [
            Planned(next(self.seq), [self.rng.choice(JOB_ACTIONS) for _ in range(self.rng.randint(0, 2))],
                    self.rng.random() < 0.05)
            for _ in range(self.rng.randint(1, 5))
        ]  # fmt: skip
        commit = self._commit_or_not()
        tx = {p.seq for p in planned if self.rng.random() < 0.4}
        old = {p.seq for p in planned if self.give_up and self.old_rng.random() < 0.2}
        with Session(self.engine) as s:
            s.begin()
            for p in planned:
                task = "model_tx" if p.seq in tx else "model"
                queue = self.rng.choice(QUEUES)
                key = self.rng.choice(KEYS) if queue == LIMITED and self.limit is not None else None
                # Priorities and jobs due a little later: a worker's claim that comes back short reads its queues
                # level by level next (_sql._priority_levels), over levels whose jobs are partly not due yet.
                priority = self.rng.choice((0, 0, 0, 1, 5, -2))
                later = self.rng.choice((None, None, None, 0.05, 0.3))
                # a job whose every planned failure is NoAnswer gets one attempt: each meets it on its last
                # attempt, which must be refunded (F2: it ends done, never failed)
                attempts = 1 if p.plan and set(p.plan) == {"noanswer"} else 10
                job = enqueue(s, Job, task, self._payload(p), queue=queue, max_attempts=attempts,
                              concurrency_key=key, priority=priority, run_at=later)  # fmt: skip
                if p.seq in old:
                    s.flush()
                    job.created_at = job.created_at - timedelta(seconds=2 * GIVE_UP_AFTER)
            s.flush()
            s.commit() if commit else s.rollback()
        for p in planned:
            if commit:
                self.model.jobs[p.seq] = p
                if p.seq in old:
                    self.model.old_jobs.add(p.seq)
                if p.seq in tx:
                    self.model.in_transaction.add(p.seq)
            else:
                self.model.rolled_back_jobs.add(p.seq)

    def rule_enqueue_many(self) -> None:
        """Bulk: one statement for the whole list, in a transaction that commits or rolls back."""
        planned = [
            Planned(next(self.seq), [self.rng.choice(JOB_ACTIONS) for _ in range(self.rng.randint(0, 2))],
                    self.rng.random() < 0.05)
            for _ in range(self.rng.randint(2, 12))
        ]  # fmt: skip
        commit = self._commit_or_not()
        items = []
        for p in planned:
            queue = self.rng.choice(QUEUES)
            item: dict[str, Any] = {"task": "model", "payload": self._payload(p), "queue": queue,
                                    "max_attempts": 10}  # fmt: skip
            if queue == LIMITED and self.limit is not None:
                item["concurrency_key"] = self.rng.choice(KEYS)
            items.append(item)
        with Session(self.engine) as s:
            s.begin()
            ids = enqueue_many(s, Job, items)
            assert len(ids) == len(planned)
            s.commit() if commit else s.rollback()
        for p in planned:
            if commit:
                self.model.jobs[p.seq] = p
            else:
                self.model.rolled_back_jobs.add(p.seq)

    def rule_enqueue_unique(self) -> None:
        """A job with a unique key (skip): written only when the key has no job that has not started yet — or,
        half the time, that job among others in one ``enqueue_many`` call that mixes the rules."""
        p = Planned(next(self.seq), [self.rng.choice(JOB_ACTIONS) for _ in range(self.rng.randint(0, 2))],
                    False)  # fmt: skip
        commit = self._commit_or_not()
        key = self.rng.choice(UNIQUE_KEYS)
        if self.bulk_rng.random() < 0.5:
            self._enqueue_many_unique(p, key, commit)
            return
        with Session(self.engine) as s:
            s.begin()
            got = enqueue(s, Job, "model", self._payload(p), queue=LIMITED if self.limit is None else "q1",
                          max_attempts=10, unique_key=key)  # fmt: skip
            s.commit() if commit else s.rollback()
        self.log.append(f"unique enqueue seq {p.seq}: {got} commit={commit}")
        if got.inserted and commit:
            self.model.jobs[p.seq] = p
        elif got.inserted:
            self.model.rolled_back_jobs.add(p.seq)
        # else: the key's waiting job stays as it was, and this seq never exists

    def _enqueue_many_unique(self, first: Planned, first_key: str, commit: bool) -> None:
        """One ``enqueue_many`` call of jobs with unique keys under mixed rules — each key its own of skip,
        replace and debounce, some keys twice — and jobs without a key, in a transaction that commits or rolls
        back (draws from a stream of its own: the seed's other rules stay what they were).

        Which planned job each returned id stands for is read back in the call's transaction: the row's seq is
        the call's job (inserted, or a waiting job it replaced — that job's seq is then gone for good) or the
        key's waiting job (skipped: the call's job never exists). A replace takes the call's task and queue too:
        a replaced job's handler (transactional or not) and queue are the new job's."""
        rng = self.bulk_rng
        rules = {k: rng.choice(("skip", "replace", "debounce")) for k in UNIQUE_KEYS}
        unique_queues = (LIMITED, "q1") if self.limit is None else ("q1", "q2")
        planned: list[tuple[Planned, str | None]] = [(first, first_key)]
        # The scenario's first such call, and a tenth of the others, is large enough to go unprepared (planned
        # for its own arrays, _enqueue.PLANNED_ALONE_FROM); the keys then come several times over.
        large = not self.planned_alone or rng.random() < 0.1
        for _ in range(PLANNED_ALONE_FROM if large else rng.randint(1, 6)):
            plan = [rng.choice(JOB_ACTIONS) for _ in range(rng.randint(0, 2))]
            key = rng.choice((*UNIQUE_KEYS, None))
            planned.append((Planned(next(self.seq), plan, key is None and rng.random() < 0.05), key))
        rng.shuffle(planned)
        tx: set[int] = set()
        items: list[dict[str, Any]] = []
        caps: dict[str, float] = {}
        for p, key in planned:
            task = "model_tx" if rng.random() < 0.4 else "model"
            if task == "model_tx":
                tx.add(p.seq)
            attempts = 1 if p.plan and set(p.plan) == {"noanswer"} else 10
            item: dict[str, Any] = {"task": task, "payload": self._payload(p), "max_attempts": attempts,
                                    "priority": rng.choice((0, 0, 1, -2))}  # fmt: skip
            if key is None:
                item["queue"] = rng.choice(("q1", "q2"))
            else:
                item.update(queue=rng.choice(unique_queues), unique_key=key, on_conflict=rules[key])
                if rules[key] == "debounce":
                    item["debounce"] = rng.choice((0.02, 0.1, 0.3))
                    if rng.random() < 0.5:
                        item["max_delay"] = item["debounce"] * rng.choice((1, 1.5, 4))
                    caps[key] = item.get("max_delay", item["debounce"] * 10)  # the key's last item's cap
            items.append(item)
        seq_of = Job.payload["seq"].as_integer()
        keys = sorted({k for _, k in planned if k is not None})
        with Session(self.engine) as s:
            s.begin()
            # the keys' waiting jobs before the call (only this thread enqueues; a worker may take one meanwhile,
            # and then the call adds a job of its own instead of taking that one over)
            before = dict(s.execute(select(Job.id, seq_of).where(Job.unique_key.in_(keys),
                                                               Job.status == "queued")).all())  # fmt: skip
            ids = enqueue_many(s, Job, items)
            assert len(ids) == len(planned)
            now = dict(s.execute(select(Job.id, seq_of).where(Job.id.in_(ids))).all())
            # a debounced key's job is never pushed past its cap: due by created_at + max_delay (a waiting job
            # created by an earlier call keeps its created_at, so a key under constant traffic still runs)
            late = s.execute(select(Job.unique_key, Job.run_at, Job.created_at).where(
                Job.unique_key.in_(sorted(caps)), Job.status == "queued", Job.lease_version == 0)).all()  # fmt: skip
            for key, run_at, created_at in late:
                assert run_at <= created_at + timedelta(seconds=caps[key]), (
                    f"debounced key {key} due at {run_at}, past its cap {caps[key]}s after {created_at}"
                )
            s.commit() if commit else s.rollback()
        self.planned_alone += len(items) >= PLANNED_ALONE_FROM
        written = {now[i] for i in ids}
        replaced = {seq for i, seq in before.items() if i in now and now[i] != seq}
        self.log.append(
            f"bulk unique ({rules}): {[(p.seq, k) for p, k in planned]} -> ids {ids}, rows {now}, replaced "
            f"{sorted(replaced)}, commit={commit}"
        )
        for p, key in planned:
            if p.seq in written:
                if commit:
                    self.model.jobs[p.seq] = p
                    if p.seq in tx:
                        self.model.in_transaction.add(p.seq)
                else:
                    self.model.rolled_back_jobs.add(p.seq)
            else:
                assert key is not None, f"job {p.seq} without a unique key was not written: {now}"
                self.model.superseded_jobs.add(p.seq)
        if commit:
            for seq in replaced:
                assert seq in self.model.jobs and seq not in self.model.cancelled_queued, seq
                del self.model.jobs[seq]
                self.model.in_transaction.discard(seq)
                self.model.superseded_jobs.add(seq)

    def rule_burst(self) -> None:
        """A burst of jobs in ``BURST`` (committed), and a fast worker to serve it when none runs: with handlers
        this short, it sends each next claim — with the outcomes of the jobs in hand — ahead of them on its own
        connection and reads it after them, amid the terminations, stops and exits of the other rules."""
        planned = [
            Planned(next(self.seq), [self.rng.choice(JOB_ACTIONS) for _ in range(self.rng.randint(0, 2))],
                    self.rng.random() < 0.05)
            for _ in range(self.rng.randint(8, 20))
        ]  # fmt: skip
        with Session(self.engine) as s:
            s.begin()
            enqueue_many(s, Job, [{"task": "model", "payload": self._payload(p), "queue": BURST,
                                   "max_attempts": 10} for p in planned])  # fmt: skip
            s.commit()
        for p in planned:
            self.model.jobs[p.seq] = p
        self.log.append(f"burst of {len(planned)} jobs in {BURST}")
        if not any(lt.name in self.burst_workers for lt in self.workers):  # (one more than max_workers, then)
            self.start_worker(burst=True)

    # -- rules: loops and faults ------------------------------------------------------------------------------

    def _async_loop_engine(self) -> AsyncEngine:
        """An async loop's engine (made on the loop's own event loop): as the sync loops', direct or pooled."""
        if self.pooler is None:
            return create_async_engine(
                self.async_url, pool_size=3, connect_args=LOOP_APP, **self.loop_engine_kwargs
            )
        aengine, _ = pgbouncer_async_engine(
            self.pooler.url, direct_url=self.pooler.direct, pool_size=3, connect_args=LOOP_APP,
            **self.loop_engine_kwargs,
        )  # fmt: skip
        return aengine

    def _listening(self, listen: bool) -> dict[str, Any]:
        """A loop's wake-up options: ``listen``, and through the pooler where its LISTEN connection goes."""
        return {"listen": listen, **(self.listen_to if listen else {})}

    def _run_kwargs(self, bounded: bool) -> dict[str, Any]:
        """Some loops stop by themselves after a few claims (``run(max_batches=N)``): they leave with jobs or
        events in hand, which must be given back or finished, never lost or run twice."""
        if bounded and self.rng.random() < 0.2:
            return {"max_batches": self.rng.choice((1, 3, 8))}
        return {}

    def start_dispatcher(self, is_async: bool | None = None, *, bounded: bool = True) -> None:
        is_async = self.rng.random() < 0.5 if is_async is None else is_async
        options = dict(
            batch=self.rng.choice((1, 3, 10)), ordered=True if self.all_ordered else set(ORDERED), lease=3.0,
            publish_timeout=0.4,
            enforce_publish_timeout=True, backoff=FAST, poll_interval=0.3,
            **self._listening(self.rng.random() < 0.5),
        )  # fmt: skip
        if self.partitioned and self.rng.random() < 0.5:
            options["maintain_partitions"] = 1.5  # a few statements each time: F5 counts them
        sync_publisher = not is_async or self.rng.random() < 0.3
        # half the dispatchers give their messages a message_id_prefix (a stream of its own: the seed's draws stay)
        prefix = self.control_rng.choice(("", "orders:"))
        if prefix:
            options["message_id_prefix"] = prefix
        publisher = (ModelPublisher if sync_publisher else AsyncModelPublisher)(
            self.record, self.outage, prefix
        )
        cls: Any = AsyncDispatcher if is_async else Dispatcher
        name = f"dispatcher-{next(self.names)}"
        run_kwargs = self._run_kwargs(bounded)
        self.log.append(
            f"start {name} async={is_async} sync_publisher={sync_publisher} {options} {run_kwargs}"
        )
        self.dispatchers.append(
            LoopThread(name, lambda e: cls(e, self.Outbox, publisher, **options), is_async=is_async,
                       engine=self.loop_engine, async_engine=self._async_loop_engine, run_kwargs=run_kwargs,
                       terminations_at_start=self.terminations).start()
        )  # fmt: skip

    def start_worker(
        self, is_async: bool | None = None, *, bounded: bool = True, every_queue: bool = False,
        burst: bool = False, schedules: bool = False,
    ) -> None:  # fmt: skip
        """A worker with random options. ``every_queue``: it serves every one of ``QUEUES``; ``burst``: a fast
        one (see below) that serves only ``BURST``; ``schedules``: it fires the cron schedule (some others do
        too, when the scenario has one)."""
        is_async = False if burst else self.rng.random() < 0.5 if is_async is None else is_async
        options = dict(
            batch=self.rng.choice((1, 4, 10)), concurrency=self.rng.choice((1, 2, 4)),
            handler_timeout=self.rng.choice((None, 0.4)), stale_after=3.0, heartbeat=0.3, backoff=FAST,
            poll_interval=0.3, **self._listening(self.rng.random() < 0.5),
        )  # fmt: skip
        async_handler = is_async and self.rng.random() < 0.6
        pace = self.rng.choice((0.0, 0.0004, 0.002))
        fast = burst or (not is_async and self.rng.random() < 0.4)
        if fast:
            # a sync inline worker with instant handlers on one queue (drawn this often: the other choices make
            # one only 1 in 18 times, and on every queue at once): it sends each claim ahead of the jobs in hand
            # on its own connection and reads it after them
            options.update(concurrency=1, handler_timeout=None)
            pace = 0.0
        name = f"worker-{next(self.names)}"
        timeout = options["handler_timeout"]
        handlers = {
            "model": make_handler(self.record, is_async=async_handler, pace=pace, who=name, timeout=timeout),
            "model_tx": make_handler(
                self.record, is_async=async_handler, in_transaction=True, who=name, timeout=timeout
            ),
            CRON: make_cron_handler(self.record),
        }
        queues: Any = QUEUES
        if self.rng.random() < 0.3:  # fair shares; the concurrency stays the one chosen above
            queues = {q: self.rng.randint(1, 2) for q in QUEUES}
        if (
            fast and not every_queue
        ):  # one unlimited queue, or two: one claim statement either way, sent ahead
            plain = [q for q in QUEUES if q != LIMITED]
            queues = (
                (BURST,) if burst else tuple(plain) if self.rng.random() < 0.4 else (self.rng.choice(plain),)
            )
        if self.give_up:
            options["give_up_after"] = GIVE_UP_AFTER
        fires = self.cron and (schedules or self.cron_rng.random() < 0.5)
        if fires:
            options["schedules"] = JobSchedule
        if self.limit is None:
            options["unique_running"] = True
        elif LIMITED in queues:
            options["limits"] = {LIMITED: self.limit}
        cls: Any = AsyncWorker if is_async else Worker
        late: random.Random | None = None
        if not is_async and not fast and self.late_rng.random() < 0.4:
            late = random.Random(self.late_rng.random())
        if set(queues) == set(QUEUES):
            self.every_queue.add(name)
        if burst:
            self.burst_workers.add(name)
        if fires:
            self.cron_workers.add(name)
        run_kwargs = self._run_kwargs(bounded)
        self.log.append(
            f"start {name} async={is_async} async_handler={async_handler} pace={pace} queues={queues} {options} "
            f"{run_kwargs}{' claims land late' if late else ''}"
        )

        def build(e: Any) -> Any:
            loop = cls(e, Job, handlers, queues=queues, **options)
            return loop if late is None else land_late(loop, late)

        self.workers.append(
            LoopThread(name, build, is_async=is_async,
                       engine=self.loop_engine, async_engine=self._async_loop_engine, run_kwargs=run_kwargs,
                       terminations_at_start=self.terminations).start()
        )  # fmt: skip

    def _reap_exited(self) -> None:
        for pool in (self.dispatchers, self.workers):
            for lt in [lt for lt in pool if not lt.alive]:
                pool.remove(lt)
                self.finished.append(lt)
                self.log.append(f"{lt.name} left: {lt.exited!r}")
                if lt.exited is not None and not isinstance(lt.exited, SystemExit):
                    raise AssertionError(f"{lt.name} died: {lt.exited!r}") from lt.exited

    def rule_start_dispatcher(self) -> None:
        if len(self.dispatchers) < self.profile.max_dispatchers:
            self.start_dispatcher()

    def rule_start_worker(self) -> None:
        if len(self.workers) < self.profile.max_workers:
            self.start_worker()

    def rule_stop_loop(self) -> None:
        pool = self.rng.choice((self.dispatchers, self.workers))
        if pool:
            lt = pool.pop(self.rng.randrange(len(pool)))
            self.log.append(f"stop {lt.name}")
            outage = self.cutter is not None and self.cutter.is_alive()
            lt.stop()
            self.finished.append(lt)
            # I8 at a stop: with the database in reach since the loop started, its end recorded what it held
            # (``ended_unrecorded`` is what makes ``sa-outbox dispatch|worker`` exit 3 instead of 0)
            if self.terminations == lt.terminations_at_start and not outage and lt.loop is not None:
                assert not lt.loop.ended_unrecorded, (
                    f"{lt.name} stopped without recording what it had in hand"
                )

    def rule_leave_async_loop(self) -> None:
        """I8 again, as an application's ``main()`` may end it: see :meth:`rule_cancel_async_loop`."""
        self.rule_cancel_async_loop(leave=True)

    def rule_cancel_async_loop(self, *, leave: bool = False) -> None:
        """I8: an async loop's run() is cancelled (once, or twice a few ms apart), or its ``asyncio.run()`` ends
        with run() going (every task left cancelled, with the event loop stopped): when it has ended, no row is
        left leased to it — the claim in flight, the batch in flight and what it held were finished, released
        or written. (Unless its backends were terminated while it ran: then its end may fail to write, as
        documented, and the rows wait for their lease.)"""
        pool = self.rng.choice((self.dispatchers, self.workers))
        running = [lt for lt in pool if lt.is_async and lt.task is not None]
        if not running:
            return
        lt = self.rng.choice(running)
        pool.remove(lt)
        if leave:
            self.log.append(f"asyncio.run() of {lt.name} ends with run() going")
            lt.leave()
            self.left_running += 1
        else:
            times = self.rng.choice((1, 1, 2))
            self.log.append(f"cancel {lt.name} x{times}")
            lt.cancel(times)
        self.finished.append(lt)
        if self.terminations != lt.terminations_at_start:
            return
        assert not lt.loop.ended_unrecorded, f"{lt.name} was cancelled and did not record what it had in hand"
        spec = lt.loop.spec
        with self.engine.connect() as conn:
            held = conn.execute(
                select(func.count())
                .select_from(spec.table)
                .where(spec.c.status == spec.active, spec.owner == lt.loop.owner)
            ).scalar_one()
        assert held == 0, f"{lt.name} was cancelled and left {held} row(s) leased to it"

    def rule_terminate_backends(self) -> None:
        with self.engine.connect() as conn:
            n = conn.execute(_TERMINATE_LOOPS).scalar_one()
        self.terminations += 1
        self.log.append(f"terminated {n} backends")

    def rule_outage(self) -> None:
        if self.outage.is_set():
            self.outage.clear()
            self.log.append("outage ends")
        else:
            self.outage.set()
            self.log.append("outage begins")

    def rule_db_outage(self) -> None:
        """The loops' database goes away for 1–3.5 s while the rules go on: a thread terminates every backend
        of the loops (their engine's and the wake-ups') every 20 ms, so their statements, beats and reconnects
        fail throughout, as in a server restart or a pooler outage (producers and operators, on their own
        engine, go on). Past 0.8 × stale_after (2.4 s) without a renewal, jobs in hand are given back rather
        than started; after it, pauses are read before anything starts or is claimed, and the rescue waits 1.5
        heartbeats (I3, I4, I5, I11 and the F rules check what follows)."""
        if self.cutter is not None and self.cutter.is_alive():
            return
        span = self.db_outage_rng.uniform(1.0, 3.5)
        spared = self.listen_spared_rng.random() < 0.5
        self.terminations += 1
        self.db_outages += 1
        loops = [lt for lt in self.dispatchers + self.workers if lt.loop is not None]
        failed_before = {lt.name: lt.loop.stats.db_errors for lt in loops}
        wake_ups = [(channel_for(Job.__tablename__), q) for q in (*QUEUES, BURST, HANDOVER)]
        wake_ups.append((channel_for(self.Outbox.__tablename__), ""))

        def cut() -> None:
            end = time.monotonic() + span
            with self.engine.connect() as conn:
                while time.monotonic() < end:
                    conn.execute(_TERMINATE_LOOP_STATEMENTS if spared else _TERMINATE_LOOPS)
                    if spared:  # a producer's commits, heard by the loops while their statements fail
                        for channel, queue in wake_ups:
                            conn.execute(_WAKE_WORKERS, {"channel": channel, "queue": queue})
                    conn.commit()
                    time.sleep(0.01 if spared else 0.02)
            self.terminations += (
                1  # (its end counts too: I8 and I9 excuse a loop whose backends were terminated)
            )
            failed_turns = {lt.name: lt.loop.stats.db_errors - failed_before[lt.name] for lt in loops}
            self.log.append(f"outage over; failed turns: {failed_turns}")
            for lt in loops:  # I13
                failed = failed_turns[lt.name]
                if failed > FAILED_TURNS_PER_OUTAGE:
                    self.fault_storms.append(
                        f"{lt.name} failed {failed} turns over a {span:.1f} s outage"
                        + (" (LISTEN spared, notified every 10 ms)" if spared else "")
                    )

        self.cutter = threading.Thread(target=cut, name="model-db-outage", daemon=True)
        self.cutter.start()
        self.log.append(
            f"database out of the loops' reach for {span:.1f}s"
            + (", their LISTEN connections spared" if spared else "")
        )

    def _end_db_outage(self) -> None:
        if self.cutter is not None:
            self.cutter.join(10)
            assert not self.cutter.is_alive(), "the database outage did not end"

    def rule_refuse_renewals(self) -> None:
        """For 1–4 s a trigger refuses every renewal of a running job, or of the odd ids only (a user's trigger, a
        row-level rule): the heartbeats fail (or renew the other jobs one by one) and leases run out while their
        handlers run. Another worker's rescue may take such a job (a lost lease, I4), and its own worker may
        claim it again, held back behind the run (I12); its own worker's rescue never takes it — before, it
        claimed the job again and ran it beside itself (I3, I4, I11 and the F rules check what follows)."""
        if self.refuser is not None and self.refuser.is_alive():
            return
        span = self.refusal_rng.uniform(1.0, 4.0)
        odd_only = self.refusal_rng.random() < 0.5
        try:
            with self.engine.begin() as conn:
                conn.execute(text("SET LOCAL lock_timeout = '2s'"))
                conn.execute(text(_REFUSE_RENEWALS.format(which="AND OLD.id % 2 = 1" if odd_only else "")))
        except DBAPIError as exc:  # (a lock the trigger's DDL waited for too long: no refusal this time)
            self.log.append(f"renewals not refused: {exc.orig}")
            return
        self.refusal_epochs += 1

        def lift() -> None:
            time.sleep(span)
            self._lift_refusal()

        self.refuser = threading.Thread(target=lift, name="model-refuser", daemon=True)
        self.refuser.start()
        self.log.append(
            f"renewals of running jobs{' of odd ids' if odd_only else ''} refused for {span:.1f}s"
        )

    def rule_take_back_running(self, *, linger: bool = False, wait: float = 2.0) -> None:
        """Another worker's rescue takes one or two jobs back from under their handlers' runs, as if the workers
        running them had been frozen (a stop-the-world pause, SIGSTOP) past stale_after mid-run: their leases
        are moved an hour back and the real rescue statement puts them back (only leases that old: no other
        row). Their workers' beats then find the leases lost; a worker may claim such a job again while its run
        goes on (held back behind the run, I12), and with late landings (:func:`land_late`) that claim may land
        after the run has ended: the run is then decided on the newer lease, or as a lost lease (I3, I4, I12).
        Only leases whose handler runs now are taken: a job claimed and not started yet is not one a frozen
        worker would start on waking (its lease unconfirmed for longer than stale_after: I11), while this
        worker is not frozen. A one-attempt job taken back fails as a crashed worker's does (F8). The rows
        rule_hold_job_row holds are left to it (I9). The workers are woken as a NOTIFY of new jobs would, so
        that a worker claims a job again while its own run of it goes on, not only after."""
        want = self.take_back_rng.randint(1, 2)
        until = time.monotonic()
        if linger or not self.lingering:
            # most handlers end at once: the first time (or ``linger``), a job whose run lingers (a success after
            # LINGER) is enqueued at the front of a queue, and taken back if a worker runs it within ``wait``
            p = Planned(next(self.seq), ["linger"], False)
            queue = self.take_back_rng.choice([q for q in QUEUES if not self.model.paused(q)] or QUEUES)
            key = self.take_back_rng.choice(KEYS) if queue == LIMITED and self.limit is not None else None
            with Session(self.engine) as s, s.begin():
                enqueue(s, Job, "model", self._payload(p), queue=queue, max_attempts=10, concurrency_key=key,
                        priority=100)  # fmt: skip
            self.model.jobs[p.seq] = p
            self.lingering = True
            until += wait
        while True:
            in_run = [run for run in self.record.leases_in_run() if run[0] not in self.hold_seqs]
            if in_run or time.monotonic() >= until:
                break
            time.sleep(0.005)
        if not in_run:
            self.log.append("take back: no run goes on")
            return
        try:
            with self.engine.begin() as conn:
                conn.execute(text("SET LOCAL lock_timeout = '1s'"))
                picked = conn.execute(
                    _RUNNING_TO_TAKE,
                    {"seqs": [s for s, _ in in_run], "versions": [v for _, v in in_run], "n": want},
                ).all()  # fmt: skip
                if not picked:
                    self.log.append(f"take back: none of the runs going on {in_run} holds its row's lease")
                    return
                conn.execute(_LEASE_AN_HOUR_BACK, {"ids": [i for i, _, _ in picked]})
                taken = _steps.rescue(conn, spec_for(Job), stale_after=timedelta(minutes=30))
                for queue in {q for _, q, _ in picked}:
                    conn.execute(_WAKE_WORKERS, {"channel": channel_for(Job.__tablename__), "queue": queue})
        except DBAPIError as exc:  # (a connection fault or a lock wait: nothing taken back this time)
            self.log.append(f"nothing taken back: {exc.orig}")
            return
        self.taken_back += len(taken)
        self.model.taken_back.update(seq for _, _, seq in picked)
        self.log.append(f"rescue took back running jobs {[(i, st, v) for i, st, v in taken]}")

    def rule_hand_over(self) -> None:
        """The in-flight hand-over, made to happen (the drawn rules almost never line it up): a worker of its own
        (sync, concurrency 2 — a free slot to claim with while a job runs —, listening, only ``HANDOVER``) runs
        a "linger" job; 0.3 s into the run another worker's rescue takes it back and a NOTIFY wakes the worker,
        whose claim takes the job again (lease 2) while the run goes on and lands only after the run has
        ended (:func:`land_after_the_run`). The run's success must then be written on lease 2 — one run, the
        job done — never refused as a lost lease and run again with an attempt counted (stop 58's bug). When
        the timing did not line it up (a fault, a slow box), the step says so in the log; the fixed seeds
        assert the hand-over happened in one of them at least."""
        name = f"worker-{next(self.names)}"
        options: dict[str, Any] = dict(batch=1, concurrency=2, handler_timeout=None, stale_after=3.0, heartbeat=0.3,
                                       backoff=FAST, poll_interval=0.3, **self._listening(True))  # fmt: skip
        if self.limit is None:
            options["unique_running"] = True  # (the fleet's rule)
        if self.give_up:
            options["give_up_after"] = GIVE_UP_AFTER
        handlers = {"model": make_handler(self.record, is_async=False, who=name)}
        record = self.record
        self.log.append(f"start {name} (hand-over) queues=({HANDOVER},) {options}")

        def build(e: Any) -> Any:
            return land_after_the_run(Worker(e, Job, handlers, queues=(HANDOVER,), **options), record, name)

        self.workers.append(
            LoopThread(name, build, is_async=False, engine=self.loop_engine, async_engine=self._async_loop_engine,
                       terminations_at_start=self.terminations).start()
        )  # fmt: skip
        p = Planned(next(self.seq), ["linger"], False)
        with Session(self.engine) as s, s.begin():
            enqueue(s, Job, "model", self._payload(p), queue=HANDOVER, max_attempts=10)
        self.model.jobs[p.seq] = p
        landed_before = self.record.landed_after_run
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            with self.record.lock:
                run = next(iter(self.record.in_run.get((name, p.seq)) or ()), None)
            if run is not None:
                break
            time.sleep(0.005)
        else:
            self.log.append(f"hand-over: job seq {p.seq} did not start within 5 s")
            return
        time.sleep(max(0.0, run[0] + 0.3 - time.monotonic()))
        try:
            with self.engine.begin() as conn:
                conn.execute(text("SET LOCAL lock_timeout = '1s'"))
                picked = conn.execute(_RUNNING_TO_TAKE, {"seqs": [p.seq], "versions": [run[1]], "n": 1}).all()
                if not picked:
                    self.log.append(f"hand-over: job seq {p.seq}'s row no longer holds lease {run[1]}")
                    return
                conn.execute(_LEASE_AN_HOUR_BACK, {"ids": [picked[0].id]})
                taken = _steps.rescue(conn, spec_for(Job), stale_after=timedelta(minutes=30))
                conn.execute(_WAKE_WORKERS, {"channel": channel_for(Job.__tablename__), "queue": HANDOVER})
        except DBAPIError as exc:
            self.log.append(f"hand-over: nothing taken back: {exc.orig}")
            return
        self.taken_back += len(taken)
        self.model.taken_back.add(p.seq)
        self.log.append(f"hand-over: rescue took back {[(i, st, v) for i, st, v in taken]}")
        job_id = picked[0].id
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            with self.engine.connect() as conn:
                row = conn.execute(select(Job.status, Job.lease_version).where(Job.id == job_id)).one()
            if row.status == "done":
                break
            time.sleep(0.02)
        with self.record.lock:
            handed = self.record.landed_after_run - landed_before
            runs = [r for r in self.record.runs if r[1] == p.seq]
        self.handed_over += handed
        self.log.append(f"hand-over: {handed} claim(s) landed after the run; job {job_id} {row}; runs {runs}")
        if handed:
            # H1: the claim that landed after the run took its outcome: one run, done on the newer lease
            assert (row.status, row.lease_version, len(runs)) == ("done", 2, 1), (
                f"H1: job seq {p.seq} (id {job_id}) handed over to the claim that landed after its run: "
                f"{row.status} lease {row.lease_version} after {len(runs)} run(s) {runs}"
            )

    def _lift_refusal(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text("DROP TRIGGER IF EXISTS model_no_renewal ON jobs"))
        if self.refusal_epochs % 2:
            self.refusal_epochs += 1

    def rule_pooler_pause(self) -> None:
        """P2: the pooler's ``PAUSE`` for 1–6 s (the dispatchers' lease is 3 s) while the rules go on: every loop's
        next statement through it waits, with no error, until ``RESUME`` — a claim, a finalize, a rescue — while
        their leases run out; the beats and guards, on the server, go on. At RESUME the queued statements run:
        a rescue held back meanwhile must not take the leases that ran out during the pause from the loops
        whose finalize waited in the same queue (before: published again — I4 counts those as lost leases,
        so ``test_a_rescue_held_back_by_a_pooler_pause…`` is what shows it; here every other invariant holds
        through pauses mixed with the other rules)."""
        admin = self.pooler.admin if self.pooler is not None else None
        if admin is None or self.pooler is None or (self.pauser is not None and self.pauser.is_alive()):
            return
        if self.pooler_pause_rng.random() < 0.3:
            self.rule_pooler_refuse_clients()
            return
        span = self.pooler_pause_rng.uniform(1.0, 6.0)
        alias = self.pooler.url.database
        self.pooler_pauses += 1

        def pause() -> None:
            try:
                admin(f"PAUSE {alias}")  # (returns once the transactions in progress have ended)
            except psycopg.Error as exc:
                self.log.append(f"pooler not paused: {exc}")
                return
            self.log.append(f"pooler paused; resumed in {span:.1f}s")
            try:
                time.sleep(span)
            finally:
                admin(f"RESUME {alias}")
                self.log.append("pooler resumed")

        self.pauser = threading.Thread(target=pause, name="model-pooler-pause", daemon=True)
        self.pauser.start()
        self.log.append(f"pooler PAUSE for {span:.1f}s")

    def rule_pooler_refuse_clients(self) -> None:
        """P3: the pooler's ``max_client_conn`` lowered to the clients it has, for 1–4 s: every new connection
        to it is refused ("no more connections allowed"), as a pooler or server at its limit refuses them — a
        loop that lost its connection cannot make another, and a transactional handler's session cannot get
        one when its engine's pool must grow (such a job is deferred, its attempt given back: F2, F8 and the
        attempts rules check what follows)."""
        admin = self.pooler.admin if self.pooler is not None else None
        connect = self.pooler.admin_connection if self.pooler is not None else None
        if admin is None or connect is None:
            return
        span = self.pooler_pause_rng.uniform(1.0, 4.0)
        self.pooler_refusals += 1

        def refuse() -> None:
            # (on one admin connection, kept: at the limit the pooler takes no new one, an admin's included — a
            # seed's refusal could not be lifted, and every loop was refused for the rest of the scenario)
            with connect() as conn:
                lists = {r["list"]: int(r["items"]) for r in admin("SHOW LISTS", conn)}
                admin(f"SET max_client_conn = {max(1, lists['used_clients'])}", conn)
                self.log.append(f"pooler refuses new clients beyond {lists['used_clients']} for {span:.1f}s")
                try:
                    time.sleep(span)
                finally:
                    admin(f"SET max_client_conn = {POOLER_MAX_CLIENTS}", conn)
                    self.log.append("pooler takes new clients again")

        self.pauser = threading.Thread(target=refuse, name="model-pooler-refusal", daemon=True)
        self.pauser.start()

    def _end_pooler_pause(self) -> None:
        if self.pauser is not None:
            self.pauser.join(30)
            assert not self.pauser.is_alive(), "the pooler's pause did not end"

    def _end_refusal(self) -> None:
        if self.refuser is not None:
            self.refuser.join(10)
            assert not self.refuser.is_alive(), "the refusal of renewals did not end"

    def rule_skip_dead(self) -> None:
        with self.engine.connect() as conn:
            dead = conn.execute(
                select(self.Outbox.id, self.Outbox.payload).where(self.Outbox.status == "dead")
            ).all()
        if dead:
            row_id, payload = self.rng.choice(dead)
            position = len(self.record.snapshot())
            # half the time the operator first requeues it (dead retry): a poison event dies again, in order —
            # its aggregate's later events still wait behind it, and its new claims take new lease versions
            retry = self.control_rng.random() < 0.5
            try:
                if retry:
                    requeued = retry_dead(self.engine, self.Outbox, ids=[row_id])
                    self.log.append(f"dead event seq {payload['seq']} requeued: {requeued}")
                    self.controlled["retry dead event"] += len(requeued)
                    return
                skipped = skip_dead(self.engine, self.Outbox, ids=[row_id])
            except SchemaError as exc:  # its partition was left closed by a retire: refused, nothing written
                assert "closed to writes" in str(exc), exc
                what = "retry" if retry else "skip"
                self.log.append(f"{what} of dead event seq {payload['seq']} refused: its partition is closed")
                return
            if skipped:
                self.model.skipped[payload["seq"]] = position
                self.log.append(f"skipped dead event seq {payload['seq']}")

    def rule_cancel(self) -> None:
        """An operator cancels a random job that is not finished yet."""
        candidates = [q for q in self.model.jobs if q not in self.model.cancelled_queued]
        if not candidates:
            return
        seq = self.rng.choice(candidates)
        with self.engine.connect() as conn:
            found = conn.execute(select(Job.id).where(Job.payload["seq"].as_integer() == seq)).scalar()
        if found is None:
            return
        position = len(self.record.snapshot())
        got = cancel_jobs(self.engine, Job, ids=[found])
        if got.cancelled:
            self.model.cancelled_queued[seq] = position
        elif got.requested:
            self.model.cancel_requested.add(seq)
        self.log.append(f"cancel job seq {seq}: {got}")
        if self.control_rng.random() < 0.9:
            self._control_jobs()

    def _control_jobs(self) -> None:
        """An operator's jobs control: requeue a failed or cancelled job (``retry_jobs``, or ``retry_dead`` for a
        failed one), discard a failed one (``skip_dead``: cancelled), or change a waiting job's priority, due time or attempts (``update_jobs``). A requeued job
        runs again — a cancelled one is no longer expected to stay cancelled (F7 then holds from the next cancel
        on): it ends as any other, done, or failed if poison or given up (F2, F8); a job it would make a second
        waiting job of its unique key stays where it was."""
        rng = self.control_rng
        seq_of = Job.payload["seq"].as_integer()
        if rng.random() < 0.6:
            with self.engine.connect() as conn:
                found = conn.execute(
                    select(Job.id, seq_of, Job.status).where(Job.status.in_(("failed", "cancelled")))
                ).all()
            if not found:
                return
            job_id, seq, status = rng.choice(found)
            if status == "failed" and rng.random() < 0.25:
                # discarded (``dead skip --jobs``): cancelled, final — never run again unless requeued (F7)
                position = len(self.record.snapshot())
                changed = skip_dead(self.engine, Job, ids=[job_id])
                self.log.append(f"discard failed job seq {seq}: {changed}")
                if changed:
                    self.controlled["discard failed job"] += 1
                    self.model.cancelled_queued[seq] = position
                    self.model.cancel_requested.discard(seq)
                return
            if status == "failed" and rng.random() < 0.3:
                changed = retry_dead(self.engine, Job, ids=[job_id])
            else:
                changed = retry_jobs(self.engine, Job, ids=[job_id])
            self.log.append(f"retry {status} job seq {seq}: {changed}")
            if changed:
                assert changed == [job_id], changed
                self.controlled[f"retry {status} job"] += 1
                self.model.cancelled_queued.pop(seq, None)
                self.model.cancel_requested.discard(seq)
            return
        with self.engine.connect() as conn:
            waiting = conn.execute(select(Job.id, seq_of).where(Job.status == "queued")).all()
        if not waiting:
            return
        picked = rng.sample(waiting, min(len(waiting), rng.randint(1, 4)))
        values: dict[str, Any] = {"priority": rng.choice((-3, 0, 2, 7))}
        if rng.random() < 0.4:
            values["run_at"] = rng.choice((0.0, 0.05, 0.2))
        if rng.random() < 0.3:  # (never fewer attempts than a job's plan and the faults need: F2)
            values["max_attempts"] = rng.randint(10, 20)
        changed = update_jobs(self.engine, Job, ids=[i for i, _ in picked], **values)
        self.log.append(f"update jobs {[seq for _, seq in picked]} {values}: {len(changed)} changed")
        assert set(changed) <= {i for i, _ in picked}, changed
        self.controlled["update jobs"] += len(changed)

    def rule_pause_queue(self) -> None:
        """An operator pauses a queue, or resumes a paused one."""
        queue = self.rng.choice(QUEUES)
        windows = self.model.pauses[queue]
        if self.model.paused(queue):
            assert resume_queue(self.engine, Job, queue) is True, queue  # it was paused: resumed
            windows[-1][1] = time.monotonic()
            self.log.append(f"resume {queue}")
        else:
            # a resume of a queue that is not paused changes nothing and says so (an operator's typo or double click)
            assert resume_queue(self.engine, Job, queue) is False, queue
            pause_queue(self.engine, Job, queue, by="model")
            windows.append([time.monotonic(), float("inf")])
            self.log.append(f"pause {queue}")
        if self.cron and self.cron_rng.random() < 0.4:
            self._toggle_cron()
        if self.cron and self.resync_rng.random() < 0.3:
            self._resync_cron()

    def _db_now(self) -> datetime:
        with self.engine.connect() as conn:
            now: datetime = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
        return now

    def _toggle_cron(self) -> None:
        """An operator pauses the cron schedule, or resumes it (C2: no slot of a pause ever fires)."""
        if self.cron_pauses and self.cron_pauses[-1][1] is None:
            self.cron_pauses[-1][1] = self._db_now()
            assert resume_schedule(self.engine, JobSchedule, CRON) is True
            self.log.append("resume the cron schedule")
        else:
            pause_schedule(self.engine, JobSchedule, CRON)
            self.cron_pauses.append([self._db_now(), None])
            self.log.append("pause the cron schedule")

    def _resync_cron(self) -> None:
        """A deploy's ``sync_schedules`` changes the cron expression between every second and every even second
        while workers fire it (C5: from the sync's commit on, no slot of the old expression fires — the fire's
        compare-and-set also matches the cron it read)."""
        cron = "*/2 * * * * *" if self.cron_changes[-1][1] == "* * * * * *" else "* * * * * *"
        self.cron_schedule = replace(self.cron_schedule, cron=cron)
        sync_schedules(self.engine, JobSchedule, [self.cron_schedule])
        self.cron_changes.append((self._db_now(), cron))  # (read after the commit: at or after it)
        self.log.append(f"sync the cron schedule to {cron!r}")

    def rule_pause(self) -> None:
        time.sleep(self.rng.uniform(0.05, 0.3))

    def rule_hold_job_row(self) -> None:
        """A job that runs LONG is enqueued; once a worker runs it, a user's transaction holds its row FOR
        UPDATE for longer than stale_after (3 s) — an application updating its job's row from a long
        transaction — in a thread of its own while the rules go on, and another worker's rescue comes the
        moment the row is free. The handler is still running then (or, timed out, its finalize waits)."""
        if self.holder is not None and self.holder.is_alive():
            return
        span = self.rng.uniform(3.3, 4.0)
        p = Planned(next(self.seq), ["long"], False)
        # a queue no pause holds, at the front of it: the hold happens in every run of a seed that draws this
        # rule, not only when the workers happen to reach the job within the holder's look (the fixed seeds'
        # coverage of I9 depended on the machine's speed)
        queue = self.rng.choice([q for q in QUEUES if not self.model.paused(q)] or QUEUES)
        key = self.rng.choice(KEYS) if queue == LIMITED and self.limit is not None else None
        with Session(self.engine) as s, s.begin():
            enqueue(
                s,
                Job,
                "model",
                self._payload(p),
                queue=queue,
                max_attempts=10,
                concurrency_key=key,
                priority=100,
            )
        self.model.jobs[p.seq] = p
        self.hold_seqs.add(p.seq)

        def hold() -> None:
            with self.engine.connect() as conn:
                # until a worker runs it — while the rules go on, or in the final drain, which serves every queue
                # (a paused one resumed): then its hold is part of every run of a seed that draws this rule, not
                # only of runs where a worker happened to reach the job within a few seconds
                look = 0
                while (got := conn.execute(_HOLD_RUNNING, {"seq": p.seq}).first()) is None:
                    conn.rollback()
                    look += 1
                    if look % 50 == 0:
                        state = conn.execute(_JOB_STATE, {"seq": p.seq}).first()
                        conn.rollback()
                        over = self.steps_over is not None and time.monotonic() > self.steps_over + 10.0
                        if state is None or state[0] not in ("queued", "running") or over:
                            self.log.append(f"no hold of long job seq {p.seq}: it is {state}")
                            return
                    time.sleep(0.01)
                began, epochs = self.terminations, self.refusal_epochs
                with self.engine.connect() as rescuer:
                    rescuer.execute(text("SELECT 1"))
                    rescuer.commit()  # (its rescue's now() is then the moment it is sent)
                    time.sleep(span)
                    conn.commit()
                    # another worker's rescue, the moment the row is free: before any beat could renew it
                    taken = _steps.rescue(rescuer, spec_for(Job), stale_after=timedelta(seconds=3))
                    rescuer.commit()
            time.sleep(1.0)  # beats and rescues after the release
            rescued = any(row_id == got.id for row_id, _, _ in taken)
            # (renewals refused during the hold: the lease ran out for that, not for the hold — the trigger's
            # DROP waits for the hold's transaction, so the refusal lasts until it ends — and no guard is taken)
            refused = epochs % 2 == 1 or self.refusal_epochs != epochs
            self.holds.append(
                (got.id, got.lease_version, got.locked_by, began, self.terminations, rescued, refused)
            )

        self.holder = threading.Thread(target=hold, name="model-holder", daemon=True)
        self.holder.start()
        self.log.append(f"hold the row of long job seq {p.seq} for {span:.1f}s once it runs")

    def rule_lock_pending_events(self) -> None:
        """A user's transaction locks a few pending events for up to 0.2 s while the loops run, and ends
        (commits or rolls back): ``FOR KEY SHARE``, as the foreign key check of a row that references them
        does, or ``FOR UPDATE``, as an operator's tool might. Meanwhile claims skip those rows, and afterwards
        their row versions carry the ended lock's xmax: neither may cost an event its order (I2) or its
        delivery (F1, F3)."""
        key_share = self.rng.random() < 0.5
        lock = (
            select(self.Outbox.id)
            .where(self.Outbox.status == "pending")
            .order_by(func.random())
            .limit(self.rng.randint(1, 12))
            .with_for_update(read=key_share, key_share=key_share, skip_locked=True)
        )
        # Two sessions sharing the KEY SHARE leave a MultiXact id as the rows' xmax, read as an xid by the outbox
        # claim's test of a live xmax (a hostile review kept an event from a dispatcher that way, on a cluster
        # whose MultiXact counter ran ahead: the locking claims after short ones take such rows).
        shared = key_share and self.rng.random() < 0.5
        with self.engine.connect() as conn, self.engine.connect() as other:
            ids = conn.execute(lock).scalars().all()
            if not ids:
                # The dispatchers drained every due event: three of this rule's own, due in 0.1 s, so the lock
                # meets committed pending rows in every run (drawn from a generator of its own — whether this
                # happens depends on timing, and the other rules' sequence must not)
                conn.rollback()
                self._write_due_soon(3)
                ids = conn.execute(lock).scalars().all()
            if shared and ids:
                other.execute(
                    select(self.Outbox.id)
                    .where(self.Outbox.id.in_(ids))
                    .with_for_update(read=True, key_share=True)
                )
            time.sleep(self.rng.uniform(0.0, 0.2))
            if self.rng.random() < 0.8:
                conn.commit()
            else:
                conn.rollback()
            other.commit()
        self.locked_pending += len(ids)
        self.log.append(
            f"locked {len(ids)} pending events FOR {'KEY SHARE' if key_share else 'UPDATE'}"
            + (" in two sessions" if shared else "")
        )

    def _write_due_soon(self, n: int) -> None:
        planned = [
            Planned(next(self.seq), [], False, ("acct", self.lock_rng.choice(STRING_AGGREGATES)),
                    self.lock_rng.choice(EVENT_TYPES))
            for _ in range(n)
        ]  # fmt: skip
        with Session(self.engine) as s, s.begin():
            s.add_all(self._outbox_row(p, available_at=func.now() + timedelta(seconds=0.1)) for p in planned)
        self._remember(planned, True)
        self.log.append(f"wrote events {[p.seq for p in planned]} due in 0.1 s to lock")

    def rule_analyze(self) -> None:
        """ANALYZE both queue tables while the loops run: the claims' plans change under them (every prepared
        statement is re-planned on its next run) with the statistics of whatever the tables hold at that moment —
        the ordered claim's predecessor test and the ``unique_running`` lookups must keep their meaning in any
        plan (I2, and I6: one running job per key)."""
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for table in (self.Outbox.__table__, Job.__table__):
                conn.execute(text(f"ANALYZE {table.name}"))
        self.analyzed += 1
        self.log.append("analyzed the queue tables")

    def _end_holds(self) -> None:
        if self.holder is not None:
            self.holder.join(10)
            assert not self.holder.is_alive(), "the row holder did not end"

    RULES: tuple[tuple[str, int], ...] = (
        ("rule_produce_add", 6), ("rule_produce_emit", 3), ("rule_produce_savepoint", 2),
        ("rule_produce_for_aggregate", 3), ("rule_produce_async", 2), ("rule_enqueue", 5),
        ("rule_start_dispatcher", 3), ("rule_start_worker", 3), ("rule_stop_loop", 2),
        ("rule_terminate_backends", 1), ("rule_outage", 1), ("rule_skip_dead", 1), ("rule_pause", 4),
        ("rule_cancel", 1), ("rule_pause_queue", 1), ("rule_enqueue_many", 2), ("rule_enqueue_unique", 2),
        ("rule_maintain_partitions", 1), ("rule_cancel_async_loop", 1), ("rule_leave_async_loop", 2), ("rule_burst", 2),
        ("rule_hold_job_row", 2), ("rule_lock_pending_events", 2),
    )  # fmt: skip
    #: rule_analyze runs after a step with this probability, drawn from a generator of its own: the other
    #: rules' sequence of each seed stays what the fixed seeds' coverage checks were chosen for.
    ANALYZE_EVERY = 1 / 15
    #: rule_db_outage starts after a step with this probability (its own generator, as ANALYZE_EVERY).
    DB_OUTAGE_EVERY = 1 / 25
    #: rule_refuse_renewals starts after a step with this probability (its own generator, as ANALYZE_EVERY).
    REFUSE_RENEWALS_EVERY = 1 / 25
    #: rule_take_back_running runs after a step with this probability (its own generator, as ANALYZE_EVERY).
    TAKE_BACK_EVERY = 1 / 5
    #: rule_pooler_pause starts after a step with this probability, through a pooler (its own generator).
    POOLER_PAUSE_EVERY = 1 / 30

    # -- the run ---------------------------------------------------------------------------------------------

    def run(self) -> None:
        names = [n for n, _ in self.RULES]
        weights = [w for _, w in self.RULES]
        counter = StatementCounter()
        self.log.append(f"limit of {LIMITED}: {self.limit or 'none: unique keys and unique_running'}")
        self.sampler.start()
        try:
            self._run_rules(names, weights, counter)
            self.check_always()
            self.check_final()
        finally:
            # (also when a rule or a check failed: connections this scenario's engines still hold would otherwise
            # be collected during the next scenario, and fail it with "connections left open"; and an outage or a
            # refusal a failed step left going ends first — its thread, on engines closed under it, failed the
            # test's teardown with an error of its own that hid the step's)
            for thread in (self.cutter, self.refuser, self.pauser):
                if thread is not None:
                    thread.join(10)
            with self.engine.begin() as conn:
                conn.execute(text("DROP TABLE model_effects"))
                conn.execute(text("DROP TRIGGER IF EXISTS model_no_renewal ON jobs"))
                conn.execute(text("DROP FUNCTION IF EXISTS model_no_renewal()"))
                if self.partitioned:
                    conn.execute(text(f"DROP TABLE {PARTITIONED_TABLE} CASCADE"))
            if self.timed_out():
                time.sleep(
                    HANG
                )  # abandoned handler calls give their connections back before the engines close
            self.engine.dispose()
            self.loop_engine.dispose()

    def _run_rules(self, names: list[str], weights: list[int], counter: StatementCounter) -> None:
        with counter.installed(), self.record.accepting():
            try:
                for step in range(self.profile.steps):
                    rule = self.rng.choices(names, weights)[0]
                    self.log.append(f"step {step}: {rule}")
                    getattr(self, rule)()
                    if self.analyze_rng.random() < self.ANALYZE_EVERY:
                        self.rule_analyze()
                    if self.db_outage_rng.random() < self.DB_OUTAGE_EVERY:
                        self.rule_db_outage()
                    if self.refusal_rng.random() < self.REFUSE_RENEWALS_EVERY:
                        self.rule_refuse_renewals()
                    if self.take_back_rng.random() < self.TAKE_BACK_EVERY:
                        self.rule_take_back_running()
                    if (
                        self.pooler is not None
                        and self.profile.pooler_faults
                        and self.pooler_pause_rng.random() < self.POOLER_PAUSE_EVERY
                    ):
                        self.rule_pooler_pause()
                    self._reap_exited()
                    self.check_always()
                # Every scenario meets a held job row and a locked pending event at least once: a seed whose rules
                # drew neither (or drew them only while a hold was in progress — when, depends on timing) gets them
                # now, so the fixed seeds' coverage of I9 and of the lock does not hang on the machine's speed.
                if self.holder is None:
                    self.log.append("coverage: a held job row")
                    self.rule_hold_job_row()
                if not self.locked_pending:
                    self.log.append("coverage: locked pending events")
                    self.rule_lock_pending_events()
                # (whether a run went on at the moments the rule was drawn depends on timing)
                if not self.taken_back:
                    self.log.append("coverage: a running job taken back")
                    if not any(lt.name in self.every_queue for lt in self.workers):
                        self.start_worker(is_async=False, bounded=False, every_queue=True)
                    self.rule_take_back_running(linger=True, wait=5.0)
                if not self.planned_alone:  # (whether the rules drew one depends on timing: the loops that
                    # exited change the draws that follow — a clean clone's CI run met none in seeds 1-3)
                    self.log.append("coverage: an enqueue_many call large enough to go unprepared")
                    first = Planned(next(self.seq), [], False)
                    self._enqueue_many_unique(first, self.bulk_rng.choice(UNIQUE_KEYS), commit=True)
                if self.cron and len(self.cron_changes) == 1:  # C5 in every scenario with a cron schedule
                    self.log.append("coverage: a deploy re-syncs the cron schedule")
                    self._resync_cron()
                if (
                    self.pooler is not None
                    and self.profile.pooler_faults
                    and self.pooler.admin is not None
                    and not self.pooler_pauses
                ):
                    self.log.append("coverage: a pooler pause")  # (P2 in every pooled scenario)
                    self.rule_pooler_pause()
                self._end_db_outage()
                self._end_refusal()
                self._end_pooler_pause()
                # (with the faults over: H1 asks for one run and the outcome written, which an outage still going
                # on would delay past the lease — a seed's step met one, its outcome unwritten 2.4 s after the run)
                if not self.record.landed_after_run:
                    self.log.append("coverage: a claim lands after its job's run ended, with a newer lease")
                    self.rule_hand_over()
                self.steps_over = time.monotonic()
                self.drain()  # (the holder's job runs by then, if no worker reached it while the rules went on)
                self._end_holds()
                self.check_idle(counter)
            finally:
                self.sent_ahead = counter.sent_ahead
                self.log.append(f"claims sent ahead of the jobs in hand: {counter.sent_ahead}")
                self.log.append(
                    f"runs ended with a claim in flight: {self.record.ended_in_flight}; claims that landed with "
                    f"a newer lease of such a run's job: {self.record.landed_after_run}; claims of a job its worker was "
                    f"running: {self.record.claimed_while_running}; running jobs taken back: "
                    f"{self.taken_back}"
                )
                for lt in self.dispatchers + self.workers:
                    lt.stop()
                self.sampler.stop()

    def timed_out(self) -> int:
        return sum(
            lt.loop.stats.timed_out for lt in self.dispatchers + self.workers + self.finished if lt.loop
        )

    def lost_leases(self) -> int:
        return sum(
            lt.loop.stats.lost_leases for lt in self.dispatchers + self.workers + self.finished if lt.loop
        )

    def drain(self) -> None:
        """Faults off, queues resumed, one loop of each kind at least, until every row is finished or blocked."""
        self.outage.clear()
        for queue, windows in self.model.pauses.items():
            if self.model.paused(queue):
                assert resume_queue(self.engine, Job, queue) is True, queue
                windows[-1][1] = time.monotonic()
        if not self.dispatchers:
            self.start_dispatcher(is_async=False, bounded=False)
        if not any(lt.name in self.every_queue for lt in self.workers):
            self.start_worker(is_async=False, bounded=False, every_queue=True)
        if not any(lt.name in self.burst_workers for lt in self.workers):
            self.start_worker(bounded=False, burst=True)
        if self.cron:
            self._last_cron_firing()
        deadline = time.monotonic() + self.profile.drain_seconds
        while time.monotonic() < deadline:
            self._reap_exited()
            if not self.dispatchers:  # one that stopped after max_batches
                self.start_dispatcher(is_async=False, bounded=False)
            if not any(lt.name in self.every_queue for lt in self.workers):  # (likewise)
                self.start_worker(is_async=False, bounded=False, every_queue=True)
            if not any(lt.name in self.burst_workers for lt in self.workers):
                self.start_worker(bounded=False, burst=True)
            if self._settled():
                return
            time.sleep(0.2)
        raise AssertionError(f"not drained within {self.profile.drain_seconds}s: {self._unsettled()}")

    def _cron_jobs(self, conn: Any) -> list[Any]:
        return list(
            conn.execute(select(Job.id, Job.unique_key, Job.status, Job.created_at).where(Job.task == CRON))
        )

    def _last_cron_firing(self) -> None:
        """C3: the schedule resumed and a worker that fires it running, a new slot fires within a few seconds
        (every second, by the workers' once-a-second maintenance); then the schedule is paused for good, so the
        drain can end (C4: and nothing fires after it)."""
        if self.cron_pauses and self.cron_pauses[-1][1] is None:
            self.cron_pauses[-1][1] = self._db_now()
            assert resume_schedule(self.engine, JobSchedule, CRON) is True
        since = self._db_now()
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            self._reap_exited()  # (a worker whose job planned "exit" has left)
            if not any(lt.name in self.cron_workers for lt in self.workers):
                self.start_worker(is_async=False, bounded=False, every_queue=True, schedules=True)
            with self.engine.connect() as conn:
                if any(j.created_at >= since for j in self._cron_jobs(conn)):
                    break
            time.sleep(0.2)
        else:
            with self.engine.connect() as conn:
                row = conn.execute(text("SELECT *, now() FROM schedules")).all()
            raise AssertionError(
                f"C3: no cron slot fired within 15 s of {since} with workers {self.cron_workers}: {row}"
            )
        pause_schedule(self.engine, JobSchedule, CRON)
        self.cron_pauses.append([self._db_now(), None])
        with self.engine.connect() as conn:
            self.cron_jobs_at_pause = len(self._cron_jobs(conn))
        self.log.append(f"cron schedule paused for the drain: {self.cron_jobs_at_pause} cron jobs")

    def check_cron(self, delivered: set[int]) -> None:
        """C1 one job per slot, C2 no slot of a pause fired, C4 every cron job done, run, and none written
        after the final pause (``delivered``: minus the ids of the cron jobs a handler ran to success)."""
        with self.engine.connect() as conn:
            jobs = self._cron_jobs(conn)
        prefix = f"schedule:{CRON}:"
        slots = Counter(j.unique_key for j in jobs)
        assert all(k.startswith(prefix) for k in slots) and max(slots.values(), default=1) == 1, slots  # C1
        for j in jobs:
            slot = datetime.fromisoformat(j.unique_key.removeprefix(prefix))
            for begin, end in self.cron_pauses:  # C2
                assert begin is not None
                assert not (begin <= slot and (end is None or slot < end)), (
                    f"cron job {j.id} of slot {slot} fired during the pause {begin} .. {end}"
                )
            in_force = [cron for at, cron in self.cron_changes if at <= slot]
            assert not in_force or in_force[-1] == "* * * * * *" or slot.second % 2 == 0, (  # C5
                f"cron job {j.id} of slot {slot} fired under {in_force[-1]!r} (changes: {self.cron_changes})"
            )
            assert j.status == "done" and -j.id in delivered, j  # C4
        assert len(jobs) == self.cron_jobs_at_pause, (len(jobs), self.cron_jobs_at_pause)  # C4
        self.log.append(
            f"cron: {len(jobs)} jobs, {len(self.cron_pauses)} pauses, "
            f"{len(self.cron_changes) - 1} changes of its expression"
        )

    def _settled(self) -> bool:
        return not self._unsettled()

    def _unsettled(self) -> list[str]:
        """Rows not finished, except ordered ones behind a dead row of their aggregate (F3)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(self.Outbox.id, self.Outbox.aggregate_type, self.Outbox.aggregate_id, self.Outbox.status,
                       self.Outbox.event_type).order_by(self.Outbox.id)
            ).all()  # fmt: skip
            jobs = conn.execute(select(Job.id, Job.status).where(Job.status.in_(("queued", "running")))).all()
        out = [f"job {j.id} {j.status}" for j in jobs]
        dead_before: set[tuple[str, str]] = set()
        for r in rows:
            key = (r.aggregate_type, r.aggregate_id)
            if r.status == "dead" and r.event_type in self.ordered_types:
                dead_before.add(key)
            elif r.status in ("pending", "processing") and not (
                r.status == "pending" and r.event_type in self.ordered_types and key in dead_before
            ):
                out.append(f"event {r.id} {r.status} {key}")
        return out

    def _aggregate_dump(self, aggregate: tuple[str, str], events: dict[int, Any]) -> str:
        return "; ".join(
            f"seq {s} {self.model.events[s].event_type} poison={self.model.events[s].poison} "
            f"plan={self.model.events[s].plan} "
            + (
                f"id={events[s].id} {events[s].status} att={events[s].attempts} "
                f"err={(events[s].last_error or '')[-80:]!r}"
                if s in events
                else "retired with its partition"
            )
            for s in self.model.order[aggregate]
        )

    # -- invariants ------------------------------------------------------------------------------------------

    def check_always(self) -> None:
        rec = self.record.snapshot()
        published = {seq for kind, seq, _, _ in rec if kind == "publish"}
        handled = {seq for kind, seq, _, _ in rec if kind == "handle"}
        # I1
        assert not published & self.model.rolled_back_events, "a rolled-back event was published"
        assert not handled & self.model.rolled_back_jobs, "a rolled-back job was handled"
        assert not handled & self.model.superseded_jobs, (
            f"a skipped or replaced job was handled: {sorted(handled & self.model.superseded_jobs)}"
        )
        # I13
        assert not self.fault_storms, f"I13: hot loop through an outage: {self.fault_storms}"
        # I3 (a claim in a worker's hands twice would run twice: said with the path that put it there again)
        assert not self.record.in_hand_twice, f"I3: a claim in hand twice: {self.record.in_hand_twice[:3]}"
        claims = Counter((kind, seq, lv) for kind, seq, lv, _ in rec)
        twice = [c for c, n in claims.items() if n > 1]
        if twice:
            with self.record.lock:
                runs = [r for r in self.record.runs if (r[1], r[2]) in {(c[1], c[2]) for c in twice}]
            with self.engine.connect() as conn:
                rows = conn.execute(
                    text("SELECT id, status, lease_version, attempts, unique_key, last_error FROM jobs "
                         "WHERE (payload ->> 'seq')::int = ANY(:s)"), {"s": [c[1] for c in twice]},
                ).all()  # fmt: skip
            with self.record.lock:
                claimed = {c[1:]: self.record.accepted.get(c[1:]) for c in twice[:5]}
            owners = {
                lt.name: lt.loop.owner for lt in self.dispatchers + self.workers + self.finished if lt.loop
            }
            raise AssertionError(
                f"one claim handled twice: {twice[:5]}; its runs: {runs[:10]}; rows {rows}; the claims that handed "
                f"it over (owner, time): {claimed}; the loops' owners {owners}"
            )
        # I11
        newest: dict[tuple[str, int], int] = {}
        for kind, seq, lv, _ in rec:
            if kind in ("handle", "cron"):
                before = newest.get((kind, seq), 0)
                assert lv >= before, (
                    f"{kind} {seq} started on lease {lv} after it had started on lease {before}"
                )
                newest[(kind, seq)] = lv
        # I2
        first_ok: dict[int, int] = {}
        for position, (kind, seq, _, action) in enumerate(rec):
            if kind == "publish" and action == "ok" and seq not in first_ok:
                first_ok[seq] = position
        for aggregate, seqs in self.model.order.items():
            ordered = [s for s in seqs if self.model.events[s].event_type in self.ordered_types]
            for i, seq in enumerate(ordered):
                if seq not in first_ok:
                    continue
                for earlier in ordered[:i]:
                    done_at = first_ok.get(earlier, self.model.skipped.get(earlier))
                    if done_at is None or done_at > first_ok[seq]:
                        trail = [r for r in enumerate(rec) if r[1][1] in ordered]
                        raise AssertionError(
                            f"aggregate {aggregate}: event {seq} delivered before earlier event {earlier} "
                            f"(skipped at {self.model.skipped}; {[(s, self.model.events[s].plan, self.model.events[s].poison) for s in ordered]}); trail {trail}"
                        )
        # I5: no job of a paused queue starts once its workers had time to learn of the pause
        with self.record.lock:
            starts = list(self.record.starts)
        for seq, queue, at in starts:
            for begin, end in self.model.pauses.get(queue, []):
                assert not (begin + PAUSE_GRACE <= at < end), (
                    f"job {seq} of queue {queue} started {at - begin:.1f}s into a pause"
                )
        # I10
        with self.record.lock:
            batches = list(self.record.batches)
        started: dict[tuple[int, int], int] = {}
        for position, (kind, seq, lv, _) in enumerate(rec):
            if kind == "handle":
                started.setdefault((seq, lv), position)
        for concurrency, batch in batches:
            for queue in {q for _, _, q, _ in batch}:
                priorities = [p for _, _, q, p in batch if q == queue]
                assert priorities == sorted(priorities, reverse=True), (
                    f"a batch taken out of priority order: {batch}"
                )
            if concurrency == 1:
                order = [started[(seq, lv)] for seq, lv, _, _ in batch if (seq, lv) in started]
                assert order == sorted(order), f"a batch started out of the order it was taken in: {batch}"
        # I12
        assert not self.record.beside_itself, f"a job run beside itself: {self.record.beside_itself[:5]}"
        # I7
        assert not self.record.bad_payloads, f"payloads decoded otherwise: {self.record.bad_payloads[:5]}"
        # I6
        assert not self.sampler.violations, f"the limit was broken: {self.sampler.violations[:5]}"
        # I4 — against what the loops have counted by then: a run whose lease was taken back counts as a lost
        # lease only once its loop has tried to write its outcome, a few ms after the run returned; a check right
        # after a step can come between the two (seed 100: a lingering run taken back, its job run again on the
        # next lease by another worker 10 ms after it returned, checked before its loop wrote). So the counts
        # may catch up for up to 3 s before a duplicate is called unexplained.
        successes = Counter((kind, seq) for kind, seq, _, action in rec if action == "ok")
        extra = sum(n - 1 for n in successes.values() if n > 1)
        explained = self.lost_leases() + self.timed_out()
        catch_up = time.monotonic() + 3.0
        while extra > explained and time.monotonic() < catch_up:
            time.sleep(0.05)
            explained = self.lost_leases() + self.timed_out()
        if extra > explained:
            twice_ok = {k for k, n in successes.items() if n > 1}
            trail = [r for r in rec if (r[0], r[1]) in twice_ok]
            # (what the next such failure needs to say which path ran a job again: each run's worker and start,
            # the loops that counted a lost lease or a timeout, the loops that left, and the rows)
            seqs = {seq for _, seq in twice_ok}
            with self.record.lock:
                runs = [r for r in self.record.runs if r[1] in seqs]
            loops = self.dispatchers + self.workers + self.finished
            counted = {lt.name: (lt.loop.stats.lost_leases, lt.loop.stats.timed_out) for lt in loops
                       if lt.loop and (lt.loop.stats.lost_leases or lt.loop.stats.timed_out)}  # fmt: skip
            left = {lt.name: repr(lt.exited) for lt in self.finished if lt.exited is not None}
            with self.engine.connect() as conn:
                seq_col = Job.payload["seq"].as_integer()
                rows = conn.execute(
                    select(seq_col, Job.id, Job.status, Job.attempts, Job.lease_version, Job.last_error)
                    .where(seq_col.in_(sorted(seqs)))
                ).all()  # fmt: skip
            raise AssertionError(
                f"{extra} duplicate successes but {self.lost_leases()} lost leases and {self.timed_out()} "
                f"timed-out calls: {trail}; runs (worker, seq, lease, start) {runs}; loops that counted a lost "
                f"lease or a timeout {counted}; loops that left {left}; rows {[tuple(r) for r in rows]}"
            )

    def check_idle(self, counter: StatementCounter) -> None:
        """F5: with nothing to do, a loop's threads send a few statements per second at most (a hot loop would
        send thousands)."""
        time.sleep(0.5)
        before = counter.snapshot()
        time.sleep(2.0)
        after = counter.snapshot()
        busiest = max(((after[t] - before[t]) for t in after), default=0)
        # An idle worker of q1, q2 and a limited q3 polling every 0.3 s sends a claim per queue (the limited one's
        # pick and claim are two) ~3 times a second, plus its maintenance step (rescue, the rate window's
        # cleanup, the paused queues): ~16 a second, measured up to 31 in 2 s. A hot loop would send thousands.
        assert busiest <= 60, f"an idle loop sent {busiest} statements in 2 s"

    def check_final(self) -> None:
        rec = self.record.snapshot()
        delivered = {seq for kind, seq, _, action in rec if kind == "publish" and action == "ok"}
        handled_ok = {seq for kind, seq, _, action in rec if kind == "handle" and action == "ok"}
        with self.engine.connect() as conn:
            events = {r.payload["seq"]: r for r in conn.execute(select(self.Outbox))}
            jobs = {r.payload["seq"]: r for r in conn.execute(select(Job).where(Job.task != CRON))}
        if self.cron:
            self.check_cron({seq for kind, seq, _, action in rec if kind == "cron" and action == "ok"})
        if self.translated:  # T1: the loops' statements were compiled as a tenant's, the schema written in
            mapped = [c.sql for k, c in list(_execute._TRANSLATED.items()) if k[2] >= PUBLIC_MAP]
            tables = ("public.jobs", f"public.{self.Outbox.__table__.name}")
            assert all(any(t in sql for sql in mapped) for t in tables), (len(mapped), mapped[:2])
        # F4
        assert not set(events) & self.model.rolled_back_events and not set(jobs) & self.model.rolled_back_jobs
        assert not set(jobs) & self.model.superseded_jobs, sorted(set(jobs) & self.model.superseded_jobs)
        assert set(jobs) == set(self.model.jobs)
        # a committed event's row is missing only when its (yesterday's) partition was retired, and then it was
        # finished: delivered, or skipped by the operator
        retired = set(self.model.events) - set(events)
        assert set(events) <= set(self.model.events) and retired <= self.model.yesterday, retired
        assert not retired - delivered - set(self.model.skipped), (
            retired - delivered - set(self.model.skipped)
        )
        # F1, F2, F3
        for aggregate, seqs in self.model.order.items():
            blocked_by: int | None = None
            for seq in seqs:
                p, row = self.model.events[seq], events.get(seq)
                in_scope = p.event_type in self.ordered_types
                if row is None:  # retired with its partition: finished (checked above)
                    continue
                dump = self._aggregate_dump(aggregate, events)
                if in_scope and blocked_by is not None:
                    assert row.status == "pending", f"{seq} should wait behind dead {blocked_by}: {dump}"
                elif p.poison:
                    assert row.status == "dead" or seq in self.model.skipped, f"poison {seq}: {dump}"
                    if in_scope and seq not in self.model.skipped:
                        blocked_by = seq
                else:
                    assert row.status == "done" and seq in delivered, f"{seq} not delivered: {dump}"
        # I9
        for job_id, version, owner, began, ended, rescued, refused in self.holds:
            assert not (rescued and began == ended and not refused), (
                f"job {job_id} (lease version {version}) was rescued from {owner}, which was running it, the "
                "moment a transaction that held its row past stale_after ended"
            )
        with self.engine.connect() as conn:
            effects = Counter(conn.execute(text("SELECT seq FROM model_effects")).scalars())
        runs: dict[int, list[tuple[str, int, int, str]]] = {}
        for e in rec:
            if e[0] == "handle":
                runs.setdefault(e[1], []).append(e)
        for seq, p in self.model.jobs.items():
            row = jobs[seq]
            why = (seq, p.plan, p.poison, row.status, row.last_error, runs.get(seq, []))
            if seq in self.model.cancelled_queued:
                assert row.status == "cancelled", why
                ran_after = [
                    e for e in rec[self.model.cancelled_queued[seq] :] if e[0] == "handle" and e[1] == seq
                ]
                assert not ran_after, f"job {seq} ran after it was cancelled: {ran_after}"
            elif seq in self.model.cancel_requested:
                # requested while it ran: done if its handler returned, else cancelled — a failure too, whether
                # its worker had learned of the request or not (the finalize reads it)
                assert row.status in ("cancelled", "done"), why
                assert not (p.poison and row.status == "done"), why
            elif p.poison:
                assert row.status == "failed", why
            elif seq in self.model.old_jobs:
                # F8: a failure fails it (it was written past give_up_after); done if it never failed, or if the
                # claim that met a failure lost its lease and a later claim succeeded. A one-attempt job's handler
                # that overran its worker's handler_timeout (on a loaded machine, seed 108 of the long profile)
                # spent its one attempt: that failure is named as such, give_up_after having nothing to add; so does
                # a one-attempt job a rescue took back from under its run (rule_take_back_running: a crashed
                # worker's job, the poison-message rule)
                assert row.status == "done" or (
                    row.status == "failed"
                    and (
                        (row.last_error or "").startswith("gave up: written")
                        or (
                            seq in self.model.taken_back
                            and "after max attempts (worker crash?)" in (row.last_error or "")
                        )
                        or (
                            p.plan
                            and set(p.plan) == {"noanswer"}
                            and _timed_out_on_its_attempt(row.last_error)
                        )
                        # (as for a younger one-attempt job below — seed 116 of the long profile)
                        or _spent_on_a_cut_session(
                            seq in self.model.in_transaction, self.terminations, row.last_error, runs.get(seq)
                        )
                    )
                ), why
                # (not "an empty plan ends done": on a loaded machine an instant handler can overrun its timeout)
                assert row.status == "failed" or seq in handled_ok, why
            elif row.status == "failed" and set(p.plan) == {"noanswer"}:
                # a one-attempt job (see rule_enqueue) may end failed only by the rescue of a worker that died
                # holding it — the poison-message rule — or, a transactional handler's, when its session's
                # connection was terminated under it (an exception like any other: its one attempt spent,
                # docs/jobs.md), or by a run that overran handler_timeout — never by a NoAnswer on its last attempt
                error = row.last_error or ""
                assert (
                    "after max attempts (worker crash?)" in error
                    or _timed_out_on_its_attempt(error)
                    or _spent_on_a_cut_session(
                        seq in self.model.in_transaction, self.terminations, error, runs.get(seq)
                    )
                ), why
            else:
                assert row.status == "done" and seq in handled_ok, why
            # F6: a transactional handler's effect commits exactly when its completion does
            expected = 1 if row.status == "done" and seq in self.model.in_transaction else 0
            assert effects[seq] == expected, (
                f"job {seq}: {effects[seq]} effect row(s), expected {expected}: {why}"
            )


def _spent_on_a_cut_session(
    in_transaction: bool, terminations: int, error: str | None, runs: list[tuple[str, int, int, str]] | None
) -> bool:
    """A one-attempt job's transactional handler whose session's connection a termination cut under it: an
    exception like any other, its one attempt spent (docs/jobs-control.md) — said with the server's notice, or
    the closed socket when the client read that first; through PgBouncer (P1) with the pooler's own words for
    its lost server connection, or psycopg's for the pooler's answer to a COMMIT or ROLLBACK on it. On its second
    attempt when a NoAnswer gave its first back and a run's outcome was then lost with its worker's connection:
    the rescue sends such a row back once more, even at its last attempt (``_sql.rescue_statement``, "it goes
    back once" — seed 169 of the pooled profile: noanswer, a cut run rescued, a cut run)."""
    error = error or ""
    spent: tuple[str, ...] = ("retries exhausted (1/1)",)
    if any(action == "noanswer" for _, _, _, action in runs or ()):
        spent = (*spent, "retries exhausted (2/1)")
    return (
        in_transaction
        and terminations > 0
        and error.startswith(spent)
        and any(cut in error for cut in _CUT_SESSION)
    )


#: How a session cut under a transactional handler reads (see :func:`_spent_on_a_cut_session`).
_CUT_SESSION = (
    "terminating connection due to administrator command",
    "server closed the connection unexpectedly",
    "server conn crashed?",  # PgBouncer: the server connection under the client's transaction died
    "received 2 results from command",  # psycopg: PgBouncer answered with that error and the command's result
    "invalid server parameter",  # PgBouncer (08P01): linking a server connection that died meanwhile
)


def _timed_out_on_its_attempt(error: str | None) -> bool:
    """A one-attempt job's run overran its worker's ``handler_timeout``: a RetryableError on its last attempt —
    a failure, not a NoAnswer (whose last attempt is refunded). The model's handlers never sleep on such jobs,
    so this is the machine's load (threads waiting for a core past 0.4 s), and the product's answer to it."""
    return (error or "").startswith(
        "retries exhausted (1/1): RetryableError: handler exceeded handler_timeout"
    )


#: Who opened each connection of this process (the driver connection's id -> the scenario, the opening thread
#: and frames), so that one the collector finds open is named in the failure: a sync one, rarely, under load,
#: whose opener tracing every connect did not catch (stop 67). Kept across scenarios: one collected in the
#: next scenario of the process was opened in an earlier one. The id may have been reused since: a hint.
_OPENED_BY: dict[int, str] = {}
_SCENARIO = [0]  # the seed of the scenario running in this process


def _note(driver: Any, how: str) -> None:
    if len(_OPENED_BY) > 50_000:
        _OPENED_BY.clear()
    frames = [
        f for f in traceback.extract_stack(limit=48)[:-2]
        if "/sqlalchemy/" not in f.filename and "/psycopg/" not in f.filename
    ][-10:]  # fmt: skip
    where = " <- ".join(f"{f.name}@{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames))
    _OPENED_BY[id(driver)] = f"seed {_SCENARIO[0]}, {how}, {threading.current_thread().name}: {where}"


@event.listens_for(Pool, "connect")
def _note_opener(dbapi_connection: Any, _record: Any) -> None:
    _note(getattr(dbapi_connection, "driver_connection", dbapi_connection), "pooled")


@contextlib.contextmanager
def _direct_connects_noted() -> Iterator[None]:
    """psycopg's own ``Connection.connect`` (a LISTEN connection, its probe's) noted as the pools' are."""
    original = psycopg.Connection.__dict__["connect"]

    def connect(cls: Any, *args: Any, **kwargs: Any) -> Any:
        conn = original.__func__(cls, *args, **kwargs)
        if "sa_outbox.listen" in str(kwargs.get("application_name", "")):
            _note(conn, "direct")
        return conn

    psycopg.Connection.connect = classmethod(connect)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        psycopg.Connection.connect = original  # type: ignore[method-assign]


def _openers(messages: list[str]) -> list[str]:
    """The openers of the connections named in the collector's warnings (from their ``0x…`` address)."""
    found = []
    for m in messages:
        at = re.search(r"object at (0x[0-9a-f]+)", m)
        opener = _OPENED_BY.get(int(at.group(1), 16)) if at else None
        found.append(opener or "(opened neither by a pool nor as a LISTEN connection)")
    return found


def run_scenario(
    seed: int, engine: Engine, async_url: URL, profile: Profile, pooler: Pooler | None = None
) -> Scenario:
    scenario = Scenario(seed, engine, async_url, profile, pooler)
    _SCENARIO[0] = seed
    try:
        # Over the whole run, and once every loop is closed and every engine disposed: the collector finds no
        # psycopg connection still open (one given back to a pool already disposed — an abandoned handler's
        # to a loop's own engine). Recorded from any thread, whenever a collection happens to find one.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            with _direct_connects_noted():
                scenario.run()
            gc.collect()
        left = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        open_ = [m for m in left if "while still open" in m]
        assert not open_, f"connections left open: {open_[:3]}; opened by: {_openers(open_[:3])}"
    except BaseException as exc:
        tail = "\n  ".join(scenario.log[-int(os.environ.get("SA_OUTBOX_MODEL_TAIL", "40")) :])
        if pooler is not None and pooler.state is not None:
            with contextlib.suppress(Exception):
                tail += f"\n  the pooler now: {pooler.state()}"
        raise AssertionError(f"model-based scenario seed={seed} failed: {exc}\n  {tail}") from exc
    return scenario
