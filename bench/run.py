"""sa_outbox benchmark: the library beside the jobs document's own worker (on the document's own DDL), the
ceiling of its own SQL (pgbench), the physical limit, and optionally PgQueuer — in one run, on one database.

    python -m bench.run --quick                 # smoke test: small sizes, one repetition (about a minute)
    python -m bench.run --runs 3                # the table (see docs/benchmarks-howto.md for timings)
    python -m bench.run --scenarios jobs,slowjobs --with-pgqueuer
    python -m bench.run --memory                # RSS over 1,000,000 jobs/events
    python -m bench.run --profile               # where the time goes (cProfile, py-spy, client/server CPU)

Figures are medians of ``--runs`` repetitions with their min–max; ratios are taken within each run, then
their median and min–max reported. The table is printed (Markdown) and the raw JSON written to
``bench/results/latest.json``. Uses ``DATABASE_URL`` (a database ``sa_outbox_bench`` is created on that
server and dropped at the end), else an embedded PostgreSQL.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

# Nothing heavy at module level: every benchmark process is spawned, and a spawned child imports the
# parent's main module first — with SQLAlchemy and the library imported here, the document's worker and
# PgQueuer would carry them and report their RSS.

RESULTS = Path(__file__).resolve().parent / "results"

#: The table's scenarios, in order (``--scenarios`` picks some; the default is all of these): module:function.
SCENARIOS = {
    "jobs": "drains:scenario_jobs",
    "slowjobs": "drains:scenario_slow_jobs",
    "longjobs": "drains:scenario_long_jobs",
    "outbox": "drains:scenario_outbox",
    "hotagg": "drains:scenario_hot_aggregates",
    "queues": "drains:scenario_queues",
    "async": "drains:scenario_async",
    "producer": "latency:scenario_producer",
    "wakeup": "latency:scenario_wakeup",
    "growth": "latency:scenario_growth",
    "steady": "latency:scenario_steady",
    "bulk": "unique_bulk:scenario_bulk",
    "unique": "unique_bulk:scenario_unique",
    "limits": "limits:scenario_limits",
    "pgbouncer": "pgbouncer:scenario_pgbouncer",
}
#: Modes run only when asked for (``--memory``, ``--profile``, or by name in ``--scenarios``).
MODES = {
    "memory": "memory:scenario_memory",
    "profile": "profiling:scenario_profile",
    "dashboard": "dashboard:scenario_dashboard",  # every page over HTTP on 1M rows per table (bench/dashboard.py)
    "partitions": "partitions:scenario_partitions",  # partitioned vs plain table, retention (bench/partitions.py)
}


def scenario(name: str) -> Any:
    module, function = {**SCENARIOS, **MODES}[name].split(":")
    return getattr(importlib.import_module(f"bench.{module}"), function)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, one repetition (a smoke test)")
    p.add_argument("--runs", type=int, default=3, help="repetitions of every figure (median, min–max)")
    p.add_argument(
        "--scenarios", default=None, help=f"comma-separated, from {', '.join([*SCENARIOS, *MODES])}"
    )
    p.add_argument("--memory", action="store_true", help="only the memory mode (RSS over --memory-rows rows)")
    p.add_argument("--memory-rows", type=int, default=1_000_000)
    p.add_argument(
        "--dashboard-rows", type=int, default=1_000_000, help="rows per table for --scenarios dashboard"
    )
    p.add_argument(
        "--partition-rows", type=int, default=1_000_000, help="rows per table for --scenarios partitions"
    )
    p.add_argument("--profile", action="store_true", help="only the profile mode (batch 1 and the 5 ms case)")
    p.add_argument("--with-pgqueuer", action="store_true", help="add PgQueuer to the jobs drain at batch 50")
    p.add_argument(
        "--library-processes",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        help="comma-separated process counts: the jobs drain of the library again with each (e.g. 1,2), "
        "beside its run with the scenario's 4 — how the drain scales on this machine's cores",
    )
    p.add_argument("--jobs", type=int, default=20_000, help="rows per drain (jobs, outbox, async, profile)")
    p.add_argument(
        "--icu-locale",
        help="create the benchmark database with this ICU locale's collation (en-US: text compared "
        "linguistically, as the ordered claim's probe of aggregate ids then does) instead of the server's default",
    )
    p.add_argument("--json", default=str(RESULTS / "latest.json"))
    cfg = p.parse_args(argv)
    cfg.slow_jobs, cfg.long_seconds, cfg.producer, cfg.wakeups = 8_000, 3.0, 5_000, 200
    cfg.growth_rows, cfg.steady_rate, cfg.steady_seconds = 1_000_000, 500, 10
    if cfg.quick:
        cfg.runs, cfg.jobs, cfg.slow_jobs, cfg.long_seconds, cfg.producer, cfg.wakeups = (
            1,
            2_000,
            400,
            0.5,
            500,
            20,
        )
        cfg.growth_rows, cfg.steady_rate, cfg.steady_seconds = 50_000, 100, 2
        if cfg.memory_rows == 1_000_000:
            cfg.memory_rows = 20_000
        if cfg.dashboard_rows == 1_000_000:
            cfg.dashboard_rows = 50_000
        if cfg.partition_rows == 1_000_000:
            cfg.partition_rows = 50_000
    names = cfg.scenarios.split(",") if cfg.scenarios else []
    if cfg.memory:
        names.append("memory")
    if cfg.profile:
        names.append("profile")
    cfg.names = names or list(SCENARIOS)
    unknown = [n for n in cfg.names if n not in SCENARIOS and n not in MODES]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; known: {', '.join([*SCENARIOS, *MODES])}")
    if cfg.library_processes and "jobs" not in cfg.names:
        p.error("--library-processes adds runs to the jobs scenario: include it (--scenarios jobs)")
    if any(k < 1 for k in cfg.library_processes):
        p.error("--library-processes: process counts of 1 or more")
    if cfg.with_pgqueuer and "jobs" not in cfg.names:
        p.error("--with-pgqueuer adds PgQueuer to the jobs scenario: include it (--scenarios jobs)")
    cfg.results_dir = Path(cfg.json).parent
    return cfg


def main(argv: list[str] | None = None) -> int:
    from sqlalchemy import create_engine, text

    from sa_outbox.embedded import database_url

    from . import db
    from .report import HEADER, render_rows

    cfg = parse(argv)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "runs": cfg.runs,
        "quick": cfg.quick,
        "command": "python -m bench.run " + " ".join(sys.argv[1:] if argv is None else argv),
        "notes": [
            "library: sa_outbox on its own schema (sa_outbox.models: public.jobs, public.outbox)",
            "document worker: the jobs document's SQL on the document's own DDL (schema docbench: job_status "
            "enum, jobs_dequeue_idx, jobs_running_idx)",
            "ceiling: the library's finalize_and_claim statement for jobs, batch written in, pgbench -M prepared, "
            "as many clients as the drain has processes",
            "ratios are taken within each run (same database, same conditions), then their median (min–max)",
        ]
        + (["--quick: small sizes, one run; a smoke test, not figures to compare"] if cfg.quick else []),
        "scenarios": {},
    }
    cfg.results_dir.mkdir(parents=True, exist_ok=True)
    with database_url() as server:
        url = db.create(server, cfg.icu_locale)
        engine = create_engine(url, pool_size=4)
        with engine.connect() as conn:
            results["machine"]["postgresql"] = conn.execute(text("SHOW server_version")).scalar_one()
            # (provider c or i; the ICU locale is daticulocale on 15-16, datlocale from 17)
            results["machine"]["collation"] = conn.execute(
                text(
                    "SELECT concat_ws(' ', d.datlocprovider, d.datcollate, "
                    "coalesce(to_jsonb(d) ->> 'datlocale', to_jsonb(d) ->> 'daticulocale')) "
                    "FROM pg_database d WHERE d.datname = current_database()"
                )
            ).scalar_one()
        print("\n".join(HEADER), flush=True)
        try:
            for name in cfg.names:
                t0 = time.perf_counter()
                rows = scenario(name)(url, engine, cfg)
                results["scenarios"][name] = rows
                results.setdefault("seconds", {})[name] = time.perf_counter() - t0
                print("\n".join(render_rows(rows)), flush=True)
                Path(cfg.json).write_text(json.dumps(results, indent=2, default=str))
        finally:
            engine.dispose()
            db.drop(server)
    print("\n" + "\n".join(f"- {note}" for note in results["notes"]))
    print(f"\n{cfg.runs} run(s); PostgreSQL {results['machine']['postgresql']}; raw figures: {cfg.json}")
    print("seconds per scenario: " + ", ".join(f"{k} {v:.0f}" for k, v in results.get("seconds", {}).items()))
    Path(cfg.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
