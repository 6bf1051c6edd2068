"""Publishers for real brokers, one module per broker, each behind its own optional extra.

Each maps its client's failures onto :class:`~sa_outbox.DestinationUnavailable` (the destination as a whole is
down: connection refused or lost, DNS failure, broker not ready), :class:`~sa_outbox.RetryableError` (this
message failed), :class:`~sa_outbox.PermanentError` and :class:`~sa_outbox.Defer`; bounds each ``publish`` and
``publish_many`` call by its ``timeout`` in total; reconnects after a loss; and carries the outbox id as the
broker's own de-duplication key where it has one.
"""
