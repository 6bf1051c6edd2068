"""The ``sa-outbox`` command line (also ``python -m sa_outbox``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ._version import __version__

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # A clear one-line reason and the list of commands, exit 2 (argparse's convention).
        self.print_usage(sys.stderr)
        sys.stderr.write(f"sa-outbox: error: {message}\n")
        raise SystemExit(2)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url", default=os.environ.get("DATABASE_URL"), help="database URL (default: $DATABASE_URL)"
    )
    p.add_argument("--outbox-table", default="outbox", help="outbox table name (default: outbox)")
    p.add_argument("--jobs-table", default="jobs", help="jobs table name (default: jobs)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sa-outbox", description="Transactional outbox and job queue for SQLAlchemy + PostgreSQL."
    )
    parser.add_argument("--version", action="version", version=f"sa-outbox {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:  # pragma: no cover - argparse requires a command
        parser.error("a command is required")
    code: int = handler(args)
    return code
