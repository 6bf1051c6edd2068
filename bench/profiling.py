"""``--profile``: where the time goes at batch 1 and in the 5 ms case.

Each case runs ``--runs`` times plainly, then once under each profiler:

1. plain — the CPU accounting: every worker process's own CPU (``getrusage``, all threads), its backends' CPU
   (``/proc/<pg_backend_pid()>/stat``) and every PostgreSQL process's CPU on the machine (WAL writer
   included), each per job; and how many of the machine's cores were busy (client + server CPU / wall time).
   Near all of them busy: CPU-bound; well below: the loop waits (round trips, sleeping handlers).
2. under cProfile in every worker process, timed by the main thread's CPU clock (the loop; handler threads
   are not profiled): a wall clock put the backend's work inside the client's ``send`` (waking the backend
   preempts the client on two cores). The first process's top functions by own CPU are printed in µs per
   job; cProfile's cost per call inflates functions called often, so read proportions from py-spy and call
   counts and structure from cProfile. Every ``.prof`` is kept under ``bench/results/profile/`` for
   ``python -m pstats`` or snakeviz;
3. under py-spy at 1 kHz, attached to the first worker process (all its threads), when ``py-spy`` is installed
   (``pip install -e '.[bench]'``) and may ptrace: the leaf functions by samples, the raw stacks kept (feed
   them to a flame-graph tool).

The document's worker at batch 1 is measured plainly beside it, for comparison.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import pstats
import re
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from . import db
from .drains import SLOW_CONFIGS, document_drain, library_drain
from .harness import Run, summary, timed_processes
from .library import LoopOptions, library_worker
from .report import cpu_per_row, row, rss_of

TOP = 25


def busy_cores(run: Run) -> float | None:
    client, server = run.total("client_cpu_s"), run.server_cpu_s
    if client is None or server is None:
        return None
    return (client + server) / run.seconds


def what_limits(runs: list[Run], cpus: int) -> str:
    values = [busy_cores(r) for r in runs]
    busy = None if None in values else statistics.median(v for v in values if v is not None)
    if busy is None:
        return "server CPU unreadable (remote server?)"
    if busy >= 0.85 * cpus:
        return f"CPU: {busy:.2f} of {cpus} cores busy"
    return f"waiting (round trips, handlers): {busy:.2f} of {cpus} cores busy"


def cprofile_top(path: Path, jobs: int) -> tuple[str, list[dict[str, Any]]]:
    stats = pstats.Stats(str(path))
    text = io.StringIO()
    stats.stream = text  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(TOP)
    top = []
    for (file, line, func), (_cc, calls, tottime, cumtime, _callers) in sorted(
        stats.stats.items(),  # type: ignore[attr-defined]
        key=lambda kv: -kv[1][2],
    )[:TOP]:
        top.append({"function": f"{func} ({Path(file).name}:{line})", "calls": calls,
                    "own_us_per_job": tottime / jobs * 1e6, "cumulative_us_per_job": cumtime / jobs * 1e6})  # fmt: skip
    return text.getvalue(), top


def py_spy() -> str | None:
    return shutil.which("py-spy") or (
        str(Path(sys.executable).parent / "py-spy")
        if (Path(sys.executable).parent / "py-spy").exists()
        else None
    )


class PySpy:
    """py-spy record on one process, started after the common start, stopped (SIGINT) after the last report."""

    def __init__(self, exe: str, out: Path) -> None:
        self.exe, self.out = exe, out
        self.proc: subprocess.Popen[bytes] | None = None
        self.error = ""

    def __call__(self, procs: list[Any]) -> Any:
        cmd = [self.exe, "record", "--pid", str(procs[0].pid), "--rate", "1000", "--format", "raw",
               "--nonblocking", "--threads", "-o", str(self.out)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self.stop

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        if not self.out.exists():
            self.error = (
                err.decode(errors="replace").strip()[-500:] or f"py-spy exited {self.proc.returncode}"
            )


def leaf_functions(raw: Path) -> tuple[int, list[dict[str, Any]]]:
    """Samples by leaf function (own time) from py-spy's raw (collapsed) stacks."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        leaf = re.sub(r":\d+\)$", ")", stack.split(";")[-1])
        counts[leaf] += int(n)
        total += int(n)
    return total, [{"function": f, "share": c / total} for f, c in counts.most_common(TOP)] if total else []


def _case(
    url: str, engine: Engine, name: str, n: int, procs: int, opts: LoopOptions, out: Path, runs: int
) -> dict[str, Any]:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    cpus = os.cpu_count() or 1
    plain = [library_drain(url, engine, n, procs, opts) for _ in range(runs)]
    # cProfile in every process
    prof_dir = out / slug
    prof_dir.mkdir(parents=True, exist_ok=True)
    db.reset_jobs(engine, n)
    profiled = timed_processes(library_worker, [(url, opts)] * procs, profile_dir=prof_dir)
    db.check_drained(engine, "jobs", n)
    text, top = cprofile_top(prof_dir / "0.prof", profiled.reports[0]["jobs"] or 1)
    (prof_dir / "cprofile.txt").write_text(text)
    result: dict[str, Any] = {
        "rate": summary([n / r.seconds for r in plain]), "cpu_us_per_job": cpu_per_row(plain),
        "busy_cores": [busy_cores(r) for r in plain], "limit": what_limits(plain, cpus), "rss": rss_of(plain),
        "cprofile_top": top,
        "cprofile_rate": n / profiled.seconds, "files": str(prof_dir),
    }  # fmt: skip
    exe = py_spy()
    if exe is None:
        result["py_spy"] = "not installed (pip install -e '.[bench]')"
    else:
        db.reset_jobs(engine, n)
        spy = PySpy(exe, prof_dir / "py-spy.txt")
        timed_processes(library_worker, [(url, opts)] * procs, on_start=spy)
        db.check_drained(engine, "jobs", n)
        if spy.error:
            result["py_spy"] = f"failed: {spy.error}"
        else:
            samples, leaves = leaf_functions(spy.out)
            result["py_spy"] = {"samples": samples, "leaf_functions": leaves, "raw": str(spy.out)}
    return result


def scenario_profile(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    out = cfg.results_dir / "profile"
    cases = [(f"jobs drain batch 1, {4} processes", cfg.jobs, 4, LoopOptions(batch=1))]
    cases += [(f"5 ms jobs, {name}", cfg.slow_jobs, p, LoopOptions(batch=o.batch, concurrency=o.concurrency,
                                                                    job_seconds=0.005)) for name, p, o in SLOW_CONFIGS]  # fmt: skip
    rows = []
    for name, n, procs, opts in cases:
        r = _case(url, engine, name, n, procs, opts, out, cfg.runs)
        cpu = r["cpu_us_per_job"]
        rows.append(row(
            f"profile: {name}", r["rate"],
            reference_name=_cpu_text(cpu) + f"; {r['limit']}", rss=r["rss"], profile=r,
        ))  # fmt: skip
        print(f"\n--- {name}: top functions by own time (cProfile, first process, µs per job)", flush=True)
        for item in r["cprofile_top"][:15]:
            print(f"  {item['own_us_per_job']:8.1f}  {item['function']}")
        if isinstance(r["py_spy"], dict):
            print(f"--- {name}: leaf functions (py-spy, {r['py_spy']['samples']} samples, first process)")
            for item in r["py_spy"]["leaf_functions"][:15]:
                print(f"  {item['share'] * 100:5.1f} %  {item['function']}")
        else:
            print(f"--- py-spy: {r['py_spy']}")
    docs = [document_drain(url, engine, cfg.jobs, 4, 1, 0.0) for _ in range(cfg.runs)]
    cpu = cpu_per_row(docs)
    rows.append(row("profile: the document's worker, batch 1, 4 processes", summary([cfg.jobs / d.seconds for d in docs]),
                    reference_name=_cpu_text(cpu) + f"; {what_limits(docs, os.cpu_count() or 1)}",
                    rss=rss_of(docs), cpu=cpu))  # fmt: skip
    return rows


def _cpu_text(cpu: dict[str, float | None]) -> str:
    def us(v: float | None) -> str:
        return "?" if v is None else f"{v:,.0f} µs"

    return (f"CPU per job: client {us(cpu['client_us'])}, its backends {us(cpu['backend_us'])}, "
            f"all PostgreSQL {us(cpu['server_all_us'])}")  # fmt: skip
