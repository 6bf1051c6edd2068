"""The tables the mixins create, read back from the catalog (not from the metadata)."""

from __future__ import annotations

from sqlalchemy import Engine, text


def _columns(engine: Engine, table: str) -> dict[str, tuple[str, str, str | None]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT column_name, data_type, is_nullable, column_default, is_identity, identity_generation "
                "FROM information_schema.columns WHERE table_name = :t AND table_schema = 'public'"
            ),
            {"t": table},
        ).all()
    return {r[0]: (r[1], r[2], r[3] or (f"identity {r[5]}" if r[4] == "YES" else None)) for r in rows}


def _indexes(engine: Engine, table: str) -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = :t"), {"t": table}
        )
        return {r[0]: r[1] for r in rows}


def _checks(engine: Engine, table: str) -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                "WHERE conrelid = CAST(:t AS regclass) AND contype = 'c'"
            ),
            {"t": table},
        )
        return {r[0]: r[1] for r in rows}


def test_outbox_columns_match_the_document(engine: Engine) -> None:
    cols = _columns(engine, "outbox")
    assert cols == {
        "id": ("bigint", "NO", "identity ALWAYS"),
        "aggregate_type": ("text", "NO", None),
        "aggregate_id": ("text", "NO", None),
        "event_type": ("text", "NO", None),
        "payload": ("jsonb", "NO", None),
        "created_at": ("timestamp with time zone", "NO", "now()"),
        "status": ("text", "NO", "'pending'::text"),
        "available_at": ("timestamp with time zone", "NO", "now()"),
        "attempts": ("integer", "NO", "0"),
        "lease_owner": ("text", "YES", None),
        "lease_until": ("timestamp with time zone", "YES", None),
        "lease_version": ("bigint", "NO", "0"),
        "last_error": ("text", "YES", None),
        "done_at": ("timestamp with time zone", "YES", None),
        "headers": ("jsonb", "YES", None),
    }


def test_outbox_status_check_and_partial_indexes(engine: Engine) -> None:
    checks = _checks(engine, "outbox")
    assert "pending" in checks["ck_outbox_status"] and "dead" in checks["ck_outbox_status"]
    for s in ("pending", "processing", "done", "dead"):
        assert f"'{s}'" in checks["ck_outbox_status"]
    idx = _indexes(engine, "outbox")
    assert idx["ix_outbox_ready"].endswith("(available_at, id) WHERE (status = 'pending'::text)")
    assert idx["ix_outbox_leased"].endswith("(lease_until) WHERE (status = 'processing'::text)")
    assert (
        "(aggregate_id, id) WHERE (status = ANY (ARRAY['pending'::text, 'processing'::text, 'dead'::text]))"
        in (idx["ix_outbox_aggregate"])
    )
    assert "pk_outbox" in idx


def test_jobs_columns_match_the_document_plus_task_and_fencing(engine: Engine) -> None:
    cols = _columns(engine, "jobs")
    assert cols == {
        "id": ("bigint", "NO", "identity ALWAYS"),
        "queue": ("text", "NO", "'default'::text"),
        "task": ("text", "NO", None),
        "payload": ("jsonb", "NO", None),
        "status": ("text", "NO", "'queued'::text"),
        "priority": ("integer", "NO", "0"),
        "run_at": ("timestamp with time zone", "NO", "now()"),
        "attempts": ("integer", "NO", "0"),
        "max_attempts": ("integer", "NO", "10"),
        "locked_by": ("text", "YES", None),
        "locked_at": ("timestamp with time zone", "YES", None),
        "lease_version": ("bigint", "NO", "0"),
        "last_error": ("text", "YES", None),
        "created_at": ("timestamp with time zone", "NO", "now()"),
        "finished_at": ("timestamp with time zone", "YES", None),
        "headers": ("jsonb", "YES", None),
        "cancel_requested_at": ("timestamp with time zone", "YES", None),
        "result": ("jsonb", "YES", None),
        "concurrency_key": ("text", "NO", "''::text"),
        "unique_key": ("text", "YES", None),
    }


def test_jobs_status_check_and_partial_indexes(engine: Engine) -> None:
    checks = _checks(engine, "jobs")
    for s in ("queued", "running", "done", "failed", "cancelled"):
        assert f"'{s}'" in checks["ck_jobs_status"]
    idx = _indexes(engine, "jobs")
    assert idx["ix_jobs_dequeue"].endswith(
        "(queue, priority DESC, run_at, id) WHERE (status = 'queued'::text)"
    )
    assert idx["ix_jobs_running"].endswith(
        "(queue, concurrency_key, locked_at) WHERE (status = 'running'::text)"
    )
    assert "ix_jobs_limited" not in idx  # one index over running jobs (alembic 0008)
    assert idx["ux_jobs_unique"].startswith("CREATE UNIQUE INDEX")
    assert idx["ux_jobs_unique"].endswith(
        "(unique_key) WHERE ((status = 'queued'::text) AND (lease_version = 0) AND (unique_key IS NOT NULL))"
    )
    assert idx["ix_jobs_unique_active"].endswith(
        "(unique_key, status, id) WHERE ((status = ANY (ARRAY['queued'::text, 'running'::text])) AND (unique_key IS NOT NULL))"
    )


def test_schedules_columns_check_and_due_index(engine: Engine) -> None:
    assert _columns(engine, "schedules") == {
        "name": ("text", "NO", None),
        "cron": ("text", "NO", None),
        "timezone": ("text", "NO", "'UTC'::text"),
        "task": ("text", "NO", None),
        "payload": ("jsonb", "NO", "'{}'::jsonb"),
        "queue": ("text", "NO", "'default'::text"),
        "priority": ("integer", "NO", "0"),
        "max_attempts": ("integer", "YES", None),
        "catch_up": ("text", "NO", "'latest'::text"),
        "paused": ("boolean", "NO", "false"),
        "next_run_at": ("timestamp with time zone", "NO", None),
        "last_run_at": ("timestamp with time zone", "YES", None),
        "created_at": ("timestamp with time zone", "NO", "now()"),
        "updated_at": ("timestamp with time zone", "NO", "now()"),
    }
    assert _checks(engine, "schedules") == {
        "ck_schedules_catch_up": "CHECK ((catch_up = ANY (ARRAY['latest'::text, 'all'::text, 'none'::text])))"
    }
    idx = _indexes(engine, "schedules")
    assert idx["ix_schedules_due"].endswith("(next_run_at) WHERE (NOT paused)") and "pk_schedules" in idx


def test_status_check_rejects_unknown_status(engine: Engine) -> None:
    import pytest
    from sqlalchemy.exc import IntegrityError

    with pytest.raises(IntegrityError, match="ck_outbox_status"), engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status) "
                "VALUES ('a', '1', 'e', '{}', 'bogus')"
            )
        )


def test_queue_tables_have_autovacuum_storage_parameters(engine: Engine) -> None:
    with engine.connect() as conn:
        rows = dict(
            conn.execute(
                text("SELECT relname, reloptions FROM pg_class WHERE relname IN ('outbox', 'jobs')")
            ).all()
        )
    for table in ("outbox", "jobs"):
        assert "autovacuum_vacuum_scale_factor=0.01" in rows[table]
