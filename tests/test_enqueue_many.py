"""Bulk enqueue: one statement per call, ids in the given order, all or nothing on bad input, one NOTIFY per
queue, in ``Session`` and ``AsyncSession``."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from sa_outbox import PayloadError, enqueue, enqueue_many
from sa_outbox._names import channel_for
from sa_outbox.models import Job

from .conftest import count_rows
from .test_producer import statement_log
from .test_unique import jobs


def test_tuples_and_dicts_get_their_ids_in_order_in_one_statement(engine: Engine) -> None:
    later = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    items: list[Any] = [
        ("send_email", {"to": "a"}),
        {"task": "resize", "payload": {"n": 1}, "queue": "images", "priority": 3, "max_attempts": 2},
        {"task": "report", "payload": [1, 2], "run_at": later, "headers": {"x-tenant": "acme"}},
        {"task": "later", "payload": {}, "run_at": dt.timedelta(minutes=5)},
        ("send_email", {"to": "b"}),
    ]
    with statement_log(engine) as seen, Session(engine) as s, s.begin():
        ids = enqueue_many(s, Job, items)
        now = s.execute(text("SELECT now()")).scalar_one()
    assert ids == [1, 2, 3, 4, 5]
    assert len(seen) == 1 + 1  # the insert (with its NOTIFYs), then our own SELECT now()
    rows = jobs(engine)
    assert [(r.task, r.queue, r.payload, r.priority) for r in rows] == [
        ("send_email", "default", {"to": "a"}, 0),
        ("resize", "images", {"n": 1}, 3),
        ("report", "default", [1, 2], 0),
        ("later", "default", {}, 0),
        ("send_email", "default", {"to": "b"}, 0),
    ]
    assert rows[2].run_at == later and rows[2].headers == {"x-tenant": "acme"}
    assert rows[3].run_at == now + dt.timedelta(minutes=5) and rows[0].run_at == now
    with engine.connect() as conn:
        attempts = conn.execute(text("SELECT max_attempts FROM jobs ORDER BY id")).scalars().all()
    assert attempts == [Job.sa_outbox_default_max_attempts, 2, 10, 10, 10]


def test_a_large_batch_keeps_its_order(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        ids = enqueue_many(s, Job, [("t", {"n": i}) for i in range(5000)])
    assert ids == list(range(1, 5001))
    with engine.connect() as conn:
        ns = conn.execute(text("SELECT (payload->>'n')::int FROM jobs ORDER BY id")).scalars().all()
    assert ns == list(range(5000))


def test_bad_input_anywhere_refuses_the_whole_call_before_any_sql(engine: Engine) -> None:
    good = [("t", {"n": i}) for i in range(500)]
    bad_items: list[tuple[Any, str]] = [
        (("t",), r"jobs\[500\].*\(task, payload\)"),
        (("t", {}, "x"), r"jobs\[500\]"),
        ({"task": "t"}, r"jobs\[500\].*payload is required"),
        ({"task": "t", "payload": {}, "colour": "red"}, r"jobs\[500\].*unknown option 'colour'"),
        (("", {}), r"jobs\[500\].*task must be a non-empty string"),
        (("t", {"x": {1, 2}}), r"jobs\[500\].*payload refused"),
        ({"task": "t", "payload": {}, "queue": "q" * 3000}, r"jobs\[500\].*queue is 3000 bytes"),
        (
            {"task": "t", "payload": {}, "unique_key": "k", "on_conflict": "merge"},
            r"jobs\[500\].*on_conflict",
        ),
        ({"task": "t", "payload": {}, "headers": {"bad name": "v"}}, r"jobs\[500\].*header"),
        ({"task": "t", "payload": {}, "max_attempts": 0}, r"jobs\[500\].*max_attempts"),
        ("t", r"jobs\[500\]"),
    ]
    with statement_log(engine) as seen, Session(engine) as s:
        for bad, message in bad_items:
            with pytest.raises(PayloadError, match=message):
                enqueue_many(s, Job, [*good, bad, *good])
        with pytest.raises(PayloadError, match="not in the task registry"):
            enqueue_many(s, Job, [("t", {}), ("nope", {})], registry={"t"})
    assert seen == [] and count_rows(engine, "jobs") == 0


def test_an_empty_batch_writes_nothing(engine: Engine) -> None:
    with statement_log(engine) as seen, Session(engine) as s, s.begin():
        assert enqueue_many(s, Job, []) == []
    assert seen == []


def test_one_notify_per_queue_and_none_on_rollback(engine: Engine) -> None:
    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel_for("jobs"))))
        with Session(engine) as s, s.begin():
            enqueue_many(s, Job, [("t", {}), {"task": "t", "payload": {}, "queue": "mail"}, ("t", {})])
            enqueue_many(s, Job, [{"task": "t", "payload": {}, "queue": "mail"}])
            enqueue(s, Job, "t", {}, queue="mail")
        got = sorted((n.channel, n.payload) for n in listener.notifies(timeout=0.5))
        assert got == [("sa_outbox.jobs", "default"), ("sa_outbox.jobs", "mail")]
        with Session(engine) as s:
            enqueue_many(s, Job, [("t", {})])
            s.rollback()
        assert list(listener.notifies(timeout=0.3)) == []
    assert count_rows(engine, "jobs") == 5


def test_unique_keys_in_a_batch(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        enqueue(s, Job, "t", {"v": "old"}, unique_key="a")
        enqueue(s, Job, "t", {"v": "old"}, unique_key="b")
        enqueue(s, Job, "t", {"v": "old"}, unique_key="c")
    items: list[Any] = [
        ("t", {"plain": 1}),
        {"task": "t", "payload": {"v": "new"}, "unique_key": "a"},  # skip: the existing id
        {"task": "t", "payload": {"v": "new"}, "unique_key": "b", "on_conflict": "replace", "priority": 4},
        {"task": "t", "payload": {"v": "new"}, "unique_key": "c", "on_conflict": "debounce", "debounce": 30},
        {"task": "t", "payload": {"v": "new"}, "unique_key": "d"},  # a new key
        {"task": "t", "payload": {"v": "again"}, "unique_key": "d"},  # the same key twice: one job
        ("t", {"plain": 2}),
    ]
    with statement_log(engine) as seen, Session(engine) as s, s.begin():
        ids = enqueue_many(s, Job, items)
    assert len(seen) == 1
    assert ids[1:4] == [1, 2, 3] and ids[4] == ids[5]
    assert len({ids[0], ids[4], ids[6]}) == 3 and min(ids[0], ids[4], ids[6]) > 3
    assert ids[0] < ids[6]  # plain jobs keep their order
    by_id = {r.id: r for r in jobs(engine)}
    assert by_id[1].payload == {"v": "old"}
    assert (by_id[2].payload, by_id[2].priority) == ({"v": "new"}, 4)
    assert by_id[3].payload == {"v": "new"} and by_id[3].run_at - by_id[3].created_at > dt.timedelta(0)
    assert by_id[ids[4]].payload == {"v": "new"}  # skip: the first of the batch's own duplicates
    assert count_rows(engine, "jobs") == 6


def test_one_key_with_two_conflict_rules_in_one_batch_is_refused(engine: Engine) -> None:
    items = [
        {"task": "t", "payload": {}, "unique_key": "k"},
        {"task": "t", "payload": {}, "unique_key": "k", "on_conflict": "replace"},
    ]
    with (
        statement_log(engine) as seen,
        Session(engine) as s,
        pytest.raises(PayloadError, match=r"jobs\[1\].*unique_key 'k'.*jobs\[0\]"),
    ):
        enqueue_many(s, Job, items)
    assert seen == []


def test_replace_with_duplicates_in_a_batch_takes_the_last(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        ids = enqueue_many(
            s, Job,
            [{"task": "t", "payload": {"n": n}, "unique_key": "k", "on_conflict": "replace"} for n in range(3)],
        )  # fmt: skip
    assert ids == [1, 1, 1] and jobs(engine)[0].payload == {"n": 2}


def test_trace_context_and_call_headers_reach_every_job(engine: Engine) -> None:
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    span = NonRecordingSpan(SpanContext(0x1234, 0x5678, is_remote=False, trace_flags=TraceFlags(1)))
    with trace.use_span(span), Session(engine) as s, s.begin():
        enqueue_many(s, Job, [("t", {}), {"task": "t", "payload": {}, "headers": {"x-a": "1"}},
                              {"task": "t", "payload": {}, "unique_key": "k"}])  # fmt: skip
    parent = "00-00000000000000000000000000001234-0000000000005678-01"
    assert [r.headers for r in jobs(engine)] == [
        {"traceparent": parent},
        {"traceparent": parent, "x-a": "1"},
        {"traceparent": parent},
    ]


def test_async_session_awaits_enqueue_many(engine: Engine, async_url: URL) -> None:
    async def main() -> list[int]:
        aengine = create_async_engine(async_url)
        try:
            async with AsyncSession(aengine) as s, s.begin():
                ids = await enqueue_many(s, Job, [("t", {"n": 1}), ("t", {"n": 2})])
                with pytest.raises(PayloadError):
                    enqueue_many(s, Job, [("t", object())])  # refused before anything is awaited
                return ids
        finally:
            await aengine.dispose()

    assert asyncio.run(main()) == [1, 2]
    assert count_rows(engine, "jobs") == 2


def test_concurrency_keys_in_a_batch_and_with_a_unique_key(engine: Engine) -> None:
    with Session(engine) as s, s.begin():
        enqueue_many(s, Job, [("t", {}), {"task": "t", "payload": {}, "concurrency_key": "customer:7"}])
        enqueue(s, Job, "t", {}, unique_key="k", concurrency_key="customer:8")
        enqueue(s, Job, "t", {}, unique_key="k", concurrency_key="customer:9", on_conflict="replace")
    with engine.connect() as conn:
        keys = conn.execute(text("SELECT concurrency_key FROM jobs ORDER BY id")).scalars().all()
    assert keys == ["", "customer:7", "customer:9"]  # replace takes the new key's group too
    with statement_log(engine) as seen, Session(engine) as s:
        with pytest.raises(PayloadError, match=r"jobs\[0\].*concurrency_key must be a string"):
            enqueue_many(s, Job, [{"task": "t", "payload": {}, "concurrency_key": 7}])
        with pytest.raises(
            PayloadError, match=r"queue and concurrency_key are 5007 bytes.*2683 bytes.*ix_jobs_running"
        ):
            enqueue_many(s, Job, [{"task": "t", "payload": {}, "concurrency_key": "x" * 5000}])
    assert seen == []


@pytest.mark.parametrize(
    ("mine", "theirs"),
    [
        (("replace", "debounce"), ("debounce", "replace")),
        (("replace", "skip"), ("replace", "replace")),
        (("skip", "debounce"), ("replace", "skip")),
    ],
    ids=["replace-debounce", "skip-replace", "skip-debounce"],
)
def test_two_calls_giving_two_keys_other_rules_never_deadlock(
    engine: Engine, mine: tuple[str, str], theirs: tuple[str, str]
) -> None:
    """Two callers enqueue the same two keys (x before y) at the same moment, each with its own rule per key:
    the calls take the keys in one order, whatever rules they mix (a hostile review: a replace and a debounce
    upsert each locked their keys in order but not together — 3 deadlocks in 300 calls; skip rows beside
    replace rows, 11 in 600). Each key ends with one waiting job."""
    rounds = 60
    start = threading.Barrier(2, timeout=30)
    deadlocks: list[str] = []

    def call(rules: tuple[str, str]) -> None:
        for i in range(rounds):
            items = [
                {
                    "task": "t",
                    "payload": {"i": i},
                    "unique_key": f"{key}{i}",
                    "on_conflict": rule,
                    "debounce": 1,
                }
                if rule == "debounce"
                else {"task": "t", "payload": {"i": i}, "unique_key": f"{key}{i}", "on_conflict": rule}
                for key, rule in zip(("x", "y"), rules, strict=True)
            ]
            start.wait()
            try:
                with Session(engine) as s, s.begin():
                    enqueue_many(s, Job, items)
                    s.execute(
                        text("SELECT pg_sleep(0.002)")
                    )  # hold the keys a moment, as a caller's work does
            except DBAPIError as exc:
                if getattr(exc.orig, "sqlstate", None) != "40P01":
                    raise
                deadlocks.append(str(exc.orig))

    threads = [threading.Thread(target=call, args=(rules,)) for rules in (mine, theirs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert deadlocks == []
    with engine.connect() as conn:
        per_key = conn.execute(text("SELECT unique_key, count(*) FROM jobs GROUP BY 1")).all()
    assert len(per_key) == 2 * rounds and {n for _, n in per_key} == {1}


@pytest.mark.parametrize("rule", ["skip", "replace", "debounce"])
def test_a_call_of_many_items_is_planned_for_its_own_values(engine: Engine, rule: str) -> None:
    """A call of many keyed items is sent unprepared — PostgreSQL plans it for its own arrays — while a small one
    is server-side prepared as every other statement of the library. On a prepared statement's generic plan
    (from the sixth call on) 20,000 mixed items that all met a waiting job took 2.2 s a call against 0.4 s
    (the waiting jobs read through another index and tested against every skip key one by one). Each call of
    the same shape writes what it should either way."""
    from sa_outbox._enqueue import PLANNED_ALONE_FROM

    fresh = create_engine(engine.url, poolclass=NullPool)  # a new session each call: nothing prepared before

    def call(n: int) -> int:
        items = [
            {"task": "t", "payload": {"i": i}, "unique_key": f"{rule}-{n}-{i}", "on_conflict": rule,
             **({"debounce": 5} if rule == "debounce" else {})}
            for i in range(n)
        ]  # fmt: skip
        with Session(fresh) as s, s.begin():
            ids = enqueue_many(s, Job, items)
            again = enqueue_many(s, Job, items)  # every key meets its waiting job
            prepared = s.execute(
                text("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE '%INSERT INTO jobs%'")
            ).scalar_one()
        assert again == ids and len(set(ids)) == n
        return int(prepared)

    small, large = PLANNED_ALONE_FROM - 1, PLANNED_ALONE_FROM
    try:
        assert call(large) == 0
        assert call(small) == 1  # prepared, as every statement of the library (the control)
    finally:
        fresh.dispose()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM jobs")).scalar_one() == small + large
