"""``sa-outbox doctor`` and ``sa-outbox locks``: the diagnosis of a stuck queue done by hand in SQL, in one command.

Each :class:`Finding` is ``ok``/``warn``/``fail`` with a one-line explanation and, when not ok, the fix.
A fix that is SQL holds one statement per line: run each line on its own (``psql -c LINE``), as statements
like ``CREATE INDEX CONCURRENTLY`` or ``ALTER SYSTEM`` cannot share a transaction. Nothing here runs
``EXPLAIN ANALYZE`` or takes a lock: it reads the catalog, the settings, the statistics views and the *plans*
(``EXPLAIN`` without ``ANALYZE``) of this installation's real claim statements.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, Engine, MetaData, Table, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.schema import CreateColumn, CreateIndex, CreateTable

from . import _partitions, _sql
from ._durations import Duration, to_seconds, to_timedelta
from .errors import ConfigurationError
from .migration import QUEUE_STORAGE_PARAMETERS, storage_parameters_sql
from .monitoring import (
    HorizonHolder,
    dead_list_command,
    describe_closed_partition,
    describe_held_partition,
    describe_holder,
    describe_interrupted_retire,
    describe_outage,
    essentials,
    long_horizon_holders,
    regclass_name,
)

__all__ = ["Finding", "LockInfo", "doctor", "explain_claim", "locks"]


@dataclass(frozen=True)
class Finding:
    """One diagnosis: ``status`` is ``ok``/``warn``/``fail``; ``fix`` (when not ok) is one statement or
    instruction per line; ``table`` is ``None`` for findings about the whole database."""

    check: str
    table: str | None
    status: str  # ok | warn | fail
    message: str
    fix: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def explain_claim(conn: Connection, model: type[Any], *, ordered: bool = False) -> dict[str, Any]:
    """The planner's plan (JSON, no ANALYZE) for this table's real claim statement — on the table where the
    connection's ``schema_translate_map`` puts it (the statement is sent as text, beyond the map's reach)."""
    spec = _sql.translated_spec(conn, _sql.spec_for(model))
    stmt = _sql.claim_statement(spec, ordered=ordered, limit=50)  # as a loop with batch=50 sends it
    params: dict[str, Any] = {"owner": "doctor"}
    if spec.kind == "outbox":
        params["lease"] = timedelta(seconds=60)
    else:
        params["queue_name"] = "default"
    compiled = stmt.compile(dialect=conn.dialect)
    # On a small table the planner rightly prefers a sequential scan; with seq scans priced out (SET LOCAL, in a
    # transaction rolled back right after) the plan answers the real question: can the claim use its index?
    with conn.begin_nested() if conn.in_transaction() else conn.begin() as tx:
        conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
        raw = conn.exec_driver_sql(
            "EXPLAIN (FORMAT JSON) " + str(compiled), compiled.construct_params(params)
        )
        plan: dict[str, Any] = raw.scalar_one()[0]["Plan"]
        tx.rollback()
    return plan


def _outer(node: dict[str, Any]) -> dict[str, Any]:
    """A node's input, its InitPlans aside (the outbox claim's snapshot values hang under its Limit)."""
    inputs = [n for n in node.get("Plans", []) if n.get("Parent Relationship") != "InitPlan"]
    return inputs[0] if inputs else {}


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = [node]
    for child in node.get("Plans", []):
        out += _nodes(child)
    return out


#: The partitions' copies of a partitioned index (``:i``, a regclass name).
_PARTITION_INDEXES = text(
    "SELECT c.relname FROM pg_partition_tree(CAST(:i AS regclass)) p JOIN pg_class c ON c.oid = p.relid"
)


def _qualified_index(conn: Connection, table: Any, index: str) -> str:
    prep = _sql.text_preparer(conn.dialect)
    return (f"{prep.quote_schema(table.schema)}." if table.schema else "") + prep.quote(index)


def _partition_findings(conn: Connection, model: type[Any]) -> list[Finding]:
    """The partitioned layout: a partition for the current and the next period, and no past partition kept
    alive by unfinished rows. Nothing for a plain table."""
    spec = _sql.spec_for(model)
    name = spec.table.fullname
    if not _partitions.is_partitioned(conn, spec.table):
        return []
    placed = _sql.translated_spec(conn, spec)  # (the command names the table where the map puts it)
    command = _partitions.partitions_command(placed)
    missing = _partitions.missing_periods(conn, model, ahead=1)
    out: list[Finding] = []
    if missing:
        now = conn.execute(text("SELECT now()")).scalar_one()
        current = missing[0] <= now
        out.append(Finding(
            "partitions", name, "fail" if current else "warn",
            f"no partition for the period starting {missing[0].isoformat()}: "
            + ("every insert fails now" if current else "inserts will fail when it starts"),
            f"{command} (and run it regularly: a Dispatcher/Worker's maintain_partitions=3600, or cron)",
        ))  # fmt: skip
    closed = [p for p in _partitions.list_partitions(conn, model, counts=False) if p.closed]
    for p in _partitions.held_partitions(conn, model):
        if p.name not in {c.name for c in closed}:  # (a closed one's rows cannot be retried: said below)
            out.append(Finding("partitions", name, "warn", describe_held_partition(p, spec),
                               f"finish or retry its rows ({dead_list_command(spec)}); the next maintain retires it"))  # fmt: skip
    for p in closed:
        out.append(Finding("partitions", name, "warn", describe_closed_partition(p, placed),
                           f"{command} (it waits at most 1 s for the partition's lock)"))  # fmt: skip
    for table in _partitions.interrupted_retires(conn, model):
        out.append(Finding("partitions", name, "warn", describe_interrupted_retire(table, placed), command))
    if not out:
        out.append(Finding("partitions", name, "ok",
                           "partitions exist for this period and the next; no past partition is held by rows"))  # fmt: skip
    return out


def _claim_plan_finding(conn: Connection, model: type[Any]) -> Finding:
    spec = _sql.spec_for(model)
    t, name = spec.table.name, spec.table.fullname
    wanted = f"ix_{t}_ready" if spec.kind == "outbox" else f"ix_{t}_dequeue"
    index = next((_index_name(conn, i.name) for i in spec.table.indexes if str(i.name) == wanted), wanted)
    plan = explain_claim(conn, model)
    nodes = _nodes(plan)
    # The partitioned layout: each partition's copy of the index (named by PostgreSQL) and each partition.
    indexes, tables = {index}, {t}
    if _partitions.is_partitioned(conn, spec.table):
        indexes |= set(
            conn.execute(
                _PARTITION_INDEXES,
                {"i": _qualified_index(conn, _sql.translated_spec(conn, spec).table, index)},
            ).scalars()
        )
        tables |= {p.name for p in _partitions.list_partitions(conn, model, counts=False)}
    seq = [n for n in nodes if n["Node Type"] == "Seq Scan" and n.get("Relation Name") in tables]
    limits = [n for n in nodes if n["Node Type"] == "Limit"]
    lock_rows = _outer(limits[0]) if limits else {}
    uses_index = any(n.get("Index Name") in indexes for n in _nodes(lock_rows)) if lock_rows else False
    if lock_rows.get("Node Type") == "LockRows" and uses_index and not seq:
        return Finding("claim plan", name, "ok", f"claim: LockRows under Limit on an index scan of {index}")
    shape = ", ".join(f"{n['Node Type']}{' on ' + n['Relation Name'] if n.get('Relation Name') else ''}"
                      f"{' using ' + n['Index Name'] if n.get('Index Name') else ''}" for n in nodes)  # fmt: skip
    return Finding(
        "claim plan", name, "fail",
        f"the claim does not read {index} under LockRows (plan: {shape}); every claim scans and sorts the table",
        "create the partial index (run the migration; see the 'indexes' finding) and "
        f"ANALYZE {regclass_name(conn, spec.table)}",
    )  # fmt: skip


@dataclass(frozen=True)
class _Shape:
    """A table as PostgreSQL's catalogs describe it."""

    #: column -> its description: ``format_type``, NOT NULL, identity, default (``pg_get_expr``)
    columns: dict[str, str]
    #: CHECK and PRIMARY KEY constraint -> ``pg_get_constraintdef``
    checks: dict[str, str]
    #: CHECK constraint -> the columns it reads
    check_columns: dict[str, list[str]]
    #: index -> (its definition from ``USING`` on, unique, valid, backs a constraint)
    indexes: dict[str, tuple[str, bool, bool, bool]]
    #: column of a collatable type -> (its collation, quoted as ``COLLATE`` takes it; whether it is
    #: deterministic; the column's type)
    collations: dict[str, tuple[str, bool, str]]


_SHAPE_COLUMNS = text(
    "SELECT a.attname, format_type(a.atttypid, a.atttypmod) "
    "|| CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END "
    "|| CASE a.attidentity WHEN 'a' THEN ' GENERATED ALWAYS AS IDENTITY' "
    "WHEN 'd' THEN ' GENERATED BY DEFAULT AS IDENTITY' ELSE '' END "
    "|| coalesce(' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid), '') "
    "FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
    "WHERE a.attrelid = CAST(:t AS regclass) AND a.attnum > 0 AND NOT a.attisdropped"
)
_SHAPE_CHECKS = text(
    "SELECT c.conname, pg_get_constraintdef(c.oid), "
    "ARRAY(SELECT a.attname FROM pg_attribute a WHERE a.attrelid = c.conrelid AND a.attnum = ANY (c.conkey)), "
    "c.contype FROM pg_constraint c WHERE c.conrelid = CAST(:t AS regclass) AND c.contype IN ('c', 'p')"
)
_SHAPE_COLLATIONS = text(
    "SELECT a.attname, quote_ident(n.nspname) || '.' || quote_ident(co.collname), co.collisdeterministic, "
    "format_type(a.atttypid, a.atttypmod) "
    "FROM pg_attribute a JOIN pg_collation co ON co.oid = a.attcollation "
    "JOIN pg_namespace n ON n.oid = co.collnamespace "
    "WHERE a.attrelid = CAST(:t AS regclass) AND a.attnum > 0 AND NOT a.attisdropped"
)
_SHAPE_INDEXES = text(
    "SELECT i.relname, regexp_replace(pg_get_indexdef(x.indexrelid), '^.*? USING ', ''), x.indisunique, "
    "x.indisvalid, EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = x.indexrelid "
    "AND c.conrelid = x.indrelid) FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid "
    "WHERE x.indrelid = CAST(:t AS regclass)"
)


def _shape(conn: Connection, regclass: str) -> _Shape:
    params = {"t": regclass}
    constraints = conn.execute(_SHAPE_CHECKS, params).all()
    return _Shape(
        columns={r[0]: r[1] for r in conn.execute(_SHAPE_COLUMNS, params)},
        checks={r[0]: r[1] for r in constraints},
        check_columns={r[0]: list(r[2]) for r in constraints if r[3] == "c"},
        indexes={r[0]: (r[1], r[2], r[3], r[4]) for r in conn.execute(_SHAPE_INDEXES, params)},
        collations={r[0]: (r[1], r[2], r[3]) for r in conn.execute(_SHAPE_COLLATIONS, params)},
    )


def _expected_shape(conn: Connection, table: Table) -> _Shape | str:
    """The model's table as this version of sa_outbox creates it, in PostgreSQL's own words: a temporary copy
    under the same name in ``pg_temp`` (columns, constraints, indexes — the DDL ``create_all`` sends, without
    foreign keys, which a temporary table cannot have) read back from the catalogs, in a savepoint rolled back
    at once. So a type, a default, a CHECK or an index predicate is compared as the server normalised it, and
    names a naming convention derives from the table's name come out the same. When the copy cannot be made
    (no TEMPORARY privilege, a standby, a model SQLAlchemy cannot copy) the reason."""
    try:
        copy = table.to_metadata(MetaData(), schema="pg_temp")
        # a name a naming convention derives from the column's label (``ix_%(column_0_label)s``) would now read
        # ``pg_temp_…``: give each copied index its model's name
        originals = {_index_key(i): i.name for i in table.indexes}
        for index in copy.indexes:
            index.name = originals.get(_index_key(index), index.name)
        with conn.begin_nested() if conn.in_transaction() else conn.begin() as tx:
            conn.execute(CreateTable(copy, include_foreign_key_constraints=[]))
            for index in copy.indexes:
                conn.execute(CreateIndex(index))
            prep = _sql.text_preparer(conn.dialect)
            shape = _shape(conn, f"pg_temp.{prep.quote(table.name)}")
            tx.rollback()
    except DBAPIError as exc:
        return f"{type(exc.orig).__name__}: {str(exc.orig).strip().splitlines()[0]}"
    except Exception as exc:  # doctor reports, never raises: compare what it can without the copy
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return shape


def _index_key(index: Any) -> tuple[Any, ...]:
    """An index told apart by what it indexes, not by its name: expressions, uniqueness, predicate."""
    columns = tuple(getattr(e, "name", None) or str(e) for e in index.expressions)
    return columns, bool(index.unique), str(index.dialect_options["postgresql"]["where"])


def _index_name(conn: Connection, name: Any) -> str:
    """An index name as the DDL creates it, not as the model spells it: longer than 63 characters, SQLAlchemy
    shortens it (its first 55 characters, ``_`` and four hex digits of a hash); longer than 63 bytes
    (``NAMEDATALEN - 1``, multi-byte characters), PostgreSQL then cuts it at the last whole character."""
    rendered = str(
        _sql.text_preparer(conn.dialect).truncate_and_render_index_name(name, _alembic_quote=False)
    )
    return rendered.encode()[:63].decode("utf-8", "ignore")


def _schema_findings(conn: Connection, model: type[Any]) -> tuple[list[Finding], bool]:
    """The table against the shape this version expects: the table exists; every column of the model, with
    its type, nullability, identity and default; every CHECK and the primary key (and CHECKs of one's own on
    the model's columns, a warning); every index, by its definition (columns, order, predicate, uniqueness)
    and validity. Returns the findings and whether the table can be used at all (every column
    there: the claim and the counts name them all). Columns the model does not have are the team's own."""
    spec = _sql.spec_for(model)
    table = spec.table
    name = table.fullname
    # the DDL of the fixes names the table and the index where the connection's schema_translate_map puts them
    placed = _sql.translated_spec(conn, spec).table
    regclass = regclass_name(conn, table)
    if conn.execute(text("SELECT to_regclass(:t)"), {"t": regclass}).scalar_one() is None:
        return [Finding("columns", name, "fail", f"table {regclass} does not exist",
                        "run the migration (alembic upgrade head), or metadata.create_all() in a script")], False  # fmt: skip
    have = _shape(conn, regclass)
    want = _expected_shape(conn, table)
    out: list[Finding] = []
    # columns
    missing = [c for c in table.columns if c.name not in have.columns]
    changed = (
        [
            f"{c}: {have.columns[c]}, expected {d}"
            for c, d in want.columns.items()
            if c in have.columns and have.columns[c] != d
        ]
        if isinstance(want, _Shape)
        else []
    )
    if missing:
        added = "\n".join(
            f"ALTER TABLE {regclass} ADD COLUMN {CreateColumn(c).compile(dialect=conn.dialect)}"
            for c in missing
        )
        out.append(Finding(
            "columns", name, "fail",
            f"column{'s' if len(missing) > 1 else ''} {', '.join(c.name for c in missing)} missing: the schema is "
            "behind this version of sa_outbox, and every claim fails until it is migrated",
            f"run the migration (alembic upgrade head); the columns this version adds:\n{added}",
        ))  # fmt: skip
    if changed:
        out.append(Finding("columns", name, "fail",
                           "columns differ from the model (type, NOT NULL, identity or default: a row the library "
                           "writes may be refused or get the wrong value): " + "; ".join(changed),
                           "an alembic revision that alters them (autogenerate with compare_type=True and "
                           "compare_server_default=True sees most of it)"))  # fmt: skip
    if not missing and not changed:
        compared = "" if isinstance(want, _Shape) else f" (types not compared: {want})"
        out.append(
            Finding("columns", name, "ok", f"all {len(table.columns)} columns of the model present{compared}")
        )
    if missing:
        return out, False
    if isinstance(want, _Shape):
        out += _collation_findings(conn, regclass, name, have, want)
    # CHECK and primary key constraints
    if isinstance(want, _Shape):
        prep = _sql.text_preparer(conn.dialect)
        bad_checks = [
            f"{c} is {have.checks[c]!r}, expected {d!r}" if c in have.checks else f"{c} ({d}) is missing"
            for c, d in sorted(want.checks.items())
            if have.checks.get(c) != d
        ]
        fixes = []
        for c, d in sorted(want.checks.items()):
            if have.checks.get(c) != d:
                if c in have.checks:
                    fixes.append(f"ALTER TABLE {regclass} DROP CONSTRAINT {prep.quote(c)}")
                fixes.append(f"ALTER TABLE {regclass} ADD CONSTRAINT {prep.quote(c)} {d}")
        if bad_checks:
            out.append(Finding("constraints", name, "fail",
                               "constraints differ from this version's: " + "; ".join(bad_checks)
                               + " (a row the library writes may be refused, or a wrong one let in)",
                               "run the migration (alembic upgrade head), or:\n" + "\n".join(fixes)))  # fmt: skip
        model_columns = {c.name for c in table.columns}
        extra = [
            c
            for c, cols in sorted(have.check_columns.items())
            if c not in want.checks and model_columns.intersection(cols)
        ]
        if extra:
            out.append(Finding("constraints", name, "warn",
                               "CHECK constraints on the library's columns that this version does not define: "
                               + "; ".join(f"{c} ({have.checks[c]})" for c in extra)
                               + " (a row the library writes may be refused)",
                               "\n".join(f"ALTER TABLE {regclass} DROP CONSTRAINT {prep.quote(c)}" for c in extra)))  # fmt: skip
        if not bad_checks and not extra:
            out.append(Finding("constraints", name, "ok",
                               f"all {len(want.checks)} CHECK and primary key constraints as expected"))  # fmt: skip
    # indexes
    bad = 0
    for index in sorted(placed.indexes, key=lambda i: str(i.name)):
        index_name = _index_name(conn, index.name)
        # CONCURRENTLY for a unique index too: a plain build holds a SHARE lock, every claim and finalize waits
        ddl = re.sub(
            r"^CREATE (UNIQUE )?INDEX",
            r"CREATE \1INDEX CONCURRENTLY",
            str(CreateIndex(index).compile(dialect=conn.dialect)),
        )
        qualified = _qualified_index(conn, placed, index_name)
        if index_name not in have.indexes:
            out.append(Finding("indexes", name, "fail", f"index {index_name} is missing", ddl))
        elif not have.indexes[index_name][2]:
            # Two statements, two lines: neither may run inside a transaction block, so they cannot be sent
            # together (psql -c "A; B" runs both in one implicit transaction and fails).
            out.append(Finding("indexes", name, "fail",
                               f"index {index_name} is INVALID (a failed CREATE INDEX CONCURRENTLY?)",
                               f"DROP INDEX CONCURRENTLY {qualified}\n{ddl}"))  # fmt: skip
        elif (
            isinstance(want, _Shape)
            and index_name in want.indexes
            and (have.indexes[index_name][:2] != want.indexes[index_name][:2])
        ):
            got, expected = have.indexes[index_name], want.indexes[index_name]
            out.append(Finding("indexes", name, "fail",
                               f"index {index_name} is {'UNIQUE ' if got[1] else ''}{got[0]}, expected "
                               f"{'UNIQUE ' if expected[1] else ''}{expected[0]} (an older version's index?)",
                               f"DROP INDEX CONCURRENTLY {qualified}\n{ddl}"))  # fmt: skip
        else:
            continue
        bad += 1
    known = {_index_name(conn, i.name) for i in placed.indexes}
    stale = sorted(n for n, shape in have.indexes.items() if n not in known and not shape[3])
    if stale:
        out.append(Finding("indexes", name, "warn",
                           f"index{'es' if len(stale) > 1 else ''} {', '.join(stale)} not in the model: every claim "
                           "and finalize writes an entry to each (a queue row's updates are never HOT) — an older "
                           "version's (revision 0008 replaced ix_<jobs>_limited)? Drop it unless your own "
                           "queries read it",
                           "\n".join(f"DROP INDEX CONCURRENTLY {_qualified_index(conn, placed, n)}" for n in stale)))  # fmt: skip
    if not bad:
        compared = "" if isinstance(want, _Shape) else f" (definitions not compared: {want})"
        out.append(
            Finding(
                "indexes", name, "ok", f"all {len(table.indexes)} partial indexes present and valid{compared}"
            )
        )
    return out, True


def _collation_findings(
    conn: Connection, regclass: str, name: str, have: _Shape, want: _Shape
) -> list[Finding]:
    """Text columns whose collation is not the model's. A nondeterministic one (an ICU collation that ignores
    case or accents) makes texts it calls equal one value: two aggregates one ordered stream, two unique keys
    one key, two queue names one queue — a failure. A deterministic one only orders the indexes differently
    (``COLLATE "C"`` for speed is common): said, as a warning."""
    differ = {
        c: (have.collations[c], d)
        for c, d in want.collations.items()
        if c in have.collations and have.collations[c][0] != d[0]
    }
    if not differ:
        return []
    loose = [c for c, (got, _) in differ.items() if not got[1]]
    said = "; ".join(f"{c}: {got[0]}, expected {expected[0]}" for c, (got, expected) in differ.items())
    prep = _sql.text_preparer(conn.dialect)
    fix = "\n".join(
        f"ALTER TABLE {regclass} ALTER COLUMN {prep.quote(c)} TYPE {got[2]} COLLATE {expected[0]}"
        for c, (got, expected) in differ.items()
    )
    if loose:
        return [Finding("columns", name, "fail",
                        f"columns with a nondeterministic collation ({said}): texts it calls equal are one value — "
                        f"{', '.join(loose)} of two rows that differ only in case or accents match as one "
                        "(one aggregate's order, one unique key, one queue)",
                        f"an alembic revision that sets the model's collation back:\n{fix}")]  # fmt: skip
    return [Finding("columns", name, "warn",
                    f"columns with another collation than the model's ({said}): the indexes order them by it, "
                    "which the library does not rely on; said in case it was not meant",
                    f"to go back to the model's (an alembic revision):\n{fix}")]  # fmt: skip


def _reloptions(conn: Connection, model: type[Any]) -> dict[str, str]:
    """The table's storage parameters; for the partitioned layout, those of its newest partition (a
    partitioned parent takes none: each partition is created with them)."""
    t = _sql.spec_for(model).table
    name = regclass_name(conn, t)
    if _partitions.is_partitioned(conn, t):
        parts = _partitions.list_partitions(conn, model, counts=False)
        if not parts:
            return dict.fromkeys(QUEUE_STORAGE_PARAMETERS, "(no partition)")  # the partitions finding says it
        prep = _sql.text_preparer(conn.dialect)
        newest = parts[-1]
        name = f"{prep.quote_schema(newest.schema)}.{prep.quote(newest.name)}"
    options = conn.execute(
        text("SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = CAST(:t AS regclass)"), {"t": name}
    ).scalar_one()
    return dict(o.split("=", 1) for o in options)


def _storage_finding(conn: Connection, model: type[Any], have: dict[str, str]) -> Finding:
    t = _sql.spec_for(model).table
    missing = [k for k in QUEUE_STORAGE_PARAMETERS if k not in have]
    if not missing:
        return Finding(
            "autovacuum settings", t.fullname, "ok",
            "per-table autovacuum settings present: " + ", ".join(f"{k}={v}" for k, v in have.items()),
        )  # fmt: skip
    target = regclass_name(conn, t)
    if _partitions.is_partitioned(conn, t):  # a partitioned parent takes none: set them on each partition
        prep = _sql.text_preparer(conn.dialect)
        target = ", ".join(
            f"{prep.quote_schema(p.schema)}.{prep.quote(p.name)}"
            for p in _partitions.list_partitions(conn, model, counts=False)
        )
    fixes = "\n".join(f"ALTER TABLE {name} SET ({storage_parameters_sql()})" for name in target.split(", "))
    return Finding(
        "autovacuum settings", t.fullname, "warn",
        f"missing {', '.join(missing)}: with the server default (vacuum at 20 % dead) dead queue rows pile up "
        "in the claim's index between vacuums",
        fixes,
    )  # fmt: skip


def _table_autovacuum_off(have: dict[str, str]) -> bool:
    return have.get("autovacuum_enabled", "true").lower() in ("false", "off", "no", "0")


def _server_autovacuum_finding(conn: Connection) -> tuple[Finding, bool]:
    """Whether autovacuum runs at all on this server (``autovacuum`` and ``track_counts`` both on)."""
    autovacuum = str(conn.execute(text("SELECT current_setting('autovacuum')")).scalar_one())
    track = str(conn.execute(text("SELECT current_setting('track_counts')")).scalar_one())
    if autovacuum == "on" and track == "on":
        return Finding("autovacuum", None, "ok", "autovacuum = on, track_counts = on"), True
    off = [
        f"{name} = off"
        for name, value in (("autovacuum", autovacuum), ("track_counts", track))
        if value != "on"
    ]
    fix = [f"ALTER SYSTEM SET {s.split(' =')[0]} = on" for s in off] + ["SELECT pg_reload_conf()"]
    return Finding(
        "autovacuum", None, "warn",
        f"{' and '.join(off)} on this server: nothing vacuums the queue tables unless you schedule VACUUM "
        "(only anti-wraparound vacuums still run), so dead queue rows pile up and every claim slows down",
        "\n".join(fix),
    ), False  # fmt: skip


def _dead_tuples_finding(
    conn: Connection, model: type[Any], h: Any, *, ratio_warn: float, server_on: bool, table_off: bool,
    settings_missing: bool, holders: list[HorizonHolder],
) -> Finding:  # fmt: skip
    name = _sql.spec_for(model).table.fullname
    if not (h.dead_tuples > 10_000 and h.dead_ratio > ratio_warn):
        return Finding("dead tuples", name, "ok",
                       f"{h.dead_tuples:,} dead / {h.live_tuples:,} live; size {h.total_bytes / 1024:.0f} kB")  # fmt: skip
    # The fix names the causes that are really there, each with its own finding.
    causes = []
    if table_off:
        causes.append(
            "autovacuum is off for this table (autovacuum_enabled = false; see the 'autovacuum' finding)"
        )
    if not server_on:
        causes.append(
            "autovacuum is off on this server (see the 'autovacuum' finding): schedule VACUUM or turn it on"
        )
    if settings_missing:
        causes.append("the per-table autovacuum settings are missing (see 'autovacuum settings')")
    if holders:
        who = ", ".join(
            f"pid {x.pid}" if x.pid else f"{x.kind.replace('_', ' ')} {x.name!r}" for x in holders
        )
        causes.append(
            f"{who} holds back the xmin horizon: VACUUM cannot remove them until it ends (see 'xmin horizon')"
        )
    if not causes:
        causes.append("autovacuum has not caught up with this table: if it recurs, let it work faster here "
                      f"(ALTER TABLE {regclass_name(conn, _sql.spec_for(model).table)} SET "
                      "(autovacuum_vacuum_cost_delay = 0))")  # fmt: skip
    return Finding(
        "dead tuples", name, "warn",
        f"{h.dead_tuples:,} dead tuples ({h.dead_ratio:.0%}); last autovacuum {h.last_autovacuum or 'never'}",
        "\n".join([f"VACUUM (ANALYZE) {regclass_name(conn, _sql.spec_for(model).table)}", *causes]),
    )  # fmt: skip


# Table lock modes by what they block for the queue: SHARE and stronger conflict with the ROW EXCLUSIVE lock
# every claim and finalize takes (UPDATE); ROW SHARE / ROW EXCLUSIVE come with row locks (SELECT … FOR
# UPDATE/SHARE, UPDATE, DELETE) that block claims of those rows only; ACCESS SHARE (a plain SELECT) blocks
# only what needs ACCESS EXCLUSIVE.
_BLOCKS_CLAIMS = ("ShareLock", "ShareRowExclusiveLock", "ExclusiveLock", "AccessExclusiveLock")
_ROW_LOCKS = ("RowShareLock", "RowExclusiveLock")


def _held_locks_message(lk: LockInfo) -> str:
    """What an idle-in-transaction session's locks on the queue tables really block."""
    modes = {h.split(" ", 1)[0] for h in lk.holds if " on table " in h}
    what = f"pid {lk.pid} ({lk.application_name or '?'}) is idle in transaction holding {', '.join(lk.holds)}"
    if modes & set(_BLOCKS_CLAIMS):
        return f"{what}: this lock blocks every claim and finalize on the table until the transaction ends"
    if modes & set(_ROW_LOCKS):
        return (f"{what}: it locked or changed queue rows (SELECT … FOR UPDATE/SHARE, UPDATE or DELETE) and "
                "keeps those row locks until it ends, so claims of those rows skip or wait for them")  # fmt: skip
    return (f"{what}: it only read the table, which blocks no claim, but it blocks ALTER TABLE, DROP, "
            "TRUNCATE and VACUUM FULL on it (anything that needs an ACCESS EXCLUSIVE lock)")  # fmt: skip


def _destination_finding(name: str, status: Any) -> Finding:
    """Whether the oldest due messages were given back because their destination was unavailable."""
    outage = status.destination_unavailable
    if outage is None:
        return Finding(
            "destination", name, "ok",
            "the oldest due messages show no delivery failing for an unavailable destination",
        )  # fmt: skip
    since = (
        f"since at least {status.last_done_age:.0f}s ago (the last delivery)"
        if status.last_done_age is not None
        else "since before the oldest due message"
    )
    return Finding(
        "destination", name, "warn",
        f"the broker is down or unreachable {since}; the dispatcher is probing it: "
        + describe_outage(outage, status.oldest_pending_age, status.last_done_age),
        "bring the broker back, or fix what stands between it and the dispatchers (network, DNS, credentials, "
        "the publisher's URL); nothing needs doing to the rows: no attempt is spent on the outage and the "
        "dispatchers deliver the backlog as soon as a probe gets through (watch sa_outbox_circuit_open)",
    )  # fmt: skip


def _lease_finding(target: Any) -> Finding:
    lease, timeout, batch = target.lease.total_seconds(), target.publish_timeout.total_seconds(), target.batch
    # The dispatcher releases the rest of a batch when less than publish_timeout of the lease is left, so a
    # large batch never outlives its lease; what hurts is a publish_timeout that eats most of the lease: after
    # one publish that runs to its timeout, everything else in the batch is released unpublished.
    if 2 * timeout > lease:
        return Finding(
            "lease vs publish timeout", None, "warn",
            f"publish_timeout {timeout:g}s is more than half the lease {lease:g}s: after one publish that runs "
            "to its timeout the rest of the batch is released unpublished, so a slow broker delivers about one "
            "message per claim",
            f"raise lease to at least {3 * timeout:g}s or lower publish_timeout",
        )  # fmt: skip
    return Finding(
        "lease vs publish timeout", None, "ok",
        f"lease {lease:g}s leaves room for several publishes of up to {timeout:g}s each; the rest of a batch of "
        f"{batch} is released, never held past the lease, if the broker is slow",
    )  # fmt: skip


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _retry_budget_finding(name: str, spec: Any, model: type[Any], target: Any) -> Finding:
    """How long a row that fails every attempt keeps being retried before it is dead/failed."""
    from ._backoff import JOBS_BACKOFF, OUTBOX_BACKOFF

    is_dispatcher = hasattr(target, "publish_timeout")
    if spec.kind == "outbox":
        attempts = target.max_attempts if is_dispatcher else 12
        backoff = target.backoff if is_dispatcher else OUTBOX_BACKOFF
        whose = "the dispatcher's" if is_dispatcher else "the dispatcher's default"
        outage = (
            "; an unavailable destination (DestinationUnavailable) spends no attempt, and no answer in time "
            "(NoAnswer) never the last one: such a message is retried until it is answered, or until "
            "give_up_after if set"
        )
    else:
        attempts = model.sa_outbox_default_max_attempts
        is_worker = target is not None and hasattr(target, "stale_after") and not is_dispatcher
        backoff = target.backoff if is_worker else JOBS_BACKOFF
        whose = "the model's default (a job's own max_attempts wins)"
        outage = "; a handler's NoAnswer never spends the last one"
    shortest, longest = backoff.give_up_window(attempts)
    window = (
        f"about {_minutes(longest)}"
        if shortest == longest
        else f"about {_minutes(longest / 2)} on average, at most {_minutes(longest)} (jittered backoff)"
    )
    message = (
        f"{whose} {attempts} attempts: a {'message' if spec.kind == 'outbox' else 'job'} that fails every "
        f"attempt is retried for {window} before it is {spec.dead}{outage}"
    )
    if longest < 60:
        return Finding("retry budget", name, "warn", message + ": a downstream blip of a minute kills rows",
                       "raise max_attempts or the backoff's base/cap")  # fmt: skip
    return Finding("retry budget", name, "ok", message)


def doctor(
    engine: Engine | Connection,
    models: list[type[Any]],
    *,
    long_transaction: Duration = 300.0,
    dead_ratio_warn: float = 0.2,
    stale_after: Duration | None = None,
    target: Any = None,
) -> list[Finding]:
    """Run every check on the given outbox/jobs models and return the findings (none raises; any ``fail``
    means a claim cannot work as designed). ``engine`` may be a ``Connection``: the checks then run on it, in
    its transaction (the dashboard's, bounded by its ``statement_timeout``).

    ``stale_after`` is the workers' reaping window for counting stuck jobs (default: the target's
    ``stale_after`` if it has one, else 60 s); ``target`` (a Dispatcher) adds the lease check. Invalid
    options raise ``ConfigurationError`` before any query."""
    threshold = to_seconds(long_transaction, name="long_transaction")
    if (
        isinstance(dead_ratio_warn, bool)
        or not isinstance(dead_ratio_warn, int | float)
        or not 0 <= dead_ratio_warn <= 1
    ):
        raise ConfigurationError(
            f"dead_ratio_warn must be a fraction between 0 and 1, got {dead_ratio_warn!r}"
        )
    if stale_after is None:
        stale_after = getattr(target, "stale_after", None) or 60.0
    stale = to_timedelta(stale_after, name="stale_after", allow_zero=False)
    findings: list[Finding] = []
    # (an engine's own connection, or the caller's, in its transaction)
    with engine.connect() if isinstance(engine, Engine) else contextlib.nullcontext(engine) as conn:
        server, server_on = _server_autovacuum_finding(conn)
        holders = long_horizon_holders(conn, threshold)
        for model in models:
            name = _sql.spec_for(model).table.fullname
            schema, usable = _schema_findings(conn, model)
            if not usable:  # every other check reads the columns: the migration comes first
                findings += schema
                continue
            findings.append(_claim_plan_finding(conn, model))
            findings += schema
            findings += _partition_findings(conn, model)
            have = _reloptions(conn, model)
            storage = _storage_finding(conn, model, have)
            findings.append(storage)
            table_off = _table_autovacuum_off(have)
            if table_off:
                findings.append(Finding(
                    "autovacuum", name, "warn",
                    f"autovacuum_enabled = false on {name}: autovacuum never vacuums it, so dead queue rows pile "
                    "up and every claim slows down",
                    f"ALTER TABLE {regclass_name(conn, _sql.spec_for(model).table)} RESET (autovacuum_enabled)",
                ))  # fmt: skip
            status = essentials(conn, model, stale_after=stale)
            if status.health is not None:
                findings.append(_dead_tuples_finding(
                    conn, model, status.health, ratio_warn=dead_ratio_warn, server_on=server_on,
                    table_off=table_off, settings_missing=storage.status != "ok", holders=holders,
                ))  # fmt: skip
            if status.expired_leases:
                window = (
                    f" (running longer than stale_after {stale.total_seconds():g}s)"
                    if status.kind == "jobs"
                    else ""
                )
                findings.append(Finding(
                    "stuck rows", name, "warn",
                    f"{status.expired_leases} row(s) leased past their lease{window} (a dispatcher/worker died or "
                    "hangs)",
                    "they are rescued by the next run of any dispatcher/worker; if none runs, start one",
                ))  # fmt: skip
            else:
                findings.append(Finding("stuck rows", name, "ok", "no lease past its expiry"))
            findings.append(_retry_budget_finding(name, _sql.spec_for(model), model, target))
            if status.kind == "outbox":
                findings.append(_destination_finding(name, status))
            if status.dead:
                findings.append(Finding("dead letters", name, "warn",
                                        f"{status.dead} {_sql.spec_for(model).dead} row(s) need a person",
                                        dead_list_command(_sql.spec_for(model))))  # fmt: skip
            else:
                findings.append(Finding("dead letters", name, "ok", "no dead/failed rows"))
        findings.append(server)
        for holder in holders:
            fix = f"SELECT pg_terminate_backend({holder.pid})" if holder.pid else (
                f"SELECT pg_drop_replication_slot('{holder.name}')" if holder.kind == "replication_slot"
                else f"ROLLBACK PREPARED '{holder.name}'")  # fmt: skip
            findings.append(Finding("xmin horizon", None, "warn", describe_holder(holder), fix))
        if not holders:
            findings.append(Finding("xmin horizon", None, "ok", "no long transaction of this database, replication "
                                    "slot or prepared transaction holds back VACUUM"))  # fmt: skip
        names = [regclass_name(conn, _sql.spec_for(m).table) for m in models]
        idle = [lk for lk in locks(conn, names) if lk.idle_in_transaction]
        for lk in idle:
            findings.append(Finding("idle in transaction", None, "warn", _held_locks_message(lk),
                                    f"SELECT pg_terminate_backend({lk.pid})"))  # fmt: skip
        if not idle:
            findings.append(
                Finding("idle in transaction", None, "ok", "no idle-in-transaction session holds queue locks")
            )
    findings.append(Finding(
        "wake-ups", None, "ok",
        "NOTIFY is sent by the sa_outbox flush hook at commit; rows written without it are found by polling",
    ))  # fmt: skip
    if target is not None and hasattr(target, "publish_timeout"):
        findings.append(_lease_finding(target))
    return findings


@dataclass(frozen=True)
class LockInfo:
    pid: int
    application_name: str
    state: str | None
    wait_event_type: str | None
    wait_event: str | None
    transaction_seconds: float | None
    query_seconds: float | None
    query: str
    blocked_by: list[int]
    #: granted locks on the queue tables: "<mode> on table <t>" for a table lock, "<mode> on row (page,item)
    #: of <t> (tuple lock: …)" for the lock a session takes while it queues for one row.
    holds: list[str]
    idle_in_transaction: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def locks(conn: Connection | Engine, tables: list[str]) -> list[LockInfo]:
    """Sessions holding or waiting for locks on the queue tables (names as in SQL, schema-qualified if
    needed), with who blocks whom.

    One read of live views that PostgreSQL does not snapshot together (``pg_stat_activity`` once per query,
    ``pg_locks`` and ``pg_blocking_pids`` as each is evaluated), so a session that changes state during the
    read can show its previous statement beside its new lock; read again for a settled picture."""
    if isinstance(conn, Engine):
        with conn.connect() as c:
            return locks(c, tables)
    rows = conn.execute(
        text(
            """
            WITH queue AS (
                SELECT to_regclass(name)::oid AS oid FROM unnest(CAST(:tables AS text[])) AS name
                 WHERE to_regclass(name) IS NOT NULL
            ), involved AS (
                SELECT DISTINCT l.pid FROM pg_locks l JOIN queue q ON q.oid = l.relation
                 WHERE l.pid <> pg_backend_pid()
            ), related AS (
                SELECT pid FROM involved
                UNION SELECT a.pid FROM pg_stat_activity a
                 WHERE a.pid <> pg_backend_pid() AND pg_blocking_pids(a.pid) && ARRAY(SELECT pid FROM involved)
            )
            SELECT a.pid, coalesce(a.application_name, '') AS app, a.state, a.wait_event_type, a.wait_event,
                   EXTRACT(epoch FROM now() - a.xact_start) AS xact_s, EXTRACT(epoch FROM now() - a.query_start) AS query_s,
                   left(a.query, 300) AS query, pg_blocking_pids(a.pid) AS blocked_by,
                   ARRAY(SELECT CASE l.locktype
                                WHEN 'relation' THEN l.mode || ' on table ' || l.relation::regclass::text
                                WHEN 'tuple' THEN l.mode || ' on row (' || l.page || ',' || l.tuple || ') of '
                                     || l.relation::regclass::text || ' (tuple lock: first in line for that row)'
                                ELSE l.mode || ' on ' || l.locktype || ' of ' || l.relation::regclass::text END
                           FROM pg_locks l JOIN queue q ON q.oid = l.relation
                          WHERE l.pid = a.pid AND l.granted
                          ORDER BY 1) AS holds
              FROM pg_stat_activity a JOIN related r USING (pid)
             ORDER BY a.xact_start NULLS LAST
            """
        ),
        {"tables": tables},
    )
    out = []
    for r in rows:
        out.append(LockInfo(
            r.pid, r.app, r.state, r.wait_event_type, r.wait_event,
            None if r.xact_s is None else float(r.xact_s), None if r.query_s is None else float(r.query_s),
            r.query or "", list(r.blocked_by or []), list(r.holds or []),
            (r.state or "").startswith("idle in transaction") and bool(r.holds),
        ))  # fmt: skip
    return out
