"""``sa-outbox doctor`` and ``sa-outbox locks``: the diagnosis the jobs document does by hand, in one command.

Each :class:`Finding` is ``ok``/``warn``/``fail`` with a one-line explanation and, when not ok, the fix.
Nothing here runs ``EXPLAIN ANALYZE`` or takes a lock: it reads the catalog, the statistics views and the
*plans* (``EXPLAIN`` without ``ANALYZE``) of this installation's real claim statements.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.schema import CreateIndex

from . import _sql
from ._durations import Duration, to_seconds
from .migration import QUEUE_STORAGE_PARAMETERS, storage_parameters_sql
from .monitoring import queue_status, xmin_horizon

__all__ = ["Finding", "LockInfo", "doctor", "explain_claim", "locks"]


@dataclass(frozen=True)
class Finding:
    check: str
    table: str | None
    status: str  # ok | warn | fail
    message: str
    fix: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def explain_claim(conn: Connection, model: type[Any], *, ordered: bool = False) -> dict[str, Any]:
    """The planner's plan (JSON, no ANALYZE) for this table's real claim statement."""
    spec = _sql.spec_for(model)
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


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = [node]
    for child in node.get("Plans", []):
        out += _nodes(child)
    return out


def _claim_plan_finding(conn: Connection, model: type[Any]) -> Finding:
    spec = _sql.spec_for(model)
    t = spec.table.name
    index = f"ix_{t}_ready" if spec.kind == "outbox" else f"ix_{t}_dequeue"
    plan = explain_claim(conn, model)
    nodes = _nodes(plan)
    seq = [n for n in nodes if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == t]
    limits = [n for n in nodes if n["Node Type"] == "Limit"]
    lock_rows = limits[0]["Plans"][0] if limits and limits[0].get("Plans") else {}
    uses_index = any(n.get("Index Name") == index for n in _nodes(lock_rows)) if lock_rows else False
    if lock_rows.get("Node Type") == "LockRows" and uses_index and not seq:
        return Finding("claim plan", t, "ok", f"claim: LockRows under Limit on an index scan of {index}")
    shape = ", ".join(f"{n['Node Type']}{' on ' + n['Relation Name'] if n.get('Relation Name') else ''}"
                      f"{' using ' + n['Index Name'] if n.get('Index Name') else ''}" for n in nodes)  # fmt: skip
    return Finding(
        "claim plan", t, "fail",
        f"the claim does not read {index} under LockRows (plan: {shape}); every claim scans and sorts the table",
        f"create the partial index (run the migration; see the 'indexes' finding) and ANALYZE {t}",
    )  # fmt: skip


def _index_findings(conn: Connection, model: type[Any]) -> list[Finding]:
    spec = _sql.spec_for(model)
    t = spec.table.name
    present = {
        r.indexname: r
        for r in conn.execute(
            text(
                "SELECT i.relname AS indexname, x.indisvalid, x.indisready FROM pg_index x "
                "JOIN pg_class i ON i.oid = x.indexrelid WHERE x.indrelid = CAST(:t AS regclass)"
            ),
            {"t": spec.table.fullname},
        )
    }
    out = []
    for index in sorted(spec.table.indexes, key=lambda i: str(i.name)):
        name = str(index.name)
        ddl = str(CreateIndex(index).compile(dialect=conn.dialect)).replace(
            "CREATE INDEX", "CREATE INDEX CONCURRENTLY"
        )
        if name not in present:
            out.append(Finding("indexes", t, "fail", f"index {name} is missing", ddl))
        elif not present[name].indisvalid:
            out.append(Finding("indexes", t, "fail", f"index {name} is INVALID (a failed CREATE INDEX CONCURRENTLY?)",
                               f"DROP INDEX CONCURRENTLY {name}; {ddl}"))  # fmt: skip
    if not out:
        out.append(
            Finding("indexes", t, "ok", f"all {len(spec.table.indexes)} partial indexes present and valid")
        )
    return out


def _storage_finding(conn: Connection, model: type[Any]) -> Finding:
    t = _sql.spec_for(model).table
    options = conn.execute(
        text("SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = CAST(:t AS regclass)"),
        {"t": t.fullname},
    ).scalar_one()
    have = dict(o.split("=", 1) for o in options)
    missing = [k for k in QUEUE_STORAGE_PARAMETERS if k not in have]
    if not missing:
        return Finding(
            "autovacuum settings",
            t.name,
            "ok",
            "per-table autovacuum settings present: " + ", ".join(options),
        )
    return Finding(
        "autovacuum settings", t.name, "warn",
        f"missing {', '.join(missing)}: with the server default (vacuum at 20 % dead) dead queue rows pile up "
        "in the claim's index between vacuums",
        f"ALTER TABLE {t.fullname} SET ({storage_parameters_sql()})",
    )  # fmt: skip


def doctor(
    engine: Engine,
    models: list[type[Any]],
    *,
    long_transaction: Duration = 300.0,
    dead_ratio_warn: float = 0.2,
    target: Any = None,
) -> list[Finding]:
    """Run every check on the given outbox/jobs models; ``target`` (a Dispatcher) adds the lease checks."""
    findings: list[Finding] = []
    with engine.connect() as conn:
        for model in models:
            t = _sql.spec_for(model).table.name
            findings.append(_claim_plan_finding(conn, model))
            findings += _index_findings(conn, model)
            findings.append(_storage_finding(conn, model))
            status = queue_status(conn, model, long_transaction=long_transaction)
            h = status.health
            if h is not None:
                if h.dead_tuples > 10_000 and h.dead_ratio > dead_ratio_warn:
                    findings.append(Finding(
                        "dead tuples", t, "warn",
                        f"{h.dead_tuples:,} dead tuples ({h.dead_ratio:.0%}); last autovacuum {h.last_autovacuum or 'never'}",
                        f"VACUUM (ANALYZE) {t}; check that the autovacuum settings are present and nothing holds the xmin horizon",
                    ))  # fmt: skip
                else:
                    findings.append(Finding("dead tuples", t, "ok",
                                            f"{h.dead_tuples:,} dead / {h.live_tuples:,} live; size {h.total_bytes / 1024:.0f} kB"))  # fmt: skip
            if status.expired_leases:
                findings.append(Finding(
                    "stuck rows", t, "warn",
                    f"{status.expired_leases} row(s) leased past their lease (a dispatcher/worker died or hangs)",
                    "they are rescued by the next run of any dispatcher/worker; if none runs, start one",
                ))  # fmt: skip
            else:
                findings.append(Finding("stuck rows", t, "ok", "no lease past its expiry"))
            if status.dead:
                findings.append(Finding("dead letters", t, "warn", f"{status.dead} dead/failed row(s) need a person",
                                        f"sa-outbox dead list{' --jobs' if status.kind == 'jobs' else ''}"))  # fmt: skip
            else:
                findings.append(Finding("dead letters", t, "ok", "no dead/failed rows"))
        threshold = to_seconds(long_transaction, name="long_transaction")
        holders = [
            h for h in xmin_horizon(conn) if h.kind != "transaction" or (h.age_seconds or 0) >= threshold
        ]
        if holders:
            for holder in holders:
                who = (
                    f"pid {holder.pid} ({holder.name or 'no application_name'}, {holder.state})"
                    if holder.pid
                    else f"{holder.kind} {holder.name!r}"
                )
                fix = f"SELECT pg_terminate_backend({holder.pid})" if holder.pid else (
                    f"SELECT pg_drop_replication_slot('{holder.name}')" if holder.kind == "replication_slot" else f"ROLLBACK PREPARED '{holder.name}'")  # fmt: skip
                findings.append(Finding("xmin horizon", None, "warn",
                                        f"{who} holds back the xmin horizon ({holder.xmin_age} xids"
                                        f"{f', open {holder.age_seconds:.0f}s' if holder.age_seconds else ''}): VACUUM cannot "
                                        "remove dead queue rows", fix))  # fmt: skip
        else:
            findings.append(Finding("xmin horizon", None, "ok", "no long transaction, replication slot or prepared "
                                    "transaction holds back VACUUM"))  # fmt: skip
        idle = [
            lk for lk in locks(conn, [_sql.spec_for(m).table.name for m in models]) if lk.idle_in_transaction
        ]
        for lk in idle:
            findings.append(Finding("idle in transaction", None, "warn",
                                    f"pid {lk.pid} ({lk.application_name or '?'}) is idle in transaction holding "
                                    f"{', '.join(lk.holds)}: its row locks block claims of those rows",
                                    f"SELECT pg_terminate_backend({lk.pid}) — and fix the client that leaves transactions open"))  # fmt: skip
        if not idle:
            findings.append(
                Finding("idle in transaction", None, "ok", "no idle-in-transaction session holds queue locks")
            )
    findings.append(Finding(
        "wake-ups", None, "ok",
        "NOTIFY is sent by the sa_outbox flush hook at commit; rows written without it are found by polling",
    ))  # fmt: skip
    if target is not None and hasattr(target, "publish_timeout"):
        lease, timeout, batch = (
            target.lease.total_seconds(),
            target.publish_timeout.total_seconds(),
            target.batch,
        )
        if batch * timeout > lease:
            findings.append(Finding("lease vs publish timeout", None, "warn",
                                    f"batch {batch} × publish_timeout {timeout:g}s > lease {lease:g}s: a slow broker "
                                    "makes the end of a batch be released instead of published",
                                    "lower batch or publish_timeout, or raise lease"))  # fmt: skip
        else:
            findings.append(Finding("lease vs publish timeout", None, "ok",
                                    f"lease {lease:g}s covers batch {batch} × publish_timeout {timeout:g}s"))  # fmt: skip
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
    holds: list[str]  # "<mode> on <table>"
    idle_in_transaction: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def locks(conn: Connection | Engine, tables: list[str]) -> list[LockInfo]:
    """Sessions holding or waiting for locks on the queue tables, with who blocks whom."""
    if isinstance(conn, Engine):
        with conn.connect() as c:
            return locks(c, tables)
    rows = conn.execute(
        text(
            """
            WITH involved AS (
                SELECT DISTINCT l.pid FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
                 WHERE c.relname = ANY(CAST(:tables AS text[])) AND l.pid <> pg_backend_pid()
            ), related AS (
                SELECT pid FROM involved
                UNION SELECT a.pid FROM pg_stat_activity a
                 WHERE a.pid <> pg_backend_pid() AND pg_blocking_pids(a.pid) && ARRAY(SELECT pid FROM involved)
            )
            SELECT a.pid, coalesce(a.application_name, '') AS app, a.state, a.wait_event_type, a.wait_event,
                   EXTRACT(epoch FROM now() - a.xact_start) AS xact_s, EXTRACT(epoch FROM now() - a.query_start) AS query_s,
                   left(a.query, 300) AS query, pg_blocking_pids(a.pid) AS blocked_by,
                   ARRAY(SELECT l.mode || ' on ' || c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
                          WHERE l.pid = a.pid AND l.granted AND c.relname = ANY(CAST(:tables AS text[]))
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
