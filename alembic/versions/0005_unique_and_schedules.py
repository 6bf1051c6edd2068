"""unique jobs and cron schedules: the jobs' unique_key with its two partial indexes, and the schedules table
(sa_outbox reference models)

``unique_key`` is a nullable text column: existing rows keep NULL (no rewrite) and hold no key; adding it
takes an ACCESS EXCLUSIVE lock for a moment (reads and writes wait for it, and it waits for every running
transaction on the table). Both indexes are partial on ``unique_key IS NOT NULL``, so they start empty; building
them still reads the jobs table once under a SHARE lock (writes wait meanwhile, reads do not). They cannot be
built beforehand (the column comes with this revision); on a very large jobs table, run the revision at a
quiet time, or add the column yourself first (``ALTER TABLE jobs ADD COLUMN unique_key text``), build both
indexes with ``CREATE INDEX CONCURRENTLY`` under the same names and predicates, and then run it: it adds the
column and creates the indexes only if they do not exist.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The predicates of sa_outbox._enqueue.UNIQUE_WAITING / UNIQUE_ACTIVE, written out: a revision must not change
# when the library does.
UNIQUE_WAITING = "status = 'queued' AND lease_version = 0 AND unique_key IS NOT NULL"
UNIQUE_ACTIVE = "status IN ('queued', 'running') AND unique_key IS NOT NULL"


def upgrade() -> None:
    # (IF NOT EXISTS: the column may have been added by hand to build the indexes concurrently, see above)
    op.execute("ALTER TABLE jobs ADD COLUMN IF NOT EXISTS unique_key text")
    op.create_index(
        op.f("ux_jobs_unique"),
        "jobs",
        ["unique_key"],
        unique=True,
        postgresql_where=sa.text(UNIQUE_WAITING),
        if_not_exists=True,
    )
    op.create_index(
        op.f("ix_jobs_unique_active"),
        "jobs",
        ["unique_key", "status", "id"],
        unique=False,
        postgresql_where=sa.text(UNIQUE_ACTIVE),
        if_not_exists=True,
    )
    op.create_table(
        "schedules",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("cron", sa.Text(), nullable=False),
        sa.Column("timezone", sa.Text(), server_default=sa.text("'UTC'"), nullable=False),
        sa.Column("task", sa.Text(), nullable=False),
        sa.Column(
            "payload",
            postgresql.JSONB(none_as_null=True, astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("queue", sa.Text(), server_default=sa.text("'default'"), nullable=False),
        sa.Column("priority", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=True),
        sa.Column("catch_up", sa.Text(), server_default=sa.text("'latest'"), nullable=False),
        sa.Column("paused", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("next_run_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_run_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("catch_up IN ('latest', 'all', 'none')", name=op.f("ck_schedules_catch_up")),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_schedules")),
        info={"sa_outbox_kind": "schedules"},
    )
    op.create_index(
        op.f("ix_schedules_due"),
        "schedules",
        ["next_run_at"],
        unique=False,
        postgresql_where=sa.text("NOT paused"),
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_schedules_due"), table_name="schedules", postgresql_where=sa.text("NOT paused"))
    op.drop_table("schedules")
    op.drop_index(op.f("ix_jobs_unique_active"), table_name="jobs", postgresql_where=sa.text(UNIQUE_ACTIVE))
    op.drop_index(op.f("ux_jobs_unique"), table_name="jobs", postgresql_where=sa.text(UNIQUE_WAITING))
    op.drop_column("jobs", "unique_key")
