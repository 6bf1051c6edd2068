"""The metrics endpoint serves the status gauges and the loop's counters and histograms, scraped over HTTP."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request

from sqlalchemy import Engine
from sqlalchemy.engine import URL

from sa_outbox import Dispatcher
from sa_outbox.metrics import MetricsExporter
from sa_outbox.models import OutboxEvent
from sa_outbox.testing import RecordingPublisher, drain

from .conftest import ROOT
from .helpers import seed_events


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def test_metrics_endpoint_serves_the_listed_series(engine: Engine) -> None:
    seed_events(engine, 7)
    d = Dispatcher(engine, OutboxEvent, RecordingPublisher(), listen=False, batch=5)
    port = _free_port()
    exporter = MetricsExporter(d, status_interval=0).start(port, addr="127.0.0.1")
    try:
        drain(d)
        body = _scrape(port)
    finally:
        exporter.stop()
    assert 'sa_outbox_claimed_total{kind="outbox",table="outbox"} 7.0' in body
    assert 'sa_outbox_completed_total{kind="outbox",table="outbox"} 7.0' in body
    for series in ("sa_outbox_retried_total", "sa_outbox_deferred_total", "sa_outbox_dead_total",
                   "sa_outbox_lost_leases_total", "sa_outbox_claim_seconds_bucket", "sa_outbox_handle_seconds_count",
                   "sa_outbox_age_at_handle_seconds_bucket", "sa_outbox_oldest_pending_age_seconds",
                   "sa_outbox_expired_leases"):  # fmt: skip
        assert series in body, series
    assert 'sa_outbox_rows{kind="outbox",status="done",table="outbox"} 7.0' in body
    assert 'sa_outbox_handle_seconds_count{kind="outbox",table="outbox"} 7.0' in body


def test_cli_metrics_port_while_a_dispatcher_runs(engine: Engine, db_url: URL) -> None:
    seed_events(engine, 3)
    port = _free_port()
    env = dict(os.environ, DATABASE_URL=db_url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE IF NOT EXISTS deliveries (message_id bigint, pid int, at timestamptz)"
        )
    proc = subprocess.Popen(
        [sys.executable, "-m", "sa_outbox", "dispatch", "tests.targets:dispatcher", "--metrics-port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        body = ""
        deadline = time.monotonic() + 30
        while (
            time.monotonic() < deadline
            and 'sa_outbox_completed_total{kind="outbox",table="outbox"} 3.0' not in body
        ):
            with contextlib.suppress(OSError):
                body = _scrape(port)
            time.sleep(0.2)
        assert 'sa_outbox_completed_total{kind="outbox",table="outbox"} 3.0' in body
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_async_loops_feed_the_same_histograms(engine: Engine, async_url: URL) -> None:
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from sa_outbox import AsyncDispatcher

    seed_events(engine, 4)

    async def go() -> str:
        aengine = create_async_engine(async_url)
        d = AsyncDispatcher(aengine, OutboxEvent, RecordingPublisher(), listen=False)
        port = _free_port()
        exporter = MetricsExporter(d, status_interval=0).start(port, addr="127.0.0.1")
        try:
            await d.run_once()
            return await asyncio.to_thread(_scrape, port)
        finally:
            exporter.stop()
            await d.close()
            await aengine.dispose()

    body = asyncio.run(go())
    assert 'sa_outbox_handle_seconds_count{kind="outbox",table="outbox"} 4.0' in body
    assert 'sa_outbox_claim_seconds_count{kind="outbox",table="outbox"} 1.0' in body
    assert 'sa_outbox_rows{kind="outbox",status="done",table="outbox"} 4.0' in body  # status gauges too
