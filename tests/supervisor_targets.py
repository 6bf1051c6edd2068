"""CLI targets for tests/test_supervisor.py: ones that fail the way real deployments fail."""

from __future__ import annotations

from sa_outbox import Worker


def crashing() -> Worker:
    """A factory that always raises (a bug in the application's start-up code, a missing secret, …)."""
    raise RuntimeError("this factory always fails (tests.supervisor_targets:crashing)")
