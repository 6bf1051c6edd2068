"""Publishers for real brokers, one module per broker, each behind its own optional extra.

Each maps its client's failures onto :class:`~sa_outbox.RetryableError` / :class:`~sa_outbox.PermanentError` /
:class:`~sa_outbox.Defer` and carries the outbox id as the broker's own de-duplication key where it has one.
"""
