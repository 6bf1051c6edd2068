"""Bulk enqueue, enqueue per job, and the claim cost of ``unique_running`` (issue #21).

``bulk``: ``enqueue_many`` against a plain ``INSERT … SELECT FROM unnest(…)`` of the same rows (psycopg on a
held connection, binary parameters, payloads JSON-encoded by ``json.dumps``, no RETURNING) and against ``COPY`` (no ids back),
1,000 and 10,000 rows per call; then ``enqueue`` in a ``Session`` against a Core single-row ``INSERT`` per
job, 1 and 10 jobs per transaction, and ``enqueue(…, unique_key=…)`` beside them. Single connection, this
process: within a run the writers take turns in blocks (the order rotating), so each meets the same
conditions, and the ratio is taken within the run.

``unique``: four processes drain the same keyed jobs with the worker's own database step (finalize of the
previous batch + claim of the next, one statement, batch 10 written in, autocommit) — once with
``unique_running=True``, once without: the price of the per-key check, with every job keyed by a key of its
own, and with 1,000 keys of 20 jobs each.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, create_engine, insert, text
from sqlalchemy.orm import Session

from sa_outbox import _steps as eng
from sa_outbox import enqueue, enqueue_many
from sa_outbox._sql import spec_for
from sa_outbox.models import Job

from . import db
from .drains import rotated
from .harness import Harness, Run, measured, timed_processes
from .library import _record_backends
from .report import compared, cpu_per_row, rss_of

# --- bulk: enqueue_many vs unnest vs COPY ---------------------------------------------------------------


def _rows(start: int, n: int) -> list[tuple[str, dict[str, Any]]]:
    return [("noop", {"n": i, "tenant": "acme"}) for i in range(start, start + n)]


def _write_enqueue_many(engine: Engine, rows: list[Any], per_call: int) -> float:
    started = time.perf_counter()
    for i in range(0, len(rows), per_call):
        with Session(engine) as s, s.begin():
            enqueue_many(s, Job, rows[i : i + per_call])
    return time.perf_counter() - started


_UNNEST = "INSERT INTO jobs (task, payload) SELECT t, p FROM unnest(%s::text[], %s::jsonb[]) AS u(t, p)"


def _write_unnest(engine: Engine, rows: list[Any], per_call: int) -> float:
    with engine.connect() as conn:
        driver = conn.connection.driver_connection
        assert driver is not None
        driver.commit()
        started = time.perf_counter()
        for i in range(0, len(rows), per_call):
            chunk = rows[i : i + per_call]
            with driver.transaction():
                # binary parameters, as the library sends its own: the faster of psycopg's two formats
                driver.execute(
                    _UNNEST, ([t for t, _ in chunk], [json.dumps(p) for _, p in chunk]), binary=True
                )
        return time.perf_counter() - started


def _write_copy(engine: Engine, rows: list[Any], per_call: int) -> float:
    with engine.connect() as conn:
        driver = conn.connection.driver_connection
        assert driver is not None
        driver.commit()
        started = time.perf_counter()
        for i in range(0, len(rows), per_call):
            with driver.transaction(), driver.cursor().copy("COPY jobs (task, payload) FROM STDIN") as copy:
                for t, p in rows[i : i + per_call]:
                    copy.write_row((t, json.dumps(p)))
        return time.perf_counter() - started


# --- per job: enqueue in a session vs a Core INSERT --------------------------------------------------------


def _write_enqueue(engine: Engine, rows: list[Any], per_tx: int) -> float:
    started = time.perf_counter()
    for i in range(0, len(rows), per_tx):
        with Session(engine) as s, s.begin():
            for task, payload in rows[i : i + per_tx]:
                enqueue(s, Job, task, payload)
    return time.perf_counter() - started


def _write_unique_enqueue(engine: Engine, rows: list[Any], per_tx: int) -> float:
    started = time.perf_counter()
    for i in range(0, len(rows), per_tx):
        with Session(engine) as s, s.begin():
            for task, payload in rows[i : i + per_tx]:
                enqueue(s, Job, task, payload, unique_key=f"u{payload['n']}")
    return time.perf_counter() - started


def _write_core(engine: Engine, rows: list[Any], per_tx: int) -> float:
    stmt = insert(Job.__table__)
    started = time.perf_counter()
    for i in range(0, len(rows), per_tx):
        with engine.begin() as conn:
            for task, payload in rows[i : i + per_tx]:
                conn.execute(stmt, {"task": task, "payload": payload})
    return time.perf_counter() - started


def _turns(
    engine: Engine,
    writers: dict[str, Callable[[Engine, list[Any], int], float]],
    n: int,
    size: int,
    runs: int,
) -> dict[str, list[float]]:
    """Rows per second of each writer in each run: ``n`` rows each, in 10 blocks taken in turn."""
    blocks = 10
    per_block = n // blocks
    rates: dict[str, list[float]] = {name: [] for name in writers}
    for _ in range(runs):
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE jobs RESTART IDENTITY"))
        spent = dict.fromkeys(writers, 0.0)
        for b in range(blocks):
            names = list(writers)
            for k, name in enumerate(names[b % len(names) :] + names[: b % len(names)]):
                rows = _rows((b * len(names) + k) * per_block, per_block)
                spent[name] += writers[name](engine, rows, size)
        for name in writers:
            rates[name].append(per_block * blocks / spent[name])
    return rates


def scenario_bulk(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """enqueue_many vs an unnest INSERT and COPY; enqueue per job vs a Core INSERT per job."""
    rows: list[dict[str, Any]] = []
    n = 20_000 if cfg.quick else 100_000
    for per_call in (1_000, 10_000):
        rates = _turns(
            engine,
            {"enqueue_many": _write_enqueue_many, "unnest": _write_unnest, "copy": _write_copy},
            n,
            per_call,
            cfg.runs,
        )
        what = f"bulk enqueue, {n:,} jobs, {per_call:,} per call"
        rows.append(compared(
            f"{what}: enqueue_many vs a plain INSERT … SELECT FROM unnest (psycopg, json.dumps, no RETURNING)",
            rates["enqueue_many"], rates["unnest"], "unnest INSERT", "≥ 0.7× (≥ 100,000/s)",
        ))  # fmt: skip
        rows.append(compared(
            f"… {per_call:,} per call: COPY of the same rows (no ids back) vs the unnest INSERT",
            rates["copy"], rates["unnest"], "unnest INSERT", "(reported)",
        ))  # fmt: skip
    n_single = 2_000 if cfg.quick else 10_000
    for per_tx in (1, 10):
        rates = _turns(
            engine,
            {"enqueue": _write_enqueue, "core": _write_core, "unique": _write_unique_enqueue},
            n_single,
            per_tx,
            cfg.runs,
        )
        what = f"enqueue per job, {per_tx} job(s) per transaction"
        rows.append(compared(
            f"{what}: enqueue in a Session vs a Core single-row INSERT per job",
            rates["enqueue"], rates["core"], "Core INSERT", "≥ 0.7×",
        ))  # fmt: skip
        rows.append(compared(
            f"… {per_tx} per transaction: enqueue(…, unique_key=…) (written at once) vs the Core INSERT",
            rates["unique"], rates["core"], "Core INSERT", "(reported)",
        ))  # fmt: skip
    return rows


# --- unique: the claim with and without unique_running ------------------------------------------------------

JOBS = spec_for(Job)
CLAIM_PROCESSES = 4
CLAIM_BATCH = 10


def claim_loop(url: str, unique_running: bool, h: Harness) -> None:
    """The worker's database step in a loop — the previous batch's outcomes and the next claim in one
    statement, the batch written in — with no-op jobs, until nothing is left to claim."""
    engine = create_engine(url, pool_size=1)
    backends = _record_backends(engine)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("SELECT 1"))
        with measured(h, lambda: backends) as box:
            outcomes: list[eng.Outcome] = []
            while True:
                _, got = eng.finalize_and_claim(
                    conn, JOBS, outcomes, owner="bench", batch=CLAIM_BATCH, queue="default", fixed_batch=True,
                    unique_running=unique_running,
                )  # fmt: skip
                outcomes = [eng.Outcome(r[0], r[1], "done") for r in got]
                box["jobs"] += len(got)
                box["claims"] = box.get("claims", 0) + 1
                if len(got) < CLAIM_BATCH:
                    box["short_claims"] = box.get("short_claims", 0) + 1
                if not got:
                    # keys held by other processes may still block jobs: quit only when none is queued
                    left = conn.execute(text("SELECT count(*) FROM jobs WHERE status <> 'done'")).scalar_one()
                    if not left:
                        break
                    time.sleep(0.001)
    engine.dispose()


def _keyed_jobs(engine: Engine, n: int, keys: int | None) -> None:
    """``n`` queued no-op jobs; each with a key of its own, or ``keys`` keys (as retries, lease_version 1, so
    that one key may have many queued jobs)."""
    key = "'k' || g" if keys is None else f"'k' || (g % {keys})"
    version = 0 if keys is None else 1
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE jobs RESTART IDENTITY"))
        conn.execute(
            text(
                "INSERT INTO jobs (task, payload, unique_key, lease_version) "
                f"SELECT 'noop', jsonb_build_object('n', g), {key}, {version} FROM generate_series(1, :n) g"
            ),
            {"n": n},
        )
    db.vacuum(engine, "jobs")


def _claim_drain(url: str, engine: Engine, n: int, keys: int | None, unique_running: bool) -> Run:
    _keyed_jobs(engine, n, keys)
    run = timed_processes(claim_loop, [(url, unique_running)] * CLAIM_PROCESSES)
    db.check_drained(engine, "jobs", n)
    return run


def scenario_unique(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """Claim throughput with unique_running against the same drain without it."""
    n = cfg.jobs
    rows = []
    for keys, label in ((None, "every job with a key of its own"), (1_000, "1,000 keys × 20 jobs (retries)")):
        jobs = n if keys is None else keys * 20
        runs: dict[str, list[Run]] = {"with": [], "without": []}
        for i in range(cfg.runs):
            contenders: dict[str, Callable[[], Any]] = {
                "with": lambda j=jobs, k=keys: _claim_drain(url, engine, j, k, True),
                "without": lambda j=jobs, k=keys: _claim_drain(url, engine, j, k, False),
            }
            for name, result in rotated(contenders, i).items():
                runs[name].append(result)
        with_ = [jobs / r.seconds for r in runs["with"]]
        without = [jobs / r.seconds for r in runs["without"]]
        rows.append(compared(
            f"claim + finalize, {jobs:,} keyed no-op jobs ({label}), {CLAIM_PROCESSES} processes, batch "
            f"{CLAIM_BATCH}: unique_running=True vs the same claim without it",
            with_, without, "without unique_running", "(reported)", rss=rss_of(runs["with"]),
            cpu=cpu_per_row(runs["with"]), reference_cpu=cpu_per_row(runs["without"]),
            short_claims={name: [sum(rep.get("short_claims", 0) for rep in r.reports) for r in rs]
                          for name, rs in runs.items()},
        ))  # fmt: skip
    return rows
