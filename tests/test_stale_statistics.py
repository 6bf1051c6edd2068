"""The claims' per-candidate probes read only their own index, whatever the planner's statistics say.

Two table shapes that production makes and that each broke a form of the probes (``_sql._keyed_probe``):

* **burst** — ANALYZE last saw a table of finished rows, then a burst arrived that autovacuum will not
  re-analyze soon (on a table of ten million rows the threshold is a million changes): the planner believes one
  row is ready. The ordered claim's NOT EXISTS, pulled up into an anti-join, read the whole aggregate index for
  every candidate (5,000,000 buffers, 3.3 s for one claim of 50); the ``unique_running`` lookups, written with
  ``status = …``, walked the dequeue index (31,000 buffers).
* **few keys** — ANALYZE ran during a backlog spread over a few aggregates / unique keys, so the planner
  expects a predecessor at once: a probe planned for its first row walked the primary key from id 1 or the
  table for every candidate (3,200,000 buffers, 24 s for one ordered claim; 4,300,000 for a jobs claim).
* **long queues** — 50 keys with 4,000 rows each: a head's probe scanning upward from the key's start read
  every later entry of the key on PostgreSQL 15 (4,800 buffers per claim with 20,000 each, 198 downward).
* **emptied** — ANALYZE saw two rows, retention deleted them and VACUUM truncated the table (no pages, no
  tuples, the old column statistics), then the long queues arrived: each probe became a Sort over a Bitmap Heap
  Scan of its whole key (4,000 entries): ANALYZE stored the type's one distinct value among two rows as a
  ratio, so on the grown table every aggregate type looked unique and each probe expected to find nothing.

* **never analyzed** — a new table took a backlog before autovacuum analyzed it (no statistics at all): the
  ordered claim read and sorted every ready row, probing each (113,000 buffers for one claim over 4,000
  events). No form of the statement avoids that; the loops' maintenance step analyzes such a table once.

The partitioned outbox keeps the plain NOT EXISTS (see ``claim_statement``); these shapes are not built for it.

Asserted on what the database reports — which index each probe reads and on which conditions, the buffers of
one claim — never on a timing. Autovacuum is off on both tables while a shape is built and checked.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool
from sqlalchemy.sql import Executable

from sa_outbox import Dispatcher, Worker, _sql
from sa_outbox.models import Base, Job, OutboxEvent
from sa_outbox.testing import RecordingPublisher

from .conftest import scratch_database
from .test_explain import nodes

OUTBOX = _sql.spec_for(OutboxEvent)
JOBS = _sql.spec_for(Job)

#: shape: (keys, finished rows, new rows, ANALYZE before the new rows arrive)
SHAPES = {
    "burst": (1_000, 100_000, 100_000, True),
    "few keys": (10, 20_000, 10_000, False),
    # the heads come first and each key has a long queue behind them: a probe that reads on past the
    # candidate (PostgreSQL 15 ends a scan on a row comparison only at its first column) reads the whole queue
    "long queues": (50, 0, 200_000, False),
    # ANALYZE saw two waiting rows; they were delivered, retention deleted them and VACUUM cut the table to no
    # pages (the statistics stay); then long queues arrived
    "emptied": (50, 2, 200_000, True),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped(request: pytest.FixtureRequest, shared_engine: Engine) -> Iterator[tuple[str, Engine]]:
    """Both tables in one of SHAPES: finished rows over ``keys`` aggregates / unique keys, then the new ones
    (outbox: pending over the same aggregates; jobs: queued, as retries of the same keys — lease_version 1,
    so a key may have many queued jobs), with ANALYZE before or after the new rows."""
    keys, finished, new, analyze_first = SHAPES[request.param]

    def write(conn: Any, n: int, *, finished: bool) -> None:
        """n rows in each table over the shape's keys (aggregates / unique keys), finished or waiting."""
        for table, columns, values, finished_at in (
            ("outbox", "aggregate_type, aggregate_id, event_type, payload", "'order', 'agg-' || (g % :k), 'E', '{}'",
             "done_at"),
            ("jobs", "task, payload, unique_key, lease_version", "'noop', '{}', 'key-' || (g % :k), 1", "finished_at"),
        ):  # fmt: skip
            if finished:
                columns, values = f"{columns}, status, {finished_at}", f"{values}, 'done', now()"
            conn.execute(
                text(f"INSERT INTO {table} ({columns}) SELECT {values} FROM generate_series(1, :n) g"),
                {"n": n, "k": keys},
            )

    def analyze(conn: Any) -> None:
        conn.execute(text("VACUUM ANALYZE outbox"))
        conn.execute(text("VACUUM ANALYZE jobs"))

    with shared_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("TRUNCATE outbox, jobs RESTART IDENTITY"))
        try:
            for table in ("outbox", "jobs"):
                conn.execute(text(f"ALTER TABLE {table} SET (autovacuum_enabled = off)"))
            # (the emptied shape's two rows were still waiting when ANALYZE saw them)
            write(conn, finished, finished=request.param != "emptied")
            if analyze_first:
                analyze(conn)
            if request.param == "emptied":
                for table in ("outbox", "jobs"):
                    conn.execute(text(f"DELETE FROM {table}"))
                    conn.execute(text(f"VACUUM {table}"))  # no ANALYZE: the two rows' statistics stay
            write(conn, new, finished=False)
            if not analyze_first:
                analyze(conn)
            yield request.param, shared_engine
        finally:
            conn.execute(text("TRUNCATE outbox, jobs RESTART IDENTITY"))
            for table in ("outbox", "jobs"):
                conn.execute(text(f"ALTER TABLE {table} RESET (autovacuum_enabled)"))
            analyze(conn)


def analyzed(engine: Engine, stmt: Executable, params: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """EXPLAIN (ANALYZE, BUFFERS) of one claim, rolled back: its plan and the rows it claimed."""
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


def probes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The scans inside the claim's subplans (the per-candidate probes)."""
    return [
        scan
        for sub in nodes(plan)
        if sub.get("Parent Relationship") == "SubPlan"
        for scan in nodes(sub)
        if "Scan" in scan["Node Type"]
    ]


def index_probes(plan: dict[str, Any]) -> int:
    """How many times the claim's subplans descended an index: one per probe, whatever the plan's shape (an
    Index Scan is one node per probe; a Bitmap Heap Scan over a Bitmap Index Scan, which leftover statistics
    can bring, is two)."""
    return sum(scan["Actual Loops"] for scan in probes(plan) if "Index Name" in scan)


def assert_probes_read(plan: dict[str, Any], index: str, *columns: str) -> None:
    """Every probe is a scan of ``index`` whose index condition names each of ``columns``: a lookup, not a
    walk of the primary key, another partial index or the table."""
    found = probes(plan)
    assert found, "the probes are not per-candidate subplans"
    for probe in found:
        assert probe.get("Index Name") == index, probe
        for column in columns:
            assert column in probe.get("Index Cond", ""), probe
        # and each lookup stops near where it started: a descent and a leaf page, the nearest older row
        per_lookup = probe["Shared Hit Blocks"] / max(probe["Actual Loops"], 1)
        assert per_lookup < 8, f"{per_lookup:.1f} buffers per lookup of {index}"


def assert_few_buffers(plan: dict[str, Any], candidates: int) -> None:
    """The claim walks each ready candidate once (the blocked ones too): a few buffers each, plus the 50 it
    claims — the walks of the broken plans read thousands per candidate."""
    touched = plan["Shared Hit Blocks"] + plan.get("Shared Read Blocks", 0)
    assert touched < 10 * candidates + 5_000, f"one claim of 50 touched {touched:,} buffers"


def test_the_statistics_are_what_the_shape_says(shaped: tuple[str, Engine]) -> None:
    """The premise, for each table: after a burst the planner expects (almost) no ready row; with few keys
    it expects the backlog; emptied, it expects a key to hold (almost) nothing of what it holds — without that
    the tests below prove nothing."""
    shape, engine = shaped
    keys, _, new, analyze_first = SHAPES[shape]
    with engine.connect() as conn:

        def estimate(sql: str) -> float:
            return float(
                conn.execute(text("EXPLAIN (FORMAT JSON) " + sql)).scalar_one()[0]["Plan"]["Plan Rows"]
            )

        if shape == "emptied":
            for sql in (
                "SELECT id FROM outbox WHERE aggregate_id = 'agg-7'",
                "SELECT id FROM jobs WHERE unique_key = 'key-7'",
            ):
                assert estimate(sql) < new / keys / 100, (sql, estimate(sql))  # it holds new / keys
            # one type among two rows, kept as a ratio of the rows: on the grown table, every type unique
            ratio = conn.execute(
                text(
                    "SELECT n_distinct FROM pg_stats WHERE schemaname = current_schema() AND tablename = 'outbox' "
                    "AND attname = 'aggregate_type'"
                )
            ).scalar_one()
            assert ratio < 0, ratio
            return
        for sql in (
            "SELECT id FROM outbox WHERE status = 'pending'",
            "SELECT id FROM jobs WHERE status = 'queued'",
        ):
            if analyze_first:  # analyzed before the new rows: it expects (almost) none ready
                assert estimate(sql) < new / 100, (sql, estimate(sql))
            else:
                assert estimate(sql) > new / 2, (sql, estimate(sql))  # ANALYZE saw the backlog


def heads(shape: str) -> list[int]:
    """The first new row of each key, up to 50 (the new rows come after the finished ones, keys in turn)."""
    keys, finished, _, _ = SHAPES[shape]
    return list(range(finished + 1, finished + 1 + min(keys, 50)))


@pytest.mark.parametrize("ordered_types", [False, True], ids=["ordered", "ordered_types"])
def test_an_ordered_claim_looks_each_candidates_aggregate_up(
    shaped: tuple[str, Engine], ordered_types: bool
) -> None:
    shape, engine = shaped
    params: dict[str, Any] = {"owner": "w", "lease": timedelta(seconds=60)}
    if ordered_types:
        params["ordered_types"] = ["E"]
    plan, rows = analyzed(
        engine, _sql.claim_statement(OUTBOX, ordered=True, ordered_types=ordered_types, limit=50), params
    )
    assert_probes_read(plan, "ix_outbox_aggregate", "aggregate_id", "id")
    assert_few_buffers(plan, SHAPES[shape][2])
    assert sorted(r.id for r in rows) == heads(shape)  # the heads of the aggregates, and only those


def test_the_heads_form_descends_the_aggregate_index_once_per_aggregate(shaped: tuple[str, Engine]) -> None:
    """The ordered claim's other form reads the first unfinished row of each aggregate through
    ix_outbox_aggregate — a few buffers per aggregate, whatever the statistics — and claims the same heads."""
    shape, engine = shaped
    keys, _, _, _ = SHAPES[shape]
    plan, rows = analyzed(
        engine,
        _sql.claim_statement(OUTBOX, ordered=True, limit=50, heads=True),
        {"owner": "w", "lease": timedelta(seconds=60)},
    )
    touched = plan["Shared Hit Blocks"] + plan.get("Shared Read Blocks", 0)
    assert touched < 20 * keys + 1_000, f"one claim over {keys} aggregates touched {touched:,} buffers"
    assert sorted(r.id for r in rows) == heads(shape)


def test_a_unique_running_claim_looks_each_candidates_key_up(shaped: tuple[str, Engine]) -> None:
    shape, engine = shaped
    plan, rows = analyzed(
        engine,
        _sql.claim_statement(JOBS, limit=50, unique_running=True),
        {"owner": "w", "queue_name": "default"},
    )
    assert_probes_read(plan, "ix_jobs_unique_active", "unique_key", "status")
    assert_few_buffers(plan, SHAPES[shape][2])
    assert sorted(r.id for r in rows) == heads(shape)  # the oldest queued job of each key


def test_a_plain_jobs_claim_stays_a_walk_of_the_dequeue_index(shaped: tuple[str, Engine]) -> None:
    shape, engine = shaped
    plan, rows = analyzed(
        engine, _sql.claim_statement(JOBS, limit=50), {"owner": "w", "queue_name": "default"}
    )
    touched = plan["Shared Hit Blocks"] + plan.get("Shared Read Blocks", 0)
    assert touched < 5_000, f"one claim of 50 touched {touched:,} buffers"
    finished = SHAPES[shape][1]
    assert sorted(r.id for r in rows) == list(range(finished + 1, finished + 51))


# --- never analyzed ------------------------------------------------------------------------------------------


@pytest.fixture
def never_analyzed(server_url: URL) -> Iterator[Engine]:
    """A database of its own with the library's tables, autovacuum off on them, and rows but no planner
    statistics: 4,000 pending events over 200 aggregates and 4,000 queued jobs over 200 unique keys — a new
    table that took a backlog before autovacuum reached it."""
    with scratch_database(server_url, "sa_outbox_stats") as url:
        engine = create_engine(url, poolclass=NullPool)
        try:
            Base.metadata.create_all(engine)
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                for table in ("outbox", "jobs"):
                    conn.execute(text(f"ALTER TABLE {table} SET (autovacuum_enabled = off)"))
            yield engine
        finally:
            engine.dispose()


def _backlog(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                "SELECT 'order', 'agg-' || (g % 200), 'E', '{}' FROM generate_series(1, 4000) g"
            )
        )
        conn.execute(
            text(
                "INSERT INTO jobs (task, payload, unique_key, lease_version) "
                "SELECT 'noop', '{}', 'key-' || (g % 200), 1 FROM generate_series(1, 4000) g"
            )
        )


@contextlib.contextmanager
def _recording(engine: Engine, **options: Any) -> Iterator[Dispatcher]:
    """A dispatcher on ``engine`` with a recording publisher and no LISTEN, closed afterwards."""
    dispatcher = Dispatcher(engine, OutboxEvent, RecordingPublisher(), listen=False, **options)
    try:
        yield dispatcher
    finally:
        dispatcher.close()


def _run(loop: Any, batches: int = 1, *, next_step: bool = False) -> None:
    """One short run of a loop (``batches`` claims at most); ``next_step``: once its next maintenance step is
    due (the step that looks after the table's statistics runs at most once per ``_rescuer.every``)."""
    if next_step:
        time.sleep(loop._rescuer.every)
    loop.run(install_signal_handlers=False, max_batches=batches)


def _has_statistics(engine: Engine, table: str) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(_sql.STATISTICS_PRESENT, {"t": table}).scalar_one())


def _ordered_claim(engine: Engine) -> tuple[dict[str, Any], list[Any]]:
    params = {"owner": "w", "lease": timedelta(seconds=60)}
    return analyzed(engine, _sql.claim_statement(OUTBOX, ordered=True, limit=50), params)


def test_a_loop_gives_a_table_with_rows_but_no_statistics_its_first_analyze(never_analyzed: Engine) -> None:
    """Without statistics the ordered claim reads and sorts every ready row, probing each (the premise, checked
    first: 113,000 buffers for one claim over 4,000 events). A loop's first maintenance step analyzes the table;
    the claim then walks the ready index to the 50 heads."""
    engine = never_analyzed
    _backlog(engine)
    plan, rows = _ordered_claim(engine)
    touched = plan["Shared Hit Blocks"] + plan.get("Shared Read Blocks", 0)
    assert touched > 20_000, f"the premise: without statistics one claim touched only {touched:,} buffers"
    assert sorted(r.id for r in rows) == list(range(1, 51))
    assert not _has_statistics(engine, "outbox") and not _has_statistics(engine, "jobs")

    dispatcher = Dispatcher(engine, OutboxEvent, RecordingPublisher(), ordered=True, listen=False)
    worker = Worker(engine, Job, {"noop": lambda job: None}, listen=False, unique_running=True)
    try:
        _run(dispatcher)
        _run(worker)
        _run(dispatcher, next_step=True)  # the first maintenance step after their claims
        _run(worker)
    finally:
        dispatcher.close()
        worker.close()
    assert _has_statistics(engine, "outbox") and _has_statistics(engine, "jobs")
    plan, rows = _ordered_claim(engine)
    touched = plan["Shared Hit Blocks"] + plan.get("Shared Read Blocks", 0)
    assert touched < 2_000, f"one claim of 50 touched {touched:,} buffers after ANALYZE"
    assert len(rows) == 50  # the next heads (the dispatcher delivered the first 50)


def test_an_empty_table_is_left_alone_and_analyzed_once_rows_arrive(never_analyzed: Engine) -> None:
    """ANALYZE of an empty table stores nothing: a loop that has claimed nothing asks nothing; once its claims
    find rows, its next maintenance step analyzes."""
    engine = never_analyzed
    with _recording(engine, ordered=True) as dispatcher:
        _run(dispatcher)
        assert not _has_statistics(engine, "outbox")
        _backlog(engine)
        _run(dispatcher)  # claims the first rows
        _run(dispatcher, next_step=True)
    assert _has_statistics(engine, "outbox")


def test_an_analyze_skipped_for_a_lock_is_no_privilege_warning_and_is_asked_again(
    never_analyzed: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Another session holds a lock that ANALYZE (SKIP_LOCKED) skips for — another loop's ANALYZE, most often
    (several loops start at once). A review saw the warning meant for a role that may not analyze logged by a
    superuser: now the loop says nothing at WARNING and asks again at its next maintenance step, which
    analyzes once the lock is gone."""
    engine = never_analyzed
    _backlog(engine)
    with _recording(engine) as dispatcher:
        with engine.connect() as holder, caplog.at_level("WARNING", logger="sa_outbox"):
            holder.execute(text("LOCK TABLE outbox IN SHARE UPDATE EXCLUSIVE MODE"))  # (what ANALYZE takes)
            _run(dispatcher, 2)
            _run(dispatcher, 2, next_step=True)  # its maintenance step: skipped
            assert not _has_statistics(engine, "outbox")
            holder.rollback()
        assert not [r for r in caplog.records if "could not ANALYZE" in r.getMessage()]
        _run(dispatcher, 2, next_step=True)  # asked again: analyzed
    assert _has_statistics(engine, "outbox")


def test_a_table_emptied_before_its_first_analyze_is_analyzed_once_not_every_second(
    never_analyzed: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop's claims found rows, then the table was emptied (a purge) before its maintenance step: ANALYZE
    finds nothing to sample and stores no statistics. That is no lock to wait out: a review saw eaf8611 run
    ANALYZE every second for as long as the table stayed empty (12 in 12.7 s), logging a lock nobody held."""
    engine = never_analyzed
    analyzed: list[str] = []
    real = _sql.analyze_statement

    def counted(name: str) -> Any:
        analyzed.append(name)
        return real(name)

    monkeypatch.setattr(_sql, "analyze_statement", counted)
    _backlog(engine)
    with _recording(engine) as dispatcher:
        _run(dispatcher)  # claims rows
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM outbox"))
        for _ in range(3):
            _run(dispatcher, next_step=True)  # a maintenance step each
    assert analyzed == ["outbox"]
    assert not _has_statistics(engine, "outbox")


def test_a_role_that_may_not_analyze_says_so_once_and_delivers_all_the_same(
    never_analyzed: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The dispatcher's documented grants (SELECT, UPDATE) do not allow ANALYZE: PostgreSQL skips it with a
    warning, and the loop says once what to run, then goes on delivering."""
    engine = never_analyzed
    _backlog(engine)
    role = f"sa_outbox_noanalyze_{uuid.uuid4().hex[:6]}"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN"))
        conn.execute(text(f"GRANT USAGE ON SCHEMA public TO {role}"))
        conn.execute(text(f"GRANT SELECT, UPDATE ON outbox TO {role}"))
    limited = create_engine(engine.url.set(username=role, password=None), poolclass=NullPool)
    pub = RecordingPublisher()
    try:
        with caplog.at_level("WARNING", logger="sa_outbox"):
            dispatcher = Dispatcher(limited, OutboxEvent, pub, listen=False)
            try:
                _run(dispatcher, 3)
                _run(dispatcher, 3, next_step=True)
            finally:
                dispatcher.close()
    finally:
        limited.dispose()
        with engine.begin() as conn:
            conn.execute(
                text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'")
            )
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))
    assert len(pub.ids) == 6 * 50
    assert not _has_statistics(engine, "outbox")
    said = [r.getMessage() for r in caplog.records if "could not ANALYZE" in r.getMessage()]
    assert len(said) == 1 and "(run ANALYZE outbox" in said[0], said
