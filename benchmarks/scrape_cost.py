"""What one metrics scrape costs on a big message table (not a test: run it by hand).

    python benchmarks/scrape_cost.py --dsn 'host=127.0.0.1 dbname=test user=postgres' \\
        --rows 10000000 [--queues 500] [--keep]

Loads ``--rows`` messages into a throwaway schema (70 % ready in 'celery' at three
priorities with 100 leased, 20 % ready in 'emails', 10 % delayed in 'reports', dead
letters 2 % of the rows), plus ``--queues`` small queues of 20 messages, VACUUM ANALYZE,
then times full scrapes (both monitoring statements and the Prometheus text), the full
scan that ``celery pgqueue queues`` does, and prints ``EXPLAIN (ANALYZE, BUFFERS)`` of
``queue_depths``. 10 million rows take about 3 GB and two minutes to load. The schema is
dropped at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import psycopg
from prometheus_client import CollectorRegistry, generate_latest
from psycopg import sql

from celery_pgqueue.metrics import PgQueueCollector
from kombu_pgqueue import migrate
from kombu_pgqueue._monitor import Monitor
from kombu_pgqueue._options import parse_options
from kombu_pgqueue._sql import queries
from kombu_pgqueue._store import Store

BATCH = 1_000_000
MESSAGES = sql.SQL(
    "INSERT INTO {s}.message_store (queue, priority, delayed, next_iteration, created_at, body, "
    "headers, properties) "
    "SELECT %(queue)s, (i %% 3) * 4 * %(prioritised)s::int, %(delayed)s, "
    "CASE WHEN %(delayed)s THEN now() + interval '1 hour' ELSE now() END, "
    "now() - make_interval(secs => (%(n)s::bigint - i) / 1000.0), "
    "convert_to(repeat('x', 120), 'UTF8'), '{{\"task\": \"t\", \"id\": \"abc\"}}', '{{}}' "
    "FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i"
)
LEASED = sql.SQL(
    "UPDATE {s}.message_store"
    " SET lease = 42, attempts = 1, next_iteration = now() + interval '1 h' "
    "WHERE id IN (SELECT id FROM {s}.message_store WHERE queue = 'celery' AND NOT delayed "
    "ORDER BY priority DESC, id LIMIT 100)"
)
SMALL = sql.SQL(
    "INSERT INTO {s}.message_store (queue, priority, body, headers, properties) "
    "SELECT 'small_' || (i %% %(queues)s::int), i %% 3, 'x', '{{}}', '{{}}' "
    "FROM generate_series(1, %(queues)s::int * 20) AS i"
)
DEAD = sql.SQL(
    "INSERT INTO {s}.dead_letter (id, queue, priority, attempts, reason, created_at, body, "
    "headers, properties) "
    "SELECT -i, CASE WHEN i %% 1000 = 0 THEN 'emails' ELSE 'celery' END, 0, 5, "
    "'max_attempts', now(), 'x', '{{}}', '{{}}' FROM generate_series(1, %(n)s::int) AS i"
)


def load(conn: psycopg.Connection, schema: str, rows: int, queues: int) -> None:
    s = sql.Identifier(schema)
    started = time.perf_counter()
    parts = [("celery", 0.7, False, 1), ("emails", 0.2, False, 0), ("reports", 0.1, True, 0)]
    for queue, share, delayed, prioritised in parts:
        n = int(rows * share)
        for first in range(0, n, BATCH):
            params = {"queue": queue, "delayed": delayed, "prioritised": prioritised, "n": n}
            conn.execute(
                MESSAGES.format(s=s), {**params, "first": first, "last": min(n, first + BATCH) - 1}
            )
            print(
                f"  {queue}: {min(n, first + BATCH):,} rows, {time.perf_counter() - started:.0f} s"
            )
    conn.execute(LEASED.format(s=s))
    if queues:
        conn.execute(SMALL.format(s=s), {"queues": queues})
    conn.execute(DEAD.format(s=s), {"n": max(rows // 50, 10)})
    conn.execute(sql.SQL("VACUUM ANALYZE {}.message_store").format(s))
    conn.execute(sql.SQL("VACUUM ANALYZE {}.dead_letter").format(s))
    size = conn.execute(
        "SELECT pg_size_pretty(pg_total_relation_size(%s::regclass))",
        (f'"{schema}".message_store',),
    ).fetchone()
    print(f"loaded in {time.perf_counter() - started:.0f} s; message table {size[0]}")


def measure(dsn: str, schema: str, conn: psycopg.Connection) -> None:
    monitor = Monitor(Store(dsn, parse_options({"schema": schema, "auto_migrate": False})))
    took = []
    for _ in range(11):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(PgQueueCollector(monitor, min_interval=0))
        started = time.perf_counter()
        generate_latest(registry)
        took.append((time.perf_counter() - started) * 1000)
    print(
        f"one scrape: first {took[0]:.0f} ms (opens the pool), then median "
        f"{statistics.median(took[1:]):.0f} ms, max {max(took[1:]):.0f} ms"
    )
    for depth in monitor.queue_depths()[:4]:
        print(f"  {depth}")
    started = time.perf_counter()
    Store(dsn, parse_options({"schema": schema})).queue_stats()
    print(
        f"for comparison, queue_stats (full scan): {(time.perf_counter() - started) * 1000:.0f} ms"
    )
    explain = sql.SQL("EXPLAIN (ANALYZE, BUFFERS) ") + queries(schema)["queue_depths"]
    params = {"schema": schema, "cap": monitor.cap, "now": None}
    print("\n".join(row[0] for row in conn.execute(explain, params)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dsn", default="host=127.0.0.1 dbname=test user=postgres")
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--queues", type=int, default=0, help="small queues to add")
    parser.add_argument("--schema", default="pgqueue_scrape_cost")
    parser.add_argument("--keep", action="store_true", help="keep the schema afterwards")
    args = parser.parse_args()
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        drop = sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(args.schema))
        conn.execute(drop)
        try:
            migrate(conn, args.schema)
            load(conn, args.schema, args.rows, args.queues)
            measure(args.dsn, args.schema, conn)
        finally:
            if not args.keep:
                conn.execute(drop)


if __name__ == "__main__":
    main()
