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
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ._version import __version__
from .errors import ConfigurationError, OutboxError, PartitionClosedError

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
    p.add_argument("--outbox-table", default=_Default("outbox"), help="outbox table name (default: outbox)")
    p.add_argument("--jobs-table", default=_Default("jobs"), help="jobs table name (default: jobs)")


def _typed(args: argparse.Namespace, kind: str) -> bool:
    """Whether ``--<kind>-table`` was given on the command line (not defaulted)."""
    return not isinstance(getattr(args, f"{kind}_table"), _Default)


class _Default(str):
    """A table name the command defaulted to, told apart from one typed: a typed one that does not exist is an
    error, a default one is skipped when the other table exists."""

    __slots__ = ()


def load_target(target: str, kind: str) -> Any:
    """Import ``module:attribute`` and return the Dispatcher/Worker it names (calling a factory if needed)."""
    from ._dispatcher import AsyncDispatcher, Dispatcher
    from ._worker import AsyncWorker, Worker

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


# --- operations: status / check / dead / purge / doctor / locks ---------------------------------------------


#: Seconds a command waits for a connection, unless the URL sets ``connect_timeout``: then it exits 3.
CONNECT_TIMEOUT = 10


def _engine(args: argparse.Namespace) -> Any:
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from .embedded import normalize_url

    if not args.url:
        raise ConfigurationError("no database URL: pass --url or set DATABASE_URL")
    try:
        url = make_url(normalize_url(args.url))
        # No server-side prepared statements: an operator's command runs a handful of statements, and the URL
        # may well be PgBouncer's in transaction mode, where a prepared name does not survive the transaction.
        connect: dict[str, Any] = {"prepare_threshold": None}
        if (
            "connect_timeout" not in url.query
        ):  # (psycopg's own is 130 s: a hung server held a check that long)
            connect["connect_timeout"] = CONNECT_TIMEOUT
        engine = create_engine(url, connect_args=connect)
    except Exception as exc:  # ArgumentError, a bad port, an unknown or missing driver
        raise ConfigurationError(
            f"invalid database URL (--url / DATABASE_URL): {exc}; expected "
            "postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE"
        ) from None
    args.engines.append(engine)  # disposed by main()
    return engine


def _split_table(option: str, name: str) -> tuple[str | None, str]:
    """``schema.table`` or ``table`` (in the search path)."""
    parts = name.split(".")
    if len(parts) > 2 or not all(parts):
        raise ConfigurationError(f"{option} {name!r}: give a table name or schema.table")
    return (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])


def _tables(
    args: argparse.Namespace, engine: Any, kinds: Sequence[str] = ("outbox", "jobs")
) -> list[tuple[str, Any]]:
    """(kind, model) for each requested table that exists; schema-qualified names (``app.outbox``) work. A
    default table that does not exist is skipped when the other does; one named with ``--outbox-table`` or
    ``--jobs-table`` that does not exist is an error (a review: ``check --outbox-table outbx`` printed OK for
    the jobs table alone, exit 0 — a monitor with a typo stayed green)."""
    from sqlalchemy import inspect, text

    from ._partitions import table_period
    from .models import model_for

    found, absent = [], []
    insp = inspect(engine)
    for kind in kinds:
        option = f"--{kind}-table"
        schema, table = _split_table(option, args.outbox_table if kind == "outbox" else args.jobs_table)
        if insp.has_table(table, schema=schema):
            with engine.connect() as conn:
                period = table_period(conn, table, schema)
            found.append((kind, model_for(kind, table, schema, partitioned=period)))
        else:
            absent.append((option, schema, table))
    typed = [(o, s, t) for o, s, t in absent if _typed(args, o[2:].removesuffix("-table"))]
    if found and not typed:
        return found
    absent = typed or absent
    hints = []
    with engine.connect() as conn:
        for option, _schema, table in absent:
            elsewhere = (
                conn.execute(
                    text(
                        "SELECT table_schema FROM information_schema.tables WHERE table_name = :t "
                        "AND table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 1"
                    ),
                    {"t": table},
                )
                .scalars()
                .all()
            )
            if elsewhere:
                hints.append(f"{table} exists in schema {', '.join(elsewhere)}: pass {option} "
                             f"{elsewhere[0]}.{table}")  # fmt: skip
    names = ", ".join(f"{s + '.' if s else ''}{t}" for _, s, t in absent)
    if hints:
        raise ConfigurationError(f"no table {names} where this command looked; " + "; ".join(hints))
    raise ConfigurationError(
        f"no table {names} in this database: check --outbox-table/--jobs-table (schema.table for a table "
        "outside the search path), or create the tables (alembic upgrade head)"
    )


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


def _stale_after(args: argparse.Namespace) -> Any:
    return args.stale_after if args.stale_after is not None else 60.0


def _cmd_status(args: argparse.Namespace) -> int:
    from .monitoring import queue_status

    engine = _engine(args)
    reports = [
        queue_status(engine, model, long_transaction=args.long_transaction, stale_after=_stale_after(args))
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
        print(f"  {counts}" + ("   (~ estimated from the statistics)" if r.done_is_estimate else ""))
        print(
            f"  oldest pending age      {_fmt_age(r.oldest_pending_age):>9}    (due, not started: what check alerts on)"
        )
        print(
            f"  oldest unfinished age   {_fmt_age(r.oldest_unfinished_age):>9}    (includes rows due later)"
        )
        print(
            f"  last done               {_fmt_age(r.last_done_age):>9}    ago (the newest row finished done)"
        )
        if r.destination_unavailable is not None:
            o = r.destination_unavailable
            print(f"  destination           unavailable    {o.rows} of the {o.sampled} oldest due rows given back "
                  f"for it: {o.error}")  # fmt: skip
        window = (
            f"    (running longer than stale_after {r.stale_after:g}s)" if r.stale_after is not None else ""
        )
        print(f"  expired leases          {r.expired_leases:>9}{window}")
        if r.attempts:
            print("  attempts                " + "  ".join(f"{a}: {n}" for a, n in r.attempts.items()))
        for q, by in sorted(r.queues.items()):
            since = f"  PAUSED since {r.paused_queues[q]}" if q in r.paused_queues else ""
            print(f"  queue {q:<17} " + "  ".join(f"{k} {v}" for k, v in by.items()) + since)
        for q in sorted(set(r.paused_queues) - set(r.queues)):
            print(f"  queue {q:<17} PAUSED since {r.paused_queues[q]}")
        for key, by in r.concurrency_keys.items():
            print(f"  concurrency key {key!r:<7} " + "  ".join(f"{k} {v}" for k, v in by.items()))
        if r.partitions:
            print(
                f"  partitions              {r.partitions:>9}    ({len(r.held_partitions)} past one(s) held by rows)"
            )
        if r.health:
            h = r.health
            print(
                f"  table                   live {h.live_tuples:,}  dead {h.dead_tuples:,} ({h.dead_ratio:.0%})  "
                f"last autovacuum {h.last_autovacuum or 'never'}  size {h.total_bytes / 1024:.0f} kB"
            )
        for b in r.blocked_aggregates:
            print(f"  blocked aggregate       {b.aggregate_type}/{b.aggregate_id}: {b.waiting} pending behind dead "
                  f"{b.dead_id} (sa-outbox dead show {b.dead_id})")  # fmt: skip
        for w in r.warnings:
            print(f"  ! {w}")
        print()
    horizon = reports[0].horizon_warnings if reports else []
    if horizon:  # about the database, not one table: said once
        print("database")
        for w in horizon:
            print(f"  ! {w}")
        print()
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from .monitoring import queue_status

    engine = _engine(args)
    age_limit = None if args.max_oldest_pending_age is None else args.max_oldest_pending_age.total_seconds()
    max_dead = args.max_dead
    if age_limit is None and max_dead is None and args.max_expired_leases is None:
        max_dead = 0  # no threshold given: dead letters never fix themselves, so any of them fails the check
    thresholds = {"max_oldest_pending_age": age_limit, "max_dead": max_dead,
                  "max_expired_leases": args.max_expired_leases}  # fmt: skip
    problems: list[str] = []
    summary: dict[str, Any] = {}
    fine: list[str] = []  # (a FAIL line said nothing of the tables that passed)
    for _, model in _tables(args, engine):
        before = len(problems)
        r = queue_status(engine, model, stale_after=_stale_after(args))
        dead_word = "failed" if r.kind == "jobs" else "dead"
        summary[r.table] = {
            "oldest_pending_age": r.oldest_pending_age,
            "oldest_unfinished_age": r.oldest_unfinished_age,
            "dead": r.dead,
            "expired_leases": r.expired_leases,
        }
        if age_limit is not None and r.oldest_pending_age is not None and r.oldest_pending_age > age_limit:
            problems.append(
                f"{r.table}: oldest pending age (due, not started) {r.oldest_pending_age:.0f}s > {age_limit:g}s"
            )
        if max_dead is not None and r.dead > max_dead:
            problems.append(f"{r.table}: {r.dead} {dead_word} > {max_dead}")
        if args.max_expired_leases is not None and r.expired_leases > args.max_expired_leases:
            problems.append(f"{r.table}: {r.expired_leases} expired leases > {args.max_expired_leases}")
        if len(problems) == before:
            fine.append(r.table)
    if args.json:
        _print_json({"ok": not problems, "problems": problems, "thresholds": thresholds, "tables": summary})
    else:
        checked = ", ".join(f"{k.removeprefix('max_').replace('_', ' ')} <= {v:g}"
                            for k, v in thresholds.items() if v is not None)  # fmt: skip
        passed = " (ok: " + ", ".join(fine) + ")" if fine else ""
        print(f"FAIL: {'; '.join(problems)}{passed}" if problems else f"OK: {', '.join(summary)} ({checked})")
    return 1 if problems else 0


#: ``dead``'s filters of one table: (option, admin keyword) — the outbox's, then the jobs'.
_DEAD_FILTERS = {
    "outbox": (
        ("--event-type", "event_type"),
        ("--aggregate-type", "aggregate_type"),
        ("--aggregate", "aggregate_id"),
    ),
    "jobs": (("--task", "task"), ("--queue", "queue")),
}


def _dead_options(kind: str) -> list[str]:
    """The filter options of ``dead`` for ``kind``'s table, as typed."""
    return [option for option, _ in _DEAD_FILTERS[kind]] + ["--error", "--older-than"]


def _dead_filters(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """The admin call's filters for ``kind``'s table. A filter of the other table is refused, naming it: left
    out, the command would act on every row the other filters match."""
    other = "jobs" if kind == "outbox" else "outbox"
    given = [
        option
        for option, _ in _DEAD_FILTERS[other]
        if getattr(args, option[2:].replace("-", "_")) is not None
    ]
    if given:
        table = "failed jobs (add --jobs)" if other == "jobs" else "dead outbox rows (leave out --jobs)"
        raise ConfigurationError(
            f"{', '.join(given)} filter{'' if len(given) > 1 else 's'} {table}; this command acts on "
            f"{'failed jobs (--jobs)' if kind == 'jobs' else 'dead outbox rows'}"
        )
    filters: dict[str, Any] = {"error_contains": args.error, "older_than": args.older_than}
    filters.update(
        {name: getattr(args, option[2:].replace("-", "_")) for option, name in _DEAD_FILTERS[kind]}
    )
    return filters


def _last_line(error: str | None, width: int = 120) -> str:
    lines = [line for line in (error or "").splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "-"
    return last if len(last) <= width else last[: width - 1] + "…"


def _cmd_dead(args: argparse.Namespace) -> int:
    from . import admin

    engine = _engine(args)
    kind = "jobs" if args.jobs else "outbox"
    other = "outbox" if args.jobs else "jobs"
    # the other table named alone: meant for it (``dead list --jobs-table j`` without --jobs); both named is a
    # script passing its tables to every command
    if _typed(args, other) and not _typed(args, kind):
        raise ConfigurationError(
            f"--{other}-table names the {other} table, but this command acts on "
            f"{'failed jobs (--jobs)' if kind == 'jobs' else 'dead outbox rows'}"
            f"{'' if args.jobs else ': add --jobs for failed jobs'}"
        )
    [(_, model)] = _tables(args, engine, (kind,))
    if args.action == "list":
        rows = admin.list_dead(engine, model, limit=args.limit + 1, **_dead_filters(args, kind))
        more = len(rows) > args.limit
        rows = rows[: args.limit]
        if more:  # (a silent cut at 100 of 25,002 read as "100 failed jobs" — a review)
            sys.stderr.write(
                f"sa-outbox: the first {args.limit} row(s); more match — raise --limit to see them\n"
            )
        if args.json:
            _print_json(rows)
        else:
            for r in rows:
                what = (
                    f"{r['aggregate_type']}/{r['aggregate_id']} {r['event_type']}"
                    if kind == "outbox"
                    else f"{r['queue']}/{r['task']}"
                )
                print(f"{r['id']:>10}  {what}  attempts={r['attempts']}  {_last_line(r['last_error'])}")
            print(f"{len(rows)} row(s){', more match (--limit)' if more else ''}")
        return 0
    if args.action == "show":
        rows = admin.list_dead(engine, model, ids=[args.id], limit=1)
        if not rows:
            hint = "" if args.jobs else " (a failed job? add --jobs)"
            raise ConfigurationError(
                f"no dead/failed row with id {args.id} in {model.__table__.fullname}{hint}"
            )
        if args.json:
            _print_json(rows[0])
        else:
            for k, v in rows[0].items():
                print(f"{k:>15}: {v}")
        return 0
    fn = admin.retry_dead if args.action == "retry" else admin.skip_dead
    ids = args.ids or None
    filters = _dead_filters(args, kind)
    filtered = any(v is not None for v in filters.values())
    if ids is None and not filtered and not args.all:  # (admin's own message names ``all=True``)
        raise ConfigurationError(
            f"name the rows to {args.action}: ids, a filter ({', '.join(_dead_options(kind))}), or --all"
        )
    changed = fn(engine, model, ids=ids, all=args.all, batch_size=args.batch_size, dry_run=args.dry_run,
                 **filters)  # fmt: skip
    verb = {"retry": "requeued", "skip": "skipped" if kind == "outbox" else "discarded"}[args.action]
    left = _passed_over(engine, model, args.ids, changed, verb=verb, acts_on=_ACTS_ON["dead", kind],
                        dry_run=args.dry_run, filtered=filtered)  # fmt: skip
    if args.json:
        _print_json({"dry_run": args.dry_run, verb: changed, "passed_over": _json_left(left)})
    else:
        shown = ", ".join(map(str, changed[:50])) + (
            f", … ({len(changed) - 50} more)" if len(changed) > 50 else ""
        )
        print(
            f"{'would be ' if args.dry_run else ''}{verb}: {len(changed)} row(s){': ' + shown if changed else ''}"
        )
    return EXIT_THRESHOLD if left else 0


def _cmd_purge(args: argparse.Namespace) -> int:
    from .monitoring import purge

    engine = _engine(args)
    result = {}
    for _, model in _tables(args, engine):
        result[model.__table__.fullname] = purge(engine, model, older_than=args.older_than,
                                                 batch_size=args.batch_size, dry_run=args.dry_run)  # fmt: skip
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
                      stale_after=args.stale_after, target=target)  # fmt: skip
    failed = any(f.status == "fail" for f in findings)
    if args.json:
        _print_json({"ok": not failed, "findings": [f.as_dict() for f in findings]})
    else:
        for f in findings:
            where = f" [{f.table}]" if f.table else ""
            print(f"{f.status.upper():<4}  {f.check}{where}: {f.message}")
            if f.fix and f.status != "ok":
                lines = f.fix.splitlines()
                print(f"      fix: {lines[0]}")
                for line in lines[1:]:
                    print(f"           {line}")
    return 1 if failed else 0


def _cmd_locks(args: argparse.Namespace) -> int:
    from .doctor import locks
    from .monitoring import regclass_name

    engine = _engine(args)
    models = [m for _, m in _tables(args, engine)]
    with engine.connect() as conn:
        found = locks(conn, [regclass_name(conn, m.__table__) for m in models])
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


def _positive_duration(text_: str) -> Any:
    value = _duration(text_)
    if value.total_seconds() <= 0:
        raise argparse.ArgumentTypeError(f"must be a duration > 0, got {text_!r}")
    return value


def _int_at_least(minimum: int) -> Any:
    def parse(text_: str) -> int:
        try:
            value = int(text_)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text_!r}")
        return value

    return parse


_positive = _int_at_least(1)
_nonneg = _int_at_least(0)


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
    p.add_argument(
        "--stale-after",
        type=_positive_duration,
        default=None,
        help="the workers' stale_after: a running job locked longer ago is an expired lease (default 60s)",
    )
    p.set_defaults(handler=_cmd_status)

    p = sub.add_parser("check", help="exit non-zero with a one-line reason when a threshold is passed")
    _common(p)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--max-oldest-pending-age",
        type=_duration,
        default=None,
        help="fail when a row due to run has waited longer than this (rows scheduled for later do not count)",
    )
    p.add_argument("--max-dead", type=_nonneg, default=None, help="fail above this many dead/failed rows "
                   "(the default when no threshold is given: 0)")  # fmt: skip
    p.add_argument("--max-expired-leases", type=_nonneg, default=None)
    p.add_argument(
        "--stale-after",
        type=_positive_duration,
        default=None,
        help="the workers' stale_after: a running job locked longer ago is an expired lease (default 60s)",
    )
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
            p.add_argument("--limit", type=_positive, default=100,
                           help="list at most this many rows, oldest first (default 100; a note says when more match)")  # fmt: skip
        if action in ("retry", "skip"):
            p.add_argument("ids", nargs="*", type=int, help="ids to act on")
            p.add_argument("--all", action="store_true", help="every dead row (with no ids/filters)")
            p.add_argument("--dry-run", action="store_true", help="print what would change, change nothing")
            p.add_argument("--batch-size", type=_positive, default=1000)
        p.set_defaults(handler=_cmd_dead)

    p = sub.add_parser(
        "doctor", help="diagnose a slow or stuck queue: plans, indexes, vacuum, xmin horizon, locks"
    )
    _common(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--long-transaction", type=_duration, default=_duration("5m"))
    p.add_argument("--target", help="module:attribute of a Dispatcher, to check its lease against its batch")
    p.add_argument(
        "--stale-after",
        type=_positive_duration,
        default=None,
        help="the workers' stale_after: a running job locked longer ago is an expired lease (default 60s)",
    )
    p.set_defaults(handler=_cmd_doctor)

    p = sub.add_parser("locks", help="who holds or waits for locks on the queue tables, and who blocks whom")
    _common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_cmd_locks)

    p = sub.add_parser("purge", help="delete done rows older than a duration, in bounded batches")
    _common(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--older-than", type=_duration, required=True)
    p.add_argument("--batch-size", type=_positive, default=10_000)
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(handler=_cmd_purge)
    _job_commands(sub)
    _schedule_commands(sub)
    _cdc_commands(sub)
    _partition_commands(sub)
    _dashboard_commands(sub)
    return parser


# --- jobs and queues: cancel, retry, update; pause, resume, list --------------------------------------------


def _job_commands(sub: Any) -> None:
    jobs = sub.add_parser(
        "jobs", help="jobs: cancel, retry (failed/cancelled), update (priority/run_at/attempts)"
    )
    jsub = jobs.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    jsub.required = True
    for action in ("cancel", "retry", "update"):
        p = jsub.add_parser(action)
        _common(p)
        p.add_argument("--json", action="store_true")
        p.add_argument("ids", nargs="*", type=int, help="job ids to act on")
        p.add_argument("--task")
        p.add_argument("--queue")
        if action != "cancel":
            p.add_argument("--all", action="store_true", help="every job in the statuses acted on")
            p.add_argument("--dry-run", action="store_true", help="print what would change, change nothing")
            p.add_argument("--batch-size", type=_positive, default=1000)
        if action == "update":
            p.add_argument("--priority", type=int)
            p.add_argument("--run-in", type=_duration, help="due this long from now (90, 5m, 1h)")
            p.add_argument("--max-attempts", type=_positive)
        p.set_defaults(handler=_cmd_jobs)
    queues = sub.add_parser("queues", help="queues: pause, resume, list (paused queues are not claimed)")
    qsub = queues.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    qsub.required = True
    for action in ("pause", "resume", "list"):
        p = qsub.add_parser(action)
        _common(p)
        p.add_argument("--json", action="store_true")
        if action != "list":
            p.add_argument("name", help="the queue")
        if action == "pause":
            p.add_argument("--by", help="who paused it (shown by queues list)")
        p.set_defaults(handler=_cmd_queues)


#: What each command that takes ids acts on, for the note naming the ids it left alone.
_ACTS_ON = {
    ("jobs", "cancel"): "queued or running jobs",
    ("jobs", "retry"): "failed or cancelled jobs",
    ("jobs", "update"): "queued, failed or cancelled jobs",
    ("dead", "outbox"): "dead rows",
    ("dead", "jobs"): "failed jobs",
}


def _passed_over(
    engine: Any, model: type[Any], named: list[int], acted: Iterable[int], *, verb: str, acts_on: str,
    dry_run: bool = False, filtered: bool = False,
) -> dict[int, str | None]:  # fmt: skip
    """The ids a command named but did not act on, each with its status now (``None``: no such row), told on
    stderr — ``jobs cancel 123`` of a job that does not exist, or finished a moment ago, exited 0 saying only
    "cancelled 0" (a review). The caller exits 1 when any is left."""
    from . import admin

    left = sorted(set(named) - set(acted))
    if not left:
        return {}
    statuses = admin._statuses_of(engine, model, left)
    shown = ", ".join(f"{i} ({statuses[i] or 'no such row'})" for i in left[:20])
    more = f", … ({len(left) - 20} more)" if len(left) > 20 else ""
    sys.stderr.write(
        f"sa-outbox: {len(left)} of the {len(set(named))} named id(s) {'would not be' if dry_run else 'were not'} "
        f"{verb}: {shown}{more} — this acts on {acts_on}{' matching the filters' if filtered else ''}\n"
    )
    return statuses


def _cmd_jobs(args: argparse.Namespace) -> int:
    from . import admin

    engine = _engine(args)
    [(_, model)] = _tables(args, engine, ("jobs",))
    target = {"ids": args.ids or None, "task": args.task, "queue": args.queue}
    # (the admin functions' own messages name their Python arguments: ``all=True``, ``run_at``)
    if not any(v is not None for v in target.values()) and not getattr(args, "all", False):
        raise ConfigurationError(
            f"name the jobs to {args.action}: ids, --task{' or' if args.action == 'cancel' else ','} --queue"
            f"{'' if args.action == 'cancel' else ' or --all'}"
        )
    if (
        args.action == "update"
        and args.priority is None
        and args.run_in is None
        and args.max_attempts is None
    ):
        raise ConfigurationError("jobs update needs at least one of --priority, --run-in, --max-attempts")
    filtered = args.task is not None or args.queue is not None
    if args.action == "cancel":
        got = admin.cancel_jobs(engine, model, **target)
        left = _passed_over(engine, model, args.ids, got.cancelled + got.requested, verb="cancelled",
                            acts_on=_ACTS_ON["jobs", "cancel"], filtered=filtered)  # fmt: skip
        if args.json:
            _print_json(
                {"cancelled": got.cancelled, "requested": got.requested, "passed_over": _json_left(left)}
            )
        else:
            print(
                f"cancelled {len(got.cancelled)} queued job(s); asked {len(got.requested)} running job(s) to stop"
            )
        return EXIT_THRESHOLD if left else 0
    common = {**target, "all": args.all, "batch_size": args.batch_size, "dry_run": args.dry_run}
    if args.action == "retry":
        changed = admin.retry_jobs(engine, model, **common)
    else:
        changed = admin.update_jobs(
            engine,
            model,
            priority=args.priority,
            run_at=args.run_in,
            max_attempts=args.max_attempts,
            **common,
        )
    verb = "requeued" if args.action == "retry" else "updated"
    left = _passed_over(engine, model, args.ids, changed, verb=verb, acts_on=_ACTS_ON["jobs", args.action],
                        dry_run=args.dry_run, filtered=filtered)  # fmt: skip
    if args.json:
        _print_json({"dry_run": args.dry_run, verb: changed, "passed_over": _json_left(left)})
    else:
        print(f"{'would be ' if args.dry_run else ''}{verb}: {len(changed)} job(s)")
    return EXIT_THRESHOLD if left else 0


def _json_left(left: dict[int, str | None]) -> list[dict[str, Any]]:
    return [{"id": i, "status": status} for i, status in left.items()]


def _cmd_queues(args: argparse.Namespace) -> int:
    from . import admin

    engine = _engine(args)
    [(_, model)] = _tables(args, engine, ("jobs",))
    if args.action == "pause":
        known = sorted(q.name for q in admin.list_queues(engine, model))
        admin.pause_queue(engine, model, args.name, by=args.by)
        print(f"paused {args.name}: workers stop claiming it within about a second")
        if args.name not in known:  # pausing ahead of the first job is allowed; a typo must not pass unseen
            print(
                f"sa-outbox: note: no job is queued or running in {args.name!r} and it was never paused before "
                f"(names are case-sensitive; known queues: {', '.join(map(repr, known)) or 'none'}) — "
                f"paused anyway, ahead of its first job",
                file=sys.stderr,
            )
        return 0
    if args.action == "resume":
        if admin.resume_queue(engine, model, args.name):
            print(f"resumed {args.name}")
            return 0
        # Names are case-sensitive and free-form: a typo must not read as a resumed queue.
        paused = sorted(q.name for q in admin.list_queues(engine, model) if q.paused)
        print(
            f"sa-outbox: queue {args.name!r} was not paused: nothing resumed (paused queues: "
            f"{', '.join(map(repr, paused)) or 'none'})",
            file=sys.stderr,
        )
        return EXIT_THRESHOLD
    states = admin.list_queues(engine, model)
    if args.json:
        _print_json([{"name": q.name, "paused": q.paused, "paused_at": q.paused_at, "paused_by": q.paused_by,
                      "queued": q.queued, "running": q.running} for q in states])  # fmt: skip
        return 0
    for q in states:
        state = (
            f"paused since {q.paused_at:%Y-%m-%d %H:%M:%S}{' by ' + q.paused_by if q.paused_by else ''}"
            if q.paused_at
            else "active"
        )
        print(f"{q.name:<20} {state:<40} queued {q.queued:>8,}  running {q.running:>6,}")
    return 0


# --- schedules: list, pause, resume, run-now ---------------------------------------------------------------


def _schedule_commands(sub: Any) -> None:
    schedules = sub.add_parser(
        "schedules", help="cron schedules: list, pause, resume, run-now (paused schedules do not fire)"
    )
    ssub = schedules.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    ssub.required = True
    for action in ("list", "pause", "resume", "run-now"):
        p = ssub.add_parser(action)
        _common(p)
        p.add_argument(
            "--schedules-table", default="schedules", help="schedules table name (default: schedules)"
        )
        p.add_argument("--json", action="store_true")
        if action != "list":
            p.add_argument("name", help="the schedule")
        p.set_defaults(handler=_cmd_schedules)


def _cmd_schedules(args: argparse.Namespace) -> int:
    from sqlalchemy import inspect, select

    from . import _schedules
    from .models import model_for

    engine = _engine(args)
    schema, name = _split_table("--schedules-table", args.schedules_table)
    if not inspect(engine).has_table(name, schema=schema):
        raise ConfigurationError(
            f"no table {args.schedules_table} in this database: check --schedules-table, or create it "
            "(alembic upgrade head)"
        )
    model = model_for("schedules", name, schema)
    if args.action == "pause":
        _schedules.pause_schedule(engine, model, args.name)
        print(f"paused {args.name}: it fires no slot until resumed")
        return 0
    if args.action == "resume":
        if _schedules.resume_schedule(engine, model, args.name):
            print(f"resumed {args.name}: it fires from its next slot (the paused slots are skipped)")
        else:
            print(f"{args.name} was not paused: left as it is")
        return 0
    if args.action == "run-now":
        [(_, jobs)] = _tables(args, engine, ("jobs",))
        job_id = _schedules.run_schedule_now(engine, model, jobs, args.name)
        if args.json:
            _print_json({"schedule": args.name, "job": job_id})
        else:
            print(f"enqueued job {job_id} for schedule {args.name}")
        return 0
    c = model.__table__.c
    with engine.connect() as conn:
        rows = conn.execute(
            select(
                c.name,
                c.cron,
                c.timezone,
                c.task,
                c.queue,
                c.catch_up,
                c.paused,
                c.next_run_at,
                c.last_run_at,
            ).order_by(c.name)
        ).all()
    if args.json:
        _print_json([dict(r._mapping) for r in rows])
        return 0
    for r in rows:
        state = "paused" if r.paused else "active"
        last = f"{r.last_run_at:%Y-%m-%d %H:%M:%S%z}" if r.last_run_at else "never"
        where = f"{r.queue}/{r.task}"
        print(f"{r.name:<24} {r.cron:<16} {r.timezone:<16} {where:<32} {state:<7} "
              f"next {r.next_run_at:%Y-%m-%d %H:%M:%S%z}  last {last}  catch-up {r.catch_up}")  # fmt: skip
    print(f"{len(rows)} schedule(s)")
    return 0


# --- cdc: the Debezium connector of a CdcOutboxMixin table -------------------------------------------------


# --- partitions: the partitioned layout's upkeep (docs/partitioning.md) ---------------------------------------


def _partition_commands(sub: Any) -> None:
    parts = sub.add_parser(
        "partitions", help="partitioned tables: maintain (create ahead, retire finished), list"
    )
    psub = parts.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    psub.required = True
    for action in ("maintain", "list"):
        p = psub.add_parser(action)
        _common(p)
        p.add_argument("--json", action="store_true")
        if action == "maintain":
            p.add_argument("--ahead", type=_int_at_least(0), default=3,
                           help="periods to create beyond the current one (default 3)")  # fmt: skip
            p.add_argument("--archive", action="store_true",
                           help="detach finished partitions and keep them as tables instead of dropping them")  # fmt: skip
            p.add_argument("--retire-dead", action="store_true",
                           help="retire partitions whose only unfinished rows are dead/failed (default: keep them)")  # fmt: skip
            p.add_argument("--period", choices=["day", "week", "month"],
                           help="the partition period (default: that of the existing partitions)")  # fmt: skip
        p.set_defaults(handler=_cmd_partitions)


def _cmd_partitions(args: argparse.Namespace) -> int:
    from ._partitions import is_partitioned, list_partitions, maintain_partitions

    engine = _engine(args)
    found = []
    with engine.connect() as conn:
        for _, model in _tables(args, engine):
            if is_partitioned(conn, model.__table__):
                found.append(model)
    if not found:
        raise ConfigurationError(
            "no partitioned table among "
            f"{args.outbox_table}, {args.jobs_table}: see docs/partitioning.md to create or convert one"
        )
    if args.action == "list":
        listed = {m.__table__.fullname: [p.as_dict() for p in list_partitions(engine, m)] for m in found}
        if args.json:
            _print_json(listed)
            return 0
        for table, items in listed.items():
            print(table)
            for p in items:
                span = "DEFAULT" if p["is_default"] else f"{p['lower']} .. {p['upper']}"
                flags = ("  (detach pending)" if p["detach_pending"] else "") + (
                    "  (closed to writes: being retired)" if p["closed"] else ""
                )
                print(
                    f"  {p['name']:<28} {span:<54} unfinished {p['unfinished']:>6}  dead {p['dead']:>5}{flags}"
                )
            print()
        return 0
    reports = [
        maintain_partitions(engine, m, ahead=args.ahead, archive=args.archive, keep_dead=not args.retire_dead,
                            period=args.period)
        for m in found
    ]  # fmt: skip
    if args.json:
        _print_json({r.table: r.as_dict() for r in reports})
    else:
        for r in reports:
            print(r.table)
            print(f"  created   {', '.join(r.created) or '-'}")
            print(f"  retired   {', '.join(r.retired) or '-'}")
            if r.archived:
                print(f"  archived  {', '.join(r.archived)} (detached, kept as tables)")
            for name, counts in r.kept.items():
                print(f"  kept      {name}: {counts['unfinished']} unfinished, {counts['dead']} dead row(s)")
            for line in r.errors:
                print(f"  ! {line}")
            print()
    return 1 if any(r.errors for r in reports) else 0


def _cdc_commands(sub: Any) -> None:
    cdc = sub.add_parser(
        "cdc", help="change data capture: Debezium reads a CdcOutboxMixin table from the WAL"
    )
    csub = cdc.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    csub.required = True
    for action, what in (
        ("debezium-config", "print the Kafka Connect JSON of a Debezium PostgreSQL connector with the outbox "
                            "event router for the table"),
        ("setup-sql", "print the SQL that creates the publication and the replication slot (run it before the "
                      "first event is written)"),
    ):  # fmt: skip
        p = csub.add_parser(action, help=what)
        p.add_argument(
            "--url", default=os.environ.get("DATABASE_URL"),
            help="the database the table is checked in (default: $DATABASE_URL); the connector's address too, "
            "unless --debezium-url",
        )  # fmt: skip
        p.add_argument("--table", required=True, help="the CdcOutboxMixin table: name, or schema.table")
        p.add_argument("--slot-name", help="replication slot (default: sa_outbox_<table>)")
        p.add_argument("--publication-name", help="publication (default: the slot name)")
        if action == "debezium-config":
            p.add_argument(
                "--debezium-url",
                help="where Debezium connects, if not --url (e.g. the server itself when --url is PgBouncer): "
                "its host, port, user and database are printed",
            )
            p.add_argument("--name", help="connector name (default: sa-outbox-<table>)")
            p.add_argument("--topic-prefix", help="Debezium's topic.prefix (default: the slot name)")
            p.add_argument(
                "--topic-replacement", default=None,
                help="the router's topic (default: outbox.event.${routedByValue}, KafkaPublisher's topics)",
            )  # fmt: skip
            p.add_argument(
                "--password",
                help="database.password: best a config provider reference, e.g. ${file:/secrets/pg.properties:password}"
                " (the URL's password is never printed)",
            )
        p.set_defaults(handler=_cmd_cdc)


def _cmd_cdc(args: argparse.Namespace) -> int:
    import json

    from . import cdc

    engine = _engine(args)
    schema, table = _split_table("--table", args.table)
    schema, warnings = cdc._check_table(engine, table, schema, args.slot_name, args.publication_name)
    for warning in warnings:
        sys.stderr.write(f"sa-outbox: warning: {warning}\n")
    if args.action == "setup-sql":
        for statement in cdc._setup_sql(schema, table, args.slot_name, args.publication_name):
            print(f"{statement};")
        return 0
    config = cdc._config(
        schema, table, url=args.debezium_url or engine.url, name=args.name, topic_prefix=args.topic_prefix,
        slot_name=args.slot_name, publication_name=args.publication_name, password=args.password,
        topic_replacement=args.topic_replacement or cdc.DEFAULT_TOPIC_REPLACEMENT,
    )  # fmt: skip
    print(json.dumps(config, indent=2))
    return 0


# Exit codes (README, "Operations"): 0 success; 1 a check threshold passed, doctor found a failure, or
# ``queues resume`` found no paused queue of that name (the queue needs attention); 2 bad usage or configuration, fix the command (invalid option, malformed URL, no
# such table, no such database or role, authentication refused, unknown host); 3 the database could not be
# reached or failed meanwhile, worth retrying (refused, timed out, restarting); 141 the output was closed
# early (``| head``), as for a process killed by SIGPIPE.
EXIT_THRESHOLD, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_PIPE = 1, 2, 3, 141

_LOG_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class LogFormatter(logging.Formatter):
    """The CLI's log line: ``time LEVEL logger message key=value …`` — the ``extra`` fields a record carries
    (the loops' and commands' structured stats) follow the message on the same line."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        extras = [
            (k, v) for k, v in vars(record).items() if k not in _LOG_RECORD_FIELDS and not k.startswith("_")
        ]
        return line + "".join(f" {k}={_log_value(v)}" for k, v in extras)


def _log_value(value: Any) -> str:
    import json

    text_ = value if isinstance(value, str) else json.dumps(value, default=str, separators=(",", ":"))
    return json.dumps(text_) if (not text_ or any(c.isspace() or c in '="' for c in text_)) else text_


def _configure_logging(level_name: str) -> None:
    level = logging.getLevelName(str(level_name).upper())
    if not isinstance(level, int):
        raise ConfigurationError(f"invalid --log-level {level_name!r}: use DEBUG, INFO, WARNING or ERROR")
    root = logging.getLogger()
    root.setLevel(level)
    if not root.handlers:  # an embedding program (or a test runner) may have configured logging already
        handler = logging.StreamHandler()
        handler.setFormatter(LogFormatter())
        root.addHandler(handler)


def _database_error(exc: Exception) -> tuple[int, str]:
    """Exit code and one-line message for a database error that reached the top."""
    from sqlalchemy.exc import ProgrammingError

    from ._db import is_schema_error
    from ._dbfaults import connection_error_cause, is_connect_failure, is_permanent_connection_error

    cause = connection_error_cause(exc)
    if is_permanent_connection_error(exc):
        return EXIT_USAGE, (f"cannot connect to the database: {cause}; retrying will not help: check the "
                            "database URL (--url / DATABASE_URL)")  # fmt: skip
    if is_connect_failure(exc) or getattr(exc, "connection_invalidated", False):
        return EXIT_UNREACHABLE, f"cannot reach the database: {cause}; is PostgreSQL running and reachable?"
    if isinstance(exc, ProgrammingError) and is_schema_error(exc):
        # a table or column the code needs is not there: the schema is behind the code (or the name is wrong)
        return EXIT_USAGE, (f"the database refused the command: {cause}; the schema may be behind this version "
                            "of sa_outbox: run the migration (alembic upgrade head), or check the table names")  # fmt: skip
    return EXIT_USAGE, f"the database refused the command: {cause}"


class _Stopped(BaseException):
    """SIGTERM/SIGINT during a one-shot command (not an Exception: nothing on the way may swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop_on_signals(early: Sequence[int]) -> Callable[[], None]:
    """A one-shot command (status, check, purge, …) ends at SIGTERM/SIGINT, exit 128 + the signal: before, it
    only remembered them, as a loop does until it can stop cleanly — and a command waiting on a server that
    never answered could be ended only by SIGKILL. A signal that came during start-up ends it at once."""
    if early:
        raise _Stopped(early[0])

    def stop(signum: int, _frame: Any) -> None:
        raise _Stopped(signum)

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:  # (main() called in a process of its own making, a test's: its handlers back)
        for sig, handler in before.items():
            signal.signal(sig, handler)

    return restore


def main(argv: Sequence[str] | None = None, *, early_signals: Sequence[int] = ()) -> int:
    """Run the CLI and return its exit code (see ``EXIT_*``); ``early_signals`` are SIGTERM/SIGINT received
    before it started (see ``__main__``). Errors are one ``sa-outbox: error: …`` line on stderr (the
    traceback with ``--log-level DEBUG``)."""
    from sqlalchemy.exc import DBAPIError

    parser = build_parser()
    args = parser.parse_args(argv)
    args.early_signals = early_signals
    args.engines = []
    restore: Callable[[], None] | None = None
    on_main_thread = threading.current_thread() is threading.main_thread()
    try:
        _configure_logging(args.log_level)
        if args.handler not in (_cmd_loop, _cmd_dashboard, _cmd_demo) and on_main_thread:
            restore = _stop_on_signals(early_signals)
        code: int = args.handler(args)
        sys.stdout.flush()
    except _Stopped as exc:
        name = signal.Signals(exc.signum).name
        sys.stderr.write(f"sa-outbox: stopped by {name}: each batch is its own transaction — those done stay "
                         "done, the one in progress was rolled back; run the command again to go on\n")  # fmt: skip
        return 128 + exc.signum
    except BrokenPipeError:
        # The reader went away (`sa-outbox status | head`): no traceback, and no second error when Python
        # flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_PIPE
    except PartitionClosedError as exc:
        # Stopped part way: what the earlier batches changed goes to stdout too, for a script to read.
        if exc.changed:
            if getattr(args, "json", False):
                _print_json({"changed_before_the_error": exc.changed})
            else:
                print(
                    f"changed before the error: {len(exc.changed)} row(s): {', '.join(map(str, exc.changed))}"
                )
        sys.stderr.write(f"sa-outbox: error: {exc}\n")
        return EXIT_USAGE
    except OutboxError as exc:
        log.debug("configuration error", exc_info=True)
        sys.stderr.write(f"sa-outbox: error: {exc}\n")
        return EXIT_USAGE
    except DBAPIError as exc:
        log.debug("database error", exc_info=True)
        code, message = _database_error(exc)
        sys.stderr.write(f"sa-outbox: error: {message}\n")
        before = getattr(exc, "changed_before", None)
        deleted = getattr(exc, "deleted_before", None)
        if before or deleted:  # (a bulk command cut off part way said nothing of what it had done — a review)
            done = f"{len(before)} row(s) changed" if before else f"{deleted} row(s) deleted"
            sys.stderr.write(f"sa-outbox: before the error {done} (committed, batch by batch); run the command "
                             "again to go on\n")  # fmt: skip
        return code
    finally:
        try:
            for engine in args.engines:
                engine.dispose()
        finally:
            if restore is not None:
                restore()
    return code


# --- the dashboard: sa-outbox dashboard -------------------------------------------------------------------


def _dashboard_commands(sub: Any) -> None:
    p = sub.add_parser(
        "dashboard",
        help="serve the web dashboard (extra web): read-only unless --actions; 127.0.0.1 by default",
    )
    _common(p)
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--actions",
        action="store_true",
        help="allow retry, skip, cancel, pause and resume; requires the token (SA_OUTBOX_DASHBOARD_TOKEN, "
        "or one generated and printed at start)",
    )
    p.add_argument(
        "--stale-after",
        type=_positive_duration,
        default=None,
        help="the workers' stale_after: a running job locked longer ago is an expired lease (default 60s)",
    )
    p.add_argument(
        "--long-transaction",
        type=_duration,
        default=_duration("60s"),
        help="show transactions open longer than this as holding back the xmin horizon (default 60s)",
    )
    p.set_defaults(handler=_cmd_dashboard)


def _port(text_: str) -> int:
    value: int = _int_at_least(1)(text_)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (1-65535), got {text_!r}")
    return value


_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _cmd_dashboard(args: argparse.Namespace) -> int:
    """Serve ``sa_outbox.web`` with uvicorn until SIGINT/SIGTERM. A token (``SA_OUTBOX_DASHBOARD_TOKEN``, or one
    generated for this run with ``--actions``) guards every page; without one the dashboard is read-only and
    only binds a loopback address."""
    import secrets
    import socket

    try:
        import uvicorn

        from .web import TokenAuth, create_app
    except ImportError as exc:
        raise ConfigurationError(
            f"the dashboard needs the web extra ({exc.name} is missing): pip install 'sa-outbox[web]'"
        ) from None
    token = os.environ.get("SA_OUTBOX_DASHBOARD_TOKEN") or None
    generated = False
    if args.actions and token is None:
        token, generated = secrets.token_urlsafe(24), True
    if token is None and args.host not in _LOOPBACK:
        raise ConfigurationError(
            f"--host {args.host} without a token would show every payload to anyone who reaches it: set "
            "SA_OUTBOX_DASHBOARD_TOKEN (or bind 127.0.0.1 and reach it through an SSH tunnel)"
        )
    engine = _engine(args)
    models = [m for _, m in _tables(args, engine)]
    auth = TokenAuth(token) if token else None
    app = create_app(engine, tables=models, actions=args.actions, authenticate=auth,
                     stale_after=_stale_after(args), long_transaction=args.long_transaction)  # fmt: skip
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:  # a clear error now, not uvicorn's exit later
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((args.host, args.port))
        except OSError as exc:
            raise ConfigurationError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    host = f"[{args.host}]" if ":" in args.host else args.host
    base = f"http://{host}:{args.port}/"
    mode = "actions on" if args.actions else "read-only"
    tables = ", ".join(m.__table__.fullname for m in models)
    print(f"sa-outbox dashboard: {base} ({mode}; {tables})", flush=True)
    if generated:
        print(f"sign in (token generated for this run): {base}login?token={token}", flush=True)
    elif token:
        print(f"sign in with the token in SA_OUTBOX_DASHBOARD_TOKEN: {base}login", flush=True)
    early = args.early_signals

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            # uvicorn's own SIGTERM/SIGINT handlers are in place by now; one that came before them was
            # remembered by __main__ and stops the server here, as a clean exit 0.
            if early:
                self.should_exit = True

    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False,
                            server_header=False, lifespan="off")  # fmt: skip
    Server(config).run()
    return 0
