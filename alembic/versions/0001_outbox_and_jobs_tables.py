"""outbox and jobs tables (sa_outbox reference models)

Storage parameters (autovacuum) are not visible to autogenerate: they are set by the documented helper.

Revision ID: 0001
Revises:
Create Date: 2026-11-29 15:32:42.891512
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from sa_outbox.migration import set_queue_storage_parameters

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("queue", sa.Text(), server_default=sa.text("'default'"), nullable=False),
        sa.Column("task", sa.Text(), nullable=False),
        sa.Column("payload", postgresql.JSONB(none_as_null=True, astext_type=sa.Text()), nullable=False),
        sa.Column("status", sa.Text(), server_default=sa.text("'queued'"), nullable=False),
        sa.Column("priority", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("run_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("max_attempts", sa.Integer(), server_default=sa.text("3"), nullable=False),
        sa.Column("locked_by", sa.Text(), nullable=True),
        sa.Column("locked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_version", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("status IN ('queued', 'running', 'done', 'failed')", name=op.f("ck_jobs_status")),
        sa.CheckConstraint("attempts >= 0", name=op.f("ck_jobs_attempts")),
        sa.CheckConstraint("max_attempts >= 1", name=op.f("ck_jobs_max_attempts")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        info={"sa_outbox_kind": "jobs"},
    )
    op.create_index(
        op.f("ix_jobs_dequeue"),
        "jobs",
        ["queue", sa.literal_column("priority DESC"), "run_at", "id"],
        unique=False,
        postgresql_where=sa.text("status = 'queued'"),
    )
    op.create_index(
        op.f("ix_jobs_finished"),
        "jobs",
        ["finished_at"],
        unique=False,
        postgresql_where=sa.text("status = 'done'"),
    )
    op.create_index(
        op.f("ix_jobs_failed"), "jobs", ["id"], unique=False, postgresql_where=sa.text("status = 'failed'")
    )
    op.create_index(
        op.f("ix_jobs_running"),
        "jobs",
        ["locked_at"],
        unique=False,
        postgresql_where=sa.text("status = 'running'"),
    )
    op.create_table(
        "outbox",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("aggregate_type", sa.Text(), nullable=False),
        sa.Column("aggregate_id", sa.Text(), nullable=False),
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column("payload", postgresql.JSONB(none_as_null=True, astext_type=sa.Text()), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("status", sa.Text(), server_default=sa.text("'pending'"), nullable=False),
        sa.Column(
            "available_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("lease_owner", sa.Text(), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_version", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("done_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('pending', 'processing', 'done', 'dead')", name=op.f("ck_outbox_status")
        ),
        sa.CheckConstraint("attempts >= 0", name=op.f("ck_outbox_attempts")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox")),
        info={"sa_outbox_kind": "outbox"},
    )
    op.create_index(
        op.f("ix_outbox_aggregate"),
        "outbox",
        ["aggregate_id", "id"],
        unique=False,
        postgresql_where=sa.text("status IN ('pending', 'processing', 'dead')"),
    )
    op.create_index(
        op.f("ix_outbox_done"),
        "outbox",
        ["done_at"],
        unique=False,
        postgresql_where=sa.text("status = 'done'"),
    )
    op.create_index(
        op.f("ix_outbox_leased"),
        "outbox",
        ["lease_until"],
        unique=False,
        postgresql_where=sa.text("status = 'processing'"),
    )
    op.create_index(
        op.f("ix_outbox_ready"),
        "outbox",
        ["available_at", "id"],
        unique=False,
        postgresql_where=sa.text("status = 'pending'"),
    )
    set_queue_storage_parameters(op, "jobs")
    set_queue_storage_parameters(op, "outbox")


def downgrade() -> None:
    op.drop_index(
        op.f("ix_outbox_ready"), table_name="outbox", postgresql_where=sa.text("status = 'pending'")
    )
    op.drop_index(
        op.f("ix_outbox_leased"), table_name="outbox", postgresql_where=sa.text("status = 'processing'")
    )
    op.drop_index(op.f("ix_outbox_done"), table_name="outbox", postgresql_where=sa.text("status = 'done'"))
    op.drop_index(
        op.f("ix_outbox_aggregate"),
        table_name="outbox",
        postgresql_where=sa.text("status IN ('pending', 'processing', 'dead')"),
    )
    op.drop_table("outbox")
    op.drop_index(op.f("ix_jobs_running"), table_name="jobs", postgresql_where=sa.text("status = 'running'"))
    op.drop_index(op.f("ix_jobs_failed"), table_name="jobs", postgresql_where=sa.text("status = 'failed'"))
    op.drop_index(op.f("ix_jobs_finished"), table_name="jobs", postgresql_where=sa.text("status = 'done'"))
    op.drop_index(op.f("ix_jobs_dequeue"), table_name="jobs", postgresql_where=sa.text("status = 'queued'"))
    op.drop_table("jobs")
