"""headers column on the outbox and jobs tables

A nullable ``jsonb``: existing rows keep NULL (no table rewrite, no default to backfill), and the claim
statements read it back as an empty mapping.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for table in ("outbox", "jobs"):
        op.add_column(
            table,
            sa.Column("headers", postgresql.JSONB(none_as_null=True, astext_type=sa.Text()), nullable=True),
        )


def downgrade() -> None:
    for table in ("jobs", "outbox"):
        op.drop_column(table, "headers")
