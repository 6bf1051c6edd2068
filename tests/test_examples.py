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


def test_examples_are_all_tested() -> None:
    tested = {line.split('"')[1] for line in Path(__file__).read_text().splitlines() if '_run("' in line}
    assert {p.name for p in (ROOT / "examples").glob("*.py")} <= tested
