"""outbox dead letters: a partial index on id for the dead rows (sa_outbox reference models)

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # On a big live table, build it first without blocking writes, and this step finds it and does nothing:
    #   CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_outbox_dead ON outbox (id) WHERE status = 'dead';
    # A concurrent build that failed or was cancelled leaves an INVALID index of that name behind: it is built
    # again here (IF NOT EXISTS alone kept it, unusable, at head).
    invalid = (
        op.get_bind()
        .execute(
            sa.text("SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass('ix_outbox_dead')")
        )
        .scalar()
    )
    if invalid:
        op.drop_index(op.f("ix_outbox_dead"), table_name="outbox")
    op.create_index(
        op.f("ix_outbox_dead"),
        "outbox",
        ["id"],
        unique=False,
        postgresql_where=sa.text("status = 'dead'"),
        if_not_exists=True,
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_outbox_dead"), table_name="outbox", postgresql_where=sa.text("status = 'dead'"))
