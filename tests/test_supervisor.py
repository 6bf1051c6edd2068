"""``--processes N``: the supervisor and its children, with real processes and real signals.

Each test starts the real CLI (``python -m sa_outbox`` or the ``sa-outbox`` console script) in a session of its
own, so that the cleanup can kill whatever is left of the process tree, and waits in bounded loops that read
``/proc``. Signals that must land at an exact moment of start-up are sent by ``tests/early_signal``'s import
trap instead of after a guessed delay.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import URL

from .conftest import ROOT
from .helpers import seed_jobs, statuses
from .test_metrics import _free_port, _scrape

TRAP_DIR = Path(__file__).resolve().parent / "early_signal"
CONSOLE_SCRIPT = str(Path(sys.executable).parent / "sa-outbox")


# --- the process tree, read from /proc ---------------------------------------------------------------------


def children_of(pid: int) -> set[int]:
    """Direct children of ``pid`` (every thread's list: Linux files a child under the thread that forked it)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(c) for c in f.read().split())
    return found


def alive(pid: int) -> bool:
    """Running and not a zombie (an orphan's zombie may linger when PID 1 does not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def catches_sigterm(pid: int) -> bool:
    """SIGTERM (15) is bit 14 of the caught-signals mask: the process has its handler installed."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    except OSError:
        pass
    return False


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError(f"not reached in {timeout:g}s: {what}")


def scalar(engine: Engine, sql: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(text(sql)).scalar_one()


class Pool:
    """A ``sa-outbox dispatch|worker`` command in its own session; its output is collected as it comes."""

    def __init__(self, db_url: URL, *args: str, console: bool = False, **env: str) -> None:
        full_env = dict(os.environ, DATABASE_URL=db_url.render_as_string(hide_password=False), **env)
        if "SA_OUTBOX_TEST_TRAP" in env:
            full_env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(TRAP_DIR), os.environ.get("PYTHONPATH")])
            )
        command = [CONSOLE_SCRIPT] if console else [sys.executable, "-m", "sa_outbox"]
        self.proc = subprocess.Popen(
            [*command, *args], cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.seen_children: set[int] = set()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def workers(self) -> set[int]:
        """The live children running a loop (not multiprocessing's resource tracker)."""
        found = {c for c in children_of(self.proc.pid) if "--multiprocessing-fork" in cmdline(c) and alive(c)}
        self.seen_children |= found
        return found

    def wait(self, timeout: float) -> int:
        """The exit code; fails (after ``timeout``) naming the children still alive."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            left = sorted(c for c in self.seen_children | self.workers() if alive(c))
            raise AssertionError(
                f"still running {timeout:g}s later, children alive: {left}\n{self.output[-3000:]}"
            ) from None
        self._reader.join(10)
        return code

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the whole tree, orphans included (same group)
        for child in self.seen_children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        self.proc.wait(30)
        self._reader.join(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def job_calls(engine: Engine) -> Iterator[Engine]:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS job_calls (job_id bigint, pid int)"))
        conn.execute(text("TRUNCATE job_calls"))
    yield engine


def sample(body: str, series: str) -> float | None:
    """The value of one exact series line (name with its labels) in a Prometheus text page."""
    for line in body.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


# --- item 8: signals during start-up -------------------------------------------------------------------------


@pytest.mark.parametrize("console", [True, False], ids=["console-script", "python-m"])
def test_a_sigterm_that_lands_while_the_cli_module_imports_is_a_clean_stop(
    job_calls: Engine, db_url: URL, console: bool
) -> None:
    with Pool(
        db_url,
        "worker",
        "tests.targets:worker",
        console=console,
        SA_OUTBOX_TEST_TRAP="main:sa_outbox._cli:self",
    ) as pool:
        code = pool.wait(60)
        assert "trap fired" in pool.output  # the signal really landed while sa_outbox._cli was being imported
        assert code == 0, pool.output
        assert "Traceback" not in pool.output


@pytest.mark.parametrize(
    ("who", "processes"),
    [("parent", 8), ("group", 4)],
    ids=["supervisor-only", "whole-group"],
)
def test_sigterm_while_children_start_stops_every_child_and_exits_zero(
    job_calls: Engine, db_url: URL, who: str, processes: int
) -> None:
    """The signal lands as the first child starts importing sa_outbox, before it has any handler.

    ``parent``: only the supervisor is signalled, while it is still starting later children.
    ``group``: the supervisor and every child at once, as ``systemctl stop`` (KillMode=control-group) and
    Ctrl-C do; the signalled child itself has no handler yet."""
    with Pool(
        db_url, "worker", "tests.targets:worker", "--processes", str(processes),
        SA_OUTBOX_TEST_TRAP=f"child:sa_outbox:{who}",
    ) as pool:  # fmt: skip
        code = pool.wait(90)
        assert "trap fired" in pool.output
        assert code == 0, pool.output
        assert "Traceback" not in pool.output
        assert not [c for c in pool.seen_children if alive(c)]


# --- item 9: supervision ---------------------------------------------------------------------------------------


def _running_workers(pool: Pool, n: int) -> set[int]:
    """Wait until ``n`` children have their signal handlers installed (past start-up) and return them."""
    found: set[int] = set()

    def ready() -> bool:
        nonlocal found
        found = {c for c in pool.workers() if catches_sigterm(c)}
        return len(found) == n

    wait_for(ready, 60, f"{n} running children")
    return found


def test_a_child_killed_by_sigkill_is_logged_with_its_cause_and_replaced(
    job_calls: Engine, db_url: URL
) -> None:
    engine = job_calls
    with Pool(db_url, "worker", "tests.targets:worker", "--processes", "2") as pool:
        before = _running_workers(pool, 2)
        victim = min(before)
        os.kill(victim, signal.SIGKILL)  # what the OOM killer does
        wait_for(lambda: len(pool.workers() - before) == 1 and len(pool.workers()) == 2, 60, "a replacement")
        replacement = (pool.workers() - before).pop()
        wait_for(lambda: f"(pid {victim}) was" in pool.output, 10, "the exit logged")
        line = next(ln for ln in pool.lines if f"(pid {victim}) was" in ln)
        assert re.search(
            rf"WARNING .* child \d \(pid {victim}\) was killed by SIGKILL .*; restarting it in", line
        ), line
        # The replacement runs the loop: with the survivor frozen, it alone does the work.
        survivor = (before - {victim}).pop()
        _running_workers(pool, 2)
        os.kill(survivor, signal.SIGSTOP)
        try:
            seed_jobs(engine, 30, task="record")
            wait_for(lambda: statuses(engine, "jobs") == {"done": 30}, 60, "30 jobs done by the replacement")
        finally:
            os.kill(survivor, signal.SIGCONT)
        assert scalar(engine, f"SELECT count(*) FROM job_calls WHERE pid = {replacement}") == 30
        pool.proc.send_signal(signal.SIGTERM)
        assert pool.wait(60) == 0, pool.output


def test_children_stop_gracefully_when_the_supervisor_is_killed(job_calls: Engine, db_url: URL) -> None:
    engine = job_calls
    seed_jobs(engine, 5000, task="record")
    with Pool(
        db_url, "worker", "tests.targets:worker", "--processes", "2", JOB_DELAY="0.01", BATCH="5"
    ) as pool:
        kids = _running_workers(pool, 2)
        wait_for(lambda: scalar(engine, "SELECT count(*) FROM job_calls") >= 40, 60, "jobs flowing")
        os.kill(pool.proc.pid, signal.SIGKILL)
        # Counted once the supervisor is gone (reaped), not when the SIGKILL is sent: on a loaded machine the
        # killed process may take a while to exit, and its children, rightly, work on until it has.
        pool.proc.wait(30)
        at_kill = scalar(engine, "SELECT count(*) FROM job_calls")
        wait_for(
            lambda: not any(alive(c) for c in kids), 30, f"children {sorted(kids)} gone after the parent"
        )
        after = scalar(engine, "SELECT count(*) FROM job_calls")
        # Each child finishes the batch in hand (at most BATCH jobs) and claims nothing more.
        assert after - at_kill <= 2 * 5, (at_kill, after)
        assert "running" not in statuses(engine, "jobs")  # finished jobs recorded, unstarted ones released


def test_a_child_that_dies_at_once_every_time_makes_the_pool_give_up(job_calls: Engine, db_url: URL) -> None:
    with Pool(db_url, "worker", "tests.supervisor_targets:crashing", "--processes", "2") as pool:
        code = pool.wait(120)
        out = pool.output
    assert code == 2, out
    gave_up = re.search(
        r"child (\d+) died within \S+ of its start 5 times in a row \(last: exited with exit code 1\); giving up",
        out,
    )
    assert gave_up, out[-3000:]
    starts = re.findall(rf"child {gave_up[1]} started", out)
    assert len(starts) == 5, out[-3000:]  # the first start and four restarts, with backoff between them
    assert out.rstrip().splitlines()[-1].startswith("sa-outbox: error: child"), out[-3000:]


def test_a_configuration_error_in_the_children_fails_once_with_one_line(
    job_calls: Engine, db_url: URL
) -> None:
    with Pool(db_url, "worker", "tests.targets:not_a_loop", "--processes", "3") as pool:
        code = pool.wait(60)
        out = pool.output
    assert code == 2, out
    assert "sa-outbox: error: target 'tests.targets:not_a_loop' is a int" in out, out
    assert "Traceback" not in out, out


def test_a_taken_metrics_port_is_refused_before_any_child_starts(job_calls: Engine, db_url: URL) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with Pool(
            db_url, "worker", "tests.targets:worker", "--processes", "2", "--metrics-port", str(port)
        ) as pool:
            code = pool.wait(60)
            out = pool.output
    assert code == 2, out
    assert f"--metrics-port {port}" in out, out
    assert not pool.seen_children
    assert "Traceback" not in out, out


def test_one_metrics_port_serves_the_whole_pool_and_survives_a_replaced_child(
    job_calls: Engine, db_url: URL
) -> None:
    engine = job_calls
    seed_jobs(engine, 300, task="record")
    port = _free_port()
    completed = 'sa_outbox_completed_total{kind="jobs",table="jobs"}'
    with Pool(
        db_url, "worker", "tests.targets:worker", "--processes", "2", "--metrics-port", str(port),
        JOB_DELAY="0.01", BATCH="5",
    ) as pool:  # fmt: skip
        kids = _running_workers(pool, 2)
        wait_for(lambda: statuses(engine, "jobs") == {"done": 300}, 90, "300 jobs done")
        assert scalar(engine, "SELECT count(DISTINCT pid) FROM job_calls") == 2  # both children did work
        body = ""

        def scraped(series: str, value: float) -> bool:
            nonlocal body
            with contextlib.suppress(OSError):
                body = _scrape(port)
            return sample(body, series) == value

        wait_for(lambda: scraped(completed, 300.0), 30, f"{completed} 300 on port {port}", every=0.3)
        assert sample(body, 'sa_outbox_handle_seconds_count{kind="jobs",table="jobs"}') == 300.0
        assert sample(body, 'sa_outbox_pool_processes{command="worker"}') == 2.0
        assert 'sa_outbox_rows{kind="jobs",status=' in body  # the queue gauges, from one child
        os.kill(min(kids), signal.SIGKILL)
        wait_for(lambda: len(pool.workers() - kids) == 1 and len(pool.workers()) == 2, 60, "a replacement")
        wait_for(
            lambda: scraped('sa_outbox_pool_restarts_total{command="worker"}', 1.0), 30, "restart counted"
        )
        assert sample(body, completed) == 300.0  # a replaced child's counts stay in the pool's counters
        pool.proc.send_signal(signal.SIGTERM)
        assert pool.wait(60) == 0, pool.output


def test_children_log_with_the_parents_level_and_format(job_calls: Engine, db_url: URL) -> None:
    started = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO sa_outbox\.worker started")
    with Pool(db_url, "worker", "tests.targets:worker", "--processes", "2") as pool:
        wait_for(
            lambda: len([ln for ln in pool.lines if started.match(ln)]) == 2, 60, "2 children log 'started'"
        )
        pool.proc.send_signal(signal.SIGTERM)
        assert pool.wait(60) == 0, pool.output
    with Pool(db_url, "--log-level", "WARNING", "worker", "tests.targets:worker", "--processes", "2") as pool:
        _running_workers(pool, 2)
        pool.proc.send_signal(signal.SIGTERM)
        assert pool.wait(60) == 0, pool.output
        assert " INFO " not in pool.output, pool.output


def test_children_ask_linux_for_a_sigterm_when_their_supervisor_dies() -> None:
    probe = (
        "import ctypes, os; from sa_outbox._supervisor import _die_with_parent; "
        "assert _die_with_parent(os.getppid()); v = ctypes.c_int(); "
        "ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)"  # 2 = PR_GET_PDEATHSIG
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == str(int(signal.SIGTERM))
