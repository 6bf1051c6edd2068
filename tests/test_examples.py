"""Every example runs against the real database (the same URL as the rest of the suite)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy.engine import URL

from .conftest import ROOT


def _run(example: str, url: URL, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DATABASE_URL=url.render_as_string(hide_password=False))
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / example)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_quickstart_example(db_url: URL) -> None:
    result = _run("quickstart.py", db_url)
    assert result.returncode == 0, result.stderr
    assert "published #1: order/1 OrderPaid" in result.stdout
    assert "job #1 send_receipt ran with {'order': 1}" in result.stdout


def test_ordered_events_example(db_url: URL) -> None:
    result = _run("ordered_events.py", db_url)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("in commit order: True") == 3


def test_jobs_worker_example(db_url: URL) -> None:
    result = _run("jobs_worker.py", db_url)
    assert result.returncode == 0, result.stderr
    assert "flaky_email: done after 3 attempts" in result.stdout
    assert "import_file: failed after 2 attempts" in result.stdout
    assert "requeued: [2]" in result.stdout and "imported orders.csv after the fix" in result.stdout


def test_publish_rabbitmq_example(db_url: URL) -> None:
    result = _run("publish_rabbitmq.py", db_url)
    assert result.returncode == 0, result.stderr
    assert [line.split()[1] for line in result.stdout.splitlines()] == [
        "message_id=1",
        "message_id=2",
        "message_id=3",
    ]


def test_publish_nats_example(db_url: URL) -> None:
    result = _run("publish_nats.py", db_url)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [w for n in (1, 2, 3) for w in ("exorders.paid", f"Nats-Msg-Id={n}")]


def test_webapp_async_example(db_url: URL) -> None:
    result = _run("webapp_async.py", db_url)
    assert result.returncode == 0, result.stderr
    assert "POST /orders -> 201" in result.stdout
    assert "broker got message_id=1: OrderCreated {'item': 'book'}" in result.stdout
    assert "broker got message_id=2: OrderCreated {'item': 'lamp'}" in result.stdout


def test_examples_are_all_tested() -> None:
    tested = {line.split('"')[1] for line in Path(__file__).read_text().splitlines() if '_run("' in line}
    assert {p.name for p in (ROOT / "examples").glob("*.py")} <= tested
