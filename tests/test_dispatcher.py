"""The outbox document's test table (§7), against the real database, plus the dispatcher's own guarantees."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text

from sa_outbox import (
    Backoff,
    ConfigurationError,
    Defer,
    Dispatcher,
    Message,
    PermanentError,
    RetryableError,
    _sql,
)
from sa_outbox import _steps as eng
from sa_outbox.models import Job, OutboxEvent
from sa_outbox.testing import RecordingPublisher, drain

from .factories import FAST, expire_leases, make_due
from .helpers import OUTBOX, claim, claim_forms_sent, ids_with_status, mark_done, row, seed_events, statuses


def dispatcher(engine: Engine, publisher: Any, **kw: Any) -> Dispatcher:
    kw.setdefault("listen", False)
    kw.setdefault("backoff", FAST)
    return Dispatcher(engine, OutboxEvent, publisher, **kw)


# --- §7 row 1: concurrent claims take disjoint rows ----------------------------------------------------------


def test_four_workers_claiming_200_rows_take_disjoint_sets(engine: Engine) -> None:
    seed_events(engine, 200)
    taken: list[list[int]] = [[] for _ in range(4)]
    barrier = threading.Barrier(4)

    def worker(i: int) -> None:
        barrier.wait()
        for _ in range(100):  # bounded
            rows = claim(engine, f"w{i}", batch=7, lease=30)
            if not rows:
                return
            taken[i].extend(r.id for r in rows)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    all_ids = [i for part in taken for i in part]
    assert len(all_ids) == 200 and len(set(all_ids)) == 200
    assert sum(1 for part in taken if part) >= 2  # they really ran side by side


# --- §7 row 2: the broken dispatcher (COMMIT, then publish) publishes twice -------------------------------


def _broken_claim(engine: Engine, batch: int) -> list[int]:
    """The document's broken pattern: SELECT … FOR UPDATE SKIP LOCKED, COMMIT, then (later) publish."""
    with engine.begin() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT id FROM outbox WHERE status = 'pending' ORDER BY id LIMIT :n FOR UPDATE SKIP LOCKED"
                ),
                {"n": batch},
            ).scalars()
        )


def test_broken_dispatcher_publishes_every_message_twice(engine: Engine) -> None:
    seed_events(engine, 3)
    published: Counter[int] = Counter()
    a = _broken_claim(engine, 50)  # worker A committed; its row locks are gone, status still pending
    b = _broken_claim(engine, 50)  # worker B runs while A is still publishing: it gets the same rows
    for worker_rows in (a, b):
        for i in worker_rows:
            published[i] += 1
    assert a == b == [1, 2, 3]
    assert set(published.values()) == {2}


def test_real_dispatcher_does_not_publish_twice_in_the_same_situation(engine: Engine) -> None:
    seed_events(engine, 3)
    a = claim(engine, "A", batch=50, lease=30)  # committed, A now "publishing"
    b = claim(engine, "B", batch=50, lease=30)
    assert [r.id for r in a] == [1, 2, 3]
    assert b == []  # ownership outlived the transaction


# --- §7 row 3: 4 workers × dispatch_once over 100 rows ----------------------------------------------------


def test_four_dispatchers_publish_each_of_100_messages_once(engine: Engine) -> None:
    seed_events(engine, 100)
    pub = RecordingPublisher()
    ds = [dispatcher(engine, pub, batch=7) for _ in range(4)]
    threads = [threading.Thread(target=drain, args=(d,)) for d in ds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(pub.ids) == list(range(1, 101))
    assert statuses(engine) == {"done": 100}
    assert sum(d.stats.done for d in ds) == 100


# --- §7 rows 4–5: crash → lease expiry → reclaim; expired but not taken over ------------------------------


def test_stale_worker_cannot_finalize_after_reclaim(engine: Engine) -> None:
    seed_events(engine, 1)
    [a] = claim(engine, "A", batch=10, lease=0.2)
    assert claim(engine, "B", batch=10, lease=30) == []  # leased: nobody else can take it
    expire_leases(engine, "outbox")  # A stalled past its lease
    [b] = claim(engine, "B", batch=10, lease=30)  # rescue + claim
    assert b.id == a.id and b.lease_version == a.lease_version + 1 and b.attempts == 2
    assert mark_done(engine, a) is False  # the expired A is fenced off
    assert mark_done(engine, b) is True
    assert row(engine, "outbox", a.id).status == "done"


def test_expired_lease_nobody_took_over_still_finalizes(engine: Engine) -> None:
    seed_events(engine, 1)
    [a] = claim(engine, "A", batch=10, lease=0.2)
    expire_leases(engine, "outbox")
    assert mark_done(engine, a) is True
    r = row(engine, "outbox", a.id)
    assert (r.status, r.lease_owner, r.lease_until, r.done_at is not None) == ("done", None, None, True)


# --- §7 rows 6–8: failure classes ------------------------------------------------------------------------


def test_retryable_three_times_with_max_three_ends_dead(engine: Engine) -> None:
    seed_events(engine, 1)
    pub = RecordingPublisher(fail=lambda m: RetryableError("broker timeout"))
    d = dispatcher(engine, pub, max_attempts=3)
    seen = []
    for _ in range(3):
        make_due(engine, "outbox")  # the backoff has passed
        assert d.run_once() == 1
        r = row(engine, "outbox", 1)
        seen.append((r.status, r.attempts))
    assert seen == [("pending", 1), ("pending", 2), ("dead", 3)]
    r = row(engine, "outbox", 1)
    assert "RetryableError: broker timeout" in r.last_error and "retries exhausted (3/3)" in r.last_error
    make_due(engine, "outbox")
    assert d.run_once() == 0  # dead is never claimed again
    assert (d.stats.retried, d.stats.dead) == (2, 1)


def test_retry_backoff_is_full_jitter_from_the_database_clock(engine: Engine) -> None:
    seed_events(engine, 1)
    d = dispatcher(engine, RecordingPublisher(fail=lambda m: RetryableError("x")), backoff=Backoff(10, 300))
    d.run_once()
    with engine.connect() as conn:
        wait = conn.execute(text("SELECT extract(epoch FROM available_at - now()) FROM outbox")).scalar_one()
    assert -0.5 <= float(wait) <= 20.0  # random(0, min(300, 10 * 2^1))


def test_defer_keeps_pending_refunds_the_attempt_and_pushes_available_at(engine: Engine) -> None:
    seed_events(engine, 1)
    d = dispatcher(
        engine, RecordingPublisher(fail=lambda m: Defer(timedelta(minutes=5), "customer not created yet"))
    )
    assert d.run_once() == 1
    with engine.connect() as conn:
        r = conn.execute(
            text(
                "SELECT status, attempts, last_error, extract(epoch FROM available_at - now()) AS wait FROM outbox"
            )
        ).one()
    assert (r.status, r.attempts) == ("pending", 0)
    assert 290 <= float(r.wait) <= 301
    assert r.last_error == "deferred: customer not created yet"
    assert d.stats.deferred == 1


def test_permanent_error_goes_straight_to_dead(engine: Engine) -> None:
    seed_events(engine, 1)
    d = dispatcher(engine, RecordingPublisher(fail=lambda m: PermanentError("422 invalid payload")))
    assert d.run_once() == 1
    r = row(engine, "outbox", 1)
    assert (r.status, r.attempts, r.last_error) == ("dead", 1, "PermanentError: 422 invalid payload")


# --- §7 row 9: poison message (claim without finalize ×3) --------------------------------------------------


def test_claim_without_finalize_three_times_ends_dead_and_is_never_claimed_again(engine: Engine) -> None:
    seed_events(engine, 1)
    for attempt in (1, 2, 3):
        [r] = claim(engine, f"crash-{attempt}", batch=10, lease=0.05, max_attempts=3)
        assert r.attempts == attempt
        expire_leases(engine, "outbox")  # the worker "crashed": nothing finalizes, the lease runs out
    assert claim(engine, "next", batch=10, lease=30, max_attempts=3) == []
    r = row(engine, "outbox", 1)
    assert (r.status, r.attempts) == ("dead", 3)
    assert "after max attempts" in r.last_error
    assert claim(engine, "later", batch=10, lease=30, max_attempts=3) == []


# --- §7 rows 10–11: ordered claim ------------------------------------------------------------------------


def test_ordered_claim_takes_only_each_aggregates_head(engine: Engine) -> None:
    seed_events(engine, 3, aggregate="X")  # ids 1, 2, 3
    seed_events(engine, 2, aggregate="Y")  # ids 4, 5
    first = claim(engine, "A", batch=10, lease=30, ordered=True)
    assert [r.id for r in first] == [1, 4]
    assert claim(engine, "B", batch=10, lease=30, ordered=True) == []  # heads are in flight
    for r in first:
        assert mark_done(engine, r)
    assert [r.id for r in claim(engine, "A", batch=10, lease=30, ordered=True)] == [2, 5]


@pytest.mark.parametrize("heads", [False, True], ids=["walk", "heads"])
def test_both_forms_of_the_ordered_claim_take_only_heads_that_are_due(engine: Engine, heads: bool) -> None:
    """The walk of the ready rows and the aggregate-by-aggregate form claim the same rows: each aggregate's
    head when it is pending and due — never behind a processing, dead or not-yet-due predecessor."""
    seed_events(engine, 3, aggregate="X")  # 1, 2, 3
    seed_events(engine, 2, aggregate="Y")  # 4, 5
    seed_events(engine, 2, aggregate="Z")  # 6, 7
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET available_at = now() + interval '1 hour' WHERE id = 6"))
    first = claim(engine, "A", batch=10, lease=30, ordered=True, heads=heads)
    assert [r.id for r in first] == [1, 4]
    assert claim(engine, "B", batch=10, lease=30, ordered=True, heads=heads) == []  # heads in flight
    for r in first:
        assert mark_done(engine, r)
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 'dead' WHERE id = 2"))
    second = claim(engine, "A", batch=10, lease=30, ordered=True, heads=heads)
    assert [r.id for r in second] == [5]  # X waits behind its dead event, Z behind its not-yet-due one
    assert mark_done(engine, second[0])
    assert claim(engine, "A", batch=10, lease=30, ordered=True, heads=heads) == []
    assert claim(engine, "A", batch=1, lease=30, ordered=True, heads=heads) == []


@pytest.mark.parametrize("heads", [False, True], ids=["walk", "heads"])
def test_both_forms_take_the_head_of_a_type_whose_id_another_types_dead_event_blocks(
    engine: Engine, heads: bool
) -> None:
    """A dead "order 42" blocks "order 42" only: "customer 42"'s head is claimed, by either form."""
    rows = [("order", "dead"), ("order", "E"), ("customer", "C1"), ("order", "E"), ("customer", "C2")]
    with engine.begin() as conn:
        for aggregate_type, event_type in rows:
            conn.execute(
                text(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status) "
                    "VALUES (:t, '42', :e, '{}', CASE WHEN :e = 'dead' THEN 'dead' ELSE 'pending' END)"
                ),
                {"t": aggregate_type, "e": event_type},
            )
    assert [r.id for r in claim(engine, "A", batch=10, lease=30, ordered=True, heads=heads)] == [3]
    assert claim(engine, "B", batch=10, lease=30, ordered=True, heads=heads) == []


FORMS = {
    "walk": {"ordered": True},
    "heads": {"ordered": True, "heads": True},
    "ordered types": {"ordered": True, "ordered_types": ["E"]},
}


def _finalize_and_claim(
    engine: Engine, outcomes: list[eng.Outcome], batch: int, form: str
) -> tuple[set[int], list[int]]:
    with engine.begin() as conn:
        applied, rows = eng.finalize_and_claim(
            conn, OUTBOX, outcomes, owner="A", batch=batch, lease=timedelta(seconds=30), **FORMS[form]
        )
    return applied, [r[0] for r in rows]


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("single", [True, False], ids=["one outcome", "batch"])
def test_the_statement_that_finishes_a_head_claims_the_next_event_of_its_aggregate(
    engine: Engine, form: str, single: bool
) -> None:
    """A head finalized ``done`` lets the same statement claim its successor: the claim's snapshot still sees
    the head as processing, but not as blocking once the finalize has applied its outcome (a hot aggregate:
    one statement per event, not two). A lost lease, a retry or a dead letter keeps the successor blocked."""
    seed_events(engine, 4, aggregate="X")  # 1-4
    seed_events(engine, 1, aggregate="Y")  # 5
    first = claim(engine, "A", batch=10, lease=30, ordered=True)
    assert [r.id for r in first] == [1, 5]
    x, y = first
    outcomes = [eng.Outcome(x.id, x.lease_version, "done")]
    if not single:
        outcomes.append(eng.Outcome(y.id, y.lease_version, "done"))
    assert _finalize_and_claim(engine, outcomes, 10, form) == ({1} if single else {1, 5}, [2])
    assert (
        claim(engine, "peek", batch=10, lease=30, ordered=True) == []
    )  # 2 is in flight, X has no other head
    version = row(engine, "outbox", 2).lease_version
    # a stale version (a lost lease): nothing applied, 3 stays blocked behind 2
    assert _finalize_and_claim(engine, [eng.Outcome(2, version - 1, "done")], 10, form) == (set(), [])
    # a retry puts 2 back: 3 stays blocked (and 2 itself is claimable from the next statement on)
    assert _finalize_and_claim(engine, [eng.Outcome(2, version, "pending", delay=0)], 10, form) == ({2}, [])
    assert [r.id for r in claim(engine, "A", batch=10, lease=30, ordered=True)] == [2]
    version = row(engine, "outbox", 2).lease_version
    # a dead letter blocks its aggregate
    assert _finalize_and_claim(engine, [eng.Outcome(2, version, "dead")], 10, form) == ({2}, [])
    assert claim(engine, "A", batch=10, lease=30, ordered=True) == []
    left = (
        {"done": 1, "dead": 1, "pending": 2, "processing": 1}
        if single
        else {"done": 2, "dead": 1, "pending": 2}
    )
    assert statuses(engine) == left


def test_the_statement_that_finishes_a_keys_running_job_claims_its_next_job(engine: Engine) -> None:
    """``unique_running``: the running job of a key finalized ``done`` or ``failed`` lets the same statement
    claim the key's next job; a retry (queued again, the older job) or a lost lease does not."""
    with engine.begin() as conn:
        for _ in range(4):
            conn.execute(
                text("INSERT INTO jobs (task, payload, unique_key, lease_version) VALUES ('t', '{}', 'k', 1)")
            )
    jobs = _sql.spec_for(Job)

    def step(outcome: eng.Outcome) -> tuple[set[int], list[int]]:
        with engine.begin() as conn:
            applied, rows = eng.finalize_and_claim(
                conn, jobs, [outcome], owner="w", batch=10, queue="default", unique_running=True
            )
        return applied, [r[0] for r in rows]

    with engine.begin() as conn:
        [first] = eng.claim(conn, jobs, owner="w", batch=10, queue="default", unique_running=True)
    assert first[0] == 1

    def version(job_id: int) -> int:
        return int(row(engine, "jobs", job_id).lease_version)

    assert step(eng.Outcome(1, version(1), "done")) == ({1}, [2])
    assert step(eng.Outcome(2, version(2) - 1, "done")) == (set(), [])  # stale: 2 still runs
    assert step(eng.Outcome(2, version(2), "queued", delay=0)) == ({2}, [])  # retried: 2 is the older job
    with engine.begin() as conn:
        assert [
            r[0] for r in eng.claim(conn, jobs, owner="w", batch=10, queue="default", unique_running=True)
        ] == [2]
    assert step(eng.Outcome(2, version(2), "failed")) == ({2}, [3])


def test_the_heads_form_reads_one_index_entry_per_aggregate_not_the_backlog(engine: Engine) -> None:
    """One aggregate with 5,000 pending events and three quiet ones: the walk reads every ready row to learn
    that only four heads exist; the other form descends the aggregate index once per aggregate."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                "SELECT 'order', CASE WHEN g <= 3 THEN 'quiet-' || g ELSE 'hot' END, 'E', '{}' "
                "FROM generate_series(1, 5003) g"
            )
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE outbox"))
    found = {}
    for heads in (False, True):
        stmt = eng._sql.claim_statement(OUTBOX, ordered=True, limit=50, heads=heads)
        with engine.connect() as conn:
            compiled = stmt.compile(dialect=conn.dialect)
            sql = str(compiled)
            bound = compiled.construct_params({"owner": "w", "lease": timedelta(seconds=60)})
            plan = conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, bound).scalar_one()
            conn.rollback()
            rows = conn.exec_driver_sql(sql, bound).all()
            conn.rollback()
        found[heads] = (plan[0]["Plan"]["Shared Hit Blocks"], sorted(r[0] for r in rows))
    assert found[False][1] == found[True][1] == [1, 2, 3, 4], found
    assert found[False][0] > 5_000, found  # the premise: the walk reads the backlog
    assert found[True][0] < 200, found


def test_a_dead_event_of_one_type_does_not_hold_back_another_type_sharing_its_id(engine: Engine) -> None:
    """The aggregate-by-aggregate form sees one head per aggregate id: "order 42" dead hides "customer 42".
    A claim that finds nothing is always a walk, and a dispatcher in that form walks once a second: every
    customer event is delivered, in order, and the dead order blocks only its own aggregate."""
    rows = [
        ("order", "42", "E"),
        ("customer", "42", "C1"),
        ("customer", "42", "C2"),
        ("customer", "42", "C3"),
    ]
    rows += [("order", "hot", f"H{i}") for i in range(40)]
    with engine.begin() as conn:
        for aggregate_type, aggregate_id, event_type in rows:
            conn.execute(
                text(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES (:t, :a, :e, '{}')"
                ),
                {"t": aggregate_type, "a": aggregate_id, "e": event_type},
            )
    pub = RecordingPublisher(fail=lambda m: PermanentError("bad order") if m.event_type == "E" else None)
    d = dispatcher(engine, pub, batch=10, ordered=True)
    drain(d)
    assert ids_with_status(engine, "pending") == [], [(m.id, m.event_type) for m in pub.messages]
    assert ids_with_status(engine, "dead") == [1]
    assert statuses(engine) == {"dead": 1, "done": 43}
    published = [m.event_type for m in pub.messages]
    assert [e for e in published if e.startswith("C")] == ["C1", "C2", "C3"]
    assert [e for e in published if e.startswith("H")] == [f"H{i}" for i in range(40)]


def test_the_heads_form_is_left_while_it_costs_more_than_the_walk_and_tried_again_later(
    engine: Engine,
) -> None:
    """Its cost grows with every aggregate that has unfinished rows, dead letters included (100,000 of them made
    it ~10x slower than the walk): after a short claim the dispatcher takes it only while its last claim was
    not the slower of the two, and tries it again every ``retry_every`` seconds."""
    forms = dispatcher(engine, RecordingPublisher(), ordered=True, batch=50)._forms
    forms.claimed(5, 50)
    assert forms.heads  # short, nothing measured yet: take it
    forms.cost.update({False: 0.01, True: 0.5})
    forms._retry_at = time.monotonic() + 60
    forms.claimed(5, 50)
    assert not forms.heads  # slower than the walk
    forms._retry_at = 0.0
    forms.claimed(5, 50)
    assert forms.heads and forms._retry_at > time.monotonic() + forms.retry_every - 5
    forms.claimed(50, 50)
    assert not forms.heads  # full: the walk
    forms.claimed(0, 50)
    assert not forms.heads  # nothing: the walk
    unordered = dispatcher(engine, RecordingPublisher(), ordered=["E"], batch=50)._forms
    unordered.claimed(5, 50)
    assert not unordered.heads  # ordered types keep the walk


def test_ordered_30_rows_of_one_aggregate_across_4_dispatchers_finalize_in_id_order(engine: Engine) -> None:
    seed_events(engine, 30, aggregate="X")
    pub = RecordingPublisher()
    ds = [dispatcher(engine, pub, batch=5, ordered=True) for _ in range(4)]

    def run(d: Dispatcher) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and statuses(engine).get("done", 0) < 30:
            d.run_once()

    threads = [threading.Thread(target=run, args=(d,)) for d in ds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # Only the head is claimable, so each message is published (and finalized) after its predecessor is done.
    assert pub.ids == list(range(1, 31))
    with engine.connect() as conn:
        done_order = conn.execute(text("SELECT id FROM outbox ORDER BY done_at, id")).scalars().all()
    assert done_order == list(range(1, 31))
    assert statuses(engine) == {"done": 30}
    assert sum(1 for d in ds if d.stats.claimed) >= 2


def test_dead_message_blocks_its_ordered_aggregate_only(engine: Engine) -> None:
    seed_events(engine, 2, aggregate="X")  # 1, 2
    seed_events(engine, 1, aggregate="Y")  # 3
    pub = RecordingPublisher(fail=lambda m: PermanentError("bad") if m.id == 1 else None)
    d = dispatcher(engine, pub, ordered=True)
    drain(d)
    assert ids_with_status(engine, "dead") == [1]
    assert ids_with_status(engine, "pending") == [2]  # blocked behind the dead head
    assert pub.ids == [3]


def test_ordered_event_types_leave_other_types_unordered(engine: Engine) -> None:
    seed_events(engine, 2, aggregate="X", event_type="Ordered")  # 1, 2
    seed_events(engine, 2, aggregate="X", event_type="Notice", start=2)  # 3, 4
    rows = claim(engine, "A", batch=10, lease=30, ordered=True, ordered_types=["Ordered"])
    assert [r.id for r in rows] == [1, 3, 4]


def _claim_past_a_lock_that_ended(engine: Engine, locked: list[int], batch: int = 10) -> list[int]:
    """An ordered claim whose snapshot saw these rows locked by a live transaction (FOR KEY SHARE, as a
    foreign key check of a referencing row takes) that ended before the claim reached them. (The claim runs in
    a repeatable-read transaction whose snapshot was taken while the lock was held.)"""
    with engine.connect() as holder, engine.connect() as conn:
        holder.execute(text("SELECT id FROM outbox WHERE id = ANY(:ids) FOR KEY SHARE"), {"ids": locked})
        conn.execution_options(isolation_level="REPEATABLE READ")
        conn.execute(text("SELECT 1"))  # the claim's snapshot: the lock's transaction is live
        holder.commit()
        rows = eng.claim(conn, OUTBOX, owner="A", batch=batch, lease=timedelta(seconds=30), ordered=True)
        conn.commit()
    return [r[0] for r in rows]


def _xmax(engine: Engine, ids: list[int]) -> list[int]:
    with engine.connect() as conn:
        q = text("SELECT xmax::text::bigint FROM outbox WHERE id = ANY(:ids) ORDER BY id")
        return list(conn.execute(q, {"ids": ids}).scalars())


def test_an_ordered_claim_keeps_order_for_rows_a_transaction_had_locked_when_it_looked(
    engine: Engine,
) -> None:
    """Rows locked by a transaction that was live in the claim's snapshot and ended before the claim reached
    them: X's second event is not claimed in the batch that takes X's head (its predecessor is pending in
    the claim's snapshot). (A claim that skipped the predecessor test for rows it found locked, to save
    probes, got this wrong when its lock came through; see docs/benchmarks.md.) The claim passes over both
    locked rows unlocked; the next claim, whose snapshot sees the lock ended, takes Y's lone event and still
    not X's second."""
    seed_events(engine, 2, aggregate="X")  # 1, 2
    seed_events(engine, 1, aggregate="Y")  # 3
    assert _claim_past_a_lock_that_ended(engine, [2, 3]) == [1]
    assert [r.id for r in claim(engine, "B", batch=10, lease=30, ordered=True)] == [3]
    assert ids_with_status(engine, "pending") == [2]


def test_blocked_rows_a_transaction_had_locked_never_take_the_place_of_the_rows_behind_them(
    engine: Engine,
) -> None:
    """Sixty events of X behind its dead head, found locked by a live transaction that then ended, and Y's
    event behind them: a claim of 50 takes Y, and the next claim takes Z. A row locked by a transaction in
    progress for the claim's snapshot must not count in the batch: a claim that locked such rows before their
    predecessor test and counted them filled its batch with rows it then turned down — an empty claim while
    Y waited (a reviewer's script: 20 empty claims of 20, no head published). The claim now passes over them
    unlocked."""
    seed_events(engine, 61, aggregate="X")  # 1 … 61
    seed_events(engine, 1, aggregate="Y")  # 62
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 'dead' WHERE id = 1"))
    assert set(_xmax(engine, list(range(2, 62)))) == {0}
    assert _claim_past_a_lock_that_ended(engine, list(range(2, 62)), batch=50) == [62]
    assert 0 not in _xmax(engine, list(range(2, 62)))  # (the holder's lock marked them)
    seed_events(engine, 1, aggregate="Z")  # 63
    assert [r.id for r in claim(engine, "B", batch=50, lease=30, ordered=True)] == [63]
    assert ids_with_status(engine, "pending") == list(range(2, 62))


def test_an_ordered_claim_walks_past_blocked_rows_no_transaction_touched_without_locking_them(
    engine: Engine,
) -> None:
    """Sixty events of X behind its dead head, then Y's: the claim takes Y and leaves X's rows as it found
    them (xmax 0). Locking every candidate before its predecessor test wrote a row lock (a heap write and a
    WAL record) for each blocked row, on every claim walking past them: 10,000 per claim of the 10 heads of
    10 aggregates with 1,000 events each."""
    seed_events(engine, 61, aggregate="X")  # 1 … 61
    seed_events(engine, 1, aggregate="Y")  # 62
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 'dead' WHERE id = 1"))
    for _ in range(2):
        assert [r.id for r in claim(engine, "A", batch=50, lease=30, ordered=True)] in ([62], [])
    assert ids_with_status(engine, "processing") == [62]
    assert set(_xmax(engine, list(range(2, 62)))) == {0}


def test_blocked_rows_a_finished_transaction_locked_are_walked_past_without_a_lock(engine: Engine) -> None:
    """Sixty events of X behind its dead head, locked FOR KEY SHARE (a foreign key check's lock) by a
    transaction that committed before the claims: their xmax is that transaction's, which no claim's snapshot
    sees running, so each claim tests them before the lock and leaves them as they are. Locking every row
    with an xmax first locked them on every claim, and each claim's own xid left there made the next claim
    lock them again (10,050 WAL records per claim with 10,000 such rows)."""
    seed_events(engine, 61, aggregate="X")  # 1 … 61
    seed_events(engine, 1, aggregate="Y")  # 62
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET status = 'dead' WHERE id = 1"))
        conn.execute(text("SELECT id FROM outbox WHERE id BETWEEN 2 AND 61 FOR KEY SHARE"))
    locked = _xmax(engine, list(range(2, 62)))
    assert 0 not in locked
    assert [r.id for r in claim(engine, "A", batch=50, lease=30, ordered=True)] == [62]
    assert claim(engine, "A", batch=50, lease=30, ordered=True) == []
    assert _xmax(engine, list(range(2, 62))) == locked


def _claim_behind_a_claim_that_committed(engine: Engine, form: dict[str, Any]) -> tuple[list[int], bool]:
    """Dispatcher B's finalize-and-claim statement takes its snapshot, then waits for a row lock on the event
    it finalizes (held by C); meanwhile A claims events 2-11 and commits, C lets go, and B's claim walks past
    A's rows — pending in its snapshot, A's xid their xmax. B then stays open while A finalizes its 10
    (lock_timeout 200 ms). Returns B's claimed rows and whether A's finalize went through."""
    from sqlalchemy.exc import OperationalError

    seed_events(engine, 21)  # 1 … 21, each the head of its own aggregate
    lease = timedelta(seconds=30)
    with engine.begin() as conn:
        [x] = eng.claim(conn, OUTBOX, owner="B", batch=1, lease=lease, **form)
    claimed: list[int] = []
    b_pid: list[int] = []
    b_done, a_done = threading.Event(), threading.Event()

    def dispatcher_b() -> None:
        # (explicit transactions: the library's statements go to the driver, so a bare commit() would not
        # know one had begun)
        with engine.connect() as b:
            b_pid.append(b.execute(text("SELECT pg_backend_pid()")).scalar_one())
            b.commit()
            with b.begin():
                outcome = eng.Outcome(x[0], x[1], "done")
                _, rows = eng.finalize_and_claim(
                    b, OUTBOX, [outcome], owner="B", batch=10, lease=lease, **form
                )
                claimed.extend(r[0] for r in rows)
                b_done.set()
                a_done.wait(10)

    with engine.connect() as c, engine.connect() as a:
        c.execute(text("SELECT id FROM outbox WHERE id = :id FOR UPDATE"), {"id": x[0]})
        thread = threading.Thread(target=dispatcher_b)
        thread.start()
        try:
            waiting = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :pid"
            for _ in range(500):  # B's statement is past its snapshot, waiting for C's lock
                if b_pid and a.execute(text(waiting), {"pid": b_pid[0]}).scalar():
                    break
                a.rollback()
                time.sleep(0.01)
            else:
                raise AssertionError("B never waited for C's lock")
            a.rollback()
            with a.begin():
                taken = eng.claim(a, OUTBOX, owner="A", batch=10, lease=lease, **form)
            assert [r[0] for r in taken] == list(range(2, 12))
            c.commit()
            assert b_done.wait(10)
            try:
                with a.begin():
                    a.execute(text("SET LOCAL lock_timeout = '200ms'"))
                    applied = eng.finalize(a, OUTBOX, [eng.Outcome(r[0], r[1], "done") for r in taken])
                finalized = applied == set(range(2, 12))
            except OperationalError:
                finalized = False
        finally:
            a_done.set()
            thread.join(10)
    return claimed, finalized


@pytest.mark.parametrize("form", [{}, *FORMS.values()], ids=["plain", *FORMS])
def test_a_claim_does_not_lock_the_rows_another_claim_took_after_its_snapshot(
    engine: Engine, form: dict[str, Any]
) -> None:
    """Events claimed and committed by A after claim B's snapshot, before B reached them: B sees them
    pending, with A's xid as their xmax. B passes over them unlocked and claims the 10 after them, and A
    finalizes its 10 while B is still open. Locking them, B's row lock followed A's update to the newest
    version, locked it, found it no longer pending and held the lock until B committed: A's finalize waited
    on B (Lock transactionid; here, the lock timeout) — 28 % of the backends' active time with 4
    dispatchers draining 20,000 events."""
    claimed, finalized = _claim_behind_a_claim_that_committed(engine, form)
    assert claimed == list(range(12, 22))
    assert finalized
    assert ids_with_status(engine, "done") == list(range(1, 12))


@pytest.mark.parametrize("ordered", [False, True], ids=["plain", "ordered"])
def test_the_locking_form_claims_the_rows_the_settled_form_passes_over(engine: Engine, ordered: bool) -> None:
    """Rows whose xmax reads as a transaction in progress for the claim's snapshot although none holds them
    (here: a KEY SHARE lock that ended after the snapshot; for good, a MultiXact id just ahead of the xid
    counter — a hostile review's pg_resetwal'd cluster kept an event from a dispatcher for 65,000
    transactions): the settled form passes over them, the locking form (``settle=False``) takes them."""
    seed_events(engine, 3)  # 1, 2, 3: each the head of its own aggregate
    lease = timedelta(seconds=30)
    for settle, expected in ((True, [1]), (False, [1, 2, 3])):
        with engine.connect() as holder, engine.connect() as conn:
            holder.execute(text("SELECT id FROM outbox WHERE id IN (2, 3) FOR KEY SHARE"))
            conn.execution_options(isolation_level="REPEATABLE READ")
            conn.execute(text("SELECT 1"))  # the claim's snapshot: the lock's transaction is live
            holder.commit()
            rows = eng.claim(conn, OUTBOX, owner="A", batch=10, lease=lease, ordered=ordered, settle=settle)
            conn.rollback()
        assert [r[0] for r in rows] == expected, settle
        assert eng.passed_over(rows) is not settle  # (the locking form says it took such rows)


def _claim_forms(engine: Engine, monkeypatch: pytest.MonkeyPatch, events: int) -> list[tuple[bool, int]]:
    """(settle, rows) of each claim a dispatcher (batch 50) sends draining ``events`` until idle."""
    sent = claim_forms_sent(monkeypatch, "settle")
    got: list[int] = []
    claim_on = Dispatcher._claim_on

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        applied, rows = claim_on(self, *args, **kwargs)
        got.append(len(rows))
        return applied, rows

    monkeypatch.setattr(Dispatcher, "_claim_on", counted)
    seed_events(engine, events)
    d = dispatcher(engine, RecordingPublisher(), batch=50)
    assert drain(d) == events
    assert d.run_once() == 0  # (the next turn)
    return list(zip(sent, got, strict=True))


def test_a_dispatcher_claims_with_a_lock_after_a_short_claim_and_passes_over_after_a_full_one(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first claim locks; a full one is followed by the settled form; a short one by a locking claim,
    which is what finds the rows the settled form would pass over for good (a MultiXact id read as a live
    xid) when claims come back short or empty."""
    assert _claim_forms(engine, monkeypatch, 120) == [
        (False, 50),
        (True, 50),
        (True, 20),
        (False, 0),
        (False, 0),
    ]


def test_the_claim_after_one_that_found_nothing_locks(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A settled claim that finds nothing is followed at once by a locking one, which takes what the settled
    form passed over, before the turn says it found nothing (``run(until_idle=True)`` stops on that)."""
    assert _claim_forms(engine, monkeypatch, 50) == [(False, 50), (True, 0), (False, 0), (False, 0)]


def test_an_ordered_claim_does_not_probe_the_rows_another_claim_holds(engine: Engine) -> None:
    """A claim in progress holds the heads of 50 aggregates: a second ordered claim skips them at the lock and
    runs the predecessor test only on the 50 rows it takes. Testing before the lock, it tested the other
    claim's rows too (100 probes here; 68,530 for 20,000 events with 4 dispatchers, 3.4 per event)."""
    from .test_stale_statistics import analyzed, index_probes

    seed_events(engine, 100)  # 1 … 100, each the head of its own aggregate
    with engine.connect() as holder:
        held = eng.claim(holder, OUTBOX, owner="A", batch=50, lease=timedelta(seconds=30), ordered=True)
        assert [r[0] for r in held] == list(range(1, 51))
        plan, rows = analyzed(
            engine,
            _sql.claim_statement(OUTBOX, ordered=True, limit=50),
            {"owner": "B", "lease": timedelta(seconds=30)},
        )
        holder.rollback()
    assert sorted(r.id for r in rows) == list(range(51, 101))
    assert index_probes(plan) == 50


# --- the dispatcher's own guarantees ----------------------------------------------------------------------


def test_unclassified_exception_is_logged_recorded_and_retried(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    seed_events(engine, 1)
    d = dispatcher(engine, RecordingPublisher(fail=lambda m: KeyError("oops")))
    with caplog.at_level("ERROR", logger="sa_outbox.dispatcher"):
        assert d.run_once() == 1
    r = row(engine, "outbox", 1)
    assert (r.status, r.attempts, r.last_error) == ("pending", 1, "KeyError: 'oops'")
    assert any(rec.exc_info and "unclassified" in rec.getMessage() for rec in caplog.records)
    assert d.stats.unclassified == 1


def test_stop_on_unclassified_finalizes_then_raises(engine: Engine) -> None:
    seed_events(engine, 2)
    d = dispatcher(engine, RecordingPublisher(fail=lambda m: ZeroDivisionError("bug") if m.id == 1 else None),
                   stop_on_unclassified=True)  # fmt: skip
    with pytest.raises(ZeroDivisionError):
        d.run_once()
    assert row(engine, "outbox", 1).status == "pending" and row(engine, "outbox", 2).status == "done"


def test_publisher_returning_garbage_is_a_retryable_failure(engine: Engine) -> None:
    class Garbage:
        def publish(self, message: Message) -> Any:
            return "ok!"

    seed_events(engine, 1)
    dispatcher(engine, Garbage()).run_once()
    r = row(engine, "outbox", 1)
    assert r.status == "pending" and "publish() must return None" in r.last_error


def _count_engine_statements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every engine statement goes through sa_outbox.engine.run; record which ones are sent."""
    from sa_outbox import _steps as eng_module

    sent: list[str] = []
    real = eng_module.run

    def counting(conn: Any, stmt: Any, params: dict[str, Any], **options: Any) -> list[Any]:
        sent.append(
            str(stmt).split()[0]
            + (" finalize" if "ids" in params else "")
            + (" claim" if "batch" in params else "")
        )
        return real(conn, stmt, params, **options)

    monkeypatch.setattr(eng_module, "run", counting)
    return sent


def test_a_batch_is_rescue_claim_and_one_finalize_statement(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed_events(engine, 100)
    sent = _count_engine_statements(monkeypatch)
    pub = RecordingPublisher(fail=lambda m: RetryableError("x") if m.id % 3 == 0 else None)
    d = dispatcher(engine, pub, batch=50)
    assert d.run_once() == 50
    assert len(sent) == 4, sent  # the loop's first: its columns checked; then rescue, claim, one finalize
    assert statuses(engine) == {"done": 34, "pending": 66}
    sent.clear()
    assert d.run_once() == 50
    assert len(sent) == 3, sent  # rescue, claim, one fenced finalize for done + retry outcomes


def test_run_finalizes_each_batch_with_the_next_claim(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While run() loops, a batch costs one statement: the previous batch's finalize rides on the next claim."""
    seed_events(engine, 100)
    sent = _count_engine_statements(monkeypatch)
    d = dispatcher(engine, RecordingPublisher(), batch=10)
    d.run(install_signal_handlers=False, until_idle=True)
    assert statuses(engine) == {"done": 100}
    claims = [s for s in sent if "claim" in s]
    # 10 full batches, the empty (settled) claim that carried the last finalize, and the locking claim that
    # confirms nothing was passed over (ClaimForms.walk_before_nothing)
    assert len(claims) == 12
    assert len([s for s in sent if s.endswith("finalize")]) == 0  # no standalone finalize was needed
    assert d.stats.done == 100


def test_lease_budget_releases_the_rest_of_a_slow_batch(engine: Engine) -> None:
    seed_events(engine, 10)

    class Slow:
        def publish(self, message: Message) -> None:
            time.sleep(0.15)

    d = dispatcher(engine, Slow(), batch=10, lease=0.6, publish_timeout=0.3)
    assert d.run_once() == 10
    done, pending = ids_with_status(engine, "done"), ids_with_status(engine, "pending")
    assert 1 <= len(done) <= 3 and len(done) + len(pending) == 10
    with engine.connect() as conn:
        attempts = set(conn.execute(text("SELECT attempts FROM outbox WHERE status = 'pending'")).scalars())
    assert attempts == {0}  # released rows got their attempt back
    assert d.stats.released == len(pending)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lease": 10, "publish_timeout": 10}, "lease (10s) must be longer than publish_timeout (10s)"),
        ({"lease": 0}, "lease must be > 0"),
        ({"lease": -1}, "lease must be > 0"),
        ({"batch": 0}, "batch must be an integer >= 1"),
        ({"max_attempts": 0}, "max_attempts must be an integer >= 1"),
        ({"publish_timeout": "10s"}, "publish_timeout must be a datetime.timedelta or a number of seconds"),
        ({"ordered": "OrderPaid"}, "ordered must be True/False or a collection"),
        ({"poll_interval": float("nan")}, "poll_interval must be a finite duration"),
    ],
)
def test_invalid_options_are_refused(engine: Engine, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Dispatcher(engine, OutboxEvent, RecordingPublisher(), **kwargs)


def test_dispatcher_refuses_a_jobs_model_and_a_non_publisher(engine: Engine) -> None:
    with pytest.raises(ConfigurationError, match="needs an OutboxMixin model"):
        Dispatcher(engine, Job, RecordingPublisher())
    with pytest.raises(ConfigurationError, match="has no publish"):
        Dispatcher(engine, OutboxEvent, object())  # type: ignore[arg-type]


def test_hostile_strings_reach_sql_only_as_parameters(engine: Engine) -> None:
    hostile = "'); DROP TABLE outbox; --"
    seed_events(engine, 1, aggregate=hostile, event_type=hostile)
    pub = RecordingPublisher()
    drain(dispatcher(engine, pub, ordered=[hostile], owner=hostile))
    assert pub.messages[0].event_type == hostile and pub.messages[0].aggregate_id == hostile
    assert statuses(engine) == {"done": 1}


def test_skip_dead_unblocks_the_ordered_aggregate_and_retry_requeues(engine: Engine) -> None:
    from sa_outbox.admin import list_dead, retry_dead, skip_dead

    seed_events(engine, 2, aggregate="X")  # 1, 2
    seed_events(engine, 2, aggregate="Y", start=2)  # 3, 4
    pub = RecordingPublisher(fail=lambda m: PermanentError("bad") if m.id in (1, 3) else None)
    d = dispatcher(engine, pub, ordered=True)
    drain(d)
    assert ids_with_status(engine, "dead") == [1, 3] and ids_with_status(engine, "pending") == [2, 4]
    assert [r["id"] for r in list_dead(engine, OutboxEvent, aggregate_id="X")] == [1]
    assert skip_dead(engine, OutboxEvent, ids=[1], dry_run=True) == [1]
    assert ids_with_status(engine, "dead") == [1, 3]
    assert skip_dead(engine, OutboxEvent, ids=[1]) == [1]
    assert "skipped by operator" in row(engine, "outbox", 1).last_error
    drain(d)
    assert pub.ids == [2]  # X moved on; Y still blocked behind its dead head
    pub._fail = None
    assert retry_dead(engine, OutboxEvent, aggregate_id="Y") == [3]
    r = row(engine, "outbox", 3)
    assert (r.status, r.attempts) == ("pending", 0)
    drain(d)
    assert pub.ids == [2, 3, 4]


@pytest.mark.parametrize(("threshold", "expect_prepared"), [(None, False), (5, True)])
def test_prepared_statements_can_be_switched_off(
    db_url: Any, threshold: int | None, expect_prepared: bool
) -> None:
    """Behind PgBouncer in transaction mode: with prepare_threshold=None nothing is prepared server-side
    (one pooled connection, so the check sees the dispatcher's own session)."""
    from sqlalchemy import create_engine

    engine = create_engine(db_url, pool_size=1, max_overflow=0, connect_args={"prepare_threshold": threshold})
    try:
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE outbox RESTART IDENTITY"))
        seed_events(engine, 5)
        dispatcher(engine, RecordingPublisher()).run(install_signal_handlers=False, until_idle=True)
        with engine.connect() as conn:
            prepared = conn.execute(text("SELECT count(*) FROM pg_prepared_statements")).scalar_one()
        assert statuses(engine) == {"done": 5}
        assert (prepared > 0) is expect_prepared
    finally:
        engine.dispose()


def test_sql_observers_see_the_hot_path_statements(engine: Engine) -> None:
    """Claim and finalize skip SQLAlchemy's execute only while nobody observes the connection: a
    before_cursor_execute listener (tracing, SQL logging) sees every one of them."""
    from sqlalchemy import event

    from sa_outbox import _execute

    seed_events(engine, 5)
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        seen.append(statement)

    with engine.connect() as conn:
        assert not _execute._observed(conn)
    event.listen(engine, "before_cursor_execute", record)
    try:
        with engine.connect() as conn:
            assert _execute._observed(conn)
        assert dispatcher(engine, RecordingPublisher(), batch=5).run_once() == 5
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert any("FOR UPDATE SKIP LOCKED" in st for st in seen), seen
    assert any(st.lstrip().startswith("UPDATE") and "lease_version" in st for st in seen)
    assert statuses(engine) == {"done": 5}
