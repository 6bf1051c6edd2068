"""headers column on the outbox and jobs tables

A nullable ``jsonb``: existing rows keep NULL (no table rewrite, no default to backfill), and the claim
statements read it back as an empty mapping. One table at a time (``commit_between_tables``): a service that
writes an event and a job in one transaction holds one table while it waits for the other, so an upgrade that
held ``outbox`` while waiting for ``jobs`` deadlocked with it.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from sa_outbox.migration import commit_between_tables

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # a table per transaction, each step harmless to run twice: a retry after a lock timeout starts from the top
    op.execute("ALTER TABLE outbox ADD COLUMN IF NOT EXISTS headers jsonb")
    commit_between_tables(op)
    op.execute("ALTER TABLE jobs ADD COLUMN IF NOT EXISTS headers jsonb")


def downgrade() -> None:
    op.execute("ALTER TABLE jobs DROP COLUMN IF EXISTS headers")
    commit_between_tables(op)
    op.execute("ALTER TABLE outbox DROP COLUMN IF EXISTS headers")
