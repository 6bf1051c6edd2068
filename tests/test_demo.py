"""The demo runs end to end on the real database and its verdict holds; it leaves nothing behind."""

from __future__ import annotations

from sqlalchemy import Engine, text
from sqlalchemy.engine import URL

from sa_outbox._demo import run_demo


def test_demo_verdict_holds_and_cleans_up(engine: Engine, db_url: URL) -> None:
    assert run_demo(db_url.render_as_string(hide_password=False), quiet=True) is True
    with engine.connect() as conn:
        schemas = conn.execute(
            text("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'sa_outbox_demo_%'")
        ).all()
    assert schemas == []
