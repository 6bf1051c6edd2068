"""Generic plans of every hot statement stay index scans, on a table full of history and on a backlog.

The loops run their statements server-side prepared; after five executions PostgreSQL may switch to a
generic plan (and always does under ``plan_cache_mode = force_generic_plan``, which some poolers want). A
generic plan cannot see ``:batch`` or the length of an id array, so a join written the obvious way can become
a hash join over a sequential scan of the whole table — every claim reading every row, exactly when a backlog
makes throughput matter.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from psycopg import sql as psql
from sqlalchemy import Engine, text
from sqlalchemy.pool import NullPool
from sqlalchemy.sql import Executable

from sa_outbox import _enqueue, _schedules, _sql
from sa_outbox.models import Job, JobSchedule, OutboxEvent

from .helpers import KEPT, QUEUE_SHAPES, queue_tables_shaped
from .test_explain import nodes, scans

OUTBOX = _sql.spec_for(OutboxEvent)
JOBS = _sql.spec_for(Job)


@pytest.fixture(scope="module", params=sorted(QUEUE_SHAPES))
def table_shape(request: pytest.FixtureRequest, shared_engine: Engine) -> Iterator[Engine]:
    with queue_tables_shaped(shared_engine, request.param):
        yield shared_engine


def generic_plan(engine: Engine, stmt: Executable, params: dict[str, Any]) -> dict[str, Any]:
    """The plan of ``stmt`` as a prepared statement under plan_cache_mode = force_generic_plan."""
    with engine.connect() as conn:
        compiled = stmt.compile(dialect=conn.dialect)
        values = compiled.construct_params(params)
        names: list[str] = []

        def number(m: re.Match[str]) -> str:
            if m.group(1) not in names:
                names.append(m.group(1))
            return f"${names.index(m.group(1)) + 1}"

        query = re.sub(r"%\((\w+)\)s", number, str(compiled)).replace("%%", "%")
        driver = conn.connection.driver_connection
        conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
        conn.exec_driver_sql("PREPARE sa_outbox_generic AS " + query.replace("%", "%%"))
        args = ", ".join(psql.Literal(values[n]).as_string(driver) for n in names)
        explain = f"EXPLAIN (FORMAT JSON) EXECUTE sa_outbox_generic({args})"
        result: dict[str, Any] = conn.exec_driver_sql(explain.replace("%", "%%")).scalar_one()[0]["Plan"]
        conn.invalidate()  # the session holds the PREPAREd statement: never hand it back to the pool
        return result


CLAIM = {"owner": "w", "batch": 50, "lease": timedelta(seconds=60)}
JOBS_CLAIM = {"owner": "w", "batch": 50, "queue_name": "default"}
OUTCOMES = {"ids": [1, 2], "versions": [1, 1], "statuses": ["done", "done"], "delays": [None, None],
            "errors": [None, None], "refunds": [0, 0], "results": [None, None]}  # fmt: skip
ONE_OUTCOME = {"o_id": 1, "o_version": 1, "o_status": "done", "o_delay": None, "o_error": None, "o_refund": 0,
               "o_result": None}  # fmt: skip
STATEMENTS = {
    "outbox claim": (_sql.claim_statement(OUTBOX), CLAIM),
    "outbox ordered claim": (_sql.claim_statement(OUTBOX, ordered=True), CLAIM),
    "outbox ordered-types claim": (
        _sql.claim_statement(OUTBOX, ordered=True, ordered_types=True),
        {**CLAIM, "ordered_types": ["E"]},
    ),
    "jobs claim": (_sql.claim_statement(JOBS), JOBS_CLAIM),
    "outbox rescue": (_sql.rescue_statement(OUTBOX), {"limit": 1000, "max_attempts": 12, **KEPT}),
    "jobs rescue": (
        _sql.rescue_statement(JOBS),
        {"limit": 1000, "stale_after": timedelta(seconds=60), **KEPT},
    ),
    "outbox finalize": (_sql.finalize_statement(OUTBOX), OUTCOMES),
    "jobs finalize": (_sql.finalize_statement(JOBS), OUTCOMES),
    "outbox extend": (_sql.extend_statement(OUTBOX), {**CLAIM, "ids": [1, 2], "versions": [1, 1]}),
    "jobs extend": (_sql.extend_statement(JOBS), {"ids": [1, 2], "versions": [1, 1]}),
    "outbox finalize+claim": (_sql.finalize_and_claim_statement(OUTBOX), {**CLAIM, **OUTCOMES}),
    "outbox ordered finalize+claim": (
        _sql.finalize_and_claim_statement(OUTBOX, ordered=True),
        {**CLAIM, **OUTCOMES},
    ),
    "jobs finalize+claim": (_sql.finalize_and_claim_statement(JOBS), {**JOBS_CLAIM, **OUTCOMES}),
    # what the loops send for their configured batch: the LIMIT written in
    "outbox claim, batch 50 written in": (_sql.claim_statement(OUTBOX, limit=50), CLAIM),
    "outbox ordered finalize+claim, batch 50 written in": (
        _sql.finalize_and_claim_statement(OUTBOX, ordered=True, limit=50),
        {**CLAIM, **OUTCOMES},
    ),
    "jobs finalize+claim, batch 1 written in": (
        _sql.finalize_and_claim_statement(JOBS, limit=1),
        {**JOBS_CLAIM, **OUTCOMES},
    ),
    # a statement with exactly one outcome (a worker at batch 1): the outcome's columns as plain parameters
    "jobs finalize+claim, one outcome, batch 1 written in": (
        _sql.finalize_and_claim_statement(JOBS, limit=1, single=True),
        {**JOBS_CLAIM, **ONE_OUTCOME},
    ),
    "outbox finalize, one outcome": (_sql.finalize_statement(OUTBOX, single=True), ONE_OUTCOME),
    # the ordered claim's aggregate-by-aggregate form (after a claim that found fewer heads than its batch)
    "outbox ordered claim, heads form": (
        _sql.claim_statement(OUTBOX, ordered=True, limit=50, heads=True),
        CLAIM,
    ),
    "outbox ordered finalize+claim, heads form": (
        _sql.finalize_and_claim_statement(OUTBOX, ordered=True, limit=50, heads=True),
        {**CLAIM, **OUTCOMES},
    ),
    "jobs finalize, one outcome": (_sql.finalize_statement(JOBS, single=True), ONE_OUTCOME),
}


def _enqueue_case(items: list[Any]) -> tuple[Executable, dict[str, Any]]:
    """The statement and parameters ``enqueue_many`` sends for ``items`` (with its NOTIFY arrays)."""
    batch = _enqueue.prepare(Job, items, context={})
    parts, optional = _enqueue._shape(batch)
    params = {**_enqueue._params(batch, parts, optional), "channels": [], "payloads": []}
    return _enqueue.statement(Job.__table__, parts, optional), params


def _fire_case() -> tuple[Executable, dict[str, Any]]:
    now = dt.datetime(2024, 6, 1, tzinfo=dt.UTC)
    return _schedules._fire_statement(JobSchedule.__table__, Job.__table__), {
        "names": ["s"], "expected": [now], "nexts": [now], "lasts": [now], "crons": ["* * * * *"], "zones": ["UTC"],
        "slot_names": ["s"], "slots": [now],
        "slot_keys": ["schedule:s:x"], "slot_headers": [None], "default_max_attempts": 10, "channels": [],
        "payloads": [],
    }  # fmt: skip


UNIQUE_JOBS = {"task": "t", "payload": {}, "unique_key": "k"}
STATEMENTS.update(
    {
        # Worker(…, unique_running=True): the claim that keeps one running job per key
        "jobs claim, unique_running": (_sql.claim_statement(JOBS, unique_running=True), JOBS_CLAIM),
        "jobs finalize+claim, unique_running, batch 10 written in": (
            _sql.finalize_and_claim_statement(JOBS, limit=10, unique_running=True),
            {**JOBS_CLAIM, **OUTCOMES},
        ),
        # the producer's statements: enqueue_many, enqueue(…, unique_key=…) with each rule
        "enqueue_many, plain": _enqueue_case([("t", {}), ("t", {})]),
        "enqueue, one plain job (the flush's)": (
            _enqueue.one_statement(Job.__table__, frozenset({"priority", "run_at", "headers"})),
            {
                "j_task": "t",
                "j_queue": "q",
                "j_payload": "{}",
                "j_priority": 0,
                "j_run_at": None,
                "j_delay": 5.0,
                "j_headers": None,
                "channel": "c",
                "payload": "q",
            },
        ),
        "enqueue, unique skip": _enqueue_case([UNIQUE_JOBS]),
        "enqueue, unique replace": _enqueue_case([{**UNIQUE_JOBS, "on_conflict": "replace"}]),
        "enqueue, unique debounce": _enqueue_case(
            [{**UNIQUE_JOBS, "on_conflict": "debounce", "debounce": 1}]
        ),
        "enqueue_many, every rule": _enqueue_case(
            [
                ("t", {}),
                UNIQUE_JOBS,
                {**UNIQUE_JOBS, "unique_key": "r", "on_conflict": "replace"},
                {**UNIQUE_JOBS, "unique_key": "d", "on_conflict": "debounce", "debounce": 1},
            ]
        ),
        # the scheduler's firing step (inserts into the jobs table)
        "schedules fire": _fire_case(),
    }
)
STATEMENTS["jobs retry (operator)"] = (
    _sql.retry_jobs_statement(JOBS, ["failed", "cancelled"]),
    {"ids": [1, 2, 3]},
)
LIMITED = {"queue_name": "default", "batch": 50, "n": 2}
LIMITED_CLAIM = {"queue_name": "default", "owner": "w", "n": 2, "ids": [1, 2, 3], "keys": ["", "", ""],
                 "rate_count": 10, "rate_window": 60.0}  # fmt: skip
STATEMENTS.update({
    "jobs limited pick, per queue": (_sql.limited_pick_statement(JOBS, per_key=False), LIMITED),
    "jobs limited pick, per key": (_sql.limited_pick_statement(JOBS, per_key=True), LIMITED),
    "jobs limited claim, per key": (_sql.limited_claim_statement(JOBS, per_key=True, rate=False), LIMITED_CLAIM),
    "jobs limited claim, per key with a rate": (
        _sql.limited_claim_statement(JOBS, per_key=True, rate=True), LIMITED_CLAIM,
    ),
})  # fmt: skip


@pytest.mark.parametrize("label", sorted(STATEMENTS))
def test_generic_plan_never_scans_the_table(table_shape: Engine, label: str) -> None:
    stmt, params = STATEMENTS[label]
    found = scans(generic_plan(table_shape, stmt, params))
    assert not [s for s in found if s[0] == "Seq Scan" and s[1] in ("outbox", "jobs")], (label, found)


def _finalized_reads_under_a_subplan(node: dict[str, Any], in_subplan: bool = False) -> int:
    inside = in_subplan or node.get("Parent Relationship") == "SubPlan"
    own = int(inside and node.get("Node Type") == "CTE Scan" and node.get("CTE Name") == "finalized")
    return own + sum(_finalized_reads_under_a_subplan(child, inside) for child in node.get("Plans", []))


FINISHED_READERS = sorted(
    label
    for label in STATEMENTS
    if "finalize+claim" in label and ("ordered" in label or "unique_running" in label)
)


@pytest.mark.parametrize("label", FINISHED_READERS)
def test_no_probe_reads_the_finalized_rows_itself(table_shape: Engine, label: str) -> None:
    """The ids the statement's finalize has just finished are computed once, before the pick runs, and passed
    to the probes as a parameter: a probe that read them through an InitPlan of its own read an unset
    parameter when a row lock's EvalPlanQual recheck ran it first — a SIGSEGV that restarted the whole
    PostgreSQL 15 cluster (unique_running workers beside bulk "replace" enqueues: 11-21 crashes a minute)."""
    stmt, params = STATEMENTS[label]
    assert _finalized_reads_under_a_subplan(generic_plan(table_shape, stmt, params)) == 0, label


def test_running_workers_keep_the_generic_plan(shared_engine: Engine) -> None:
    """Three workers at batch 1 side by side: with the batch written into the claim and the outcome ids
    hidden from the planner, PostgreSQL settles on each prepared statement's generic plan
    (pg_prepared_statements counts it) instead of planning every claim."""
    import threading

    from sqlalchemy import create_engine, event

    from sa_outbox import ClaimedJob, Worker

    with shared_engine.begin() as conn:
        conn.execute(text("TRUNCATE jobs RESTART IDENTITY"))
    with shared_engine.begin() as conn:  # a queue of 12,000 (plan costs grow with the table), analyzed
        conn.execute(
            text("INSERT INTO jobs (task, payload) SELECT 'noop', '{}' FROM generate_series(1, 12000)")
        )
    with shared_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE jobs"))
    own = create_engine(shared_engine.url, poolclass=NullPool)  # fresh sessions: nothing prepared yet
    plans: list[Any] = []
    workers: list[Worker] = []
    # Each worker's own session, found by the thread that opened it (the worker's loop thread, where its
    # inline handlers run too): read between two claims, it shows that session's prepared statements.
    sessions: dict[int, Any] = {}
    event.listen(own, "connect", lambda dbapi, record: sessions.setdefault(threading.get_ident(), dbapi))

    def make_handler(index: int) -> Any:
        count = [0]

        def handle(job: ClaimedJob) -> None:
            count[0] += 1
            if count[0] == 150:  # read this loop's own session from its thread, between two claims
                inflight = workers[index]._inflight
                if inflight is not None:  # the claim sent ahead of this job: read first (the session is its)
                    inflight.future.exception()
                plans.extend(
                    sessions[threading.get_ident()]
                    .execute(
                        "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                        "WHERE statement LIKE 'WITH finalized%' AND statement LIKE '%LIMIT 1 %'"
                    )
                    .fetchall()
                )

        return handle

    for i in range(3):
        workers.append(Worker(own, Job, {"noop": make_handler(i)}, batch=1, listen=False))
    threads = [
        threading.Thread(target=w.run, kwargs={"install_signal_handlers": False, "max_batches": 160})
        for w in workers
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for w in workers:
            w.close()
        own.dispose()
        with shared_engine.begin() as conn:
            conn.execute(text("TRUNCATE jobs RESTART IDENTITY"))
    assert len(plans) == 3, plans
    # PostgreSQL's five trial custom plans, then the generic plan only
    assert all(custom == 5 and generic >= 140 for generic, custom in plans), plans


@pytest.mark.parametrize("ordered", [False, True, ["E"]], ids=["plain", "ordered", "ordered types"])
def test_a_running_dispatcher_keeps_the_generic_plan(shared_engine: Engine, ordered: Any) -> None:
    """A dispatcher draining 20,000 events of 1,000 aggregates at the default batch settles on the generic plan
    of its finalize-and-claim statement after PostgreSQL's five trial plans. PostgreSQL keeps planning when
    the generic plan's cost is not below the custom plans' average: with the ordered probe's aggregate type
    matched as a range (a 0.5 % estimate) each probe looked so costly that the claim's cost ran to 20,000, the
    estimates drifting with the table's size moved it by more than the planning charge, and every claim of
    the ordered dispatcher was planned anew (custom_plans 400, generic 0: 0.76× the plain claim's drain)."""
    from sqlalchemy import create_engine

    from sa_outbox import Dispatcher
    from sa_outbox.testing import RecordingPublisher

    with shared_engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox RESTART IDENTITY"))
        conn.execute(
            text(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                "SELECT 'order', (g % 1000)::text, 'E', '{}' FROM generate_series(1, 20000) g"
            )
        )
    with shared_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE outbox"))
    own = create_engine(shared_engine.url, pool_size=1, max_overflow=0)  # the loop's session comes back to us
    dispatcher = Dispatcher(own, OutboxEvent, RecordingPublisher(), ordered=ordered, listen=False)
    try:
        dispatcher.run(install_signal_handlers=False, max_batches=120)
        with own.connect() as conn:
            plans = conn.execute(
                text(
                    "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                    "WHERE statement LIKE 'WITH finalized%'"
                )
            ).all()
    finally:
        dispatcher.close()
        own.dispose()
        with shared_engine.begin() as conn:
            conn.execute(text("TRUNCATE outbox RESTART IDENTITY"))
    assert dispatcher.stats.done >= 100 * 50, dispatcher.stats
    # The run's claims pass over rows other transactions hold (the settled form); at least once a second one
    # locks instead (ClaimForms), a statement of its own: a run slower than a second (a loaded CI machine) has
    # two. The settled one carries the run and must be generic; none may be planned anew past the five trials.
    generic, custom = max(plans)
    assert custom == 5 and generic >= 100, plans
    assert all(c <= 5 for _, c in plans), plans


@pytest.mark.parametrize("label", ["enqueue, unique skip", "enqueue_many, every rule"])
def test_a_unique_skip_reads_the_waiting_job_through_the_unique_index(
    table_shape: Engine, label: str
) -> None:
    """The waiting job of a skip key that met one is read through ux_jobs_unique: each key one lookup — never
    the queued jobs read through another index and tested against every key (with one skip item and with a
    call that mixes every rule)."""
    found = scans(generic_plan(table_shape, *STATEMENTS[label]))
    assert {s[2] for s in found if s[2]} == {"ux_jobs_unique"}, found
    assert ("Seq Scan", "jobs", None) not in found, found


def test_the_conflict_rules_read_their_parameters_once(table_shape: Engine) -> None:
    """A call that mixes skip with replace or debounce tells a skip row from the others at each conflict, and a
    debounce row's cap is looked up at each: both from a JSON object sent as text. On a generic plan the cast
    ran for every conflicting row, each parsing the whole object again (4,000 debounce items that all met a
    waiting job: 5.0 s a call from the sixth call on, 0.11 s before), and `<> ALL(skip keys)` compared each
    row with every skip key. Both are InitPlans now, computed once per statement."""
    plan = generic_plan(table_shape, *STATEMENTS["enqueue_many, every rule"])
    upsert = next(n for n in nodes(plan) if "Conflict Filter" in n)
    # (an InitPlan's value: "$5" up to PostgreSQL 17, "(InitPlan 5).col1" from 18 on)
    once_value = r"(\$\d+|\(InitPlan \d+\)\.col1)"
    assert re.fullmatch(rf"\(NOT \({once_value} \? excluded\.unique_key\)\)", upsert["Conflict Filter"]), (
        upsert
    )
    once = [c for c in upsert["Plans"] if c.get("Parent Relationship") == "InitPlan"]
    assert len(once) >= 2, upsert  # the skip keys' object and the caps'


def test_the_unique_running_claim_looks_up_keys_through_their_index(table_shape: Engine) -> None:
    """Per candidate, one index lookup for each half of the rule — never every running job (ix_jobs_running:
    an OR of "running or older" made the planner read them all for each candidate). Each lookup is in the plan
    twice: before the row lock (a row no transaction touched) and above it (any other)."""
    found = scans(generic_plan(table_shape, *STATEMENTS["jobs claim, unique_running"]))
    names = [s[2] for s in found]
    assert names.count("ix_jobs_unique_active") == 4 and "ix_jobs_dequeue" in names, found
    assert "ix_jobs_running" not in names, found


@pytest.mark.parametrize(
    "label",
    [
        "outbox finalize", "jobs finalize", "outbox extend", "jobs extend", "jobs finalize+claim",
        "outbox finalize, one outcome", "jobs finalize, one outcome",
        "jobs finalize+claim, one outcome, batch 1 written in",
    ],
)  # fmt: skip
def test_fenced_updates_find_their_rows_by_primary_key(table_shape: Engine, label: str) -> None:
    """A finalize/heartbeat of n rows costs n key lookups — never a walk over every leased row compared
    with every outcome (what a generic plan did with statistics taken when few rows were leased)."""
    stmt, params = STATEMENTS[label]
    table = label.split()[0]
    found = scans(generic_plan(table_shape, stmt, params))
    leased_index = "ix_outbox_leased" if table == "outbox" else "ix_jobs_running"
    assert f"pk_{table}" in {s[2] for s in found}, (label, found)
    assert leased_index not in {s[2] for s in found}, (label, found)


def test_retry_jobs_finds_the_first_job_of_each_key_once(table_shape: Engine) -> None:
    """Of several never-started jobs of one unique key among the ids, retry_jobs requeues the first: found once
    for the whole batch (an InitPlan), not per row — asked per row, each row read the primary key for every id
    of the batch (4,000 ids: 1.9 s, a review). What runs per row (a SubPlan) is only the lookup of the key's
    waiting job, through ux_jobs_unique."""
    plan = generic_plan(table_shape, *STATEMENTS["jobs retry (operator)"])
    per_row = [n for n in nodes(plan) if n.get("Parent Relationship") == "SubPlan"]
    assert per_row, plan
    for sub in per_row:
        assert {s[2] for s in scans(sub) if s[2]} <= {"ux_jobs_unique"}, scans(sub)
