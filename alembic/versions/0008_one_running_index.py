"""jobs: one partial index over running jobs, (queue, concurrency_key, locked_at), instead of ix_jobs_running
on (locked_at) and ix_jobs_limited on (queue, concurrency_key) — each claim writes one index entry per job
instead of two (sa_outbox reference models)

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RUNNING = sa.text("status = 'running'")


def upgrade() -> None:
    # Built under a temporary name first, so the reaper and limited claims always have an index to read. On a
    # big live (plain, not partitioned) table, build it without blocking writes beforehand and this step finds it:
    #   CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_jobs_running_0008 ON jobs (queue, concurrency_key, locked_at)
    #     WHERE status = 'running';
    # A concurrent build that failed or was cancelled leaves an INVALID index of that name behind: it is built
    # again here, never renamed into place (the old indexes would be gone and the new one unusable).
    invalid = (
        op.get_bind()
        .execute(
            sa.text(
                "SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass('ix_jobs_running_0008')"
            )
        )
        .scalar()
    )
    if invalid:
        op.drop_index(op.f("ix_jobs_running_0008"), table_name="jobs")
    op.create_index(
        op.f("ix_jobs_running_0008"),
        "jobs",
        ["queue", "concurrency_key", "locked_at"],
        unique=False,
        postgresql_where=RUNNING,
        if_not_exists=True,
    )
    op.drop_index(op.f("ix_jobs_limited"), table_name="jobs", postgresql_where=RUNNING)
    op.drop_index(op.f("ix_jobs_running"), table_name="jobs", postgresql_where=RUNNING)
    op.execute("ALTER INDEX ix_jobs_running_0008 RENAME TO ix_jobs_running")


def downgrade() -> None:
    op.create_index(
        op.f("ix_jobs_running_0008"), "jobs", ["locked_at"], unique=False, postgresql_where=RUNNING
    )
    op.create_index(
        op.f("ix_jobs_limited"), "jobs", ["queue", "concurrency_key"], unique=False, postgresql_where=RUNNING
    )
    op.drop_index(op.f("ix_jobs_running"), table_name="jobs", postgresql_where=RUNNING)
    op.execute("ALTER INDEX ix_jobs_running_0008 RENAME TO ix_jobs_running")
