"""What the idle worker's inline claim costs, taken apart: one message per claim, after
20 ms idle (as on the idle prefork worker) and back to back.

    python benchmarks/probes/claim_rtt.py [N]

Alternates, N (200) times each: ``SELECT 1`` on a pooled connection (the round trip and
the backend's wakeup alone); ``Store.run_claim`` of one ready message with the consumer's
relaxed commit (synchronous_commit off, as shipped) and with a durable commit
(``relax_consumer_commits: false``); and ``run_claim`` on an empty queue. Each message
is published (and acked after its claim) outside the timed call. PGQUEUE_BENCH_DSN names
the database (``own_cluster.py`` sets it).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from kombu import Connection
from psycopg.conninfo import conninfo_to_dict

from kombu_pgqueue._options import parse_options
from kombu_pgqueue._store import Store, new_lease

DSN = os.environ.get("PGQUEUE_BENCH_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=test")
SCHEMA, QUEUE = "probe_claim_rtt", "probe_claim_rtt"


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    c = conninfo_to_dict(DSN)
    url = f"pgqueue://{c.get('user', 'postgres')}@{c.get('host', '127.0.0.1')}:"
    url += f"{c.get('port', 5432)}/{c.get('dbname', 'test')}"
    import psycopg

    with psycopg.connect(DSN, autocommit=True) as admin:
        admin.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
    conn = Connection(url, transport_options={"schema": SCHEMA})
    q = conn.SimpleQueue(QUEUE)
    q.put({"x": 1})
    q.get(timeout=5).ack()
    relaxed = Store(DSN, parse_options({"schema": SCHEMA}))
    durable = Store(DSN, parse_options({"schema": SCHEMA, "relax_consumer_commits": False}))

    def select1(store: Store) -> None:
        with store.pool.connection() as pc:
            pc.execute("SELECT 1").fetchall()

    acks: list[tuple[Store, int, int]] = []

    def claim(store: Store, publish: bool) -> None:
        request = store.claim_request(QUEUE, 8, new_lease())
        result = store.run_claim(request)
        acks.extend((store, row.id, request.lease) for row in result.rows)
        assert bool(result.rows) == publish, result

    cases = {
        "SELECT 1": (lambda: select1(relaxed), False),
        "claim 1, relaxed commit": (lambda: claim(relaxed, True), True),
        "claim 1, durable commit": (lambda: claim(durable, True), True),
        "claim, empty queue": (lambda: claim(relaxed, False), False),
    }
    times: dict[tuple[str, float], list[float]] = {}
    for gap in (0.02, 0.0):
        for _ in range(n):
            for name, (call, publish) in cases.items():
                if publish:
                    q.put({"x": 1})
                time.sleep(gap if gap else 0.0005)
                began = time.perf_counter()
                call()
                times.setdefault((name, gap), []).append((time.perf_counter() - began) * 1e3)
                for store, id_, lease in acks:  # outside the timed call
                    store.ack(id_, lease)
                acks.clear()
    print(f"# {n} each, load {os.getloadavg()}, {DSN}")
    print("| call | after 20 ms idle p50 [p95] | back to back p50 [p95] |")
    print("|---|---|---|")
    for name in cases:
        cells = []
        for gap in (0.02, 0.0):
            v = sorted(times[(name, gap)])
            cells.append(f"{statistics.median(v):.3f} [{v[int(len(v) * 0.95)]:.3f}]")
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    q.close()
    conn.release()


if __name__ == "__main__":
    main()
