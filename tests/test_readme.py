"""README's code and commands are exercised: Python blocks run, sa-outbox command lines parse and run."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL

from sa_outbox._cli import build_parser, main

from .conftest import ROOT

README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    """Fenced blocks whose info string is exactly ``lang`` ('' for plain fences)."""
    blocks, current, inside = [], [], None
    for line in README.splitlines():
        if line.startswith("```"):
            if inside is None:
                inside, current = line[3:].strip(), []
            else:
                if inside == lang:
                    blocks.append("\n".join(current) + "\n")
                inside = None
        elif inside is not None:
            current.append(line)
    return blocks


def test_python_blocks_run(db_url: URL, tmp_path: Path) -> None:
    env = dict(os.environ, DATABASE_URL=db_url.render_as_string(hide_password=False))
    outputs = []
    for i, block in enumerate(_blocks("python")):
        if block.startswith("# (inside an alembic revision)"):
            compile(block, "README.md", "exec")  # exercised for real by the migration tests
            continue
        script = tmp_path / f"readme_{i}.py"
        script.write_text(block)
        result = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    assert outputs
    assert "published 1 OrderPaid" in outputs[0] and "receipt for order 1" in outputs[0]


def test_the_two_commands_are_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in ci
    assert "pip install -q -e '.[demo]'" in README and "sa-outbox demo" in README


def _command_lines() -> list[list[str]]:
    lines = []
    for block in _blocks(""):
        for line in block.splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("sa-outbox "):
                lines.append(shlex.split(line)[1:])
    return lines


def test_every_sa_outbox_command_in_readme_parses_and_reporting_ones_run(
    engine: Any, db_url: URL, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = _command_lines()
    assert len(lines) >= 10
    parser = build_parser()
    url = db_url.render_as_string(hide_password=False)
    ran = 0
    for argv in lines:
        parser.parse_args(argv)
        if argv[0] in ("status", "check", "purge") or argv[:2] == ["dead", "list"] or "--dry-run" in argv:
            assert main([*argv, "--url", url]) == 0, argv
            ran += 1
    assert ran >= 6
