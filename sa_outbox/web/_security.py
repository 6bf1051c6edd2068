"""Who may act, and proof that a form was sent by the dashboard's own page.

* **Authentication** is the host application's: a callable that gets the Starlette ``Request`` and returns
  the user's name (any non-empty string, written to the action log) or ``None`` to refuse; it may be a
  coroutine function. :class:`TokenAuth` is the one ``sa-outbox dashboard`` uses: a shared secret sent as
  ``Authorization: Bearer …`` or kept in an HttpOnly, SameSite=Strict cookie after ``/login``.
* **Host names**: a dashboard without authentication answers only requests whose ``Host`` is one of
  ``allowed_hosts`` — by default the loopback names — so a web page the operator opens elsewhere cannot read
  it through DNS rebinding (its name made to resolve to 127.0.0.1: the browser then sends that name).
* **CSRF**: every form carries a token that is an HMAC of the authenticated user's name and the time it was
  issued, under a key only this process (or the ``csrf_secret`` the host gives, for several processes)
  knows; a POST without a valid, unexpired token for the same user is refused, and so is one whose
  ``Origin`` names another host or whose ``Sec-Fetch-Site`` says ``cross-site``.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

from starlette.requests import Request

from ..errors import ConfigurationError

#: The host application's authentication hook: the request → the user's name, or ``None`` to refuse.
Authenticate = Callable[[Request], "str | Awaitable[str | None] | None"]

#: How long a form's CSRF token stays valid (seconds).
CSRF_LIFETIME = 12 * 3600

COOKIE = "sa_outbox_dashboard_token"


class TokenAuth:
    """An authentication hook for one shared secret token: ``create_app(engine, authenticate=TokenAuth(t))``.

    A request is authenticated by ``Authorization: Bearer <token>`` or by the cookie that the dashboard's
    ``/login`` page sets (open ``/login?token=<token>`` once, or type the token there). The user's name in
    the action log is ``user`` (default ``"token"``) followed by the client's address."""

    def __init__(self, token: str, *, user: str = "token") -> None:
        if not isinstance(token, str) or len(token) < 16:
            raise ConfigurationError("the dashboard token must be a string of at least 16 characters")
        self._token = token.encode()
        self.user = user

    def valid(self, candidate: str | None) -> bool:
        return bool(candidate) and hmac.compare_digest(str(candidate).encode(), self._token)

    def __call__(self, request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        candidate = value.strip() if scheme.lower() == "bearer" else request.cookies.get(COOKIE)
        if not self.valid(candidate):
            return None
        client = request.client.host if request.client else "?"
        return f"{self.user}@{client}"


class Csrf:
    """Issues and checks the forms' tokens: ``<issued>.<hmac(user, issued)>``."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _mac(self, user: str, issued: int) -> str:
        return hmac.new(self._secret, f"{user}\n{issued}".encode(), hashlib.sha256).hexdigest()[:40]

    def issue(self, user: str) -> str:
        issued = int(time.time())
        return f"{issued}.{self._mac(user, issued)}"

    def check(self, user: str, token: str | None) -> bool:
        if not token or "." not in token:
            return False
        issued_text, _, mac = token.partition(".")
        if not issued_text.isdigit():
            return False
        issued = int(issued_text)
        if not 0 <= time.time() - issued <= CSRF_LIFETIME:
            return False
        return hmac.compare_digest(mac, self._mac(user, issued))


def cross_site(request: Request) -> str | None:
    """Why a POST looks cross-site (``None`` when it does not): an ``Origin`` of another host, or the
    browser's own ``Sec-Fetch-Site: cross-site``."""
    if request.headers.get("sec-fetch-site") == "cross-site":
        return "Sec-Fetch-Site: cross-site"
    origin = request.headers.get("origin")
    if origin == "null":
        return "Origin null (a sandboxed or privacy-stripped page)"
    if origin:
        host = request.headers.get("host", "")
        if urlsplit(origin).netloc != host:
            return f"Origin {origin} is not this host ({host})"
    return None


#: The names a dashboard without authentication answers to by default: the loopback ones.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def host_name(header: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:8000`` → ``::1``), lower-cased."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def allowed_host_names(hosts: Sequence[str] | None, authenticated: bool) -> tuple[str, ...] | None:
    """The host names a dashboard answers to (None: any): those given (``"*"`` allows any), else the loopback
    names without authentication and any with it."""
    if hosts is None:
        return None if authenticated else LOOPBACK_HOSTS
    if isinstance(hosts, str) or not all(isinstance(h, str) and h.strip() for h in hosts):
        raise ConfigurationError(f"allowed_hosts must be a list of host names (or ['*']), got {hosts!r}")
    names = tuple(host_name(h) for h in hosts)
    return None if "*" in names else names
