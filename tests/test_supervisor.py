"""``--processes N``: the supervisor and its children, with real processes and real signals.

Each test starts the real CLI (``python -m sa_outbox`` or the ``sa-outbox`` console script) in a session of its
own, so that the cleanup can kill whatever is left of the process tree, and waits in bounded loops that read
``/proc``. Signals that must land at an exact moment of start-up are sent by ``tests/early_signal``'s import
trap instead of after a guessed delay.
"""

from __future__ import annotations

import contextlib
import os
import signal
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
