"""Publish outbox events to NATS JetStream with ``Nats-Msg-Id`` = outbox id, so the stream drops a
re-publish inside its duplicate window. Needs nats-server -js on 127.0.0.1:4222 and ``sa-outbox[nats]``."""

from __future__ import annotations

import asyncio
import os

import nats
from sqlalchemy import create_engine
from sqlalchemy.orm import DeclarativeBase, Session

from sa_outbox import Dispatcher, OutboxMixin
from sa_outbox.embedded import database_url
from sa_outbox.publishers.nats import NatsPublisher
from sa_outbox.testing import drain

NATS = os.environ.get("NATS_URL", "nats://127.0.0.1:4222")


class Base(DeclarativeBase):
    pass


class OutboxEvent(OutboxMixin, Base):
    __tablename__ = "ex_nats_outbox"


async def stream(action: str) -> list[str]:
    nc = await nats.connect(NATS)
    js = nc.jetstream()
    out: list[str] = []
    if action == "create":
        await js.add_stream(name="EXORDERS", subjects=["exorders.>"], duplicate_window=120)
    elif action == "read":
        info = await js.stream_info("EXORDERS")
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg("EXORDERS", seq)
            out.append(f"{msg.subject} Nats-Msg-Id={msg.headers['Nats-Msg-Id']}")
    else:
        await js.delete_stream("EXORDERS")
    await nc.close()
    return out


def main() -> None:
    asyncio.run(stream("create"))
    with database_url() as url:
        engine = create_engine(url)
        Base.metadata.create_all(engine)
        publisher = NatsPublisher(NATS, subject_prefix="exorders")
        try:
            with Session(engine) as s, s.begin():
                for n in range(3):
                    s.add(
                        OutboxEvent(
                            aggregate_type="order", aggregate_id=str(n), event_type="paid", payload={"n": n}
                        )
                    )
            seen = []

            class Keep:
                def publish(self, m: object) -> None:
                    seen.append(m)
                    publisher.publish(m)  # type: ignore[arg-type]

            drain(Dispatcher(engine, OutboxEvent, Keep(), listen=False))
            publisher.publish(seen[0])  # a re-publish after a lost lease: the stream drops it
            for line in asyncio.run(stream("read")):
                print(line)
        finally:
            publisher.close()
            Base.metadata.drop_all(engine)
            engine.dispose()
            asyncio.run(stream("delete"))


if __name__ == "__main__":
    main()
