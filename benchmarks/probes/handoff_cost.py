"""What choosing a waiter and handing off costs the publishing statement.

    python benchmarks/probes/handoff_cost.py [ROUNDS] [BASE_QUERIES_SQL]

The server's side of one publish (statement ``publish`` as the store sends it outside an
application's transaction: gate true), on a dedicated psycopg connection (prepared,
autocommit, synchronous_commit off so that the WAL flush does not drown the rest):
median microseconds per execution of 500, ROUNDS rounds (4) interleaved, in each of
these states of the queue's consumers:

    nobody          nobody waits: no NOTIFY (both versions)
    watcher         a consumer waits but takes no handoffs (transport option handoff
                    False, or an older worker): 'r:' for every consumer
    waiter          a consumer waits and takes handoffs: the row is leased to it and
                    the NOTIFY carries the message ('h:')
    waiters x50     50 consumers wait and take handoffs: one is picked

With BASE_QUERIES_SQL (e.g. the previous release's ``kombu_pgqueue/sql/queries.sql``),
its ``publish`` runs beside, in the same states (it has no handoff: 'r:' when anybody
waits). The consumers are sessions of this process that LISTEN, watch the queue (and
register as waiters) as a worker's listener does, and read what arrives between
rounds. The schema ``probe_handoff`` is dropped first and last.
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

DSN = "host=127.0.0.1 dbname=test user=postgres"
SCHEMA = "probe_handoff"
QUEUE = "probe_handoff_q"


def main() -> None:
    import psycopg
    from psycopg import sql

    from kombu_pgqueue import _sql, migrate
    from kombu_pgqueue._options import notify_channel
    from kombu_pgqueue._store import new_lease
    from kombu_pgqueue.records import Outgoing

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    base = _publish_text(sys.argv[2]) if len(sys.argv) > 2 else None
    channel = notify_channel(SCHEMA)
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
    migrate(DSN, SCHEMA)
    q = _sql.queries(SCHEMA)
    texts: dict[str, Any] = {"handoff": q["publish"]}
    if base is not None:
        texts["base"] = _sql.compose(base, SCHEMA)
    message = Outgoing(
        queue=QUEUE,
        body=b'{"id": 0, "payload": "' + b"x" * 64 + b'"}',
        headers='{"lang": "py", "task": "bench.noop", "id": "0f7e5c1e-0000-4000-8000"}',
        properties='{"correlation_id": "0f7e5c1e", "delivery_mode": 2, "priority": 0}',
        content_type="application/json",
        content_encoding="utf-8",
    )
    params = {
        **message.params(),
        "replace": False,
        "channel": channel,
        "gate": True,
        "handoff": True,
        "lease": new_lease(),
    }
    consumers: list[psycopg.Connection] = []

    def consume(n: int, takes: bool) -> None:
        for c in consumers:
            c.close()
        consumers.clear()
        for _ in range(n):
            c = psycopg.connect(DSN, autocommit=True)
            consumer = os.urandom(8).hex()
            c.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            c.execute(q["listener_alive"], {"consumer": consumer})
            c.execute(
                q["watch"],
                {
                    "channel": channel,
                    "queues": [QUEUE],
                    "takes": [QUEUE] if takes else [],
                    "consumer": consumer,
                    "secret": os.urandom(16).hex(),
                    "lease_seconds": 60.0,
                },
            )
            consumers.append(c)

    states = {"nobody": (0, False), "watcher": (1, False), "waiter": (1, True)}
    states["waiters x50"] = (50, True)
    results: dict[str, list[float]] = collections.defaultdict(list)
    with psycopg.connect(DSN, autocommit=True, prepare_threshold=0) as conn:
        conn.execute("SET synchronous_commit = off")
        conn.execute("SET jit = off")
        for rnd in range(rounds):
            order = list(states.items())
            if rnd % 2:
                order.reverse()
            for state, (n, takes) in order:
                consume(n, takes)
                for name, text in texts.items():
                    for _ in range(50):
                        conn.execute(text, params)
                    samples = []
                    for _ in range(500):
                        began = time.perf_counter()
                        conn.execute(text, params)
                        samples.append(time.perf_counter() - began)
                    results[f"{name:<8} {state}"].append(statistics.median(samples) * 1e6)
                    for c in consumers:
                        for _ in c.notifies(timeout=0):
                            pass
                    conn.execute(
                        sql.SQL("TRUNCATE {}.message_store").format(sql.Identifier(SCHEMA))
                    )
        consume(0, False)
    print(f"median us per publish (client call, prepared), {rounds} rounds [min-max of rounds]")
    for key in sorted(results):
        vals = results[key]
        print(f"  {key:<24} {statistics.median(vals):7.1f}  [{min(vals):.1f}-{max(vals):.1f}]")
    with psycopg.connect(DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))


def _publish_text(path: str) -> str:
    text = open(path, encoding="utf-8").read()
    start = text.index("-- name: publish :one")
    end = text.index("-- name: ", start + 1)
    return text[start:end]


if __name__ == "__main__":
    main()
