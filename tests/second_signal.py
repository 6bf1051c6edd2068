"""A child process for test_processes: a second SIGTERM at every line of the first one's handler.

``python -m tests.second_signal URL worker|dispatcher`` runs the loop with its own signal handlers and sends
it a SIGTERM. A calibration round counts the lines the handler executes (``sys.settrace``, from the handler's
call to its return); round ``k`` then sends a second SIGTERM from the trace hook at the handler's ``k``-th line,
so every point of the first handling is interrupted once (a round whose handler ran untraced is run again). Each round prints ``round k stopped``; a round whose
handler deadlocks never prints it, and the test's timeout names the round. Exits 0 after the last round.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

from sqlalchemy import create_engine

from sa_outbox import Dispatcher, Message, Worker
from sa_outbox.models import Job, OutboxEvent


class _Quiet:
    def publish(self, message: Message) -> None:
        return None


def _round(engine: Any, kind: str, second_at: int | None) -> int:
    """One loop, stopped by SIGTERM; with ``second_at``, a second SIGTERM at that line of the handler. Returns
    the number of lines the handler executed."""
    loop: Worker | Dispatcher = (
        Worker(engine, Job, {"t": lambda job: None}, listen=False, poll_interval=0.01, heartbeat=0)
        if kind == "worker"
        else Dispatcher(engine, OutboxEvent, _Quiet(), listen=False, poll_interval=0.01)
    )
    seen = {"lines": 0, "depth": 0}

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        handler = signal.getsignal(signal.SIGTERM)
        if seen["depth"] == 0 and (event != "call" or frame.f_code is not getattr(handler, "__code__", None)):
            return None  # outside the handler: not traced line by line
        if event == "call":
            seen["depth"] += 1
        elif event == "return":
            seen["depth"] -= 1
        elif event == "line":
            seen["lines"] += 1
            if seen["lines"] == second_at:
                os.kill(os.getpid(), signal.SIGTERM)
        return trace

    def first() -> None:
        time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=first, daemon=True)
    sender.start()
    sys.settrace(trace)
    try:
        loop.run(install_signal_handlers=True)
    finally:
        sys.settrace(None)
    sender.join()
    if not loop.stopping:
        raise AssertionError("run() returned without a stop")
    return seen["lines"]


def _traced_round(engine: Any, kind: str, second_at: int | None) -> int:
    """A round whose first handler ran traced (up to 20 tries). A signal that lands while the trace hook itself
    runs has its handler run there, where nothing is traced: that round proves nothing and is run again."""
    for _ in range(20):
        lines = _round(engine, kind, second_at)
        if lines >= max(3, second_at or 0):
            return lines
    raise AssertionError(f"the handler was never traced as far as line {second_at} in 20 rounds")


def main() -> int:
    url, kind = sys.argv[1], sys.argv[2]
    # the handler logs (at INFO) before it stops the loop, as in a CLI process: those lines are swept too
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    engine = create_engine(url)
    # the fewest of three: a first round runs lines that later ones do not (first log record, first claim)
    lines = min(_traced_round(engine, kind, None) for _ in range(3))
    print(f"handler lines {lines}", flush=True)
    for k in range(1, lines + 1):
        _traced_round(engine, kind, k)
        print(f"round {k} stopped", flush=True)
    engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
