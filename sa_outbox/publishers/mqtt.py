"""MQTT publisher (extra ``mqtt``, paho-mqtt): QoS 1 (at least once) to a broker such as Mosquitto.

MQTT has no server-side de-duplication: the JSON envelope carries ``message_id`` for the consumer to
de-duplicate on (QoS 1 itself may redeliver). The topic comes from the event (default ``<prefix>/<event_type>``).
A publish counts as delivered when the broker's PUBACK arrives within ``timeout``; no PUBACK, a refused
connection or a disconnect is :class:`~sa_outbox.RetryableError`. ``publish_many`` sends a batch and waits
for all PUBACKs together.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from .._messages import Message
from ..errors import RetryableError
from ._common import envelope_json, missing_extra

try:
    import paho.mqtt.client as mqtt
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    missing_extra("mqtt", exc)

__all__ = ["MQTTPublisher"]


class MQTTPublisher:
    """``MQTTPublisher("127.0.0.1", 1883, topic_prefix="orders")``."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 1883,
        *,
        topic: Callable[[Message], str] | None = None,
        topic_prefix: str = "outbox",
        qos: int = 1,
        timeout: float = 5.0,
    ) -> None:
        self.host, self.port, self.qos, self.timeout = host, port, qos, timeout
        self.topic = topic or (lambda m: f"{topic_prefix}/{m.event_type}")
        self._client: Any = None
        self._connected = threading.Event()

    def _ensure(self) -> Any:
        if self._client is not None and self._client.is_connected():
            return self._client
        self.close()
        version = mqtt.CallbackAPIVersion.VERSION2  # type: ignore[attr-defined]
        client = mqtt.Client(version, client_id=f"sa-outbox-{uuid.uuid4().hex[:8]}")
        self._connected.clear()
        client.on_connect = lambda c, userdata, flags, reason, props: self._connected.set()
        try:
            client.connect(self.host, self.port, keepalive=30)
        except OSError as exc:
            raise RetryableError(f"mqtt broker unavailable at {self.host}:{self.port}: {exc}") from exc
        client.loop_start()
        if not self._connected.wait(self.timeout):
            client.loop_stop()
            raise RetryableError(
                f"mqtt broker at {self.host}:{self.port} did not accept the connection in time"
            )
        self._client = client
        return client

    def _send(self, client: Any, message: Message) -> Any:
        info = client.publish(self.topic(message), envelope_json(message), qos=self.qos)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            raise RetryableError(f"mqtt publish refused: {mqtt.error_string(info.rc)}")
        return info

    def _wait(self, info: Any) -> BaseException | None:
        try:
            info.wait_for_publish(self.timeout)
        except (RuntimeError, ValueError) as exc:
            return RetryableError(f"mqtt publish failed: {exc}")
        return None if info.is_published() else RetryableError(f"no PUBACK within {self.timeout:g}s")

    def publish(self, message: Message) -> None:
        error = self._wait(self._send(self._ensure(), message))
        if error is not None:
            self.close()
            raise error

    def publish_many(self, messages: Sequence[Message]) -> list[BaseException | None]:
        try:
            client = self._ensure()
            infos = [self._send(client, m) for m in messages]
        except RetryableError as exc:
            return [exc] * len(messages)
        return [self._wait(info) for info in infos]

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.disconnect()
            client.loop_stop()
