"""A burst of new rows arriving after ANALYZE saw a table of finished ones: the claims keep their per-row plans.

The common production shape: a long-lived table whose statistics say "every row is done" (the last ANALYZE ran
in a quiet hour), then a burst of pending rows that autovacuum will not re-analyze soon (on a table of ten
million rows the threshold is a million changes). The planner then believes one row is ready. With the ordered
claim's NOT EXISTS pulled up into an anti-join it chose a nested loop whose inner side read the whole aggregate
index for every candidate — 5,000,000 buffers and 3.3 s for one claim of 50 over a burst of 100,000 rows on
this machine. The probe must stay a per-row index lookup on the aggregate, whatever the statistics say.

Asserted on what the database reports (the plan's shape, the buffers one claim touched), never on a timing.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.sql import Executable

from sa_outbox import _sql
from sa_outbox.models import Job, OutboxEvent

OUTBOX = _sql.spec_for(OutboxEvent)
JOBS = _sql.spec_for(Job)

FINISHED = 100_000
BURST = 100_000
AGGREGATES = 1_000
#: What one claim of 50 may touch: ~1,200 buffers with per-row probes; the anti-join plan read 5,000,000.
MAX_BUFFERS = 20_000


@pytest.fixture(scope="module")
def burst(shared_engine: Engine) -> Iterator[Engine]:
    """FINISHED done rows per table, VACUUM ANALYZE, then BURST ready rows the statistics never saw (autovacuum
    off on both tables while the module runs, so it cannot re-analyze them underneath the assertions)."""
    with shared_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("TRUNCATE outbox, jobs RESTART IDENTITY"))
        for table in ("outbox", "jobs"):
            conn.execute(text(f"ALTER TABLE {table} SET (autovacuum_enabled = off)"))
        conn.execute(
            text(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status, done_at) "
                "SELECT 'order', 'agg-' || (g % :a), 'E', '{}', 'done', now() FROM generate_series(1, :n) g"
            ),
            {"n": FINISHED, "a": AGGREGATES},
        )
        conn.execute(
            text(
                "INSERT INTO jobs (task, payload, unique_key, status, finished_at) "
                "SELECT 'noop', '{}', 'key-' || (g % :k + 1), 'done', now() FROM generate_series(1, :n) g"
            ),
            {"n": FINISHED, "k": BURST},
        )
        conn.execute(text("VACUUM ANALYZE outbox"))
        conn.execute(text("VACUUM ANALYZE jobs"))
        conn.execute(
            text(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                "SELECT 'order', 'agg-' || (g % :a), 'E', '{}' FROM generate_series(1, :n) g"
            ),
            {"n": BURST, "a": AGGREGATES},
        )
        conn.execute(
            text(
                # one queued job per key (a key's waiting job is unique), each key with finished jobs before
                "INSERT INTO jobs (task, payload, unique_key) "
                "SELECT 'noop', '{}', 'key-' || g FROM generate_series(1, :n) g"
            ),
            {"n": BURST},
        )
    try:
        yield shared_engine
    finally:
        with shared_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("TRUNCATE outbox, jobs RESTART IDENTITY"))
            for table in ("outbox", "jobs"):
                conn.execute(text(f"ALTER TABLE {table} RESET (autovacuum_enabled)"))
            conn.execute(text("ANALYZE outbox"))
            conn.execute(text("ANALYZE jobs"))


def analyzed(engine: Engine, stmt: Executable, params: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """EXPLAIN (ANALYZE, BUFFERS) of one claim, rolled back: its plan and the ids it claimed."""
    with engine.connect() as conn:
        compiled = stmt.compile(dialect=conn.dialect)
        sql, bound = str(compiled), compiled.construct_params(params)
        plan: dict[str, Any] = conn.exec_driver_sql(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, bound
        ).scalar_one()[0]["Plan"]
        conn.rollback()
        rows = conn.exec_driver_sql(sql, bound).all()
        conn.rollback()
        return plan, rows


def nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from nodes(child)


def index_lookups(plan: dict[str, Any], index: str) -> list[dict[str, Any]]:
    return [n for n in nodes(plan) if n.get("Index Name") == index]


def assert_few_buffers(plan: dict[str, Any]) -> None:
    touched = plan["Shared Hit Blocks"] + plan.get("Shared Read Blocks", 0)
    assert touched < MAX_BUFFERS, f"one claim of 50 touched {touched:,} buffers"


def test_the_statistics_do_not_know_the_burst(burst: Engine) -> None:
    """The premise: the planner expects (almost) no ready row — without it the tests below prove nothing."""
    with burst.connect() as conn:
        estimate = conn.execute(
            text("EXPLAIN (FORMAT JSON) SELECT id FROM outbox WHERE status = 'pending'")
        ).scalar_one()[0]["Plan"]["Plan Rows"]
    assert estimate < BURST / 100, estimate


def test_an_ordered_claim_after_a_burst_probes_each_candidates_aggregate(burst: Engine) -> None:
    plan, rows = analyzed(
        burst,
        _sql.claim_statement(OUTBOX, ordered=True, limit=50),
        {"owner": "w", "lease": timedelta(seconds=60)},
    )
    probes = index_lookups(plan, "ix_outbox_aggregate")
    assert probes, plan
    for probe in probes:
        # looked up by the candidate's aggregate, not read whole and filtered
        assert "aggregate_id" in probe.get("Index Cond", ""), probe
    assert_few_buffers(plan)
    # and it claims the heads: the first event of 50 aggregates (ids FINISHED+1 … FINISHED+50)
    assert sorted(r.id for r in rows) == list(range(FINISHED + 1, FINISHED + 51))


def test_an_ordered_types_claim_after_a_burst_probes_each_candidates_aggregate(burst: Engine) -> None:
    plan, rows = analyzed(
        burst,
        _sql.claim_statement(OUTBOX, ordered=True, ordered_types=True, limit=50),
        {"owner": "w", "lease": timedelta(seconds=60), "ordered_types": ["E"]},
    )
    for probe in index_lookups(plan, "ix_outbox_aggregate"):
        assert "aggregate_id" in probe.get("Index Cond", ""), probe
    assert_few_buffers(plan)
    assert sorted(r.id for r in rows) == list(range(FINISHED + 1, FINISHED + 51))


@pytest.mark.parametrize("unique_running", [False, True], ids=["plain", "unique_running"])
def test_a_jobs_claim_after_a_burst_stays_an_index_walk(burst: Engine, unique_running: bool) -> None:
    plan, rows = analyzed(
        burst,
        _sql.claim_statement(JOBS, limit=50, unique_running=unique_running),
        {"owner": "w", "queue_name": "default"},
    )
    assert_few_buffers(plan)
    assert sorted(r.id for r in rows) == list(range(FINISHED + 1, FINISHED + 51))
