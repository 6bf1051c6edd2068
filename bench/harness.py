"""Running N benchmark processes side by side and measuring them: wall time, RSS, client and server CPU.

Every process target takes a :class:`Harness` as its last argument and wraps its work in :func:`measured`:
it connects, says it is ready, waits for the common start, works, and reports what it measured — its RSS
(``VmRSS``/``VmHWM`` from ``/proc/self/status``), its own CPU (``getrusage``, every thread) and its database
backends' CPU (``/proc/<backend pid>/stat``, the backend pids from ``pg_backend_pid()``; readable when the
server runs on this machine) — then waits to be released, so the parent can read every PostgreSQL process's
CPU while the backends still live. The wall time runs from the common start to the last report: connection
set-up and tear-down are outside it.
"""

from __future__ import annotations

import contextlib
import cProfile
import multiprocessing
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CTX = multiprocessing.get_context("spawn")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class Harness:
    """What a benchmark process shares with the parent (passed at spawn)."""

    ready: Any
    go: Any
    report: Any
    release: Any
    profile_to: str | None = None  # a cProfile dump of this process's main thread, when set
    extra: dict[str, Any] = field(default_factory=dict)


def proc_cpu(pid: int) -> float | None:
    """User + system CPU seconds of a process from /proc (None when it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14 and 15)


def rss_kib(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM (peak) in KiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0])
    return {"rss_kib": out.get("VmRSS", 0), "hwm_kib": out.get("VmHWM", 0)}


def rss_now() -> int:
    """Resident set in KiB (one read of /proc/self/statm: cheap enough to sample every N rows)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE // 1024


def postgres_pids() -> list[int]:
    """Every process on this machine named ``postgres`` (the server, its backends and helpers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == "postgres":
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def cpu_of(pids: list[int]) -> dict[int, float]:
    return {pid: cpu for pid in pids if (cpu := proc_cpu(pid)) is not None}


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU spent between two readings by the processes alive at the second (new ones counted whole)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


class PostgresCpuWatch:
    """Every PostgreSQL process's CPU over a period in which some of them exit (pgbench's backends end with
    it): their CPU is read every 10 ms while they live, the last reading kept; new processes are looked
    for every 100 ms. A backend's last < 10 ms before it exits are missed."""

    def __init__(self) -> None:
        self.before = cpu_of(postgres_pids())
        self.last = dict(self.before)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        tick = 0
        while not self.stopped.wait(0.01):
            tick += 1
            pids = postgres_pids() if tick % 10 == 0 else list(self.last)
            self.last.update(cpu_of(pids))

    def stop(self) -> float | None:
        self.stopped.set()
        self.thread.join()
        self.last.update(cpu_of(list(self.last)))
        return cpu_delta(self.before, self.last) if self.last else None


@contextlib.contextmanager
def measured(h: Harness, backends: Callable[[], list[int]]) -> Iterator[dict[str, Any]]:
    """Process side: ready → wait for the start → the body's work → report → wait for the release.

    The body may count its work in ``box["jobs"]`` and add anything else to the box (it is reported)."""
    h.ready.set()
    if not h.go.wait(600):
        raise RuntimeError("the benchmark never started")
    box: dict[str, Any] = {"jobs": 0}
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    b0 = cpu_of(backends())
    # CPU time of the main thread (the loop), not wall time: a blocking call shows what it costs, not how
    # long the server took (a wall clock put the backend's run inside the client's send: waking it preempts us).
    profiler = cProfile.Profile(time.thread_time) if h.profile_to else None
    started = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    try:
        yield box
    finally:
        if profiler is not None:
            profiler.disable()
        seconds = time.perf_counter() - started
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        b1 = cpu_of(backends())
        if profiler is not None and h.profile_to:
            profiler.dump_stats(h.profile_to)
        report = {
            **box,
            "pid": os.getpid(),
            "seconds": seconds,
            "client_cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
            "backend_cpu_s": cpu_delta(b0, b1) if b1 else None,
            **rss_kib(),
        }
        h.report.put(report)
        h.release.wait(600)


@dataclass
class Run:
    """One timed run of N processes."""

    seconds: float
    reports: list[dict[str, Any]]
    server_cpu_s: float | None  # every postgres process on this machine, start to last report

    def total(self, key: str) -> float | None:
        values = [r.get(key) for r in self.reports]
        return None if any(v is None for v in values) else float(sum(values))  # type: ignore[arg-type]

    def per_process(self, key: str) -> float:
        return statistics.median(float(r[key]) for r in self.reports)


def timed_processes(
    target: Callable[..., None],
    args_for: list[tuple[Any, ...]],
    *,
    profile_dir: Path | None = None,
    timeout: float = 900,
    on_start: Callable[[list[Any]], Any] | None = None,
) -> Run:
    """Start one process per argument tuple, start them together, time them until the last report.

    ``on_start(processes)`` is called right after the start; what it returns, when callable, is called after
    the last report (a profiler attached to the processes uses the pair)."""
    go, release, report = CTX.Event(), CTX.Event(), CTX.Queue()
    harnesses = [
        Harness(CTX.Event(), go, report, release, str(profile_dir / f"{i}.prof") if profile_dir else None)
        for i in range(len(args_for))
    ]
    procs = [CTX.Process(target=target, args=(*a, hs)) for a, hs in zip(args_for, harnesses, strict=True)]
    for p in procs:
        p.start()
    try:
        for hs, p in zip(harnesses, procs, strict=True):
            while not hs.ready.wait(1):
                if not p.is_alive():
                    raise RuntimeError(f"a benchmark process died while starting (exit code {p.exitcode})")
        pg_before = cpu_of(postgres_pids())
        started = time.perf_counter()
        go.set()
        hook = on_start(procs) if on_start else None
        reports = []
        deadline = time.monotonic() + timeout
        while len(reports) < len(procs):
            try:
                reports.append(report.get(timeout=1))
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError("the benchmark processes did not finish in time") from None
                dead = [p.exitcode for p in procs if not p.is_alive() and p.exitcode != 0]
                if dead:
                    raise RuntimeError(f"a benchmark process failed: exit codes {dead}") from None
        elapsed = time.perf_counter() - started
        pg_after = cpu_of(postgres_pids())
        if callable(hook):
            hook()
    finally:
        release.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a benchmark process failed: exit codes {[p.exitcode for p in procs]}")
    return Run(elapsed, reports, cpu_delta(pg_before, pg_after) if pg_after else None)


def summary(values: list[float]) -> dict[str, Any]:
    """Median and spread of a list of per-run figures (the runs themselves kept for the JSON)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}
