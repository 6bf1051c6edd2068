"""MQTT publisher (extra ``mqtt``, paho-mqtt): QoS 1 (at least once) to a broker such as Mosquitto.

MQTT has no server-side de-duplication: the JSON envelope carries ``message_id`` for the consumer to
de-duplicate on (QoS 1 itself may redeliver). The topic comes from the event (default ``<prefix>/<event_type>``).

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

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from .._durations import Duration, to_seconds
from .._messages import Message
from ..errors import DestinationUnavailable, PermanentError, RetryableError
from ._common import envelope_json, missing_extra

try:
    import paho.mqtt.client as mqtt
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    missing_extra("mqtt", exc)

__all__ = ["MQTTPublisher"]


class MQTTPublisher:
    """``MQTTPublisher("127.0.0.1", 1883, topic_prefix="orders")``. Use it from one thread at a time."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 1883,
        *,
        topic: Callable[[Message], str] | None = None,
        topic_prefix: str = "outbox",
        qos: int = 1,
        timeout: Duration = 5.0,
    ) -> None:
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
            version, client_id=f"sa-outbox-{uuid.uuid4().hex[:8]}", reconnect_on_failure=False
        )
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
                info = client.publish(self.topic(m), envelope_json(m), qos=self.qos)
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
                results[i] = RetryableError(f"no PUBACK within {self.timeout:g}s (the connection is dropped)")
        if down is not None or len(acked) < len(waiting):
            self.close()
        return results

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
