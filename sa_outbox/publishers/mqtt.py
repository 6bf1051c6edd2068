"""MQTT publisher (extra ``mqtt``, paho-mqtt): QoS 1 (at least once) to a broker such as Mosquitto.

MQTT has no server-side de-duplication: the JSON envelope carries ``message_id`` for the consumer to
de-duplicate on (QoS 1 itself may redeliver). The topic comes from the event (default ``<prefix>/<event_type>``).

Headers (with the publish span's ``traceparent``): MQTT v5 (``protocol="5"``) sends them as user
properties; MQTT 3.1.1 has no header slot, so the JSON envelope gets a ``headers`` object.
``envelope="cloudevents"``: with v5 a binary-mode CloudEvent (attributes as unprefixed user properties,
``Content Type`` ``application/json``, the payload JSON as the body), with 3.1.1 a structured one (the JSON
event format; headers become extension attributes, so their names must be 1–20 lowercase letters and digits,
which ``traceparent``/``tracestate`` are — a message with another header fails as
:class:`~sa_outbox.PermanentError` naming it).

* A message counts as delivered when the broker's PUBACK arrives. ``publish_many`` sends a whole batch, then
  waits for all the PUBACKs together; ``publish`` and ``publish_many`` each return within ``timeout``
  seconds in total, connecting included.
* :class:`~sa_outbox.DestinationUnavailable` — the broker as a whole is out of reach: connection refused, DNS
  failure, no CONNACK in time or a refused CONNECT (e.g. not authorised), or the connection lost while
  messages wait for their PUBACK. A ``publish_many`` that cannot connect returns it for every message; the
  next call connects afresh.
* :class:`~sa_outbox.RetryableError` — no PUBACK by the deadline on a connection that is still up (the
  connection is then dropped: a hung one would time out every later call too), or a message paho refuses to
  queue. A topic MQTT refuses (wildcards, empty) is :class:`~sa_outbox.PermanentError`.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, cast

from .._durations import Duration, to_seconds
from .._messages import Message
from ..errors import ConfigurationError, DestinationUnavailable, NoAnswer, PermanentError, RetryableError
from ._common import (
    Envelope,
    envelope,
    envelope_json,
    missing_extra,
    outgoing_headers,
    payload_json,
)

try:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import MQTTProtocolVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    missing_extra("mqtt", exc)

__all__ = ["MQTTPublisher"]


_PROTOCOLS = {"3.1.1": MQTTProtocolVersion.MQTTv311, "5": MQTTProtocolVersion.MQTTv5}


#: Characters an MQTT string must not (U+0000) or should not (the other C0 and the C1 controls) hold; Mosquitto
#: drops the connection of a client that sends one — for every message of the batch, again at each retry: as a
#: destination "unavailable", that message held the circuit open for good (a hostile review).
_MQTT_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _check_text(message: Message, what: str, text: str) -> None:
    """PermanentError naming ``what`` when ``text`` (a topic, a v5 user property) holds a control character."""
    found = _MQTT_CONTROL.search(text)
    if found is not None:
        raise PermanentError(
            f"message {message.message_id}: the {what} holds the control character {found.group()!r}, which "
            "MQTT strings may not carry (brokers drop the connection)"
        )


class MQTTPublisher:
    """``MQTTPublisher("127.0.0.1", 1883, topic_prefix="orders")``. Use it from one thread at a time.

    ``protocol`` is ``"3.1.1"`` (the default) or ``"5"``; ``envelope`` is ``"outbox"`` (the JSON envelope) or
    ``"cloudevents"`` (needs ``source``)."""

    messaging_system = "mqtt"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 1883,
        *,
        topic: Callable[[Message], str] | None = None,
        topic_prefix: str = "outbox",
        qos: int = 1,
        timeout: Duration = 5.0,
        protocol: str = "3.1.1",
        envelope: str = "outbox",
        source: str | Callable[[Message], str] | None = None,
    ) -> None:
        if protocol not in _PROTOCOLS:
            raise ConfigurationError(f"protocol must be '3.1.1' or '5', got {protocol!r}")
        self.protocol = protocol
        self.envelope = Envelope(envelope, source)
        self.host, self.port, self.qos = host, port, qos
        self.timeout = to_seconds(timeout, name="timeout", allow_zero=False)
        self.topic = topic or (lambda m: f"{topic_prefix}/{m.event_type}")
        self._client: Any = None
        # What the network thread reports, under one condition: PUBACKs by mid, CONNACK, disconnect.
        self._cond = threading.Condition()
        self._acked: set[int] = set()
        self._connack: Any = None
        self._down: str | None = None

    @property
    def _where(self) -> str:
        return f"mqtt broker at {self.host}:{self.port}"

    # --- the network thread's callbacks (paho's loop thread) ---------------------------------------------

    # A client this publisher dropped may still call back (a late PUBACK after a thaw): its message ids would
    # collide with the new client's, so only the current client counts.

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        with self._cond:
            if client is self._client:
                self._connack = reason
            self._cond.notify_all()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        with self._cond:
            if client is self._client:
                self._down = f"disconnected: {reason}"
            self._cond.notify_all()

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        with self._cond:
            if client is self._client:
                self._acked.add(mid)
            self._cond.notify_all()

    # --- the caller's side ---------------------------------------------------------------------------------

    def _ensure(self, deadline: float) -> Any:
        if self._client is not None and self._client.is_connected() and self._down is None:
            return self._client
        self.close()
        version = mqtt.CallbackAPIVersion.VERSION2  # type: ignore[attr-defined]
        client = mqtt.Client(
            version, client_id=f"sa-outbox-{uuid.uuid4().hex[:8]}", reconnect_on_failure=False,
            protocol=_PROTOCOLS[self.protocol],
        )  # fmt: skip
        client.on_connect, client.on_disconnect, client.on_publish = (
            self._on_connect, self._on_disconnect, self._on_publish,
        )  # fmt: skip
        client.connect_timeout = max(0.05, deadline - time.monotonic())
        with self._cond:
            self._connack, self._down, self._acked = None, None, set()
        try:
            client.connect(self.host, self.port, keepalive=30)
        except (OSError, ValueError) as exc:  # refused, DNS failure, TCP connect timeout
            raise DestinationUnavailable(f"{self._where} unavailable: {type(exc).__name__}: {exc}") from exc
        self._client = client
        client.loop_start()
        with self._cond:
            self._cond.wait_for(lambda: self._connack is not None, max(0.0, deadline - time.monotonic()))
            connack = self._connack
        if connack is None or connack.is_failure:
            self.close()
            why = f"refused the connection: {connack}" if connack is not None else "sent no CONNACK in time"
            raise DestinationUnavailable(f"{self._where} {why}")
        return client

    def _run(self, messages: Sequence[Message]) -> list[BaseException | None]:
        deadline = time.monotonic() + self.timeout
        try:
            client = self._ensure(deadline)
        except RetryableError as exc:
            return [exc] * len(messages)
        results: list[BaseException | None] = [None] * len(messages)
        waiting: dict[int, int] = {}  # mid -> index
        for i, m in enumerate(messages):
            try:
                body, properties = self._frame(m)
                topic = self.topic(m)
                _check_text(m, "topic", topic)
            except (
                PermanentError
            ) as exc:  # a header a structured CloudEvent cannot carry, a control character
                results[i] = exc
                continue
            except Exception as exc:  # a bug in the user's topic callable: that message's own failure
                results[i] = exc
                continue
            try:
                info = client.publish(topic, body, qos=self.qos, properties=properties)
            except ValueError as exc:  # a topic MQTT refuses (wildcards, empty, too long)
                results[i] = PermanentError(f"invalid MQTT topic for message {m.message_id}: {exc}")
                continue
            except Exception as exc:  # a bug in the user's topic callable: that message's own failure
                results[i] = exc
                continue
            if info.rc == mqtt.MQTT_ERR_NO_CONN:
                results[i] = DestinationUnavailable(f"{self._where}: not connected")
            elif info.rc != mqtt.MQTT_ERR_SUCCESS:
                results[i] = RetryableError(f"mqtt publish refused: {mqtt.error_string(info.rc)}")
            elif self.qos > 0:
                waiting[info.mid] = i
        with self._cond:
            self._cond.wait_for(
                lambda: self._down is not None or waiting.keys() <= self._acked,
                max(0.0, deadline - time.monotonic()),
            )
            acked, down = self._acked & waiting.keys(), self._down
            self._acked -= acked
        for mid, i in waiting.items():
            if mid in acked:
                continue
            if down is not None:
                results[i] = DestinationUnavailable(
                    f"{self._where} lost the connection ({down}) before the PUBACK"
                )
            else:
                results[i] = NoAnswer(f"no PUBACK within {self.timeout:g}s (the connection is dropped)")
        if down is not None or len(acked) < len(waiting):
            self.close()
        return results

    def messaging_destination(self, message: Message) -> str:
        """``messaging.destination.name`` of the publish span: the topic."""
        return self.topic(message)

    def _frame(self, message: Message) -> tuple[bytes, Any]:
        """The PUBLISH payload and its MQTT v5 properties (``None`` with 3.1.1, which has none)."""
        headers = outgoing_headers(message)
        if self.protocol == "3.1.1":
            if self.envelope.cloudevents:
                return self.envelope.ce_structured(message, headers), None
            body = envelope(message)
            body["headers"] = headers
            return json.dumps(body, separators=(",", ":")).encode(), None
        props: Any = cast(Any, Properties)(PacketTypes.PUBLISH)
        for name, value in headers.items():
            _check_text(message, f"header {name!r}", value)
        if not self.envelope.cloudevents:
            props.ContentType = "application/json"
            if headers:
                props.UserProperty = list(headers.items())
            return envelope_json(message), props
        attributes = self.envelope.ce_attributes(message)
        for name, value in attributes.items():
            _check_text(message, f"CloudEvents attribute {name!r}", str(value))
        props.ContentType = attributes.pop("datacontenttype")
        clash = sorted(set(headers) & set(attributes))
        if clash:
            raise PermanentError(
                f"message {message.message_id}: header {clash[0]!r} has the name of a CloudEvents attribute, "
                "which MQTT v5 binary mode sends as an unprefixed user property; rename the header"
            )
        props.UserProperty = [*attributes.items(), *headers.items()]
        return payload_json(message), props

    def publish(self, message: Message) -> None:
        """Publish one message and wait for its PUBACK (within ``timeout``); raises its failure class."""
        error = self._run([message])[0]
        if error is not None:
            raise error

    def publish_many(self, messages: Sequence[Message]) -> list[BaseException | None]:
        """Send a batch, then wait for all its PUBACKs together, within ``timeout`` in total. One entry per
        message: ``None`` when acknowledged, else its failure class."""
        return self._run(messages)

    def close(self) -> None:
        """Disconnect and stop paho's network thread."""
        client, self._client = self._client, None
        if client is not None:
            client.disconnect()
            client.loop_stop()
