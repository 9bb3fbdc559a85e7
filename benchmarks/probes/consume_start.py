"""Kombu consume+ack from one process, as the harness's ``kombu`` group does it, with the
time to the first delivery apart from the rate after it.

    python benchmarks/probes/consume_start.py [N] [--profile FILE] [--detach-next]

Publishes N messages (default 1,000, the harness's ``--quick`` size) to a queue of a
schema of its own, then consumes them with a Kombu Consumer (prefetch 100) through
``Connection.drain_events``, acking each in the callback. Prints the rate over the
whole (what the harness reports), the milliseconds from the consumer's start to the
first delivery, the rate from the first delivery to the last, and the client's CPU per
message. ``--profile FILE`` writes cProfile's statistics of the consuming part;
``--detach-next`` detaches the generation attached ahead (empty until the next
rotation) first, to see what one more partition costs each statement. Run it from a
checkout (``PYTHONPATH=.``), or through ``ab.sh`` to compare revisions:

    bash benchmarks/probes/ab.sh c51ce87 HEAD 5 python benchmarks/probes/consume_start.py 5000
"""

from __future__ import annotations

import argparse
import cProfile
import os
import time
import uuid
from typing import Any

import psycopg
from kombu import Connection, Consumer, Producer, Queue
from psycopg import sql

import kombu_pgqueue  # noqa: F401 - registers pgqueue://

DSN = os.environ.get("PGQUEUE_TEST_DSN", "host=127.0.0.1 dbname=test user=postgres")
URL = "pgqueue://postgres@127.0.0.1/test"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("n", type=int, nargs="?", default=1000)
    parser.add_argument("--profile")
    parser.add_argument("--detach-next", action="store_true")
    args = parser.parse_args()
    n = args.n
    schema = "probe_cs_" + uuid.uuid4().hex[:8]
    try:
        with Connection(URL, transport_options={"schema": schema}) as conn:
            consume(conn, schema, n, args.profile, args.detach_next)
    finally:
        with psycopg.connect(DSN, autocommit=True) as pg:
            pg.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def consume(conn: Connection, schema: str, n: int, profile: str | None, detach: bool) -> None:
    channel = conn.channel()
    queue = Queue("cs", routing_key="cs")
    bound = queue(channel)
    bound.declare()
    if detach:
        with psycopg.connect(DSN, autocommit=True) as pg:
            pg.execute(
                sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(
                    sql.Identifier(schema, "message_store"),
                    sql.Identifier(schema, "message_store_2"),
                )
            )
    producer = Producer(channel, serializer="json")
    for i in range(100):  # warm: connections, prepared statements
        producer.publish({"i": i}, routing_key="cs")
    bound.purge()
    for i in range(n):
        producer.publish({"id": i, "payload": "x" * 100}, routing_key="cs")
    got = 0
    first = last = 0.0

    def on_message(body: Any, message: Any) -> None:
        nonlocal got, first, last
        message.ack()
        got += 1
        last = time.perf_counter()
        if got == 1:
            first = last

    consumer = Consumer(channel, [queue], callbacks=[on_message], prefetch_count=100)
    profiler = cProfile.Profile() if profile else None
    t0, cpu0 = time.perf_counter(), time.process_time()
    if profiler:
        profiler.enable()
    with consumer:
        while got < n:
            try:
                conn.drain_events(timeout=2)
            except TimeoutError:
                pass
    if profiler:
        profiler.disable()
        profiler.dump_stats(profile)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    steady = (n - 1) / (last - first) if n > 1 and last > first else 0.0
    print(
        f"n={n} rate={n / elapsed:.0f}/s first={1000 * (first - t0):.1f}ms "
        f"after_first={steady:.0f}/s client_cpu={1e6 * cpu / n:.1f}us/msg"
    )
    time.sleep(0.3)  # the last acks' batch goes out before the schema is dropped


if __name__ == "__main__":
    main()
