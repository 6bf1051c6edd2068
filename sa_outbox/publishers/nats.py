"""NATS JetStream publisher (extra ``nats``, nats-py).

Each message is published with the ``Nats-Msg-Id`` header set to the outbox id, so the stream's duplicate
window drops a re-publish after a lost lease (the second publish is acknowledged as a duplicate and the
stream keeps one copy). The subject comes from the event (default ``<prefix>.<event_type>``). Timeouts, no
responders (no stream bound to the subject yet) and connection failures are :class:`~sa_outbox.RetryableError`.

:class:`AsyncNatsPublisher` is for :class:`~sa_outbox.AsyncDispatcher`; ``publish_many`` awaits the acks of
a whole batch together. :class:`NatsPublisher` is the same for the sync :class:`~sa_outbox.Dispatcher`: it
runs the async client on a private event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .._messages import Message
from ..errors import RetryableError
from ._common import envelope, headers_for, missing_extra

try:
    import nats
    from nats import errors as nerr
    from nats.js import errors as jserr
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    missing_extra("nats", exc)

__all__ = ["AsyncNatsPublisher", "NatsPublisher"]


class AsyncNatsPublisher:
    """``AsyncNatsPublisher("nats://127.0.0.1:4222", subject_prefix="orders")``."""

    def __init__(
        self,
        url: str = "nats://127.0.0.1:4222",
        *,
        subject: Callable[[Message], str] | None = None,
        subject_prefix: str = "outbox",
        timeout: float = 5.0,
    ) -> None:
        self.url = url
        self.subject = subject or (lambda m: f"{subject_prefix}.{m.event_type}")
        self.timeout = timeout
        self._nc: Any = None
        self._js: Any = None

    async def _ensure(self) -> Any:
        if self._nc is None or self._nc.is_closed:

            async def quiet(exc: Exception) -> None:  # errors surface as RetryableError, not stderr noise
                return None

            try:
                self._nc = await asyncio.wait_for(
                    nats.connect(
                        self.url, connect_timeout=self.timeout, max_reconnect_attempts=0, allow_reconnect=False,
                        error_cb=quiet,
                    ),
                    self.timeout,
                )  # fmt: skip
            except (nerr.NoServersError, nerr.Error, OSError, TimeoutError) as exc:
                self._nc = None
                raise RetryableError(f"nats unavailable at {self.url}: {exc!r}") from exc
            self._js = self._nc.jetstream(timeout=self.timeout)
        return self._js

    async def _publish(self, js: Any, message: Message) -> None:
        headers = {
            "Nats-Msg-Id": message.message_id,
            **{f"Outbox-{k.title()}": v for k, v in headers_for(message).items()},
        }
        body = json.dumps(envelope(message), separators=(",", ":")).encode()
        try:
            await js.publish(self.subject(message), body, timeout=self.timeout, headers=headers)
        except (nerr.TimeoutError, nerr.NoRespondersError, jserr.NoStreamResponseError) as exc:
            raise RetryableError(f"nats publish not acknowledged: {type(exc).__name__}") from exc
        except (nerr.ConnectionClosedError, nerr.StaleConnectionError, nerr.OutboundBufferLimitError) as exc:
            await self.close()
            raise RetryableError(f"nats connection lost: {type(exc).__name__}") from exc
        except jserr.APIError as exc:
            raise RetryableError(f"jetstream refused the message: {exc}") from exc

    async def publish(self, message: Message) -> None:
        await self._publish(await self._ensure(), message)

    async def publish_many(self, messages: Sequence[Message]) -> list[BaseException | None]:
        try:
            js = await self._ensure()
        except RetryableError as exc:
            return [exc] * len(messages)
        results = await asyncio.gather(*(self._publish(js, m) for m in messages), return_exceptions=True)
        return [r if isinstance(r, BaseException) else None for r in results]

    async def close(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):  # already broken
                await nc.close()


class NatsPublisher:
    """The sync face of :class:`AsyncNatsPublisher` (same arguments), for the sync Dispatcher."""

    def __init__(self, url: str = "nats://127.0.0.1:4222", **options: Any) -> None:
        self.inner = AsyncNatsPublisher(url, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sa_outbox-nats", daemon=True)
        self._thread.start()

    def _call(self, coro: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self.inner.timeout * 2 + 1)
        except TimeoutError as exc:
            future.cancel()
            raise RetryableError("nats publish timed out") from exc

    def publish(self, message: Message) -> None:
        self._call(self.inner.publish(message))

    def publish_many(self, messages: Sequence[Message]) -> list[BaseException | None]:
        result: list[BaseException | None] = self._call(self.inner.publish_many(messages))
        return result

    def close(self) -> None:
        try:
            self._call(self.inner.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()
