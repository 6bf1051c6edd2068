"""Running loops from the command line: one in this process, or ``--processes N`` children under a supervisor.

:func:`_run_target` runs one Dispatcher/Worker in the calling process; SIGTERM/SIGINT at any point stop it
gracefully (no new claims, the batch in hand finished and finalized) with exit code 0.

:func:`_run_processes` with ``processes > 1`` makes this process a supervisor of N children (``spawn``
start method) and guarantees:

* **Signals at any moment.** SIGTERM/SIGINT to the supervisor — also while children are still starting —
  stop every child gracefully and exit 0 (1 if a child then fails to stop cleanly). The supervisor never
  signals its children to stop: it closes the *lifeline*, a pipe every child watches, so a child started a
  moment after the signal learns of it as surely as one started before. Children are started with SIGTERM and
  SIGINT blocked until their handlers are installed, so a signal sent to the whole process group
  (``systemctl stop``, Ctrl-C) in a child's first milliseconds waits for the handler instead of killing it.
* **Supervision.** A child that exits while the pool runs (killed by the OOM killer, crashed) is logged with
  its cause (exit code or signal name) and replaced after a capped exponential backoff
  (:class:`RestartPolicy`). A slot whose child dies within ``RestartPolicy.quick`` seconds of its start
  ``give_up_after`` times in a row stops the pool with a :class:`~sa_outbox.errors.ConfigurationError` (the
  CLI prints it and exits 2) instead of a restart storm; so does, at once, a child that reports a
  configuration error (a bad target: exit code 2 and its one-line message).
* **Children die with the supervisor.** On Linux each child asks for ``PR_SET_PDEATHSIG`` (SIGTERM when the
  supervisor dies, even by SIGKILL); everywhere, the lifeline reaches end-of-file when the supervisor dies and
  the child stops itself. Either way the child finishes the batch in hand and claims nothing more, so a
  restarted supervisor never doubles the pool.
* **One metrics port.** With ``--metrics-port`` the supervisor serves ``/metrics`` for the whole pool on
  that one port; children send it their series over a pipe (see :mod:`sa_outbox._poolmetrics`).
* **One logging setup.** Children log with the supervisor's root level and format, to the same stderr.

This module imports nothing heavy at module level: a child imports it first, before its handlers exist.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess
    from types import FrameType

    from ._poolmetrics import PoolMetrics

log = logging.getLogger("sa_outbox.supervisor")

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_HAS_SIGMASK = hasattr(signal, "pthread_sigmask")  # POSIX; elsewhere the lifeline alone carries the stop
#: A child's exit code for "configuration error" (bad target, unreachable database at start): the same code
#: the CLI exits with for one, and a reason for the supervisor not to restart it.
CONFIG_ERROR_EXIT = 2


# --- one loop in this process -----------------------------------------------------------------------------


def _run_target(
    target: str,
    kind: str,
    early_signals: Sequence[int] = (),
    startup_timeout: float | None = 60.0,
    metrics_port: int | None = None,
    *,
    report: Connection | None = None,
    report_status: bool = False,
    restore_handlers: bool = True,
) -> int:
    """Load and run one loop in this process until SIGTERM/SIGINT, then return 0.

    A signal at any point — before the target is loaded, while it loads, while it runs — leads to a graceful
    stop and 0. ``early_signals``: signals received before this was called (the stop happens at once).
    ``metrics_port`` serves this loop's metrics; ``report`` instead sends them to a supervisor (child 0 with
    ``report_status`` also sends the queue gauges). Raises :class:`~sa_outbox.errors.ConfigurationError` for a
    bad target, a taken metrics port or a database never reached within ``startup_timeout``. The caller's
    SIGTERM/SIGINT handlers are put back on the way out unless ``restore_handlers`` is False (a child that
    exits right after)."""
    previous = {s: signal.getsignal(s) for s in _STOP_SIGNALS}
    try:
        return _load_and_serve(
            target, kind, early_signals, startup_timeout, metrics_port, report, report_status
        )
    finally:
        if restore_handlers:
            for s, handler in previous.items():
                if handler is not None:
                    signal.signal(s, handler)


def _load_and_serve(
    target: str, kind: str, early_signals: Sequence[int], startup_timeout: float | None,
    metrics_port: int | None, report: Connection | None, report_status: bool,
) -> int:  # fmt: skip
    state: dict[str, Any] = {"loop": None, "stop": False}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        state["stop"] = True
        if state["loop"] is not None:
            state["loop"].stop()

    for s in _STOP_SIGNALS:
        signal.signal(s, on_signal)
    # A supervisor starts its children with these blocked (see _signals_blocked): a signal that arrived
    # meanwhile is pending and runs on_signal right here.
    if _HAS_SIGMASK:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    if early_signals or state["stop"]:
        return 0
    from ._cli import EXIT_UNREACHABLE, load_target

    loop = load_target(target, kind)
    state["loop"] = loop
    if state["stop"]:
        return 0
    if metrics_port is not None:
        _serve_metrics(loop, metrics_port)
    reporter = None
    if report is not None:
        from ._poolmetrics import ChildReport

        reporter = ChildReport(loop, report, with_status=report_status).start()
    try:
        loop.serve(startup_timeout=startup_timeout)  # every flavour: handlers installed, closed at the end
        if loop.ended_unrecorded:  # (exit 0 said "stopped cleanly" over jobs left running — a review)
            log.error(
                "stopped without recording what it had in hand (the database out of reach): those rows stay "
                "leased until their lease expires, then are rescued and run again"
            )
            return EXIT_UNREACHABLE
        return 0
    finally:
        if reporter is not None:
            reporter.close()


def _serve_metrics(loop: Any, port: int) -> None:
    from ._poolmetrics import port_taken
    from .metrics import MetricsExporter

    try:
        MetricsExporter(loop).start(port)
    except OSError as exc:
        raise port_taken(port, exc) from None


# --- the child side ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ChildSpec:
    """Everything a child needs, pickled to it by the ``spawn`` start method."""

    target: str
    kind: str
    slot: int
    supervisor_pid: int
    lifeline: Connection
    report: Connection | None
    log_level: int
    log_formatter: logging.Formatter | None
    startup_timeout: float | None = 60.0


def _child(spec: _ChildSpec) -> None:  # pragma: no cover - runs in a child process
    """A child's whole life: bound to the supervisor, logging like it, running the target until told to stop.

    Exits 0 after a graceful stop, :data:`CONFIG_ERROR_EXIT` with a one-line message on a configuration error;
    any other exception is printed with its traceback (exit 1)."""
    # SIGTERM/SIGINT are blocked until _run_target installs the handlers: the threads started here inherit
    # that, so a signal meant for the process always reaches the main thread.
    _die_with_parent(spec.supervisor_pid)
    threading.Thread(
        target=_watch_lifeline, args=(spec.lifeline,), name="sa-outbox-lifeline", daemon=True
    ).start()
    _configure_logging(spec.log_level, spec.log_formatter)
    from .errors import OutboxError

    try:
        code = _run_target(
            spec.target, spec.kind, startup_timeout=spec.startup_timeout, report=spec.report,
            report_status=spec.slot == 0, restore_handlers=False,
        )  # fmt: skip
    except OutboxError as exc:
        sys.stderr.write(f"sa-outbox: error: {exc}\n")
        code = CONFIG_ERROR_EXIT
    finally:
        _ignore_stop_signals()
    raise SystemExit(code)


def _ignore_stop_signals() -> None:
    """Ignore SIGTERM/SIGINT from here to the process's exit: it has already stopped. Only for a process
    about to exit (a child; the CLI's entry point) — never in a caller's process, whose later children would
    inherit the ignored signals.

    Interpreter shutdown puts Python-level handlers back to the default action, so a second signal landing
    then (``systemctl stop`` repeated, a whole-group signal sent twice, Ctrl-C pressed again) would turn a
    clean exit into "killed by SIGTERM"; an ignored signal stays ignored through shutdown."""
    if threading.current_thread() is threading.main_thread():
        for s in _STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def _die_with_parent(supervisor_pid: int) -> bool:
    """Ask Linux to send this process SIGTERM when the supervisor dies (``prctl(PR_SET_PDEATHSIG)``).

    Returns False where that is not available (the lifeline still covers it). When the supervisor died before
    the request was made, sends the SIGTERM at once."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != supervisor_pid:  # orphaned before the request: nobody will send it
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def _watch_lifeline(lifeline: Connection) -> None:
    """Stop this process (SIGTERM to itself: the same graceful path as any signal) when the lifeline reaches
    end-of-file — the supervisor closed it to stop the pool, or died. Nothing is ever written to it."""
    with contextlib.suppress(OSError):
        lifeline.poll(None)
    os.kill(os.getpid(), signal.SIGTERM)


def _configure_logging(level: int, formatter: logging.Formatter | None) -> None:
    handler = logging.StreamHandler()  # stderr: the file the supervisor's own log goes to
    if formatter is not None:
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


# --- the supervisor ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RestartPolicy:
    """When the supervisor replaces a child that exited while the pool runs.

    The n-th death in a row within ``quick`` seconds of the child's start waits
    ``min(max_delay, first_delay * 2 ** (n - 1))`` before the restart; a death after a longer life waits
    ``first_delay``. The ``give_up_after``-th quick death in a row stops the pool."""

    first_delay: float = 0.5
    max_delay: float = 30.0
    quick: float = 10.0
    give_up_after: int = 5

    def delay(self, quick_deaths: int) -> float:
        return min(self.max_delay, self.first_delay * 2.0 ** max(0, quick_deaths - 1))


@dataclass
class _Slot:
    index: int
    proc: BaseProcess | None = None
    stats: Connection | None = None
    started_at: float = 0.0
    quick_deaths: int = 0
    restart_at: float = 0.0


class _Supervisor:
    """The supervisor's state and main loop: one slot per child, all of it driven from the main thread."""

    def __init__(
        self, target: str, kind: str, processes: int, metrics_port: int | None, policy: RestartPolicy
    ) -> None:
        import multiprocessing

        self.target, self.kind, self.metrics_port, self.policy = target, kind, metrics_port, policy
        self.ctx = multiprocessing.get_context("spawn")
        self.slots = [_Slot(i) for i in range(processes)]
        self.stopping = False
        self.fatal: str | None = None
        self.final_codes: dict[int, int | None] = {}
        self.metrics: PoolMetrics | None = None
        self.lifeline_w: Connection | None = None
        self.log_level, self.log_formatter = _log_setup()

    def run(self, early_signals: Sequence[int]) -> int:
        """Start the children and supervise them until a signal or a give-up; see :func:`_run_processes`."""
        self.wake_r, self.wake_w = os.pipe()  # the signal handler wakes the main loop through it
        os.set_blocking(self.wake_w, False)
        previous = {s: signal.signal(s, self._on_signal) for s in _STOP_SIGNALS}
        try:
            # early_signals is the list __main__ keeps appending to until the handlers above replaced its own.
            if early_signals or self.stopping:
                return 0
            self.lifeline_r, self.lifeline_w = self.ctx.Pipe(duplex=False)
            if self.metrics_port is not None:
                from ._poolmetrics import PoolMetrics

                with _signals_blocked():  # its server thread never takes a signal meant for the main loop
                    self.metrics = PoolMetrics(self.kind).start(self.metrics_port)
            self._loop()
        finally:
            self._close_lifeline()
            if self.metrics is not None:
                self.metrics.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
            os.close(self.wake_r)
            os.close(self.wake_w)
        if self.fatal is not None:
            from .errors import ConfigurationError

            raise ConfigurationError(self.fatal)
        return 0 if all(code == 0 for code in self.final_codes.values()) else 1

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        with contextlib.suppress(BlockingIOError):  # a full pipe: the loop is awake anyway
            os.write(self.wake_w, b"\0")

    def _loop(self) -> None:
        from multiprocessing.connection import wait

        announced = False
        while True:
            now = time.monotonic()
            if self.stopping:
                if not announced:
                    announced = True
                    log.info(
                        "stopping the pool: %d children finish their batch in hand", len(self._running())
                    )
                self._close_lifeline()
            else:
                for slot in self.slots:
                    if slot.proc is None and slot.restart_at <= now and not self.stopping:
                        self._start(slot)
            running = self._running()
            if self.stopping and not running:
                return
            waiting: list[Any] = [self.wake_r]
            for slot in running:
                assert slot.proc is not None
                waiting.append(slot.proc.sentinel)
                if slot.stats is not None:
                    waiting.append(slot.stats)
            due = [s.restart_at for s in self.slots if s.proc is None]
            timeout = None if self.stopping or not due else max(0.0, min(due) - time.monotonic())
            ready = wait(waiting, timeout)
            if self.wake_r in ready:
                os.read(self.wake_r, 512)
            for slot in running:
                assert slot.proc is not None
                if slot.stats is not None and slot.stats in ready:
                    self._receive(slot)
                if slot.proc.sentinel in ready:
                    self._reap(slot)

    def _running(self) -> list[_Slot]:
        return [s for s in self.slots if s.proc is not None]

    def _start(self, slot: _Slot) -> None:
        from multiprocessing import resource_tracker

        report = None
        if self.metrics is not None:
            slot.stats, report = self.ctx.Pipe(duplex=False)
        spec = _ChildSpec(
            self.target, self.kind, slot.index, os.getpid(), self.lifeline_r, report, self.log_level,
            self.log_formatter,
        )  # fmt: skip
        proc = self.ctx.Process(target=_child, args=(spec,), name=f"sa-outbox-{self.kind}-{slot.index}")
        # Starting multiprocessing's resource tracker blocks and then *unblocks* SIGINT/SIGTERM: have it
        # running before our block, or the first child would start without it.
        resource_tracker.ensure_running()
        with _signals_blocked():  # inherited: the child's handlers unblock them (see _run_target)
            proc.start()
        if report is not None:
            report.close()  # the child's end: only the child holds it now
        slot.proc, slot.started_at = proc, time.monotonic()
        if self.metrics is not None:
            self.metrics.set_processes(len(self._running()))
        log.info(
            "child %d started (pid %s)", slot.index, proc.pid, extra={"slot": slot.index, "pid": proc.pid}
        )

    def _receive(self, slot: _Slot) -> None:
        """Take every snapshot the child has sent so far; a closed or broken pipe is dropped."""
        assert slot.stats is not None
        try:
            while slot.stats.poll():
                snapshot = slot.stats.recv()
                if self.metrics is not None:
                    self.metrics.update(slot.index, snapshot)
        except (EOFError, OSError):
            slot.stats.close()
            slot.stats = None

    def _reap(self, slot: _Slot) -> None:
        proc = slot.proc
        assert proc is not None
        proc.join()
        code, pid = proc.exitcode, proc.pid
        proc.close()
        if slot.stats is not None:
            self._receive(slot)  # its last words (a graceful stop sends a final snapshot)
            if slot.stats is not None:
                slot.stats.close()
                slot.stats = None
        slot.proc = None
        lived = time.monotonic() - slot.started_at
        if self.metrics is not None:
            self.metrics.retire(slot.index)
            self.metrics.set_processes(len(self._running()))
        extra = {"slot": slot.index, "pid": pid, "exitcode": code, "uptime": round(lived, 3)}
        cause = describe_exit(code)
        if self.stopping:
            self.final_codes[slot.index] = code
            level = logging.INFO if code == 0 else logging.WARNING
            log.log(level, "child %d (pid %s) stopped: %s", slot.index, pid, cause, extra=extra)
            return
        if code == CONFIG_ERROR_EXIT:
            self._give_up(
                f"child {slot.index} (pid {pid}) stopped with a configuration error (its message is above); "
                f"not restarting: fix it and start the pool again"
            )
            return
        slot.quick_deaths = slot.quick_deaths + 1 if lived < self.policy.quick else 0
        if slot.quick_deaths >= self.policy.give_up_after:
            log.error("child %d (pid %s) %s after %.1fs", slot.index, pid, cause, lived, extra=extra)
            self._give_up(
                f"child {slot.index} died within {self.policy.quick:g}s of its start {slot.quick_deaths} times "
                f"in a row (last: {cause}); giving up instead of restarting it again: see its output above"
            )
            return
        delay = self.policy.delay(slot.quick_deaths)
        slot.restart_at = time.monotonic() + delay
        if self.metrics is not None:
            self.metrics.count_restart()
        log.warning(
            "child %d (pid %s) %s after %.1fs; restarting it in %.1fs", slot.index, pid, cause, lived, delay,
            extra={**extra, "restart_in": delay},
        )  # fmt: skip

    def _give_up(self, message: str) -> None:
        log.error(message)
        self.fatal = message
        self.stopping = True

    def _close_lifeline(self) -> None:
        if self.lifeline_w is not None:
            self.lifeline_w.close()  # every child sees end-of-file and stops itself
            self.lifeline_w = None


def describe_exit(code: int | None) -> str:
    """An exit status in an operator's words: ``exited with code 1``, ``killed by SIGKILL (…)``."""
    if code is None:
        return "is still running"
    if code >= 0:
        return f"exited with exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if name == "SIGKILL":
        return f"was killed by {name} (the kernel's OOM killer sends it when memory runs out)"
    return f"was killed by {name}"


@contextmanager
def _signals_blocked() -> Iterator[None]:
    """Block SIGTERM/SIGINT in this thread meanwhile; a signal that arrives waits (it is not lost).

    A child process and a thread inherit the blocked set: that is the point."""
    if not _HAS_SIGMASK:
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _log_setup() -> tuple[int, logging.Formatter | None]:
    """The root logger's level and the formatter of its first handler, when that can be sent to a child."""
    import pickle

    root = logging.getLogger()
    formatter = next((h.formatter for h in root.handlers if h.formatter is not None), None)
    try:
        pickle.dumps(formatter)
    except Exception:  # a custom formatter that cannot travel: the child keeps the level, default format
        formatter = None
    return root.level, formatter


def _run_processes(
    target: str,
    kind: str,
    processes: int,
    early_signals: Sequence[int] = (),
    metrics_port: int | None = None,
    *,
    policy: RestartPolicy | None = None,
) -> int:
    """Run the target in this process (``processes == 1``) or under a supervisor of ``processes`` children.

    Returns 0 after SIGTERM/SIGINT once every child has stopped gracefully, 1 if a child did not stop
    cleanly; raises :class:`~sa_outbox.errors.ConfigurationError` when the pool gives up (a configuration
    error in a child, a child that keeps dying at start) or the metrics port is taken. ``early_signals`` may
    keep growing while this starts (``python -m sa_outbox`` appends to it until its handlers are replaced)."""
    if processes == 1:
        return _run_target(target, kind, early_signals, metrics_port=metrics_port)
    supervisor = _Supervisor(target, kind, processes, metrics_port, policy or RestartPolicy())
    return supervisor.run(early_signals)
