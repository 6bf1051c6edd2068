"""sa_outbox benchmark: library vs the jobs document's own worker, in the same run, on the same database.

    python -m bench.run                 # full run (takes several minutes)
    python -m bench.run --quick         # small sizes, one repetition (smoke test)
    python -m bench.run --scenarios jobs,outbox --runs 3

Figures are medians of ``--runs`` repetitions (min–max shown as the machine's noise); ratios are
library/baseline within the run. Results go to stdout as a table and to ``bench/results/latest.json``.
Uses ``DATABASE_URL`` (a database named ``sa_outbox_bench`` is created on that server and dropped at the
end), else an embedded PostgreSQL.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, insert, make_url, text
from sqlalchemy.orm import Session

from sa_outbox import Dispatcher, Message, Worker
from sa_outbox import _steps as eng
from sa_outbox._sql import spec_for
from sa_outbox.embedded import database_url
from sa_outbox.models import Base, Job, OutboxEvent

from .baseline import baseline_worker

RESULTS = Path(__file__).resolve().parent / "results"
CTX = multiprocessing.get_context("spawn")


# --- setup ----------------------------------------------------------------------------------------------


def bench_database(server_url: str) -> str:
    url = make_url(server_url)
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text("DROP DATABASE IF EXISTS sa_outbox_bench WITH (FORCE)"))
        conn.execute(text("CREATE DATABASE sa_outbox_bench"))
    admin.dispose()
    bench_url = url.set(database="sa_outbox_bench").render_as_string(hide_password=False)
    engine = create_engine(bench_url)
    Base.metadata.create_all(engine)
    engine.dispose()
    return bench_url


def drop_database(server_url: str) -> None:
    admin = create_engine(make_url(server_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text("DROP DATABASE IF EXISTS sa_outbox_bench WITH (FORCE)"))
    admin.dispose()


def vacuum(engine: Engine, *tables: str) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for t in tables:
            conn.execute(text(f"VACUUM ANALYZE {t}"))


def reset_jobs(engine: Engine, n: int) -> None:
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE jobs RESTART IDENTITY"))
        conn.execute(
            text(
                "INSERT INTO jobs (task, payload) SELECT 'noop', jsonb_build_object('n', g) FROM generate_series(1, :n) g"
            ),
            {"n": n},
        )
    vacuum(engine, "jobs")


def reset_outbox(engine: Engine, n: int, aggregates: int) -> None:
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox RESTART IDENTITY"))
        conn.execute(
            text(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                "SELECT 'order', (g % :a)::text, 'E', jsonb_build_object('n', g) FROM generate_series(1, :n) g"
            ),
            {"n": n, "a": aggregates},
        )
    vacuum(engine, "outbox")


# --- processes ------------------------------------------------------------------------------------------


class NoopPublisher:
    def publish(self, message: Message) -> None:
        return None


def library_worker(url: str, batch: int, job_seconds: float, concurrency: int, ready: Any, go: Any) -> None:
    engine = create_engine(url, pool_size=2)
    handler: Callable[[Any], None] = (lambda j: time.sleep(job_seconds)) if job_seconds else (lambda j: None)
    w = Worker(engine, Job, {"noop": handler}, batch=batch, concurrency=concurrency, listen=False)
    with engine.connect():
        pass
    ready.set()
    go.wait()
    w.run(install_signal_handlers=False, until_idle=True)
    w.close()
    engine.dispose()


def library_dispatcher(url: str, batch: int, ordered: bool, ready: Any, go: Any) -> None:
    engine = create_engine(url, pool_size=2)
    d = Dispatcher(engine, OutboxEvent, NoopPublisher(), batch=batch, ordered=ordered, listen=False)
    with engine.connect():
        pass
    ready.set()
    go.wait()
    if ordered:
        # The ordered claim can come back empty while other dispatchers hold the heads: stop only when the
        # table has nothing left for anyone.
        with engine.connect() as conn:
            while True:
                d.run(install_signal_handlers=False, until_idle=True)
                left = conn.execute(text("SELECT count(*) FROM outbox WHERE status <> 'done'")).scalar_one()
                conn.rollback()
                if not left:
                    break
                time.sleep(0.001)
    else:
        d.run(install_signal_handlers=False, until_idle=True)
    d.close()
    engine.dispose()


class AsyncNoopPublisher:
    async def publish(self, message: Message) -> None:
        return None


async def _async_noop(job: Any) -> None:
    return None


def library_async_loop(url: str, kind: str, batch: int, flavour: str, ready: Any, go: Any) -> None:
    """AsyncWorker / AsyncDispatcher in one process (psycopg async driver); ``flavour`` is the handler's or
    publisher's: ``sync`` (run off the event loop) or ``async``."""
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from sa_outbox import AsyncDispatcher, AsyncWorker

    async def main() -> None:
        engine = create_async_engine(url.replace("+psycopg:", "+psycopg_async:"), pool_size=2)
        if kind == "jobs":
            handler: Any = _async_noop if flavour == "async" else (lambda j: None)
            loop: Any = AsyncWorker(engine, Job, {"noop": handler}, batch=batch, listen=False)
        else:
            publisher: Any = AsyncNoopPublisher() if flavour == "async" else NoopPublisher()
            loop = AsyncDispatcher(engine, OutboxEvent, publisher, batch=batch, listen=False)
        async with engine.connect():
            pass
        ready.set()
        while not go.is_set():
            await asyncio.sleep(0.001)
        await loop.run(install_signal_handlers=False, until_idle=True)
        await loop.close()
        await engine.dispose()

    asyncio.run(main())


def timed_processes(target: Callable[..., None], args_for: list[tuple[Any, ...]]) -> float:
    readies = [CTX.Event() for _ in args_for]
    go = CTX.Event()
    procs = [CTX.Process(target=target, args=(*a, r, go)) for a, r in zip(args_for, readies, strict=True)]
    for p in procs:
        p.start()
    for r in readies:
        r.wait(60)
    started = time.perf_counter()
    go.set()
    for p in procs:
        p.join(600)
    elapsed = time.perf_counter() - started
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a benchmark process failed: {[p.exitcode for p in procs]}")
    return elapsed


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# --- scenarios ------------------------------------------------------------------------------------------


def scenario_jobs(url: str, engine: Engine, cfg: argparse.Namespace) -> dict[str, Any]:
    n, procs = cfg.jobs, 4
    libpq = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    out: dict[str, Any] = {}
    for batch in (1, 10, 50):
        lib, base = [], []
        for _ in range(cfg.runs):
            reset_jobs(engine, n)
            base.append(n / timed_processes(baseline_worker, [(libpq, batch, 0.0)] * procs))
            reset_jobs(engine, n)
            lib.append(n / timed_processes(library_worker, [(url, batch, 0.0, 1)] * procs))
            check_drained(engine, "jobs", n)
        out[f"batch {batch}"] = ratio_row(lib, base)
    return out


def scenario_slow_jobs(url: str, engine: Engine, cfg: argparse.Namespace) -> dict[str, Any]:
    n = cfg.slow_jobs
    libpq = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    lib, base = [], []
    for _ in range(cfg.runs):
        reset_jobs(engine, n)
        base.append(n / timed_processes(baseline_worker, [(libpq, 1, 0.005)] * 8))
        reset_jobs(engine, n)
        # 8 jobs in flight: 2 processes × 4 handler threads, each claiming 8 at a time.
        lib.append(n / timed_processes(library_worker, [(url, 8, 0.005, 4)] * 2))
        check_drained(engine, "jobs", n)
    return {"5 ms jobs, 8 in flight": ratio_row(lib, base)}


def scenario_outbox(url: str, engine: Engine, cfg: argparse.Namespace) -> dict[str, Any]:
    n, procs = cfg.jobs, 4
    libpq = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    base, plain, ordered = [], [], []
    for _ in range(cfg.runs):
        reset_jobs(engine, n)
        base.append(n / timed_processes(baseline_worker, [(libpq, 50, 0.0)] * procs))
        reset_outbox(engine, n, 1000)
        plain.append(n / timed_processes(library_dispatcher, [(url, 50, False)] * procs))
        check_drained(engine, "outbox", n)
        reset_outbox(engine, n, 1000)
        ordered.append(n / timed_processes(library_dispatcher, [(url, 50, True)] * procs))
        check_drained(engine, "outbox", n)
    return {
        "plain claim, batch 50": ratio_row(plain, base),
        "ordered claim (1,000 aggregates), batch 50": {**ratio_row(ordered, base),
                                                      "vs_plain": statistics.median(ordered) / statistics.median(plain)},
    }  # fmt: skip


def scenario_async(url: str, engine: Engine, cfg: argparse.Namespace) -> dict[str, Any]:
    """The same drains through AsyncWorker / AsyncDispatcher, beside the sync classes: with the sync no-op
    handler/publisher (run off the event loop) and with an ``async def`` one."""
    n, procs = cfg.jobs, 4
    out: dict[str, Any] = {}
    for kind in ("jobs", "outbox"):
        reset = reset_jobs if kind == "jobs" else (lambda e, k: reset_outbox(e, k, 1000))
        rates: dict[str, list[float]] = {"sync": [], "async/sync": [], "async/async": []}
        for _ in range(cfg.runs):
            reset(engine, n)
            target = library_worker if kind == "jobs" else library_dispatcher
            args = (url, 50, 0.0, 1) if kind == "jobs" else (url, 50, False)
            rates["sync"].append(n / timed_processes(target, [args] * procs))
            check_drained(engine, kind, n)
            for flavour in ("sync", "async"):
                reset(engine, n)
                loop_args = (url, kind, 50, flavour)
                rates[f"async/{flavour}"].append(n / timed_processes(library_async_loop, [loop_args] * procs))
                check_drained(engine, kind, n)
        what = "handler" if kind == "jobs" else "publisher"
        out[f"{kind} drain, batch 50, sync {what}: async vs sync"] = ratio_row(
            rates["async/sync"], rates["sync"]
        )
        out[f"{kind} drain, batch 50, async def {what}: async vs sync"] = ratio_row(
            rates["async/async"], rates["sync"]
        )
    return out


def _produce_orm(engine: Engine, start: int, n: int, tx_size: int) -> float:
    started = time.perf_counter()
    for i in range(start, start + n, tx_size):
        with Session(engine) as s, s.begin():
            s.add_all(
                OutboxEvent(
                    aggregate_type="order",
                    aggregate_id=str((i + k) % 100),
                    event_type="E",
                    payload={"n": i + k},
                )
                for k in range(tx_size)
            )
    return time.perf_counter() - started


def _produce_orm_without_hook(engine: Engine, start: int, n: int, tx_size: int) -> float:
    from sqlalchemy import event

    from sa_outbox import _producer as producer

    for name, fn in producer._LISTENERS:  # the bare ORM: every listener of the producer off
        event.remove(Session, name, fn)
    try:
        return _produce_orm(engine, start, n, tx_size)
    finally:
        producer.install()


def _produce_emit(engine: Engine, start: int, n: int, tx_size: int) -> float:
    from sa_outbox import emit

    started = time.perf_counter()
    for i in range(start, start + n, tx_size):
        with Session(engine) as s, s.begin():
            emit(s, OutboxEvent, [("order", str((i + k) % 100), "E", {"n": i + k}) for k in range(tx_size)])
    return time.perf_counter() - started


def _produce_core(engine: Engine, start: int, n: int, tx_size: int) -> float:
    started = time.perf_counter()
    for i in range(start, start + n, tx_size):
        with engine.begin() as conn:
            conn.execute(
                insert(OutboxEvent),
                [{"aggregate_type": "order", "aggregate_id": str((i + k) % 100), "event_type": "E",
                  "payload": {"n": i + k}} for k in range(tx_size)],
            )  # fmt: skip
    return time.perf_counter() - started


def scenario_producer(url: str, engine: Engine, cfg: argparse.Namespace) -> dict[str, Any]:
    """Session hook (locks, validation, NOTIFY) vs a Core INSERT of the same rows, vs the same ORM session
    with the hook switched off (what an application writes without the library), and ``emit()``.

    Single-connection, latency-bound and so sensitive to the machine's drift: within a run the four writers
    take turns in blocks of ``n / 10`` events (the order rotating), so each sees the same conditions; a run's
    rate is its events over the summed time of its blocks.
    """
    writers = {
        "hook": _produce_orm,
        "core": _produce_core,
        "orm": _produce_orm_without_hook,
        "emit": _produce_emit,
    }
    out: dict[str, Any] = {}
    n, blocks = cfg.producer, 10
    per_block = n // blocks
    for tx_size in (1, 10):
        rates: dict[str, list[float]] = {name: [] for name in writers}
        for _ in range(cfg.runs):
            with engine.begin() as conn:
                conn.execute(text("TRUNCATE outbox RESTART IDENTITY"))
            spent = dict.fromkeys(writers, 0.0)
            for b in range(blocks):
                names = list(writers)
                for name in names[b % len(names) :] + names[: b % len(names)]:
                    spent[name] += writers[name](engine, b * per_block, per_block, tx_size)
            for name in writers:
                rates[name].append(per_block * blocks / spent[name])
        out[f"{tx_size} event(s) per transaction, vs Core INSERT"] = ratio_row(rates["hook"], rates["core"])
        out[f"{tx_size} event(s) per transaction, vs ORM session without the hook"] = ratio_row(
            rates["hook"], rates["orm"]
        )
        out[f"{tx_size} event(s) per transaction, emit() vs Core INSERT"] = ratio_row(
            rates["emit"], rates["core"]
        )
    return out


def scenario_wakeup(url: str, engine: Engine, cfg: argparse.Namespace) -> dict[str, Any]:
    seen: dict[int, float] = {}
    got = threading.Event()

    class Stamp:
        def publish(self, message: Message) -> None:
            seen[message.id] = time.perf_counter()
            got.set()

    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox RESTART IDENTITY"))
    d = Dispatcher(engine, OutboxEvent, Stamp(), poll_interval=10, listen=True)
    thread = threading.Thread(target=d.run, kwargs={"install_signal_handlers": False})
    thread.start()
    time.sleep(0.5)
    lat = []
    try:
        for i in range(cfg.wakeups):
            got.clear()
            t0 = time.perf_counter()
            with Session(engine, expire_on_commit=False) as s, s.begin():
                ev = OutboxEvent(aggregate_type="o", aggregate_id=str(i), event_type="E", payload={})
                s.add(ev)
            if not got.wait(10):
                raise RuntimeError("wake-up never came")
            lat.append((seen[ev.id] - t0) * 1000)
            time.sleep(0.02)
    finally:
        d.stop()
        thread.join(10)
    lat.sort()
    return {
        "commit → publish (ms)": {
            "p50": statistics.median(lat),
            "p99": lat[int(len(lat) * 0.99) - 1],
            "max": lat[-1],
        }
    }


def claim_latency(engine: Engine, tries: int = 200) -> float:
    spec = spec_for(OutboxEvent)
    times = []
    with engine.connect() as conn:
        for _ in range(tries):
            t0 = time.perf_counter()
            eng.claim(conn, spec, owner="probe", batch=50, lease=timedelta(seconds=60))
            times.append(time.perf_counter() - t0)
            conn.rollback()
    return statistics.median(times) * 1000


def scenario_growth(url: str, engine: Engine, cfg: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for total in (10_000, cfg.growth_rows):
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE outbox RESTART IDENTITY"))
            conn.execute(
                text(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, status, done_at) "
                    "SELECT 'o', (g % 1000)::text, 'E', '{}', CASE WHEN g <= :done THEN 'done' ELSE 'pending' END, "
                    "now() - interval '30 days' FROM generate_series(1, :n) g"
                ),
                {"n": total, "done": total - 2000},
            )
        vacuum(engine, "outbox")
        out[f"{total:,} rows (2,000 pending)"] = claim_latency(engine)
    from sa_outbox.monitoring import purge

    purge(engine, OutboxEvent, older_than=86400, batch_size=50_000)
    vacuum(engine, "outbox")
    out[f"after purge + vacuum ({cfg.growth_rows:,} → 2,000 rows)"] = claim_latency(engine)
    values = list(out.values())
    return {"claim latency (ms, median of 200)": out, "ratio 1M/10k": values[1] / values[0]}


def scenario_steady(url: str, engine: Engine, cfg: argparse.Namespace) -> dict[str, Any]:
    ages: list[float] = []
    lock = threading.Lock()

    class AgePublisher:
        def publish(self, message: Message) -> None:
            with lock:
                ages.append(time.time() - message.created_at.timestamp())

    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox RESTART IDENTITY"))
    ds = [
        Dispatcher(engine, OutboxEvent, AgePublisher(), batch=50, poll_interval=1.0, listen=True)
        for _ in range(2)
    ]
    threads = [threading.Thread(target=d.run, kwargs={"install_signal_handlers": False}) for d in ds]
    for t in threads:
        t.start()
    rate, seconds = cfg.steady_rate, cfg.steady_seconds
    started = time.perf_counter()
    for i in range(rate * seconds):
        target = started + i / rate
        delay = target - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        with Session(engine) as s, s.begin():
            s.add(OutboxEvent(aggregate_type="o", aggregate_id=str(i % 50), event_type="E", payload={}))
    deadline = time.monotonic() + 30
    while len(ages) < rate * seconds and time.monotonic() < deadline:
        time.sleep(0.05)
    for d in ds:
        d.stop()
    for t in threads:
        t.join(10)
    ages_ms = sorted(a * 1000 for a in ages)
    return {f"{rate}/s for {seconds}s, 2 dispatchers": {
        "delivered": len(ages_ms), "p50 age (ms)": statistics.median(ages_ms), "p99 age (ms)": ages_ms[int(len(ages_ms) * 0.99) - 1]}}  # fmt: skip


def ratio_row(lib: list[float], base: list[float]) -> dict[str, Any]:
    return {
        "library": summary(lib),
        "baseline": summary(base),
        "ratio": statistics.median(lib) / statistics.median(base),
    }


def check_drained(engine: Engine, table: str, n: int) -> None:
    with engine.connect() as conn:
        done = conn.execute(text(f"SELECT count(*) FROM {table} WHERE status = 'done'")).scalar_one()
    if done != n:
        raise RuntimeError(f"{table}: {done} of {n} done after the drain")


SCENARIOS = {
    "jobs": scenario_jobs,
    "slowjobs": scenario_slow_jobs,
    "outbox": scenario_outbox,
    "async": scenario_async,
    "producer": scenario_producer,
    "wakeup": scenario_wakeup,
    "growth": scenario_growth,
    "steady": scenario_steady,
}


def render(results: dict[str, Any]) -> str:
    lines = []
    for name, data in results["scenarios"].items():
        lines.append(f"== {name}")
        for key, value in data.items():
            if isinstance(value, dict) and "ratio" in value and "library" in value:
                lib, base = value["library"], value["baseline"]
                extra = f"  ordered/plain {value['vs_plain']:.2f}x" if "vs_plain" in value else ""
                lines.append(
                    f"  {key:<44} library {lib['median']:>9,.0f}/s ({lib['min']:,.0f}–{lib['max']:,.0f})  "
                    f"baseline {base['median']:>9,.0f}/s ({base['min']:,.0f}–{base['max']:,.0f})  "
                    f"ratio {value['ratio']:.2f}x{extra}"
                )
            elif isinstance(value, dict):
                lines.append(
                    f"  {key}: "
                    + ", ".join(
                        f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items()
                    )
                )
            else:
                lines.append(f"  {key}: {value:.2f}" if isinstance(value, float) else f"  {key}: {value}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run")
    p.add_argument("--quick", action="store_true", help="small sizes, one repetition")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--json", default=str(RESULTS / "latest.json"))
    cfg = p.parse_args(argv)
    cfg.jobs, cfg.slow_jobs, cfg.producer, cfg.wakeups = 20_000, 4_000, 5_000, 200
    cfg.growth_rows, cfg.steady_rate, cfg.steady_seconds = 1_000_000, 500, 10
    if cfg.quick:
        cfg.runs, cfg.jobs, cfg.slow_jobs, cfg.producer, cfg.wakeups = 1, 2_000, 400, 500, 20
        cfg.growth_rows, cfg.steady_rate, cfg.steady_seconds = 50_000, 100, 2
    with database_url() as server:
        url = bench_database(server)
        engine = create_engine(url, pool_size=4)
        results: dict[str, Any] = {
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
            "runs": cfg.runs,
            "scenarios": {},
        }
        with engine.connect() as conn:
            results["machine"]["postgresql"] = conn.execute(text("SHOW server_version")).scalar_one()
        try:
            for name in cfg.scenarios.split(","):
                t0 = time.perf_counter()
                results["scenarios"][name] = SCENARIOS[name](url, engine, cfg)
                print(
                    render({"scenarios": {name: results["scenarios"][name]}}),
                    f"  [{time.perf_counter() - t0:.0f}s]",
                    flush=True,
                )
        finally:
            engine.dispose()
            drop_database(server)
    Path(cfg.json).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
