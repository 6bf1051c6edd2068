"""W3C trace context and OpenTelemetry spans for the outbox (extra ``otel``: ``opentelemetry-api``).

Everything here is a no-op when ``opentelemetry-api`` is not installed, and nearly free when it is but no
span is active / no SDK is configured.

* **Producer side** (:func:`trace_headers`): when a span is active at flush, ``emit`` or ``enqueue`` time, its
  ``traceparent``/``tracestate`` are written into the row's headers (W3C Trace Context propagator, whatever
  global propagator is configured: exactly these two headers, so ambient baggage never lands in a row).
  Headers the application set itself are kept.
* **Dispatcher** (:func:`publish_span`, :func:`publish_spans` for a batch): one ``PRODUCER`` span per message,
  named ``publish <destination>``, with the messaging semantic conventions (``messaging.system``,
  ``messaging.destination.name``, ``messaging.message.id``, ``messaging.operation`` = ``publish``). The
  **first attempt continues the producer's trace** (its parent is the context extracted from the message's
  headers); a retry (``attempts > 1``) starts from the caller's context and **links** to the producer's span
  instead, so a message retried for hours does not stretch the request's trace.
* **Publishers** (:func:`inject`): write the trace context of the message's publish span into the headers
  they send, so the consumer's span is a child of the publish span. Without a publish span the producer's own
  ``traceparent`` goes out unchanged (the consumer then continues the producer's trace directly).
* **Worker** (:func:`process_span`): one ``CONSUMER`` span per job, ``process <queue>``, same first-attempt /
  retry rule.
* **Consumers** (:func:`consumer_span`, :func:`receive_span`): continue the trace carried by a broker
  message's headers (``sa_outbox.inbox`` uses them).

The spans record an exception (and ERROR status) when the block raises or when the caller reports a failure
with ``handle.outcome(error)``; a :class:`~sa_outbox.Defer` is recorded as ``sa_outbox.deferred`` without
ERROR status.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from ._messages import ClaimedJob, Message

try:
    from opentelemetry import trace
    from opentelemetry.propagators.textmap import Getter
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # pragma: no cover - exercised only without the extra
    trace = None  # type: ignore[assignment]
    TraceContextTextMapPropagator = None  # type: ignore[assignment,misc]

__all__ = [
    "ENABLED",
    "TRACE_HEADERS",
    "consumer_span",
    "extract",
    "inject",
    "process_inert",
    "process_span",
    "provider_unset",
    "publish_span",
    "publish_spans",
    "publisher_target",
    "receive_span",
    "trace_headers",
    "with_trace",
]

#: Whether ``opentelemetry-api`` is installed.
ENABLED = trace is not None
#: The headers the W3C Trace Context propagator reads and writes.
TRACE_HEADERS = ("traceparent", "tracestate")
#: ``messaging.system`` of the worker's process spans (the jobs table is the queue).
JOBS_SYSTEM = "sa_outbox"

_PROPAGATOR: Any = TraceContextTextMapPropagator() if TraceContextTextMapPropagator is not None else None


def _tracer() -> Any:
    return trace.get_tracer("sa_outbox", __version__)


if ENABLED:

    def _text(value: Any) -> Any:
        """Bytes as text; bytes that are not UTF-8 as None — a header that cannot be a trace context is
        ignored, like a malformed one, never an error of the receipt (a message whose every delivery raised
        could never be consumed)."""
        if not isinstance(value, bytes):
            return value
        try:
            return value.decode()
        except UnicodeDecodeError:
            return None

    class _AnyCaseGetter(Getter[Mapping[Any, Any]]):
        """Reads ``traceparent`` whatever the case of the carrier's keys (HTTP servers, ``Traceparent``) and
        decodes bytes values (AMQP and Redis clients hand out bytes)."""

        def get(self, carrier: Mapping[Any, Any], key: str) -> list[str] | None:
            for k, v in carrier.items():
                name = _text(k)
                if isinstance(name, str) and name.lower() == key:
                    value = _text(v)
                    return [value] if isinstance(value, str) else None
            return None

        def keys(self, carrier: Mapping[Any, Any]) -> list[str]:
            return [name for name in (_text(k) for k in carrier) if isinstance(name, str)]

    _GETTER: Any = _AnyCaseGetter()
else:  # pragma: no cover - exercised only without the extra
    _GETTER = None


# --- the producer side ----------------------------------------------------------------------------------


def trace_headers() -> dict[str, str]:
    """``traceparent`` (and ``tracestate``) of the span active now; empty without OTel or without a valid
    span."""
    if not ENABLED or not trace.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier


def with_trace(headers: Mapping[str, str] | None, context: Mapping[str, str]) -> dict[str, str] | None:
    """``headers`` plus the trace ``context`` headers (:func:`trace_headers`), unless the application set a
    ``traceparent`` itself (any case): then its trace context is kept whole (never its ``traceparent`` with
    another span's ``tracestate``)."""
    if not context:
        return None if headers is None else dict(headers)
    if not headers:
        return dict(context)
    if any(k.lower() == "traceparent" for k in headers):
        return dict(headers)
    given = {k.lower() for k in headers}
    return {**{k: v for k, v in context.items() if k not in given}, **headers}


def extract(headers: Mapping[Any, Any] | None) -> Any:
    """The OTel context carried by ``headers`` (``traceparent``/``tracestate``, any case, str or bytes), or
    ``None`` when they carry none (or OTel is not installed)."""
    if not ENABLED or not headers:
        return None
    ctx = _PROPAGATOR.extract(headers, getter=_GETTER)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


# --- spans ----------------------------------------------------------------------------------------------


class _Handle:
    """What a span's block may tell it: the outcome, when it is a value rather than an exception."""

    __slots__ = ("span",)

    def __init__(self, span: Any) -> None:
        self.span = span

    def outcome(self, error: BaseException | None) -> None:
        """Record the result: ``None`` delivered/done, a :class:`Defer` as deferred, anything else as an
        error (exception event, ERROR status, ``error.type``)."""
        if error is None or self.span is None or not self.span.is_recording():
            return
        from .errors import Defer

        if isinstance(error, Defer):
            self.span.set_attribute("sa_outbox.deferred", True)
            return
        self.span.record_exception(error)
        self.span.set_attribute("error.type", type(error).__qualname__)
        self.span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"[:500]))

    def set(self, name: str, value: Any) -> None:
        if self.span is not None and self.span.is_recording():
            self.span.set_attribute(name, value)


class _Handles:
    """The handles of a batch's spans: ``outcomes(errors)`` takes one entry per message, in order."""

    __slots__ = ("handles",)

    def __init__(self, handles: list[_Handle]) -> None:
        self.handles = handles

    def outcomes(self, errors: Sequence[BaseException | None]) -> None:
        for handle, error in zip(self.handles, errors, strict=False):
            handle.outcome(error)


_NULL = _Handle(None)


def _parent_and_links(headers: Mapping[str, str], attempts: int) -> tuple[Any, list[Any]]:
    """First attempt: the producer's context is the parent. A retry: the caller's context is (``None``), with
    a link to the producer's span."""
    ctx = extract(headers)
    if ctx is None:
        return None, []
    if attempts <= 1:
        return ctx, []
    producer = trace.get_current_span(ctx).get_span_context()
    return None, [trace.Link(producer, {"sa_outbox.link": "producer"})]


def _message_attributes(message: Message, system: str, destination: str) -> dict[str, Any]:
    return {
        "messaging.system": system,
        "messaging.destination.name": destination,
        "messaging.message.id": message.message_id,
        "messaging.operation": "publish",
        "messaging.operation.name": "publish",
        "sa_outbox.attempt": message.attempts,
        "sa_outbox.event_type": message.event_type,
        "sa_outbox.aggregate_type": message.aggregate_type,
        "sa_outbox.aggregate_id": message.aggregate_id,
    }


def publisher_target(publisher: Any, message: Message) -> tuple[str, str]:
    """``(messaging.system, messaging.destination.name)`` for ``message`` through ``publisher``: the shipped
    publishers define ``messaging_system`` and ``messaging_destination(message)``; any other publisher is
    ``("unknown", <event type>)`` unless it defines them too."""
    system = getattr(publisher, "messaging_system", None) or "unknown"
    destination = message.event_type
    describe = getattr(publisher, "messaging_destination", None)
    if callable(describe):
        with contextlib.suppress(Exception):  # a failing routing callable fails the publish, not the span
            destination = str(describe(message))
    return str(system), destination


# The publish spans open now, by message object (the publisher's inject() finds its message's span even on
# another thread, and for a batch whose spans cannot all be current at once). The message is kept in the
# entry so that its id() cannot be reused while the entry exists.
_OPEN: dict[int, tuple[Any, Any]] = {}
_OPEN_LOCK = threading.Lock()


def _register(message: Message, span: Any) -> None:
    with _OPEN_LOCK:
        _OPEN[id(message)] = (message, trace.set_span_in_context(span))


def _unregister(message: Message) -> None:
    with _OPEN_LOCK:
        entry = _OPEN.get(id(message))
        if entry is not None and entry[0] is message:
            del _OPEN[id(message)]


def _target(message: Message, system: str | None, destination: str | None, publisher: Any) -> tuple[str, str]:
    if system is None or destination is None:
        found = publisher_target(publisher, message)
        system, destination = system or found[0], destination or found[1]
    return system, destination


def _no_provider() -> bool:
    """No tracer provider is configured: the API's proxy, whose spans record nothing. A publish then opens no
    span at all, so :func:`inject` leaves the message's own trace headers as they are (a non-recording span
    of a retry, which links to the producer instead of continuing its trace, carried no context: inject
    removed the producer's traceparent and wrote none)."""
    return isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def _inert(headers: Any) -> bool:
    """Whether a span would change nothing: no tracer provider is configured (the API's proxy, whose spans
    record nothing) and there is no trace context in ``headers`` to pass on to what the span would wrap.
    Skipping it then saves ~10–20 µs of client CPU per job or message (a quarter of a no-op job's cost).
    Checked per call: a provider set later is seen at once."""
    return not headers and _no_provider()


def process_inert(job: ClaimedJob, no_provider: bool | None = None) -> bool:
    """Whether :func:`process_span` would open no span for ``job`` (a caller may then skip it).
    ``no_provider``: :func:`provider_unset` as the caller read it for a whole batch (one lookup per batch
    rather than per job; a provider set meanwhile is seen from the next batch)."""
    if not ENABLED:
        return True
    if no_provider is None:
        return _inert(job.headers)
    return not job.headers and no_provider


def provider_unset() -> bool:
    """No tracer provider is configured now (see :func:`process_inert`)."""
    return not ENABLED or _no_provider()


@contextmanager
def publish_span(
    message: Message, *, system: str | None = None, destination: str | None = None, publisher: Any = None
) -> Iterator[_Handle]:
    """A ``PRODUCER`` span around one publish, current inside the block; yields a handle whose
    ``outcome(error)`` records a failure returned as a value. ``system``/``destination`` default to what
    ``publisher`` says (:func:`publisher_target`)."""
    if not ENABLED or _no_provider():
        yield _NULL
        return
    system, destination = _target(message, system, destination, publisher)
    parent, links = _parent_and_links(message.headers, message.attempts)
    with _tracer().start_as_current_span(
        f"publish {destination}", context=parent, kind=trace.SpanKind.PRODUCER, links=links,
        attributes=_message_attributes(message, system, destination),
    ) as span:  # fmt: skip
        _register(message, span)
        try:
            yield _Handle(span)
        finally:
            _unregister(message)


@contextmanager
def publish_spans(
    messages: Sequence[Message], *, system: str | None = None, destination: str | None = None,
    publisher: Any = None,
) -> Iterator[_Handles]:  # fmt: skip
    """One ``PRODUCER`` span per message around a batch publish (``publish_many``): none of them current
    (there is one block for all), each found by :func:`inject` through its message. Yields handles whose
    ``outcomes(errors)`` takes the batch's per-message results. An exception from the block is recorded on
    every span."""
    if not ENABLED or _no_provider():
        yield _Handles([_NULL] * len(messages))
        return
    tracer = _tracer()
    spans: list[Any] = []
    try:
        for m in messages:
            sys_, dest = _target(m, system, destination, publisher)
            parent, links = _parent_and_links(m.headers, m.attempts)
            span = tracer.start_span(
                f"publish {dest}", context=parent, kind=trace.SpanKind.PRODUCER, links=links,
                attributes=_message_attributes(m, sys_, dest),
            )  # fmt: skip
            spans.append(span)
            _register(m, span)
        handles = _Handles([_Handle(s) for s in spans])
        try:
            yield handles
        except BaseException as exc:
            handles.outcomes([exc] * len(spans))
            raise
    finally:
        for m, span in zip(messages, spans, strict=False):
            _unregister(m)
            span.end()


@contextmanager
def process_span(job: ClaimedJob) -> Iterator[_Handle]:
    """A ``CONSUMER`` span around one job's handler, current inside the block (the handler's own spans are
    its children); yields a handle whose ``outcome(error)`` records a failure returned as a value."""
    if process_inert(job):
        yield _NULL
        return
    parent, links = _parent_and_links(job.headers, job.attempts)
    attributes = {
        "messaging.system": JOBS_SYSTEM,
        "messaging.destination.name": job.queue,
        "messaging.message.id": str(job.id),
        "messaging.operation": "process",
        "messaging.operation.name": "process",
        "sa_outbox.task": job.task,
        "sa_outbox.attempt": job.attempts,
    }
    with _tracer().start_as_current_span(
        f"process {job.queue}", context=parent, kind=trace.SpanKind.CONSUMER, links=links, attributes=attributes
    ) as span:  # fmt: skip
        yield _Handle(span)


def inject(headers: MutableMapping[str, Any], message: Message | None = None) -> MutableMapping[str, Any]:
    """Write into ``headers`` (in place; also returned) the trace context a consumer should continue: the
    publish span of ``message`` when one is open (:func:`publish_span`/:func:`publish_spans`), else the span
    active now. With neither — or without OTel — ``headers`` are left as they are (the producer's own
    ``traceparent``, copied from the message, goes out)."""
    if not ENABLED:
        return headers
    ctx = None
    if message is not None:
        with _OPEN_LOCK:
            entry = _OPEN.get(id(message))
        if entry is not None and entry[0] is message:
            ctx = entry[1]
    if ctx is None and not trace.get_current_span().get_span_context().is_valid:
        return headers
    for name in [k for k in headers if isinstance(k, str) and k.lower() in TRACE_HEADERS]:
        del headers[name]  # the context injected now replaces the producer's (any case)
    _PROPAGATOR.inject(headers, context=ctx)
    return headers


@contextmanager
def consumer_span(
    headers: Mapping[Any, Any] | None, name: str, attributes: Mapping[str, Any] | None = None
) -> Iterator[_Handle]:
    """A ``CONSUMER`` span continuing the trace carried by ``headers`` (parent: the extracted context; the
    current context when they carry none), current inside the block."""
    if not ENABLED:
        yield _NULL
        return
    with _tracer().start_as_current_span(
        name, context=extract(headers), kind=trace.SpanKind.CONSUMER, attributes=dict(attributes or {})
    ) as span:  # fmt: skip
        yield _Handle(span)


@contextmanager
def receive_span(headers: Mapping[Any, Any] | None, consumer: str, message_id: str) -> Iterator[_Handle]:
    """What :func:`sa_outbox.inbox.receive` records of a message whose ``headers`` carry a trace: when the
    span active now already continues that trace (the consumer opened one, e.g. with
    ``inbox.consume_span``), the receipt is recorded on it; otherwise a short ``receive <consumer>`` span,
    child of the producer's context, records it."""
    ctx = extract(headers)
    if ctx is None:
        yield _NULL
        return
    current = trace.get_current_span()
    carried = trace.get_current_span(ctx).get_span_context()
    if current.is_recording() and current.get_span_context().trace_id == carried.trace_id:
        current.set_attribute("sa_outbox.inbox.consumer", consumer)
        yield _Handle(current)
        return
    attributes = {
        "messaging.operation": "receive",
        "messaging.operation.name": "receive",
        "messaging.message.id": message_id,
        "messaging.consumer.group.name": consumer,
        "sa_outbox.inbox.consumer": consumer,
    }
    with _tracer().start_as_current_span(
        f"receive {consumer}", context=ctx, kind=trace.SpanKind.CONSUMER, attributes=attributes
    ) as span:  # fmt: skip
        yield _Handle(span)
