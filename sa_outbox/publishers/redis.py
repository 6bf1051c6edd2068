"""Redis Streams publisher (extra ``redis``): ``XADD`` of the message's fields, optional ``MAXLEN ~``.

Connection errors and timeouts are :class:`~sa_outbox.RetryableError`; a command error (``WRONGTYPE`` on the
stream key) is :class:`~sa_outbox.PermanentError`. ``publish_many`` sends a batch in one pipeline (one round
trip) and reports per message. Redis Streams has no server-side de-duplication: consumers de-duplicate by the
``message_id`` field (see :func:`sa_outbox.inbox.message_id_from_redis`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from .._messages import Message
from ..errors import PermanentError, RetryableError
from ._common import envelope, missing_extra

try:
    import redis
    from redis import exceptions as rex
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    missing_extra("redis", exc)

__all__ = ["RedisStreamPublisher"]


class RedisStreamPublisher:
    """``RedisStreamPublisher("redis://127.0.0.1:6379/0", stream="events")``; ``stream`` may be a callable of the
    message (e.g. ``lambda m: f"events.{m.aggregate_type}"``). ``timeout`` bounds every command."""

    def __init__(
        self,
        url_or_client: str | Any,
        *,
        stream: str | Callable[[Message], str] = "outbox",
        maxlen: int | None = None,
        timeout: float = 5.0,
    ) -> None:
        if isinstance(url_or_client, str):
            self.client = redis.Redis.from_url(
                url_or_client, socket_timeout=timeout, socket_connect_timeout=timeout, retry_on_timeout=False
            )
        else:
            self.client = url_or_client
        self.stream = stream
        self.maxlen = maxlen
        self.timeout = timeout

    def _key(self, message: Message) -> str:
        return self.stream(message) if callable(self.stream) else self.stream

    @staticmethod
    def _fields(message: Message) -> dict[str, str]:
        fields = envelope(message)
        fields["payload"] = json.dumps(fields["payload"], separators=(",", ":"))
        return {k: str(v) for k, v in fields.items()}

    def _add(self, target: Any, message: Message) -> Any:
        return target.xadd(
            self._key(message), self._fields(message), maxlen=self.maxlen, approximate=self.maxlen is not None
        )

    def publish(self, message: Message) -> None:
        try:
            self._add(self.client, message)
        except (rex.ConnectionError, rex.TimeoutError) as exc:
            raise RetryableError(f"redis unavailable: {exc}") from exc
        except rex.ResponseError as exc:
            raise PermanentError(f"redis refused XADD: {exc}") from exc

    def publish_many(self, messages: Sequence[Message]) -> list[BaseException | None]:
        pipe = self.client.pipeline(transaction=False)
        for m in messages:
            self._add(pipe, m)
        try:
            results = pipe.execute(raise_on_error=False)
        except (rex.ConnectionError, rex.TimeoutError) as exc:
            return [RetryableError(f"redis unavailable: {exc}")] * len(messages)
        return [
            PermanentError(f"redis refused XADD: {r}") if isinstance(r, Exception) else None for r in results
        ]

    def close(self) -> None:
        self.client.close()
