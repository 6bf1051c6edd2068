"""The ``sa-outbox`` command line (also ``python -m sa_outbox``).

``dispatch TARGET`` / ``worker TARGET`` run a Dispatcher/Worker named by ``module:attribute`` (the attribute
may be the object itself or a zero-argument factory returning one). SIGTERM/SIGINT stop them gracefully with
exit code 0 — also when the signal arrives during start-up.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from ._version import __version__
from .errors import ConfigurationError, OutboxError

__all__ = ["load_target", "main"]

log = logging.getLogger("sa_outbox.cli")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        sys.stderr.write(f"sa-outbox: error: {message}\n")
        raise SystemExit(2)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url", default=os.environ.get("DATABASE_URL"), help="database URL (default: $DATABASE_URL)"
    )
    p.add_argument("--outbox-table", default="outbox", help="outbox table name (default: outbox)")
    p.add_argument("--jobs-table", default="jobs", help="jobs table name (default: jobs)")


def load_target(target: str, kind: str) -> Any:
    """Import ``module:attribute`` and return the Dispatcher/Worker it names (calling a factory if needed)."""
    from .dispatcher import Dispatcher
    from .worker import Worker

    expected: type[Any] = Dispatcher if kind == "dispatch" else Worker
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(
            f"target {target!r} must look like module:attribute (e.g. myapp.outbox:dispatcher)"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigurationError(
            f"cannot import module {module_name!r} of target {target!r}: {exc}"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigurationError(f"module {module_name!r} has no attribute {attr!r} (target {target!r})")
        obj = getattr(obj, part)
    if not isinstance(obj, expected) and callable(obj) and not isinstance(obj, type):
        obj = obj()
    if not isinstance(obj, expected):
        raise ConfigurationError(
            f"target {target!r} is a {type(obj).__name__}, expected a {expected.__name__} "
            f"or a zero-argument factory returning one"
        )
    return obj


def _run_target(target: str, kind: str, early_signals: Sequence[int] = ()) -> int:
    """Load and run one loop in this process; SIGTERM/SIGINT at any point → graceful stop, exit 0."""
    state: dict[str, Any] = {"loop": None, "stop": bool(early_signals)}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        state["stop"] = True
        if state["loop"] is not None:
            state["loop"].stop()

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    if state["stop"]:
        return 0
    loop = load_target(target, kind)
    state["loop"] = loop
    if state["stop"]:
        return 0
    try:
        loop.run(install_signal_handlers=False)
    finally:
        loop.close()
    return 0


def _child(target: str, kind: str) -> None:  # pragma: no cover - runs in a child process
    raise SystemExit(_run_target(target, kind))


def _run_processes(target: str, kind: str, processes: int, early_signals: Sequence[int] = ()) -> int:
    if processes == 1 or early_signals:
        return _run_target(target, kind, early_signals)
    ctx = multiprocessing.get_context("spawn")
    children = [
        ctx.Process(target=_child, args=(target, kind), name=f"sa-outbox-{kind}-{i}")
        for i in range(processes)
    ]
    stopping = threading.Event()

    def forward(signum: int, frame: FrameType | None) -> None:
        stopping.set()
        for c in children:
            if c.pid is not None and c.is_alive():
                os.kill(c.pid, signal.SIGTERM)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)
    for c in children:
        c.start()
    for c in children:
        c.join()
    codes = [c.exitcode for c in children]
    return 0 if all(code == 0 for code in codes) else 1


def _cmd_loop(args: argparse.Namespace) -> int:
    if args.processes < 1:
        raise ConfigurationError("--processes must be >= 1")
    return _run_processes(args.target, args.command, args.processes, args.early_signals)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sa-outbox", description="Transactional outbox and job queue for SQLAlchemy + PostgreSQL."
    )
    parser.add_argument("--version", action="version", version=f"sa-outbox {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("SA_OUTBOX_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    for name, what in (("dispatch", "Dispatcher"), ("worker", "Worker")):
        p = sub.add_parser(name, help=f"run a {what} named by module:attribute")
        p.add_argument("target", metavar="TARGET", help=f"module:attribute naming a {what} or a factory")
        p.add_argument("--processes", type=int, default=1, help="run N copies in separate processes")
        p.set_defaults(handler=_cmd_loop)
    return parser


def main(argv: Sequence[str] | None = None, *, early_signals: Sequence[int] = ()) -> int:
    """Run the CLI; ``early_signals`` are SIGTERM/SIGINT received before it started (see ``__main__``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.early_signals = early_signals
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        code: int = args.handler(args)
    except OutboxError as exc:
        sys.stderr.write(f"sa-outbox: error: {exc}\n")
        return 2
    return code
