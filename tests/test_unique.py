"""Unique, idempotent and debounced enqueue; at most one running job per key (``unique_running``).

A unique key is held by the key's job that has not started yet (queued, never claimed): the partial unique
index ``ux_<jobs>_unique`` makes that race-free across processes, and ``INSERT … ON CONFLICT`` decides what
a second enqueue does — skip (nothing written), replace, or debounce (``run_at`` pushed, never past
``created_at + max_delay``). Running and retried jobs hold no key, so a job going back to ``queued`` never
meets a conflict; ``unique_running`` is the claim's own rule.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import multiprocessing
import os
import random
import threading
import time
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from sa_outbox import ClaimedJob, Enqueued, PayloadError, Worker, enqueue, enqueue_many
from sa_outbox import _steps as eng
from sa_outbox._names import channel_for
from sa_outbox.models import Job

from .conftest import count_rows
from .helpers import JOBS
from .test_producer import statement_log


def jobs(engine: Engine, where: str = "true") -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT id, task, queue, payload, priority, status, run_at, created_at, unique_key, xmin::text "
                    f"AS xmin, headers FROM jobs WHERE {where} ORDER BY id"
                )
            )
        )


def db_now(engine: Engine) -> dt.datetime:
    with engine.connect() as conn:
        return conn.execute(text("SELECT now()")).scalar_one()  # type: ignore[no-any-return]


def claim(
    engine: Engine, *, batch: int = 10, unique_running: bool = False, queue: str = "default"
) -> list[int]:
    with engine.begin() as conn:
        rows = eng.claim(conn, JOBS, owner="t", batch=batch, queue=queue, unique_running=unique_running)
    return [r[0] for r in rows]


def finish(engine: Engine, job_id: int, status: str = "done", delay: float | None = None) -> None:
    with engine.connect() as conn:
        version = conn.execute(
            text("SELECT lease_version FROM jobs WHERE id = :i"), {"i": job_id}
        ).scalar_one()
    with engine.begin() as conn:
        assert eng.finalize(conn, JOBS, [eng.Outcome(job_id, version, status, delay=delay)]) == {job_id}


# --- skip --------------------------------------------------------------------------------------------------


def test_skip_returns_the_queued_jobs_id_and_writes_nothing(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        first = enqueue(s, Job, "report", {"v": 1}, unique_key="report:7")
    assert first == Enqueued(id=1, inserted=True) and not first.found
    [before] = jobs(engine)
    with statement_log(engine) as seen, Session(engine) as s, s.begin():
        again = enqueue(s, Job, "report", {"v": 2}, unique_key="report:7", priority=9)
    assert again == Enqueued(id=1, inserted=False) and again.found
    assert len(seen) == 1  # one statement: the conflicting insert and the lookup of the queued job
    [after] = jobs(engine)
    assert after == before  # same payload, priority — and the same row version (xmin): nothing written
    assert after.payload == {"v": 1} and after.unique_key == "report:7"


def test_skip_is_the_default_when_a_key_is_given_and_sees_its_own_transactions_job(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        a = enqueue(s, Job, "t", {}, unique_key="k")
        b = enqueue(s, Job, "t", {"other": True}, unique_key="k")
        c = enqueue(s, Job, "t", {}, unique_key="another")
    assert (a.id, a.inserted, b.id, b.inserted, c.inserted) == (1, True, 1, False, True)
    assert count_rows(engine, "jobs") == 2


def test_keys_are_per_table_and_a_rolled_back_key_is_free_again(engine: Engine) -> None:
    with Session(engine) as s:
        enqueue(s, Job, "t", {}, unique_key="k")
        s.rollback()
    with Session(engine) as s, s.begin():
        again = enqueue(s, Job, "t", {}, unique_key="k")
    assert again.inserted and count_rows(engine, "jobs") == 1


def test_the_non_unique_path_still_returns_the_orm_object_written_at_flush(engine: Engine) -> None:
    with statement_log(engine) as seen, Session(engine, expire_on_commit=False) as s, s.begin():
        job = enqueue(s, Job, "t", {"n": 1})
        assert isinstance(job, Job) and seen == []  # no I/O until the flush
        s.flush()
    assert job.id == 1 and job.unique_key is None


# --- replace and debounce ------------------------------------------------------------------------------


def test_replace_updates_payload_run_at_and_priority_of_the_queued_job(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "sync", {"v": 1}, unique_key="sync:a", on_conflict="replace")
    later = db_now(engine) + dt.timedelta(hours=1)
    with Session(engine) as s, s.begin():
        got = enqueue(s, Job, "sync", {"v": 2}, unique_key="sync:a", on_conflict="replace", priority=5,
                      run_at=later, headers={"x-why": "again"})  # fmt: skip
    assert got == Enqueued(id=1, inserted=False)
    [row] = jobs(engine)
    assert (row.payload, row.priority, row.run_at, row.headers) == ({"v": 2}, 5, later, {"x-why": "again"})


@pytest.mark.parametrize("rule", ["replace", "debounce"])
def test_a_key_reused_for_another_task_and_queue_becomes_that_job(engine: Engine, rule: str) -> None:
    """The waiting job takes the call's task and queue with its payload: it kept the old task with the new
    payload before (a hostile review: task B's payload would run under task A's handler)."""
    extra: dict[str, Any] = {"debounce": 10} if rule == "debounce" else {}
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "export_csv", {"rows": 10}, unique_key="k", on_conflict=rule, **extra)
    with Session(engine) as s, s.begin():
        got = enqueue(
            s, Job, "export_pdf", {"pages": 3}, unique_key="k", on_conflict=rule, queue="pdf", **extra
        )
    assert got == Enqueued(id=1, inserted=False)
    [row] = jobs(engine)
    assert (row.task, row.queue, row.payload) == ("export_pdf", "pdf", {"pages": 3})


def test_debounce_pushes_run_at_but_never_past_created_at_plus_max_delay(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "t", {}, unique_key="other", on_conflict="debounce", debounce=60, max_delay=60)
    with Session(engine) as s, s.begin():
        first = enqueue(
            s, Job, "t", {"v": 1}, unique_key="d", on_conflict="debounce", debounce=10, max_delay=30
        )
    [row] = jobs(engine, "unique_key = 'd'")
    assert first.inserted and row.run_at - row.created_at == dt.timedelta(seconds=10)
    # 25 seconds later (the row's clock moved back instead of waiting): the next push would pass the cap
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE jobs SET created_at = created_at - interval '25 seconds' WHERE unique_key = 'd'")
        )
    with Session(engine) as s, s.begin():
        again = enqueue(
            s, Job, "t", {"v": 2}, unique_key="d", on_conflict="debounce", debounce=10, max_delay=30
        )
        now = s.execute(text("SELECT now()")).scalar_one()
    [row] = jobs(engine, "unique_key = 'd'")
    assert again == Enqueued(id=first.id, inserted=False)
    assert row.run_at == row.created_at + dt.timedelta(seconds=30) < now + dt.timedelta(seconds=10)
    assert row.payload == {"v": 2}  # the latest call's payload
    # well within the cap, a push moves run_at to now + debounce
    with engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET created_at = now(), run_at = now() WHERE unique_key = 'd'"))
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "t", {"v": 3}, unique_key="d", on_conflict="debounce", debounce=10, max_delay=30)
        now = s.execute(text("SELECT now()")).scalar_one()
    assert jobs(engine, "unique_key = 'd'")[0].run_at == now + dt.timedelta(seconds=10)


def test_a_debounce_never_pulls_the_waiting_job_earlier(engine: Engine) -> None:
    """now() is the calling transaction's start: a call from a transaction that began before the previous
    call's computed an earlier run_at and pulled the job forward, into the quiet period (a review: due in 4.99 s
    became 2.97 s). Here the waiting job is due in 20 s (as a later call left it); a push of 5 s keeps it."""
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "t", {"v": 1}, unique_key="d", on_conflict="debounce", debounce=5, max_delay=60)
    with engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET run_at = now() + interval '20 seconds' WHERE unique_key = 'd'"))
    [before] = jobs(engine, "unique_key = 'd'")
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "t", {"v": 2}, unique_key="d", on_conflict="debounce", debounce=5, max_delay=60)
    [after] = jobs(engine, "unique_key = 'd'")
    assert after.run_at == before.run_at and after.payload == {"v": 2}


def test_an_overdue_debounced_job_is_not_pushed_back(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "t", {}, unique_key="d", on_conflict="debounce", debounce=1, max_delay=3)
    with engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET created_at = now() - interval '1 minute'"))
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "t", {}, unique_key="d", on_conflict="debounce", debounce=1, max_delay=3)
    assert count_rows(engine, "jobs", "run_at <= now()") == 1  # due: traffic cannot postpone it


def test_debounce_without_max_delay_is_capped_at_ten_debounces(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "t", {}, unique_key="d", on_conflict="debounce", debounce=2)
    with engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET created_at = created_at - interval '19 seconds'"))
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "t", {}, unique_key="d", on_conflict="debounce", debounce=2)
    [row] = jobs(engine)
    assert row.run_at == row.created_at + dt.timedelta(seconds=20)


# --- the key belongs to the job that has not started --------------------------------------------------


def test_a_claimed_job_releases_its_key_and_its_retry_never_conflicts(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        first = enqueue(s, Job, "t", {"n": 1}, unique_key="k")
    assert claim(engine) == [first.id]
    with Session(engine) as s, s.begin():
        second = enqueue(s, Job, "t", {"n": 2}, unique_key="k")
    assert second.inserted and second.id != first.id
    finish(engine, first.id, "queued", delay=3600)  # the running job is retried: queued again, same key
    finish_at = jobs(engine, f"id = {first.id}")[0]
    assert finish_at.status == "queued"
    with Session(engine) as s, s.begin():  # the key is the new job's, not the retried one's
        third = enqueue(s, Job, "t", {"n": 3}, unique_key="k")
    assert third == Enqueued(id=second.id, inserted=False)
    assert count_rows(engine, "jobs", "status = 'queued' AND unique_key = 'k'") == 2


# --- validation and wake-ups ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"unique_key": ""}, "unique_key must be a non-empty string"),
        ({"unique_key": "   "}, "unique_key must be a non-empty string"),
        ({"unique_key": "k", "on_conflict": "merge"}, "on_conflict must be one of"),
        ({"on_conflict": "replace"}, "on_conflict='replace' needs a unique_key"),
        ({"debounce": 1}, "debounce= needs a unique_key"),
        ({"unique_key": "k", "on_conflict": "debounce"}, "needs debounce="),
        ({"unique_key": "k", "debounce": 1}, "debounce= is for on_conflict='debounce'"),
        (
            {"unique_key": "k", "on_conflict": "debounce", "debounce": 5, "max_delay": 2},
            "max_delay .* at least",
        ),
        ({"unique_key": "k", "on_conflict": "debounce", "debounce": 0}, "debounce"),
        ({"unique_key": "k", "on_conflict": "debounce", "debounce": 1, "run_at": 5}, "run_at"),
        ({"unique_key": "k", "max_delay": 5}, "max_delay= is for on_conflict='debounce'"),
        ({"unique_key": "k", "priority": 2**31}, "priority must be between"),
        ({"unique_key": "k", "run_at": dt.datetime(2030, 1, 1)}, "timezone-aware"),
        ({"unique_key": "x" * 3000}, r"unique_key is 3000 bytes.*_jobs_unique"),
    ],
)
def test_bad_unique_options_are_refused_before_any_sql(
    engine: Engine, options: dict[str, Any], message: str
) -> None:
    with statement_log(engine) as seen, Session(engine) as s:
        with pytest.raises(PayloadError, match=message):
            enqueue(s, Job, "t", {}, **options)
        with pytest.raises(PayloadError, match="payload"):
            enqueue(s, Job, "t", {"x": object()}, unique_key="k")
    assert seen == []
    assert count_rows(engine, "jobs") == 0


def test_unique_enqueue_wakes_its_queue_once_per_committed_transaction(engine: Engine) -> None:
    import psycopg

    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel_for("jobs"))))
        with Session(engine) as s, s.begin():
            enqueue(s, Job, "t", {}, unique_key="a", queue="mail")
            enqueue(s, Job, "t", {}, unique_key="b", queue="mail")
            enqueue(s, Job, "t", {}, queue="mail")
            enqueue(s, Job, "t", {}, unique_key="c")
        got = sorted((n.channel, n.payload) for n in listener.notifies(timeout=0.5))
        assert got == [("sa_outbox.jobs", "default"), ("sa_outbox.jobs", "mail")]
        with Session(engine) as s:
            enqueue(s, Job, "t", {}, unique_key="d", queue="mail")
            s.rollback()
        assert [n for n in listener.notifies(timeout=0.3)] == []
    assert count_rows(engine, "jobs", "unique_key = 'd'") == 0


def test_async_session_awaits_a_unique_enqueue(engine: Engine, async_url: URL) -> None:
    async def main() -> tuple[Enqueued, Enqueued, int]:
        aengine = create_async_engine(async_url)
        try:
            async with AsyncSession(aengine) as s, s.begin():
                a = await enqueue(s, Job, "t", {"n": 1}, unique_key="k", on_conflict="replace")
                b = await enqueue(s, Job, "t", {"n": 2}, unique_key="k", on_conflict="replace")
                plain = enqueue(s, Job, "t", {})  # the ORM path: no await, written at flush
                await s.flush()
                return a, b, plain.id
        finally:
            await aengine.dispose()

    a, b, plain_id = asyncio.run(main())
    assert a == Enqueued(1, True) and b == Enqueued(1, False) and plain_id > 1  # (a conflict spends an id)
    assert jobs(engine, "id = 1")[0].payload == {"n": 2}


# --- concurrency: real processes ----------------------------------------------------------------------

KEYS = [f"key-{i}" for i in range(40)]


def _enqueue_keys(url: str, seed: int, rounds: int, out: Any) -> None:  # pragma: no cover - child process
    """Enqueue every key ``rounds`` times in a random order, one key per transaction or a whole batch at
    once, with every conflict rule; report (key, id, inserted) of each call."""
    rng = random.Random(seed)
    engine = create_engine(url, pool_size=1)
    seen: list[tuple[str, int, bool]] = []
    error = None
    try:
        for r in range(rounds):
            keys = KEYS[:]
            rng.shuffle(keys)
            mode = ("skip", "replace", "debounce")[(seed + r) % 3]
            extra: dict[str, Any] = {"debounce": 60, "max_delay": 600} if mode == "debounce" else {}
            if r % 2:
                with Session(engine) as s, s.begin():
                    ids = enqueue_many(
                        s, Job, [{"task": "t", "payload": {"p": seed}, "unique_key": k, "on_conflict": mode,
                                  **extra} for k in keys],
                    )  # fmt: skip
                seen += [(k, i, False) for k, i in zip(keys, ids, strict=True)]
            else:
                for k in keys:
                    with Session(engine) as s, s.begin():
                        got = enqueue(s, Job, "t", {"p": seed}, unique_key=k, on_conflict=mode, **extra)
                    seen.append((k, got.id, got.inserted))
    except Exception as exc:
        error = repr(exc)
    finally:
        engine.dispose()
        out.put((error, seen))


def test_eight_processes_enqueueing_the_same_keys_leave_exactly_one_queued_job_per_key(
    engine: Engine, db_url: URL
) -> None:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    url = db_url.render_as_string(hide_password=False)
    procs = [ctx.Process(target=_enqueue_keys, args=(url, seed, 4, out)) for seed in range(8)]
    for p in procs:
        p.start()
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(60)
    assert [error for error, _ in results if error] == []
    with engine.connect() as conn:
        rows = dict(conn.execute(text("SELECT unique_key, id FROM jobs WHERE status = 'queued'")).all())  # type: ignore[arg-type]
    assert sorted(rows) == sorted(KEYS) and count_rows(engine, "jobs") == len(KEYS)
    calls = [c for _, seen in results for c in seen]
    assert len(calls) == 8 * 4 * len(KEYS)
    assert all(rows[k] == i for k, i, _ in calls)  # every call was given the key's one job
    assert sum(1 for _, _, inserted in calls if inserted) <= len(KEYS)


def _debounced_producer(url: str, seconds: float, out: Any) -> None:  # pragma: no cover - child process
    engine = create_engine(url, pool_size=1)
    calls: int | str = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            with Session(engine) as s, s.begin():
                enqueue(s, Job, "rebuild", {}, unique_key="rebuild", on_conflict="debounce", debounce=1,
                        max_delay=3)  # fmt: skip
            calls = int(calls) + 1
            time.sleep(0.1)
    except Exception as exc:
        calls = repr(exc)
    finally:
        engine.dispose()
        out.put(calls)


def test_a_key_debounced_under_constant_traffic_still_runs_at_least_every_max_delay(
    engine: Engine, db_url: URL
) -> None:
    """A producer process enqueues the key every 100 ms for 8 s, debounce 1 s, max delay 3 s; a real worker
    runs the jobs. Debounce alone would never let it run; the cap makes it run every 3 s."""
    ran: list[int] = []
    worker = Worker(engine, Job, {"rebuild": lambda job: ran.append(job.id)}, poll_interval=0.05)
    loop = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    loop.start()
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    producer = ctx.Process(
        target=_debounced_producer, args=(db_url.render_as_string(hide_password=False), 8, out)
    )
    try:
        producer.start()
        calls = out.get(timeout=60)
        producer.join(30)
        deadline = time.monotonic() + 10
        while count_rows(engine, "jobs", "status <> 'done'") and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        worker.stop()
        loop.join(30)
        worker.close()
    assert isinstance(calls, int) and calls >= 40, calls
    done = jobs(engine, "status = 'done'")
    assert len(done) == len(ran) == count_rows(engine, "jobs") and len(done) >= 3
    # every job but the last was capped: due exactly max_delay after it was first enqueued
    assert all(j.run_at == j.created_at + dt.timedelta(seconds=3) for j in done[:-1]), done
    # … and ran then: started (database clock) within a second of its due time
    with engine.connect() as conn:
        late = conn.execute(text("SELECT max(finished_at - run_at) FROM jobs")).scalar_one()
    assert late < dt.timedelta(seconds=1.5)
    # one job per window: each window opens when the previous job was claimed
    starts = [j.created_at for j in done]
    assert all(b - a <= dt.timedelta(seconds=4) for a, b in itertools.pairwise(starts))


# --- unique_running: one running job per key --------------------------------------------------------------


def _seed_keyed(engine: Engine, *rows: tuple[str, int]) -> None:
    """Queued jobs (key, lease_version): lease_version ≥ 1 is a job that ran before (a retry), which holds no
    key, so several may be queued with one key."""
    with engine.begin() as conn:
        for key, version in rows:
            conn.execute(
                text(
                    "INSERT INTO jobs (task, payload, unique_key, lease_version) VALUES ('t', '{}', :k, :v)"
                ),
                {"k": key, "v": version},
            )


def test_unique_running_never_claims_a_key_that_is_running(engine: Engine) -> None:
    _seed_keyed(engine, ("a", 1), ("a", 0), ("b", 0))
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO jobs (task, payload) VALUES ('t', '{}')"))  # no key: never blocked
    assert claim(engine, batch=1, unique_running=True) == [1]  # a's oldest
    assert claim(engine, unique_running=True) == [3, 4]  # a is running: its second job waits
    assert claim(engine, unique_running=True) == []
    finish(engine, 1)
    assert claim(engine, unique_running=True) == [2]
    # the plain claim does not look
    _seed_keyed(engine, ("b", 1))
    assert claim(engine) == [5]


def test_unique_running_takes_one_job_per_key_per_claim_oldest_first(engine: Engine) -> None:
    _seed_keyed(engine, ("a", 2), ("a", 1), ("a", 0), ("b", 1), ("b", 0))
    assert claim(engine, unique_running=True) == [1, 4]
    finish(engine, 1)
    finish(engine, 4)
    assert claim(engine, unique_running=True) == [2, 5]


def test_unique_running_across_two_open_claims(engine: Engine) -> None:
    """Two claimers at once (the first has not committed): the second skips the first's row and does not take
    the key's next job either, since an older job of the key is still queued in its snapshot."""
    _seed_keyed(engine, ("a", 1), ("a", 0))
    with engine.connect() as first:
        first.begin()
        got = eng.claim(first, JOBS, owner="1", batch=1, queue="default", unique_running=True)
        assert [r[0] for r in got] == [1]
        assert claim(engine, unique_running=True) == []
        first.commit()
    assert claim(engine, unique_running=True) == []


def test_unique_running_walks_past_replaced_jobs_without_locking_them(engine: Engine) -> None:
    """Jobs replaced by ``on_conflict="replace"`` carry the updater's xid in their xmax (ON CONFLICT's update
    leaves it there): while their keys' retries run, claims turn them down without locking them — their xmax
    stays the updater's, claim after claim — and once a retry is done its key's job is claimed. (Locking every
    row with an xmax before testing it locked each such job on every claim and left the claim's own xid for
    the next one: a reviewer's script, 2,040 WAL records per claim against 40 with 2,000 of them.)"""
    keys = [f"sync:{i}" for i in range(20)]
    _seed_keyed(engine, *[(key, 1) for key in keys])  # 1 … 20: a retry of each key (holds no key)
    assert claim(engine, batch=20, unique_running=True) == list(range(1, 21))
    for v in (1, 2):
        with Session(engine) as s, s.begin():
            for key in keys:
                enqueue(s, Job, "sync", {"v": v}, unique_key=key, on_conflict="replace")
    xmax = text("SELECT xmax::text::bigint FROM jobs WHERE id > 20 ORDER BY id")
    with engine.connect() as conn:
        replaced = list(conn.execute(xmax).scalars())
    assert len(replaced) == 20 and 0 not in replaced
    for _ in range(2):
        assert claim(engine, unique_running=True) == []
    with engine.connect() as conn:
        assert list(conn.execute(xmax).scalars()) == replaced
    finish(engine, 1)
    assert claim(engine, unique_running=True) == [21]


def test_unique_running_holds_while_other_transactions_lock_the_waiting_jobs(engine: Engine) -> None:
    """300 keys, each with a running job and a queued one behind it; two sessions keep taking FOR KEY SHARE on
    the queued jobs (what a foreign key into ``jobs`` does) while a claimer loops for 8 s: no queued job may
    start. A locker writes xmax in place, so it can change between two reads of one row in one claim: when
    the claim skipped the key test because it read a live locker and then read "not live" (a MultiXact id) for
    the row's place above the lock, the job went through untested — 32 in 30 s on this machine."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO jobs (task, payload, unique_key, status, locked_at, lease_version) "
                "SELECT 't', '{}', 'k' || g, 'running', now(), 1 FROM generate_series(1, 300) g"
            )
        )
        conn.execute(
            text(
                "INSERT INTO jobs (task, payload, unique_key, run_at) "
                "SELECT 't', '{}', 'k' || g, now() - interval '1 minute' FROM generate_series(1, 300) g"
            )
        )
    stop = time.monotonic() + 8
    claimed: list[int] = []
    errors: list[BaseException] = []

    def locker(seed: int) -> None:
        rnd = random.Random(seed)
        try:
            with engine.connect() as conn:
                while time.monotonic() < stop:
                    conn.execute(
                        text(
                            "SELECT count(*) FROM (SELECT 1 FROM jobs WHERE status = 'queued' FOR KEY SHARE) s"
                        )
                    )
                    time.sleep(rnd.random() * 0.004)
                    conn.commit()
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    def claimer() -> None:
        try:
            while time.monotonic() < stop:
                claimed.extend(claim(engine, batch=10, unique_running=True))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=locker, args=(i,)) for i in range(2)] + [
        threading.Thread(target=claimer)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert claimed == []
    assert [r.status for r in jobs(engine, "id > 300")] == ["queued"] * 300


def test_a_unique_running_claim_does_not_probe_the_jobs_another_claim_holds(engine: Engine) -> None:
    """A claim in progress holds 50 jobs of 50 keys: a second unique_running claim skips them at the lock and
    looks up only the keys of the 50 jobs it takes (two lookups each). Looking before the lock, it looked up
    the other claim's keys too (200 lookups here)."""
    from sa_outbox import _sql

    from .test_stale_statistics import analyzed, index_probes

    _seed_keyed(engine, *[(f"k{i}", 0) for i in range(100)])  # 1 … 100
    with engine.connect() as holder:
        held = eng.claim(holder, JOBS, owner="A", batch=50, queue="default", unique_running=True)
        assert [r[0] for r in held] == list(range(1, 51))
        plan, rows = analyzed(
            engine,
            _sql.claim_statement(JOBS, limit=50, unique_running=True),
            {"owner": "B", "queue_name": "default"},
        )
        holder.rollback()
    assert sorted(r.id for r in rows) == list(range(51, 101))
    assert index_probes(plan) == 2 * 50


def test_unique_running_refuses_the_outbox() -> None:
    from sa_outbox import _sql
    from sa_outbox.models import OutboxEvent

    with pytest.raises(ValueError, match="jobs"):
        _sql.claim_statement(_sql.spec_for(OutboxEvent), unique_running=True)


def _claim_and_probe(url: str, seconds: float, out: Any) -> None:  # pragma: no cover - child process
    """Claim with unique_running, batch 4; for each job hold its key in a probe table (primary key: a second
    holder fails) for a few ms, then finish it. Reports (jobs run, probe conflicts)."""
    engine = create_engine(url, pool_size=2)
    ran = conflicts = 0
    deadline = time.monotonic() + seconds
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        while time.monotonic() < deadline:
            rows = eng.claim(
                conn, JOBS, owner=str(os.getpid()), batch=4, queue="default", unique_running=True
            )
            if not rows:
                time.sleep(0.005)
                continue
            jobs_ = [ClaimedJob.from_row(r) for r in rows]
            keys = dict(
                conn.execute(
                    text("SELECT id, unique_key FROM jobs WHERE id = ANY(:i)"), {"i": [j.id for j in jobs_]}
                ).all()  # type: ignore[arg-type]
            )
            for j in jobs_:
                try:
                    conn.execute(text("INSERT INTO running_keys (k) VALUES (:k)"), {"k": keys[j.id]})
                except Exception:
                    conflicts += 1
                    continue
                time.sleep(0.002)
                conn.execute(text("DELETE FROM running_keys WHERE k = :k"), {"k": keys[j.id]})
            eng.finalize(conn, JOBS, [eng.Outcome(j.id, j.lease_version, "done") for j in jobs_])
            ran += len(jobs_)
    engine.dispose()
    out.put((ran, conflicts))


def test_unique_running_four_processes_never_run_one_key_twice_at_once(engine: Engine, db_url: URL) -> None:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS running_keys (k text PRIMARY KEY)"))
        conn.execute(text("TRUNCATE running_keys"))
        # 10 keys × 30 jobs, as retries (lease_version 1) so that a key may have many queued jobs
        conn.execute(
            text(
                "INSERT INTO jobs (task, payload, unique_key, lease_version) "
                "SELECT 't', '{}', 'k' || (g % 10), 1 FROM generate_series(1, 300) g"
            )
        )
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    url = db_url.render_as_string(hide_password=False)
    procs = [ctx.Process(target=_claim_and_probe, args=(url, 6.0, out)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert sum(c for _, c in results) == 0
    assert sum(r for r, _ in results) == count_rows(engine, "jobs", "status = 'done'") > 30


def test_a_worker_with_unique_running_waits_for_a_keys_running_job(engine: Engine) -> None:
    """``Worker(…, unique_running=True)``: while one job of key a runs (another worker holds it), the worker
    runs b's job and leaves a's second job queued; once a's job is done it runs that one too. Without the
    option the worker runs both of a's jobs at once. Combined with ``limits`` it is refused."""
    from sa_outbox import ConfigurationError, Limit, Worker

    _seed_keyed(engine, ("a", 1), ("a", 1), ("b", 0))
    assert claim(engine, batch=1) == [1]  # a's first job: running elsewhere
    ran: list[int] = []
    w = Worker(engine, Job, {"t": lambda j: ran.append(j.id)}, unique_running=True, listen=False)
    try:
        assert w.run_once() == 1 and ran == [3]
        finish(engine, 1)
        assert w.run_once() == 1 and ran == [3, 2]
    finally:
        w.close()
    _seed_keyed(engine, ("a", 1), ("a", 1))
    assert claim(engine, batch=1) == [4]
    plain = Worker(engine, Job, {"t": lambda j: ran.append(j.id)}, listen=False)
    assert plain.run_once() == 1 and ran[-1] == 5  # a's second job, while its first still runs
    plain.close()
    with pytest.raises(ConfigurationError, match="Limit\\(1, per_key=True\\)"):
        Worker(engine, Job, {}, unique_running=True, limits={"default": Limit(2)})


def test_non_ascii_keys_under_every_rule_in_a_database_that_is_not_utf8(server_url: URL) -> None:
    """The skip keys' and the debounce caps' JSON objects keep a key's characters as they are: a SQL_ASCII
    database refuses a ``\\uXXXX`` escape of a non-ASCII character in jsonb, so a skip key "é" beside a replace
    row failed there (a review), and so did any non-ASCII debounce key — the keys themselves, sent as text,
    are taken. The same call in a LATIN1 database."""
    from sa_outbox.models import Base

    from .conftest import scratch_database

    for encoding in ("SQL_ASCII", "LATIN1"):
        admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
        with scratch_database(server_url, "sa_outbox_enc") as url:
            name = url.database
            with admin.connect() as conn:  # the same database again, in this encoding
                conn.execute(text(f'DROP DATABASE "{name}"'))
                conn.execute(text(f"CREATE DATABASE \"{name}\" ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' "
                                  "TEMPLATE template0"))  # fmt: skip
            admin.dispose()
            engine = create_engine(url, connect_args={"client_encoding": "utf8"})
            try:
                Base.metadata.create_all(engine)
                items: list[Any] = [
                    {"task": "t", "payload": {}, "unique_key": "é-skip", "on_conflict": "skip"},
                    {"task": "t", "payload": {}, "unique_key": "é-replace", "on_conflict": "replace"},
                    {
                        "task": "t",
                        "payload": {},
                        "unique_key": "é-debounce",
                        "on_conflict": "debounce",
                        "debounce": 5,
                    },
                ]
                calls = []
                for _ in range(2):  # the second call meets each key's waiting job
                    with Session(engine) as s, s.begin():
                        calls.append(enqueue_many(s, Job, items))
                assert calls[0] == calls[1] and sorted(calls[0]) == [1, 2, 3], (encoding, calls)
                with engine.connect() as conn:
                    keys = dict(conn.execute(text("SELECT id, unique_key FROM jobs")).all())
                assert [keys[i] for i in calls[0]] == [item["unique_key"] for item in items], (encoding, keys)
            finally:
                engine.dispose()
