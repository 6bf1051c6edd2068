"""The fault-injection run: real producers, dispatchers and workers (processes) on the real database and a
real broker (Redis Streams, a private redis-server of the run's own: the machine's shared one is never
touched), while the run kill -9s loops, terminates their backends, restarts the broker and — in the long
mode — takes the broker down for longer than the dispatchers' whole retry budget. Then a checker compares
what the consumer received with what the database holds (nothing lost, nothing dead).

Used by tests/test_faults.py (CI size) and bench/faults.py (long mode). Every loop is bounded in count and
time and stops by itself.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Column, Engine, Integer, MetaData, Table, Text, create_engine, text
from sqlalchemy.orm import Session

from .brokers import redis_call

ROOT = Path(__file__).resolve().parent.parent

meta = MetaData()
orders = Table("fault_orders", meta, Column("id", BigInteger, primary_key=True), Column("version", Integer))
rolled_back = Table("fault_rolled_back", meta, Column("token", Text, primary_key=True))
job_calls = Table("fault_job_calls", meta, Column("job_id", BigInteger), Column("pid", Integer))


@dataclass
class FaultConfig:
    producers: int = 3
    transactions: int = 400  # per producer
    aggregates: int = 40
    rollback_rate: float = 0.1
    dispatchers: int = 3
    workers: int = 2
    kills: int = 6
    terminations: int = 3
    broker_restarts: int = 1
    chaos_seconds: float = 20.0
    settle_seconds: float = 90.0
    pg_restarts: int = 0  # long mode only, on a server the run owns
    #: Broker outages longer than the dispatchers' retry budget (long mode): Redis down for outage_seconds
    #: (default: twice the budget, see retry_budget()) while producers keep writing.
    broker_outages: int = 0
    outage_seconds: float | None = None


@dataclass
class FaultReport:
    committed_events: int = 0
    delivered_distinct: int = 0
    undelivered: int = 0
    rolled_back_transactions: int = 0
    rolled_back_delivered: int = 0
    duplicates: int = 0
    unexplained_duplicates: int = 0
    order_violations: int = 0
    order_violations_across_lost_leases: int = 0
    jobs: int = 0
    jobs_handled_twice: int = 0
    jobs_handled_twice_unexplained: int = 0
    jobs_not_done: int = 0
    stuck_rows: int = 0
    not_stopped: int = 0  # loops still running 30 s after the final SIGTERM (then killed)
    kills: int = 0
    terminations: int = 0
    broker_restarts: int = 0
    pg_restarts: int = 0
    broker_outages: int = 0
    outage_seconds: float = 0.0  # each outage's length
    retry_budget_seconds: float = 0.0  # the longest a dispatcher retries a message before it is dead
    dead_rows: int = 0  # outbox dead + jobs failed: must stay 0 (nothing here is poison)
    log: list[str] = field(default_factory=list)


def _producer(url: str, seed: int, transactions: int, aggregates: int, rate: float) -> None:  # child process
    from sa_outbox import enqueue
    from sa_outbox.models import Job, OutboxEvent

    engine = create_engine(url, pool_size=2)
    rnd = random.Random(seed)
    for _ in range(transactions):
        token = uuid.uuid4().hex
        try:
            with Session(engine) as s, s.begin():
                agg = rnd.randint(1, aggregates)
                version = s.execute(
                    text("UPDATE fault_orders SET version = version + 1 WHERE id = :i RETURNING version"),
                    {"i": agg},
                ).scalar_one()  # the UPDATE holds the aggregate's row lock until commit
                s.add(OutboxEvent(aggregate_type="order", aggregate_id=str(agg), event_type="OrderUpdated",
                                  payload={"version": version, "tx": token}))  # fmt: skip
                s.add(
                    OutboxEvent(
                        aggregate_type="notice",
                        aggregate_id=str(agg),
                        event_type="Notice",
                        payload={"tx": token},
                    )
                )
                enqueue(s, Job, "record", {"tx": token}, max_attempts=20)
                if rnd.random() < rate:
                    s.flush()
                    raise _Rollback
        except _Rollback:
            with engine.begin() as conn:
                conn.execute(rolled_back.insert().values(token=token))
        except Exception:  # a terminated backend: the outcome is unknown (it may have committed): not counted
            continue
    engine.dispose()


class _Rollback(Exception):
    pass


def retry_budget() -> float:
    """Seconds a fault-run dispatcher (tests/fault_targets.py) retries one message before it is dead: the sum
    of its backoff ceilings over max_attempts — an outage longer than this killed messages before issue #19."""
    from sa_outbox import Backoff

    from .fault_targets import dispatcher

    saved = {k: os.environ.get(k) for k in ("DATABASE_URL", "FAULT_STREAM")}
    os.environ.update(DATABASE_URL="postgresql+psycopg://nobody@127.0.0.1:1/none", FAULT_STREAM="budget")
    try:
        d = dispatcher()  # builds, connects nowhere
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ceilings = Backoff(d.backoff.base, d.backoff.cap, jitter=False)
    budget = sum(ceilings.delay(a) for a in range(1, d.max_attempts))
    d.close()
    return budget


def _stacks(pid: int) -> str:
    """The Python stacks of a process (py-spy, when installed: the bench extra), for a report."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return "(py-spy not installed: no stacks)"
    done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
    return done.stdout[-6000:] + done.stderr[-1000:]


def _spawn(kind: str, url: str, stream: str, index: int, redis_url: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, DATABASE_URL=url, FAULT_STREAM=stream, FAULT_APP=f"fault-{kind}-{index}",
               FAULT_REDIS_URL=redis_url)  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "sa_outbox", "--log-level", "ERROR", "dispatch" if kind == "dispatch" else "worker",
         f"tests.fault_targets:{'dispatcher' if kind == 'dispatch' else 'worker'}"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def run_faults(engine: Engine, url: str, cfg: FaultConfig) -> FaultReport:
    from .brokers import PrivateRedis

    broker = PrivateRedis()
    broker.start()
    try:
        return _run(engine, url, cfg, broker)
    finally:
        broker.close()


def _run(engine: Engine, url: str, cfg: FaultConfig, broker: Any) -> FaultReport:
    import multiprocessing

    report = FaultReport()
    report.retry_budget_seconds = round(retry_budget(), 2)
    outage = cfg.outage_seconds if cfg.outage_seconds is not None else 2 * report.retry_budget_seconds
    stream = f"sa_outbox_faults:{uuid.uuid4().hex[:8]}"
    meta.drop_all(engine)
    meta.create_all(engine)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox, jobs RESTART IDENTITY"))
        conn.execute(orders.insert(), [{"id": i, "version": 0} for i in range(1, cfg.aggregates + 1)])
    ctx = multiprocessing.get_context("spawn")
    producers = [ctx.Process(target=_producer, args=(url, i, cfg.transactions, cfg.aggregates, cfg.rollback_rate))
                 for i in range(cfg.producers)]  # fmt: skip
    loops: dict[str, subprocess.Popen[bytes]] = {}
    for i in range(cfg.dispatchers):
        loops[f"dispatch-{i}"] = _spawn("dispatch", url, stream, i, broker.url)
    for i in range(cfg.workers):
        loops[f"worker-{i}"] = _spawn("worker", url, stream, i, broker.url)
    for p in producers:
        p.start()
    rnd = random.Random(7)
    deadline = time.monotonic() + cfg.chaos_seconds
    actions = (["kill"] * cfg.kills + ["terminate"] * cfg.terminations + ["broker"] * cfg.broker_restarts
               + ["outage"] * cfg.broker_outages)  # fmt: skip
    rnd.shuffle(actions)
    pause = cfg.chaos_seconds / (len(actions) + 1)
    if cfg.pg_restarts:
        actions += ["postgres"] * cfg.pg_restarts
        rnd.shuffle(actions)
    for action in actions:  # bounded: one pass over the planned actions
        time.sleep(pause)
        if time.monotonic() > deadline:
            break
        if action == "kill":
            name = rnd.choice(sorted(loops))
            loops[name].send_signal(signal.SIGKILL)
            loops[name].wait(10)
            kind, index = name.split("-")
            loops[name] = _spawn(kind, url, stream, int(index), broker.url)
            report.kills += 1
            report.log.append(f"kill -9 {name}")
        elif action == "terminate":
            with engine.connect() as conn:
                n = conn.execute(text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name LIKE 'fault-%'"
                )).scalar_one()  # fmt: skip
                conn.commit()
            report.terminations += 1
            report.log.append(f"terminated {n} backends")
        elif action == "postgres":
            cluster = sorted(os.listdir("/etc/postgresql"))[-1]
            subprocess.run(
                ["pg_ctlcluster", "--skip-systemctl-redirect", cluster, "main", "restart"],
                check=True,
                timeout=120,
            )
            report.pg_restarts += 1
            report.log.append("restarted postgresql")
        elif action == "outage":
            # Longer than the whole retry budget: before issue #19 every message claimed meanwhile went dead.
            # Producers, kills of other loops and the checker's counts go on as before; the chaos window is
            # extended by the outage so that the planned faults still fit in it.
            broker.stop(save=True)
            time.sleep(outage)
            broker.start()
            deadline += outage
            report.broker_outages += 1
            report.outage_seconds = round(outage, 1)
            report.log.append(f"redis down for {outage:.1f}s ({outage / report.retry_budget_seconds:.1f}x the "
                              "retry budget)")  # fmt: skip
        else:
            # SHUTDOWN SAVE writes the dataset and the restart loads it: a broker restart that keeps what it
            # acknowledged (this Redis runs without persistence otherwise).
            broker.stop(save=True)
            time.sleep(1.0)
            broker.start()
            report.broker_restarts += 1
            report.log.append("restarted redis")
    for p in producers:
        p.join(cfg.settle_seconds)
    settle_deadline = time.monotonic() + cfg.settle_seconds
    while time.monotonic() < settle_deadline:
        with engine.connect() as conn:
            busy = conn.execute(text(
                "SELECT (SELECT count(*) FROM outbox WHERE status IN ('pending', 'processing')) + "
                "(SELECT count(*) FROM jobs WHERE status IN ('queued', 'running'))"
            )).scalar_one()  # fmt: skip
        if busy == 0:
            break
        time.sleep(0.5)
    for proc in loops.values():
        proc.send_signal(signal.SIGTERM)
    for name, proc in loops.items():
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            report.not_stopped += 1
            report.log.append(f"{name} (pid {proc.pid}) still running 30 s after SIGTERM: killed")
            report.log.append(_stacks(proc.pid))
            proc.kill()
            proc.wait(10)
    _check(engine, stream, report, broker.url)
    meta.drop_all(engine)
    return report


def _check(engine: Engine, stream: str, report: FaultReport, redis_url: str) -> None:
    entries = redis_call(redis_url, "xrange", stream, decode=True)
    import json

    delivered = [(int(f["message_id"]), f["aggregate_type"], f["aggregate_id"], f["event_type"], json.loads(f["payload"]))
                 for _, f in entries]  # fmt: skip
    with engine.connect() as conn:
        outbox = {
            r.id: r for r in conn.execute(text("SELECT id, status, lease_version, payload FROM outbox"))
        }
        rb = set(conn.execute(text("SELECT token FROM fault_rolled_back")).scalars())
        calls = Counter(conn.execute(text("SELECT job_id FROM fault_job_calls")).scalars())
        jobs = {r.id: r for r in conn.execute(text("SELECT id, status, lease_version FROM jobs"))}
        report.dead_rows = conn.execute(text(
            "SELECT (SELECT count(*) FROM outbox WHERE status = 'dead') + "
            "(SELECT count(*) FROM jobs WHERE status = 'failed')"
        )).scalar_one()  # fmt: skip
        report.stuck_rows = conn.execute(text(
            "SELECT (SELECT count(*) FROM outbox WHERE status = 'processing') + "
            "(SELECT count(*) FROM jobs WHERE status = 'running')"
        )).scalar_one()  # fmt: skip
    counts = Counter(d[0] for d in delivered)
    report.committed_events = len(outbox)
    report.delivered_distinct = len(set(counts) & set(outbox))
    report.undelivered = len(set(outbox) - set(counts))
    report.rolled_back_transactions = len(rb)
    report.rolled_back_delivered = sum(1 for d in delivered if d[4].get("tx") in rb) + len(
        set(counts) - set(outbox)
    )
    dup_ids = [i for i, n in counts.items() if n > 1]
    report.duplicates = sum(counts[i] - 1 for i in dup_ids)
    # A duplicate is explained when the message was claimed more than once (its lease was lost: a crash, a
    # terminated backend, a broker outage past the lease).
    report.unexplained_duplicates = sum(1 for i in dup_ids if outbox[i].lease_version < 2)
    seen: set[int] = set()
    newest: dict[str, int] = defaultdict(int)
    for mid, _atype, aid, etype, payload in delivered:
        first = mid not in seen
        seen.add(mid)
        if etype != "OrderUpdated":
            continue
        version = int(payload["version"])
        if version < newest[aid]:
            if first and outbox[mid].lease_version < 2:
                report.order_violations += 1
            else:
                report.order_violations_across_lost_leases += 1
        newest[aid] = max(newest[aid], version)
    report.jobs = len(jobs)
    report.jobs_not_done = sum(1 for j in jobs.values() if j.status != "done")
    twice = [j for j, n in calls.items() if n > 1]
    report.jobs_handled_twice = len(twice)
    report.jobs_handled_twice_unexplained = sum(1 for j in twice if jobs[j].lease_version < 2)
