"""Payload encoding: what an event or job payload may contain, decided once for the producer.

A payload is stored as ``jsonb``. At flush the producer turns it into plain JSON values with these rules:

* ``dict`` (string keys), ``list``/``tuple``, ``str``, ``int``, ``float``, ``bool`` and ``None`` pass as is;
* ``datetime``/``date``/``time`` become ISO 8601 strings (``datetime.isoformat()``), ``uuid.UUID`` its
  canonical string, ``decimal.Decimal`` a *string* (a JSON number would lose precision in most
  consumers), an ``enum.Enum`` its ``value`` (encoded by the same rules);
* ``int``/``float``/``bool``/``None`` dict keys become JSON strings as in :func:`json.dumps`; a dict that
  mixes them with string keys (or with each other's types) is refused, because two keys could become one
  (``1`` and ``"1"``) and ``jsonb`` would silently keep only the last;
* everything else (``bytes``, ``set``, arbitrary objects, other key types), ``NaN``/``Infinity`` and the NUL
  character (which ``jsonb`` cannot store; the six characters ``\\u0000`` are ordinary text) is refused with
  :class:`~sa_outbox.errors.PayloadError`.

The encoded size is checked against the model's ``sa_outbox_max_payload_bytes``.

Headers (:func:`check_headers`) are a mapping of header names to string values that travel to the broker's
own header slot; they are checked so that every broker adapter can carry them as they are (see that function).

The row's other values have limits of their own, checked here too so that they are a ``PayloadError``
before any SQL rather than a database error at flush: integers must fit their column (``integer``,
``bigint``), and text in a btree index must fit one index entry (:func:`check_index_entries`).
"""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import functools
import json
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Integer,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    UniqueConstraint,
)
from sqlalchemy.sql.elements import UnaryExpression

from .errors import PayloadError

__all__ = [
    "BTREE_MAX_ENTRY",
    "HEADER_NAME_MAX",
    "check_headers",
    "check_index_entries",
    "check_int",
    "check_payload",
    "encode_payload",
    "index_safe_chars",
    "normalize_payload",
    "require_text",
]


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
# the second. sort_keys makes the C encoder compare every dict's keys: keys of types that could turn into the
# same JSON key (1 and "1", None and "null") cannot be compared, so such a dict raises TypeError instead of
# being collapsed by jsonb (which keeps one object key; the order of the text's keys means nothing to it).
_PLAIN = json.JSONEncoder(default=_plain_only, allow_nan=False, separators=(",", ":"), sort_keys=True)
_CONVERTING = json.JSONEncoder(default=_default, allow_nan=False, separators=(",", ":"), sort_keys=True)
# A NUL character is encoded as \u0000 after an even number of backslashes (0, 2, …); the text "\u0000" is
# encoded as \\u0000 (the backslash escaped), which is ordinary text.
_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
# The payload again, its text left as it is: a lone surrogate (which a Python string may hold, and jsonb
# refuses) then fails the UTF-8 encoding, in C. Searched for in the ASCII text instead — "\\udXXX" escapes,
# every emoji a pair of them — a regular expression cost 10x the encoding (a hostile review: 2 MB of emoji,
# 18 -> 202 ms; this: 4 ms), and only a payload with such an escape is encoded twice.
_RAW = json.JSONEncoder(
    default=_default, allow_nan=False, separators=(",", ":"), sort_keys=True, ensure_ascii=False
)


def _lone_surrogate(payload: Any) -> str | None:
    """The first lone surrogate in ``payload``'s text (as ``\\uXXXX``), or None. A high and a low surrogate
    side by side are a pair (JSON escapes them as one, jsonb stores the character), as before."""
    raw = _RAW.encode(payload)
    units = raw.encode("utf-16-le", "surrogatepass")
    try:
        units.decode("utf-16-le")
    except UnicodeDecodeError as exc:
        before = len(
            units[: exc.start].decode("utf-16-le", "surrogatepass")
        )  # (a pair before it: one character)
        return f"\\u{ord(raw[before]):04x}"
    return None


_UNORDERABLE = re.compile(r"'<' not supported between instances of '(\w+)' and '(\w+)'")


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
    except TypeError as exc:  # dict keys of an unsupported type, or of types that could collide
        raise PayloadError(f"{describe(what)}: payload refused: {_key_problem(exc)}") from None
    except RecursionError:
        raise PayloadError(
            f"{describe(what)}: payload refused: nested too deeply to encode (thousands of levels)"
        ) from None
    if "\\ud" in encoded and (lone := _lone_surrogate(payload)) is not None:
        raise PayloadError(
            f"{describe(what)}: payload refused: a lone surrogate character ({lone}) is not valid Unicode and "
            "cannot be stored in jsonb"
        )
    if "\\u0000" in encoded and _NUL.search(encoded):
        raise PayloadError(
            f"{describe(what)}: payload refused: the NUL character (\\u0000) cannot be stored in jsonb"
        )
    if max_bytes is not None and len(encoded) > max_bytes:
        # The text above escapes every non-ASCII character (6 or 12 characters each): an upper bound. Over
        # the limit, the payload is measured as UTF-8 (600 KB of "é" was refused as 1.8 MB of JSON).
        size = len(_RAW.encode(payload).encode())
        if size > max_bytes:
            raise PayloadError(
                f"{describe(what)}: payload is {size} bytes of JSON, over the limit of {max_bytes} bytes "
                "(store large data elsewhere and put a reference in the event, or raise "
                "sa_outbox_max_payload_bytes on the model)"
            )
    return encoded


# PostgreSQL's text of a jsonb value: a space after every ":" and ",", non-ASCII characters as they are.
_JSONB_TEXT = json.JSONEncoder(
    default=_default, allow_nan=False, separators=(", ", ": "), sort_keys=True, ensure_ascii=False
)
# A number in exponent notation, which the json module writes for a float below 1e-4 or from 1e16 on.
_EXPONENT = re.compile(r"[0-9][eE][+-]?[0-9]")


def jsonb_text_over(payload: Any, encoded: str, max_bytes: int) -> int | None:
    """The UTF-8 size of ``payload`` (``encoded``: its JSON text from :func:`encode_payload`) as PostgreSQL writes
    the jsonb value back as text — what logical decoding sends for it: a space after every ``:`` and ``,``, and
    numbers in plain notation (jsonb keeps them as ``numeric``: ``1e+300`` comes back as 301 digits) — when it
    is over ``max_bytes``; else None. Measured only when the cheap bound (twice the compact text, which holds
    without numbers in exponent notation) is over it."""
    exponents = _EXPONENT.search(encoded)
    if 2 * len(encoded) <= max_bytes and not exponents:
        return None
    size = len(_JSONB_TEXT.encode(payload).encode())
    if exponents:
        floats: list[str] = []
        json.loads(encoded, parse_float=floats.append)
        size += sum(len(format(decimal.Decimal(f), "f")) - len(f) for f in floats if "e" in f or "E" in f)
    return size if size > max_bytes else None


def _key_problem(exc: TypeError) -> str:
    found = _UNORDERABLE.search(str(exc))
    if found is None:
        return str(exc)
    a, b = sorted(found.groups())
    kinds = "string and non-string keys" if "str" in (a, b) else "keys of different types"
    return (
        f"a dict mixes {kinds} ({a} and {b}): JSON object keys are strings, so two keys could become one "
        '(1 and "1", None and "null") and only the last would be kept; use keys of one type (strings)'
    )


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


# --- limits of the row's other values ---------------------------------------------------------------------


def require_text(value: Any, what: str | Callable[[], str], name: str) -> str:
    """``value`` as non-empty text without NUL (an int is taken as its decimal text), or PayloadError."""
    if type(value) is str and value and not value.isspace() and "\x00" not in value and value.isascii():
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise PayloadError(f"{describe(what)}: {name} must be a non-empty string, got {value!r}")
    return check_encodable(value, what, name)


def check_concurrency_key(value: Any, what: str | Callable[[], str]) -> str | None:
    """A job's ``concurrency_key``: None, or text PostgreSQL can store (:func:`check_encodable`), or
    PayloadError."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise PayloadError(f"{describe(what)}: concurrency_key must be a string, got {value!r:.80}")
    return check_encodable(value, what, "concurrency_key")


def check_encodable(value: str, what: str | Callable[[], str], name: str) -> str:
    """``value`` if it is text PostgreSQL can store (no NUL, valid Unicode: no lone surrogate), or
    PayloadError."""
    if "\x00" in value:
        raise PayloadError(f"{describe(what)}: {name} contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PayloadError(
            f"{describe(what)}: {name} is not valid Unicode ({exc.reason} at character {exc.start})"
        ) from None
    return value


def check_int(value: Any, *, what: str | Callable[[], str], name: str, low: int, high: int) -> int:
    """``value`` as an int within ``[low, high]`` (the column's range), or PayloadError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PayloadError(f"{describe(what)}: {name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise PayloadError(f"{describe(what)}: {name} must be between {low} and {high}, got {value}")
    return value


#: The largest btree index entry PostgreSQL stores with its default 8 KiB pages (``BTMaxItemSize``: a third of
#: a page less the page overheads). A longer entry fails the INSERT ("index row size … exceeds btree version 4
#: maximum 2704"). The database compresses long values first, but text that does not compress (random ids,
#: hashes) is stored as is, so the limit is checked on the uncompressed size.
BTREE_MAX_ENTRY = 2704

_FIXED: tuple[tuple[type[Any], int], ...] = (
    (BigInteger, 8),
    (SmallInteger, 2),
    (Integer, 4),
    (DateTime, 8),
    (Float, 8),
    (Boolean, 1),
)  # fmt: skip  (size = alignment for these; subclasses before their bases)


@dataclass(frozen=True, slots=True)
class _Slot:
    key: str
    size: int  # 0: text (varlena), else a fixed-size value aligned to its size
    nullable: bool


@dataclass(frozen=True, slots=True)
class _IndexEntry:
    """The layout of one btree index's entries, for :func:`check_index_entries`."""

    name: str
    slots: tuple[_Slot, ...]
    text_keys: tuple[str, ...]
    #: Text of at most this many characters in total always fits (4 bytes per character at worst).
    safe_chars: int


def _align(offset: int, to: int) -> int:
    return (offset + to - 1) // to * to


def _entry_size(entry: _IndexEntry, values: Mapping[str, Any], lengths: Mapping[str, int]) -> int:
    """The size of the entry PostgreSQL builds for these values (``index_form_tuple``, uncompressed)."""
    has_null = any(slot.nullable and slot.key in values and values[slot.key] is None for slot in entry.slots)
    offset = 16 if has_null else 8  # IndexTupleData, plus the null bitmap, MAXALIGNed
    for slot in entry.slots:
        if slot.size:
            if not (slot.nullable and slot.key in values and values[slot.key] is None):
                offset = _align(offset, slot.size) + slot.size
        elif slot.key in lengths:
            n = lengths[slot.key]
            # a short varlena (1-byte header, unaligned) up to 126 bytes, else a 4-byte header aligned to 4
            offset = offset + 1 + n if n <= 126 else _align(offset, 4) + 4 + n
    return _align(offset, 8)


@functools.cache
def _index_entries(table: Table) -> tuple[_IndexEntry, ...]:
    """The btree indexes (and primary key / unique constraints) of ``table`` that hold text columns and whose
    layout is known (plain columns of the types above and text); expression indexes are skipped."""
    # Constraints first: they index every row (an index may be partial, a refusal names the constraint).
    groups: list[tuple[str, list[Any]]] = [
        (str(c.name), list(c.columns))
        for c in sorted(table.constraints, key=lambda c: c is not table.primary_key)
        if isinstance(c, PrimaryKeyConstraint | UniqueConstraint)
    ]
    groups += [
        (str(ix.name), list(ix.expressions))
        for ix in table.indexes
        if (ix.dialect_kwargs.get("postgresql_using") or "btree") == "btree"
    ]
    found = []
    for name, expressions in groups:
        slots: list[_Slot] = []
        for expr in expressions:
            col = expr.element if isinstance(expr, UnaryExpression) else expr  # DESC / ASC
            if not isinstance(col, Column):  # desc("priority") refers to its column by name
                ref = getattr(col, "element", None)
                col = table.c.get(ref) if isinstance(ref, str) else None
            if col is None or col.table is not table:
                break
            size = (
                0
                if isinstance(col.type, String)
                else next((n for t, n in _FIXED if isinstance(col.type, t)), -1)
            )
            if size < 0:
                break
            slots.append(_Slot(col.key, size, bool(col.nullable)))
        else:
            text_keys = tuple(s.key for s in slots if not s.size)
            if text_keys:
                fixed = sum(2 * s.size for s in slots if s.size)  # size + worst alignment
                safe = (BTREE_MAX_ENTRY - 16 - fixed - 8 * len(text_keys) - 8) // 4
                found.append(_IndexEntry(name, tuple(slots), text_keys, safe))
    return tuple(found)


@functools.cache
def index_safe_chars(table: Table) -> int:
    """Text of at most this many characters in total, in any of ``table``'s indexed text columns, always fits
    its index entries (the check's fast path)."""
    return min((entry.safe_chars for entry in _index_entries(table)), default=2**62)


def check_index_entries(table: Table, values: Mapping[str, Any], *, what: str | Callable[[], str]) -> None:
    """Refuse text that would not fit an entry of one of ``table``'s btree indexes, naming the limit.

    ``values`` maps column keys to the row's values (text as ``str``); columns not given count as present.
    """
    for entry in _index_entries(table):
        chars = sum(len(v) for k in entry.text_keys if isinstance(v := values.get(k), str))
        if chars <= entry.safe_chars:
            continue
        lengths = {k: len(v.encode()) for k in entry.text_keys if isinstance(v := values.get(k), str)}
        if _entry_size(entry, values, lengths) <= BTREE_MAX_ENTRY:
            continue
        given = [k for k in entry.text_keys if k in lengths]
        total = sum(lengths.values())
        last, others = given[-1], total - lengths[given[-1]]
        low, high = 0, lengths[last]  # the longest text that fits, the other values kept as they are
        while low < high:
            mid = (low + high + 1) // 2
            if _entry_size(entry, values, {**lengths, last: mid}) <= BTREE_MAX_ENTRY:
                low = mid
            else:
                high = mid - 1
        names = " and ".join(given)
        are, together = ("is", "") if len(given) == 1 else ("are", " together")
        raise PayloadError(
            f"{describe(what)}: {names} {are} {total} bytes{together} (UTF-8); at most {others + low} bytes"
            f"{together} fit in an entry of the btree index {entry.name} ({BTREE_MAX_ENTRY} bytes per entry, "
            "uncompressed): shorten it, or keep long data in the payload"
        )


# --- headers ------------------------------------------------------------------------------------------------

#: The longest header name: an AMQP 0-9-1 header table key is a short string (255 bytes at most).
HEADER_NAME_MAX = 255
# An HTTP field name (RFC 9110 "token"): the strictest of the brokers' header slots. NATS and HTTP frame
# headers as "name: value" lines, so whitespace and ':' would break them; AMQP keys and MQTT user properties
# take any text.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Control characters other than TAB: CR/LF would split a NATS or HTTP header line, NUL cannot be stored.
_VALUE_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
#: Names a publisher needs for itself in every broker: CloudEvents attributes in binary mode (``ce-*`` in
#: HTTP, NATS and RabbitMQ headers, ``ce_*`` in Redis fields) and the HTTP framing headers.
RESERVED_HEADER_PREFIXES = ("ce-", "ce_")
RESERVED_HEADERS = frozenset({"content-length", "transfer-encoding", "host", "connection"})


def check_headers(
    headers: Any, *, what: str | Callable[[], str], max_bytes: int
) -> tuple[dict[str, str] | None, str | None]:
    """Validate headers; return them as a plain dict and as JSON text (``None``, ``None`` when there are none:
    ``None`` or an empty mapping is stored as NULL), or raise PayloadError naming ``what``.

    * a mapping (``dict``) of names to values;
    * a name is a non-empty string of at most 255 characters from the HTTP token set (letters, digits and
      ``!#$%&'*+-.^_`|~``: no whitespace, ``:`` or control characters); two names may not differ only in case
      (HTTP would merge them); ``ce-*``/``ce_*`` (CloudEvents attributes) and the HTTP framing headers
      (``Content-Length``, ``Transfer-Encoding``, ``Host``, ``Connection``) are reserved;
    * a value is a string (empty allowed, any Unicode) without control characters other than TAB;
    * names and values together are at most ``max_bytes`` bytes of UTF-8 (the model's
      ``sa_outbox_max_headers_bytes``, 8 KiB by default: what HTTP servers accept in a request's headers).
    """
    if headers is None:
        return None, None
    if not isinstance(headers, Mapping):
        raise PayloadError(
            f"{describe(what)}: headers must be a mapping of header names to string values, "
            f"got {type(headers).__name__}"
        )
    if not headers:
        return None, None
    size = 0
    lowered: set[str] = set()
    for name, value in headers.items():
        if not isinstance(name, str):
            raise PayloadError(f"{describe(what)}: header names must be strings, got {name!r:.80}")
        if not name:
            raise PayloadError(f"{describe(what)}: a header name must be non-empty")
        if len(name) > HEADER_NAME_MAX or _TOKEN.fullmatch(name) is None:
            raise PayloadError(
                f"{describe(what)}: {name!r:.80} is not a valid header name (at most {HEADER_NAME_MAX} "
                "letters, digits and !#$%&'*+-.^_`|~; no spaces, ':' or control characters)"
            )
        low = name.lower()
        if low in RESERVED_HEADERS or low.startswith(RESERVED_HEADER_PREFIXES):
            raise PayloadError(
                f"{describe(what)}: header name {name!r} is reserved (ce-*/ce_* carry CloudEvents attributes, "
                "and Content-Length, Transfer-Encoding, Host and Connection frame HTTP requests)"
            )
        if low in lowered:
            raise PayloadError(
                f"{describe(what)}: header names that differ only in case ({name!r}) would be merged by HTTP; "
                "use one spelling"
            )
        lowered.add(low)
        if not isinstance(value, str):
            raise PayloadError(
                f"{describe(what)}: the value of header {name!r} must be a string, got {type(value).__name__}"
            )
        if _VALUE_CONTROL.search(value) is not None:
            raise PayloadError(
                f"{describe(what)}: the value of header {name!r} contains a control character (only TAB is "
                "allowed: CR/LF would split a header line and NUL cannot be stored)"
            )
        if value.isascii():
            size += len(name) + len(value)
        else:
            size += len(name) + len(check_encodable(value, what, f"the value of header {name!r}").encode())
    if size > max_bytes:
        raise PayloadError(
            f"{describe(what)}: headers are {size} bytes (names and values, UTF-8), over the limit of "
            f"{max_bytes} bytes (keep large data in the payload, or raise sa_outbox_max_headers_bytes on the "
            "model)"
        )
    plain = dict(headers)
    return plain, json.dumps(plain, separators=(",", ":"))
