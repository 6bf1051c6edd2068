"""Throughput scenarios: the library's loops drain a queue, beside what the issue compares them with.

Within one run every contender drains the same number of rows on the same database, one after the other in
an order that rotates from run to run (so each meets the machine's drift as often as the others); a ratio is
taken within a run, then its median and spread over the runs are reported.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from . import baseline, ceiling, db
from .harness import Run, summary, timed_processes
from .library import LoopOptions, library_async_loop, library_dispatcher, library_worker
from .report import cpu_per_row, paired_ratio, row, rss_of

JOBS_PROCESSES = 4
JOB_TARGETS = {1: "≥ 1.5×", 10: "≥ 3.5×", 50: "≥ 5.5×"}
CEILING_TARGETS = {1: "(reported)", 10: "≥ 0.8", 50: "≥ 0.8"}


def rotated(contenders: dict[str, Callable[[], Any]], run: int) -> dict[str, Any]:
    """Run each contender once, starting with a different one each run; their results by name."""
    names = list(contenders)
    order = names[run % len(names) :] + names[: run % len(names)]
    return {name: contenders[name]() for name in order}


def library_drain(url: str, engine: Engine, n: int, procs: int, opts: LoopOptions) -> Run:
    db.reset_jobs(engine, n)
    run = timed_processes(library_worker, [(url, opts)] * procs)
    db.check_drained(engine, "jobs", n)
    return run


def document_drain(url: str, engine: Engine, n: int, procs: int, batch: int, job_seconds: float) -> Run:
    baseline.reset(engine, n)
    run = timed_processes(baseline.baseline_worker, [(db.libpq(url), batch, job_seconds)] * procs)
    done = baseline.done_count(engine)
    if done != n:
        raise RuntimeError(f"document worker: {done} of {n} jobs done after the drain")
    return run


def ceiling_drain(
    url: str, engine: Engine, n: int, clients: int, batch: int, script_dir: Path
) -> dict[str, Any]:
    """The pgbench drain: rows per second (rows found done over pgbench's own elapsed time) and CPU per row
    (pgbench's, every PostgreSQL process's), in µs."""
    db.reset_jobs(engine, n)
    figures = ceiling.run_pgbench(url, batch=batch, clients=clients, jobs=n, script_dir=script_dir)
    done = db.done_count(engine, "jobs")
    server = figures["server_all_cpu_s"]
    return {
        "rate": done / figures["seconds"],
        "done": done,
        "client_us": figures["client_cpu_s"] / done * 1e6,
        "server_all_us": None if server is None else server / done * 1e6,
        "command": figures["command"],
    }


def scenario_jobs(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """Jobs drain, 4 processes, no-op jobs, batch 1/10/50: library vs the document's worker on its own DDL,
    vs the ceiling (pgbench), and — with ``--with-pgqueuer`` — vs PgQueuer at batch 50."""
    n, procs = cfg.jobs, JOBS_PROCESSES
    have_pgbench = ceiling.pgbench() is not None
    rows: list[dict[str, Any]] = []
    for batch in (1, 10, 50):
        runs: dict[str, list[Any]] = {"library": [], "document": [], "ceiling": [], "pgqueuer": []}
        runs |= {f"library×{k}": [] for k in cfg.library_processes}
        for i in range(cfg.runs):
            contenders: dict[str, Callable[[], Any]] = {
                "document": lambda b=batch: document_drain(url, engine, n, procs, b, 0.0),
                "library": lambda b=batch: library_drain(url, engine, n, procs, LoopOptions(batch=b)),
            }
            if have_pgbench:
                contenders["ceiling"] = lambda b=batch: ceiling_drain(
                    url, engine, n, procs, b, cfg.results_dir / "ceiling"
                )
            for k in cfg.library_processes:
                contenders[f"library×{k}"] = lambda b=batch, k=k: library_drain(
                    url, engine, n, k, LoopOptions(batch=b)
                )
            if cfg.with_pgqueuer and batch == 50:
                from .peers import pgqueuer_drain

                contenders["pgqueuer"] = lambda b=batch: pgqueuer_drain(url, n, procs, b)
            for name, result in rotated(contenders, i).items():
                runs[name].append(result)
        lib = [n / r.seconds for r in runs["library"]]
        doc = [n / r.seconds for r in runs["document"]]
        what = f"jobs drain, {n:,} no-op jobs, {procs} processes, batch {batch}"
        common = {
            "rss": rss_of(runs["library"]),
            "cpu": cpu_per_row(runs["library"]),
            "jobs_per_process": [[rep["jobs"] for rep in r.reports] for r in runs["library"]],
        }
        rows.append(row(
            f"{what}: library vs the document's worker on the document's DDL", summary(lib),
            reference=summary(doc), reference_name="document worker (schema docbench)",
            reference_cpu=cpu_per_row(runs["document"]), reference_rss=rss_of(runs["document"]),
            ratio=paired_ratio(lib, doc), target=JOB_TARGETS[batch], **common,
        ))  # fmt: skip
        if have_pgbench:
            top = [c["rate"] for c in runs["ceiling"]]
            ceiling_cpu = {k: statistics.median(c[k] for c in runs["ceiling"]) if all(c[k] is not None
                           for c in runs["ceiling"]) else None for k in ("client_us", "server_all_us")}  # fmt: skip
            lib_server, top_server = common["cpu"]["server_all_us"], ceiling_cpu["server_all_us"]
            cpu_note = (f"server CPU per job: library {lib_server:,.0f} µs, ceiling {top_server:,.0f} µs"
                        if lib_server is not None and top_server is not None else "")  # fmt: skip
            rows.append(row(
                f"… batch {batch}: library / ceiling (its own claim + finalize statement in pgbench, {procs} clients)",
                summary(lib), reference=summary(top), reference_name="pgbench ceiling",
                reference_note=cpu_note,
                ratio=paired_ratio(lib, top), target=CEILING_TARGETS[batch], ceiling_runs=runs["ceiling"],
                reference_cpu=ceiling_cpu,
                **common,
            ))  # fmt: skip
        else:
            rows.append(
                row(f"… batch {batch}: library / ceiling", summary(lib), reference_name=ceiling.INSTALL_HINT)
            )
        for k in cfg.library_processes:
            other = runs[f"library×{k}"]
            rates = [n / r.seconds for r in other]
            rows.append(row(
                f"… batch {batch}: library with {k} process{'es' if k != 1 else ''} vs with {procs} (the same drain "
                f"on these {os.cpu_count()} cores)", summary(rates),
                reference=summary(lib), reference_name=f"library, {procs} processes",
                ratio=paired_ratio(rates, lib), target="(reported)", rss=rss_of(other), cpu=cpu_per_row(other),
                jobs_per_process=[[rep["jobs"] for rep in r.reports] for r in other],
            ))  # fmt: skip
        if runs["pgqueuer"]:
            peer = [n / r.seconds for r in runs["pgqueuer"]]
            rows.append(row(
                f"… batch {batch}: library vs PgQueuer ({runs['pgqueuer'][0].reports[0].get('driver', '?')}, "
                f"{procs} processes)", summary(lib), reference=summary(peer), reference_name="PgQueuer",
                reference_rss=rss_of(runs["pgqueuer"]), ratio=paired_ratio(lib, peer), target="> 1×", **common,
            ))  # fmt: skip
    return rows


SLOW_CONFIGS = [
    ("8 processes × batch 1", 8, LoopOptions(batch=1)),
    ("2 processes × concurrency 4", 2, LoopOptions(concurrency=4)),
    ("1 process × concurrency 8", 1, LoopOptions(concurrency=8)),
]


def scenario_slow_jobs(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """5 ms handlers, 8 in flight, in the three configurations of the issue, against the physical limit
    (8 / 5 ms = 1,600 jobs/s) and the document's worker with 8 processes × batch 1."""
    n, seconds = cfg.slow_jobs, 0.005
    limit = 8 / seconds
    runs: dict[str, list[Run]] = {name: [] for name, _, _ in SLOW_CONFIGS} | {"document": []}
    for i in range(cfg.runs):
        contenders: dict[str, Callable[[], Any]] = {
            name: (lambda p=p, o=o: library_drain(url, engine, n, p, LoopOptions(
                batch=o.batch, concurrency=o.concurrency, job_seconds=seconds)))
            for name, p, o in SLOW_CONFIGS
        }  # fmt: skip
        contenders["document"] = lambda: document_drain(url, engine, n, 8, 1, seconds)
        for name, result in rotated(contenders, i).items():
            runs[name].append(result)
    doc = [n / r.seconds for r in runs["document"]]
    rows = []
    for name, _, opts in SLOW_CONFIGS:
        lib = [n / r.seconds for r in runs[name]]
        batch = " (default batch)" if opts.batch is None else ""
        rows.append(row(
            f"{n:,} jobs of 5 ms, 8 in flight, {name}{batch}: share of the physical limit 8 / 5 ms",
            summary(lib), reference=limit, reference_name="physical limit",
            ratio=summary([x / limit for x in lib]), target="≥ 0.90", rss=rss_of(runs[name]),
            cpu=cpu_per_row(runs[name]), vs_document=paired_ratio(lib, doc),
            jobs_per_process=[[rep["jobs"] for rep in r.reports] for r in runs[name]],
        ))  # fmt: skip
    rows.append(row(
        "… the document's worker, 8 processes × batch 1, same jobs", summary(doc), reference=limit,
        reference_name="physical limit", ratio=summary([x / limit for x in doc]), target="(reference)",
        rss=rss_of(runs["document"]), cpu=cpu_per_row(runs["document"]),
    ))  # fmt: skip
    return rows


def scenario_long_jobs(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """Long jobs spread across processes: 2 workers (concurrency 1, default batch), four jobs of
    ``cfg.long_seconds``; the wall time should be two jobs' worth, not four."""
    jobs, procs, seconds = 4, 2, cfg.long_seconds
    expected = math.ceil(jobs / procs) * seconds
    walls, splits, runs = [], [], []
    for _ in range(cfg.runs):
        run = library_drain(url, engine, jobs, procs, LoopOptions(job_seconds=seconds))
        runs.append(run)
        walls.append(run.seconds)
        splits.append("+".join(str(rep["jobs"]) for rep in sorted(run.reports, key=lambda r: -r["jobs"])))
    return [row(
        f"long jobs: four {seconds:g} s jobs, 2 worker processes (concurrency 1, default batch): wall time",
        summary(walls), unit="s", reference=expected, reference_name="two jobs' worth", reference_unit="s",
        ratio=summary([w / expected for w in walls]), target="≈ 1 (not 2)", rss=rss_of(runs),
        jobs_per_process=splits,
    )]  # fmt: skip


#: Paired outbox drains per figure (at least): one pair's ratio spreads 0.7–1.2 on the shared 2-core box, so three
#: pairs could not tell 0.85 from 0.95. A drain takes about a second.
OUTBOX_PAIRS = 8


def scenario_outbox(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """Outbox drain, default batch (50): the ordered claim (1,000 aggregates) vs the plain one, with 4 dispatchers
    and with one (the claim's own cost, without concurrent claimers scanning past each other's rows). Pairs
    taken in turns, at least ``OUTBOX_PAIRS`` of them."""
    n = cfg.jobs
    pairs = cfg.runs if cfg.quick else max(cfg.runs, OUTBOX_PAIRS)
    rows = []
    for procs in (4, 1):
        runs: dict[str, list[Run]] = {"plain": [], "ordered": []}

        def drain(ordered: bool, procs: int = procs) -> Run:
            db.reset_outbox(engine, n, 1000)
            run = timed_processes(library_dispatcher, [(url, LoopOptions(ordered=ordered))] * procs)
            db.check_drained(engine, "outbox", n)
            return run

        for i in range(pairs):
            for name, result in rotated(
                {"plain": lambda: drain(False), "ordered": lambda: drain(True)}, i
            ).items():
                runs[name].append(result)
        plain = [n / r.seconds for r in runs["plain"]]
        ordered = [n / r.seconds for r in runs["ordered"]]
        # claims that returned rows, all dispatchers of a drain together (n / 50 when every claim is full): what
        # the ordered drain spends on claims that come back short while others hold the aggregates' heads
        claims = {k: [r.total("batches") for r in v] for k, v in runs.items()}
        what = f"outbox drain, {n:,} events, {procs} dispatcher{'s' if procs > 1 else ''}, default batch"
        rows += [
            row(f"{what}, plain claim ({pairs} pair{'s' if pairs > 1 else ''})", summary(plain), rss=rss_of(runs["plain"]),
                cpu=cpu_per_row(runs["plain"]), claims_with_rows=claims["plain"]),
            row(f"{what}, ordered claim (1,000 aggregates) / plain claim", summary(ordered),
                reference=summary(plain), reference_name="plain claim", ratio=paired_ratio(ordered, plain),
                target="≥ 0.9" if procs > 1 else "(reported)", rss=rss_of(runs["ordered"]),
                cpu=cpu_per_row(runs["ordered"]), claims_with_rows=claims["ordered"]),
        ]  # fmt: skip
    return rows


def scenario_hot_aggregates(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """Ordered outbox drains of a deep backlog over few aggregates (fewer than the batch), 1 dispatcher,
    default batch: 5,000 events over 1 and over 10 aggregates. The claim's walk of the ready rows would read the
    whole backlog for each claim (4 events/s with one aggregate of 20,000); the dispatcher finds the heads
    aggregate by aggregate instead (``_sql._heads_pick``)."""
    n = 5_000 if not cfg.quick else 500
    rows = []
    for aggregates in (1, 10):
        rates, runs = [], []
        for _ in range(cfg.runs):
            db.reset_outbox(engine, n, aggregates)
            run = timed_processes(library_dispatcher, [(url, LoopOptions(ordered=True))])
            db.check_drained(engine, "outbox", n)
            runs.append(run)
            rates.append(n / run.seconds)
        rows.append(
            row(
                f"ordered outbox drain, {n:,} events over {aggregates} aggregate{'s' if aggregates > 1 else ''}, "
                "1 dispatcher, default batch",
                summary(rates), rss=rss_of(runs), cpu=cpu_per_row(runs),
            )
        )  # fmt: skip
    return rows


def scenario_queues(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """A worker of three queues (strict priority) whose jobs all wait in the last one, against a worker of
    that one queue: 4 processes, batch 10, no-op jobs. The worker claims its queues with one statement; when
    it sent one claim per queue, two empty queues cost two round trips per batch."""
    n, procs = cfg.jobs, JOBS_PROCESSES
    three = LoopOptions(batch=10, queues=("first", "second", "default"))
    contenders: dict[str, Callable[[], Any]] = {
        "one": lambda: library_drain(url, engine, n, procs, LoopOptions(batch=10)),
        "three": lambda: library_drain(url, engine, n, procs, three),
    }
    runs: dict[str, list[Any]] = {"one": [], "three": []}
    for i in range(cfg.runs):
        for name, result in rotated(contenders, i).items():
            runs[name].append(result)
    many, one = ([n / r.seconds for r in runs[k]] for k in ("three", "one"))
    return [
        row(
            f"jobs drain, {n:,} no-op jobs, {procs} processes, batch 10: a worker of three queues (the jobs in "
            "the last) vs a worker of that queue",
            summary(many), reference=summary(one), reference_name="one queue", ratio=paired_ratio(many, one),
            target="(reported)", rss=rss_of(runs["three"]), cpu=cpu_per_row(runs["three"]),
        )
    ]  # fmt: skip


def scenario_async(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """The same drains through AsyncWorker / AsyncDispatcher beside the sync classes, batch 50: with the
    sync no-op handler/publisher (run off the event loop) and with an ``async def`` one."""
    n, procs = cfg.jobs, 4
    rows = []
    for kind in ("jobs", "outbox"):
        rates: dict[str, list[float]] = {"sync": [], "async/sync": [], "async/async": []}
        rss: dict[str, list[Run]] = {k: [] for k in rates}

        def reset(kind: str = kind) -> None:
            if kind == "jobs":
                db.reset_jobs(engine, n)
            else:
                db.reset_outbox(engine, n, 1000)

        def sync_drain(kind: str = kind) -> Run:
            reset()
            target = library_worker if kind == "jobs" else library_dispatcher
            run = timed_processes(target, [(url, LoopOptions(batch=50))] * procs)
            db.check_drained(engine, kind, n)
            return run

        def async_drain(flavour: str, kind: str = kind) -> Run:
            reset()
            run = timed_processes(library_async_loop, [(url, kind, 50, flavour)] * procs)
            db.check_drained(engine, kind, n)
            return run

        for i in range(cfg.runs):
            contenders: dict[str, Callable[[], Any]] = {
                "sync": sync_drain, "async/sync": lambda: async_drain("sync"),
                "async/async": lambda: async_drain("async"),
            }  # fmt: skip
            for name, result in rotated(contenders, i).items():
                rates[name].append(n / result.seconds)
                rss[name].append(result)
        what = "handler" if kind == "jobs" else "publisher"
        for flavour, label in (("async/sync", f"sync {what}"), ("async/async", f"async def {what}")):
            rows.append(row(
                f"{'AsyncWorker' if kind == 'jobs' else 'AsyncDispatcher'} vs the sync class, {kind} drain, batch 50, "
                f"{label}", summary(rates[flavour]), reference=summary(rates["sync"]), reference_name="sync class",
                ratio=paired_ratio(rates[flavour], rates["sync"]), target="(reported)", rss=rss_of(rss[flavour]),
            ))  # fmt: skip
    return rows
