"""Ordered events per aggregate: several dispatchers, one order's events still arrive in commit order.

Producers lock the order row (``FOR NO KEY UPDATE``) while they read and bump its version; the outbox hook
takes the same lock, so the outbox id order within an order is its commit order, and ``ordered=True``
dispatchers only ever claim the oldest unfinished event of each order.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from sqlalchemy import BigInteger, Integer, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sa_outbox import Dispatcher, Message, OutboxMixin
from sa_outbox.embedded import database_url


class Base(DeclarativeBase):
    pass


class Account(Base):
    __tablename__ = "ex_accounts"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, default=0)


class OutboxEvent(OutboxMixin, Base):
    __tablename__ = "ex_ordered_outbox"


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: dict[str, list[int]] = defaultdict(list)

    def publish(self, message: Message) -> None:
        with self.lock:
            self.seen[message.aggregate_id].append(message.payload["version"])


def produce(engine: object, account_id: int, times: int) -> None:
    for _ in range(times):
        with Session(engine) as s, s.begin():  # type: ignore[call-overload]
            account = s.get(Account, account_id, with_for_update={"key_share": True})
            account.version += 1
            s.add(OutboxEvent.for_aggregate(account, "BalanceChanged", {"version": account.version}))


def main() -> None:
    with database_url() as url:
        engine = create_engine(url, pool_size=10)
        Base.metadata.create_all(engine)
        try:
            with Session(engine) as s, s.begin():
                s.add_all(Account(id=i, version=0) for i in range(1, 4))
            producers = [threading.Thread(target=produce, args=(engine, 1 + i % 3, 20)) for i in range(6)]
            for p in producers:
                p.start()
            for p in producers:
                p.join()
            recorder = Recorder()
            dispatchers = [
                Dispatcher(engine, OutboxEvent, recorder, ordered=True, batch=5, listen=False)
                for _ in range(3)
            ]
            threads = [threading.Thread(target=d.run, kwargs={"install_signal_handlers": False, "until_idle": True})
                       for d in dispatchers]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            while sum(len(v) for v in recorder.seen.values()) < 120:  # a dispatcher may go idle early
                dispatchers[0].run(install_signal_handlers=False, until_idle=True)
            for account, versions in sorted(recorder.seen.items()):
                in_order = versions == sorted(versions) == list(range(1, len(versions) + 1))
                print(f"account {account}: {len(versions)} events, in commit order: {in_order}")
        finally:
            Base.metadata.drop_all(engine)
            engine.dispose()


if __name__ == "__main__":
    main()
