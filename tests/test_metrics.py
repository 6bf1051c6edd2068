"""The metrics endpoint serves the status gauges and the loop's counters and histograms, scraped over HTTP."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

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
            "CREATE TABLE IF NOT EXISTS deliveries (message_id bigint, pid int, at timestamptz DEFAULT clock_timestamp())"
        )  # (the shape tests/test_processes.py gives it: whichever module runs first creates it)
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


def _gauge(body: str, series: str) -> float:
    for line in body.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not in the scrape:\n{body}")


def test_worker_gauges_use_the_workers_stale_after_and_the_due_age(engine: Engine) -> None:
    from sqlalchemy import text

    from sa_outbox import Worker
    from sa_outbox.models import Job

    with engine.begin() as conn:
        conn.execute(  # a healthy long job for a fleet with stale_after=600, and a job scheduled for tomorrow
            text(
                "INSERT INTO jobs (task, queue, payload, status, attempts, lease_version, locked_by, locked_at) "
                "VALUES ('export', 'default', '{}', 'running', 1, 1, 'w', now() - interval '2 minutes');"
                "INSERT INTO jobs (task, queue, payload, created_at, run_at) "
                "VALUES ('report', 'default', '{}', now() - interval '2 days', now() + interval '1 day')"
            )
        )
    worker = Worker(engine, Job, {"export": lambda job: None}, stale_after=600, listen=False)
    port = _free_port()
    exporter = MetricsExporter(worker, status_interval=0).start(port, addr="127.0.0.1")
    try:
        body = _scrape(port)
    finally:
        exporter.stop()
        worker.close()
    labels = '{kind="jobs",table="jobs"}'
    assert _gauge(body, f"sa_outbox_expired_leases{labels}") == 0.0  # 2 minutes < the worker's 600 s
    assert _gauge(body, f"sa_outbox_oldest_pending_age_seconds{labels}") == 0.0  # nothing due is waiting
    assert _gauge(body, f"sa_outbox_oldest_unfinished_age_seconds{labels}") > 2 * 86400 - 60


def test_the_rows_gauge_says_when_it_is_an_estimate_and_follows_a_purge(engine: Engine) -> None:
    from sqlalchemy import text

    from sa_outbox.models import model_for
    from sa_outbox.monitoring import purge

    # A table of its own: its statistics see only this test's statements (no other test's pending counts).
    model = model_for("outbox", "outbox_estimate")
    model.__table__.create(engine)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO outbox_estimate (aggregate_type, aggregate_id, event_type, payload, status, done_at) "
                    "SELECT 'o', g::text, 'E', '{}', CASE WHEN g <= 2 THEN 'pending' ELSE 'done' END, "
                    "CASE WHEN g > 62 THEN now() - interval '1 day' WHEN g > 2 THEN now() - interval '10 days' END "
                    "FROM generate_series(1, 102) g"
                )
            )
            conn.execute(text("SELECT pg_stat_force_next_flush()"))  # counted before the commit returns
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE outbox_estimate"))  # reltuples 102, until the next ANALYZE/VACUUM

        def live_tuples() -> int:
            with engine.connect() as conn:
                return int(
                    conn.execute(
                        text("SELECT n_live_tup FROM pg_stat_user_tables WHERE relname = 'outbox_estimate'")
                    ).scalar_one()
                )

        d = Dispatcher(engine, model, RecordingPublisher(), listen=False)
        port = _free_port()
        exporter = MetricsExporter(d, status_interval=0, done_count_cap=10).start(port, addr="127.0.0.1")
        try:
            before = _scrape(port)
            assert purge(engine, model, older_than=5 * 86400) == 60  # the 60 oldest done rows
            deadline = time.monotonic() + 15  # the deleting session reports its counts within about 1 s
            while time.monotonic() < deadline and live_tuples() != 42:
                time.sleep(0.1)
            after = _scrape(port)
        finally:
            exporter.stop()
            d.close()
    finally:
        model.__table__.drop(engine)
    labels = '{kind="outbox",status="done",table="outbox_estimate"}'
    assert _gauge(before, f"sa_outbox_rows_estimated{labels}") == 1.0  # beyond the exact-count cap
    assert (
        _gauge(before, 'sa_outbox_rows_estimated{kind="outbox",status="pending",table="outbox_estimate"}')
        == 0
    )
    assert _gauge(before, f"sa_outbox_rows{labels}") == 100.0
    assert _gauge(after, f"sa_outbox_rows{labels}") == 40.0  # not the stale 100 of reltuples
    assert _gauge(after, 'sa_outbox_status_age_seconds{kind="outbox",table="outbox_estimate"}') < 60


def test_metrics_exporter_refuses_bad_options(engine: Engine) -> None:
    import pytest

    from sa_outbox.errors import ConfigurationError

    d = Dispatcher(engine, OutboxEvent, RecordingPublisher(), listen=False)
    try:
        with pytest.raises(ConfigurationError, match="status_interval must be >= 0"):
            MetricsExporter(d, status_interval=-1)
        with pytest.raises(ConfigurationError, match="stale_after must be > 0"):
            MetricsExporter(d, stale_after=0)
    finally:
        d.close()


# --- the circuit breaker's gauge (issue #19 §1) ----------------------------------------------------------

CIRCUIT = 'sa_outbox_circuit_open{kind="outbox",table="outbox"}'


def redis_dispatcher(engine: Engine | None = None, redis_url: str | None = None) -> Dispatcher:
    """A dispatcher publishing to a (private) Redis; with no argument a CLI target on ``DATABASE_URL`` and
    ``OUTAGE_REDIS_URL``."""
    from sqlalchemy import create_engine

    from sa_outbox import Backoff
    from sa_outbox.publishers.redis import RedisStreamPublisher

    publisher = RedisStreamPublisher(
        redis_url or os.environ["OUTAGE_REDIS_URL"], stream="metrics-outage", timeout=1
    )
    engine = engine or create_engine(os.environ["DATABASE_URL"])
    return Dispatcher(engine, OutboxEvent, publisher, max_attempts=3,
                      backoff=Backoff(0.01, 0.05), poll_interval=0.2, batch=5)  # fmt: skip


def _wait_scrape(port: int, series: str, value: float, timeout: float) -> str:
    """Scrape until ``series`` has ``value``; fails with the last page after ``timeout``."""
    body = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            body = _scrape(port)
            for line in body.splitlines():
                if line.startswith(series + " ") and float(line.rsplit(" ", 1)[1]) == value:
                    return body
        time.sleep(0.1)
    raise AssertionError(f"{series} never {value} within {timeout:g}s:\n{body[-3000:]}")


def test_circuit_open_gauge_is_one_while_the_broker_is_down(engine: Engine) -> None:
    import threading

    from .brokers import PrivateRedis

    server = PrivateRedis()
    server.start()
    d = redis_dispatcher(engine, server.url)
    port = _free_port()
    exporter = MetricsExporter(d, status_interval=0).start(port, addr="127.0.0.1")
    thread = threading.Thread(target=lambda: d.run(install_signal_handlers=False), daemon=True)
    thread.start()
    try:
        seed_events(engine, 3)
        closed_before = _wait_scrape(
            port, 'sa_outbox_rows{kind="outbox",status="done",table="outbox"}', 3, 30
        )
        server.stop()
        seed_events(engine, 3, start=3)
        _wait_scrape(port, CIRCUIT, 1.0, 30)
        server.start()
        after = _wait_scrape(port, CIRCUIT, 0.0, 60)
    finally:
        d.stop()
        thread.join(30)
        exporter.stop()
        d.close()
        server.close()
    assert _gauge(closed_before, CIRCUIT) == 0.0
    assert d.stats.dead == 0 and d.stats.done == 6 and not thread.is_alive()
    assert "sa_outbox_circuit_open" in after


def test_workers_have_no_circuit_gauge(engine: Engine) -> None:
    from sa_outbox import Worker
    from sa_outbox.models import Job

    worker = Worker(engine, Job, {"t": lambda job: None}, listen=False)
    port = _free_port()
    exporter = MetricsExporter(worker, status_interval=0).start(port, addr="127.0.0.1")
    try:
        body = _scrape(port)
    finally:
        exporter.stop()
        worker.close()
    assert "sa_outbox_rows" in body and "sa_outbox_circuit_open" not in body


def test_pool_circuit_gauge_is_or_ed_over_the_live_children(engine: Engine) -> None:
    """The supervisor's one endpoint: 1 while any child's circuit is open; a child that exits is forgotten."""
    from multiprocessing import Pipe

    from sa_outbox._poolmetrics import ChildReport, PoolMetrics
    from sa_outbox.publishers.redis import RedisStreamPublisher

    from .brokers import closed_port

    seed_events(engine, 2)
    down = Dispatcher(engine, OutboxEvent, RedisStreamPublisher(f"redis://127.0.0.1:{closed_port()}/0",
                      timeout=1), listen=False)  # fmt: skip
    up = Dispatcher(engine, OutboxEvent, RecordingPublisher(), listen=False)
    assert down.run_once() == 2 and down.circuit_open and not up.circuit_open  # both rows refunded
    pool = PoolMetrics("dispatch")
    port = _free_port()
    pool.start(port, addr="127.0.0.1")
    reports = []
    try:
        for slot, loop in enumerate((up, down)):
            parent, child = Pipe()
            report = ChildReport(loop, child, with_status=slot == 0)
            reports.append(report)
            report.close()  # sends one snapshot
            pool.update(slot, parent.recv())
        one_open = _scrape(port)
        pool.retire(1)
        none_open = _scrape(port)
    finally:
        pool.stop()
        down.close()
        up.close()
    assert _gauge(one_open, CIRCUIT) == 1.0
    assert (
        _gauge(one_open, 'sa_outbox_rows{kind="outbox",status="pending",table="outbox"}') == 2.0
    )  # child 0's
    assert _gauge(none_open, CIRCUIT) == 0.0


def test_cli_pool_serves_the_circuit_gauge_during_an_outage(engine: Engine, db_url: URL) -> None:
    from .brokers import PrivateRedis

    server = PrivateRedis()
    server.start()
    server.stop()  # down from the start: the children's first publish meets the outage
    port = _free_port()
    env = dict(
        os.environ, DATABASE_URL=db_url.render_as_string(hide_password=False), OUTAGE_REDIS_URL=server.url
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "sa_outbox", "dispatch", "tests.test_metrics:redis_dispatcher", "--processes", "2",
         "--metrics-port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        seed_events(engine, 4)
        during = _wait_scrape(port, CIRCUIT, 1.0, 60)
        server.start()
        after = _wait_scrape(port, 'sa_outbox_completed_total{kind="outbox",table="outbox"}', 4.0, 90)
        # every child's circuit closes, also one whose probe found the backlog delivered by the other child
        _wait_scrape(port, CIRCUIT, 0.0, 60)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
        server.close()
    assert proc.returncode == 0, out
    assert _gauge(during, 'sa_outbox_dead_total{kind="outbox",table="outbox"}') == 0.0
    assert _gauge(after, 'sa_outbox_dead_total{kind="outbox",table="outbox"}') == 0.0
    assert "destination unavailable: not claiming" in out, out
    # the child whose circuit opened closes it by its probe's delivery, or (when the other child, which never
    # met the outage, delivered the backlog first) because its probe found nothing left
    assert re.search(r"destination (considered )?available again", out), out


def test_an_async_loops_status_engine_keeps_its_engines_options_and_prepares_nothing(
    engine: Engine, async_url: URL
) -> None:
    """The exporter's sync engine for an async loop was made from the URL alone: a tenant's
    schema_translate_map was lost (its status read another schema's table), and behind PgBouncer its
    connections prepared statements the loop's engine had switched off (a review)."""
    import asyncio

    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    from sa_outbox import AsyncDispatcher

    tenant = engine.execution_options(schema_translate_map={None: "metrics_tenant"})
    with engine.begin() as conn:
        conn.execute(text("CREATE SCHEMA metrics_tenant"))
    try:
        OutboxEvent.__table__.create(tenant)
        with tenant.begin() as conn:
            conn.execute(OutboxEvent.__table__.insert(), [
                {"aggregate_type": "o", "aggregate_id": str(i), "event_type": "E", "payload": {}} for i in range(3)
            ])  # fmt: skip

        async def go() -> tuple[float, Any]:
            aengine = create_async_engine(async_url).execution_options(
                schema_translate_map={None: "metrics_tenant"}
            )
            d = AsyncDispatcher(aengine, OutboxEvent, RecordingPublisher(), listen=False)
            port = _free_port()
            exporter = MetricsExporter(d, status_interval=0).start(port, addr="127.0.0.1")
            try:
                body = await asyncio.to_thread(_scrape, port)
                with exporter._status_engine.connect() as conn:
                    threshold = conn.connection.driver_connection.prepare_threshold
                return _gauge(
                    body, 'sa_outbox_rows{kind="outbox",status="pending",table="outbox"}'
                ), threshold
            finally:
                exporter.stop()
                await d.close()
                await aengine.dispose()

        pending, threshold = asyncio.run(go())
        assert pending == 3.0  # the tenant's table (public's is empty)
        assert threshold is None
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP SCHEMA metrics_tenant CASCADE"))
