"""jobs a team can control: the cancelled status, cancel requests, stored results, outage-proof default
attempts, and the queue table that holds paused queues (sa_outbox reference models)

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "jobs", sa.Column("result", postgresql.JSONB(none_as_null=True, astext_type=sa.Text()), nullable=True)
    )
    op.alter_column("jobs", "max_attempts", server_default=sa.text("10"))
    op.drop_constraint(op.f("ck_jobs_status"), "jobs", type_="check")
    op.create_check_constraint(
        op.f("ck_jobs_status"), "jobs", "status IN ('queued', 'running', 'done', 'failed', 'cancelled')"
    )
    op.drop_index(op.f("ix_jobs_finished"), table_name="jobs", postgresql_where=sa.text("status = 'done'"))
    op.create_index(
        op.f("ix_jobs_finished"),
        "jobs",
        ["finished_at"],
        unique=False,
        postgresql_where=sa.text("status IN ('done', 'cancelled')"),
    )
    op.create_table(
        "jobs_queues",
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("paused_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("paused_by", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("queue", name=op.f("pk_jobs_queues")),
        info={"sa_outbox_kind": "queues", "sa_outbox_jobs": "jobs"},
    )


def downgrade() -> None:
    op.drop_table("jobs_queues")
    op.drop_index(
        op.f("ix_jobs_finished"),
        table_name="jobs",
        postgresql_where=sa.text("status IN ('done', 'cancelled')"),
    )
    op.create_index(
        op.f("ix_jobs_finished"),
        "jobs",
        ["finished_at"],
        unique=False,
        postgresql_where=sa.text("status = 'done'"),
    )
    # The old schema has no 'cancelled': a cancelled job was given up by a person, the closest is failed.
    op.execute(sa.text("UPDATE jobs SET status = 'failed' WHERE status = 'cancelled'"))
    op.drop_constraint(op.f("ck_jobs_status"), "jobs", type_="check")
    op.create_check_constraint(
        op.f("ck_jobs_status"), "jobs", "status IN ('queued', 'running', 'done', 'failed')"
    )
    op.alter_column("jobs", "max_attempts", server_default=sa.text("3"))
    op.drop_column("jobs", "result")
    op.drop_column("jobs", "cancel_requested_at")
