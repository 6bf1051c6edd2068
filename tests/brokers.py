"""Private broker instances and a TCP proxy for the publisher fault tests.

The machine's shared brokers (Redis 6379, RabbitMQ 5672, NATS 4222, Mosquitto 1883) are used by other test
runs at the same time: nothing here stops, restarts or reconfigures them. Outages, restarts, broker-side
limits and hangs happen on a private server started on a free port (its own temporary directory, removed
afterwards) or behind a :class:`TcpProxy` that a test can freeze (bytes stop flowing, sockets stay open) or
cut (every connection dropped) while the real broker keeps running.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "PrivateMosquitto",
    "PrivateNats",
    "PrivateRabbit",
    "PrivateRedis",
    "TcpProxy",
    "closed_port",
    "free_port",
    "running",
    "wait_port",
]


def redis_call(url: str, command: str, *args: Any, decode: bool = False) -> Any:
    """One Redis command on a client closed right after. A one-shot ``Redis.from_url(…).command()`` leaves the
    closing to ``__del__``; collected in a reference cycle, its socket's finalizer may run first — an "unclosed
    socket" ResourceWarning, an error under the suite's filterwarnings, at whatever test the collector ran in
    (CI failed once so, in test_redis_readonly_replica_is_transient, which used two such clients)."""
    import redis

    with redis.Redis.from_url(url, decode_responses=decode) as client:
        return getattr(client, command)(*args)


def free_port() -> int:
    """A TCP port nothing listens on right now (the kernel picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def closed_port() -> int:
    """A port that refuses connections (nothing listens on it)."""
    return free_port()


def wait_port(port: int, timeout: float = 15.0) -> None:
    """Until something accepts TCP connections on ``port``; ``TimeoutError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout:g}s") from None
            time.sleep(0.05)


S = TypeVar("S", bound="_Server")


@contextlib.contextmanager
def running(server: S) -> Iterator[S]:
    """``server`` started for the ``with`` block, then stopped and its directory removed."""
    server.start()
    try:
        yield server
    finally:
        server.close()


class _Server:
    """One private server process on a port of its own, in a temporary directory deleted by ``close``."""

    name = "server"
    #: How long its port may take to open (a loaded CI box boots an Erlang VM slowly).
    boot_timeout = 15.0

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"sa_outbox_{self.name}_"))
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> Sequence[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str] | None:
        return None

    def start(self) -> None:
        log = (self.dir / "out.log").open("ab")
        self.proc = subprocess.Popen(
            list(self.command()), stdout=log, stderr=subprocess.STDOUT, env=self.env(), cwd=self.dir
        )
        log.close()
        try:
            wait_port(self.port, self.boot_timeout)
        except TimeoutError:
            self.stop()
            raise RuntimeError(
                f"{self.name} did not start: {(self.dir / 'out.log').read_text()[-2000:]}"
            ) from None

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateRedis(_Server):
    """``redis-server`` on a free port, no persistence; ``args`` are extra server options."""

    name = "redis"

    def __init__(self, *args: str) -> None:
        super().__init__()
        self.args = args

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self, *, save: bool = False) -> None:
        """Shut the server down; with ``save`` it writes its dataset first (``SHUTDOWN SAVE``) and the next
        :meth:`start` loads it: a restart that keeps what the server acknowledged."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(
                OSError, subprocess.SubprocessError
            ):  # quick exit even when a save fails
                subprocess.run(["redis-cli", "-p", str(self.port), "shutdown", "save" if save else "nosave"],
                               capture_output=True, timeout=30 if save else 5, check=False)  # fmt: skip
        super().stop()

    def command(self) -> Sequence[str]:
        return ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--dir", str(self.dir), *self.args]  # fmt: skip


class PrivateNats(_Server):
    """``nats-server`` with JetStream on a free port; ``max_payload`` in bytes when given."""

    name = "nats"

    def __init__(self, *, max_payload: int | None = None) -> None:
        super().__init__()
        conf = [f"port: {self.port}", 'host: "127.0.0.1"', f'jetstream {{ store_dir: "{self.dir / "js"}" }}']
        if max_payload is not None:
            conf.append(f"max_payload: {max_payload}")
        (self.dir / "nats.conf").write_text("\n".join(conf) + "\n")

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def command(self) -> Sequence[str]:
        return ["nats-server", "-c", str(self.dir / "nats.conf")]


class PrivateMosquitto(_Server):
    """``mosquitto`` on a free port, anonymous clients allowed."""

    name = "mosquitto"

    def __init__(self) -> None:
        super().__init__()
        (self.dir / "mosquitto.conf").write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\n")

    def command(self) -> Sequence[str]:
        return ["mosquitto", "-c", str(self.dir / "mosquitto.conf")]


class PrivateRabbit(_Server):
    """A private RabbitMQ node (own node name, ports, Mnesia and cookie under a temporary HOME).

    About 5–10 s to boot: start it once per module. ``ctl(...)`` runs ``rabbitmqctl`` against it (e.g.
    ``ctl("set_policy", …)``); ``restart()`` stops the node process and starts it again on the same port with
    the same data (durable queues and policies survive).
    """

    name = "rabbitmq"
    BIN = "/usr/lib/rabbitmq/bin"
    boot_timeout = 60.0  # 5–10 s on a quiet box; a CI run saw it miss 15 s while the suite ran beside it

    def __init__(self) -> None:
        super().__init__()
        self.node = f"saopub{uuid.uuid4().hex[:8]}@localhost"
        self.dist_port = free_port()
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / "rabbitmq-env.conf").write_text("")

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    def env(self) -> dict[str, str]:
        d = self.dir
        return {
            **os.environ,
            "HOME": str(d),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(d / "pid"),
        }

    def command(self) -> Sequence[str]:
        return [f"{self.BIN}/rabbitmq-server"]

    def start(self) -> None:
        super().start()
        # The AMQP port opens before the broker is fully booted: wait for the applications too.
        self.ctl("await_startup", "--timeout", "60", timeout=70)

    def ctl(self, *args: str, timeout: float = 30) -> str:
        out = subprocess.run(
            [f"{self.BIN}/rabbitmqctl", "-n", self.node, *args],
            env=self.env(), capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {out.stdout}{out.stderr}")
        return out.stdout

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.ctl("stop", timeout=30)
        super().stop()


class TcpProxy:
    """A TCP proxy in front of ``127.0.0.1:target`` that a test can freeze, thaw, cut, refuse and accept.

    * ``freeze()``: no byte moves in either direction; connections (and new ones) stay open — a hung peer.
    * ``cut()``: every current connection is reset — a broker restart or a network drop.
    * ``refuse()`` / ``accept()``: stop / start listening — connections are refused meanwhile.
    * ``gate(i, to_server=…, to_client=…)``: hold (False) or let flow (True) one direction of the ``i``-th
      connection accepted, the others untouched.
    """

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._gates: list[
            tuple[threading.Event, threading.Event]
        ] = []  # per connection: to server, to client
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self.accept()

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    def accept(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.1)
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept_loop, args=(listener,), daemon=True)
        self._acceptor.start()

    def refuse(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        if self._acceptor is not None:
            self._acceptor.join(5)

    def gate(self, i: int, *, to_server: bool | None = None, to_client: bool | None = None) -> None:
        for event, flowing in zip(self._gates[i], (to_server, to_client), strict=True):
            if flowing is not None:
                event.set() if flowing else event.clear()

    def freeze(self) -> None:
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    def cut(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._closed.set()
        self._flowing.set()
        self.refuse()
        self.cut()

    def _accept_loop(self, listener: socket.socket) -> None:
        while self._listener is listener and not self._closed.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                client.close()
                continue
            gates = (threading.Event(), threading.Event())
            for g in gates:
                g.set()
            with self._lock:
                self._conns += [client, upstream]
                self._gates.append(gates)
            for src, dst, own in ((client, upstream, gates[0]), (upstream, client, gates[1])):
                threading.Thread(target=self._pump, args=(src, dst, own), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, own: threading.Event) -> None:
        src.settimeout(0.1)
        try:
            while not self._closed.is_set():
                self._flowing.wait()
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                while not (self._flowing.is_set() and own.is_set()) and not self._closed.is_set():
                    self._flowing.wait(0.1)  # frozen: hold what was read, send nothing
                    own.wait(0.1)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
