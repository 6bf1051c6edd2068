"""The partitioned layout (docs/partitioning.md) beside the plain table, on the same rows (issue 23).

Two outbox tables in the schema ``pbench`` hold the same ``--partition-rows`` rows (default 1,000,000): ten
days of history, 98 % done, and 20,000 pending rows of today over 1,000 aggregates. ``plain`` is the
OutboxMixin table; ``parted`` is the same model with ``sa_outbox_partitioned = "day"`` (ten past
partitions, today's and three ahead).

* **claim + finalize**: one process drains the pending rows with the dispatcher's own database step (the
  previous batch's outcomes and the next claim of 50 in one statement, the batch written in, autocommit):
  milliseconds per statement and rows per second, plain and ordered (per-aggregate) claim; the tables take
  turns, the order rotating from run to run, and the ratio is taken within each run.
* **retention**: retiring the oldest day (``maintain_partitions``: ``DETACH … CONCURRENTLY`` + ``DROP``) against
  ``purge`` of the same rows from the plain table followed by ``VACUUM`` — seconds and WAL bytes
  (``pg_current_wal_lsn()`` before and after; other sessions' WAL on a shared server counts too). The other
  past days each keep one pending row, so only the oldest day is finished and retired.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, MetaData, text
from sqlalchemy.orm import DeclarativeBase

from sa_outbox import OutboxMixin, maintain_partitions, purge
from sa_outbox import _steps as eng
from sa_outbox._partitions import partition_name, period_start
from sa_outbox._sql import create_partition_ddl, spec_for
from sa_outbox.migration import storage_parameters_sql

from .drains import rotated
from .harness import summary
from .report import paired_ratio, row

SCHEMA = "pbench"
DAYS = 10
PENDING = 20_000
AGGREGATES = 1_000
BATCH = 50


class _Base(DeclarativeBase):
    metadata = MetaData(schema=SCHEMA)


class Plain(OutboxMixin, _Base):
    __tablename__ = "plain"


class Parted(OutboxMixin, _Base):
    __tablename__ = "parted"
    sa_outbox_partitioned = "day"


def _fill(engine: Engine, rows: int) -> None:
    """The same rows in both tables: ``rows - PENDING`` done rows over the last ten days (done a minute after
    being written), then PENDING pending rows of today (aggregate_type 'p', to reset them between drains)."""
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
        conn.execute(text(f"CREATE SCHEMA {SCHEMA}"))
        _Base.metadata.create_all(conn)
        now = conn.execute(text("SELECT now()")).scalar_one()
        today = period_start(now, "day")
        prep = conn.dialect.identifier_preparer
        for d in range(1, DAYS + 1):
            start = today - timedelta(days=d)
            name = partition_name("parted", start)
            conn.execute(
                text(create_partition_ddl(prep, Parted.__table__, name, start, start + timedelta(days=1),
                                          storage_parameters_sql()))
            )  # fmt: skip
    history = rows - PENDING
    for table in ("plain", "parted"):
        with engine.begin() as conn:
            # created_at spread evenly over the ten past days, oldest first (ids follow time, as in life)
            conn.execute(
                text(
                    f"INSERT INTO {SCHEMA}.{table} (aggregate_type, aggregate_id, event_type, payload, created_at,"
                    " status, done_at) SELECT 'h', 'a' || (g % :aggs), 'E', jsonb_build_object('n', g),"
                    " date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - interval '10 days'"
                    " + (g - 1) * (interval '10 days' / :history),"
                    " 'done', date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - interval '10 days'"
                    " + (g - 1) * (interval '10 days' / :history) + interval '1 minute'"
                    " FROM generate_series(1, :history) g"
                ),
                {"aggs": AGGREGATES, "history": history},
            )
            conn.execute(
                text(
                    f"INSERT INTO {SCHEMA}.{table} (aggregate_type, aggregate_id, event_type, payload) "
                    "SELECT 'p', 'a' || (g % :aggs), 'E', jsonb_build_object('n', g) FROM generate_series(1, :n) g"
                ),
                {"aggs": AGGREGATES, "n": PENDING},
            )
            # One pending row in each past day but the oldest: those partitions stay alive.
            conn.execute(
                text(
                    f"UPDATE {SCHEMA}.{table} SET status = 'pending', done_at = NULL, available_at = now() + "
                    "interval '1 day', aggregate_id = 'keeper-' || id WHERE id IN (SELECT min(id) FROM "
                    f"{SCHEMA}.{table} WHERE aggregate_type = 'h' GROUP BY date_trunc('day', created_at AT TIME "
                    "ZONE 'UTC') ORDER BY 1 OFFSET 1)"
                )
            )
    _vacuum(engine)


def _vacuum(engine: Engine) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in ("plain", "parted"):
            conn.execute(text(f"VACUUM ANALYZE {SCHEMA}.{table}"))


def _reset(engine: Engine) -> None:
    with engine.begin() as conn:
        for table in ("plain", "parted"):
            conn.execute(
                text(
                    f"UPDATE {SCHEMA}.{table} SET status = 'pending', done_at = NULL, lease_owner = NULL, "
                    "lease_until = NULL WHERE aggregate_type = 'p'"
                )
            )
    _vacuum(engine)


def _drain(engine: Engine, model: Any, ordered: bool) -> tuple[float, int, int]:
    """(seconds, statements, rows) of one drain of the pending rows with the dispatcher's database step."""
    spec = spec_for(model)
    rows = statements = 0
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        outcomes: list[eng.Outcome] = []
        started = time.perf_counter()
        while True:
            _, got = eng.finalize_and_claim(
                conn, spec, outcomes, owner="bench", batch=BATCH, lease=timedelta(seconds=60), ordered=ordered,
                fixed_batch=True,
            )  # fmt: skip
            statements += 1
            rows += len(got)
            outcomes = [eng.Outcome(r[0], r[1], "done") for r in got]
            if not got:
                break
        seconds = time.perf_counter() - started
    if rows != PENDING:
        raise AssertionError(f"drained {rows} of {PENDING} rows from {spec.table.fullname}")
    return seconds, statements, rows


def _wal(engine: Engine) -> Any:
    with engine.connect() as conn:
        return conn.execute(text("SELECT pg_current_wal_lsn()")).scalar_one()


def _wal_since(engine: Engine, lsn: Any) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), :l)"), {"l": lsn}).scalar_one()
        )


def _retire(engine: Engine) -> tuple[float, int, int]:
    lsn = _wal(engine)
    started = time.perf_counter()
    report = maintain_partitions(engine, Parted, ahead=3)
    seconds = time.perf_counter() - started
    if len(report.retired) != 1 or report.errors:
        raise AssertionError(f"expected one retired partition: {report}")
    return seconds, _wal_since(engine, lsn), len(report.kept)


def _purge_and_vacuum(engine: Engine) -> tuple[float, int, int]:
    with engine.connect() as conn:
        oldest_end = conn.execute(
            text("SELECT date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - interval '9 days'")
        ).scalar_one()
        older_than = conn.execute(text("SELECT now() - :e"), {"e": oldest_end}).scalar_one()
    lsn = _wal(engine)
    started = time.perf_counter()
    deleted = purge(engine, Plain, older_than=older_than)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"VACUUM {SCHEMA}.plain"))
    seconds = time.perf_counter() - started
    return seconds, _wal_since(engine, lsn), deleted


def scenario_partitions(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    rows_total = cfg.partition_rows
    _fill(engine, rows_total)
    out: list[dict[str, Any]] = []
    for ordered in (False, True):
        rates: dict[str, list[float]] = {"parted": [], "plain": []}
        per_stmt: dict[str, list[float]] = {"parted": [], "plain": []}
        for i in range(cfg.runs):
            contenders = {
                "parted": lambda o=ordered: _drain(engine, Parted, o),
                "plain": lambda o=ordered: _drain(engine, Plain, o),
            }
            for name, (seconds, statements, rows) in rotated(contenders, i).items():
                rates[name].append(rows / seconds)
                per_stmt[name].append(seconds / statements * 1000)
            _reset(engine)
        what = f"{'ordered ' if ordered else ''}drain of {PENDING:,} of {rows_total:,} rows, batch {BATCH}, 1 process"
        out.append(row(
            f"{what}: daily partitions (10 past + today + 3 ahead) vs the plain table",
            summary(rates["parted"]), reference=summary(rates["plain"]), reference_name="plain table",
            ratio=paired_ratio(rates["parted"], rates["plain"]), target="(reported)",
        ))  # fmt: skip
        out.append(row(
            f"… {'ordered ' if ordered else ''}claim + finalize statement, ms each: partitioned vs plain",
            summary(per_stmt["parted"]), unit="ms", reference=summary(per_stmt["plain"]),
            reference_name="plain table", ratio=paired_ratio(per_stmt["parted"], per_stmt["plain"]),
            target="(reported)",
        ))  # fmt: skip
    retire_s, retire_wal, kept = _retire(engine)
    purge_s, purge_wal, deleted = _purge_and_vacuum(engine)
    out.append(row(
        f"retention of the oldest day ({deleted:,} done rows): maintain_partitions (DETACH CONCURRENTLY + DROP; "
        f"{kept} partitions kept by a pending row) vs purge + VACUUM of the plain table, seconds",
        summary([retire_s]), unit="s", reference=summary([purge_s]), reference_name="purge + VACUUM",
        ratio=summary([retire_s / purge_s]), target="(reported)",
    ))  # fmt: skip
    out.append(row(
        "… WAL written, MB (pg_current_wal_lsn diff; other sessions' WAL included)",
        summary([retire_wal / 1e6]), unit="MB", reference=summary([purge_wal / 1e6]),
        reference_name="purge + VACUUM", ratio=summary([retire_wal / max(purge_wal, 1)]), target="(reported)",
    ))  # fmt: skip
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
    return out
