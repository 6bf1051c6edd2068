"""Helpers for your own tests: a recording publisher and "dispatch until the outbox is drained"."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ._messages import Message

__all__ = ["RecordingPublisher", "drain"]


class RecordingPublisher:
    """An in-memory publisher that records every message it accepts (thread-safe).

    ``fail`` may be a callable returning an exception to raise for a message (or None to accept it), to
    script failures: ``RecordingPublisher(fail=lambda m: RetryableError("down") if m.attempts < 3 else None)``.
    """

    def __init__(self, fail: Callable[[Message], BaseException | None] | None = None) -> None:
        self._lock = threading.Lock()
        self._fail = fail
        self.messages: list[Message] = []
        self.calls = 0

    def publish(self, message: Message) -> None:
        with self._lock:
            self.calls += 1
        if self._fail is not None:
            error = self._fail(message)
            if error is not None:
                raise error
        with self._lock:
            self.messages.append(message)

    @property
    def ids(self) -> list[int]:
        with self._lock:
            return [m.id for m in self.messages]

    def by_event_type(self, event_type: str) -> list[Message]:
        with self._lock:
            return [m for m in self.messages if m.event_type == event_type]

    def clear(self) -> None:
        with self._lock:
            self.messages.clear()
            self.calls = 0


def drain(loop: Any, *, max_batches: int = 10_000) -> int:
    """Call ``loop.run_once()`` (a Dispatcher or a Worker) until a call claims nothing; returns rows claimed.

    Rows that are not yet due (backoff, Defer, run_at in the future) stay where they are.
    """
    total = 0
    for _ in range(max_batches):
        n = int(loop.run_once())
        if n == 0:
            return total
        total += n
    raise AssertionError(f"the queue did not drain within {max_batches} batches")
