"""inbox table (sa_outbox reference model)

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "inbox",
        sa.Column("consumer", sa.Text(), nullable=False),
        sa.Column("message_id", sa.Text(), nullable=False),
        sa.Column("source", sa.Text(), nullable=True),
        sa.Column("event_type", sa.Text(), nullable=True),
        sa.Column("aggregate", sa.Text(), nullable=True),
        sa.Column("position", sa.BigInteger(), nullable=True),
        sa.Column("received_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("consumer", "message_id", name=op.f("pk_inbox")),
    )
    op.create_index(
        op.f("ix_inbox_position"),
        "inbox",
        ["consumer", "aggregate", "position"],
        unique=False,
        postgresql_where=sa.text("aggregate IS NOT NULL"),
    )
    op.create_index(op.f("ix_inbox_received"), "inbox", ["received_at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_inbox_received"), table_name="inbox")
    op.drop_index(
        op.f("ix_inbox_position"), table_name="inbox", postgresql_where=sa.text("aggregate IS NOT NULL")
    )
    op.drop_table("inbox")
