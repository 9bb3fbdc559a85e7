"""The ``kombu`` group: Producer.publish and consume+ack rates from one process."""

from __future__ import annotations

import time
from typing import Any

import psycopg
from kombu import Connection, Consumer, Producer, Queue

from .config import SMALL_BODY, Ctx
from .peers import Broker


def bench_kombu(ctx: Ctx, broker: Broker, run: int) -> dict[str, float]:
    n, cap = ctx.sizes["kombu_n"], ctx.sizes["kombu_cap"]
    name = ctx.queue(broker, f"k{run}")
    out: dict[str, float] = {}
    with Connection(broker.url, transport_options=broker.options) as conn:
        ch = conn.channel()
        queue = Queue(name, routing_key=name)  # default exchange: straight to the queue
        bound = queue(ch)
        bound.declare()
        bound.purge()
        producer = Producer(ch, serializer="json")
        for _ in range(100):  # warm-up: connection, pooled connections, prepared statements
            producer.publish(SMALL_BODY, routing_key=name)
        bound.purge()
        published = 0
        t0 = time.perf_counter()
        for i in range(n):
            producer.publish({"id": i, "payload": SMALL_BODY["payload"]}, routing_key=name)
            published += 1
            if i % 100 == 99 and time.perf_counter() - t0 > cap:
                break
        out["kombu_publish"] = published / (time.perf_counter() - t0)
        if published < n:
            ctx.notes.append(
                f"{broker.name}: kombu publish stopped at the {cap:.0f}s cap "
                f"after {published} of {n} messages"
            )
        got = 0

        def on_message(body: Any, message: Any) -> None:
            nonlocal got
            message.ack()
            got += 1

        consumer = Consumer(
            ch, [queue], callbacks=[on_message], prefetch_count=100, accept=["json"]
        )
        deadline = time.monotonic() + ctx.sizes["consume_cap"]
        t0 = time.perf_counter()
        with consumer:
            while got < published and time.monotonic() < deadline:
                try:
                    conn.drain_events(timeout=2)
                except TimeoutError:
                    pass
                except OSError as exc:
                    if "timed out" not in str(exc):
                        raise
        elapsed = time.perf_counter() - t0
        if got:
            out["kombu_consume"] = got / elapsed
        if got < published:
            ctx.notes.append(
                f"{broker.name}: kombu consume stopped at the {ctx.sizes['consume_cap']:.0f}s "
                f"cap after {got} of {published} messages"
            )
        try:
            left = bound.queue_declare(passive=True).message_count
        except Exception:  # noqa: BLE001 - Redis forgets an empty queue
            left = 0
        if left != published - got:
            ctx.problem(
                broker.name,
                "kombu_consume",
                f"{left} messages left after consuming {got} of {published}",
            )
        if broker.name.startswith("pgqueue"):
            # every acked message must be gone from the table, not merely invisible
            time.sleep(0.2)
            with psycopg.connect(ctx.settings.dsn, autocommit=True) as pg:
                rows = pg.execute(
                    psycopg.sql.SQL(
                        "SELECT count(*) FROM {}.message_store"
                        " WHERE queue = %s AND lease IS NOT NULL"
                    ).format(psycopg.sql.Identifier(broker.options["schema"])),
                    (name,),
                ).fetchone()[0]
            if rows:
                ctx.problem(
                    broker.name,
                    "kombu_consume",
                    f"{rows} delivered+acked messages are still in the table",
                )
        bound.delete()
    return out
