"""Latency and single-connection scenarios: wake-up, the producer, claim latency as the table grows, a steady
trickle of events."""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from sa_outbox import Dispatcher, Message, Worker, enqueue
from sa_outbox import _steps as eng
from sa_outbox._sql import spec_for
from sa_outbox.models import Job, OutboxEvent

from .harness import CTX, Harness, Run, measured, summary, timed_processes
from .report import paired_ratio, row, rss_of

# --- wake-up: commit in this process → handler/publisher called in another ----------------------------


def wakeup_loop(url: str, kind: str, stamps: Any, stop: Any, h: Harness) -> None:
    """An idle Worker/Dispatcher with LISTEN (poll every 10 s, so only a notification wakes it in time); the
    handler/publisher sends (id, perf_counter()) back. perf_counter is CLOCK_MONOTONIC: one clock for every
    process on the machine."""
    engine = create_engine(url, pool_size=2)

    def stamp(row_id: int) -> None:
        stamps.put((row_id, time.perf_counter()))

    if kind == "jobs":
        loop: Any = Worker(engine, Job, {"noop": lambda job: stamp(job.id)}, poll_interval=10, listen=True)
    else:

        class Stamp:
            def publish(self, message: Message) -> None:
                stamp(message.id)

        loop = Dispatcher(engine, OutboxEvent, Stamp(), poll_interval=10, listen=True)
    thread = threading.Thread(target=loop.run, kwargs={"install_signal_handlers": False}, daemon=True)
    thread.start()
    with measured(h, lambda: []) as box:
        stop.wait(600)
        box["jobs"] = loop.stats.done
    loop.stop()
    thread.join(30)
    loop.close()
    engine.dispose()


def _wakeups(url: str, engine: Engine, kind: str, count: int) -> tuple[list[float], Run]:
    stamps, stop = CTX.Queue(), CTX.Event()
    lat: list[float] = []

    def produce(_procs: list[Any]) -> Any:
        time.sleep(0.5)  # the loop's LISTEN is up and it is idle
        for i in range(count):
            with Session(engine, expire_on_commit=False) as s, s.begin():
                if kind == "jobs":
                    item: Any = enqueue(s, Job, "noop", {"i": i})
                else:
                    item = OutboxEvent(aggregate_type="o", aggregate_id=str(i), event_type="E", payload={})
                    s.add(item)
                s.flush()
                t0 = time.perf_counter()  # the COMMIT is sent when the block ends
            row_id, seen = stamps.get(timeout=10)
            if row_id != item.id:
                raise RuntimeError(f"wake-up: expected row {item.id}, got {row_id}")
            lat.append((seen - t0) * 1000)
            time.sleep(0.02)
        stop.set()
        return None

    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox, jobs RESTART IDENTITY"))
    run = timed_processes(wakeup_loop, [(url, kind, stamps, stop)], on_start=produce)
    return lat, run


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


def scenario_wakeup(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """Commit → handler/publisher called, an idle loop with LISTEN in its own process; p50 and p99."""
    rows = []
    for kind, loop in (("outbox", "Dispatcher"), ("jobs", "Worker")):
        p50, p99, worst, runs = [], [], [], []
        for _ in range(cfg.runs):
            lat, run = _wakeups(url, engine, kind, cfg.wakeups)
            p50.append(statistics.median(lat))
            p99.append(percentile(lat, 99))
            worst.append(max(lat))
            runs.append(run)
        rows.append(row(f"wake-up, commit → {loop} calls the {'publisher' if kind == 'outbox' else 'handler'}, "
                        f"idle, LISTEN: p50", summary(p50), unit="ms", target="< 5 ms", rss=rss_of(runs)))  # fmt: skip
        rows.append(row("… p99", summary(p99), unit="ms", target="(reported)", max_ms=summary(worst)))
    return rows


# --- the producer ----------------------------------------------------------------------------------------


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
    from sqlalchemy import insert

    started = time.perf_counter()
    for i in range(start, start + n, tx_size):
        with engine.begin() as conn:
            conn.execute(
                insert(OutboxEvent),
                [{"aggregate_type": "order", "aggregate_id": str((i + k) % 100), "event_type": "E",
                  "payload": {"n": i + k}} for k in range(tx_size)],
            )  # fmt: skip
    return time.perf_counter() - started


def scenario_producer(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """Session hook (locks, validation, NOTIFY) vs a Core INSERT of the same rows, vs the same ORM session
    with the hook switched off, and ``emit()``. Single-connection and latency-bound, so within a run the four
    writers take turns in blocks of ``n / 10`` events (the order rotating): each sees the same conditions."""
    writers = {
        "hook": _produce_orm,
        "core": _produce_core,
        "orm": _produce_orm_without_hook,
        "emit": _produce_emit,
    }
    rows = []
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
        what = f"producer, {tx_size} event(s) per transaction"
        for name, ref, ref_name, target in (
            ("hook", "core", "Core INSERT", "≥ 0.7×"),
            ("hook", "orm", "ORM session without the hook", "(reported)"),
            ("emit", "core", "Core INSERT", "≥ 0.7×"),
        ):
            label = "session.add through the hook" if name == "hook" else "emit()"
            rows.append(row(f"{what}: {label} vs {ref_name}", summary(rates[name]), reference=summary(rates[ref]),
                            reference_name=ref_name, ratio=paired_ratio(rates[name], rates[ref]), target=target))  # fmt: skip
    return rows


# --- claim latency as the table grows -------------------------------------------------------------------


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


def scenario_growth(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """Claim latency (median of 200 claims of 50, rolled back) with 2,000 pending rows among 10k and 1M rows,
    and after purging the done rows. Each table is built once; its latency is taken ``--runs`` times."""
    from sa_outbox.monitoring import purge

    def vacuum() -> None:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE outbox"))

    figures: dict[str, list[float]] = {}
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
        vacuum()
        figures[str(total)] = [claim_latency(engine) for _ in range(cfg.runs)]
    purge(engine, OutboxEvent, older_than=timedelta(days=1), batch_size=50_000)
    vacuum()
    after = [claim_latency(engine) for _ in range(cfg.runs)]
    small, large = figures.values()
    return [
        row(f"claim latency, 2,000 pending among {cfg.growth_rows:,} rows (vs 10,000)", summary(large), unit="ms",
            reference=summary(small), reference_name="10,000 rows", reference_unit="ms",
            ratio=paired_ratio(large, small), target="≤ 2×"),
        row(f"… after purge + VACUUM ({cfg.growth_rows:,} → 2,000 rows)", summary(after), unit="ms"),
    ]  # fmt: skip


# --- steady state ---------------------------------------------------------------------------------------


def _steady_once(engine: Engine, rate: int, seconds: int) -> list[float]:
    ages: list[float] = []
    lock = threading.Lock()

    class AgePublisher:
        def publish(self, message: Message) -> None:
            with lock:
                ages.append(time.time() - message.created_at.timestamp())

    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox RESTART IDENTITY"))
    ds = [Dispatcher(engine, OutboxEvent, AgePublisher(), poll_interval=1.0, listen=True) for _ in range(2)]
    threads = [threading.Thread(target=d.run, kwargs={"install_signal_handlers": False}) for d in ds]
    for t in threads:
        t.start()
    started = time.perf_counter()
    for i in range(rate * seconds):
        delay = started + i / rate - time.perf_counter()
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
    return [a * 1000 for a in ages]


def scenario_steady(url: str, engine: Engine, cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """A steady trickle of single-event transactions, 2 dispatchers with LISTEN in this process: the age of
    each event when published (database created_at → publish), p50 and p99 of each run."""
    rate, seconds = cfg.steady_rate, cfg.steady_seconds
    p50, p99, delivered = [], [], []
    for _ in range(cfg.runs):
        ages_ms = _steady_once(engine, rate, seconds)
        p50.append(statistics.median(ages_ms))
        p99.append(percentile(ages_ms, 99))
        delivered.append(len(ages_ms))
    what = f"steady state, {rate}/s for {seconds} s, 2 dispatchers: age when published"
    return [
        row(f"{what}, p50", summary(p50), unit="ms", delivered=delivered),
        row("… p99", summary(p99), unit="ms"),
    ]
