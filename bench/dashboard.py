"""The dashboard's pages on big tables: ``python -m bench.run --scenarios dashboard`` (or ``python -m
bench.dashboard --url …`` alone).

Fills the outbox and the jobs table with ``--dashboard-rows`` rows each (default 1,000,000) shaped like a
week of a busy service — most rows done over seven days, the newest hour the busiest (100,000 rows), a tail of
pending/queued rows, leased rows (a few past their lease), dead and failed rows scattered through the week,
ordered aggregates blocked behind dead messages, cancelled jobs, four queues, eight tasks, JSON payloads and
headers — then starts the dashboard the way ``sa-outbox dashboard`` does (uvicorn, its own process, actions
on) and times every page over HTTP: ``--runs`` rounds of ``REQUESTS`` requests per page after one warm-up
request, median and max. The same again with a backlog (half the table pending/queued: an outage), where
exact counts would read every row.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from http.client import HTTPConnection
from typing import Any

from sqlalchemy import Engine, create_engine, make_url, text

from .harness import summary
from .report import HEADER, render_rows, row

#: Requests per page per run (after one warm-up request).
REQUESTS = 5
TARGET_MS = 300.0

# Rows are numbered p = 0 (the newest) … n-1 (the oldest); ids ascend with age going down, as in a real table.
# The newest 100,000 rows were created over the last hour, the rest over the seven days before.
_CREATED = (
    "CASE WHEN p < 100000 THEN now() - p * interval '36 ms' "
    "ELSE now() - interval '1 hour' - (p - 100000) * (interval '7 days' / greatest(:n - 100000, 1)) END"
)

_OUTBOX = f"""
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, created_at, status,
                    available_at, attempts, lease_owner, lease_until, lease_version, last_error, done_at)
SELECT (ARRAY['order', 'customer', 'invoice', 'shipment'])[1 + p % 4],
       (p % 50000)::text,
       (ARRAY['OrderPaid', 'OrderShipped', 'CustomerUpdated', 'InvoiceIssued', 'ShipmentDelivered'])[1 + p % 5],
       jsonb_build_object('id', p, 'amount', (p % 1000) * 1.5, 'currency', 'EUR',
                          'lines', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || p % 97, 'qty', 1 + p % 3))),
       CASE WHEN p % 3 = 0 THEN jsonb_build_object('traceparent', '00-' || md5(p::text) || '-' || left(md5(p::text), 16) || '-01') END,
       created,
       st,
       CASE WHEN st = 'pending' AND p % 10 = 0 THEN now() + interval '5 minutes' ELSE created END,
       CASE st WHEN 'dead' THEN 12 WHEN 'done' THEN 1 ELSE p % 4 END,
       CASE WHEN st = 'processing' THEN 'dispatcher-' || p % 4 END,
       CASE WHEN st = 'processing' THEN now() + CASE WHEN p % 10 = 0 THEN interval '-2 minutes' ELSE interval '50 s' END END,
       CASE st WHEN 'done' THEN 1 WHEN 'dead' THEN 12 ELSE p % 4 END,
       CASE WHEN st = 'dead' THEN (ARRAY['PermanentError: no route for ' || 'event', 'RetryableError: HTTP 503 from https://hooks.example.com/in',
                                          'ValueError: amount must be positive'])[1 + p % 3]
            WHEN st = 'pending' AND p % 4 > 0 THEN 'RetryableError: HTTP 503 from https://hooks.example.com/in' END,
       CASE WHEN st = 'done' THEN created + interval '80 ms' END
  FROM (SELECT p, {_CREATED} AS created,
               CASE WHEN p < :pending THEN 'pending' WHEN p < :pending + 200 THEN 'processing'
                    WHEN p % 200 = 7 THEN 'dead' ELSE 'done' END AS st
          FROM generate_series(:n - 1, 0, -1) AS p) AS r
"""

_JOBS = f"""
INSERT INTO jobs (queue, task, payload, headers, status, priority, run_at, attempts, max_attempts, locked_by,
                  locked_at, lease_version, last_error, created_at, finished_at)
SELECT (ARRAY['default', 'mail', 'reports', 'webhooks'])[1 + p % 4],
       (ARRAY['send_email', 'send_sms', 'render_invoice', 'sync_crm', 'resize_image', 'charge_card',
              'post_webhook', 'rebuild_index'])[1 + p % 8],
       jsonb_build_object('id', p, 'to', 'user' || p % 5000 || '@example.com'),
       CASE WHEN p % 3 = 0 THEN jsonb_build_object('traceparent', '00-' || md5(p::text) || '-' || left(md5(p::text), 16) || '-01') END,
       st,
       CASE WHEN p % 10 = 0 THEN 10 ELSE 0 END,
       CASE WHEN st = 'queued' AND p % 10 = 0 THEN now() + interval '10 minutes' ELSE created END,
       CASE st WHEN 'failed' THEN 10 WHEN 'queued' THEN p % 3 ELSE 1 END,
       10,
       CASE WHEN st = 'running' THEN 'worker-' || p % 4 END,
       CASE WHEN st = 'running' THEN now() - CASE WHEN p % 10 = 0 THEN interval '5 minutes' ELSE interval '5 s' END END,
       CASE st WHEN 'queued' THEN p % 3 ELSE 1 END,
       CASE WHEN st = 'failed' THEN (ARRAY['PermanentError: mailbox unavailable', 'TimeoutError: handler ran longer than 30s',
                                          'KeyError: ''customer_id'''])[1 + p % 3]
            WHEN st = 'cancelled' THEN 'cancelled by operator' END,
       created,
       CASE WHEN st IN ('done', 'cancelled', 'failed') THEN created + interval '120 ms' END
  FROM (SELECT p, {_CREATED} AS created,
               CASE WHEN p < :queued THEN 'queued' WHEN p < :queued + 100 THEN 'running'
                    WHEN p % 200 = 11 THEN 'failed' WHEN p % 500 = 13 THEN 'cancelled' ELSE 'done' END AS st
          FROM generate_series(:n - 1, 0, -1) AS p) AS r
"""


def fill(engine: Engine, n: int, *, backlog: bool = False) -> dict[str, int]:
    """``n`` rows in each of ``outbox`` and ``jobs`` (emptied first), vacuumed and analyzed. Returns how many
    rows are pending / queued."""
    pending = n // 2 if backlog else min(20_000, n // 50)
    queued = n // 2 if backlog else min(30_000, n // 30)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox, jobs, jobs_queues RESTART IDENTITY"))
        conn.execute(text(_OUTBOX), {"n": n, "pending": pending})
        conn.execute(text(_JOBS), {"n": n, "queued": queued})
        conn.execute(
            text("INSERT INTO jobs_queues (queue, paused_at, paused_by) VALUES ('reports', now(), 'bench')")
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in ("outbox", "jobs", "jobs_queues"):
            conn.execute(text(f"VACUUM ANALYZE {table}"))
    return {"pending": pending, "queued": queued}


def pages(engine: Engine) -> dict[str, str]:
    """Every page of the dashboard, with ids and filters taken from the filled tables."""
    with engine.connect() as conn:
        dead = conn.execute(text("SELECT min(id) FROM outbox WHERE status = 'dead'")).scalar_one()
        failed = conn.execute(text("SELECT min(id) FROM jobs WHERE status = 'failed'")).scalar_one()
    return {
        "overview": "/",
        "dead letters": "/tables/outbox/dead",
        "dead letters, filtered": "/tables/outbox/dead?event_type=CustomerUpdated&error=503",
        "dead letters, next page": f"/tables/outbox/dead?after={dead + 10_000}",
        "bulk retry preview": "/tables/outbox/dead/preview?action=retry&error=positive",
        "dead letter": f"/tables/outbox/rows/{dead}",
        "blocked aggregates": "/tables/outbox/blocked",
        "jobs, queued": "/tables/jobs/jobs",
        "jobs, done, task filter": "/tables/jobs/jobs?status=done&task=send_sms",
        "jobs, failed": "/tables/jobs/jobs?status=failed",
        "failed jobs": "/tables/jobs/dead",
        "job": f"/tables/jobs/rows/{failed}",
        "bulk cancel preview": "/tables/jobs/jobs/preview?action=cancel&queue=mail",
        "queues": "/tables/jobs/queues",
        "doctor": "/doctor",
        "locks": "/locks",
    }


def _get(base: str, path: str, token: str) -> tuple[int, float]:
    """One GET over a new connection (as a browser's first request); (status, milliseconds)."""
    host, port = base.removeprefix("http://").split(":")
    t0 = time.perf_counter()
    conn = HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        reply = conn.getresponse()
        reply.read()
        return reply.status, (time.perf_counter() - t0) * 1000
    finally:
        conn.close()


def _serve(url: str, token: str) -> tuple[subprocess.Popen[bytes], str]:
    """``sa-outbox dashboard --actions`` in its own process, as an operator would run it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sa_outbox", "--log-level", "WARNING", "dashboard", "--url", url, "--port",
         str(port), "--actions"],
        env=dict(os.environ, SA_OUTBOX_DASHBOARD_TOKEN=token), stdout=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            _get(base, "/login", token)
            return proc, base
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the dashboard did not start within 60 s") from None
            time.sleep(0.2)


def time_pages(url: str, engine: Engine, runs: int) -> dict[str, list[list[float]]]:
    """Per page: for each run, the times of ``REQUESTS`` requests (after one warm-up request per page)."""
    token = secrets.token_urlsafe(24)
    proc, base = _serve(url, token)
    try:
        paths = pages(engine)
        times: dict[str, list[list[float]]] = {name: [] for name in paths}
        for path in paths.values():
            status, _ = _get(base, path, token)
            if status != 200:
                raise RuntimeError(f"{path} answered {status}")
        for _ in range(runs):
            for name, path in paths.items():
                times[name].append([_get(base, path, token)[1] for _ in range(REQUESTS)])
        return times
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def scenario_dashboard(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    n = cfg.dashboard_rows
    out = []
    for shape in ("steady", "backlog"):
        filled = fill(engine, n, backlog=shape == "backlog")
        for page, per_run in time_pages(url, engine, cfg.runs).items():
            medians = [statistics.median(r) for r in per_run]
            slowest = max(max(r) for r in per_run)
            out.append(row(
                f"dashboard: {page} ({n:,} rows per table, {shape})", summary(medians), unit="ms",
                target=f"< {TARGET_MS:.0f} ms", reference_name=f"slowest request {slowest:.0f} ms",
                requests=per_run, shape=shape, pending=filled["pending"], queued=filled["queued"],
            ))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.dashboard``: the scenario alone, on its own database (created and dropped)."""
    p = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=os.environ.get("DATABASE_URL"), help="the server (default: DATABASE_URL)")
    p.add_argument("--dashboard-rows", type=int, default=1_000_000, help="rows per table (default 1,000,000)")
    p.add_argument("--runs", type=int, default=3, help="rounds of requests per page (median, min–max)")
    cfg = p.parse_args(argv)
    if not cfg.url:
        p.error("give --url or set DATABASE_URL")
    from sa_outbox.models import Base

    name = "sa_outbox_dashboard_bench"
    admin = create_engine(make_url(cfg.url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        conn.execute(text(f"CREATE DATABASE {name}"))
    url = make_url(cfg.url).set(database=name).render_as_string(hide_password=False)
    engine = create_engine(url)
    try:
        Base.metadata.create_all(engine)
        print("\n".join(HEADER), flush=True)
        print("\n".join(render_rows(scenario_dashboard(url, engine, cfg))), flush=True)
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
