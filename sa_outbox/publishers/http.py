"""HTTP webhook publisher (extra ``http``): POST the message as JSON with ``Idempotency-Key: <message_id>``.

* 2xx → delivered.
* 408, 429 and 5xx, and network errors/timeouts → :class:`~sa_outbox.RetryableError` (backoff, attempts used).
* ``Retry-After`` on a 429/503 is honoured as :class:`~sa_outbox.Defer` (the attempt is refunded: the
  receiver asked us to wait, it did not fail) when it is at most ``max_retry_after`` seconds; a longer one is a
  plain retryable failure, so a receiver cannot park messages forever.
* Any other 4xx → :class:`~sa_outbox.PermanentError` (our request is wrong; retrying will not fix it).
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable, Mapping
from typing import Any

from .._messages import Message
from ..errors import Defer, PermanentError, RetryableError
from ._common import envelope, headers_for, missing_extra

try:
    import httpx
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    missing_extra("http", exc)

__all__ = ["AsyncWebhookPublisher", "WebhookPublisher", "classify_response"]

RETRYABLE = {408, 429}


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    if value.strip().isdigit():
        return float(value)
    parsed = email.utils.parsedate_to_datetime(value)
    return max(0.0, parsed.timestamp() - time.time()) if parsed else None


def classify_response(response: httpx.Response, *, max_retry_after: float = 300.0) -> BaseException | None:
    """None for a 2xx; otherwise the failure class the response means (see the module docs)."""
    status = response.status_code
    if 200 <= status < 300:
        return None
    text = f"HTTP {status} from {response.request.url}: {response.text[:200]}"
    if status in RETRYABLE or status >= 500:
        wait = _retry_after(response.headers.get("Retry-After")) if status in (429, 503) else None
        if wait is not None and wait <= max_retry_after:
            return Defer(wait, f"{text} (Retry-After {wait:g}s)")
        return RetryableError(text)
    return PermanentError(text)


class WebhookPublisher:
    """``WebhookPublisher("https://example.com/hooks/orders")``; ``url`` may be a callable of the message."""

    _client_class: Any = httpx.Client

    def __init__(
        self,
        url: str | Callable[[Message], str],
        *,
        timeout: float = 5.0,
        headers: Mapping[str, str] | None = None,
        client: Any = None,
        max_retry_after: float = 300.0,
    ) -> None:
        self.url = url
        self.client: Any = client or self._client_class(timeout=timeout)
        self.headers = dict(headers or {})
        self.max_retry_after = max_retry_after

    def _request(self, message: Message) -> tuple[str, dict[str, str], dict[str, Any]]:
        url = self.url(message) if callable(self.url) else self.url
        headers = {**self.headers, **{f"X-Outbox-{k.title()}": v for k, v in headers_for(message).items()}}
        headers["Idempotency-Key"] = message.message_id
        return url, headers, envelope(message)

    def publish(self, message: Message) -> None:
        url, headers, body = self._request(message)
        try:
            response = self.client.post(url, json=body, headers=headers)
        except httpx.TransportError as exc:  # connect errors, timeouts, broken connections
            raise RetryableError(f"POST {url} failed: {type(exc).__name__}: {exc}") from exc
        error = classify_response(response, max_retry_after=self.max_retry_after)
        if error is not None:
            raise error

    def close(self) -> None:
        self.client.close()


class AsyncWebhookPublisher(WebhookPublisher):
    """The same webhook publisher for :class:`~sa_outbox.AsyncDispatcher` (``httpx.AsyncClient``); the batch of a
    claim is POSTed concurrently (``publish_concurrency`` of the dispatcher)."""

    _client_class: Any = httpx.AsyncClient

    async def publish(self, message: Message) -> None:  # type: ignore[override]
        url, headers, body = self._request(message)
        try:
            response = await self.client.post(url, json=body, headers=headers)
        except httpx.TransportError as exc:
            raise RetryableError(f"POST {url} failed: {type(exc).__name__}: {exc}") from exc
        error = classify_response(response, max_retry_after=self.max_retry_after)
        if error is not None:
            raise error

    async def aclose(self) -> None:
        await self.client.aclose()
