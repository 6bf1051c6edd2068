"""HTTP webhook publisher (extra ``http``): POST the message as JSON with ``Idempotency-Key: <message_id>``.

The message's ``headers`` (with the publish span's ``traceparent``) are sent as HTTP headers, under the
configured ``headers`` and the publisher's own. ``envelope="cloudevents"`` POSTs a binary-mode CloudEvent
(HTTP protocol binding: percent-encoded ``ce-*`` headers, ``Content-Type: application/json``, the payload
JSON as the body).

Outcomes:

* **2xx → delivered**, whatever the body: the receiver took the message when it answered 2xx, so a slow,
  broken (bad gzip) or huge body never turns a delivery into a retry (a second delivery). The body of a 2xx is
  not decoded; a small one is drained so that the connection can be reused.
* **307 / 308 → followed**: POSTed again, same body and headers, to the ``Location`` — on the same origin
  only (an upgrade from ``http`` to ``https`` on the same host counts), at most ``max_redirects`` hops. A
  redirect to another origin could hand the headers (signatures, tokens) to someone else, and 301/302/303
  turn a POST into a GET in every client: those are :class:`~sa_outbox.PermanentError` naming the new
  location — update the configured URL, then retry the dead messages.
* **408, 429, 5xx → retryable** (:class:`~sa_outbox.RetryableError`). ``Retry-After`` on a 429/503 is honoured
  as :class:`~sa_outbox.Defer` (the attempt is refunded: the receiver asked us to wait, it did not fail),
  with two limits so that a receiver can neither hammer itself nor park messages forever:

  - the delay is at least ``min_retry_after`` (1 s): ``Retry-After: 0`` or a date in the past came back at
    once, about 1,800 POSTs a second per message;
  - it is honoured only while the message is younger than ``max_defer_age`` (1 hour; ``None``: always) and
    the delay is at most ``max_retry_after`` (300 s). Otherwise the answer is a plain retryable failure that
    spends an attempt, so a message that is never accepted ends ``dead`` after ``max_attempts``. The age is
    ``now - created_at`` on this machine's clock against the database's ``created_at`` (refunded deferrals
    leave no count in the row; the age needs none); a skew of seconds does not matter at this scale.

  A malformed ``Retry-After`` is ignored (as if absent).
* **Any other 4xx / 3xx → permanent** (our request is wrong; retrying will not fix it).
* **Network**: a refused connection, a DNS failure or a connect timeout is
  :class:`~sa_outbox.DestinationUnavailable` (the receiver as a whole is down); a read or write timeout and a
  connection broken mid-request are :class:`~sa_outbox.NoAnswer` (retried, but never dead on the last
  attempt: no verdict on the message).

``timeout`` bounds each publish as a whole — connecting, sending, the status line and headers (a receiver
trickling them a byte at a time included), redirects and the error text — not each socket read. Only the
first 200 bytes of an error body are read, for ``last_error``. The whole-call bound needs the publisher's own
HTTP client: a ``client=`` passed in keeps its own per-operation timeouts (with :class:`AsyncWebhookPublisher`
the call is still cancelled after ``timeout`` + 1 s).
"""

from __future__ import annotations

import asyncio
import contextvars
import email.utils
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from .._durations import Duration, to_seconds
from .._messages import Message
from ..errors import (
    ConfigurationError,
    Defer,
    DestinationUnavailable,
    NoAnswer,
    PermanentError,
    RetryableError,
)
from ._common import (
    Envelope,
    ce_header_value,
    envelope_json,
    headers_for,
    missing_extra,
    outgoing_headers,
    payload_json,
)

try:
    import httpcore
    import httpx
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    missing_extra("http", exc)

__all__ = ["AsyncWebhookPublisher", "WebhookPublisher", "classify_response"]

RETRYABLE = {408, 429}
FOLLOWED = {307, 308}
ERROR_TEXT_BYTES = 200
DRAIN_2XX_BYTES = 64 * 1024  # a 2xx body up to this size is read (and ignored) to keep the connection


# --- one deadline for the whole call ---------------------------------------------------------------------
# httpx's timeouts apply to each socket operation, so a receiver sending a byte now and then holds a call
# forever. The publisher's own client runs on a network backend whose every connect, read and write gets at
# most the time left until the call's deadline (a context variable: per thread, per task).

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "sa_outbox_http_deadline", default=None
)


def _left(timeout: float | None, error: type[Exception]) -> float | None:
    deadline = _DEADLINE.get()
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise error("the publish timeout passed")
    return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> Any:
        return _Stream(
            self._stream.start_tls(ssl_context, server_hostname, _left(timeout, httpcore.ConnectTimeout))
        )

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(
        self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.NetworkStream:  # fmt: skip
        timeout = _left(timeout, httpcore.ConnectTimeout)
        return _Stream(self._backend.connect_tcp(host, port, timeout, local_address, socket_options))

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.NetworkStream:
        return _Stream(
            self._backend.connect_unix_socket(path, _left(timeout, httpcore.ConnectTimeout), socket_options)
        )

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class _AsyncStream(httpcore.AsyncNetworkStream):
    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._stream.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._stream.write(buffer, _left(timeout, httpcore.WriteTimeout))

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> Any:
        timeout = _left(timeout, httpcore.ConnectTimeout)
        return _AsyncStream(await self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _AsyncBackend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(
        self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:  # fmt: skip
        timeout = _left(timeout, httpcore.ConnectTimeout)
        return _AsyncStream(
            await self._backend.connect_tcp(host, port, timeout, local_address, socket_options)
        )

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.AsyncNetworkStream:
        timeout = _left(timeout, httpcore.ConnectTimeout)
        return _AsyncStream(await self._backend.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def _client(timeout: float) -> httpx.Client:
    transport = httpx.HTTPTransport()
    # httpx has no option for the network backend: its transport's pool is rebuilt with ours.
    transport._pool = httpcore.ConnectionPool(
        ssl_context=httpx.create_ssl_context(), network_backend=_Backend()
    )
    return httpx.Client(timeout=timeout, transport=transport)


def _async_client(timeout: float) -> httpx.AsyncClient:
    transport = httpx.AsyncHTTPTransport()
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=httpx.create_ssl_context(), network_backend=_AsyncBackend()
    )
    return httpx.AsyncClient(timeout=timeout, transport=transport)


# --- what an answer means ----------------------------------------------------------------------------------


def _retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delta-seconds or an HTTP date); ``None`` when absent or
    malformed."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        seconds = float(value)
        return seconds if math.isfinite(seconds) else None
    try:
        parsed = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return max(0.0, parsed.timestamp() - time.time())


def _age(message: Message) -> float:
    created = message.created_at if message.created_at.tzinfo else message.created_at.replace(tzinfo=UTC)
    return (datetime.now(UTC) - created).total_seconds()


def classify_response(
    response: httpx.Response,
    *,
    max_retry_after: float = 300.0,
    min_retry_after: float = 1.0,
    max_defer_age: float | None = None,
    message: Message | None = None,
    text: str | None = None,
) -> BaseException | None:
    """``None`` for a 2xx; otherwise the failure class the answer means (see the module docs).

    ``text`` is the error body prefix for the message (default: the body, when it has been read).
    ``max_defer_age`` applies when ``message`` is given. Redirects are the publisher's business: here a 3xx
    is a :class:`~sa_outbox.PermanentError`.
    """
    status = response.status_code
    if 200 <= status < 300:
        return None
    if text is None:
        text = response.text[:ERROR_TEXT_BYTES] if response.is_stream_consumed else ""
    summary = f"HTTP {status} from {response.request.url}: {text}"
    if 300 <= status < 400:
        location = response.headers.get("Location")
        return PermanentError(
            f"{summary} (redirect to {location!r}: a POST is only re-sent for 307/308 on the same origin; "
            "configure the new URL)"
        )
    if status in RETRYABLE or status >= 500:
        wait = _retry_after(response.headers.get("Retry-After")) if status in (429, 503) else None
        if wait is None:
            return RetryableError(summary)
        delay = max(wait, min_retry_after)
        if delay > max_retry_after:
            return RetryableError(
                f"{summary} (Retry-After {wait:g}s is over max_retry_after {max_retry_after:g}s)"
            )
        if max_defer_age is not None and message is not None and _age(message) > max_defer_age:
            return RetryableError(
                f"{summary} (Retry-After {wait:g}s, but the message is {_age(message):.0f}s old, over "
                f"max_defer_age {max_defer_age:g}s: an attempt is spent)"
            )
        return Defer(delay, f"{summary} (Retry-After {delay:g}s)")
    return PermanentError(summary)


def _network_error(url: str, exc: httpx.TransportError) -> BaseException:
    text = f"POST {url} failed: {type(exc).__name__}: {exc}"
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.ProxyError):
        return DestinationUnavailable(text)  # refused, DNS failure, unreachable: the receiver as a whole
    if isinstance(exc, httpx.UnsupportedProtocol):
        return PermanentError(text)
    if isinstance(exc, httpx.TimeoutException | httpx.NetworkError | httpx.RemoteProtocolError):
        # a timeout, or a connection broken mid-request (the receiver closed it, a reset): no answer, no
        # verdict on the message — as a plain RetryableError a network fault sent messages to dead (a hostile
        # review: 20 dropped connections in 6 s, 18-20 dead, 18 of 20 ordered aggregates blocked)
        return NoAnswer(text)
    return RetryableError(text)  # a response that could not be decoded


def _same_origin(a: httpx.URL, b: httpx.URL) -> bool:
    if a.host != b.host:
        return False
    return (a.scheme, a.port) == (b.scheme, b.port) or (a.scheme, b.scheme) == ("http", "https")


# --- the publishers ------------------------------------------------------------------------------------------


class _Webhook:
    """Options, the request and the meaning of an answer: shared by the sync and the async publisher."""

    messaging_system = "http"

    def __init__(
        self,
        url: str | Callable[[Message], str],
        *,
        timeout: Duration = 5.0,
        headers: Mapping[str, str] | None = None,
        client: Any = None,
        max_retry_after: Duration = 300.0,
        min_retry_after: Duration = 1.0,
        max_defer_age: Duration | None = timedelta(hours=1),
        max_redirects: int = 5,
        envelope: str = "outbox",
        source: str | Callable[[Message], str] | None = None,
    ) -> None:
        self.envelope = Envelope(envelope, source)
        self.url = url
        self.timeout = to_seconds(timeout, name="timeout", allow_zero=False)
        self.headers = dict(headers or {})
        self.max_retry_after = to_seconds(max_retry_after, name="max_retry_after")
        self.min_retry_after = to_seconds(min_retry_after, name="min_retry_after")
        self.max_defer_age = (
            None if max_defer_age is None else to_seconds(max_defer_age, name="max_defer_age")
        )
        if isinstance(max_redirects, bool) or not isinstance(max_redirects, int) or max_redirects < 0:
            raise ConfigurationError(f"max_redirects must be an int >= 0, got {max_redirects!r}")
        self.max_redirects = max_redirects
        self.client: Any = client

    def messaging_destination(self, message: Message) -> str:
        """``messaging.destination.name`` of the publish span: the URL without its query (which may hold a
        token)."""
        url = httpx.URL(self.url(message) if callable(self.url) else self.url)
        return str(url.copy_with(query=None, fragment=None))

    def _request(self, message: Message) -> tuple[httpx.URL, httpx.Headers, bytes]:
        """URL, headers and body. Headers, later ones replacing earlier ones of the same name (any case): the
        message's, the configured ``headers``, then ``X-Outbox-*``, the CloudEvents ``ce-*`` attributes
        (binary mode, percent-encoded), ``Idempotency-Key`` and ``Content-Type``. Values are sent as UTF-8
        (an aggregate id or header value may be non-ASCII)."""
        url = self.url(message) if callable(self.url) else self.url
        merged: dict[str, tuple[str, str]] = {}

        def put(items: Mapping[str, str]) -> None:
            for name, value in items.items():
                merged[name.lower()] = (name, value)

        put(outgoing_headers(message))
        put(self.headers)
        put({f"X-Outbox-{k.title()}": v for k, v in headers_for(message).items()})
        if self.envelope.cloudevents:
            attributes = self.envelope.ce_attributes(message)
            content_type = attributes.pop("datacontenttype")
            put({f"ce-{k}": ce_header_value(v) for k, v in attributes.items()})
            body = payload_json(message)
        else:
            content_type, body = "application/json", envelope_json(message)
        put({"Idempotency-Key": message.message_id, "Content-Type": content_type})
        headers = httpx.Headers([(name.encode(), value.encode()) for name, value in merged.values()])
        return httpx.URL(url), headers, body

    def _answer(self, url: httpx.URL, response: httpx.Response, hops: int) -> tuple[int, httpx.URL | None]:
        """What to do with an answer's status and headers: (how many body bytes to read, ``None``) when it is
        final — a small 2xx body to drain, none of a large one, a prefix of an error for its text — or
        (0, the URL to POST to next) for a 307/308 that may be followed."""
        status, location = response.status_code, response.headers.get("Location")
        if 200 <= status < 300:
            return (DRAIN_2XX_BYTES if _keep(response) else 0), None
        if status not in FOLLOWED or not location:
            return ERROR_TEXT_BYTES, None
        target = url.join(location)
        if not _same_origin(url, target):
            raise PermanentError(
                f"HTTP {status} from {url} redirects to another origin ({target}): not followed, the headers "
                "would go there too; configure that URL if it is right"
            )
        if hops >= self.max_redirects:
            raise PermanentError(f"HTTP {status} from {url}: more than {self.max_redirects} redirects")
        return 0, target

    def _finish(self, message: Message, response: httpx.Response, body: bytes) -> None:
        """Return for a 2xx (delivered, whatever ``body`` holds); raise the failure class otherwise."""
        error = classify_response(
            response, max_retry_after=self.max_retry_after, min_retry_after=self.min_retry_after,
            max_defer_age=self.max_defer_age, message=message, text=body.decode("utf-8", "replace"),
        )  # fmt: skip
        if error is not None:
            raise error


def _keep(response: httpx.Response) -> bool:
    """Whether a 2xx body is small enough to drain (keeping the connection) rather than drop."""
    length = response.headers.get("Content-Length", "")
    return (
        length.isdigit() and int(length) <= DRAIN_2XX_BYTES and not response.headers.get("Content-Encoding")
    )


class WebhookPublisher(_Webhook):
    """``WebhookPublisher("https://example.com/hooks/orders")``; ``url`` may be a callable of the message.

    ``timeout`` bounds each publish as a whole; ``min_retry_after``, ``max_retry_after`` and ``max_defer_age``
    bound what a ``Retry-After`` may ask; ``max_redirects`` bounds the 307/308 hops (see the module docs).
    Durations take a ``timedelta`` or seconds.
    """

    def __init__(self, url: str | Callable[[Message], str], **options: Any) -> None:
        super().__init__(url, **options)
        if self.client is None:
            self.client = _client(self.timeout)

    @contextmanager
    def _deadline(self) -> Iterator[None]:
        token = _DEADLINE.set(time.monotonic() + self.timeout)
        try:
            yield
        finally:
            _DEADLINE.reset(token)

    def _read(self, response: httpx.Response, limit: int) -> bytes:
        """At most ``limit`` bytes of the raw body; what arrived before an error or the deadline."""
        data = b""
        try:
            for chunk in response.iter_raw() if limit else ():
                data += chunk
                if len(data) >= limit:
                    break
        except httpx.HTTPError:
            pass
        return data[:limit]

    def publish(self, message: Message) -> None:
        """POST the message; returns when the receiver answered 2xx (within ``timeout``), raises otherwise."""
        url, headers, body = self._request(message)
        with self._deadline():
            for hops in range(self.max_redirects + 1):
                try:
                    with self.client.stream("POST", url, content=body, headers=headers) as response:
                        limit, target = self._answer(url, response, hops)
                        if target is None:
                            return self._finish(message, response, self._read(response, limit))
                except httpx.TransportError as exc:
                    raise _network_error(str(url), exc) from exc
                url = target

    def close(self) -> None:
        """Close the HTTP client (its pooled connections)."""
        self.client.close()


class AsyncWebhookPublisher(_Webhook):
    """The same webhook publisher for :class:`~sa_outbox.AsyncDispatcher` (``httpx.AsyncClient``); the batch of a
    claim is POSTed concurrently (``publish_concurrency`` of the dispatcher). ``close()`` and ``aclose()`` are
    awaited."""

    def __init__(self, url: str | Callable[[Message], str], **options: Any) -> None:
        super().__init__(url, **options)
        if self.client is None:
            self.client = _async_client(self.timeout)

    @asynccontextmanager
    async def _deadline(self) -> AsyncIterator[None]:
        token = _DEADLINE.set(time.monotonic() + self.timeout)
        try:
            async with asyncio.timeout(self.timeout + 1):  # a backstop for a client passed in
                yield
        finally:
            _DEADLINE.reset(token)

    async def _read(self, response: httpx.Response, limit: int) -> bytes:
        data = b""
        if not limit:
            return data
        try:
            async for chunk in response.aiter_raw():
                data += chunk
                if len(data) >= limit:
                    break
        except httpx.HTTPError:
            pass
        return data[:limit]

    async def publish(self, message: Message) -> None:
        """POST the message; returns when the receiver answered 2xx (within ``timeout``), raises otherwise."""
        url, headers, body = self._request(message)
        try:
            async with self._deadline():
                for hops in range(self.max_redirects + 1):
                    try:
                        async with self.client.stream("POST", url, content=body, headers=headers) as response:
                            limit, target = self._answer(url, response, hops)
                            if target is None:
                                return self._finish(message, response, await self._read(response, limit))
                    except httpx.TransportError as exc:
                        raise _network_error(str(url), exc) from exc
                    url = target
        except TimeoutError as exc:
            raise NoAnswer(f"POST {url}: no complete answer within {self.timeout:g}s") from exc

    async def close(self) -> None:
        """Close the HTTP client (its pooled connections)."""
        await self.client.aclose()

    async def aclose(self) -> None:
        """The same as :meth:`close`."""
        await self.close()
