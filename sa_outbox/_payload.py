"""Payload encoding: what an event or job payload may contain, decided once for the producer.

A payload is stored as ``jsonb``. At flush the producer turns it into plain JSON values with these rules:

* ``dict`` (string keys), ``list``/``tuple``, ``str``, ``int``, ``float``, ``bool`` and ``None`` pass as is;
* ``datetime``/``date``/``time`` become ISO 8601 strings (``datetime.isoformat()``), ``uuid.UUID`` its
  canonical string, ``decimal.Decimal`` a *string* (a JSON number would lose precision in most
  consumers), an ``enum.Enum`` its ``value`` (encoded by the same rules);
* everything else (``bytes``, ``set``, arbitrary objects), ``NaN``/``Infinity``, non-string keys and the
  NUL character (which ``jsonb`` cannot store) is refused with :class:`~sa_outbox.errors.PayloadError`.

The encoded size is checked against the model's ``sa_outbox_max_payload_bytes``.
"""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import json
import uuid
from collections.abc import Callable
from typing import Any

from .errors import PayloadError

__all__ = ["check_payload", "encode_payload", "normalize_payload"]


class _Refused(TypeError):
    pass


def _default(value: Any) -> Any:
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise _Refused(f"non-finite Decimal {value!r}")
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    raise _Refused(f"value of type {type(value).__name__} ({value!r:.80}) is not JSON-serialisable")


class _NeedsConversion(Exception):
    pass


def _plain_only(value: Any) -> Any:
    raise _NeedsConversion


# Built once: json.dumps with non-default options would build a new encoder per call. The first encodes plain
# JSON values only (the common case, one C-speed pass); a payload that needs a conversion is encoded again by
# the second.
_PLAIN = json.JSONEncoder(default=_plain_only, allow_nan=False, separators=(",", ":"))
_CONVERTING = json.JSONEncoder(default=_default, allow_nan=False, separators=(",", ":"))


def encode_payload(
    payload: Any,
    *,
    what: str | Callable[[], str],
    max_bytes: int | None = None,
    converted: list[bool] | None = None,
) -> str:
    """Encode ``payload`` to a JSON string by the rules above, or raise PayloadError naming ``what`` (a string,
    or a function building it — only called for the error message). ``converted`` (a one-element list) is
    set to True when a value needed one of the conversions."""
    if payload is None:
        raise PayloadError(f"{describe(what)}: payload is required (use {{}} for an empty payload)")
    try:
        try:
            encoded = _PLAIN.encode(payload)
        except _NeedsConversion:
            encoded = _CONVERTING.encode(payload)
            if converted is not None:
                converted[0] = True
    except _Refused as exc:
        raise PayloadError(f"{describe(what)}: payload refused: {exc}") from None
    except ValueError as exc:  # NaN / Infinity, circular reference
        raise PayloadError(f"{describe(what)}: payload refused: {exc}") from None
    except TypeError as exc:  # non-string dict keys of an unsupported type
        raise PayloadError(f"{describe(what)}: payload refused: {exc}") from None
    if "\\u0000" in encoded:
        raise PayloadError(
            f"{describe(what)}: payload refused: the NUL character (\\u0000) cannot be stored in jsonb"
        )
    if max_bytes is not None:
        size = len(encoded)  # the encoders escape non-ASCII characters: one byte per character
        if size > max_bytes:
            raise PayloadError(
                f"{describe(what)}: payload is {size} bytes of JSON, over the limit of {max_bytes} bytes "
                "(store large data elsewhere and put a reference in the event, or raise "
                "sa_outbox_max_payload_bytes on the model)"
            )
    return encoded


def describe(what: str | Callable[[], str]) -> str:
    """The name of what is validated, for an error message (``what`` may build it lazily)."""
    return what if isinstance(what, str) else what()


def normalize_payload(payload: Any, *, what: str | Callable[[], str], max_bytes: int | None = None) -> Any:
    """The payload as plain JSON values (what the database will hold), validated."""
    return json.loads(encode_payload(payload, what=what, max_bytes=max_bytes))


def check_payload(
    payload: Any, *, what: str | Callable[[], str], max_bytes: int | None = None
) -> tuple[Any, str]:
    """Validate; return the payload as plain JSON values and its JSON text. A payload that needed no
    conversion is returned as is (no decode round trip)."""
    converted = [False]
    encoded = encode_payload(payload, what=what, max_bytes=max_bytes, converted=converted)
    return (json.loads(encoded) if converted[0] else payload), encoded
