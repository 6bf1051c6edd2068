"""Names shared by the producer and the loops without either importing the other."""

from __future__ import annotations

__all__ = ["RESERVED_ID_PREFIX", "channel_for"]

#: Message ids starting with this are the library's own: the inbox keeps its aggregates' heads under
#: ``sa_outbox:head:<aggregate>``, so no message may take such an id (nor a dispatcher's ``message_id_prefix``).
RESERVED_ID_PREFIX = "sa_outbox:"


def channel_for(table_name: str) -> str:
    """The NOTIFY channel of an outbox/jobs table (the payload is '' for outbox, the queue name for jobs).

    PostgreSQL truncates identifiers to 63 bytes; the channel is cut the same way so producer and listener
    agree on it."""
    return f"sa_outbox.{table_name}"[:63]
