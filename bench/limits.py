"""The price of each limit shape (docs/limits.md): the jobs drain with ``Worker(…, limits=…)`` against the same
drain without limits, in one run.

20,000 no-op jobs over 1,000 concurrency keys (20 each), 4 worker processes, batch 10. The shapes:

* ``Limit(1000)`` — a queue cap that never binds: what counting the queue's running jobs costs;
* ``Limit(5, per_key=True)`` and ``Limit(1, per_key=True)`` — per-key concurrency, the second binding at
  every instant (a key's next job waits until its running one is recorded);
* ``Limit(rate="100/s", per_key=True)`` — a rate per key that never binds (each key has 20 jobs);
* ``Limit(rate="1000000/min")`` — a rate on the queue that never binds: the worst case, since a claim counts
  the starts in the window up to the rate's count, and here that is every start of the run.

A worker whose claim finds only jobs of keys that other workers hold is idle for a moment; it runs again
until no job is left, so every run drains the whole table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, create_engine, text

from sa_outbox import Limit, Worker
from sa_outbox.models import Job

from . import db
from .drains import rotated
from .harness import Harness, Run, measured, summary, timed_processes
from .library import _record_backends
from .report import compared, cpu_per_row, row, rss_of

PROCESSES = 4
BATCH = 10
KEYS = 1_000

#: name -> (the limit of queue 'default', or None; what the table calls it)
SHAPES: dict[str, tuple[Limit | None, str]] = {
    "none": (None, "no limit"),
    "queue": (Limit(1000), "Limit(1000) on the queue (never binds)"),
    "key5": (Limit(5, per_key=True), "Limit(5, per_key=True)"),
    "key1": (Limit(1, per_key=True), "Limit(1, per_key=True) (binds: one running job per key)"),
    "keyrate": (Limit(rate="100/s", per_key=True), 'Limit(rate="100/s", per_key=True) (never binds)'),
    "rate": (Limit(rate="1000000/min"), 'Limit(rate="1000000/min") (never binds: counts every start)'),
}


def limits_worker(url: str, shape: str, h: Harness) -> None:
    engine = create_engine(url, pool_size=2)
    pids = _record_backends(engine)
    limit = SHAPES[shape][0]
    w = Worker(
        engine, Job, {"noop": lambda job: None}, batch=BATCH, listen=False, poll_interval=0.01,
        limits={"default": limit} if limit is not None else None,
    )  # fmt: skip
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
    with measured(h, lambda: list(pids)) as box:
        while True:
            w.run(install_signal_handlers=False, until_idle=True)
            with engine.connect() as conn:
                left = conn.execute(text("SELECT count(*) FROM jobs WHERE status <> 'done'")).scalar_one()
            if not left:
                break
            time.sleep(0.002)  # the rest are jobs of keys that other workers run now
        box.update(jobs=w.stats.done)
    w.close()
    engine.dispose()


def _keyed(engine: Engine, n: int) -> None:
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE jobs, jobs_starts RESTART IDENTITY"))
        conn.execute(
            text(
                "INSERT INTO jobs (task, payload, concurrency_key) "
                f"SELECT 'noop', jsonb_build_object('n', g), 'k' || (g % {KEYS}) FROM generate_series(1, :n) g"
            ),
            {"n": n},
        )
    db.vacuum(engine, "jobs")


def _drain(url: str, engine: Engine, n: int, shape: str) -> Run:
    _keyed(engine, n)
    run = timed_processes(limits_worker, [(url, shape)] * PROCESSES)
    db.check_drained(engine, "jobs", n)
    return run


def scenario_limits(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """Each limit shape's drain rate as a share of the unlimited drain's in the same run."""
    n = cfg.jobs
    runs: dict[str, list[Run]] = {shape: [] for shape in SHAPES}
    for i in range(cfg.runs):
        contenders: dict[str, Callable[[], Any]] = {
            shape: (lambda s=shape: _drain(url, engine, n, s)) for shape in SHAPES
        }
        for name, result in rotated(contenders, i).items():
            runs[name].append(result)
    rates = {shape: [n / r.seconds for r in rs] for shape, rs in runs.items()}
    rows = [
        row(
            f"jobs drain, {n:,} no-op jobs over {KEYS:,} concurrency keys, {PROCESSES} processes, batch {BATCH}, "
            "no limit (the reference of the rows below)",
            summary(rates["none"]), target="(reference)", rss=rss_of(runs["none"]), cpu=cpu_per_row(runs["none"]),
        )
    ]  # fmt: skip
    for shape, (_, label) in SHAPES.items():
        if shape == "none":
            continue
        rows.append(compared(
            f"… {label} vs no limit", rates[shape], rates["none"], "no limit", "(reported)",
            rss=rss_of(runs[shape]), cpu=cpu_per_row(runs[shape]), reference_cpu=cpu_per_row(runs["none"]),
        ))  # fmt: skip
    return rows
