"""The dashboard as an operator meets it: served over real HTTP (``sa-outbox dashboard`` in its own process, and
``create_app`` mounted in a host application), driven by Debian's chromium through Playwright, on the test
database filled by real dispatchers and workers.

Screenshots of every page are saved under a temporary directory (its path is printed with ``-s``), or under
``$SA_OUTBOX_SCREENSHOTS`` when set (``docs/images`` is made that way: see docs/dashboard.md).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest
from playwright.sync_api import sync_playwright
from sqlalchemy import Engine, func, select, text
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from sa_outbox import ClaimedJob, Dispatcher, Message, PermanentError, Worker, enqueue
from sa_outbox._cli import EXIT_USAGE, main
from sa_outbox._sql import spec_for
from sa_outbox.errors import ConfigurationError
from sa_outbox.models import Job, OutboxEvent
from sa_outbox.testing import drain
from sa_outbox.web import TokenAuth, create_app
from sa_outbox.web._reads import Count, overview, status_counts, throughput

from .helpers import seed_events

TOKEN = "test-dashboard-token-0123456789"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
#: This machine's network is closed: no background connections, no first-run, no GPU, a fresh profile.
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip
WAIT_MS = 15_000


# --- a queue worth looking at, made by the real loops ---------------------------------------------------------

EVENTS = ["OrderPaid", "OrderShipped", "OrderRefunded", "InvoiceIssued", "InvoiceVoided"]


class Broker:
    """Refuses two event types for good, the way a real broker or webhook does."""

    def publish(self, message: Message) -> None:
        if message.event_type == "OrderRefunded":
            raise PermanentError("no route for OrderRefunded: exchange 'orders' has no binding for it")
        if message.event_type == "InvoiceVoided":
            raise PermanentError("422 from https://billing.example.com/hooks: amount must be positive")


def send_email(job: ClaimedJob) -> None:
    if job.payload["to"].endswith("@invalid.example"):
        raise PermanentError("550 5.1.1 mailbox unavailable: user unknown")


def seed(engine: Engine) -> None:
    """Events of a dozen orders delivered by an ordered dispatcher (so a dead message blocks its order), and
    jobs run by a worker of the default and mail queues (reports stays queued)."""
    with Session(engine) as s, s.begin():
        for i in range(60):
            order = str(1000 + i % 12)
            s.add(OutboxEvent(
                aggregate_type="order", aggregate_id=order, event_type=EVENTS[(i * 7 + i // 12) % len(EVENTS)],
                payload={"order_id": order, "amount": f"{(i + 1) * 7.5:.2f}", "currency": "EUR"},
                headers={"traceparent": f"00-{i:032x}-{i:016x}-01"} if i % 3 == 0 else None,
            ))  # fmt: skip
        for i in range(24):
            to = f"user{i}@{'invalid.example' if i % 6 == 0 else 'example.com'}"
            enqueue(s, Job, "send_email", {"to": to}, queue="mail")
            enqueue(s, Job, "render_invoice", {"invoice": 500 + i}, queue="default")
        for i in range(6):
            enqueue(s, Job, "monthly_report", {"month": i + 1}, queue="reports")
        enqueue(s, Job, "send_email", {"to": "later@example.com"}, queue="mail", run_at=3600)
    drain(Dispatcher(engine, OutboxEvent, Broker(), ordered=True))
    drain(
        Worker(
            engine,
            Job,
            {"send_email": send_email, "render_invoice": lambda job: None},
            queues=["default", "mail"],
        )
    )


def ids(engine: Engine, table: Any, *where: Any) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(select(table.id).where(*where).order_by(table.id)).scalars())


def status_of(engine: Engine, table: Any, row_id: int) -> str:
    with engine.connect() as conn:
        return str(conn.execute(select(table.status).where(table.id == row_id)).scalar_one())


def blocked_heads(engine: Engine) -> list[int]:
    from sa_outbox.monitoring import queue_status

    return [b.dead_id for b in queue_status(engine, OutboxEvent).blocked_aggregates]


# --- servers -----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: str


def http(
    method: str, url: str, *, headers: dict[str, str] | None = None, form: dict[str, Any] | None = None
) -> Reply:
    """One real HTTP request (no redirect followed)."""
    parts = urlsplit(url)
    conn = HTTPConnection(parts.hostname, parts.port, timeout=30)
    body = urlencode(form, doseq=True) if form is not None else None
    sent = dict(headers or {})
    if body is not None:
        sent["Content-Type"] = "application/x-www-form-urlencoded"
    try:
        conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), body=body, headers=sent)
        r = conn.getresponse()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode())
    finally:
        conn.close()


def wait_http(url: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            http("GET", url)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


BEARER = {"Authorization": f"Bearer {TOKEN}"}


def csrf_of(base: str, path: str, headers: dict[str, str] = BEARER) -> str:
    page = http("GET", base + path, headers=headers)
    assert page.status == 200, page.body[-500:]
    found = re.search(r'name="csrf" value="([^"]+)"', page.body)
    assert found, "the page carries no CSRF token"
    return found.group(1)


@dataclass
class CliServer:
    base: str
    proc: subprocess.Popen[bytes]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text()


@pytest.fixture(scope="module")
def cli_server(db_url: URL, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliServer]:
    """``sa-outbox dashboard --actions`` in its own process, the token from the environment."""
    port = free_port()
    log = tmp_path_factory.mktemp("dashboard-server") / "server.log"
    env = dict(os.environ, SA_OUTBOX_DASHBOARD_TOKEN=TOKEN)
    url = db_url.render_as_string(hide_password=False)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sa_outbox", "dashboard", "--url", url, "--port", str(port), "--actions"],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/login")
        yield CliServer(base, proc, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def serve(app: Any) -> tuple[str, Callable[[], None]]:
    """Serve an ASGI app with uvicorn on a thread (real HTTP); returns its base URL and a stop function."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/")

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=30)

    return base, stop


# --- the browser -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = os.environ.get("SA_OUTBOX_SCREENSHOTS")
    path = Path(target) if target else tmp_path_factory.mktemp("dashboard-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    print(f"\ndashboard screenshots: {path}")
    return path


@pytest.fixture(scope="module")
def playwright() -> Iterator[Any]:
    pw = sync_playwright().start()
    try:
        yield pw
    finally:
        pw.stop()


@pytest.fixture(scope="module")
def browser(playwright: Any, tmp_path_factory: pytest.TempPathFactory) -> Callable[[], Any]:
    """A fresh Chromium profile (no cookies) per call; all closed at the end of the module."""
    contexts: list[Any] = []

    def make() -> Any:
        ctx = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 900},
        )  # fmt: skip
        ctx.set_default_timeout(WAIT_MS)
        contexts.append(ctx)
        return ctx

    yield make  # type: ignore[misc]
    for ctx in contexts:
        ctx.close()


@dataclass
class Tab:
    """A browser tab signed in to the CLI server, that accepts confirm() dialogs and records console errors."""

    page: Any
    base: str
    errors: list[str]

    def go(self, path: str) -> Any:
        response = self.page.goto(self.base + path)
        assert response is not None and response.status == 200, (path, response and response.status)
        return self.page


@pytest.fixture
def tab(browser: Callable[[], Any], cli_server: CliServer) -> Iterator[Tab]:
    ctx = browser()
    page = ctx.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("dialog", lambda d: d.accept())
    page.goto(f"{cli_server.base}/login?token={TOKEN}")
    yield Tab(page, cli_server.base, errors)
    page.close()


# --- pages -------------------------------------------------------------------------------------------------


def test_every_page_loads_in_the_browser_and_shows_the_queue(engine: Engine, tab: Tab, shots: Path) -> None:
    seed(engine)
    dead = ids(engine, OutboxEvent, OutboxEvent.status == "dead")
    failed = ids(engine, Job, Job.status == "failed")
    heads = blocked_heads(engine)
    assert dead and failed and heads
    pages = {
        "overview": "/",
        "dead-letters": "/tables/outbox/dead",
        "dead-letter": f"/tables/outbox/rows/{dead[0]}",
        "bulk-preview": "/tables/outbox/dead/preview?action=retry&event_type=OrderRefunded",
        "blocked": "/tables/outbox/blocked",
        "jobs": "/tables/jobs/jobs?status=queued",
        "failed-jobs": "/tables/jobs/dead",
        "queues": "/tables/jobs/queues",
        "doctor": "/doctor",
        "locks": "/locks",
    }
    for name, path in pages.items():
        page = tab.go(path)
        if name == "dead-letters":  # one opened, with headers if one has them: payload, headers, error
            opened = (
                ids(engine, OutboxEvent, OutboxEvent.status == "dead", OutboxEvent.headers.is_not(None))
                or dead
            )[0]
            page.locator(f'tr[data-id="{opened}"] summary').click()
        page.screenshot(path=str(shots / f"dashboard-{name}.png"), full_page=True)
    assert tab.errors == []

    page = tab.go("/")
    card = page.locator('section.card[data-table="outbox"]')
    assert card.locator('[data-status="dead"] .n').inner_text() == str(len(dead))
    assert page.locator('section.card[data-table="jobs"] [data-status="failed"] .n').inner_text() == str(
        len(failed)
    )
    assert card.get_by_text("Blocked aggregates").is_visible()

    page = tab.go("/tables/outbox/dead")
    assert page.locator("table.list tbody tr").count() == len(dead)
    page.locator(f'tr[data-id="{dead[0]}"] summary').click()  # payload, headers and the whole error
    detail = page.locator(f'tr[data-id="{dead[0]}"] .detail')
    assert '"currency": "EUR"' in detail.inner_text() and "PermanentError" in detail.inner_text()

    page = tab.go("/tables/outbox/blocked")
    assert sorted(int(x) for x in page.locator("tr[data-dead-id]").evaluate_all(
        "rows => rows.map(r => r.dataset.deadId)")) == sorted(heads)  # fmt: skip
    page = tab.go("/tables/jobs/queues")
    assert page.locator('tr[data-queue="reports"] td').nth(2).inner_text() == "6"


def test_the_locks_page_names_the_idle_session_that_holds_queue_locks(
    engine: Engine, db_url: URL, tab: Tab, shots: Path
) -> None:
    from sqlalchemy import create_engine

    seed(engine)
    target = ids(engine, OutboxEvent, OutboxEvent.status == "dead")[0]
    stuck = create_engine(db_url, connect_args={"application_name": "stuck-report"})
    conn = stuck.connect()
    try:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        conn.execute(select(OutboxEvent.id).where(OutboxEvent.id == target).with_for_update())  # then idle
        page = tab.go("/locks")
        page.screenshot(path=str(shots / "dashboard-locks-stuck.png"), full_page=True)
        holder = page.locator("table.list").first.locator("tr.culprit")
        assert "stuck-report" in holder.inner_text() and str(pid) in holder.inner_text()
        session = page.locator("table.list").nth(1).locator("tr", has_text="stuck-report")
        assert "idle holding locks" in session.inner_text() and "on table outbox" in session.inner_text()
        assert f"pg_terminate_backend({pid})" in page.locator(".explain").first.inner_text()
    finally:
        conn.close()
        stuck.dispose()


def test_the_overview_says_when_deliveries_fail_because_the_destination_is_down(
    engine: Engine, tab: Tab
) -> None:
    """Rows given back by a real dispatcher whose broker cannot be reached (a port nothing listens on)."""
    from sa_outbox.publishers.redis import RedisStreamPublisher

    from .brokers import closed_port

    with Session(engine) as s, s.begin():
        for i in range(3):
            s.add(
                OutboxEvent(aggregate_type="order", aggregate_id=str(i), event_type="OrderPaid", payload={})
            )
    down = RedisStreamPublisher(f"redis://127.0.0.1:{closed_port()}/0", stream="s", timeout=1)
    d = Dispatcher(engine, OutboxEvent, down, listen=False)
    try:
        assert d.run_once() == 3 and d.circuit_open
    finally:
        d.close()
    card = tab.go("/").locator('section.card[data-table="outbox"]')
    assert card.locator(".badge", has_text="unavailable").is_visible()
    assert "3 of the 3 oldest due messages were given back for it" in card.inner_text()
    assert "deliveries are failing: the destination is unavailable" in card.locator(".warnings").inner_text()


def test_the_overview_refreshes_itself_in_place(engine: Engine, tab: Tab) -> None:
    """The script re-reads the page every 10 s and swaps the figures in, without a navigation. (The page's
    clock is Playwright's, paused before the page loads: the test moves it on by the 10 s instead of waiting
    for them; the re-read itself is a real request. Installed but not paused, it ran on in real time between
    the page's load and the first step, and on a loaded machine the re-read came before the 9 s step ended.)"""
    start = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
    tab.page.clock.install(time=start)
    tab.page.clock.pause_at(start + dt.timedelta(seconds=1))
    page = tab.go("/")
    page.evaluate("window.sameDocument = true")
    dead = page.locator('section.card[data-table="outbox"] [data-status="dead"] .n')
    assert dead.inner_text() == "0"
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status) "
                          "VALUES ('order', '1', 'OrderPaid', '{}', 'dead')"))  # fmt: skip
    script = (
        "() => document.querySelector('section.card[data-table=outbox] [data-status=dead] .n').textContent"
    )
    page.clock.run_for(9_000)
    time.sleep(0.5)
    assert page.evaluate(script) == "0"  # not before the 10 s
    page.clock.run_for(1_100)
    deadline = time.monotonic() + WAIT_MS / 1000
    while page.evaluate(script) != "1" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert page.evaluate(script) == "1"
    assert page.evaluate("window.sameDocument") is True


def test_dead_letter_filters_narrow_the_list(engine: Engine, tab: Tab) -> None:
    seed(engine)
    refunded = ids(
        engine, OutboxEvent, OutboxEvent.status == "dead", OutboxEvent.event_type == "OrderRefunded"
    )
    page = tab.go("/tables/outbox/dead")
    page.fill('input[name="event_type"]', "OrderRefunded")
    page.click('form.filters button[type="submit"]')
    page.wait_for_url("**event_type=OrderRefunded**")
    shown = [int(x) for x in page.locator("tbody tr").evaluate_all("rows => rows.map(r => r.dataset.id)")]
    assert shown == refunded
    page.fill('input[name="error"]', "no such text anywhere")
    page.click('form.filters button[type="submit"]')
    assert page.locator("p.empty").inner_text().startswith("No dead rows match")


# --- actions through the UI ---------------------------------------------------------------------------------


def test_retry_a_dead_letter_through_the_ui_requeues_it(
    engine: Engine, tab: Tab, cli_server: CliServer
) -> None:
    seed(engine)
    target = ids(engine, OutboxEvent, OutboxEvent.status == "dead")[0]
    page = tab.go("/tables/outbox/dead")
    page.check(f'tr[data-id="{target}"] input[name="ids"]')
    assert page.locator("[data-selected-count]").inner_text() == "1 selected"
    page.click("text=Retry selected")
    page.wait_for_selector(".flash")
    assert f"requeued 1 row(s) of outbox: {target}" in page.locator(".flash").inner_text()
    with engine.connect() as conn:
        row = conn.execute(select(OutboxEvent.status, OutboxEvent.attempts, OutboxEvent.last_error)
                           .where(OutboxEvent.id == target)).one()  # fmt: skip
    assert row.status == "pending" and row.attempts == 0 and row.last_error.endswith("requeued by operator")
    assert page.locator(f'tr[data-id="{target}"]').count() == 0
    assert re.search(rf"dashboard: token@127\.0\.0\.1 retry_dead on outbox: 1 of 1 selected row\(s\) changed "
                     rf"\(selected ids\): {target}\b", cli_server.log_text())  # fmt: skip


def test_skip_a_dead_letter_through_the_ui_unblocks_its_aggregate(engine: Engine, tab: Tab) -> None:
    seed(engine)
    head = blocked_heads(engine)[0]
    page = tab.go("/tables/outbox/blocked")
    page.locator(f'tr[data-dead-id="{head}"]').get_by_role("button", name="Skip").click()
    page.wait_for_selector(".flash")
    assert status_of(engine, OutboxEvent, head) == "done"
    assert head not in blocked_heads(engine)
    assert page.locator(f'tr[data-dead-id="{head}"]').count() == 0


def test_bulk_retry_shows_how_many_rows_then_requeues_exactly_those(engine: Engine, tab: Tab) -> None:
    seed(engine)
    voided = ids(engine, OutboxEvent, OutboxEvent.status == "dead", OutboxEvent.event_type == "InvoiceVoided")
    others = ids(engine, OutboxEvent, OutboxEvent.status == "dead", OutboxEvent.event_type != "InvoiceVoided")
    assert len(voided) > 1 and others
    page = tab.go("/tables/outbox/dead?event_type=InvoiceVoided")
    page.click("text=Retry all matching…")
    assert page.locator("[data-preview-count]").inner_text() == str(len(voided))
    assert (
        ids(engine, OutboxEvent, OutboxEvent.status == "pending", OutboxEvent.id.in_(voided)) == []
    )  # a preview
    page.get_by_role("button", name=f"Retry {len(voided)} row(s)").click()
    page.wait_for_selector(".flash")
    assert f"requeued {len(voided)} row(s) of outbox (the preview showed {len(voided)})" in page.inner_text(
        ".flash"
    )
    assert ids(engine, OutboxEvent, OutboxEvent.id.in_(voided), OutboxEvent.status == "pending") == voided
    assert ids(engine, OutboxEvent, OutboxEvent.id.in_(others), OutboxEvent.status == "dead") == others


def test_cancel_and_retry_jobs_through_the_ui(engine: Engine, tab: Tab) -> None:
    seed(engine)
    reports = ids(engine, Job, Job.queue == "reports", Job.status == "queued")
    failed = ids(engine, Job, Job.status == "failed")
    page = tab.go("/tables/jobs/jobs?status=queued&queue=reports")
    page.check(f'tr[data-id="{reports[0]}"] input[name="ids"]')
    page.click("text=Cancel selected")
    page.wait_for_selector(".flash")
    assert status_of(engine, Job, reports[0]) == "cancelled"
    page = tab.go("/tables/jobs/jobs?status=failed")
    page.check("[data-select-all]")
    page.click("text=Retry selected")
    page.wait_for_selector(".flash")
    assert f"requeued {len(failed)} job(s)" in page.inner_text(".flash")
    assert ids(engine, Job, Job.id.in_(failed), Job.status == "queued") == failed


def test_discard_failed_jobs_through_the_ui_one_and_every_matching(
    engine: Engine, tab: Tab, cli_server: CliServer
) -> None:
    """A failed job could be retried from the dashboard but not discarded (the CLI's ``dead skip --jobs``): an
    operator had to leave it failing the check, or go to the command line (a review)."""
    seed(engine)
    failed = ids(engine, Job, Job.status == "failed")
    with engine.begin() as conn:  # two more failed jobs, of another task, for the bulk discard
        conn.execute(text("INSERT INTO jobs (queue, task, payload, status, last_error) "
                          "SELECT 'mail', 'import_file', '{}', 'failed', 'bad file' FROM generate_series(1, 2)"))  # fmt: skip
    imports = ids(engine, Job, Job.status == "failed", Job.task == "import_file")
    page = tab.go(f"/tables/jobs/rows/{failed[0]}")
    page.get_by_role("button", name="Discard").click()
    page.wait_for_selector(".flash")
    assert f"discarded 1 row(s) of jobs: {failed[0]}" in page.inner_text(".flash")
    with engine.connect() as conn:
        status, error = conn.execute(select(Job.status, Job.last_error).where(Job.id == failed[0])).one()
    assert status == "cancelled" and error.endswith("discarded by operator (not run again)")
    page = tab.go("/tables/jobs/dead?task=import_file")
    page.click("text=Discard all matching…")
    assert page.locator("[data-preview-count]").inner_text() == "2"
    assert "This would discard (cancel: never run again)" in page.inner_text("section.preview")
    page.get_by_role("button", name="Discard 2 row(s)").click()
    page.wait_for_selector(".flash")
    assert "discarded 2 row(s) of jobs (the preview showed 2)" in page.inner_text(".flash")
    assert ids(engine, Job, Job.id.in_(imports), Job.status == "cancelled") == imports
    assert ids(engine, Job, Job.status == "failed") == failed[1:]
    assert re.search(r"dashboard: token@127\.0\.0\.1 skip_dead on jobs: 2 of 2 selected row\(s\) changed",
                     cli_server.log_text())  # fmt: skip


def test_an_action_on_selected_jobs_names_those_that_changed_since_the_page_was_drawn(
    engine: Engine, cli_server: CliServer
) -> None:
    """A job selected on the page that finished before the click: the flash said "cancelled 0 queued job(s)"
    and nothing of why, as if the click had been lost."""
    from urllib.parse import unquote

    seed(engine)
    queued = ids(engine, Job, Job.status == "queued", Job.queue == "reports")[:2]
    done = ids(engine, Job, Job.status == "done")[0]
    failed = ids(engine, Job, Job.status == "failed")[0]
    csrf = csrf_of(cli_server.base, "/tables/jobs/jobs")

    def flash(action: str, *picked: int) -> str:
        reply = http("POST", f"{cli_server.base}/tables/jobs/jobs/{action}", headers=BEARER,
                     form={"ids": [str(i) for i in picked], "csrf": csrf})  # fmt: skip
        assert reply.status == 303, reply.body
        return unquote(reply.headers["set-cookie"])

    said = flash("cancel", queued[0], done)
    assert "cancelled 1 queued job(s)" in said and f"; 1 were no longer queued or running: {done}" in said, (
        said
    )
    said = flash("retry", failed, done)
    assert "requeued 1 job(s)" in said and f"; 1 were no longer failed or cancelled: {done}" in said, said
    assert "were no longer" not in flash("cancel", queued[1])


def test_job_lists_filter_by_status_task_and_queue_newest_first(
    engine: Engine, cli_server: CliServer
) -> None:
    seed(engine)

    def listed(query: str) -> list[int]:
        page = http("GET", f"{cli_server.base}/tables/jobs/jobs?{query}", headers=BEARER)
        assert page.status == 200
        return [int(x) for x in re.findall(r'<tr data-id="(\d+)"', page.body)]

    invoices = ids(engine, Job, Job.status == "done", Job.task == "render_invoice")
    assert listed("status=done&task=render_invoice") == invoices[::-1]
    assert listed(f"status=done&task=render_invoice&before={invoices[-3]}") == invoices[-4::-1]
    assert listed("status=failed&queue=mail") == ids(engine, Job, Job.status == "failed")[::-1]
    assert listed("status=queued&queue=reports&task=send_email") == []


def test_pause_and_resume_a_queue_through_the_ui(engine: Engine, tab: Tab) -> None:
    from sa_outbox.admin import list_queues

    seed(engine)
    page = tab.go("/tables/jobs/queues")
    page.locator('tr[data-queue="reports"]').get_by_role("button", name="Pause").click()
    page.wait_for_selector(".flash")
    [state] = [q for q in list_queues(engine, Job) if q.name == "reports"]
    assert state.paused and state.paused_by == "token@127.0.0.1"
    page.locator('tr[data-queue="reports"]').get_by_role("button", name="Resume").click()
    page.wait_for_selector(".flash")
    [state] = [q for q in list_queues(engine, Job) if q.name == "reports"]
    assert not state.paused


def test_resuming_a_queue_that_is_not_paused_says_so(engine: Engine, cli_server: CliServer) -> None:
    """Names are case-sensitive: resuming ``reports`` while ``Reports`` is paused changes nothing, and the flash
    says so instead of "resumed"; the log has no "resume" line for it."""
    from urllib.parse import unquote

    from sa_outbox.admin import list_queues, pause_queue

    seed(engine)
    pause_queue(engine, Job, "Reports")
    csrf = csrf_of(cli_server.base, "/tables/jobs/queues")
    logged = len(cli_server.log_text())
    reply = http("POST", cli_server.base + "/tables/jobs/queues/resume", headers=BEARER,
                 form={"queue": "reports", "csrf": csrf})  # fmt: skip
    assert reply.status == 303
    assert "queue reports of jobs was not paused: nothing resumed" in unquote(reply.headers["set-cookie"])
    assert [q.name for q in list_queues(engine, Job) if q.paused] == ["Reports"]
    assert "resume queue 'reports'" not in cli_server.log_text()[logged:]


def test_an_id_beyond_bigint_is_a_bad_request_not_a_database_outage(
    engine: Engine, cli_server: CliServer
) -> None:
    seed(engine)
    huge = str(2**63)
    csrf = csrf_of(cli_server.base, "/tables/outbox/dead")
    action = http("POST", cli_server.base + "/tables/outbox/dead/retry", headers=BEARER,
                  form={"ids": huge, "csrf": csrf})  # fmt: skip
    page = http("GET", cli_server.base + f"/tables/outbox/rows/{huge}", headers=BEARER)
    assert (action.status, page.status) == (400, 400)
    assert "must fit a bigint" in action.body and "must fit a bigint" in page.body
    # the largest bigint is a valid id: no such row, not a refusal
    assert http("GET", cli_server.base + f"/tables/outbox/rows/{2**63 - 1}", headers=BEARER).status == 404


# --- refusals ----------------------------------------------------------------------------------------------


def test_an_action_without_the_csrf_token_is_refused(engine: Engine, cli_server: CliServer) -> None:
    seed(engine)
    target = ids(engine, OutboxEvent, OutboxEvent.status == "dead")[0]
    url = cli_server.base + "/tables/outbox/dead/retry"
    missing = http("POST", url, headers=BEARER, form={"ids": target})
    forged = http("POST", url, headers=BEARER, form={"ids": target, "csrf": "1700000000.deadbeef"})
    assert (missing.status, forged.status) == (403, 403)
    assert "CSRF" in missing.body and "CSRF" in forged.body
    assert status_of(engine, OutboxEvent, target) == "dead"
    # The same form with the page's token goes through: the refusals above were for the token alone.
    done = http(
        "POST",
        url,
        headers=BEARER,
        form={"ids": target, "csrf": csrf_of(cli_server.base, "/tables/outbox/dead")},
    )
    assert done.status == 303 and status_of(engine, OutboxEvent, target) == "pending"


def test_an_action_without_authentication_is_refused(engine: Engine, cli_server: CliServer) -> None:
    seed(engine)
    target = ids(engine, OutboxEvent, OutboxEvent.status == "dead")[0]
    csrf = csrf_of(cli_server.base, "/tables/outbox/dead")  # a valid token, taken by someone signed in
    url = cli_server.base + "/tables/outbox/dead/skip"
    anonymous = http("POST", url, form={"ids": target, "csrf": csrf})
    wrong = http(
        "POST",
        url,
        headers={"Authorization": "Bearer not-the-token-at-all-0000"},
        form={"ids": target, "csrf": csrf},
    )
    assert (anonymous.status, wrong.status) == (401, 401)
    assert status_of(engine, OutboxEvent, target) == "dead"
    # The pages too: with a token, nothing is shown to a stranger.
    assert http("GET", cli_server.base + "/tables/outbox/dead").status == 401
    assert "refused POST /tables/outbox/dead/skip: authentication required" in cli_server.log_text()


def test_a_cross_site_form_post_is_refused_even_with_valid_tokens(
    engine: Engine, cli_server: CliServer
) -> None:
    seed(engine)
    target = ids(engine, OutboxEvent, OutboxEvent.status == "dead")[0]
    csrf = csrf_of(cli_server.base, "/tables/outbox/dead")
    reply = http("POST", cli_server.base + "/tables/outbox/dead/retry",
                 headers={**BEARER, "Origin": "https://evil.example"}, form={"ids": target, "csrf": csrf})  # fmt: skip
    assert reply.status == 403 and "cross-site" in reply.body
    assert status_of(engine, OutboxEvent, target) == "dead"


def test_the_login_page_takes_only_the_dashboard_token(
    browser: Callable[[], Any], cli_server: CliServer
) -> None:
    page = browser().new_page()
    assert page.goto(cli_server.base + "/").status == 401
    assert page.goto(cli_server.base + "/login?token=wrong-token-0123456789").status == 401
    page.goto(cli_server.base + "/login")
    page.fill('input[name="token"]', TOKEN)
    page.click('button[type="submit"]')
    page.wait_for_url(cli_server.base + "/")
    assert page.locator(".mode").inner_text() == "actions on · token@127.0.0.1"
    [cookie] = [c for c in page.context.cookies() if c["name"] == "sa_outbox_dashboard_token"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"


# --- in a host application ---------------------------------------------------------------------------------


def test_mounted_in_a_host_app_the_hook_names_who_acted(
    engine: Engine, browser: Callable[[], Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A Starlette app mounts the dashboard under a prefix with its own (async) authentication hook."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.routing import Mount

    async def current_user(request: Request) -> str | None:
        return request.cookies.get("user")  # the host app's own session, say

    seed(engine)
    target = ids(engine, Job, Job.status == "failed")[0]
    host = Starlette(
        routes=[Mount("/ops/queue", create_app(engine, actions=True, authenticate=current_user))]
    )
    base, stop = serve(host)
    try:
        ctx = browser()
        ctx.add_cookies([{"name": "user", "value": "alice", "url": base}])
        page = ctx.new_page()
        page.on("dialog", lambda d: d.accept())
        page.goto(base + "/ops/queue/")
        page.locator("header nav").get_by_role(
            "link", name="Failed", exact=True
        ).click()  # links carry the prefix
        assert page.url == base + "/ops/queue/tables/jobs/dead"
        with caplog.at_level(logging.INFO, logger="sa_outbox.web"):
            page.check(f'tr[data-id="{target}"] input[name="ids"]')
            page.click("text=Retry selected")
            page.wait_for_selector(".flash")
        assert page.url == base + "/ops/queue/tables/jobs/dead"
        assert status_of(engine, Job, target) == "queued"
        [record] = [r for r in caplog.records if r.name == "sa_outbox.web"]
        assert (record.who, record.action, record.table, record.selected, record.changed) == (  # type: ignore[attr-defined]
            "alice", "retry_dead", "jobs", 1, 1,
        )  # fmt: skip
        ctx.clear_cookies()
        assert page.goto(base + "/ops/queue/").status == 401
    finally:
        stop()


def test_read_only_by_default_no_action_is_offered_or_accepted(
    engine: Engine, browser: Callable[[], Any]
) -> None:
    seed(engine)
    target = ids(engine, OutboxEvent, OutboxEvent.status == "dead")[0]
    base, stop = serve(create_app(engine))
    try:
        page = browser().new_page()
        page.goto(base + "/tables/outbox/dead")
        assert page.locator(".mode").inner_text() == "read-only"
        assert page.locator("button").count() == 1  # the filter form's, nothing else
        assert page.locator('input[name="ids"]').count() == 0
        reply = http("POST", base + "/tables/outbox/dead/retry", form={"ids": target, "csrf": "x"})
        assert reply.status == 403 and "read-only" in reply.body
        assert status_of(engine, OutboxEvent, target) == "dead"
    finally:
        stop()


def test_a_page_whose_statement_waits_too_long_says_so_instead_of_hanging(engine: Engine) -> None:
    """Another session holds an ACCESS EXCLUSIVE lock on the outbox (a migration, say): the page's read waits
    for it, then statement_timeout cancels it and the page answers 503 with the database's reason."""
    base, stop = serve(create_app(engine, statement_timeout=0.5))
    blocker = engine.connect()
    try:
        blocker.execute(text("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE"))
        reply = http(
            "GET", base + "/tables/outbox/dead"
        )  # the lock is held for good: only the timeout ends it
        assert reply.status == 503 and "canceling statement due to statement timeout" in reply.body
        blocker.rollback()
        assert http("GET", base + "/tables/outbox/dead").status == 200
    finally:
        blocker.close()
        stop()


EVERY_PAGE = (
    "/",
    "/tables/outbox/dead",
    "/tables/outbox/dead/preview?action=retry",
    "/tables/outbox/dead/preview?action=skip&event_type=E",
    "/tables/jobs/dead/preview?action=retry&task=t",
    "/tables/jobs/dead/preview?action=skip&task=t",
    "/tables/outbox/rows/1",
    "/tables/outbox/blocked",
    "/tables/jobs/jobs",
    "/tables/jobs/jobs/preview?action=retry&task=t",
    "/tables/jobs/jobs/preview?action=cancel&queue=default",
    "/tables/jobs/queues",
    "/doctor",
)


def test_no_page_waits_on_a_lock_past_its_statement_timeout_nor_uses_up_the_pool(engine: Engine) -> None:
    """Every page that reads the tables — the bulk previews and the doctor included — reads them in the page's
    bounded transaction: under a migration's ACCESS EXCLUSIVE lock on both tables each answers 503, and after
    more such requests than the pool holds the Locks page (what an operator opens to find the holder) still
    answers. A hostile review: the previews and the doctor called the admin/doctor functions on the engine,
    which waited for the lock for good; 16 of them used up the pool and every page was a bare 500 after 30 s."""
    base, stop = serve(create_app(engine, statement_timeout=0.5))
    blocker = engine.connect()
    try:
        blocker.execute(text("LOCK TABLE outbox, jobs IN ACCESS EXCLUSIVE MODE"))
        for _ in range(2):  # 24 requests: more than the app's pool (5 + 10 overflow)
            for path in EVERY_PAGE:
                reply = http(
                    "GET", base + path
                )  # (a page that waited for the lock would time out here: 30 s)
                assert reply.status == 503 and "statement timeout" in reply.body, (path, reply.status)
        assert http("GET", base + "/locks").status == 200
        blocker.rollback()
        for path in EVERY_PAGE:
            assert http("GET", base + path).status in (200, 404), path  # (row 1 does not exist: 404)
    finally:
        blocker.close()
        stop()


def test_a_dashboard_without_authentication_answers_only_to_its_loopback_names(engine: Engine) -> None:
    """DNS rebinding: a page on attacker.example whose name is made to resolve to 127.0.0.1 has the browser send
    ``Host: attacker.example`` to the open (no-token) dashboard, and would read every payload on it. Such a
    dashboard answers only to its loopback names unless told others (``allowed_hosts``); one with
    authentication answers to any (its login cookie is bound to the host the operator signed in on). A
    hostile review read a payload through ``Host: attacker.example:18552`` (status 200)."""
    seed_events(engine, 1)
    with engine.begin() as conn:
        conn.execute(text('UPDATE outbox SET payload = \'{"secret": "s3cr3t-abc"}\''))
    base, stop = serve(create_app(engine))
    named, stop_named = serve(create_app(engine, allowed_hosts=["queues.internal"]))
    token = "t" * 24
    authed, stop_authed = serve(create_app(engine, authenticate=TokenAuth(token)))
    try:
        port = urlsplit(base).port
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST"):
            assert http("GET", base + "/tables/outbox/rows/1", headers={"Host": host}).status == 200, host
        for host in (f"attacker.example:{port}", "attacker.example", "127.0.0.1.attacker.example", ""):
            reply = http("GET", base + "/tables/outbox/rows/1", headers={"Host": host})
            assert reply.status == 400 and "s3cr3t" not in reply.body and "loopback" in reply.body, host
        assert http("GET", named + "/", headers={"Host": "queues.internal:80"}).status == 200
        assert http("GET", named + "/", headers={"Host": "localhost"}).status == 400
        bearer = {"Authorization": f"Bearer {token}", "Host": "dashboard.example"}
        assert http("GET", authed + "/tables/outbox/rows/1", headers=bearer).status == 200
    finally:
        stop()
        stop_named()
        stop_authed()
    with pytest.raises(ConfigurationError, match="allowed_hosts"):
        create_app(engine, allowed_hosts="localhost")  # type: ignore[arg-type]


def test_actions_need_an_authentication_hook(engine: Engine) -> None:
    with pytest.raises(ConfigurationError, match="actions=True needs authenticate="):
        create_app(engine, actions=True)
    with pytest.raises(ConfigurationError, match="at least 16 characters"):
        TokenAuth("short")


# --- the command -------------------------------------------------------------------------------------------


def test_the_command_refuses_a_public_address_without_a_token(
    db_url: URL, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SA_OUTBOX_DASHBOARD_TOKEN", raising=False)
    code = main(["dashboard", "--host", "0.0.0.0", "--url", db_url.render_as_string(hide_password=False)])
    assert code == EXIT_USAGE
    assert "without a token would show every payload" in capsys.readouterr().err


def test_the_command_prints_a_sign_in_link_and_stops_cleanly_on_sigterm(db_url: URL) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "SA_OUTBOX_DASHBOARD_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sa_outbox", "dashboard", "--url", db_url.render_as_string(hide_password=False),
         "--port", str(port), "--actions"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith(
            f"sa-outbox dashboard: http://127.0.0.1:{port}/ (actions on; outbox, jobs)"
        ), first
        link = proc.stdout.readline().strip()
        token = re.fullmatch(rf"sign in \(token generated for this run\): http://127\.0\.0\.1:{port}/login\?token=(\S+)",
                             link)  # fmt: skip
        assert token, link
        wait_http(f"http://127.0.0.1:{port}/login")
        assert (
            http(
                "GET", f"http://127.0.0.1:{port}/", headers={"Authorization": f"Bearer {token.group(1)}"}
            ).status
            == 200
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()
    assert code == 0


# --- reads on big tables: exact below the cap, estimated above -------------------------------------------


def test_counts_beyond_the_cap_are_estimates_and_below_it_exact(engine: Engine) -> None:
    spec = spec_for(OutboxEvent)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                          "SELECT 'o', g::text, 'E', '{}' FROM generate_series(1, 300) g"))  # fmt: skip
        conn.execute(text("ANALYZE outbox"))
    with engine.connect() as conn:
        exact = status_counts(conn, spec, cap=1000)
        capped = status_counts(conn, spec, cap=100)
    assert (exact["pending"].value, exact["pending"].estimated) == (300, False)
    assert (
        capped["pending"].estimated and capped["pending"].value > 100
    )  # the planner's figure, never below the cap
    assert (capped["dead"].value, capped["dead"].estimated) == (0, False)


def test_the_queues_page_reads_what_list_queues_reads_with_bounded_counts(engine: Engine) -> None:
    from sa_outbox.admin import list_queues, pause_queue
    from sa_outbox.web._reads import queue_rows

    seed(engine)
    pause_queue(engine, Job, "reports", by="ops")
    pause_queue(engine, Job, "nightly")  # a state row and no job
    with engine.connect() as conn:
        rows, more = queue_rows(conn, spec_for(Job))
        capped, _ = queue_rows(conn, spec_for(Job), cap=2)
    assert not more
    expected = [
        (q.name, q.paused_at, q.paused_by, q.queued, False, q.running) for q in list_queues(engine, Job)
    ]
    assert [
        (r.name, r.paused_at, r.paused_by, r.queued.value, r.queued.estimated, r.running) for r in rows
    ] == expected
    assert [r.name for r in rows] == ["mail", "nightly", "reports"]
    reports = next(r for r in capped if r.name == "reports")
    assert reports.queued.estimated and reports.queued.value > 2


def test_the_queues_page_and_the_jobs_summary_list_a_bounded_number_of_queues(engine: Engine) -> None:
    """250 queues of one job each (a queue per tenant, say), three of them paused and named last: the queues
    page lists 100 — the paused ones among them, with their queued jobs counted — and says more exist; the jobs
    page's summary lists the 100 (queue, task) pairs with the most jobs and how many it left out. Both read and
    rendered every queue before (a hostile review: 60,000 queues, 20.7 s and 38 MB for the queues page, past
    its statement_timeout without a 503: each statement was short)."""
    from sa_outbox.admin import pause_queue
    from sa_outbox.web._reads import job_summary, queue_rows

    with engine.begin() as conn:
        conn.execute(text("INSERT INTO jobs (task, queue, payload) "
                          "SELECT 't', 'q' || lpad(g::text, 3, '0'), '{}'::jsonb FROM generate_series(1, 247) g "
                          "UNION ALL SELECT 't', 'zz' || g, '{}' FROM generate_series(1, 3) g "
                          "UNION ALL SELECT 'big', 'q001', '{}' FROM generate_series(1, 5)"))  # fmt: skip
    for name in ("zz1", "zz2", "zz3"):
        pause_queue(engine, Job, name, by="ops")
    with engine.connect() as conn:
        rows, more = queue_rows(conn, spec_for(Job))
        summary, sampled, left_out = job_summary(conn, spec_for(Job))
    assert more and len(rows) == 100
    assert {r.name: (r.paused, r.queued.value) for r in rows if r.name.startswith("zz")} == {
        "zz1": (True, 1), "zz2": (True, 1), "zz3": (True, 1),
    }  # fmt: skip
    assert [r.name for r in rows] == sorted(r.name for r in rows)
    assert all(
        (r.queued.value, r.queued.estimated) == (6 if r.name == "q001" else 1, False)
        for r in rows
        if not r.name.startswith("zz")
    )
    assert len(summary) == 100 and left_out == 151 and not sampled
    assert {"queue": "q001", "task": "big", "queued": 5, "running": 0, "failed": 0} in summary
    base, stop = serve(create_app(engine))
    try:
        page = http("GET", base + "/tables/jobs/queues")
        assert page.status == 200 and page.body.count("<tr data-queue=") == 100
        assert "More queues than the 100 listed here" in page.body
        jobs = http("GET", base + "/tables/jobs/jobs")
        assert jobs.status == 200 and "151 more (queue, task) pair(s)" in jobs.body
    finally:
        stop()


def test_the_overview_reads_at_most_its_cap_of_dead_rows(engine: Engine) -> None:
    """Dead rows are counted up to the cap and estimated beyond (as every other state), and the blocked
    aggregates counted among the first dead rows read, said as "at least" — the overview grouped every dead row
    (a hostile review: 200,000 dead rows scanned on each visit, its figure exact where the others are capped).
    Six aggregates, each a dead message then a pending one; with a cap of 3 the first four dead rows are read."""
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status) "
            "SELECT 'o', (g % 6)::text, 'E', '{}'::jsonb, CASE WHEN g <= 6 THEN 'dead' ELSE 'pending' END "
            "FROM generate_series(1, 12) g"
        ))  # fmt: skip
        conn.execute(text("ANALYZE outbox"))
    spec = spec_for(OutboxEvent)
    with engine.connect() as conn:
        exact = overview(conn, spec, stale_after=60)
        capped = overview(conn, spec, stale_after=60, cap=3)
    assert (exact.counts["dead"], exact.blocked_total, exact.blocked_partial) == (Count(6), 6, False)
    assert capped.counts["dead"].estimated and capped.counts["dead"].value >= 4
    assert (capped.blocked_total, capped.blocked_partial) == (4, True)
    assert "at least 4 ordered aggregate(s) wait behind a dead message" in capped.warnings


def test_throughput_counts_rows_finished_in_the_last_hour_per_minute(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status, done_at) "
            "SELECT 'o', g::text, 'E', '{}'::jsonb, 'done', now() - (g % 3) * interval '10 minutes' - interval '1 s' "
            "FROM generate_series(1, 90) g UNION ALL "
            "SELECT 'o', 'old', 'E', '{}', 'done', now() - interval '2 hours'"
        ))  # fmt: skip
    spec = spec_for(OutboxEvent)
    with engine.connect() as conn:
        tp = throughput(conn, spec)
        sampled = throughput(conn, spec, cap=50)
        card = overview(conn, spec, stale_after=60)
    assert (tp.total, tp.estimated) == (90, False)
    assert sorted(v for v in tp.per_minute if v) == [
        30,
        30,
        30,
    ]  # three minutes, 10 apart; the 2-hour-old row is out
    assert sampled.estimated and None in sampled.per_minute
    assert card.throughput == tp and card.counts["done"].value == 91
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(OutboxEvent)).scalar_one() == 91
