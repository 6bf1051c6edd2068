"""Through PgBouncer (transaction pooling) vs direct, in one run: jobs drain throughput and wake-up latency.

A private PgBouncer (``tests.pooler.PrivatePgBouncer``: the machine's package, a free port,
``pool_mode = transaction``, a pool of 20 server connections — PgBouncer's default) in front of the benchmark's
database. Every loop behind it is built the way the docs tell users to: ``sa_outbox.pgbouncer_engine(pooled,
direct_url=server)`` — prepared statements off, LISTEN straight on the server.

* drain: 4 worker processes, no-op jobs, batch 1 and 50, three contenders in rotating order within each run —
  direct (the library's default: prepared statements), direct with prepared statements off (what the
  PgBouncer engine gives up, measured without the pooler), and through PgBouncer. Server CPU is every
  PostgreSQL process's; PgBouncer's own CPU is read from ``/proc`` beside it.
* wake-up: an idle Worker (poll every 10 s) in its own process, 200 commits 20 ms apart (``--quick``: 20):
  direct, and through PgBouncer with the helper's direct LISTEN; then the helper without ``direct_url``
  (poll only, every 1 s), for what a wake-up costs when LISTEN cannot be had.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, create_engine, make_url
from sqlalchemy.orm import Session

from . import db
from .drains import rotated
from .harness import CTX, Harness, Run, measured, proc_cpu, summary, timed_processes
from .latency import percentile
from .report import cpu_per_row, paired_ratio, row, rss_of

PROCESSES = 4
POOL = 20
MODES = ("direct", "direct, prepared statements off", "PgBouncer")


def _engine(mode: str, url: str, pooled: str) -> tuple[Engine, dict[str, Any]]:
    from sa_outbox import pgbouncer_engine

    if mode == "PgBouncer":
        return pgbouncer_engine(pooled, direct_url=url, pool_size=2)
    connect_args = {"prepare_threshold": None} if "off" in mode else {}
    return create_engine(url, pool_size=2, connect_args=connect_args), {"listen": True}


def drain_worker(url: str, pooled: str, mode: str, batch: int, h: Harness) -> None:
    """One worker process: ``run(until_idle=True)`` on the mode's engine (no LISTEN: a drain is never idle)."""
    from sa_outbox import Worker
    from sa_outbox.models import Job

    from .library import _record_backends

    engine, _ = _engine(mode, url, pooled)
    # Behind PgBouncer the backend pid psycopg reports is PgBouncer's, not a server process: not recorded.
    pids = _record_backends(engine) if mode != "PgBouncer" else []
    w = Worker(engine, Job, {"noop": lambda job: None}, batch=batch, listen=False)
    with engine.connect() as conn:
        conn.exec_driver_sql("SELECT 1")
    with measured(h, lambda: list(pids)) as box:
        w.run(install_signal_handlers=False, until_idle=True)
        box.update(jobs=w.stats.done)
    w.close()
    engine.dispose()


class _PgBouncerCpu:
    """PgBouncer's CPU seconds from the common start of a drain to its last report (``on_start`` hook)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seconds: float | None = None

    def __call__(self, _procs: list[Any]) -> Callable[[], None]:
        before = proc_cpu(self.pid)

        def after() -> None:
            now = proc_cpu(self.pid)
            self.seconds = None if before is None or now is None else now - before

        return after


def _drain(
    url: str, pooled: str, engine: Engine, n: int, mode: str, batch: int, bouncer_pid: int
) -> tuple[Run, float | None]:
    """One drain of ``n`` jobs by ``PROCESSES`` workers of the mode; with PgBouncer's CPU seconds meanwhile."""
    db.reset_jobs(engine, n)
    cpu = _PgBouncerCpu(bouncer_pid)
    run = timed_processes(drain_worker, [(url, pooled, mode, batch)] * PROCESSES, on_start=cpu)
    db.check_drained(engine, "jobs", n)
    return run, cpu.seconds


def wakeup_worker(url: str, pooled: str, mode: str, poll: float, stamps: Any, stop: Any, h: Harness) -> None:
    """An idle Worker; its handler sends (job id, perf_counter()) back (CLOCK_MONOTONIC: one clock for every
    process on the machine). ``mode``: ``direct``, ``PgBouncer`` (LISTEN on the server), or ``poll only``
    (the helper without ``direct_url``)."""
    from sa_outbox import Worker, pgbouncer_engine
    from sa_outbox.models import Job

    if mode == "direct":
        engine, wakeups = create_engine(url, pool_size=2), {"listen": True}
    else:
        engine, helper = pgbouncer_engine(
            pooled, direct_url=url if mode == "PgBouncer" else None, pool_size=2
        )
        wakeups = dict(helper)
    w = Worker(engine, Job, {"noop": lambda job: stamps.put((job.id, time.perf_counter()))}, poll_interval=poll,
               **wakeups)  # fmt: skip
    thread = threading.Thread(target=w.run, kwargs={"install_signal_handlers": False}, daemon=True)
    thread.start()
    with measured(h, lambda: []) as box:
        stop.wait(600)
        box["jobs"] = w.stats.done
        box["wakeups"] = w.stats.wakeups
    w.stop()
    thread.join(30)
    w.close()
    engine.dispose()


def _wakeups(url: str, pooled: str, mode: str, count: int, poll: float) -> tuple[list[float], Run]:
    from sa_outbox import enqueue, pgbouncer_engine
    from sa_outbox.models import Job

    stamps, stop = CTX.Queue(), CTX.Event()
    lat: list[float] = []
    producer = create_engine(url) if mode == "direct" else pgbouncer_engine(pooled)[0]

    def produce(_procs: list[Any]) -> None:
        time.sleep(0.5)  # the loop is idle, its LISTEN up
        try:
            for i in range(count):
                with Session(producer, expire_on_commit=False) as s, s.begin():
                    job = enqueue(s, Job, "noop", {"i": i})
                    s.flush()
                    t0 = time.perf_counter()  # the COMMIT is sent when the block ends
                job_id, seen = stamps.get(timeout=30)
                if job_id != job.id:
                    raise RuntimeError(f"wake-up: expected job {job.id}, got {job_id}")
                lat.append((seen - t0) * 1000)
                time.sleep(0.02)
        finally:
            stop.set()

    with producer.begin() as conn:
        conn.exec_driver_sql("TRUNCATE jobs RESTART IDENTITY")
    try:
        run = timed_processes(wakeup_worker, [(url, pooled, mode, poll, stamps, stop)], on_start=produce)
    finally:
        producer.dispose()
    return lat, run


def scenario_pgbouncer(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """Jobs drain (batch 1 and 50) and wake-up latency through a private PgBouncer in transaction mode, beside
    the same on a direct connection, in one run."""
    from tests.pooler import PrivatePgBouncer, pgbouncer_version

    server = make_url(url)
    name = str(server.database)
    bouncer = PrivatePgBouncer(server, {name: (name, POOL)})
    bouncer.start()
    assert bouncer.proc is not None
    pid = bouncer.proc.pid
    pooled = bouncer.url(name).render_as_string(hide_password=False)
    version = ".".join(map(str, pgbouncer_version()))
    rows: list[dict[str, Any]] = []
    try:
        n = cfg.jobs
        for batch in (1, 50):
            runs: dict[str, list[Run]] = {m: [] for m in MODES}
            bouncer_us: list[float] = []
            for i in range(cfg.runs):
                contenders = {
                    m: (lambda m=m, b=batch: _drain(url, pooled, engine, n, m, b, pid)) for m in MODES
                }
                for mode, (result, bouncer_s) in rotated(contenders, i).items():
                    runs[mode].append(result)
                    if mode == "PgBouncer" and bouncer_s is not None:
                        bouncer_us.append(bouncer_s / n * 1e6)
            rates = {m: [n / r.seconds for r in runs[m]] for m in MODES}
            what = f"jobs drain, {n:,} no-op jobs, {PROCESSES} processes, batch {batch}"
            rows.append(row(
                f"{what}: through PgBouncer {version} (transaction mode, pgbouncer_engine) vs direct",
                summary(rates["PgBouncer"]), reference=summary(rates["direct"]), reference_name="direct",
                ratio=paired_ratio(rates["PgBouncer"], rates["direct"]), target="(reported)",
                rss=rss_of(runs["PgBouncer"]), cpu=cpu_per_row(runs["PgBouncer"]),
                reference_cpu=cpu_per_row(runs["direct"]),
                pgbouncer_cpu_us=statistics.median(bouncer_us) if bouncer_us else None,
            ))  # fmt: skip
            rows.append(row(
                f"… batch {batch}: direct with prepared statements off (what the PgBouncer engine gives up) vs direct",
                summary(rates[MODES[1]]), reference=summary(rates["direct"]), reference_name="direct",
                ratio=paired_ratio(rates[MODES[1]], rates["direct"]), target="(reported)",
                cpu=cpu_per_row(runs[MODES[1]]),
            ))  # fmt: skip
        lat: dict[str, dict[str, list[float]]] = {}
        for i in range(cfg.runs):
            for mode in rotated({"direct": lambda: "direct", "PgBouncer": lambda: "PgBouncer"}, i):
                got, _ = _wakeups(url, pooled, mode, cfg.wakeups, poll=10)
                figures = lat.setdefault(mode, {"p50": [], "p99": []})
                figures["p50"].append(statistics.median(got))
                figures["p99"].append(percentile(got, 99))
        poll_only = [statistics.median(_wakeups(url, pooled, "poll only", min(cfg.wakeups, 10), poll=1.0)[0])
                     for _ in range(cfg.runs)]  # fmt: skip
        what = "wake-up, commit → an idle Worker calls the handler"
        for p in ("p50", "p99"):
            rows.append(row(
                f"{what}, through PgBouncer (commit through it, LISTEN on the server): {p}" if p == "p50"
                else f"… {p}", summary(lat["PgBouncer"][p]), unit="ms", reference=summary(lat["direct"][p]),
                reference_name="direct", reference_unit="ms",
                ratio=paired_ratio(lat["PgBouncer"][p], lat["direct"][p]), target="(reported)",
            ))  # fmt: skip
        rows.append(row(
            f"{what}, through PgBouncer without direct_url (poll only, poll_interval 1 s): p50",
            summary(poll_only), unit="ms", target="(reported)",
        ))  # fmt: skip
    finally:
        bouncer.close()
    return rows
