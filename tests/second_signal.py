"""A child process for test_processes: a SIGTERM at every line of code that a signal must be able to interrupt.

``python -m tests.second_signal URL worker|dispatcher MODE`` runs the loop with its own signal handlers,
logging at INFO through ``logging.handlers.QueueHandler`` (its ``queue.put`` holds a plain, non-reentrant lock;
a listener thread writes the records to stderr). ``sys.settrace`` counts the lines executed inside a watched
call, and round ``k`` sends a SIGTERM from the trace hook at the watched call's ``k``-th line:

* ``second`` — the watched call is the first SIGTERM's handler (sent by a thread 20 ms into the run); round
  ``k`` sends a second SIGTERM at its ``k``-th line;
* ``in-log`` — the watched call is the loop's first log record (``Logger.handle``: "started"); round ``k``
  sends the one SIGTERM at its ``k``-th line.

A calibration round counts the watched call's lines (the fewest of three). Each round prints ``round k
stopped``; a round that deadlocks never does, and the test's timeout names it. A round whose watched call ran
untraced (a signal handled inside the trace hook itself runs untraced) is run again. Exits 0 after the last.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from sqlalchemy import create_engine

from sa_outbox import Dispatcher, Worker
from sa_outbox.models import Job, OutboxEvent
from sa_outbox.testing import RecordingPublisher


def _handler_code() -> CodeType | None:
    return getattr(signal.getsignal(signal.SIGTERM), "__code__", None)


def _round(engine: Any, kind: str, mode: str, send_at: int | None) -> int:
    """One loop, stopped by SIGTERM; with ``send_at``, a SIGTERM at that line of the watched call. Returns the
    number of lines the watched call executed."""
    loop: Worker | Dispatcher = (
        Worker(engine, Job, {"t": lambda job: None}, listen=False, poll_interval=0.01, heartbeat=0)
        if kind == "worker"
        else Dispatcher(engine, OutboxEvent, RecordingPublisher(), listen=False, poll_interval=0.01)
    )
    watched: Callable[[], CodeType | None] = (
        _handler_code if mode == "second" else lambda: logging.Logger.handle.__code__
    )
    seen = {"lines": 0, "depth": 0, "done": False, "sent": False}

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if seen["depth"] == 0 and (seen["done"] or event != "call" or frame.f_code is not watched()):
            return None  # outside the watched call (or after it): not traced line by line
        if event == "call":
            seen["depth"] += 1
        elif event == "return":
            seen["depth"] -= 1
            seen["done"] = seen["depth"] == 0
        elif event == "line":
            seen["lines"] += 1
            if seen["lines"] == send_at:
                seen["sent"] = True
                os.kill(os.getpid(), signal.SIGTERM)
        return trace

    # The first SIGTERM of "second" rounds, and of in-log calibration rounds; an in-log round whose watched call
    # ended before line send_at (a shorter path than in calibration) is stopped the same way, later, and run
    # again by _traced_round.
    outside_only = mode == "second" or send_at is None
    done = threading.Event()

    def first() -> None:
        if not done.wait(0.02 if outside_only else 0.5) and (outside_only or not seen["sent"]):
            os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=first, daemon=True)
    sender.start()
    sys.settrace(trace)
    try:
        loop.run(install_signal_handlers=True)
    finally:
        sys.settrace(None)
        done.set()
    sender.join()
    if not loop.stopping:
        raise AssertionError("run() returned without a stop")
    return seen["lines"]


def _traced_round(engine: Any, kind: str, mode: str, send_at: int | None) -> int:
    """A round whose watched call ran traced as far as ``send_at`` (up to 20 tries)."""
    for _ in range(20):
        lines = _round(engine, kind, mode, send_at)
        if lines >= max(3, send_at or 0):
            return lines
    raise AssertionError(f"the watched call was never traced as far as line {send_at} in 20 rounds")


def main() -> int:
    url, kind, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    records: queue.Queue[logging.LogRecord] = queue.Queue()
    to_stderr = logging.StreamHandler(sys.stderr)
    to_stderr.setFormatter(logging.Formatter("%(message)s"))
    listener = logging.handlers.QueueListener(records, to_stderr)
    listener.start()
    logging.basicConfig(level=logging.INFO, handlers=[logging.handlers.QueueHandler(records)])
    engine = create_engine(url)
    # the fewest of three: a first round runs lines that later ones do not (first log record, first claim)
    lines = min(_traced_round(engine, kind, mode, None) for _ in range(3))
    print(f"watched lines {lines}", flush=True)
    for k in range(1, lines + 1):
        _traced_round(engine, kind, mode, k)
        print(f"round {k} stopped", flush=True)
    engine.dispose()
    listener.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
