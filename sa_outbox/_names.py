"""Names shared by the producer and the loops without either importing the other."""

from __future__ import annotations

__all__ = ["channel_for"]


def channel_for(table_name: str) -> str:
    """The NOTIFY channel of an outbox/jobs table (the payload is '' for outbox, the queue name for jobs).

    PostgreSQL truncates identifiers to 63 bytes; the channel is cut the same way so producer and listener
    agree on it."""
    return f"sa_outbox.{table_name}"[:63]
