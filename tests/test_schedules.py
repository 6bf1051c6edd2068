"""Cron schedules: declared in code, synced to a table, fired by any number of processes — each slot exactly
once, also when a process is killed between reading a due schedule and firing it.

Most tests move the database clock instead of waiting (``now=``, the River way: ``coalesce(:now, now())``);
the process tests run on the real clock with a schedule that fires every second.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from sa_outbox import (
    ConfigurationError,
    PayloadError,
    Schedule,
    Worker,
    _schedules,
    fire_due_schedules,
    pause_schedule,
    resume_schedule,
    run_schedule_now,
    sync_schedules,
)
from sa_outbox._cli import main
from sa_outbox.models import Job, JobSchedule

from .conftest import count_rows
from .test_producer import statement_log


def at(iso: str) -> dt.datetime:
    return dt.datetime.fromisoformat(iso)


@pytest.fixture
def db(engine: Engine) -> Iterator[Engine]:
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE schedules"))
    yield engine


def schedule_row(engine: Engine, name: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(text("SELECT * FROM schedules WHERE name = :n"), {"n": name}).one()


def fired(engine: Engine, where: str = "true") -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT id, task, queue, payload, priority, max_attempts, unique_key, run_at, headers "
                    f"FROM jobs WHERE {where} ORDER BY run_at, id"
                )
            )
        )


def fire(engine: Engine, now: str | dt.datetime | None = None, **kw: Any) -> int:
    when = at(now) if isinstance(now, str) else now
    return fire_due_schedules(engine, JobSchedule, Job, now=when, **kw)


# --- declaring schedules -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (("", "* * * * *"), {"task": "t"}, ConfigurationError, "name"),
        (("n", "61 * * * *"), {"task": "t"}, ConfigurationError, r"cron expression '61 \* \* \* \*'.*minute"),
        (("n", "* * *"), {"task": "t"}, ConfigurationError, "cron expression"),
        (("n", "0 0 30 2 *"), {"task": "t"}, ConfigurationError, "cron expression"),
        (("n", "* * * * *"), {"task": ""}, ConfigurationError, "task"),
        (
            ("n", "* * * * *"),
            {"task": "t", "tz": "Mars/Olympus"},
            ConfigurationError,
            "time zone 'Mars/Olympus'",
        ),
        (("n", "* * * * *"), {"task": "t", "catch_up": "some"}, ConfigurationError, "catch_up"),
        (("n", "* * * * *"), {"task": "t", "queue": ""}, ConfigurationError, "queue"),
        (("n", "* * * * *"), {"task": "t", "priority": 2**40}, ConfigurationError, "priority"),
        (("n", "* * * * *"), {"task": "t", "max_attempts": 0}, ConfigurationError, "max_attempts"),
        (("n", "* * * * *"), {"task": "t", "payload": {"x": object()}}, PayloadError, "payload"),
        (("n" * 300, "* * * * *"), {"task": "t"}, ConfigurationError, "name"),
    ],
)
def test_a_schedule_is_checked_when_it_is_declared(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Schedule(*args, **kwargs)


def test_sync_creates_each_schedule_due_at_its_next_slot(db: Engine) -> None:
    nightly = Schedule("nightly-report", "0 3 * * *", task="report", tz="Europe/Berlin", payload={"k": 1},
                       queue="reports", priority=2, max_attempts=4)  # fmt: skip
    changed = sync_schedules(db, JobSchedule, [nightly], now=at("2024-06-01T12:00:00+00:00"))
    assert changed == ["nightly-report"]
    row = schedule_row(db, "nightly-report")
    assert row.next_run_at == at("2024-06-02T01:00:00+00:00")  # 03:00 in Berlin (CEST)
    assert (row.cron, row.timezone, row.task, row.payload, row.queue, row.priority, row.max_attempts) == (
        "0 3 * * *", "Europe/Berlin", "report", {"k": 1}, "reports", 2, 4,
    )  # fmt: skip
    assert (row.paused, row.catch_up, row.last_run_at) == (False, "latest", None)


def test_sync_again_keeps_the_next_slot_and_a_pause_and_a_new_cron_moves_the_slot(db: Engine) -> None:
    s = Schedule("s", "0 * * * *", task="t")
    sync_schedules(db, JobSchedule, [s], now=at("2024-06-01T12:10:00+00:00"))
    pause_schedule(db, JobSchedule, "s")
    assert sync_schedules(db, JobSchedule, [s], now=at("2024-06-01T12:40:00+00:00")) == []
    row = schedule_row(db, "s")
    assert row.next_run_at == at("2024-06-01T13:00:00+00:00") and row.paused
    moved = Schedule("s", "*/15 * * * *", task="t2", payload={"v": 2})
    assert sync_schedules(db, JobSchedule, [moved], now=at("2024-06-01T12:40:00+00:00")) == ["s"]
    row = schedule_row(db, "s")
    assert (row.next_run_at, row.task, row.payload, row.paused) == (
        at("2024-06-01T12:45:00+00:00"), "t2", {"v": 2}, True,
    )  # fmt: skip


def test_a_new_cron_synced_with_a_clock_before_the_last_fired_slot_never_fires_that_slot_again(
    db: Engine,
) -> None:
    """A deploy's transaction that began before a slot syncs a changed cron after a worker fired that slot: the
    schedule moves to the first slot after the fired one, not after the transaction's clock (a hostile review:
    the slot fired twice, a second job with the same slot key)."""
    sync_schedules(
        db, JobSchedule, [Schedule("rep", "*/2 * * * * *", task="rep")], now=at("2024-06-01T12:00:01+00:00")
    )
    assert fire(db, "2024-06-01T12:00:02.5+00:00") == 1  # the 12:00:02 slot
    every_second = Schedule("rep", "* * * * * *", task="rep")
    assert sync_schedules(db, JobSchedule, [every_second], now=at("2024-06-01T12:00:01.5+00:00")) == ["rep"]
    assert schedule_row(db, "rep").next_run_at == at("2024-06-01T12:00:03+00:00")
    fire(db, "2024-06-01T12:00:03.5+00:00")
    keys = [r.unique_key for r in fired(db)]
    assert len(keys) == len(set(keys)) == 2, keys


def test_sync_with_prune_deletes_schedules_no_longer_declared(db: Engine) -> None:
    a, b = Schedule("a", "* * * * *", task="t"), Schedule("b", "* * * * *", task="t")
    sync_schedules(db, JobSchedule, [a, b])
    sync_schedules(db, JobSchedule, [a])
    assert count_rows(db, "schedules") == 2  # kept: a schedule may have been added at run time
    sync_schedules(db, JobSchedule, [a], prune=True)
    with db.connect() as conn:
        assert conn.execute(text("SELECT name FROM schedules")).scalars().all() == ["a"]


def test_sync_refuses_two_schedules_with_one_name_before_any_sql(db: Engine) -> None:
    with statement_log(db) as seen, pytest.raises(ConfigurationError, match="twice"):
        sync_schedules(
            db, JobSchedule, [Schedule("a", "* * * * *", task="t"), Schedule("a", "0 * * * *", task="t")]
        )
    assert seen == []


# --- firing -------------------------------------------------------------------------------------------


def test_a_due_schedule_fires_one_job_for_its_slot_and_moves_on(db: Engine) -> None:
    sync_schedules(
        db, JobSchedule,
        [Schedule("nightly", "0 3 * * *", task="report", payload={"r": 1}, queue="reports", priority=2,
                  max_attempts=4, tz="Europe/Berlin")],
        now=at("2024-06-01T12:00:00+00:00"),
    )  # fmt: skip
    assert fire(db, "2024-06-02T00:59:59+00:00") == 0
    assert fire(db, "2024-06-02T01:00:00+00:00") == 1  # exactly at its slot
    [job] = fired(db)
    slot = at("2024-06-02T01:00:00+00:00")
    assert (job.task, job.queue, job.payload, job.priority, job.max_attempts, job.run_at) == (
        "report", "reports", {"r": 1}, 2, 4, slot,
    )  # fmt: skip
    assert job.unique_key == "schedule:nightly:2024-06-02T01:00:00Z"
    assert job.headers == {"x-schedule": "nightly", "x-schedule-slot": "2024-06-02T01:00:00Z"}
    row = schedule_row(db, "nightly")
    assert (row.last_run_at, row.next_run_at) == (slot, at("2024-06-03T01:00:00+00:00"))
    assert fire(db, "2024-06-02T01:00:02+00:00") == 0  # the slot is spent


def test_catch_up_after_downtime_latest_all_and_none(db: Engine) -> None:
    sync_schedules(
        db, JobSchedule,
        [Schedule(policy, "*/10 * * * *", task=policy, catch_up=policy) for policy in ("latest", "all", "none")],
        now=at("2024-06-01T12:00:00+00:00"),
    )  # fmt: skip
    # down from 12:00 to 13:05: six slots missed (12:10 … 13:00)
    assert fire(db, "2024-06-01T13:05:00+00:00") == 1 + 6 + 0
    slots = {
        t: [j.run_at.strftime("%H:%M") for j in fired(db, f"task = '{t}'")] for t in ("latest", "all", "none")
    }
    assert slots == {
        "latest": ["13:00"],  # the most recent missed slot, once
        "all": ["12:10", "12:20", "12:30", "12:40", "12:50", "13:00"],
        "none": [],  # more than a minute late: skipped
    }
    with db.connect() as conn:
        nexts = set(conn.execute(text("SELECT next_run_at FROM schedules")).scalars())
    assert nexts == {at("2024-06-01T13:10:00+00:00")}
    # on time (within a minute of its slot), "none" fires too
    assert fire(db, "2024-06-01T13:10:30+00:00") == 3


def test_catch_up_all_is_bounded(db: Engine) -> None:
    sync_schedules(db, JobSchedule, [Schedule("m", "* * * * *", task="t", catch_up="all")],
                   now=at("2024-06-01T00:00:30+00:00"))  # fmt: skip
    assert fire(db, "2024-06-01T05:00:30+00:00") == _schedules.CATCH_UP_LIMIT  # 300 missed, the newest 100
    runs = [j.run_at for j in fired(db)]
    assert runs[0] == at("2024-06-01T03:21:00+00:00") and runs[-1] == at("2024-06-01T05:00:00+00:00")
    assert schedule_row(db, "m").next_run_at == at("2024-06-01T05:01:00+00:00")


def test_daylight_saving_spring_forward_runs_the_missing_time_once_right_after_the_jump(db: Engine) -> None:
    """Berlin, 31 March 2024: 02:00 CET jumps to 03:00 CEST. A daily 02:30 runs at 03:00 CEST that day (01:00
    UTC), once; an hourly :30 job keeps running every real hour."""
    sync_schedules(db, JobSchedule, [Schedule("daily", "30 2 * * *", task="d", tz="Europe/Berlin"),
                                     Schedule("hourly", "30 * * * *", task="h", tz="Europe/Berlin")],
                   now=at("2024-03-30T22:00:00+00:00"))  # fmt: skip
    for minute in range(0, 4 * 60, 5):  # fire every 5 minutes from 22:00 to 02:00 UTC
        fire(db, at("2024-03-30T22:00:00+00:00") + dt.timedelta(minutes=minute, seconds=30))
    daily = [j.run_at for j in fired(db, "task = 'd'")]
    hourly = [j.run_at for j in fired(db, "task = 'h'")]
    assert daily == [at("2024-03-31T01:00:00+00:00")]
    assert hourly == [
        at(f"2024-03-{d}T{h}:30:00+00:00")
        for d, h in (("30", "22"), ("30", "23"), ("31", "00"), ("31", "01"))
    ]
    assert schedule_row(db, "daily").next_run_at == at("2024-04-01T00:30:00+00:00")  # 02:30 CEST


def test_daylight_saving_fall_back_runs_a_daily_job_once_in_the_repeated_hour(db: Engine) -> None:
    """Berlin, 27 October 2024: 03:00 CEST falls back to 02:00 CET, so 02:30 happens twice. A daily 02:30
    runs once (at the first, 00:30 UTC); an hourly :30 job runs in both hours."""
    sync_schedules(db, JobSchedule, [Schedule("daily", "30 2 * * *", task="d", tz="Europe/Berlin"),
                                     Schedule("hourly", "30 * * * *", task="h", tz="Europe/Berlin")],
                   now=at("2024-10-26T22:00:00+00:00"))  # fmt: skip
    for minute in range(0, 5 * 60, 5):
        fire(db, at("2024-10-26T22:00:00+00:00") + dt.timedelta(minutes=minute, seconds=30))
    daily = [j.run_at for j in fired(db, "task = 'd'")]
    hourly = [j.run_at for j in fired(db, "task = 'h'")]
    assert daily == [at("2024-10-27T00:30:00+00:00")]
    assert hourly == [at(f"2024-10-{d}T{h}:30:00+00:00")
                      for d, h in (("26", "22"), ("26", "23"), ("27", "00"), ("27", "01"), ("27", "02"))]  # fmt: skip
    assert schedule_row(db, "daily").next_run_at == at("2024-10-28T01:30:00+00:00")  # 02:30 CET


@pytest.mark.parametrize("how", ["late firer", "synced then", "resumed then"])
def test_a_schedule_first_planned_in_the_second_pass_of_a_repeated_hour_fires_its_slot_once(
    db: Engine, how: str
) -> None:
    """Berlin, 27 October 2024, daily at 02:45: the slot is the first pass (00:45 UTC). Planned at 02:10 of the
    second pass (01:10 UTC) — a firer late across the change, a deploy's sync, a resume — the next slot was
    read at 02:45 of the first pass, already past: each tick fired it again and its key was free again once the
    job ran (a hostile review: 600 runs in 600 one-second ticks). Now: once at most, then the 28th."""
    daily = Schedule("nightly", "45 2 * * *", task="d", tz="Europe/Berlin")
    second_pass = at("2024-10-27T01:10:00+00:00")  # 02:10 CET
    if how == "late firer":
        sync_schedules(db, JobSchedule, [daily], now=at("2024-10-26T12:00:00+00:00"))
    elif how == "synced then":
        sync_schedules(db, JobSchedule, [daily], now=second_pass)
    else:
        sync_schedules(db, JobSchedule, [daily], now=at("2024-10-26T12:00:00+00:00"))
        pause_schedule(db, JobSchedule, "nightly")
        assert resume_schedule(db, JobSchedule, "nightly", now=second_pass) is True
    if how != "late firer":
        assert schedule_row(db, "nightly").next_run_at == at("2024-10-28T01:45:00+00:00")  # 02:45 CET
    for tick in range(0, 120, 2):
        fire(db, second_pass + dt.timedelta(seconds=tick))
        with db.begin() as conn:  # the job ran: its key no longer holds back another of the slot
            conn.execute(text("UPDATE jobs SET status = 'done', finished_at = now() WHERE status = 'queued'"))
    runs = [j.run_at for j in fired(db)]
    assert runs == ([at("2024-10-27T00:45:00+00:00")] if how == "late firer" else [])
    assert schedule_row(db, "nightly").next_run_at == at("2024-10-28T01:45:00+00:00")


def test_a_paused_schedule_does_not_fire_and_resuming_skips_the_paused_slots(db: Engine) -> None:
    sync_schedules(db, JobSchedule, [Schedule("s", "*/10 * * * *", task="t", catch_up="all")],
                   now=at("2024-06-01T12:00:00+00:00"))  # fmt: skip
    pause_schedule(db, JobSchedule, "s")
    assert fire(db, "2024-06-01T13:05:00+00:00") == 0
    assert resume_schedule(db, JobSchedule, "s", now=at("2024-06-01T13:05:00+00:00")) is True
    assert resume_schedule(db, JobSchedule, "s", now=at("2024-06-01T13:06:00+00:00")) is False  # not paused
    row = schedule_row(db, "s")
    assert not row.paused and row.next_run_at == at("2024-06-01T13:10:00+00:00")
    assert fire(db, "2024-06-01T13:10:01+00:00") == 1
    with pytest.raises(ConfigurationError, match="no schedule named 'nope'"):
        pause_schedule(db, JobSchedule, "nope")


def test_a_firing_read_before_a_cron_change_does_not_move_the_schedule_by_the_old_cron(db: Engine) -> None:
    """A firer read the schedule (due 12:00 on */10); a deploy's sync then changed it to */30, whose next slot
    is 12:00 as well. The compare-and-set on next_run_at alone let the stale firing through: it moved the
    schedule on to 12:10, a slot */30 does not have, which then fired (a review). It fires nothing now; the
    next firing reads */30 and fires 12:00, then 12:30."""
    sync_schedules(
        db, JobSchedule, [Schedule("r", "*/10 * * * *", task="t")], now=at("2026-01-05T11:55:00+00:00")
    )
    with db.connect() as loop:
        due = _schedules.read_due(loop, JobSchedule, now=at("2026-01-05T12:00:01+00:00"))
        loop.commit()
        sync_schedules(db, JobSchedule, [Schedule("r", "*/30 * * * *", task="t")],
                       now=at("2026-01-05T11:59:59+00:00"))  # fmt: skip
        assert _schedules.fire(loop, JobSchedule, Job, due) == 0
        loop.commit()
    for when in ("2026-01-05T12:00:02+00:00", "2026-01-05T12:10:01+00:00", "2026-01-05T12:30:01+00:00"):
        fire(db, when)
    assert [j.run_at for j in fired(db)] == [at("2026-01-05T12:00:00+00:00"), at("2026-01-05T12:30:00+00:00")]


def test_run_now_enqueues_a_job_at_once_and_leaves_the_schedule_alone(db: Engine) -> None:
    sync_schedules(db, JobSchedule, [Schedule("s", "0 3 * * *", task="t", payload={"p": 1}, queue="q")])
    before = schedule_row(db, "s")
    job_id = run_schedule_now(db, JobSchedule, Job, "s")
    [job] = fired(db)
    assert job.id == job_id and (job.task, job.queue, job.payload) == ("t", "q", {"p": 1})
    assert job.unique_key.startswith("schedule:s:run-now:")
    assert schedule_row(db, "s") == before
    with pytest.raises(ConfigurationError, match="no schedule named"):
        run_schedule_now(db, JobSchedule, Job, "nope")


def test_every_kind_of_bind_fires(db: Engine) -> None:
    sync_schedules(db, JobSchedule, [Schedule("s", "* * * * *", task="t", catch_up="all")],
                   now=at("2024-06-01T12:00:30+00:00"))  # fmt: skip
    assert fire_due_schedules(db, JobSchedule, Job, now=at("2024-06-01T12:01:30+00:00")) == 1  # Engine
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:  # a worker's loop connection
        assert fire_due_schedules(conn, JobSchedule, Job, now=at("2024-06-01T12:02:30+00:00")) == 1
    with Session(db) as session:  # in the caller's transaction: gone with its rollback
        assert fire_due_schedules(session, JobSchedule, Job, now=at("2024-06-01T12:03:30+00:00")) == 1
        session.rollback()
    with db.connect() as conn:
        assert fire_due_schedules(conn, JobSchedule, Job, now=at("2024-06-01T12:03:30+00:00")) == 1
        conn.commit()
    assert [j.run_at.minute for j in fired(db)] == [1, 2, 3]


def test_fired_jobs_run_on_a_worker(db: Engine) -> None:
    from sa_outbox.testing import drain

    sync_schedules(db, JobSchedule, [Schedule("s", "* * * * *", task="tick", payload={"n": 1})],
                   now=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=2))  # fmt: skip
    assert fire(db) == 1
    seen: list[Any] = []
    drain(Worker(db, Job, {"tick": lambda job: seen.append((job.payload, dict(job.headers)))}))
    [(payload, headers)] = seen
    assert payload == {"n": 1} and headers["x-schedule"] == "s"


@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_worker_given_the_schedules_fires_them_in_its_maintenance(
    db: Engine, async_url: URL, flavour: str
) -> None:
    """``Worker(…, schedules=JobSchedule)``: the once-a-second maintenance step fires the due slots on the
    loop's own connection, and the same turn claims and runs the job."""
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from sa_outbox import AsyncWorker

    sync_schedules(db, JobSchedule, [Schedule("s", "* * * * *", task="tick", payload={"n": 1})],
                   now=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=2))  # fmt: skip
    seen: list[Any] = []
    if flavour == "sync":
        w = Worker(
            db, Job, {"tick": lambda job: seen.append(job.payload)}, schedules=JobSchedule, listen=False
        )
        assert w.run_once() == 1
        assert w.run_once() == 0  # the next slot is in the future: nothing fires twice
        w.close()
    else:

        async def tick(job: Any) -> None:
            seen.append(job.payload)

        async def main() -> None:
            aengine = create_async_engine(async_url)
            aw = AsyncWorker(aengine, Job, {"tick": tick}, schedules=JobSchedule, listen=False)
            try:
                assert await aw.run_once() == 1
                assert await aw.run_once() == 0
            finally:
                await aw.close()
                await aengine.dispose()

        asyncio.run(main())
    assert seen == [{"n": 1}]
    assert schedule_row(db, "s").next_run_at > dt.datetime.now(dt.UTC)


def test_a_worker_refuses_a_model_that_is_not_a_schedules_table(db: Engine) -> None:
    with pytest.raises(ConfigurationError, match="ScheduleMixin"):
        Worker(db, Job, {}, schedules=Job)


# --- any number of processes, and kill -9 ------------------------------------------------------------

N_SCHEDULES = 12


def _firer(
    url: str, seed: int, seconds: float, crash_after: int = 0, started: Any = None, between: Any = None
) -> None:  # pragma: no cover - child process
    """Fire due schedules in a loop. Half of the steps read and fire in one transaction (the row locks keep
    other firers off), the others on an autocommit connection (like a worker's loop connection: nothing but
    the compare-and-set keeps them apart). With ``crash_after`` N, the process kills itself with SIGKILL
    after its N-th read that found due schedules, before firing them (counted in ``between`` first)."""
    rng = random.Random(seed)
    reads = 0
    engine = create_engine(url, pool_size=1)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        autocommit = rng.random() < 0.5
        conn = engine.connect()
        if autocommit:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        with conn:
            due = _schedules.read_due(conn, JobSchedule, limit=rng.choice((1, 3, 20)))
            if started is not None:
                started.set()
            reads += bool(due)
            if crash_after and reads == crash_after:
                with between.get_lock():
                    between.value += 1
                os.kill(os.getpid(), signal.SIGKILL)
            _schedules.fire(conn, JobSchedule, Job, due)
            conn.commit()
        time.sleep(rng.random() * 0.05)


def _finish_jobs(engine: Engine) -> None:
    """Mark every queued job done (as a worker would): the unique key no longer guards its slot, so only the
    firing step can keep a slot from firing twice."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE jobs SET status = 'done', lease_version = 1, finished_at = now() WHERE status = 'queued'"
            )
        )


def _check_every_slot_once(engine: Engine, start: dt.datetime) -> int:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT task, run_at, count(*) OVER (PARTITION BY unique_key) FROM jobs")
        ).all()
        nexts = dict(conn.execute(text("SELECT name, next_run_at FROM schedules")).all())  # type: ignore[arg-type]
    assert all(n == 1 for _, _, n in rows), "a slot fired twice"
    for name, next_run_at in nexts.items():
        slots = sorted(run_at for task, run_at, _ in rows if task == name)
        expected = [
            start + dt.timedelta(seconds=i) for i in range(int((next_run_at - start).total_seconds()))
        ]
        assert slots == expected, (name, "lost slots", sorted(set(expected) - set(slots)))
    return len(rows)


def _start(engine: Engine) -> dt.datetime:
    """Schedules firing every second, all missed slots fired ("all"); their first slot."""
    schedules = [Schedule(f"s{i}", "* * * * * *", task=f"s{i}", catch_up="all") for i in range(N_SCHEDULES)]
    sync_schedules(engine, JobSchedule, schedules)
    with engine.connect() as conn:
        starts = set(conn.execute(text("SELECT next_run_at FROM schedules")).scalars())
    assert len(starts) == 1
    return starts.pop()  # type: ignore[no-any-return]


def test_many_processes_fire_every_slot_exactly_once(db: Engine, db_url: URL) -> None:
    start = _start(db)
    ctx = multiprocessing.get_context("spawn")
    url = db_url.render_as_string(hide_password=False)
    procs = [ctx.Process(target=_firer, args=(url, seed, 5.0)) for seed in range(4)]
    for p in procs:
        p.start()
    while any(p.is_alive() for p in procs):
        _finish_jobs(db)
        time.sleep(0.1)
    assert all(p.exitcode == 0 for p in procs)
    fire(db)
    assert _check_every_slot_once(db, start) >= N_SCHEDULES * 4


def test_kill_9_between_reading_and_firing_loses_no_slot_and_fires_none_twice(
    db: Engine, db_url: URL
) -> None:
    """Three firer processes for 8 s or more; most kill themselves with SIGKILL between their two statements after
    one to three firings, and this test kills a random running one with SIGKILL every few hundred ms (wherever it is) and starts a
    new one. Jobs are marked done as they come, so the unique key cannot be what stops a second firing."""
    start = _start(db)
    ctx = multiprocessing.get_context("spawn")
    url = db_url.render_as_string(hide_password=False)
    between = ctx.Value("i", 0)
    rng = random.Random(7)
    seed = 0

    def spawn() -> tuple[Any, Any]:
        nonlocal seed
        seed += 1
        started = ctx.Event()
        crash_after = rng.choice((0, 1, 2, 3))  # 0: runs until this test kills it
        p = ctx.Process(target=_firer, args=(url, seed, 60.0, crash_after, started, between))
        p.start()
        return p, started

    procs = [spawn() for _ in range(3)]
    killed = 0
    began = time.monotonic()
    next_kill = began + 0.3

    def going() -> bool:  # at least 8 s, then until both kinds of crash happened often enough (30 s at most)
        spent = time.monotonic() - began
        return spent < 8 or (spent < 30 and (killed < 4 or between.value < 3))

    while going():
        _finish_jobs(db)
        running = [p for p, started in procs if p.is_alive() and started.is_set()]
        if running and time.monotonic() >= next_kill:
            rng.choice(running).kill()
            killed += 1
            next_kill = time.monotonic() + 0.2 + rng.random() * 0.5
        for i, (p, _) in enumerate(procs):
            if not p.is_alive():
                p.join()
                procs[i] = spawn()
        time.sleep(0.05)
    for p, _ in procs:
        p.kill()
        p.join()
    assert killed >= 4 and between.value >= 3, (killed, between.value)  # both kinds of crash happened
    # every slot up to now fired — again until none is due: a killed firer's backend may still hold its
    # schedules' row locks while it is torn down, and the read skips locked rows (once, under the whole
    # suite's load, one fire here left 38 slots counted where at least 96 were due)
    deadline = time.monotonic() + 15
    while True:
        fire(db)
        with db.connect() as conn:
            behind = conn.execute(
                text("SELECT count(*) FROM schedules WHERE next_run_at <= now()")
            ).scalar_one()
        if not behind or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    print(f"killed by the test: {killed}, killed themselves between the statements: {between.value}")
    assert _check_every_slot_once(db, start) >= N_SCHEDULES * 8


# --- the CLI -------------------------------------------------------------------------------------------


def test_cli_schedules_list_pause_resume_run_now(
    db: Engine, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    sync_schedules(db, JobSchedule, [Schedule("nightly", "0 3 * * *", task="report", tz="Europe/Berlin")])
    url = ["--url", db_url.render_as_string(hide_password=False)]
    assert main(["schedules", "list", *url]) == 0
    out = capsys.readouterr().out
    assert "nightly" in out and "0 3 * * *" in out and "Europe/Berlin" in out and "active" in out
    assert main(["schedules", "pause", "nightly", *url]) == 0
    assert "paused nightly" in capsys.readouterr().out
    assert main(["schedules", "list", "--json", *url]) == 0
    [listed] = json.loads(capsys.readouterr().out)
    assert (listed["name"], listed["paused"], listed["task"]) == ("nightly", True, "report")
    assert main(["schedules", "resume", "nightly", *url]) == 0
    assert not schedule_row(db, "nightly").paused
    assert "resumed nightly" in capsys.readouterr().out
    assert main(["schedules", "resume", "nightly", *url]) == 0  # the second click: nothing to resume
    assert capsys.readouterr().out == "nightly was not paused: left as it is\n"
    assert main(["schedules", "run-now", "nightly", *url]) == 0
    assert "enqueued job" in capsys.readouterr().out
    assert count_rows(db, "jobs", "task = 'report'") == 1
    assert main(["schedules", "pause", "nope", *url]) == 2
    assert "no schedule named 'nope'" in capsys.readouterr().err


def test_a_worker_started_before_the_migration_fires_schedules_and_reads_pauses_once_it_ran(
    db: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The schedules and queue-pause tables are missing when the worker starts (a database behind the code):
    warned once, and looked for again every MISSING_TABLE_RETRY seconds (0 here) — after the migration the same
    worker fires the schedule and honours a pause. Before, it never fired (a review: 0 jobs in 8 s while a
    fresh worker fired 5) and would never have read a pause."""
    from sa_outbox import _worker
    from sa_outbox.admin import pause_queue, resume_queue

    monkeypatch.setattr(_worker, "MISSING_TABLE_RETRY", 0.0)
    sync_schedules(db, JobSchedule, [Schedule("s", "* * * * *", task="tick", payload={"n": 1})],
                   now=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=2))  # fmt: skip
    with db.begin() as conn:
        conn.execute(text("ALTER TABLE schedules RENAME TO schedules_not_yet"))
        conn.execute(text("ALTER TABLE jobs_queues RENAME TO jobs_queues_not_yet"))
    seen: list[Any] = []
    w = Worker(db, Job, {"tick": lambda job: seen.append(job.payload)}, schedules=JobSchedule, listen=False)
    try:
        with caplog.at_level("WARNING", logger="sa_outbox.worker"):
            assert w.run_once() == 0
            assert w.run_once() == 0
        assert sum("schedules table of JobSchedule is missing" in r.getMessage() for r in caplog.records) == 1
        assert sum("queue table jobs_queues is missing" in r.getMessage() for r in caplog.records) == 1
        with db.begin() as conn:  # the migration
            conn.execute(text("ALTER TABLE schedules_not_yet RENAME TO schedules"))
            conn.execute(text("ALTER TABLE jobs_queues_not_yet RENAME TO jobs_queues"))
        pause_queue(db, Job, "default")
        assert w.run_once() == 0 and seen == []  # fired, but its queue is paused: not claimed
        resume_queue(db, Job, "default")
        assert w.run_once() == 1 and seen == [{"n": 1}]
    finally:
        w.close()
        with db.begin() as conn:
            conn.execute(text("ALTER TABLE IF EXISTS schedules_not_yet RENAME TO schedules"))
            conn.execute(text("ALTER TABLE IF EXISTS jobs_queues_not_yet RENAME TO jobs_queues"))
