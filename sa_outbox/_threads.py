"""Threads for blocking handlers and publishers that a stuck call cannot take down.

A ``ThreadPoolExecutor`` thread whose call hangs keeps its place in the pool: the calls queued behind it wait
for it, time out without running and run late, outside any lease. :class:`CallThreads` instead gives each call
to an idle thread (starting one when none is idle); a call that overran its time is *abandoned* — its thread is
never given another call and exits when the call finally returns — so the calls after it always find a thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["CallThreads"]


class _CallThread(threading.Thread):
    def __init__(self, pool: CallThreads, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.pool = pool
        self.inbox: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self.abandoned = False

    def run(self) -> None:
        while True:
            item = self.inbox.get()
            if item is None:
                return
            fn, args, future = item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:  # SystemExit/KeyboardInterrupt too: the caller decides
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            if not self.pool.call_done(self, future):
                return


class CallThreads:
    """Runs blocking calls on threads of their own; see the module docs. The caller bounds how many calls are
    in flight (a worker's ``concurrency``); :meth:`abandon` retires the thread of a call that overran."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._idle: list[_CallThread] = []
        self._busy: dict[Future[Any], _CallThread] = {}
        self._started = 0
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            self._closed = False
            thread = self._idle.pop() if self._idle else None
            if thread is None:
                self._started += 1
                thread = _CallThread(self, f"{self._name}-{self._started}")
                thread.start()
            self._busy[future] = thread
        thread.inbox.put((fn, args, future))
        return future

    def abandon(self, future: Future[Any]) -> None:
        """The call of ``future`` overran: its thread takes no further call (it exits once the call returns)."""
        with self._lock:
            thread = self._busy.pop(future, None)
            if thread is not None:
                thread.abandoned = True

    def call_done(self, thread: _CallThread, future: Future[Any]) -> bool:
        """Called by a thread after its call; True when it goes back to the idle list."""
        with self._lock:
            self._busy.pop(future, None)
            if thread.abandoned or self._closed:
                return False
            self._idle.append(thread)
            return True

    @property
    def started(self) -> int:
        """Threads started so far (a stuck call costs one more)."""
        return self._started

    def close(self) -> None:
        """Let idle threads exit; busy and abandoned ones exit when their call returns (they are daemons)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for thread in idle:
            thread.inbox.put(None)
