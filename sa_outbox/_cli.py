"""The ``sa-outbox`` command line (also ``python -m sa_outbox``).

``dispatch TARGET`` / ``worker TARGET`` run a Dispatcher/Worker named by ``module:attribute`` (the attribute
may be the object itself or a zero-argument factory returning one). SIGTERM/SIGINT stop them gracefully with
exit code 0 — also when the signal arrives during start-up.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
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
    from ._aio import AsyncDispatcher, AsyncWorker
    from ._dispatcher import Dispatcher
    from ._worker import Worker

    expected: tuple[type[Any], ...] = (
        (Dispatcher, AsyncDispatcher) if kind == "dispatch" else (Worker, AsyncWorker)
    )
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
            f"target {target!r} is a {type(obj).__name__}, expected a {expected[0].__name__} "
            f"(or its async twin) or a zero-argument factory returning one"
        )
    return obj


def _cmd_loop(args: argparse.Namespace) -> int:
    """``dispatch``/``worker``: the loop here, or ``--processes N`` children under a supervisor (see
    ``sa_outbox._supervisor`` for what the supervisor guarantees)."""
    from ._supervisor import _run_processes

    if args.processes < 1:
        raise ConfigurationError("--processes must be >= 1")
    return _run_processes(args.target, args.command, args.processes, args.early_signals, args.metrics_port)


# --- operations: status / check / dead / purge ------------------------------------------------------------


def _engine(args: argparse.Namespace) -> Any:
    from sqlalchemy import create_engine

    from .embedded import normalize_url

    if not args.url:
        raise ConfigurationError("no database URL: pass --url or set DATABASE_URL")
    engine = create_engine(normalize_url(args.url))
    args.engines.append(engine)  # disposed by main()
    return engine


def _tables(
    args: argparse.Namespace, engine: Any, kinds: Sequence[str] = ("outbox", "jobs")
) -> list[tuple[str, Any]]:
    """(kind, model) for each requested table that exists."""
    from sqlalchemy import inspect

    from .models import model_for

    found = []
    insp = inspect(engine)
    for kind in kinds:
        name = args.outbox_table if kind == "outbox" else args.jobs_table
        if insp.has_table(name):
            found.append((kind, model_for(kind, name)))
    if not found:
        names = ", ".join(args.outbox_table if k == "outbox" else args.jobs_table for k in kinds)
        raise ConfigurationError(
            f"no table {names} in this database: run the migration (alembic upgrade head)"
        )
    return found


def _print_json(data: Any) -> None:
    import json

    print(json.dumps(data, indent=2, default=str, sort_keys=True))


def _fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _cmd_status(args: argparse.Namespace) -> int:
    from .monitoring import queue_status

    engine = _engine(args)
    reports = [
        queue_status(engine, model, long_transaction=args.long_transaction)
        for _, model in _tables(args, engine)
    ]
    if args.json:
        _print_json({r.table: r.as_dict() for r in reports})
        return 0
    for r in reports:
        print(f"{r.table}  ({r.kind})")
        counts = "   ".join(
            f"{k} {v:,}" + ("~" if r.done_is_estimate and k == "done" else "") for k, v in r.counts.items()
        )
        print(f"  {counts}")
        print(
            f"  oldest unfinished age  {_fmt_age(r.oldest_pending_age):>10}    oldest due ready  {_fmt_age(r.oldest_ready_age)}"
        )
        print(f"  expired leases         {r.expired_leases:>10}")
        if r.attempts:
            print("  attempts               " + "  ".join(f"{a}: {n}" for a, n in r.attempts.items()))
        for q, by in sorted(r.queues.items()):
            print(f"  queue {q:<16} " + "  ".join(f"{k} {v}" for k, v in by.items()))
        if r.health:
            h = r.health
            print(
                f"  table                  live {h.live_tuples:,}  dead {h.dead_tuples:,} ({h.dead_ratio:.0%})  "
                f"last autovacuum {h.last_autovacuum or 'never'}  size {h.total_bytes / 1024:.0f} kB"
            )
        for w in r.warnings:
            print(f"  ! {w}")
        print()
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from .monitoring import queue_status

    engine = _engine(args)
    problems: list[str] = []
    summary: dict[str, Any] = {}
    for _, model in _tables(args, engine):
        r = queue_status(engine, model)
        summary[r.table] = {
            "oldest_pending_age": r.oldest_pending_age,
            "dead": r.dead,
            "expired_leases": r.expired_leases,
        }
        limit = (
            args.max_oldest_pending_age.total_seconds() if args.max_oldest_pending_age is not None else None
        )
        if limit is not None and r.oldest_pending_age is not None and r.oldest_pending_age > limit:
            problems.append(f"{r.table}: oldest pending age {r.oldest_pending_age:.0f}s > {limit:g}s")
        if args.max_dead is not None and r.dead > args.max_dead:
            problems.append(f"{r.table}: {r.dead} dead/failed > {args.max_dead}")
        if args.max_expired_leases is not None and r.expired_leases > args.max_expired_leases:
            problems.append(f"{r.table}: {r.expired_leases} expired leases > {args.max_expired_leases}")
    if args.json:
        _print_json({"ok": not problems, "problems": problems, "tables": summary})
    else:
        print(("FAIL: " + "; ".join(problems)) if problems else "OK: " + ", ".join(summary))
    return 1 if problems else 0


def _dead_filters(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    filters: dict[str, Any] = {"error_contains": args.error, "older_than": args.older_than}
    if kind == "outbox":
        filters.update(
            event_type=args.event_type, aggregate_type=args.aggregate_type, aggregate_id=args.aggregate
        )
    else:
        filters.update(task=args.task, queue=args.queue)
    return filters


def _cmd_dead(args: argparse.Namespace) -> int:
    from . import admin

    engine = _engine(args)
    kind = "jobs" if args.jobs else "outbox"
    [(_, model)] = _tables(args, engine, (kind,))
    if args.action == "list":
        rows = admin.list_dead(engine, model, limit=args.limit, **_dead_filters(args, kind))
        if args.json:
            _print_json(rows)
        else:
            for r in rows:
                what = (
                    f"{r['aggregate_type']}/{r['aggregate_id']} {r['event_type']}"
                    if kind == "outbox"
                    else f"{r['queue']}/{r['task']}"
                )
                print(
                    f"{r['id']:>10}  {what}  attempts={r['attempts']}  {str(r['last_error'] or '').splitlines()[-1:]}"
                )
            print(f"{len(rows)} row(s)")
        return 0
    if args.action == "show":
        rows = admin.list_dead(engine, model, ids=[args.id], limit=1)
        if not rows:
            raise ConfigurationError(f"no dead/failed row with id {args.id} in {model.__table__.name}")
        _print_json(rows[0]) if args.json else [print(f"{k:>15}: {v}") for k, v in rows[0].items()]
        return 0
    fn = admin.retry_dead if args.action == "retry" else admin.skip_dead
    ids = args.ids or None
    changed = fn(engine, model, ids=ids, all=args.all, batch_size=args.batch_size, dry_run=args.dry_run,
                 **_dead_filters(args, kind))  # fmt: skip
    verb = {"retry": "requeued", "skip": "skipped"}[args.action]
    if args.json:
        _print_json({"dry_run": args.dry_run, verb: changed})
    else:
        print(f"{'would be ' if args.dry_run else ''}{verb}: {len(changed)} row(s) {changed[:50]}")
    return 0


def _cmd_purge(args: argparse.Namespace) -> int:
    from .monitoring import purge

    engine = _engine(args)
    result = {}
    for _, model in _tables(args, engine):
        result[model.__table__.name] = purge(engine, model, older_than=args.older_than, batch_size=args.batch_size,
                                             dry_run=args.dry_run)  # fmt: skip
    if args.json:
        _print_json({"dry_run": args.dry_run, "deleted": result})
    else:
        for table, n in result.items():
            print(f"{table}: {'would delete' if args.dry_run else 'deleted'} {n} done row(s)")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import doctor

    engine = _engine(args)
    target = load_target(args.target, "dispatch") if args.target else None
    findings = doctor(engine, [m for _, m in _tables(args, engine)], long_transaction=args.long_transaction,
                      target=target)  # fmt: skip
    failed = any(f.status == "fail" for f in findings)
    if args.json:
        _print_json({"ok": not failed, "findings": [f.as_dict() for f in findings]})
    else:
        for f in findings:
            where = f" [{f.table}]" if f.table else ""
            print(f"{f.status.upper():<4}  {f.check}{where}: {f.message}")
            if f.fix and f.status != "ok":
                print(f"      fix: {f.fix}")
    return 1 if failed else 0


def _cmd_locks(args: argparse.Namespace) -> int:
    from .doctor import locks

    engine = _engine(args)
    found = locks(engine, [args.outbox_table, args.jobs_table])
    if args.json:
        _print_json([lk.as_dict() for lk in found])
        return 0
    if not found:
        print("no session holds or waits for locks on the queue tables")
    for lk in found:
        flag = "  <- idle in transaction holding queue locks" if lk.idle_in_transaction else ""
        print(f"pid {lk.pid} ({lk.application_name or '-'}) {lk.state} wait={lk.wait_event_type or '-'}/"
              f"{lk.wait_event or '-'} xact={lk.transaction_seconds or 0:.1f}s blocked_by={lk.blocked_by or '-'}{flag}")  # fmt: skip
        if lk.holds:
            print(f"    holds: {', '.join(lk.holds)}")
        print(f"    query: {lk.query[:160]}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    return 0 if run_demo(args.url) else 1


def _duration(text_: str) -> Any:
    from ._durations import parse_duration

    try:
        return parse_duration(text_)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _nonneg(text_: str) -> int:
    value = int(text_)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


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
        p.add_argument(
            "--metrics-port",
            type=int,
            default=None,
            help="serve Prometheus metrics on this port (with --processes N: the whole pool's, on this one port)",
        )
        p.set_defaults(handler=_cmd_loop)

    p = sub.add_parser("demo", help="run a small order service end to end and print a verdict")
    p.add_argument(
        "--url", default=os.environ.get("DATABASE_URL"), help="default: $DATABASE_URL, else embedded"
    )
    p.set_defaults(handler=_cmd_demo)

    p = sub.add_parser(
        "status", help="depth, oldest age, expired leases, attempts, dead letters, table health"
    )
    _common(p)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--long-transaction",
        type=_duration,
        default=_duration("60s"),
        help="report transactions open longer than this as holding back the xmin horizon (default 60s)",
    )
    p.set_defaults(handler=_cmd_status)

    p = sub.add_parser("check", help="exit non-zero with a one-line reason when a threshold is passed")
    _common(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--max-oldest-pending-age", type=_duration, default=None)
    p.add_argument("--max-dead", type=_nonneg, default=None)
    p.add_argument("--max-expired-leases", type=_nonneg, default=None)
    p.set_defaults(handler=_cmd_check)

    dead = sub.add_parser(
        "dead", help="dead letters: list, show, retry, skip (outbox; --jobs for failed jobs)"
    )
    dsub = dead.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    dsub.required = True
    for action in ("list", "show", "retry", "skip"):
        p = dsub.add_parser(action)
        _common(p)
        p.add_argument("--json", action="store_true")
        p.add_argument("--jobs", action="store_true", help="act on failed jobs instead of dead outbox rows")
        if action == "show":
            p.add_argument("id", type=int)
        else:
            p.add_argument("--event-type")
            p.add_argument("--aggregate-type")
            p.add_argument("--aggregate", help="aggregate id")
            p.add_argument("--task")
            p.add_argument("--queue")
            p.add_argument("--error", help="text contained in last_error")
            p.add_argument("--older-than", type=_duration)
        if action == "list":
            p.add_argument("--limit", type=int, default=100)
        if action in ("retry", "skip"):
            p.add_argument("ids", nargs="*", type=int, help="ids to act on")
            p.add_argument("--all", action="store_true", help="every dead row (with no ids/filters)")
            p.add_argument("--dry-run", action="store_true", help="print what would change, change nothing")
            p.add_argument("--batch-size", type=int, default=1000)
        p.set_defaults(handler=_cmd_dead)

    p = sub.add_parser(
        "doctor", help="diagnose a slow or stuck queue: plans, indexes, vacuum, xmin horizon, locks"
    )
    _common(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--long-transaction", type=_duration, default=_duration("5m"))
    p.add_argument("--target", help="module:attribute of a Dispatcher, to check its lease against its batch")
    p.set_defaults(handler=_cmd_doctor)

    p = sub.add_parser("locks", help="who holds or waits for locks on the queue tables, and who blocks whom")
    _common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_cmd_locks)

    p = sub.add_parser("purge", help="delete done rows older than a duration, in bounded batches")
    _common(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--older-than", type=_duration, required=True)
    p.add_argument("--batch-size", type=int, default=10_000)
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(handler=_cmd_purge)
    return parser


def main(argv: Sequence[str] | None = None, *, early_signals: Sequence[int] = ()) -> int:
    """Run the CLI; ``early_signals`` are SIGTERM/SIGINT received before it started (see ``__main__``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.early_signals = early_signals
    args.engines = []
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        code: int = args.handler(args)
    except OutboxError as exc:
        sys.stderr.write(f"sa-outbox: error: {exc}\n")
        return 2
    finally:
        for engine in args.engines:
            engine.dispose()
    return code
