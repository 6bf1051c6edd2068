"""``--memory``: does one process's RSS stay flat over a million rows?

One Worker process (concurrency 1, the handler in the loop's thread), one Worker process with concurrency 8
(handler threads), and one Dispatcher process, each alone on a table of ``--memory-rows`` ready rows (default
1,000,000), with the library's defaults otherwise. The no-op handler/publisher reads the process's RSS from
``/proc/self/statm`` every ``rows / 100`` rows. Reported per process: the RSS after the warm-up (the first
10 % of the rows), at the end, the peak, and the growth from warm-up to the end (target: < 10 %).
"""

from __future__ import annotations

import argparse
from typing import Any

from sqlalchemy import Engine

from . import db
from .harness import summary, timed_processes
from .library import LoopOptions, library_dispatcher, library_worker
from .report import row

WARM_UP = 0.10


def growth(samples: list[tuple[int, int]], rows: int) -> dict[str, Any]:
    """RSS (KiB) after the warm-up, at the end and at its highest; growth from warm-up to the end in %."""
    warm_at = rows * WARM_UP
    warm = next(rss for n, rss in samples if n >= warm_at)
    final = samples[-1][1]
    return {
        "warm_kib": warm,
        "final_kib": final,
        "max_kib": max(rss for _, rss in samples),
        "growth_pct": (final - warm) / warm * 100,
        "samples": samples,
    }


def scenario_memory(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    rows_n = cfg.memory_rows
    every = max(1, rows_n // 100)
    cases = [
        ("jobs", "one Worker process, concurrency 1", library_worker, LoopOptions(sample_every=every)),
        ("jobs", "one Worker process, concurrency 8", library_worker,
         LoopOptions(concurrency=8, sample_every=every)),
        ("outbox", "one Dispatcher process", library_dispatcher, LoopOptions(sample_every=every)),
    ]  # fmt: skip
    out = []
    for table, what, target, opts in cases:
        figures = []
        for _ in range(cfg.runs):
            if table == "jobs":
                db.reset_jobs(engine, rows_n)
            else:
                db.reset_outbox(engine, rows_n, 1000)
            run = timed_processes(target, [(url, opts)], timeout=3600)
            db.check_drained(engine, table, rows_n)
            figures.append({**growth(run.reports[0]["rss_samples"], rows_n), "rate": rows_n / run.seconds})
        warm = summary([f["warm_kib"] / 1024 for f in figures])["median"]
        final = summary([f["final_kib"] / 1024 for f in figures])["median"]
        out.append(row(
            f"memory, {what}, {rows_n:,} {'jobs' if table == 'jobs' else 'events'}: RSS growth after warm-up",
            summary([f["growth_pct"] for f in figures]), unit="%", target="< 10 %",
            reference_name=f"RSS {warm:.1f} MiB after warm-up → {final:.1f} MiB at the end",
            rss={"rss_mib": summary([f["final_kib"] / 1024 for f in figures])["median"],
                 "peak_mib": summary([f["max_kib"] / 1024 for f in figures])["median"]},
            warm_mib=summary([f["warm_kib"] / 1024 for f in figures]),
            final_mib=summary([f["final_kib"] / 1024 for f in figures]),
            rate=summary([f["rate"] for f in figures]), runs_detail=figures,
        ))  # fmt: skip
    return out
