"""limits: concurrency keys, the running-jobs index limited claims count through, and the starts log of
rate-limited queues (sa_outbox reference models)

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "jobs", sa.Column("concurrency_key", sa.Text(), server_default=sa.text("''"), nullable=False)
    )
    op.create_index(
        op.f("ix_jobs_limited"),
        "jobs",
        ["queue", "concurrency_key"],
        unique=False,
        postgresql_where=sa.text("status = 'running'"),
    )
    op.create_table(
        "jobs_starts",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs_starts")),
        info={"sa_outbox_kind": "starts", "sa_outbox_jobs": "jobs"},
    )
    op.create_index(op.f("ix_jobs_starts_window"), "jobs_starts", ["queue", "key", "at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_jobs_starts_window"), table_name="jobs_starts")
    op.drop_table("jobs_starts")
    op.drop_index(op.f("ix_jobs_limited"), table_name="jobs", postgresql_where=sa.text("status = 'running'"))
    op.drop_column("jobs", "concurrency_key")
