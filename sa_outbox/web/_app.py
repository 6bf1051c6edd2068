"""The dashboard's routes: pages that read (``_reads``, ``monitoring``, ``doctor``) and actions that call the
same ``sa_outbox.admin`` functions as the CLI, behind authentication and a CSRF token."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, quote, urlencode

import jinja2
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import admin, doctor, monitoring
from .._durations import Duration, parse_duration, to_seconds
from .._sql import BIGINT_RANGE, QueueSpec, spec_for
from ..errors import ConfigurationError, OutboxError
from . import _reads
from ._security import COOKIE, Authenticate, Csrf, TokenAuth, allowed_host_names, cross_site, host_name

log = logging.getLogger("sa_outbox.web")

HERE = Path(__file__).resolve().parent
FLASH = "sa_outbox_flash"
#: The largest form body accepted (a bulk selection of ids is the largest thing a form sends).
MAX_FORM_BYTES = 1_000_000

T = TypeVar("T")


class Refused(Exception):
    """A request the dashboard will not serve: rendered as an error page with ``status``."""

    def __init__(self, status: int, message: str, *, login: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.login = login


@dataclass(frozen=True)
class Table:
    name: str
    kind: str
    spec: QueueSpec
    model: type[Any]


# --- formatting ------------------------------------------------------------------------------------------


def fmt_age(seconds: float | None) -> str:
    """12s, 5m 07s, 3h 05m, 2d 04h."""
    if seconds is None:
        return "-"
    s = float(seconds)
    if s < 0:
        return "in " + fmt_age(-s)
    if s < 10:
        return f"{s:.1f}s"
    if s < 120:
        return f"{s:.0f}s"
    m = int(s // 60)
    if m < 120:
        return f"{m}m {int(s % 60):02d}s"
    h = m // 60
    if h < 48:
        return f"{h}h {m % 60:02d}m"
    return f"{h // 24}d {h % 24:02d}h"


def fmt_num(value: Any) -> str:
    return f"{int(value):,}"


def fmt_approx(value: int) -> str:
    """Two significant figures: 1.2M, 51k, 980."""
    for limit, suffix in ((1_000_000_000, "G"), (1_000_000, "M"), (1_000, "k")):
        if value >= limit:
            scaled = value / limit
            return f"{scaled:.1f}{suffix}" if scaled < 10 else f"{scaled:.0f}{suffix}"
    return str(value)


def fmt_rate(per_hour: float) -> str:
    """A rate from a count per hour: per second when at least one, else per minute."""
    per_second = per_hour / 3600
    return f"{per_second:,.1f}/s" if per_second >= 1 else f"{per_hour / 60:,.1f}/min"


def fmt_count(c: _reads.Count) -> str:
    return f"≈ {fmt_approx(c.value)}" if c.estimated else fmt_num(c.value)


def last_line(error: str | None, width: int = 140) -> str:
    lines = [line for line in (error or "").splitlines() if line.strip()]
    last = lines[-1].strip() if lines else ""
    return last if len(last) <= width else last[: width - 1] + "…"


# --- the app ---------------------------------------------------------------------------------------------


class Dashboard:
    """State shared by the routes (one per ``create_app`` call)."""

    def __init__(
        self, engine: Engine, models: Sequence[type[Any]], *, actions: bool, authenticate: Authenticate | None,
        stale_after: Duration, long_transaction: Duration, title: str, csrf_secret: bytes | str | None,
        statement_timeout: Duration = 10.0, allowed_hosts: Sequence[str] | None = None,
    ) -> None:  # fmt: skip
        if not isinstance(engine, Engine):
            raise ConfigurationError(
                f"create_app needs a sync SQLAlchemy Engine (postgresql+psycopg://…), got {type(engine).__name__}"
            )
        if actions and authenticate is None:
            raise ConfigurationError(
                "actions=True needs authenticate=: a callable that returns the user's name for a request (or "
                "None to refuse), e.g. sa_outbox.web.TokenAuth(token); actions are never open to anyone"
            )
        if authenticate is not None and not callable(authenticate):
            raise ConfigurationError(f"authenticate must be callable, got {authenticate!r}")
        self.engine = engine
        self.tables: dict[str, Table] = {}
        for model in models:
            spec = spec_for(model)
            name = spec.table.fullname
            if name in self.tables:
                raise ConfigurationError(f"table {name!r} is given twice")
            self.tables[name] = Table(name, spec.kind, spec, model)
        if not self.tables:
            raise ConfigurationError("tables must name at least one outbox or jobs model")
        self.actions = actions
        self.authenticate = authenticate
        self.stale_after = to_seconds(stale_after, name="stale_after")
        if self.stale_after <= 0:
            raise ConfigurationError("stale_after must be > 0")
        self.long_transaction = to_seconds(long_transaction, name="long_transaction")
        self.statement_timeout_ms = int(to_seconds(statement_timeout, name="statement_timeout") * 1000)
        self.host_names = allowed_host_names(allowed_hosts, authenticated=authenticate is not None)
        if self.statement_timeout_ms < 1:
            raise ConfigurationError("statement_timeout must be at least 1 ms")
        self.title = title
        if isinstance(csrf_secret, str):
            csrf_secret = csrf_secret.encode()
        if csrf_secret is not None and len(csrf_secret) < 16:
            raise ConfigurationError("csrf_secret must be at least 16 bytes")
        self.csrf = Csrf(csrf_secret or os.urandom(32))
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            auto_reload=False,  # package data: read once
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters.update(
            age=fmt_age, num=fmt_num, count=fmt_count, approx=fmt_approx, lastline=last_line, rate=fmt_rate,
            pretty=_reads.pretty_json, ts=_reads.timestamp,
        )  # fmt: skip

    # --- plumbing ----------------------------------------------------------------------------------------

    def read(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` on one connection, in one transaction that only reads, bounded in time."""
        with self.engine.connect() as conn:
            conn.exec_driver_sql(f"SET LOCAL statement_timeout = {self.statement_timeout_ms:d}")
            try:
                return fn(conn)
            finally:
                conn.rollback()

    async def who(self, request: Request) -> str | None:
        """The authenticated user (``None`` when no hook is configured); refuses when the hook says no."""
        if self.authenticate is None:
            return None
        result = self.authenticate(request)
        if inspect.isawaitable(result):
            result = await result
        if not result or not isinstance(result, str):
            raise Refused(401, "authentication required", login=isinstance(self.authenticate, TokenAuth))
        return result

    def table(self, request: Request, kind: str | None = None) -> Table:
        name = request.path_params["table"]
        t = self.tables.get(name)
        if t is None:
            raise Refused(404, f"no table {name!r} on this dashboard (it shows: {', '.join(self.tables)})")
        if kind is not None and t.kind != kind:
            raise Refused(404, f"{name} is a{'n' if t.kind == 'outbox' else ''} {t.kind} table: this page is for "
                          f"{kind} tables")  # fmt: skip
        return t

    def href(self, request: Request, name: str, query: dict[str, Any] | None = None, **path: Any) -> str:
        url = request.url_for(name, **path).path
        q = {k: v for k, v in (query or {}).items() if v not in (None, "")}
        return url + ("?" + urlencode(q, doseq=True) if q else "")

    def render(
        self, request: Request, template: str, who: str | None, http_status: int = 200, **context: Any
    ) -> Response:
        started = request.scope.get("sa_outbox_started", time.perf_counter())
        flash = request.cookies.get(FLASH)
        context.update(
            request=request, who=who, actions=self.actions, title=self.title, tables=list(self.tables.values()),
            csrf=self.csrf.issue(who) if (who is not None and self.actions) else "",
            href=lambda name, query=None, **p: self.href(request, name, query, **p),
            here=request.url.path + (f"?{request.url.query}" if request.url.query else ""),
            flash=_unquote(flash) if flash else None, active=context.get("active", template.removesuffix(".html")),
            elapsed_ms=lambda: (time.perf_counter() - started) * 1000, login_page=isinstance(self.authenticate, TokenAuth),
        )  # fmt: skip
        html = self.env.get_template(template).render(**context)
        response = HTMLResponse(html, status_code=http_status)
        response.headers["Cache-Control"] = "no-store"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; frame-ancestors 'none'; "
            "form-action 'self'"
        )
        if flash:
            response.delete_cookie(FLASH, path=self.cookie_path(request))
        return response

    @staticmethod
    def cookie_path(request: Request) -> str:
        return str(request.url_for("overview").path)

    def page(
        self, fn: Callable[[Dashboard, Request, str | None], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            request.scope["sa_outbox_started"] = time.perf_counter()
            try:
                who = await self.who(request)
                return await fn(self, request, who)
            except Refused as exc:
                return self.refusal(request, exc)
            except DBAPIError as exc:  # down, restarting, or a statement past the page's statement_timeout
                log.warning("dashboard page %s failed: %s", request.url.path, _db_cause(exc))
                return self.refusal(request, Refused(503, f"the database did not answer: {_db_cause(exc)}"))

        return endpoint

    def refusal(self, request: Request, exc: Refused) -> Response:
        return self.render(request, "error.html", None, http_status=exc.status, message=exc.message, login=exc.login,
                           active="error")  # fmt: skip

    def action(
        self, fn: Callable[[Dashboard, Request, str, dict[str, list[str]]], Awaitable[str]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """An action: refused unless actions are on, the user is authenticated, the request is same-site and
        the form carries this user's CSRF token. ``fn`` returns the message shown after the redirect."""

        async def endpoint(request: Request) -> Response:
            request.scope["sa_outbox_started"] = time.perf_counter()
            what = f"{request.method} {request.url.path}"
            try:
                if not self.actions:
                    raise Refused(403, "this dashboard is read-only: start it with actions enabled (create_app("
                                  "…, actions=True, authenticate=…) or sa-outbox dashboard --actions)")  # fmt: skip
                who = await self.who(request)
                assert who is not None  # actions=True always has a hook
                why = cross_site(request)
                if why:
                    raise Refused(403, f"refused a cross-site form post ({why})")
                form = await _form(request)
                if not self.csrf.check(who, _one(form, "csrf")):
                    raise Refused(403, "missing or invalid CSRF token: reload the page and try again")
                message = await fn(self, request, who, form)
            except Refused as exc:
                log.warning("dashboard refused %s: %s", what, exc.message,
                            extra={"status": exc.status, "client": request.client.host if request.client else None})  # fmt: skip
                return self.refusal(request, exc)
            except (
                OutboxError
            ) as exc:  # a bad filter or option, a closed partition: said by the admin function
                log.warning("dashboard refused %s: %s", what, exc,
                            extra={"status": 400, "client": request.client.host if request.client else None,
                                   "changed": getattr(exc, "changed", [])})  # fmt: skip
                return self.refusal(request, Refused(400, str(exc)))
            except DBAPIError as exc:
                log.warning("dashboard action %s failed: %s", what, _db_cause(exc))
                return self.refusal(request, Refused(503, f"the database did not answer: {_db_cause(exc)}"))
            target = _safe_next(request, _one(form, "next"))
            response = RedirectResponse(target, status_code=303)
            response.set_cookie(FLASH, quote(message), max_age=60, path=self.cookie_path(request), httponly=True,
                                samesite="strict")  # fmt: skip
            return response

        return endpoint


async def _form(request: Request) -> dict[str, list[str]]:
    """The urlencoded form body (no multipart: the dashboard's forms send none)."""
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise Refused(413, "form too large")
    return parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)


def _one(form: dict[str, list[str]], key: str) -> str | None:
    values = form.get(key)
    return values[0] if values else None


def _db_cause(exc: DBAPIError) -> str:
    lines = str(exc.orig or exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _unquote(text: str) -> str:
    from urllib.parse import unquote

    return unquote(text)


def _safe_next(request: Request, target: str | None) -> str:
    """Where to go after an action: a path of this dashboard only (never another site)."""
    root = str(request.url_for("overview").path)
    if target and target.startswith(root) and not target.startswith("//") and "\\" not in target:
        return target
    return root


def _ints(values: list[str], what: str = "ids") -> list[int]:
    out = []
    for v in values:
        for part in v.replace(",", " ").split():
            if not part.isdigit():
                raise Refused(400, f"{what} must be integers, got {part!r}")
            if int(part) > BIGINT_RANGE[1]:  # no row has it; sent, the statement would fail (not a 503)
                raise Refused(400, f"{what} must fit a bigint (at most {BIGINT_RANGE[1]}), got {part}")
            out.append(int(part))
    return out


# --- filters ---------------------------------------------------------------------------------------------

_OUTBOX_FILTERS = ("event_type", "aggregate_type", "aggregate_id")
_JOBS_FILTERS = ("task", "queue")


def dead_filters(t: Table, source: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The dead-letter filters of a query string or form: (for ``admin``, as typed)."""
    typed: dict[str, str] = {}
    names = (*(_OUTBOX_FILTERS if t.kind == "outbox" else _JOBS_FILTERS), "error", "older_than")
    for name in names:
        value = source.get(name)
        if isinstance(value, list):
            value = value[0] if value else None
        if value:
            typed[name] = str(value).strip()
    filters: dict[str, Any] = {k: v for k, v in typed.items() if k not in ("error", "older_than")}
    if "error" in typed:
        filters["error_contains"] = typed["error"]
    if "older_than" in typed:
        try:
            filters["older_than"] = parse_duration(typed["older_than"])
        except ConfigurationError as exc:
            raise Refused(400, f"older than: {exc}") from None
    return filters, typed


# --- pages -----------------------------------------------------------------------------------------------


async def overview(d: Dashboard, request: Request, who: str | None) -> Response:
    """One card per table, each read on its own connection at the same time (the tables' statements do not
    wait for each other), and what holds back the xmin horizon."""

    def card(t: Table) -> Callable[[Connection], _reads.TableOverview]:
        return lambda conn: _reads.overview(conn, t.spec, stale_after=d.stale_after)

    def database(conn: Connection) -> tuple[list[str], Any]:
        horizon = monitoring.long_horizon_holders(conn, d.long_transaction)
        return [monitoring.describe_holder(h) for h in horizon], conn.exec_driver_sql(
            "SELECT now()"
        ).scalar_one()

    cards, (horizon, now) = await asyncio.gather(
        asyncio.gather(*(run_in_threadpool(d.read, card(t)) for t in d.tables.values())),
        run_in_threadpool(d.read, database),
    )
    return d.render(request, "overview.html", who, cards=cards, horizon=horizon, db_now=now)


async def dead_letters(d: Dashboard, request: Request, who: str | None) -> Response:
    t = d.table(request)
    filters, typed = dead_filters(t, request.query_params)
    after = request.query_params.get("after")
    after_id = _ints([after], "after")[0] if after else None
    try:
        rows, total = await run_in_threadpool(
            d.read, lambda conn: _reads.dead_page(conn, t.spec, dict(filters), after=after_id)
        )
    except OutboxError as exc:
        raise Refused(400, str(exc)) from None
    more = len(rows) == _reads.PAGE_SIZE
    return d.render(request, "dead.html", who, t=t, rows=rows, total=total, typed=typed, after=after_id, more=more,
                    next_after=rows[-1]["id"] if rows else None, active="dead:" + t.name)  # fmt: skip


async def dead_preview(d: Dashboard, request: Request, who: str | None) -> Response:
    """What a bulk action on every matching dead letter would change: the same call with ``dry_run``."""
    t = d.table(request)
    action = request.query_params.get("action", "retry")
    if action not in ("retry", "skip"):
        raise Refused(400, f"no bulk action {action!r} for {t.kind} dead letters")
    filters, typed = dead_filters(t, request.query_params)
    try:  # the call's own selection, in the page's bounded read (admin's dry run would wait on any lock)
        named = {k: v for k, v in filters.items() if k != "older_than"}
        spec, f = admin._dead_plan(
            t.model, action, ids=None, all=not filters, older_than=filters.get("older_than"), filters=named
        )
        ids = await run_in_threadpool(
            d.read, lambda conn: admin._dead_selected(conn, t.model, action, spec, f)
        )
    except OutboxError as exc:
        raise Refused(400, str(exc)) from None
    return d.render(request, "preview.html", who, t=t, action=action, count=_reads.Count(len(ids)), sample=ids[:100],
                    typed=typed, back=d.href(request, "dead", typed, table=t.name), active="dead:" + t.name,
                    post=d.href(request, "dead_action", table=t.name, action=action))  # fmt: skip


async def row(d: Dashboard, request: Request, who: str | None) -> Response:
    t = d.table(request)
    row_id = _ints([request.path_params["id"]], "id")[0]
    found = await run_in_threadpool(d.read, lambda conn: _reads.row_detail(conn, t.spec, row_id))
    if found is None:
        raise Refused(404, f"no row {row_id} in {t.name}")
    return d.render(request, "row.html", who, t=t, r=found, active=("dead:" if found["status"] in ("dead", "failed") else
                    "jobs:") + t.name)  # fmt: skip


async def blocked(d: Dashboard, request: Request, who: str | None) -> Response:
    t = d.table(request, "outbox")
    found, total = await run_in_threadpool(d.read, lambda conn: _reads.blocked_aggregates(conn, t.spec, 100))
    return d.render(request, "blocked.html", who, t=t, blocked=found, total=total, active="blocked:" + t.name)


async def jobs(d: Dashboard, request: Request, who: str | None) -> Response:
    t = d.table(request, "jobs")
    q = request.query_params
    status = q.get("status") or "queued"
    if status not in _reads.JOB_STATUSES:
        raise Refused(400, f"status must be one of {', '.join(_reads.JOB_STATUSES)}, got {status!r}")
    task, queue = q.get("task") or None, q.get("queue") or None
    before = _ints([q["before"]], "before")[0] if q.get("before") else None

    def read(conn: Connection) -> dict[str, Any]:
        rows, cut = _reads.jobs_page(conn, t.spec, status=status, task=task, queue=queue, before=before)
        counts = _reads.status_counts(conn, t.spec)
        summary, sampled, left_out = _reads.job_summary(conn, t.spec)
        return {"rows": rows, "cut": cut, "counts": counts, "summary": summary, "sampled": sampled,
                "left_out": left_out}  # fmt: skip

    data = await run_in_threadpool(d.read, read)
    typed = {"status": status, "task": task or "", "queue": queue or ""}
    rows = data["rows"]
    return d.render(request, "jobs.html", who, t=t, typed=typed, status=status, before=before,
                    more=len(rows) == _reads.PAGE_SIZE, next_before=rows[-1]["id"] if rows else None,
                    window=_reads.SEARCH_WINDOW, active="jobs:" + t.name, **data)  # fmt: skip


async def jobs_preview(d: Dashboard, request: Request, who: str | None) -> Response:
    """How many jobs a bulk cancel/retry by task/queue would change (retry: the same call with ``dry_run``;
    cancel: the queued and running jobs that match, counted)."""
    t = d.table(request, "jobs")
    q = request.query_params
    action = q.get("action", "retry")
    task, queue = q.get("task") or None, q.get("queue") or None
    status = q.get("status") or ("failed" if action == "retry" else "queued")
    if action not in ("retry", "cancel"):
        raise Refused(400, f"no bulk action {action!r} for jobs")
    if task is None and queue is None:
        raise Refused(400, "a bulk action on jobs needs a task or a queue filter")
    try:
        if action == "retry":
            if status not in ("failed", "cancelled"):
                raise Refused(400, "retry applies to failed or cancelled jobs")
            spec, wanted, where = admin._retry_jobs_plan(t.model, ids=None, task=task, queue=queue,
                                                         statuses=(status,), all=False)  # fmt: skip
            ids = await run_in_threadpool(
                d.read, lambda conn: admin._jobs_selected(conn, t.model, spec, wanted, where)
            )
            count, sample = _reads.Count(len(ids)), ids[:100]
        else:
            count, sample = await run_in_threadpool(
                d.read, lambda conn: _reads.cancellable(conn, t.spec, task, queue)
            )
    except OutboxError as exc:
        raise Refused(400, str(exc)) from None
    typed = {"status": status, "task": task or "", "queue": queue or ""}
    return d.render(request, "preview.html", who, t=t, action=action, count=count, sample=sample, typed=typed,
                    back=d.href(request, "jobs", typed, table=t.name), active="jobs:" + t.name,
                    post=d.href(request, "jobs_action", table=t.name, action=action))  # fmt: skip


async def queues(d: Dashboard, request: Request, who: str | None) -> Response:
    t = d.table(request, "jobs")
    states, more = await run_in_threadpool(d.read, lambda conn: _reads.queue_rows(conn, t.spec))
    return d.render(request, "queues.html", who, t=t, queues=states, more=more, shown=_reads.QUEUES_SHOWN,
                    active="queues:" + t.name)  # fmt: skip


async def doctor_page(d: Dashboard, request: Request, who: str | None) -> Response:
    models = [t.model for t in d.tables.values()]
    findings = await run_in_threadpool(
        d.read,
        lambda conn: doctor.doctor(
            conn, models, long_transaction=d.long_transaction, stale_after=d.stale_after
        ),
    )
    order = {"fail": 0, "warn": 1, "ok": 2}
    findings = sorted(findings, key=lambda f: order.get(f.status, 3))
    return d.render(request, "doctor.html", who, findings=findings, active="doctor")


async def locks_page(d: Dashboard, request: Request, who: str | None) -> Response:
    def read(conn: Connection) -> dict[str, Any]:
        names = [monitoring.regclass_name(conn, t.spec.table) for t in d.tables.values()]
        held = doctor.locks(conn, names)
        holders = monitoring.xmin_horizon(conn, limit=10)
        return {"locks": held, "holders": holders, "describe": monitoring.describe_holder}

    data = await run_in_threadpool(d.read, read)
    return d.render(request, "locks.html", who, long_transaction=d.long_transaction, active="locks", **data)


# --- actions (each calls the admin function the CLI calls) -----------------------------------------------


def _log_action(
    who: str, action: str, t: Table, *, selected: int, changed: int, ids: list[int], how: str
) -> None:
    shown = ", ".join(map(str, ids[:20])) + (f", … ({len(ids) - 20} more)" if len(ids) > 20 else "")
    log.info(
        "dashboard: %s %s on %s: %d of %d selected row(s) changed (%s)%s", who, action, t.name, changed, selected,
        how, f": {shown}" if ids else "",
        extra={"who": who, "action": action, "table": t.name, "selected": selected, "changed": changed,
               "how": how, "ids": ids[:100]},
    )  # fmt: skip


async def dead_action(d: Dashboard, request: Request, who: str, form: dict[str, list[str]]) -> str:
    t = d.table(request)
    action = request.path_params["action"]
    if action not in ("retry", "skip"):
        raise Refused(400, f"no action {action!r} for {t.kind} dead letters")
    fn = admin.retry_dead if action == "retry" else admin.skip_dead
    # a failed job is discarded (cancelled, never run again), as ``sa-outbox dead skip --jobs`` does
    verb = "requeued" if action == "retry" else "skipped" if t.kind == "outbox" else "discarded"
    if _one(form, "scope") == "matching":
        filters, typed = dead_filters(t, form)
        expected = _one(form, "expected") or ""
        changed = await run_in_threadpool(fn, d.engine, t.model, all=not filters, **filters)
        said = f" (the preview showed {int(expected):,})" if expected.isdigit() else ""
        how = "every dead letter matching " + (
            ", ".join(f"{k}={v}" for k, v in typed.items()) or "(no filter)"
        )
        _log_action(
            who, f"{action}_dead", t, selected=len(changed), changed=len(changed), ids=changed, how=how + said
        )
        return f"{verb} {len(changed):,} row(s) of {t.name}{said}"
    ids = _ints(form.get("ids", []))
    if not ids:
        raise Refused(400, "select at least one row")
    changed = await run_in_threadpool(fn, d.engine, t.model, ids=ids)
    _log_action(
        who, f"{action}_dead", t, selected=len(ids), changed=len(changed), ids=changed, how="selected ids"
    )
    tail = _left_alone({"ids": ids}, changed, f"no longer {t.spec.dead}")
    return f"{verb} {len(changed):,} row(s) of {t.name}: {', '.join(map(str, changed[:20]))}{tail}"


async def jobs_action(d: Dashboard, request: Request, who: str, form: dict[str, list[str]]) -> str:
    t = d.table(request, "jobs")
    action = request.path_params["action"]
    if action not in ("retry", "cancel"):
        raise Refused(400, f"no action {action!r} for jobs")
    if _one(form, "scope") == "matching":
        task, queue = _one(form, "task") or None, _one(form, "queue") or None
        if task is None and queue is None:
            raise Refused(400, "a bulk action on jobs needs a task or a queue filter")
        target: dict[str, Any] = {"task": task, "queue": queue}
        how = "every job matching " + ", ".join(f"{k}={v}" for k, v in target.items() if v)
    else:
        ids = _ints(form.get("ids", []))
        if not ids:
            raise Refused(400, "select at least one job")
        target = {"ids": ids}
        how = "selected ids"
    if action == "cancel":
        got = await run_in_threadpool(admin.cancel_jobs, d.engine, t.model, **target)
        changed = sorted(got.cancelled + got.requested)
        _log_action(who, "cancel_jobs", t, selected=len(target.get("ids", changed)), changed=len(changed), ids=changed,
                    how=how)  # fmt: skip
        return (f"cancelled {len(got.cancelled):,} queued job(s); asked {len(got.requested):,} running job(s) to stop"
                f" ({t.name}){_left_alone(target, changed, 'no longer queued or running')}")  # fmt: skip
    status = _one(form, "status")
    statuses = (status,) if status in ("failed", "cancelled") else ("failed", "cancelled")
    changed = await run_in_threadpool(admin.retry_jobs, d.engine, t.model, statuses=statuses, **target)
    _log_action(who, "retry_jobs", t, selected=len(target.get("ids", changed)), changed=len(changed), ids=changed,
                how=how)  # fmt: skip
    tail = _left_alone(target, changed, "no longer " + " or ".join(statuses))
    return f"requeued {len(changed):,} job(s) of {t.name}{tail}"


def _left_alone(target: dict[str, Any], changed: list[int], why: str) -> str:
    """The flash's note of the selected jobs an action left alone (finished or changed since the page was
    drawn): "cancelled 0" alone read as if the click had been lost."""
    left = sorted(set(target.get("ids", ())) - set(changed))
    return f"; {len(left)} were {why}: {', '.join(map(str, left[:20]))}" if left else ""


async def queue_action(d: Dashboard, request: Request, who: str, form: dict[str, list[str]]) -> str:
    t = d.table(request, "jobs")
    action = request.path_params["action"]
    name = _one(form, "queue")
    if not name:
        raise Refused(400, "name the queue")
    if action == "pause":
        await run_in_threadpool(admin.pause_queue, d.engine, t.model, name, by=who)
    elif action == "resume":
        if not await run_in_threadpool(admin.resume_queue, d.engine, t.model, name):
            return f"queue {name} of {t.name} was not paused: nothing resumed"
    else:
        raise Refused(400, f"no queue action {action!r}")
    log.info("dashboard: %s %s queue %r of %s", who, action, name, t.name,
             extra={"who": who, "action": f"{action}_queue", "table": t.name, "queue": name})  # fmt: skip
    return f"{'paused' if action == 'pause' else 'resumed'} queue {name} of {t.name}"


# --- login (TokenAuth only) ------------------------------------------------------------------------------


def _login_endpoint(d: Dashboard) -> Callable[[Request], Awaitable[Response]]:
    auth = d.authenticate
    assert isinstance(auth, TokenAuth)

    async def endpoint(request: Request) -> Response:
        request.scope["sa_outbox_started"] = time.perf_counter()
        token: str | None
        if request.method == "POST":
            if cross_site(request):
                return d.refusal(request, Refused(403, "refused a cross-site login"))
            token = _one(await _form(request), "token")
        else:
            token = request.query_params.get("token")
        if token is None:
            return d.render(request, "login.html", None, failed=False, active="login")
        if not auth.valid(token):
            log.warning(
                "dashboard login refused", extra={"client": request.client.host if request.client else None}
            )
            return d.render(request, "login.html", None, http_status=401, failed=True, active="login")
        response = RedirectResponse(str(request.url_for("overview").path), status_code=303)
        response.set_cookie(COOKIE, token, httponly=True, samesite="strict", path=Dashboard.cookie_path(request),
                            secure=request.url.scheme == "https")  # fmt: skip
        return response

    return endpoint


def routes(d: Dashboard) -> list[BaseRoute]:
    out: list[BaseRoute] = [
        Route("/", d.page(overview), name="overview"),
        Route("/tables/{table}/dead", d.page(dead_letters), name="dead"),
        Route("/tables/{table}/dead/preview", d.page(dead_preview), name="dead_preview"),
        Route("/tables/{table}/dead/{action}", d.action(dead_action), methods=["POST"], name="dead_action"),
        Route("/tables/{table}/rows/{id}", d.page(row), name="row"),
        Route("/tables/{table}/blocked", d.page(blocked), name="blocked"),
        Route("/tables/{table}/jobs", d.page(jobs), name="jobs"),
        Route("/tables/{table}/jobs/preview", d.page(jobs_preview), name="jobs_preview"),
        Route("/tables/{table}/jobs/{action}", d.action(jobs_action), methods=["POST"], name="jobs_action"),
        Route("/tables/{table}/queues", d.page(queues), name="queues"),
        Route(
            "/tables/{table}/queues/{action}", d.action(queue_action), methods=["POST"], name="queue_action"
        ),
        Route("/doctor", d.page(doctor_page), name="doctor"),
        Route("/locks", d.page(locks_page), name="locks"),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    if isinstance(d.authenticate, TokenAuth):
        out.append(Route("/login", _login_endpoint(d), methods=["GET", "POST"], name="login"))
    return out


class _HostCheck:
    """Refuses (400) a request whose ``Host`` is not one the dashboard answers to (see ``_security``)."""

    def __init__(self, app: ASGIApp, names: tuple[str, ...]) -> None:
        self.app, self.names = app, names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            header = next((v for k, v in scope["headers"] if k == b"host"), b"").decode("latin-1")
            name = host_name(header)
            if name not in self.names:
                log.warning("dashboard refused a request for host %r (it answers to %s)", name, ", ".join(self.names),
                            extra={"host": name})  # fmt: skip
                await PlainTextResponse(
                    f"this dashboard answers to {', '.join(self.names)}, not {name!r}: a dashboard without "
                    "authentication answers only to its loopback names (create_app(…, allowed_hosts=[…]) names "
                    "others)", status_code=400,
                )(scope, receive, send)  # fmt: skip
                return
        await self.app(scope, receive, send)


def build(d: Dashboard) -> Starlette:
    middleware = [] if d.host_names is None else [Middleware(_HostCheck, names=d.host_names)]
    app = Starlette(routes=routes(d), middleware=middleware)
    app.state.dashboard = d
    return app
