"""CDC mode: Debezium reads the outbox from the WAL instead of a dispatcher polling it.

A :class:`~sa_outbox.CdcOutboxMixin` table is insert-only (by default each row is deleted again in the
transaction that wrote it: the WAL keeps the insert). Debezium's PostgreSQL connector streams its changes
through ``pgoutput`` and its outbox event router (``io.debezium.transforms.outbox.EventRouter``) turns each
insert into a Kafka record. This module writes what that needs:

* :func:`debezium_config` — the Kafka Connect JSON of the connector (``sa-outbox cdc debezium-config``);
* :func:`setup_sql` — the publication and the replication slot, to create *before* the first event is written
  (``sa-outbox cdc setup-sql``): in insert-then-delete mode, an event committed before the slot exists is in
  no table and in no slot's WAL — it is gone;
* :func:`headers_from_debezium` — a consumer's view of the record's headers (the event's own headers travel
  as one JSON header).

The record the configuration produces, next to what :class:`~sa_outbox.publishers.kafka.KafkaPublisher` sends
for the same event (see docs/cdc.md): the same topic (``outbox.event.<aggregate_type>``), the same key bytes
(``aggregate_id`` as UTF-8, hence the same partition), the same ``message_id``, ``event-type``,
``aggregate-type`` and ``aggregate-id`` headers; the value is the payload itself (not the envelope), the id is
a UUID, and the event's own headers are one ``outbox-headers`` header holding their JSON object.

Field names are Debezium's, from its documentation (checked by ``tests/test_cdc.py``); Debezium itself is not
run by the tests — PostgreSQL's logical decoding of the same table is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Table
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from ._payload import describe, jsonb_text_over
from .errors import ConfigurationError, PayloadError

if TYPE_CHECKING:
    from sqlalchemy import Engine

__all__ = [
    "COLUMNS",
    "DEFAULT_TOPIC_REPLACEMENT",
    "OUTBOX_HEADERS",
    "check_event",
    "debezium_config",
    "headers_from_debezium",
    "setup_sql",
    "span_context",
]

#: The columns of a ``CdcOutboxMixin`` table.
COLUMNS = frozenset(
    {
        "id",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "payload",
        "headers",
        "tracingspancontext",
        "created_at",
    }
)
#: The event router's topic: ``outbox.event.`` and the aggregate type — the topic KafkaPublisher's default
#: ``topic_prefix`` gives the same event.
DEFAULT_TOPIC_REPLACEMENT = "outbox.event.${routedByValue}"
#: The Kafka header that carries the event's own headers (a JSON object; absent or null for none).
OUTBOX_HEADERS = "outbox-headers"

# Columns → Kafka headers (``table.fields.additional.placement``: ``column:header:alias``): the header names
# KafkaPublisher writes, so that a consumer reads both the same way (message_id_from_kafka included).
_HEADER_PLACEMENT = (
    ("id", "message_id"),
    ("event_type", "event-type"),
    ("aggregate_type", "aggregate-type"),
    ("aggregate_id", "aggregate-id"),
    ("created_at", "created-at"),
    ("headers", OUTBOX_HEADERS),
)
_PREDICATE = "outbox_table"
# PostgreSQL: "Each replication slot has a name, which can contain lower-case letters, numbers, and the
# underscore character" (at most NAMEDATALEN - 1 = 63 bytes). Publications get the same name.
_SLOT_NAME = re.compile(r"[a-z0-9_]{1,63}")
# Debezium: topic.prefix takes "alphanumeric characters, hyphens, dots and underscores".
_TOPIC_PREFIX = re.compile(r"[A-Za-z0-9._-]+")
_TOPIC_CHAR = re.compile(r"[A-Za-z0-9._-]")


# --- names ---------------------------------------------------------------------------------------------------


def _table_of(model: Any) -> Table:
    table = model if isinstance(model, Table) else getattr(model, "__table__", None)
    if not isinstance(table, Table) or table.info.get("sa_outbox_kind") != "cdc":
        raise ConfigurationError(
            f"{getattr(model, '__name__', model)!r} is not a CdcOutboxMixin model or table: the event router "
            "needs an insert-only table (an OutboxMixin table's rows are UPDATEd by the dispatcher)"
        )
    return table


def _default_name(table: str) -> str:
    return f"sa_outbox_{re.sub(r'[^a-z0-9_]', '_', table.lower())}"[:63]


def _names(table: str, slot_name: str | None, publication_name: str | None) -> tuple[str, str]:
    """The replication slot's and the publication's names: the given ones, else ``sa_outbox_<table>`` (both)."""
    slot = _slot(slot_name, table, "slot name")
    return slot, _slot(slot if publication_name is None else publication_name, table, "publication name")


def _slot(name: str | None, table: str, what: str) -> str:
    slot = _default_name(table) if name is None else name
    if not _SLOT_NAME.fullmatch(slot):
        raise ConfigurationError(
            f"{what} {slot!r}: PostgreSQL replication slot names can contain lower-case letters, numbers, and "
            "the underscore character (at most 63)"
        )
    return slot


def _java_regex_literal(text_: str) -> str:
    """``text_`` as a regular expression that matches exactly it (Java and Python agree on these escapes)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text_)


def _include_list_literal(text_: str) -> str:
    """``text_`` as one entry of a Debezium include list: a regular expression that matches exactly it, in a
    list Debezium splits at commas and whose entries it trims — so a comma, and a blank or control character
    (a table named ``"a,b"`` or ``" t"``), are written as ``\\xHH`` escapes, which the split leaves alone."""
    return re.sub(r"[,\x00-\x20\x7f]", lambda m: f"\\x{ord(m.group()):02x}", _java_regex_literal(text_))


def _debezium_topic(name: str) -> str:
    """The topic Debezium's default naming gives ``name`` (``<prefix>.<schema>.<table>``): every UTF-16 code
    unit outside ``A-Z a-z 0-9 . _ -`` replaced with ``_``, cut at 249 — a table ``"Tenant A".Outbox`` streams
    to ``<prefix>.Tenant_A.Outbox``, which is what the router's predicate must match."""
    units = "".join(ch if _TOPIC_CHAR.fullmatch(ch) else "_" * (2 if ord(ch) > 0xFFFF else 1) for ch in name)
    cut = units[:249]
    return {".": "_", "..": "__"}.get(cut, cut)


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


# --- the connector configuration and the setup SQL ------------------------------------------------------------


def debezium_config(
    model: Any,
    *,
    url: str | URL,
    schema: str | None = None,
    name: str | None = None,
    topic_prefix: str | None = None,
    slot_name: str | None = None,
    publication_name: str | None = None,
    topic_replacement: str = DEFAULT_TOPIC_REPLACEMENT,
    password: str | None = None,
) -> dict[str, Any]:
    """The Kafka Connect REST body (``{"name": …, "config": {…}}``) of a Debezium PostgreSQL connector that
    streams ``model``'s table (a ``CdcOutboxMixin`` model or its ``Table``) through the outbox event router.

    ``url`` is the database as Debezium reaches it — PostgreSQL itself, not PgBouncer (the replication
    protocol does not pass a pooler), as a role with the ``REPLICATION`` attribute; its password is never
    copied: pass ``password`` (a Kafka Connect config provider reference such as
    ``${file:/secrets/pg.properties:password}`` is best). ``schema`` defaults to the table's, else ``public``.
    ``slot_name`` and ``publication_name`` default to ``sa_outbox_<table>``, ``name`` to ``sa-outbox-<table>``
    and ``topic_prefix`` (Debezium's namespace for its own topics) to the slot name. All values are strings,
    as the REST API takes them.
    """
    table = _table_of(model)
    return _config(schema or table.schema or "public", table.name, url=url, name=name, topic_prefix=topic_prefix,
                   slot_name=slot_name, publication_name=publication_name, topic_replacement=topic_replacement,
                   password=password)  # fmt: skip


def _config(
    schema: str, table: str, *, url: str | URL, name: str | None, topic_prefix: str | None, slot_name: str | None,
    publication_name: str | None, topic_replacement: str, password: str | None,
) -> dict[str, Any]:  # fmt: skip
    try:
        db = make_url(url)
        port = 5432 if db.port is None else db.port  # (a port that is no number fails here)
    except (ArgumentError, ValueError) as exc:
        raise ConfigurationError(
            f"invalid database URL for Debezium: {exc}; expected postgresql://USER@HOST:PORT/DATABASE"
        ) from None
    if db.get_backend_name() != "postgresql":
        raise ConfigurationError(
            f"the database URL is not PostgreSQL's ({db.drivername}://…): Debezium's PostgreSQL connector is "
            "configured here; expected postgresql://USER@HOST:PORT/DATABASE"
        )
    if not 0 < port < 65536:
        raise ConfigurationError(f"the database URL's port {port} is not a TCP port (1–65535)")
    if db.query:
        raise ConfigurationError(
            f"the database URL has query options ({', '.join(sorted(db.query))}) that the connector config "
            "would drop: give host, port and database in the URL itself (postgresql://USER@HOST:PORT/DATABASE), "
            "and set other connector options (database.sslmode, …) in the printed config"
        )
    if not db.host or not db.database:
        raise ConfigurationError(
            f"the database URL names no host or no database ({db.render_as_string(hide_password=True)}): Debezium "
            "connects over TCP: give the URL it reaches PostgreSQL by (postgresql://USER@HOST:PORT/DATABASE)"
        )
    slot, publication = _names(table, slot_name, publication_name)
    prefix = slot if topic_prefix is None else topic_prefix
    if not _TOPIC_PREFIX.fullmatch(prefix):
        raise ConfigurationError(
            f"topic prefix {prefix!r}: Debezium takes letters, digits, hyphens, dots and underscores"
        )
    config: dict[str, str] = {
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "tasks.max": "1",
        "plugin.name": "pgoutput",
        "database.hostname": db.host,
        "database.port": str(port),
        "database.user": db.username or "postgres",
        **({"database.password": password} if password is not None else {}),
        "database.dbname": db.database,
        "topic.prefix": prefix,
        # Only the outbox table: with `filtered` the connector creates (or narrows) the publication to it.
        "table.include.list": _include_list_literal(f"{schema}.{table}"),
        "slot.name": slot,
        "publication.name": publication,
        "publication.autocreate.mode": "filtered",
        # The deletes of insert-then-delete are dropped by the router; no tombstone after them either.
        "tombstones.on.delete": "false",
        # Key = aggregate_id as plain UTF-8: KafkaPublisher's key bytes, so an aggregate keeps its partition.
        "key.converter": "org.apache.kafka.connect.storage.StringConverter",
        # Value = the payload column's text as PostgreSQL sends it: the payload's JSON, whatever its shape.
        # (Expanded by the router instead, fields holding null and empty arrays were dropped, and a top-level
        # scalar, an array of mixed numbers or an integer past 64 bits sent the whole payload as a JSON string.)
        "value.converter": "org.apache.kafka.connect.storage.StringConverter",
        # Header values as plain strings (the outbox-headers JSON object unquoted).
        "header.converter": "org.apache.kafka.connect.storage.SimpleHeaderConverter",
        "transforms": "outbox",
        "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
        "transforms.outbox.predicate": _PREDICATE,
        "transforms.outbox.table.field.event.id": "id",
        "transforms.outbox.table.field.event.key": "aggregate_id",
        "transforms.outbox.table.field.event.payload": "payload",
        "transforms.outbox.table.expand.json.payload": "false",
        "transforms.outbox.table.fields.additional.placement": ",".join(
            f"{column}:header:{alias}" for column, alias in _HEADER_PLACEMENT
        ),
        "transforms.outbox.route.by.field": "aggregate_type",
        "transforms.outbox.route.topic.replacement": topic_replacement,
        "transforms.outbox.tracing.span.context.field": "tracingspancontext",
        # The router sees only the outbox table's records (not a heartbeat's, should one be configured).
        "predicates": _PREDICATE,
        f"predicates.{_PREDICATE}.type": "org.apache.kafka.connect.transforms.predicates.TopicNameMatches",
        f"predicates.{_PREDICATE}.pattern": _java_regex_literal(
            _debezium_topic(f"{prefix}.{schema}.{table}")
        ),
    }
    if name is not None and not name.strip():
        raise ConfigurationError(f"connector name {name!r}: Kafka Connect needs a name that is not blank")
    return {"name": f"sa-outbox-{table}" if name is None else name, "config": config}


def setup_sql(
    model: Any,
    *,
    schema: str | None = None,
    slot_name: str | None = None,
    publication_name: str | None = None,
) -> list[str]:
    """The statements that create the publication (the one ``publication.autocreate.mode=filtered`` would
    create: the table only) and the ``pgoutput`` replication slot, with the names :func:`debezium_config`
    uses by default. Run them (a superuser, or the table's owner with ``REPLICATION``) before the first event
    is written — each in a transaction of its own: PostgreSQL refuses to create a logical slot in a transaction
    that has written. The slot keeps the WAL from its creation on (its creation waits for the transactions open
    then, whose events it does not hold), and the connector starts from it."""
    table = _table_of(model)
    return _setup_sql(schema or table.schema or "public", table.name, slot_name, publication_name)


def _setup_sql(schema: str, table: str, slot_name: str | None, publication_name: str | None) -> list[str]:
    slot, publication = _names(table, slot_name, publication_name)
    return [
        f"CREATE PUBLICATION {_quote(publication)} FOR TABLE {_quote(schema)}.{_quote(table)}",
        f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')",
    ]


def _check_table(
    engine: Engine,
    table: str,
    schema: str | None,
    slot_name: str | None = None,
    publication_name: str | None = None,
) -> tuple[str, list[str]]:
    """For the CLI: the table's schema, and warnings about the server, the table's replica identity and the
    slot and publication names (``slot_name``, ``publication_name``: as given, or None for the defaults) —
    a publication of that name already publishes other tables, or a default name that does not keep the table's
    name whole (``Outbox-CDC`` and ``outbox_cdc`` both give ``sa_outbox_outbox_cdc``); :class:`ConfigurationError`
    when the table is missing or is not a CdcOutboxMixin table."""
    from sqlalchemy import func, inspect, select, text

    insp = inspect(engine)
    schema = schema or insp.default_schema_name or "public"
    if not insp.has_table(table, schema=schema):
        raise ConfigurationError(
            f"no table {schema}.{table} in this database: pass --table schema.table, or create the "
            "CdcOutboxMixin table first (alembic upgrade head)"
        )
    columns = {c["name"] for c in insp.get_columns(table, schema=schema)}
    if {"status", "lease_version"} <= columns:
        raise ConfigurationError(
            f"{schema}.{table} is a polling outbox (OutboxMixin: the dispatcher UPDATEs its rows, which the event "
            "router refuses): declare a CdcOutboxMixin model for CDC"
        )
    missing = sorted(COLUMNS - columns)
    if missing:
        raise ConfigurationError(f"{schema}.{table} lacks the CdcOutboxMixin columns {', '.join(missing)}")
    warnings = []
    with engine.connect() as conn:
        wal_level = conn.execute(select(func.current_setting("wal_level"))).scalar_one()
        # the replica identity, and whether the key it names exists (DEFAULT: the primary key; INDEX: an index
        # marked as the identity) — without it, DELETEs fail as under NOTHING once the table is published
        identity, keyed = conn.execute(
            text(
                "SELECT c.relreplident, EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND "
                "CASE c.relreplident WHEN 'd' THEN i.indisprimary WHEN 'i' THEN i.indisreplident ELSE true END) "
                "FROM pg_class c WHERE c.oid = to_regclass(:name)"
            ),
            {"name": f"{_quote(schema)}.{_quote(table)}"},
        ).one()
        slot, publication = _names(table, slot_name, publication_name)
        others = sorted(
            f"{r.schemaname}.{r.tablename}"
            for r in conn.execute(
                text("SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = :p"),
                {"p": publication},
            )
            if (r.schemaname, r.tablename) != (schema, table)
        )
    if wal_level != "logical":
        warnings.append(
            f"this server has wal_level={wal_level}: Debezium needs wal_level=logical (set it, restart the "
            "server; max_replication_slots and max_wal_senders must leave room for the slot)"
        )
    if identity == "n":
        warnings.append(
            f"{schema}.{table} has REPLICA IDENTITY NOTHING: once it is in a publication, its DELETEs fail "
            f"(ALTER TABLE {_quote(schema)}.{_quote(table)} REPLICA IDENTITY DEFAULT)"
        )
    elif not keyed:
        what = "no primary key" if identity == "d" else "no replica identity index (it was dropped)"
        warnings.append(
            f"{schema}.{table} has {what}: once it is in a publication, its DELETEs fail — every producer "
            f"transaction of insert-then-delete mode (restore the primary key on id: ALTER TABLE "
            f"{_quote(schema)}.{_quote(table)} ADD PRIMARY KEY (id))"
        )
    if others:
        warnings.append(
            f"publication {publication} already publishes {', '.join(others)}: another table's names? "
            "Give this table its own (--slot-name, --publication-name)"
        )
    elif slot_name is None and publication_name is None and _default_name(table) != f"sa_outbox_{table}":
        warnings.append(
            f"the default slot and publication name {slot} does not keep the table's name {table!r} whole: "
            "another table's may be the same — give this table its own (--slot-name)"
        )
    return schema, warnings


# --- the producer's and the consumer's side ---------------------------------------------------------------


def _properties_value(value: str) -> str:
    """``value`` escaped for a ``java.util.Properties`` line (backslash, a leading space, anything outside
    printable ASCII as ``\\uXXXX``: safe for both ``load(Reader)`` and ``load(InputStream)``)."""
    out = []
    for i, ch in enumerate(value):
        if ch == "\\":
            out.append("\\\\")
        elif ch == " " and i == 0:
            out.append("\\ ")
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            encoded = ch.encode("utf-16-be")
            out.extend(f"\\u{int.from_bytes(encoded[j : j + 2]):04x}" for j in range(0, len(encoded), 2))
    return "".join(out)


#: The topic the router gives an event with the default ``topic_replacement``: this prefix and its aggregate type.
_TOPIC_OF_AGGREGATE = DEFAULT_TOPIC_REPLACEMENT.replace("${routedByValue}", "")
#: Kafka's rule for a topic name (KafkaPublisher checks the same).
_KAFKA_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


def check_event(
    aggregate_type: str, payload: Any, encoded: str, max_bytes: int, what: str | Callable[[], str]
) -> None:
    """What a CDC event must be for the connector to produce its record, checked as it is written
    (:class:`PayloadError` otherwise, nothing written): once an event is in the WAL nothing turns it into a
    dead letter — the connector's producer fails on its record, and the connector stops.

    * Its topic, ``outbox.event.<aggregate_type>`` (the router's default ``topic_replacement``), is a name
      Kafka takes: 1 to 249 of ``a-z A-Z 0-9 . _ -``.
    * Its payload as the record value carries it — PostgreSQL's text of the jsonb (a space after every ``:``
      and ``,``, numbers in plain notation), UTF-8 — is at most ``max_bytes`` (the model's
      ``sa_outbox_max_payload_bytes``; a CDC table's default leaves room in Kafka's 1 MiB for the key and the
      headers)."""
    topic = _TOPIC_OF_AGGREGATE + aggregate_type
    if not _KAFKA_TOPIC.fullmatch(topic):
        raise PayloadError(
            f"{describe(what)}: its aggregate_type routes it to the topic {topic!r:.120}, which Kafka refuses "
            "(1 to 249 of a-z A-Z 0-9 . _ -): the connector would stop on its record — use an aggregate type "
            "of those characters"
        )
    size = jsonb_text_over(payload, encoded, max_bytes)
    if size is not None:
        raise PayloadError(
            f"{describe(what)}: its payload is {size} bytes as the record value carries it (PostgreSQL's "
            f"text of the jsonb), over the limit of {max_bytes} bytes: the connector would stop on a record "
            "Kafka refuses (store large data elsewhere and put a reference in the event)"
        )


def span_context(headers: Mapping[str, str] | None) -> str | None:
    """The ``tracingspancontext`` of an event: its ``traceparent`` (and ``tracestate``) headers as the text of
    a ``java.util.Properties`` — what Debezium's event router reads as the span context to continue
    (``tracing.span.context.field``). ``None`` without a ``traceparent``."""
    if not headers:
        return None
    by_name = {k.lower(): v for k, v in headers.items()}
    if "traceparent" not in by_name:
        return None
    names = ("traceparent", "tracestate") if "tracestate" in by_name else ("traceparent",)
    return "".join(f"{n}={_properties_value(by_name[n])}\n" for n in names)


def headers_from_debezium(record: Any) -> dict[str, str]:
    """A Kafka record's headers as the event router wrote them, with the event's own headers (the JSON object
    of the ``outbox-headers`` header) unfolded into it — ready for ``sa_outbox.inbox.receive(headers=…)`` and
    ``consume_span``. ``record`` is a confluent-kafka ``Message`` (its ``headers()``), a mapping, or
    ``(name, value)`` pairs; bytes are decoded as UTF-8, null values dropped. The router's own headers
    (``id``, ``message_id``, ``event-type``, …) win over an event header of the same name. An
    ``outbox-headers`` header that is absent, null or JSON ``null`` means none; :class:`PayloadError` names a
    header that is not UTF-8, an ``outbox-headers`` that is not a JSON object of strings."""
    if callable(getattr(record, "headers", None)):
        items: Iterable[tuple[str, Any]] = record.headers() or []
    elif isinstance(record, Mapping):
        items = record.items()
    else:
        items = record
    plain: dict[str, str] = {}
    folded: str | None = None
    for name, value in items:
        if isinstance(value, bytes | bytearray):
            try:
                text_: str | None = bytes(value).decode()
            except UnicodeDecodeError:
                raise PayloadError(
                    f"the record's header {name!r} is not UTF-8: {bytes(value)!r:.80}"
                ) from None
        else:
            text_ = None if value is None else str(value)
        if name == OUTBOX_HEADERS:
            folded = text_
        elif text_ is not None:
            plain[name] = text_
    try:
        own = json.loads(folded) if folded else None
    except ValueError:
        raise PayloadError(f"the {OUTBOX_HEADERS} header is not JSON: {folded!r:.120}") from None
    if own is None:
        own = {}
    if not isinstance(own, dict):
        raise PayloadError(f"the {OUTBOX_HEADERS} header is not a JSON object: {folded!r:.120}")
    odd = next(((k, v) for k, v in own.items() if not isinstance(v, str)), None)
    if odd is not None:
        raise PayloadError(
            f"the {OUTBOX_HEADERS} header's {odd[0]!r} is {odd[1]!r:.80}, not a string: the producer writes only "
            "string header values — this record's headers were not written by it"
        )
    return {**{k: v for k, v in own.items() if k not in plain}, **plain}
