"""The ceiling: the library's own claim + finalize statement driven by ``pgbench`` — the same SQL, no Python.

The statement is the one a Worker's steady state sends (``sa_outbox._steps.finalize_and_claim`` with
``fixed_batch``): ``_sql.finalize_and_claim_statement(spec_for(Job), limit=batch)``, compiled for psycopg
exactly as ``sa_outbox._execute`` compiles it, the batch written in. ``pgbench`` runs it as a prepared
statement (``-M prepared``) from ``clients`` connections, each statement autocommit, each writing the
previous statement's claims back as ``done`` while it claims the next batch — the loop of a no-op worker.

Two things differ from the loop, both forced by pgbench, both small:

* the claimed rows come back aggregated into one row (``\\gset`` keeps one row): the statement's result
  becomes a CTE and the outer ``SELECT`` builds the next outcome arrays from it (a few µs of server CPU, and
  one row on the wire instead of up to ``2 × batch``);
* pgbench cannot bind a NULL: the statement's two internal parameters whose value is NULL (the lease columns
  a finalize clears) are written in as typed NULLs, and so, at batch 1, are the one outcome's delay, error
  and result (the loop binds them as NULL parameters; at larger batches they are arrays of NULLs, bound).
  Every other parameter is a bound parameter, as psycopg sends it.

At batch 1 the statement is its one-outcome form (``single=True``), the one the loop sends when a statement
carries exactly one outcome; at larger batches the array form.

Each client runs ``jobs / (clients × batch)`` claiming statements plus one that finalizes its last batch, so
with every claim full the table drains exactly; the rate is the rows found ``done`` over pgbench's own
elapsed time (``transactions / tps``, connection set-up excluded).
"""

from __future__ import annotations

import re
import resource
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

from sqlalchemy import make_url
from sqlalchemy.dialects.postgresql.psycopg import dialect as psycopg_dialect

from sa_outbox import _sql, _steps
from sa_outbox.models import Job

from .harness import PostgresCpuWatch

_TAIL = "\n SELECT 'f' AS k"

INSTALL_HINT = "pgbench not found: apt-get install postgresql-client (Debian; it ships pgbench)"


def pgbench() -> str | None:
    return shutil.which("pgbench")


def script(batch: int) -> tuple[str, dict[str, Any]]:
    """(pgbench script, the -D variables) for the library's finalize + claim at ``batch``. At batch 1 each
    statement carries one outcome, so the loop sends the statement's one-outcome form (plain parameters,
    ``_steps._single``): so does the ceiling."""
    spec = _sql.spec_for(Job)
    single = batch == 1
    compiled = _sql.finalize_and_claim_statement(spec, limit=batch, single=single).compile(
        dialect=psycopg_dialect()
    )
    sql = str(compiled)
    one = [_steps.done_outcome(0, 0, spec.done)] if single else []
    outcome_names = set(_steps._outcome_params(spec, one))
    dynamic = set(_steps._claim_params(spec, "ceiling", batch, None, "default", None)) | outcome_names
    values: dict[str, Any] = {}
    for name, value in compiled.construct_params(_check=False).items():
        if name in dynamic and not (single and name in ("o_delay", "o_error", "o_result")):
            continue
        if value is None:  # pgbench binds text only: a NULL goes in as a typed NULL literal
            sql = re.sub(rf"%\({name}\)s", "NULL", sql)
        else:
            values[name] = value
    if sql.count(_TAIL) != 1:
        raise RuntimeError("finalize_and_claim_statement changed shape: update bench/ceiling.py")
    head, tail = sql.split(_TAIL)
    # The loop's statement as a CTE; the next round's outcomes (all 'done') built from its claimed rows.
    if single:
        outcomes = (
            "SELECT coalesce(max(id) FILTER (WHERE k = 'c'), 0) AS o_id,\n"
            "       coalesce(max(lease_version) FILTER (WHERE k = 'c'), 0) AS o_version\n"
        )
    else:
        outcomes = (
            "SELECT coalesce(array_agg(id) FILTER (WHERE k = 'c'), '{}') AS ids,\n"
            "       coalesce(array_agg(lease_version) FILTER (WHERE k = 'c'), '{}') AS versions,\n"
            "       coalesce(array_agg('done'::text) FILTER (WHERE k = 'c'), '{}') AS statuses,\n"
            "       coalesce(array_agg(NULL::float8) FILTER (WHERE k = 'c'), '{}') AS delays,\n"
            "       coalesce(array_agg(NULL::text) FILTER (WHERE k = 'c'), '{}') AS errors,\n"
            "       coalesce(array_agg(0) FILTER (WHERE k = 'c'), '{}') AS refunds,\n"
            "       coalesce(array_agg(NULL::text) FILTER (WHERE k = 'c'), '{}') AS results\n"
        )
    sql = f"{head}, result AS (SELECT 'f' AS k{tail})\n{outcomes}  FROM result"
    sql = re.sub(r"%\((\w+)\)s", r":\1", sql).replace("%%", "%")
    values.update(owner="ceiling", queue_name="default")
    if single:  # the first statement's outcome matches no row (as the first empty arrays do)
        values.update(o_id=0, o_version=0, o_status="done", o_refund=0)
    else:
        values.update(
            ids="{}", versions="{}", statuses="{}", delays="{}", errors="{}", refunds="{}", results="{}"
        )
    return sql + "\n\\gset\n", values


def libpq_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def run_pgbench(url: str, *, batch: int, clients: int, jobs: int, script_dir: Path) -> dict[str, Any]:
    """Drain ``jobs`` rows of the library's jobs table with pgbench; returns its own figures. The script is
    kept in ``script_dir`` and the command returned, so the ceiling can be rerun by hand."""
    exe = pgbench()
    if exe is None:
        raise RuntimeError(INSTALL_HINT)
    text, values = script(batch)
    per_client = jobs // (clients * batch) + 1  # the last statement finalizes the last batch
    script_dir.mkdir(parents=True, exist_ok=True)
    path = script_dir / f"finalize_and_claim_{batch}.sql"
    path.write_text(text)
    cmd = [exe, "-n", "-M", "prepared", "-c", str(clients), "-j", str(clients), "-t", str(per_client),
           "-f", str(path)]  # fmt: skip
    for name, value in values.items():
        cmd += ["-D", f"{name}={value}"]
    cmd.append(libpq_url(url))
    watch, child_before = PostgresCpuWatch(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    server_cpu, child_after = watch.stop(), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = proc.stdout + proc.stderr
    tps = re.search(r"^tps = ([\d.]+)", out, re.M)
    processed = re.search(r"number of transactions actually processed: (\d+)", out)
    if proc.returncode != 0 or tps is None or processed is None:
        raise RuntimeError(f"pgbench failed ({proc.returncode}):\n{out[-2000:]}")
    transactions = int(processed.group(1))
    return {
        "seconds": transactions / float(tps.group(1)),
        "transactions": transactions,
        "command": shlex.join(cmd),
        # pgbench's own CPU, and every PostgreSQL process's (compare with the library's all-PostgreSQL figure)
        "client_cpu_s": (child_after.ru_utime - child_before.ru_utime)
        + (child_after.ru_stime - child_before.ru_stime),
        "server_all_cpu_s": server_cpu,
    }
