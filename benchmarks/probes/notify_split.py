"""What the NOTIFY in a durable publish costs many publishers, and two ways around it.

    python benchmarks/probes/notify_split.py [SECONDS] [ROUNDS]

PostgreSQL takes a cluster-wide lock when a transaction that notified commits and keeps
it until the commit is over, WAL flush included, so publishes that notify commit one at
a time: the server cannot flush many of them together (group commit). 8 publisher
processes run pgqueue's ``publish`` statement (raw psycopg, prepared, autocommit, one
~90-byte message each) for SECONDS (5) per window, ROUNDS (3) times, the variants
interleaved, on a throwaway cluster (``listeners.cluster``) with 1 and with 200 sessions
listening on the channel:

* ``shipped``: the statement as in queries.sql (``pg_notify`` in the durable transaction)
* ``no notify``: the statement without ``pg_notify`` (nobody is woken)
* ``split``: the statement without ``pg_notify``, then, pipelined in the same round trip
  after a Sync, ``SELECT set_config('synchronous_commit', 'off', true), pg_notify(...)``:
  the message is durable before the wakeup is sent, and the notifying transaction does
  not wait for its flush while it holds the lock (a crash can lose the wakeup, not the
  message; the consumers' safety poll covers a lost wakeup already)

Prints msg/s of each variant (median [min-max]) and server CPU per publish.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PROCS = 8
VARIANTS = ("shipped", "no notify", "split")
SCHEMA = "probe_ns"
QUEUE = "probe_ns_q"


def _publisher(dsn: str, variant: str, seconds: float, barrier: Any, out: Any) -> None:
    import psycopg

    from benchmarks.scale import without_notify
    from kombu_pgqueue import _sql
    from kombu_pgqueue._listener import legacy_token
    from kombu_pgqueue._options import notify_channel
    from kombu_pgqueue.records import Outgoing

    raw = _sql.raw_queries()["publish"]
    text = raw if variant == "shipped" else without_notify(raw)
    query = _sql.compose(text, SCHEMA)
    wake = "SELECT set_config('synchronous_commit', 'off', true), pg_notify(%s, %s)"
    channel = notify_channel(SCHEMA)
    payload = "r:" + legacy_token(QUEUE)
    message = Outgoing(
        queue=QUEUE,
        body=b'{"id": 0, "payload": "' + b"x" * 64 + b'"}',
        headers="{}",
        properties="{}",
        content_type="application/json",
        content_encoding="utf-8",
    )
    # what Store.publish and publish_routed send, with gate false: the statement always
    # notifies (as inside an application's transaction), whether a consumer waits or not
    params = {
        **message.params(),
        "replace": False,
        "channel": channel,
        "gate": False,
    }
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn:

        def publish() -> None:
            if variant == "split":
                with conn.pipeline() as p:
                    conn.execute(query, params)
                    p.sync()
                    conn.execute(wake, (channel, payload))
            else:
                conn.execute(query, params)

        for _ in range(20):
            publish()
        barrier.wait()
        began = time.time()
        deadline = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < deadline:
            publish()
            n += 1
        out.put((n, began, time.time()))


def window(dsn: str, variant: str, seconds: float) -> float:
    spawn = mp.get_context("spawn")
    barrier, out = spawn.Barrier(PROCS), spawn.Queue()
    procs = [
        spawn.Process(target=_publisher, args=(dsn, variant, seconds, barrier, out))
        for _ in range(PROCS)
    ]
    for p in procs:
        p.start()
    done = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(10)
    return sum(d[0] for d in done) / (max(d[2] for d in done) - min(d[1] for d in done))


def main() -> None:
    import psycopg
    from kombu import Connection, Queue

    import kombu_pgqueue  # noqa: F401 - registers pgqueue://
    from benchmarks.listeners import Listeners, cluster, server_cpu
    from kombu_pgqueue._options import notify_channel

    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    found: dict[tuple[int, str], list[tuple[float, float]]] = {}
    with cluster() as c:
        url = f"pgqueue://postgres@127.0.0.1:{c.port}/postgres"
        with Connection(url, transport_options={"schema": SCHEMA}) as kc:
            Queue(QUEUE, routing_key=QUEUE)(kc.channel()).declare()
        lst = Listeners(c.dsn, notify_channel(SCHEMA))
        try:
            for listening in (1, 200):
                lst.resize(listening)
                for r in range(rounds):
                    order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
                    for variant in order:
                        with psycopg.connect(c.dsn, autocommit=True) as conn:
                            conn.execute(f"TRUNCATE {SCHEMA}.message")
                            conn.execute("CHECKPOINT")
                        cpu0 = server_cpu(str(c.datadir))
                        rate = window(c.dsn, variant, seconds)
                        cpu = server_cpu(str(c.datadir)) - cpu0
                        us = cpu / (rate * seconds) * 1e6
                        found.setdefault((listening, variant), []).append((rate, us))
                        print(
                            f"{listening:3d} listening, {variant:9s}: {rate:7.0f} msg/s, "
                            f"server {us:5.0f} us per publish",
                            flush=True,
                        )
        finally:
            lst.close()
    print(f"\n{PROCS} publishers, {seconds:g} s windows, {rounds} rounds: median [min-max]")
    for (listening, variant), vals in found.items():
        rates = [v[0] for v in vals]
        cpus = [v[1] for v in vals]
        print(
            f"  {listening:3d} listening, {variant:9s}: {statistics.median(rates):7.0f} msg/s "
            f"[{min(rates):.0f}-{max(rates):.0f}], server {statistics.median(cpus):5.0f} us"
        )


if __name__ == "__main__":
    main()
